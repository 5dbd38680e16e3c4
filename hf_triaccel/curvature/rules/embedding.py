"""``nn.Embedding``: a Linear on one-hot inputs, its weight stored (V, D)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_triaccel.curvature.rules.base import FisherRule, in_out_layout
from hf_triaccel.curvature.rules.batching import then
from hf_triaccel.curvature.rules.plans import as_view, remember, sum_square_rows


@dataclass
class _EmbeddingPlan:
    ones: torch.Tensor  # one per looked-up row: index_add_ counts them exactly
    count: float


class EmbeddingRule(FisherRule):
    """a_v = share of the input rows that look up row v (the mean of the squared one-hot);
    g = mean over rows of the squared output gradient. The hooks write the counts of
    each row and the sums of squares; the finish divides by the step's rows.

    Example:
        >>> from torch import nn
        >>> from hf_triaccel.curvature.rules import a_statistic
        >>> a_statistic(EmbeddingRule(), nn.Embedding(3, 2), torch.tensor([0, 2, 2, 2]))
        tensor([0.2500, 0.0000, 0.7500])
    """

    def sizes(self, module):
        return module.num_embeddings, module.embedding_dim

    def layouts(self, module):
        return {"weight": in_out_layout(module.num_embeddings, module.embedding_dim)}

    def a_write(self, module, x, out, impl, cache):
        key = ("a", x.shape)
        plan = cache.get(key)
        if plan is None:
            n = x.numel()
            ones = torch.ones(n, dtype=torch.float32, device=x.device)
            plan = remember(cache, key, _EmbeddingPlan(ones, float(n)))
        then(_count_rows, x, out, plan.ones)  # after the batch's sums (at once without one)
        return plan.count

    def g_write(self, module, grad, out, accumulate, impl, cache):
        return sum_square_rows(grad, out, accumulate, impl, cache, "g")


def _count_rows(x: torch.Tensor, out: torch.Tensor, ones: torch.Tensor) -> None:
    """Writes into ``out`` how many entries of ``x`` look up each row."""
    # index_add_ rather than bincount: bincount sizes its output on the host (a sync)
    out.zero_().index_add_(0, as_view(x, (-1,)), ones)
