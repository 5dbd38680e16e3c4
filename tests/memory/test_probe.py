"""Memory probes and the classification of out-of-memory and fatal CUDA errors."""

from __future__ import annotations

import pytest
import torch

from hf_triaccel.memory import probe as probe_module
from hf_triaccel.memory.probe import (
    CudaMemoryProbe,
    MemorySnapshot,
    NullProbe,
    default_probe,
    is_fatal_cuda_error,
    is_oom,
)
from hf_triaccel.memory.retry import ElasticBatchError

OOMS = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
    torch.cuda.OutOfMemoryError("anything: the type decides"),
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)"),
    RuntimeError("CUDA error: out of memory"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
]
FATAL = [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("CUDA error: misaligned address"),
    RuntimeError("CUDA error: unspecified launch failure"),
    torch.AcceleratorError("CUDA error: an illegal instruction was encountered"),
]
NEITHER = [
    ValueError("out of memory"),  # not a runtime error: a message alone does not make an OOM
    RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
    KeyError("labels"),
    ElasticBatchError("out of memory (CUDA out of memory.) at micro-batch 1"),
]


@pytest.mark.parametrize("exc", OOMS, ids=str)
def test_oom_recognised(exc):
    assert is_oom(exc) and not is_fatal_cuda_error(exc)


@pytest.mark.parametrize("exc", FATAL, ids=str)
def test_fatal_recognised(exc):
    assert is_fatal_cuda_error(exc) and not is_oom(exc)


@pytest.mark.parametrize("exc", NEITHER, ids=str)
def test_neither(exc):
    assert not is_oom(exc) and not is_fatal_cuda_error(exc)


def test_oom_found_through_cause():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("forward of layer 3 failed") from inner
    except RuntimeError as outer:
        assert is_oom(outer)


def test_snapshot_available():
    assert MemorySnapshot(free=10, total=100, reserved=30, allocated=20).available == 40
    assert MemorySnapshot(free=10, total=100, reserved=30, allocated=20, budget=35).available == 35


def test_null_probe():
    probe = NullProbe()
    assert not probe.measures and probe.snapshot() is None and probe.peak() is None
    probe.reset_peak()
    probe.release()
    assert isinstance(default_probe("cpu"), NullProbe)


class FakeCuda:
    """The torch.cuda calls CudaMemoryProbe makes, with settable values."""

    def __init__(self) -> None:
        self.fraction = 1.0
        self.peak = 0
        self.emptied = 0

    def install(self, monkeypatch) -> None:
        cuda = probe_module.torch.cuda
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device: (6 * 2**30, 80 * 2**30))
        monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda device: self.fraction)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device: 30 * 2**30)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device: 20 * 2**30)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device: self.peak)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device: self._reset())
        monkeypatch.setattr(cuda, "empty_cache", self._empty)

    def _reset(self) -> None:
        self.peak = 0

    def _empty(self) -> None:
        self.emptied += 1


def test_cuda_probe_reads_the_allocator(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    probe = CudaMemoryProbe()
    assert probe.device == torch.device("cuda", 0)
    snap = probe.snapshot()
    assert (snap.free, snap.total, snap.reserved, snap.allocated) == (
        6 * 2**30,
        80 * 2**30,
        30 * 2**30,
        20 * 2**30,
    )
    assert snap.budget is None and snap.available == 36 * 2**30
    fake.fraction = 0.25  # torch.cuda.set_per_process_memory_fraction(0.25)
    assert probe.snapshot().budget == 20 * 2**30
    assert probe.snapshot().available == 20 * 2**30

    fake.peak = 50
    probe.reset_peak()
    fake.peak = 20
    assert probe.peak() == 20 and probe.overall_peak == 50
    probe.reset_overall_peak()
    assert probe.overall_peak == 0
    probe.release()
    assert fake.emptied == 1
