"""Which modules carry Fisher factors, and how their statistics are taken.

A :class:`FisherRule` knows, for one kind of module, the lengths of its two factor
vectors (``a`` from the layer input, ``g`` from the gradient of its output), how to
compute one statistic of each from a forward input / output gradient, and how each
of the module's parameters indexes the two vectors (:class:`FactorLayout`).

The preconditioner entry for flat element ``k`` of a parameter is::

    F[k] = g[(k // g_div) % g_mod] * a[(k // a_div) % a_mod + a_off] + damping

which covers weights stored (out, in) (Linear, Conv), (in, out) (Embedding,
transformers' Conv1D), biases (the last ``a`` entry) and normalisation layers
(``a`` is a 2-vector: entry 0 for the weight, entry 1 for the bias).

Rules are looked up along the module's class hierarchy, so subclasses (timm's
``BatchNormAct2d``) are covered. :func:`register_fisher_rule` adds a rule for a
custom module class.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel.curvature.reductions import channel_sum, sum_rows


@dataclass(frozen=True)
class FactorLayout:
    """How the flat elements of one parameter index the ``g`` and ``a`` factor vectors."""

    g_div: int
    g_mod: int
    a_div: int
    a_mod: int
    a_off: int = 0

    def indices(self, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the (g index, a index) of every flat element (reference path)."""
        k = torch.arange(numel, device=device)
        return (k // self.g_div) % self.g_mod, (k // self.a_div) % self.a_mod + self.a_off


def out_in_layout(d_out: int, d_in: int) -> FactorLayout:
    """Weight stored (d_out, d_in...): g over rows, a over columns."""
    return FactorLayout(g_div=d_in, g_mod=d_out, a_div=1, a_mod=d_in)


def in_out_layout(d_in: int, d_out: int) -> FactorLayout:
    """Weight stored (d_in, d_out): a over rows, g over columns."""
    return FactorLayout(g_div=1, g_mod=d_out, a_div=d_out, a_mod=d_in)


def per_entry_layout(n: int, a_entry: int) -> FactorLayout:
    """A vector parameter: g per entry, one shared ``a`` entry (bias or norm affine)."""
    return FactorLayout(g_div=1, g_mod=n, a_div=1, a_mod=1, a_off=a_entry)


class FisherRule:
    """Statistics of one module kind. Subclasses override every method."""

    def sizes(self, module: nn.Module) -> tuple[int, int]:
        """Lengths of the (a, g) factor vectors."""
        raise NotImplementedError

    def layouts(self, module: nn.Module) -> dict[str, FactorLayout]:
        """Layout of each direct parameter, by attribute name."""
        raise NotImplementedError

    def a_stat(self, module: nn.Module, x: torch.Tensor, impl: str | None) -> torch.Tensor:
        """Activation statistic (float32, length a) from the module's input."""
        raise NotImplementedError

    def g_stat(self, module: nn.Module, grad: torch.Tensor, impl: str | None) -> torch.Tensor:
        """Gradient statistic (float32, length g) from the gradient of the module's output."""
        raise NotImplementedError

    def output_module(self, module: nn.Module) -> nn.Module:
        """The module whose output gradient ``g_stat`` reads: ``module`` itself, unless
        its forward applies something (an activation) after the parameterised op."""
        return module


def _with_ones(a: torch.Tensor, value: float, bias: bool) -> torch.Tensor:
    """Appends the bias column's statistic when the module has a bias."""
    return torch.cat([a, a.new_full((1,), value)]) if bias else a


class LinearRule(FisherRule):
    """``nn.Linear``: a = mean over rows of x^2 (+1 for the bias), g = mean of grad^2."""

    def sizes(self, module):
        return module.in_features + (module.bias is not None), module.out_features

    def layouts(self, module):
        d_out, d_in = module.out_features, module.in_features
        return {"weight": out_in_layout(d_out, d_in), "bias": per_entry_layout(d_out, d_in)}

    def a_stat(self, module, x, impl):
        x2 = x.reshape(-1, x.shape[-1])
        return _with_ones(sum_rows(x2, True, impl) / x2.shape[0], 1.0, module.bias is not None)

    def g_stat(self, module, grad, impl):
        g2 = grad.reshape(-1, grad.shape[-1])
        return sum_rows(g2, True, impl) / g2.shape[0]


class HFConv1DRule(LinearRule):
    """transformers' ``Conv1D``: a Linear whose weight is stored (d_in, d_out)."""

    def sizes(self, module):
        d_in, d_out = module.weight.shape
        return d_in + (module.bias is not None), d_out

    def layouts(self, module):
        d_in, d_out = module.weight.shape
        return {"weight": in_out_layout(d_in, d_out), "bias": per_entry_layout(d_out, d_in)}

    def a_stat(self, module, x, impl):
        x2 = x.reshape(-1, x.shape[-1])
        return _with_ones(sum_rows(x2, True, impl) / x2.shape[0], 1.0, module.bias is not None)


def _conv_geometry(module: nn.Module, spatial: tuple[int, ...]):
    """Per spatial dim: (input size, kernel, stride, dilation, left pad, output size)."""
    dims = []
    for i, n in enumerate(spatial):
        k, s, d = module.kernel_size[i], module.stride[i], module.dilation[i]
        if module.padding == "same":
            total = d * (k - 1)
            left, right = total // 2, total - total // 2
        elif module.padding == "valid":
            left = right = 0
        else:
            left = right = module.padding[i]
        out = (n + left + right - d * (k - 1) - 1) // s + 1
        dims.append((n, k, s, d, left, out))
    return dims


@functools.lru_cache(maxsize=512)
def _window_selector(
    n: int, k: int, s: int, d: int, left: int, out: int, device, dtype=torch.float32
) -> torch.Tensor:
    """(k, n) 0/1 matrix: entry [p, h] says input position h sits at kernel tap p of some window.

    Cached: it depends only on the geometry, and building it takes several small
    launches that would otherwise repeat for every conv layer on every refresh step.
    The returned tensor is shared: callers must not modify it.
    """
    taps = torch.arange(k, device=device).unsqueeze(1)
    starts = torch.arange(out, device=device).unsqueeze(0) * s - left
    pos = starts + taps * d  # (k, out): the input position each tap of each window reads
    sel = torch.zeros(k, n + 1, device=device, dtype=dtype)
    valid = (pos >= 0) & (pos < n)
    # padded positions read zeros: send them to a scratch column that is dropped
    sel.scatter_add_(1, torch.where(valid, pos, n), torch.ones_like(pos, dtype=sel.dtype))
    return sel[:, :n]


def _pads_same_dynamically(module: nn.Module) -> bool:
    """timm's ``Conv2dSame`` (always) and ``StdConv2dSame`` / ``ScaledStdConv2dSame`` (when
    ``same_pad``) zero-pad their input TensorFlow-style inside ``forward``."""
    if type(module).__name__ == "Conv2dSame":
        return True
    return getattr(module, "same_pad", False) is True


def _tf_same_pad(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """The TensorFlow 'SAME' zero padding those modules apply (extra pixel right/bottom)."""
    pads = []
    for n, k, s, d in zip(
        reversed(x.shape[2:]),
        reversed(module.kernel_size),
        reversed(module.stride),
        reversed(module.dilation),
        strict=True,
    ):
        total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads)


class ConvRule(FisherRule):
    """``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d``.

    a = sum over batch, output positions and groups of the squared zero-padded patch
    entries, in weight-flattening order (C_in/groups, *kernel), plus the ones column if
    bias, divided by B * L * D (L output positions, D patch length; the published
    scaling). The unfold is never formed: the batch-sum of x^2 is taken once per input
    position, then each kernel tap gathers the positions its windows visit through a
    small 0/1 selector per spatial dim.
    g = mean over B * L of the squared output gradient, per output channel.
    """

    def sizes(self, module):
        d = module.in_channels // module.groups * math.prod(module.kernel_size)
        return d + (module.bias is not None), module.out_channels

    def layouts(self, module):
        d = module.in_channels // module.groups * math.prod(module.kernel_size)
        c_out = module.out_channels
        return {"weight": out_in_layout(c_out, d), "bias": per_entry_layout(c_out, d)}

    def a_stat(self, module, x, impl):
        nd = len(module.kernel_size)
        if x.dim() == nd + 1:  # unbatched input
            x = x.unsqueeze(0)
        if _pads_same_dynamically(module):
            x = _tf_same_pad(x, module)
        if module.padding_mode != "zeros":
            x = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
            geometry = [
                (n, k, s, d, 0, (n - d * (k - 1) - 1) // s + 1)
                for n, k, s, d in zip(
                    x.shape[2:], module.kernel_size, module.stride, module.dilation, strict=True
                )
            ]
        else:
            geometry = _conv_geometry(module, tuple(x.shape[2:]))
        b, c = x.shape[:2]
        per_position = sum_rows(x.reshape(b, -1), True, impl).view(c, *x.shape[2:])
        selectors = [
            _window_selector(*g, device=x.device, dtype=per_position.dtype) for g in geometry
        ]
        letters = "xyz"[:nd]
        taps = "ijk"[:nd]
        spec = f"c{letters}," + ",".join(f"{t}{s}" for t, s in zip(taps, letters, strict=True))
        a = torch.einsum(f"{spec}->c{taps}", per_position, *selectors)
        groups = module.groups
        a = a.reshape(groups, c // groups, -1).sum(0).reshape(-1)
        positions = math.prod(g[-1] for g in geometry)
        rows = b * positions
        patch = a.numel()
        return _with_ones(a, rows * groups, module.bias is not None) / (rows * patch)

    def g_stat(self, module, grad, impl):
        nd = len(module.kernel_size)
        if grad.dim() == nd + 1:
            grad = grad.unsqueeze(0)
        g3 = grad.reshape(grad.shape[0], grad.shape[1], -1)
        return channel_sum(g3, True, impl) / (g3.shape[0] * g3.shape[2])


def _norm_a_stat(x: torch.Tensor, impl: str | None) -> torch.Tensor:
    """Normalisation layers' a (published reference mode): a 2-vector.

    Reduce over every dim except dim 1: u_j = sum / R^2, R the product of the reduced
    dims other than dim 0; a = [sum_j u_j^2, size of dim 1] / B^2.
    """
    if x.dim() == 1:
        x = x.unsqueeze(0)
    b, c = x.shape[:2]
    x3 = x.reshape(b, c, -1)
    u = channel_sum(x3, False, impl) / float(x3.shape[2]) ** 2
    return torch.stack([(u * u).sum(), u.new_tensor(float(c))]) / float(b) ** 2


def _affine_numel(module: nn.Module) -> int:
    """Number of affine elements of a normalisation layer, whether or not it has them."""
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        return math.prod(shape)
    for attr in ("num_features", "num_channels"):
        n = getattr(module, attr, None)
        if isinstance(n, int):
            return n
    p = module.weight if getattr(module, "weight", None) is not None else module.bias
    return p.numel()


def _channel_stat(grad: torch.Tensor, impl: str | None) -> torch.Tensor:
    """(sum over all dims but 1 of ``grad``)^2 / B."""
    if grad.dim() == 1:
        grad = grad.unsqueeze(0)
    b, c = grad.shape[:2]
    s = channel_sum(grad.reshape(b, c, -1), False, impl)
    return s * s / b


# timm's LayerNorm subclasses that normalise dim 1 of (B, C, H, W) inputs
_CHANNELS_FIRST_LAYER_NORMS = frozenset(
    {"LayerNorm2d", "LayerNormAct2d", "LayerNorm2dFp32", "LayerNormAct2dFp32", "LayerNorm3d"}
)


def _channels_first(module: nn.Module, shape: torch.Size) -> bool:
    """Whether a LayerNorm-like module normalises dim 1 (affine per channel of (B, C, ...))
    rather than the trailing dims: transformers' ``data_format="channels_first"`` layers,
    timm's ``LayerNorm2d`` family, or an input whose trailing dims do not fit while dim 1 does.
    """
    fmt = getattr(module, "data_format", None)
    if fmt in ("channels_first", "channels_last"):
        return fmt == "channels_first"
    if type(module).__name__ in _CHANNELS_FIRST_LAYER_NORMS:
        return True
    ns = tuple(module.normalized_shape)
    return len(ns) == 1 and len(shape) >= 3 and tuple(shape[-1:]) != ns and shape[1] == ns[0]


def _before_activation(module: nn.Module) -> nn.Module:
    """timm's norm-act layers (``BatchNormAct2d``, ``GroupNormAct``...) run
    norm -> ``drop`` -> ``act`` in one forward: the norm's output gradient is the
    gradient of ``drop``'s output, not of the module's."""
    act, drop = getattr(module, "act", None), getattr(module, "drop", None)
    if (
        isinstance(act, nn.Module)
        and not isinstance(act, nn.Identity)
        and isinstance(drop, nn.Module)
    ):
        return drop
    return module


class ChannelNormRule(FisherRule):
    """BatchNorm (1d/2d/3d, and subclasses such as timm's BatchNormAct2d) and GroupNorm.

    a: see :func:`_norm_a_stat`; g_c = (sum over all dims but 1 of the output gradient)^2 / B.
    Without affine parameters the layer has nothing to precondition (no factors).
    """

    def sizes(self, module):
        return 2, _affine_numel(module)

    def layouts(self, module):
        c = _affine_numel(module)
        return {"weight": per_entry_layout(c, 0), "bias": per_entry_layout(c, 1)}

    def a_stat(self, module, x, impl):
        return _norm_a_stat(x, impl)

    def g_stat(self, module, grad, impl):
        return _channel_stat(grad, impl)

    def output_module(self, module):
        return _before_activation(module)


class LastDimNormRule(FisherRule):
    """LayerNorm and RMSNorm (affine over the trailing ``normalized_shape`` dims).

    a: see :func:`_norm_a_stat`; g = (sum over the leading, non-normalised dims of the
    output gradient)^2 / B, one entry per affine element. Channels-first subclasses
    (timm's ``LayerNorm2d``, transformers' ``data_format="channels_first"``), which
    normalise dim 1 of (B, C, ...) inputs, take g per channel as :class:`ChannelNormRule`.
    Without affine parameters the layer has nothing to precondition (no factors).
    """

    def sizes(self, module):
        return 2, _affine_numel(module)

    def layouts(self, module):
        n = _affine_numel(module)
        return {"weight": per_entry_layout(n, 0), "bias": per_entry_layout(n, 1)}

    def a_stat(self, module, x, impl):
        return _norm_a_stat(x, impl)

    def g_stat(self, module, grad, impl):
        if _channels_first(module, grad.shape):
            return _channel_stat(grad, impl)
        ns = tuple(module.normalized_shape)
        if tuple(grad.shape[grad.dim() - len(ns) :]) != ns:
            raise ValueError(
                f"{type(module).__name__} with normalized_shape {ns} got an output of shape "
                f"{tuple(grad.shape)}, whose trailing dims do not match"
            )
        n = math.prod(ns)
        batch = grad.shape[0] if grad.dim() > len(ns) else 1
        s = sum_rows(grad.reshape(-1, n), False, impl)
        return s * s / batch

    def output_module(self, module):
        return _before_activation(module)


class EmbeddingRule(FisherRule):
    """``nn.Embedding`` (a Linear on one-hot inputs, weight stored (V, D)).

    a_v = share of the input rows that look up row v (the mean of the squared one-hot);
    g = mean over rows of the squared output gradient.
    """

    def sizes(self, module):
        return module.num_embeddings, module.embedding_dim

    def layouts(self, module):
        return {"weight": in_out_layout(module.num_embeddings, module.embedding_dim)}

    def a_stat(self, module, x, impl):
        idx = x.reshape(-1).long()
        # index_add_ rather than bincount: bincount sizes its output on the host (a sync)
        counts = torch.zeros(module.num_embeddings, device=idx.device)
        counts.index_add_(0, idx, torch.ones(idx.numel(), device=idx.device))
        return counts / idx.numel()

    def g_stat(self, module, grad, impl):
        g2 = grad.reshape(-1, grad.shape[-1])
        return sum_rows(g2, True, impl) / g2.shape[0]


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


def register_fisher_rule(module_type: type, rule: FisherRule) -> None:
    """Registers ``rule`` for ``module_type`` and its subclasses.

    Example:
        >>> class MyLinear(nn.Linear): ...
        >>> register_fisher_rule(MyLinear, LinearRule())
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")
    if not isinstance(rule, FisherRule):
        raise TypeError(f"rule must be a FisherRule, got {type(rule).__name__}")
    _RULES[module_type] = rule


# nn.MultiheadAttention's out_proj: a Linear whose weight the attention reads directly,
# never calling the module, so its hooks would never fire and its factors never refresh
_NEVER_CALLED = getattr(nn.modules.linear, "NonDynamicallyQuantizableLinear", None)


def rule_for(module: nn.Module) -> FisherRule | None:
    """The rule for ``module``'s class or its nearest registered base, else ``None``.

    ``nn.MultiheadAttention``'s ``out_proj`` gets ``None``: the attention uses its
    weight without calling it, so no statistic can be taken there.
    """
    if _NEVER_CALLED is not None and type(module) is _NEVER_CALLED:
        return None
    for cls in type(module).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    # transformers' Conv1D, recognised without importing transformers
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return _HF_CONV1D
    return None
