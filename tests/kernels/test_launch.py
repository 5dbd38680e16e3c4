"""Launching compiled kernels again: the parameters' layout, the packed buffer a driver
launch hands ``cuLaunchKernel`` (CPU, with a stand-in driver), and on the GPU the same
sums by the driver as by Triton's launcher, bit for bit."""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace

import pytest
import torch

from hf_triaccel.kernels import grouped, launch, stats

SIGNATURE = {
    "x_ptr": "*bf16",
    "n": "i32",
    "BLOCK": "constexpr",
    "scale": "fp32",
    "offset": "i64",
    "flag": "i1",
}


def test_layout_skips_constexprs_and_pads_to_the_driver_offsets():
    params = [(0, 8), (8, 4), (12, 4), (16, 8), (24, 1), (32, 8), (40, 8)]
    fmt, positions = launch.parameter_layout(SIGNATURE, params)
    assert positions == [0, 1, 3, 4, 5]
    assert struct.calcsize(fmt) == 48
    packed = struct.pack(fmt, 0x1234, -7, 0.5, 2**40, 1)
    assert struct.unpack_from("<Q", packed, 0)[0] == 0x1234
    assert struct.unpack_from("<i", packed, 8)[0] == -7
    assert struct.unpack_from("<f", packed, 12)[0] == 0.5
    assert struct.unpack_from("<q", packed, 16)[0] == 2**40
    assert packed[24] == 1
    assert packed[32:] == bytes(16)  # the two pointers Triton adds: null


@pytest.mark.parametrize(
    "signature, params",
    [
        (SIGNATURE, [(0, 8), (8, 8), (16, 4), (24, 8), (32, 1)]),  # n is not 4 bytes
        (SIGNATURE, [(0, 8), (8, 4), (12, 4), (16, 8)]),  # fewer parameters than arguments
        (SIGNATURE, [(0, 8), (4, 4), (12, 4), (16, 8), (24, 1)]),  # overlapping offsets
        ({"x": "*fp32", "s": "fp16"}, [(0, 8), (8, 2)]),  # a half-precision scalar
        ({"d": "tensordesc<bf16[64]>"}, [(0, 128)]),
    ],
)
def test_layout_refuses_what_it_cannot_pack(signature, params):
    assert launch.parameter_layout(signature, params) is None


class FakeDriver:
    """``cuLaunchKernel`` and ``cuFuncGetParamInfo`` as ctypes would call them: the
    launch keeps the parameters it was handed, read through their pointers."""

    def __init__(self, params: list[tuple[int, int]]) -> None:
        self.params = params
        self.launches: list[tuple] = []

    def param_info(self, function, index, offset, size) -> int:
        if index >= len(self.params):
            return 1  # CUDA_ERROR_INVALID_VALUE
        offset._obj.value, size._obj.value = self.params[index]
        return 0

    def launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
        read = [ctypes.string_at(params[i], size) for i, (_, size) in enumerate(self.params)]
        self.launches.append((function, (gx, gy, gz), (bx, by, bz), shared, stream, read))
        return 0


def fake_compiled(**meta) -> SimpleNamespace:
    metadata = SimpleNamespace(num_warps=4, shared=1024, **meta)
    return SimpleNamespace(function=99, metadata=metadata, src=SimpleNamespace(signature=SIGNATURE))


@pytest.fixture
def fake_driver(monkeypatch):
    driver = FakeDriver([(0, 8), (8, 4), (12, 4), (16, 8), (24, 1), (32, 8)])
    monkeypatch.setattr(launch, "_driver", lambda: (driver.launch, driver.param_info))
    knobs = SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=None))
    monkeypatch.setattr(launch, "_direct_launch", lambda: (knobs, lambda device: 5, lambda: 0))
    return driver


def test_driver_launch_hands_the_packed_arguments_to_the_driver(fake_driver):
    driver_launch = launch.DriverLaunch.of(fake_compiled())
    assert isinstance(driver_launch, launch.DriverLaunch)
    driver_launch((3, 2), [0xABC0, 9, 128, 0.25, -3, True])
    driver_launch((7,), [0xDEF0, 1, 128, 2.0, 5, False])
    first, second = fake_driver.launches
    assert first[:5] == (99, (3, 2, 1), (128, 1, 1), 1024, 5)
    assert second[1] == (7, 1, 1)
    x, n, scale, offset, flag, scratch = second[5]
    assert struct.unpack("<Q", x)[0] == 0xDEF0 and struct.unpack("<i", n)[0] == 1
    assert struct.unpack("<f", scale)[0] == 2.0 and struct.unpack("<q", offset)[0] == 5
    assert flag == b"\x00" and scratch == bytes(8)


@pytest.mark.parametrize(
    "meta", [{"num_ctas": 2}, {"launch_cooperative_grid": True}, {"global_scratch_size": 64}]
)
def test_launches_the_driver_cannot_make_go_through_triton(fake_driver, meta):
    assert launch.DriverLaunch.of(fake_compiled(**meta)) is None


def test_no_driver_launch_without_the_driver(monkeypatch):
    monkeypatch.setattr(launch, "_driver", lambda: None)
    assert launch.DriverLaunch.of(fake_compiled()) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_driver_launches_give_tritons_sums_bit_for_bit(device, monkeypatch):
    """A row sum, a channel sum and a grouped launch, each launched again and again by
    the driver and by Triton's launcher, on the same inputs."""
    gen = torch.Generator(device).manual_seed(0)
    rows = torch.randn(512 * 64, 96, generator=gen, device=device).bfloat16()
    channels = torch.randn(64, 32, 300, generator=gen, device=device)
    small = torch.randn(2, 4096, 40, generator=gen, device=device).bfloat16()

    def run() -> list[torch.Tensor]:
        grouped.forget_plans()
        row_launch = stats.reduction_launch(rows, square=True)
        channel_launch = stats.reduction_launch(channels, square=False)
        outs = [torch.zeros(96, device=device), torch.zeros(32, device=device)]
        outs += [torch.zeros(40, device=device), torch.zeros(40, device=device)]
        small_launch = stats.reduction_launch(small[0], square=True)
        key = grouped.group_key(small_launch, small[0])
        pair = [(small_launch, small[i], outs[2 + i], 1.0 + i, False) for i in (0, 1)]
        for accumulate in (False, True, True):
            row_launch(rows, outs[0], 0.5, accumulate)
            channel_launch(channels, outs[1], 2.0, accumulate)
            grouped.launch_grouped(key, [(*e[:4], accumulate) for e in pair])
        kept = [*row_launch.compiled.values(), *channel_launch.compiled.values()]
        return outs, kept

    by_driver, kept = run()
    assert kept and all(isinstance(k, launch.DriverLaunch) for k in kept)
    monkeypatch.setattr(launch.DriverLaunch, "of", classmethod(lambda cls, compiled: None))
    by_triton, kept = run()
    assert not any(isinstance(k, launch.DriverLaunch) for k in kept)
    for a, b in zip(by_driver, by_triton, strict=True):
        assert torch.equal(a, b)
