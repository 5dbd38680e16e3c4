"""Which modules carry Fisher factors, and how their statistics are taken.

A :class:`FisherRule` knows, for one kind of module, the lengths of its two factor
vectors (``a`` from the layer input, ``g`` from the gradient of its output), how to
write one micro-batch's sums for each into a caller's buffer and how the step's sums
become the statistic (:mod:`~hf_triaccel.curvature.rules.finish`), and how each of the module's
parameters indexes the two vectors (:class:`FactorLayout`).

The preconditioner entry for flat element ``k`` of a parameter is::

    F[k] = g[(k // g_div) % g_mod] * a[(k // a_div) % a_mod + a_off] + damping

which covers weights stored (out, in) (Linear, Conv), (in, out) (Embedding,
transformers' Conv1D), biases (the last ``a`` entry) and normalisation layers
(``a`` is a 2-vector: entry 0 for the weight, entry 1 for the bias).

The modules of this package: :mod:`~hf_triaccel.curvature.rules.base` (the rule API and
the layouts), one module per kind (:mod:`~hf_triaccel.curvature.rules.linear`,
:mod:`~hf_triaccel.curvature.rules.conv`, :mod:`~hf_triaccel.curvature.rules.norm`,
:mod:`~hf_triaccel.curvature.rules.embedding`), the per-shape plans they share
(:mod:`~hf_triaccel.curvature.rules.plans`), the classes of other libraries they recognise
(:mod:`~hf_triaccel.curvature.rules.thirdparty`) and the look-up
(:mod:`~hf_triaccel.curvature.rules.registry`); beneath them, what every rule writes
through: the reductions (:mod:`~hf_triaccel.curvature.rules.reductions`), queued and
launched together (:mod:`~hf_triaccel.curvature.rules.batching`), and the finish of a
step's sums (:mod:`~hf_triaccel.curvature.rules.finish`).

Example:
    >>> from torch import nn
    >>> rule = rule_for(nn.Linear(3, 2))
    >>> rule.sizes(nn.Linear(3, 2)), rule.layouts(nn.Linear(3, 2))["bias"].a_off
    ((4, 2), 3)
"""

from hf_triaccel._types import FactorLayout
from hf_triaccel.curvature.rules.base import (
    FisherRule,
    a_statistic,
    g_statistic,
    in_out_layout,
    out_in_layout,
    per_entry_layout,
)
from hf_triaccel.curvature.rules.conv import ConvRule
from hf_triaccel.curvature.rules.embedding import EmbeddingRule
from hf_triaccel.curvature.rules.linear import HFConv1DRule, LinearRule
from hf_triaccel.curvature.rules.norm import ChannelNormRule, LastDimNormRule, NormRule
from hf_triaccel.curvature.rules.registry import register_fisher_rule, rule_for

__all__ = [
    "ChannelNormRule",
    "ConvRule",
    "EmbeddingRule",
    "FactorLayout",
    "FisherRule",
    "HFConv1DRule",
    "LastDimNormRule",
    "LinearRule",
    "NormRule",
    "a_statistic",
    "g_statistic",
    "in_out_layout",
    "out_in_layout",
    "per_entry_layout",
    "register_fisher_rule",
    "rule_for",
]
