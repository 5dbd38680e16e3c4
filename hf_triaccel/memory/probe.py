"""Live device memory: what the device can give this process, peaks, and error classes.

A :class:`MemoryProbe` answers three questions for the elastic batch controller: how
much memory this process could occupy right now (:meth:`MemoryProbe.snapshot`), how
high allocation went since a mark (:meth:`MemoryProbe.reset_peak` /
:meth:`MemoryProbe.peak`), and how to hand cached blocks back after an out-of-memory
error (:meth:`MemoryProbe.release`). :class:`CudaMemoryProbe` reads the CUDA caching
allocator; :class:`NullProbe` (CPU) measures nothing; tests pass their own.

:func:`is_oom` and :func:`is_fatal_cuda_error` sort exceptions into "a smaller batch
may fit" and "the CUDA context is broken, never retry".
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

# Message fragments of out-of-memory errors that do not arrive as torch.OutOfMemoryError:
# raw cudaMalloc failures outside the caching allocator (cuBLAS / cuDNN workspaces,
# NCCL buffers) and the CPU allocator.
_OOM_MESSAGES = (
    "out of memory",  # CUDA, MPS and XPU allocators; cudaErrorMemoryAllocation
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "can't allocate memory",  # DefaultCPUAllocator
)

# Errors after which the CUDA context is unusable ("sticky" errors): every later call
# fails too, so retrying only hides the first, informative error.
_FATAL_MESSAGES = (
    "illegal memory access",
    "device-side assert",
    "misaligned address",
    "unspecified launch failure",
    "illegal instruction",
    "uncorrectable ecc error",
    "hardware stack error",
    "invalid program counter",
)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (a wrapper may carry the OOM)."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__
    return seen


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA error that leaves the context unusable.

    Illegal memory accesses, device-side asserts and similar sticky errors are never
    worth a retry: every later CUDA call fails with the same error.

    Example:
        >>> is_fatal_cuda_error(RuntimeError("CUDA error: an illegal memory access"))
        True
        >>> is_fatal_cuda_error(torch.OutOfMemoryError("CUDA out of memory."))
        False
    """
    for e in _chain(exc):
        if isinstance(e, torch.OutOfMemoryError):
            return False
        if isinstance(e, RuntimeError):
            text = str(e).lower()
            if any(m in text for m in _FATAL_MESSAGES):
                return True
    return False


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error that a smaller batch may avoid.

    Recognised by type first (``torch.OutOfMemoryError``, which is also
    ``torch.cuda.OutOfMemoryError``), by message second (allocation failures that
    surface as plain ``RuntimeError``). A fatal CUDA error is never an OOM.

    Example:
        >>> is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_oom(RuntimeError("CUDA error: out of memory"))
        True
        >>> is_oom(ValueError("out of memory"))
        False
    """
    if is_fatal_cuda_error(exc):
        return False
    for e in _chain(exc):
        if isinstance(e, torch.OutOfMemoryError):
            return True
        if isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _OOM_MESSAGES):
            return True
    return False


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory of one device at one moment, in bytes.

    Attributes:
        free: free on the device, whoever holds the rest (other processes included).
        total: the device's capacity.
        reserved: held by this process's caching allocator (allocated + cached).
        allocated: in live tensors of this process.
        budget: this process's cap (``set_per_process_memory_fraction`` x total), or
            ``None`` when no cap is set.
    """

    free: int
    total: int
    reserved: int
    allocated: int
    budget: int | None = None

    @property
    def available(self) -> int:
        """The most this process can hold now: what it holds plus what is free,
        within its budget.

        Example:
            >>> MemorySnapshot(free=4, total=16, reserved=8, allocated=6).available
            12
            >>> MemorySnapshot(free=4, total=16, reserved=8, allocated=6, budget=10).available
            10
        """
        reachable = self.reserved + self.free
        return reachable if self.budget is None else min(reachable, self.budget)


@runtime_checkable
class MemoryProbe(Protocol):
    """What the elastic batch controller reads from a device.

    ``measures`` is ``False`` for probes that cannot report (CPU): the controller then
    sizes micro-batches from out-of-memory errors alone.
    """

    measures: bool

    def snapshot(self) -> MemorySnapshot | None:
        """Current memory, or ``None`` when unknown."""
        ...

    def reset_peak(self) -> None:
        """Starts a new peak window."""
        ...

    def peak(self) -> int | None:
        """Highest allocation (bytes) since :meth:`reset_peak`, or ``None``."""
        ...

    def release(self) -> None:
        """Frees what an out-of-memory error left behind (garbage, cached blocks)."""
        ...


class NullProbe:
    """A probe that measures nothing (CPU, or sizing from OOM errors only).

    Example:
        >>> NullProbe().snapshot() is None
        True
    """

    measures = False

    def snapshot(self) -> MemorySnapshot | None:
        return None

    def reset_peak(self) -> None:
        pass

    def peak(self) -> int | None:
        return None

    def release(self) -> None:
        gc.collect()


class CudaMemoryProbe:
    """Reads one CUDA device through the caching allocator.

    Every call is a host-side query (allocator counters, ``cudaMemGetInfo``): none
    waits for the device. Peaks are tracked with the allocator's peak counter, which
    is global, so :meth:`reset_peak` keeps the highest value seen in
    :attr:`overall_peak` for reports that want the whole run's peak.

    Args:
        device: the CUDA device (default: the current one).

    Example:
        >>> probe = CudaMemoryProbe()  # doctest: +SKIP
        >>> probe.snapshot().available / 2**30  # doctest: +SKIP
        131.2
    """

    measures = True

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        if isinstance(device, int):
            device = torch.device("cuda", device)
        device = torch.device("cuda" if device is None else device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._overall_peak = 0

    def snapshot(self) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(self.device)
        # the getter is recent (older torch has only the setter): no budget known there
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = get_fraction(self.device) if get_fraction is not None else 1.0
        return MemorySnapshot(
            free=int(free),
            total=int(total),
            reserved=int(torch.cuda.memory_reserved(self.device)),
            allocated=int(torch.cuda.memory_allocated(self.device)),
            budget=int(fraction * total) if fraction < 1.0 else None,
        )

    def reset_peak(self) -> None:
        self._overall_peak = self.overall_peak
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    @property
    def overall_peak(self) -> int:
        """Highest allocation since the probe was made (or :meth:`reset_overall_peak`),
        across :meth:`reset_peak` calls."""
        return max(self._overall_peak, self.peak())

    def reset_overall_peak(self) -> None:
        """Starts :attr:`overall_peak` over (e.g. at the start of training)."""
        self._overall_peak = 0
        torch.cuda.reset_peak_memory_stats(self.device)

    def release(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()


def default_probe(device: torch.device | str | None = None) -> MemoryProbe:
    """The probe for ``device``: :class:`CudaMemoryProbe` for CUDA, else :class:`NullProbe`.

    Example:
        >>> type(default_probe("cpu")).__name__
        'NullProbe'
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaMemoryProbe(device)
    return NullProbe()
