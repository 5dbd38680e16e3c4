"""Fake device memory and out-of-memory injection for the elastic batch.

Example:
    >>> device = FakeMemoryDevice(capacity=1000, base=100, slope=10)
    >>> device.use(50); device.peak()
    600
    >>> device.use(100)
    Traceback (most recent call last):
    ...
    torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 100 B (fake device)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_triaccel.memory.probe import MemorySnapshot


def oom(message: str = "CUDA out of memory. Tried to allocate 2.00 GiB") -> torch.OutOfMemoryError:
    """The error the CUDA caching allocator raises when an allocation fails."""
    return torch.OutOfMemoryError(message)


class FakeMemoryDevice:
    """A :class:`~hf_triaccel.memory.probe.MemoryProbe` of a device whose step needs
    ``base + slope * n`` bytes for a piece of ``n`` samples.

    :meth:`use` (or a forward of a model given to :meth:`attach`) raises
    ``torch.OutOfMemoryError`` past ``capacity``, as the CUDA allocator does under
    ``torch.cuda.set_per_process_memory_fraction``.

    Args:
        capacity: bytes this process can get; lower it to mimic another process
            taking memory.
        base: bytes held besides activations (weights, optimizer state); raise it to
            mimic a tensor of this process, which shows in allocated bytes and peaks.
        slope: activation bytes per sample.

    Attributes:
        hidden: bytes that count against the capacity without showing in peaks or
            snapshots (fragmentation); 0 at first.
        ooms, resets, releases: how often :meth:`use` failed, :meth:`reset_peak` and
            :meth:`release` were called.
    """

    measures = True

    def __init__(self, capacity: float, base: float, slope: float) -> None:
        self.capacity, self.base, self.slope = capacity, base, slope
        self.hidden = 0.0
        self.window_peak = base
        self.ooms = self.resets = self.releases = 0
        self._hook: Any = None

    def use(self, n: int) -> None:
        """Charges a piece of ``n`` samples; raises an OOM past the capacity."""
        need = self.base + self.slope * n
        if need + self.hidden > self.capacity:
            self.ooms += 1
            raise oom(
                f"CUDA out of memory. Tried to allocate {need - self.capacity:.0f} B (fake device)"
            )
        self.window_peak = max(self.window_peak, need)

    def attach(self, model: nn.Module) -> None:
        """Charges every forward of ``model`` (the leading size of its first argument),
        in place of the model attached before."""
        if self._hook is not None:
            self._hook.remove()
        self._hook = model.register_forward_pre_hook(lambda module, args: self.use(len(args[0])))

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


class CountingProbe:
    """A probe that measures nothing (like ``NullProbe``) and counts releases, without
    the garbage collection that makes every injected OOM slow in a large test process."""

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


class OOMInBackward(torch.autograd.Function):
    """Identity whose backward raises an OOM while ``armed[0]`` is true (then disarms):
    the layers after it already hold gradients when it fails.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> OOMInBackward.apply(x, [True]).sum().backward()
        Traceback (most recent call last):
        ...
        torch.OutOfMemoryError: CUDA out of memory in backward
    """

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
    """A step rollback that records which samples each step kept: the ids that pieces
    :meth:`add`, forgotten when the controller re-runs the step.

    Attributes:
        steps: per step, the sample ids kept, in the order they ran.
        pieces: per step, the sizes of the pieces kept.
        reruns: per step, how often it was re-run.

    Example:
        >>> ledger = SampleLedger()
        >>> ledger.save(); ledger.add(torch.arange(3)); ledger.restore()
        >>> ledger.add(torch.arange(2)); ledger.add(torch.arange(2, 4))
        >>> ledger.steps, ledger.pieces, ledger.reruns
        ([[0, 1, 2, 3]], [[2, 2]], [1])
    """

    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        self.pieces: list[list[int]] = []
        self.reruns: list[int] = []

    @property
    def restores(self) -> int:
        """Re-runs over all steps."""
        return sum(self.reruns)

    def save(self) -> None:
        self.steps.append([])
        self.pieces.append([])
        self.reruns.append(0)

    def restore(self) -> None:
        self.steps[-1].clear()
        self.pieces[-1].clear()
        self.reruns[-1] += 1

    def add(self, ids: torch.Tensor) -> None:
        """Records the sample ids of a piece that ran."""
        self.steps[-1].extend(ids.tolist())
        self.pieces[-1].append(len(ids))
