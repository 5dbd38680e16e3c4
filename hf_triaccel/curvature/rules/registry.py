"""Which rule a module gets: the built-in table, user registrations, and the classes of
other libraries recognised without importing them."""

from __future__ import annotations

from torch import nn

from hf_triaccel.curvature.rules.base import FisherRule
from hf_triaccel.curvature.rules.conv import ConvRule
from hf_triaccel.curvature.rules.embedding import EmbeddingRule
from hf_triaccel.curvature.rules.linear import HFConv1DRule, LinearRule
from hf_triaccel.curvature.rules.norm import ChannelNormRule, LastDimNormRule
from hf_triaccel.curvature.rules.thirdparty import is_transformers_conv1d

_RULES: dict[type, FisherRule] = {
    nn.Linear: LinearRule(),
    nn.Conv1d: ConvRule(),
    nn.Conv2d: ConvRule(),
    nn.Conv3d: ConvRule(),
    nn.modules.batchnorm._BatchNorm: ChannelNormRule(),
    nn.GroupNorm: ChannelNormRule(),
    nn.LayerNorm: LastDimNormRule(),
    nn.RMSNorm: LastDimNormRule(),
    nn.Embedding: EmbeddingRule(),
}
_HF_CONV1D = HFConv1DRule()

# nn.MultiheadAttention's out_proj: a Linear whose weight the attention reads directly,
# never calling the module, so its hooks would never fire and its factors never refresh
_NEVER_CALLED = getattr(nn.modules.linear, "NonDynamicallyQuantizableLinear", None)


def register_fisher_rule(module_type: type, rule: FisherRule) -> None:
    """Registers ``rule`` for ``module_type`` and its subclasses.

    Example:
        >>> class MyLinear(nn.Linear): ...
        >>> register_fisher_rule(MyLinear, LinearRule())
        >>> isinstance(rule_for(MyLinear(2, 2)), LinearRule)
        True
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")
    if not isinstance(rule, FisherRule):
        raise TypeError(f"rule must be a FisherRule, got {type(rule).__name__}")
    _RULES[module_type] = rule


def rule_for(module: nn.Module) -> FisherRule | None:
    """The rule for ``module``'s class or its nearest registered base, else ``None``.

    Rules are looked up along the class hierarchy, so subclasses (timm's
    ``BatchNormAct2d``) are covered. ``nn.MultiheadAttention``'s ``out_proj`` gets
    ``None``: the attention uses its weight without calling it, so no statistic can be
    taken there.

    Example:
        >>> type(rule_for(nn.Conv2d(1, 1, 3))).__name__, rule_for(nn.ReLU())
        ('ConvRule', None)
    """
    if _NEVER_CALLED is not None and type(module) is _NEVER_CALLED:
        return None
    for cls in type(module).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    if is_transformers_conv1d(module):
        return _HF_CONV1D
    return None
