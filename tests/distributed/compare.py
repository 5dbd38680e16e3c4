"""Comparing a data-parallel run with one process on the global batch taken whole.

Both runs take the same float32 statistics from the same samples, added in another order:
one process sums each entry's terms in one reduction, the processes sum their shares and
the all-reduce adds the partial sums. Where a statistic squares a sum of signed gradients
(the normalisation layers' ``g``) the terms may cancel, and the worst-case bound on
reordering (``tests/curvature/rounding.py``) is then far looser than the error it bounds:
of no use over a run of many steps. Each statistic is held to that bound, fold by fold,
against its whole batch in ``tests/curvature``; a run here is held to the acceptance
tolerance of several processes against one: every tensor within ``RTOL`` of its largest
entry. (Statistics taken per share and averaged, as before the sums were added over the
processes, moved a 12-step run by 4e-2 relative.)
"""

from __future__ import annotations

import torch

RTOL = 1e-4


def assert_matches(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    """Every tensor of ``got`` within ``RTOL`` of the largest entry of its match in
    ``want``."""
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        b = b.detach()
        atol = RTOL * float(b.abs().max())
        torch.testing.assert_close(a, b, rtol=0.0, atol=atol, msg=f"{what}, tensor {i}")
