"""A fake device with a linear memory model, and fault injection for elastic-batch tests."""

from __future__ import annotations

import torch

from hf_triaccel.memory.probe import MemorySnapshot


def oom(message: str = "CUDA out of memory. Tried to allocate 2.00 GiB") -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(message)


class FakeDevice:
    """A :class:`~hf_triaccel.memory.probe.MemoryProbe` whose step needs ``base + slope * n``
    bytes for a piece of ``n`` samples; :meth:`use` raises an OOM past ``capacity`` (what
    this process can get: lower it to mimic another process taking memory). ``hidden``
    bytes count against the capacity without showing in peaks (fragmentation)."""

    measures = True

    def __init__(self, capacity: float, base: float, slope: float) -> None:
        self.capacity, self.base, self.slope = capacity, base, slope
        self.hidden = 0.0
        self.window_peak = base
        self.resets = self.releases = 0
        self.ooms = 0

    def use(self, n: int) -> None:
        need = self.base + self.slope * n
        if need + self.hidden > self.capacity:
            self.ooms += 1
            raise oom(f"CUDA out of memory. Tried to allocate {need - self.capacity:.0f} B")
        self.window_peak = max(self.window_peak, need)

    def snapshot(self) -> MemorySnapshot:
        return MemorySnapshot(
            free=int(self.capacity - self.base),
            total=int(2 * self.capacity),
            reserved=int(self.base),
            allocated=int(self.base),
        )

    def reset_peak(self) -> None:
        self.resets += 1
        self.window_peak = self.base

    def peak(self) -> int:
        return int(self.window_peak)

    def release(self) -> None:
        self.releases += 1


class OOMInBackward(torch.autograd.Function):
    """Identity whose backward raises an OOM while ``armed[0]`` is true (then disarms):
    the layers after it already hold gradients when it fails."""

    @staticmethod
    def forward(ctx, x, armed):
        ctx.armed = armed
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.armed[0]:
            ctx.armed[0] = False
            raise oom("CUDA out of memory in backward")
        return grad, None


class SampleLedger:
    """A step rollback that records which samples' gradients were kept: ids seen by a
    backward that completed, forgotten when the controller re-runs the step."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        self.attempted: list[int] = []
        self.restores = 0

    def save(self) -> None:
        self.steps.append([])

    def restore(self) -> None:
        self.restores += 1
        self.steps[-1].clear()

    def kept(self, ids: torch.Tensor) -> None:
        self.steps[-1].extend(ids.tolist())


class CountingProbe:
    """A probe that measures nothing (like NullProbe) and counts releases, without the
    garbage collection that makes every injected OOM slow in a large test process."""

    measures = False

    def __init__(self) -> None:
        self.releases = 0

    def snapshot(self) -> None:
        return None

    def reset_peak(self) -> None:
        pass

    def peak(self) -> None:
        return None

    def release(self) -> None:
        self.releases += 1
