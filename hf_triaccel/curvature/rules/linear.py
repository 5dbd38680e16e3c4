"""Linear layers: ``nn.Linear`` and transformers' ``Conv1D`` (a Linear stored transposed)."""

from __future__ import annotations

from torch import nn

from hf_triaccel.curvature.rules.base import (
    FisherRule,
    in_out_layout,
    out_in_layout,
    per_entry_layout,
)
from hf_triaccel.curvature.rules.finish import Mean
from hf_triaccel.curvature.rules.plans import sum_square_rows


class LinearRule(FisherRule):
    """``nn.Linear``: a = mean over rows of x^2 (+1 for the bias), g = mean of grad^2.

    The hooks write sums over rows; the finish divides them by the step's rows and sets
    the bias entry.

    Example:
        >>> from torch import nn
        >>> LinearRule().sizes(nn.Linear(3, 2))  # a: 3 inputs and the bias column
        (4, 2)
    """

    def sizes(self, module):
        return module.in_features + (module.bias is not None), module.out_features

    def layouts(self, module):
        d_out, d_in = module.out_features, module.in_features
        return {"weight": out_in_layout(d_out, d_in), "bias": per_entry_layout(d_out, d_in)}

    def a_finish(self, module):
        return Mean(last=1.0 if module.bias is not None else None)

    def input_saved(self, module):
        # nn.Linear and its subclasses (a class registered with this rule may not keep it)
        return isinstance(module, nn.Linear) and module.weight.requires_grad

    def a_write(self, module, x, out, impl, cache):
        return sum_square_rows(x, out, False, impl, cache, "a")

    def g_write(self, module, grad, out, accumulate, impl, cache):
        return sum_square_rows(grad, out, accumulate, impl, cache, "g")


class HFConv1DRule(LinearRule):
    """transformers' ``Conv1D``: a Linear whose weight is stored (d_in, d_out)."""

    def sizes(self, module):
        d_in, d_out = module.weight.shape
        return d_in + (module.bias is not None), d_out

    def layouts(self, module):
        d_in, d_out = module.weight.shape
        return {"weight": in_out_layout(d_in, d_out), "bias": per_entry_layout(d_out, d_in)}

    def input_saved(self, module):
        return module.weight.requires_grad  # torch.addmm keeps its input for the weight
