"""The sizing policy of the elastic batch: which micro-batch ``m`` fits in device memory.

A step's peak allocation is modelled as linear in the micro-batch: ``base + slope * m``.
The slope (activation memory per sample) comes from two measured probe pieces; the base
(weights, gradients, optimizer state, workspaces) from the same pieces, refreshed from
each measured step's peak. The largest fitting size keeps the predicted peak under
``target_fraction`` of what the device can give this process, with the effective batch
``E`` cut into the fewest, most even pieces. A size that failed with an out-of-memory
error is not proposed again until memory came back.

Nothing here runs a step or touches the device: :class:`SizingPolicy` is arithmetic on
measurements that :class:`~hf_triaccel.memory.elastic.ElasticBatchController` feeds it.
"""

from __future__ import annotations

import math
from typing import Any

from hf_triaccel.memory.probe import MemorySnapshot


class SizingPolicy:
    """The memory model of one training step and the micro-batch sizes it allows.

    Args:
        effective_batch: samples per step, ``E``.
        min_micro_batch: smallest size ever proposed.
        max_micro_batch: largest size ever proposed.
        target_fraction: share of what the device can give this process that the
            predicted peak may use.

    Attributes:
        slope: bytes per sample of the step's peak (``None`` until measured).
        base: bytes of the peak that do not scale with the micro-batch.
        last_oom: ``(failed size, available bytes, allocated bytes)`` at the last
            out-of-memory error, or ``None``.

    Example:
        >>> policy = SizingPolicy(100, min_micro_batch=1, max_micro_batch=40, target_fraction=0.9)
        >>> policy.balanced(40)  # 34 + 34 + 32, not 40 + 40 + 20
        34
        >>> policy.fit(10, 1_100, 20, 1_200)
        >>> policy.slope, policy.base, policy.predicted_peak(30)
        (10.0, 1000.0, 1300.0)
    """

    def __init__(
        self,
        effective_batch: int,
        *,
        min_micro_batch: int,
        max_micro_batch: int,
        target_fraction: float,
    ) -> None:
        self.effective_batch = effective_batch
        self.min_micro_batch = min_micro_batch
        self.max_micro_batch = max_micro_batch
        self.target_fraction = target_fraction
        self.slope: float | None = None
        self.base = 0.0
        self.last_oom: tuple[int, int, int] | None = None

    def predicted_peak(self, m: int) -> float | None:
        """Predicted peak allocation (bytes) of a step at micro-batch ``m``, once measured."""
        return None if self.slope is None else self.base + self.slope * m

    def balanced(self, cap: int) -> int:
        """The size for at most ``cap`` samples per piece with the fewest, most even
        pieces: ``ceil(E / k)`` for ``k = ceil(E / cap)``. Even pieces lower the peak
        at the same piece count and avoid a tiny last piece."""
        cap = max(self.min_micro_batch, min(cap, self.max_micro_batch))
        pieces = -(-self.effective_batch // cap)
        size = -(-self.effective_batch // pieces)
        return size if size >= self.min_micro_batch else cap

    def fitting(self, snapshot: MemorySnapshot) -> int:
        """Largest balanced size whose predicted peak fits ``target_fraction`` of what
        the device can give this process (at least ``min_micro_batch``)."""
        limit = self.max_micro_batch
        if self.slope:
            room = self.target_fraction * snapshot.available - self.base
            limit = min(limit, math.floor(room / self.slope))
        if self.last_oom is not None and not self._memory_returned(snapshot):
            limit = min(limit, self.last_oom[0] - 1)
        return self.balanced(max(self.min_micro_batch, limit))

    def _memory_returned(self, snapshot: MemorySnapshot) -> bool:
        """Whether there is more room than at the last OOM: more available to the process
        (another process let go), or less held by it (a tensor of its own was freed, which
        under a budget never shows as more available). A margin of one smallest piece
        keeps allocator noise from re-trying the size that failed."""
        _, available, allocated = self.last_oom
        margin = (self.slope or 0.0) * self.min_micro_batch
        return snapshot.available > available or snapshot.allocated + margin < allocated

    def probe_sizes(self, m: int, n: int) -> list[int]:
        """Sizes of the measuring pieces of a step of ``n`` samples at micro-batch ``m``:
        a warm-up ``p`` (allocates the gradients and workspaces, which would otherwise
        inflate the first measurement), then ``p`` and ``2p``. Empty when already
        measured or the batch is too small; ``2p <= m`` keeps them no larger than a
        piece that is expected to fit.

        Example:
            >>> SizingPolicy(64, min_micro_batch=1, max_micro_batch=64,
            ...              target_fraction=0.9).probe_sizes(64, 64)
            [8, 8, 16]
        """
        if self.slope is not None:
            return []
        p = max(self.min_micro_batch, m // 8)
        return [p, p, 2 * p] if 2 * p <= m and 4 * p <= n else []

    def fit(self, size_a: int, peak_a: int, size_b: int, peak_b: int) -> None:
        """Slope and base from the peaks of two pieces of different sizes."""
        self.slope = max(0.0, (peak_b - peak_a) / (size_b - size_a))
        self.base = peak_a - self.slope * size_a

    def measured(self, peak: int, largest: int) -> None:
        """Refreshes the base from a step's measured peak, whose largest piece was
        ``largest`` samples (the slope stays: it is a property of the model)."""
        if self.slope is not None:
            self.base = peak - self.slope * largest

    def failed(self, size: int, snapshot: MemorySnapshot | None) -> None:
        """Records an out-of-memory error at ``size`` samples: that size is not proposed
        again until memory comes back, and the base is raised to at least what the
        failure shows (the size did not fit in what was available)."""
        if snapshot is None:
            return
        self.last_oom = (size, snapshot.available, snapshot.allocated)
        if self.slope is not None:
            self.base = max(self.base, snapshot.available - self.slope * size)

    def halved(self, failed: int) -> int | None:
        """The balanced size after a failure at ``failed`` samples, ``None`` below
        ``min_micro_batch``.

        Example:
            >>> SizingPolicy(16, min_micro_batch=4, max_micro_batch=16,
            ...              target_fraction=0.9).halved(6) is None
            True
        """
        cap = failed // 2
        return self.balanced(cap) if cap >= self.min_micro_batch else None

    def forget(self) -> None:
        """Drops the measurements (the memory per sample changed: measure again)."""
        self.slope, self.base = None, 0.0

    def state_dict(self) -> dict[str, Any]:
        """The measurements, JSON-serialisable."""
        return {
            "slope": self.slope,
            "base": self.base,
            "last_oom": None if self.last_oom is None else list(self.last_oom),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output."""
        self.slope = None if state["slope"] is None else float(state["slope"])
        self.base = float(state["base"])
        self.last_oom = None if state["last_oom"] is None else tuple(state["last_oom"])
