"""Fisher statistics of every rule against float64 oracles written from the formulas of
docs/design.md ("AdaFisher as implemented").

Each oracle below is a brute-force computation (explicit unfold, one-hot, plain sums)
that shares no code with :mod:`hf_triaccel.curvature.rules`.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel._types import ParamFactors
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.curvature.rules import (
    ChannelNormRule,
    ConvRule,
    EmbeddingRule,
    HFConv1DRule,
    LastDimNormRule,
    LinearRule,
    a_statistic,
    g_statistic,
    register_fisher_rule,
    rule_for,
)
from hf_triaccel.curvature.rules.finish import Mean
from hf_triaccel.optim.functional import preconditioner

DAMPING = 1e-3

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add synchronisation cost (large on a busy host)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-7):
    assert actual.dtype == torch.float32, actual.dtype
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def stats(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, impl: str = "reference"):
    rule = rule_for(module)
    assert rule is not None, type(module).__name__
    a = a_statistic(rule, module, x, impl)
    g = g_statistic(rule, module, grad, impl)
    a_len, g_len = rule.sizes(module)
    assert a.shape == (a_len,) and g.shape == (g_len,)
    return a, g


# --------------------------------------------------------------------------- oracles


def _pads(conv: nn.Module, spatial_rank: int) -> list[tuple[int, int]]:
    """(left, right) padding per spatial dim, as the convolution applies it."""
    out = []
    for i in range(spatial_rank):
        k, d = conv.kernel_size[i], conv.dilation[i]
        if conv.padding == "same":
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        elif conv.padding == "valid":
            out.append((0, 0))
        else:
            out.append((conv.padding[i], conv.padding[i]))
    return out


def conv_oracle(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`a` of a Conv1d/Conv2d from an explicit unfold of the padded input (float64).

    Also checks that the unfolded patches reproduce the module's own output, which
    validates the padding / stride / dilation / groups handling of the oracle itself.
    """
    x = x.double()
    nd = len(conv.kernel_size)
    pads = _pads(conv, nd)
    kernel, stride, dilation = conv.kernel_size, conv.stride, conv.dilation
    xp = x
    if nd == 1:  # lift to 2-D: (B, C, 1, L)
        xp = xp.unsqueeze(2)
        pads = [(0, 0)] + pads
        kernel, stride, dilation = (1, *kernel), (1, *stride), (1, *dilation)
    flat = [p for lr in reversed(pads) for p in lr]
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(xp, flat, mode=mode)
    cols = F.unfold(xp, kernel, dilation=dilation, stride=stride)  # (B, C*K, L)
    b, _, L = cols.shape
    groups = conv.groups
    D = conv.in_channels // groups * math.prod(conv.kernel_size)
    per_group = cols.view(b, groups, D, L)

    # self-check: the patches times the weight give the module's output
    w = conv.weight.detach().double().reshape(groups, conv.out_channels // groups, D)
    out = torch.einsum("bgdl,god->bgol", per_group, w).reshape(b, conv.out_channels, L)
    if conv.bias is not None:
        out = out + conv.bias.detach().double()[:, None]
    ref = copy.deepcopy(conv).double()(x).reshape(b, conv.out_channels, -1)
    torch.testing.assert_close(out, ref)

    rows = per_group.permute(0, 1, 3, 2).reshape(-1, D)  # B*groups*L rows of patches
    if conv.bias is not None:
        rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], 1)
    return rows.square().sum(0) / (b * L * D)


def mean_sq_rows(t: torch.Tensor) -> torch.Tensor:
    """Mean over all rows (every dim but the last) of t^2."""
    t = t.double()
    return t.reshape(-1, t.shape[-1]).square().mean(0)


def conv_g_oracle(grad: torch.Tensor) -> torch.Tensor:
    g = grad.double().transpose(0, 1)
    return g.reshape(g.shape[0], -1).square().mean(1)


def norm_a_oracle(x: torch.Tensor) -> torch.Tensor:
    """Reduce over every dim but 1; u_j = sum / R^2 (R = product of reduced dims but 0);
    a = [sum_j u_j^2, size of dim 1] / B^2."""
    x = x.double()
    B, C = x.shape[:2]
    reduce = [d for d in range(x.dim()) if d != 1]
    R = math.prod(x.shape[d] for d in reduce if d != 0)
    u = x.sum(reduce) / R**2
    return torch.stack([u.square().sum(), torch.tensor(float(C), dtype=torch.float64)]) / B**2


def channel_g_oracle(grad: torch.Tensor) -> torch.Tensor:
    """(sum over every dim but 1 of the output gradient)^2 / B."""
    grad = grad.double()
    return grad.sum([d for d in range(grad.dim()) if d != 1]).square() / grad.shape[0]


def last_dim_g_oracle(grad: torch.Tensor) -> torch.Tensor:
    """(sum over every dim but the last)^2 / B."""
    grad = grad.double()
    return grad.sum(list(range(grad.dim() - 1))).square() / grad.shape[0]


# --------------------------------------------------------------------------- conv


KERNELS = [(3, 3), (1, 1), (3, 2)]
PADDINGS = [0, 1, 2, "same", "valid"]


def _conv_cases():
    for stride, padding, dilation, bias in itertools.product(
        (1, 2), PADDINGS, (1, 2), (True, False)
    ):
        if padding == "same" and stride != 1:
            continue  # PyTorch rejects it
        yield stride, padding, dilation, bias


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
@pytest.mark.parametrize("groups", ["1", "2", "depthwise"])
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k[0]}x{k[1]}")
def test_conv2d_a_matches_unfold(kernel, groups, padding_mode):
    torch.manual_seed(0)
    c_in = 4
    groups, c_out = {"1": (1, 6), "2": (2, 6), "depthwise": (c_in, 2 * c_in)}[groups]
    x = torch.randn(3, c_in, 7, 9)
    n = 0
    for stride, padding, dilation, bias in _conv_cases():
        conv = nn.Conv2d(
            c_in, c_out, kernel, stride, padding, dilation, groups, bias, padding_mode=padding_mode
        )
        a = a_statistic(rule_for(conv), conv, x, "reference")
        assert a.shape == (rule_for(conv).sizes(conv)[0],)
        close(a, conv_oracle(conv, x))
        n += 1
    assert n == 36


def test_conv2d_a_foreach_and_unbatched():
    torch.manual_seed(1)
    conv = nn.Conv2d(3, 5, (3, 2), stride=2, padding=1, dilation=(2, 1))
    x = torch.randn(2, 3, 9, 7)
    expected = conv_oracle(conv, x)
    close(a_statistic(rule_for(conv), conv, x, "foreach"), expected)
    # an unbatched (C, H, W) input is a batch of one
    close(a_statistic(rule_for(conv), conv, x[1], "reference"), conv_oracle(conv, x[1:]))
    # different padding / stride / dilation per spatial dim
    conv = nn.Conv2d(3, 2, (2, 3), stride=(2, 1), padding=(2, 0), dilation=(1, 2))
    close(a_statistic(rule_for(conv), conv, x, "reference"), conv_oracle(conv, x))


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular"])
def test_conv1d_a_matches_unfold(padding_mode):
    torch.manual_seed(2)
    x = torch.randn(3, 4, 11)
    n = 0
    for k, groups in itertools.product((1, 3, 4), (1, 2, 4)):
        for stride, padding, dilation, bias in _conv_cases():
            conv = nn.Conv1d(
                4, 8, k, stride, padding, dilation, groups, bias, padding_mode=padding_mode
            )
            close(a_statistic(rule_for(conv), conv, x, "reference"), conv_oracle(conv, x))
            n += 1
    assert n == 9 * 36


def test_conv3d_a_matches_unfold_of_slices():
    """Conv3d against an explicit triple loop over windows."""
    torch.manual_seed(3)
    conv = nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1), dilation=(1, 1, 2))
    x = torch.randn(2, 2, 4, 7, 5).double()
    xp = F.pad(x, (1, 1, 0, 0, 1, 1))
    out_shape = conv.double()(x).shape[2:]
    conv.float()
    rows = []
    for i, j, k in itertools.product(*(range(n) for n in out_shape)):
        patch = xp[:, :, i : i + 2, 2 * j : 2 * j + 3, k : k + 3 : 2]
        rows.append(patch.reshape(2, -1))
    rows = torch.cat(rows)
    rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], 1)
    L = math.prod(out_shape)
    expected = rows.square().sum(0) / (2 * L * 24)  # B * L * D, D = 2 * (2 * 3 * 2)
    close(a_statistic(rule_for(conv), conv, x.float(), "reference"), expected)


@pytest.mark.parametrize("conv", [nn.Conv2d(3, 5, 3, padding=1), nn.Conv1d(3, 5, 2, groups=1)])
def test_conv_g_is_mean_square_over_batch_and_positions(conv):
    torch.manual_seed(4)
    x = torch.randn(2, 3, 6, 5) if isinstance(conv, nn.Conv2d) else torch.randn(2, 3, 8)
    grad = torch.randn_like(conv(x))
    for impl in ("reference", "foreach"):
        close(g_statistic(rule_for(conv), conv, grad, impl), conv_g_oracle(grad))


def test_timm_conv2d_same_dynamic_padding():
    """timm's Conv2dSame pads TF-style in forward; the statistic must see that padding."""
    from timm.layers import Conv2dSame, StdConv2dSame

    torch.manual_seed(5)
    x = torch.randn(2, 3, 8, 10)  # even sizes: the TF padding is asymmetric (0 left, 1 right)
    for stride, k in ((2, 3), (1, 4), (2, 5)):
        for conv in (Conv2dSame(3, 4, k, stride), StdConv2dSame(3, 4, k, stride)):
            assert isinstance(rule_for(conv), ConvRule)
            pads = []  # (left, right) for W, then H: TF 'SAME' puts the odd pixel last
            for n in (10, 8):
                total = max((math.ceil(n / stride) - 1) * stride + k - n, 0)
                pads += [total // 2, total - total // 2]
            assert pads[0] != pads[1] or pads[2] != pads[3]
            plain = nn.Conv2d(3, 4, k, stride, bias=conv.bias is not None)
            plain.load_state_dict(conv.state_dict())
            y = conv(x)
            assert y.shape[-2:] == (math.ceil(8 / stride), math.ceil(10 / stride))
            if type(conv) is Conv2dSame:  # the oracle's padding is what forward does
                torch.testing.assert_close(y, plain(F.pad(x, pads)))
            a = a_statistic(rule_for(conv), conv, x, "reference")
            close(a, conv_oracle(plain, F.pad(x, pads)))


@pytest.mark.parametrize("groups", ["1", "2", "depthwise"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_conv2d_a_channels_last_input(groups, impl):
    """A channels-last input is reduced in its own memory order (no copy) and gives
    the same statistic."""
    torch.manual_seed(17)
    c_in = 4
    groups, c_out = {"1": (1, 6), "2": (2, 6), "depthwise": (c_in, 2 * c_in)}[groups]
    x = torch.randn(3, c_in, 7, 6).to(memory_format=torch.channels_last)
    assert not x.is_contiguous()
    for stride, padding, dilation, bias in ((1, 1, 1, True), (2, 0, 2, False)):
        conv = nn.Conv2d(c_in, c_out, (3, 2), stride, padding, dilation, groups, bias)
        close(a_statistic(rule_for(conv), conv, x, impl), conv_oracle(conv, x))


def test_conv_a_gathers_taps_per_dim_past_the_selector_size(monkeypatch):
    """Past the size of one tap-by-position selector, taps are gathered per spatial dim."""
    from hf_triaccel.curvature.rules import conv as rules

    torch.manual_seed(18)
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1, groups=1)
    x = torch.randn(2, 3, 9, 8)
    expected = conv_oracle(conv, x)
    monkeypatch.setattr(rules, "MAX_SELECTOR_ELEMENTS", 0)
    close(a_statistic(rule_for(conv), conv, x, "reference"), expected)
    xl = x.to(memory_format=torch.channels_last)
    close(a_statistic(rule_for(conv), conv, xl, "reference"), expected)


def test_conv_a_per_dim_gather_takes_a_permuted_einsum_result(monkeypatch):
    """einsum may return its result in a permuted memory order (CUDA does for the
    ViT patch embedding); the gathered statistic must not depend on it."""
    from hf_triaccel.curvature.rules import conv as rules

    def permuted_einsum(*args):
        out = torch.functional.einsum(*args)
        return out.transpose(0, -1).contiguous().transpose(0, -1)

    torch.manual_seed(19)
    conv = nn.Conv2d(3, 8, 4, stride=4, bias=True)
    x = torch.randn(2, 3, 16, 16)
    monkeypatch.setattr(rules, "MAX_SELECTOR_ELEMENTS", 0)
    monkeypatch.setattr(rules.torch, "einsum", permuted_einsum)
    close(a_statistic(rule_for(conv), conv, x, "reference"), conv_oracle(conv, x))


def test_fast_path_reuses_its_cache_and_leaves_the_last_entry():
    """a_write / g_write: the sums into a given buffer, the count returned, the bias entry
    left to the finish, the gradient sums written then accumulated; a second call reuses
    the cached plan."""
    torch.manual_seed(19)
    rule, conv = rule_for(nn.Conv2d(3, 4, 3)), nn.Conv2d(3, 4, 3, padding=1)
    x, grad = torch.randn(2, 3, 5, 5), torch.randn(2, 4, 5, 5)
    cache: dict = {}
    out = torch.full((28,), -1.0)
    rows = rule.a_write(conv, x, out, "reference", cache)
    assert rows == 2 * 25 and out[-1] == -1.0  # B L rows; the bias entry is the finish's
    assert rule.a_finish(conv) == Mean(scale=1 / 27, last=1 / 27)  # 1 / D, groups / D
    close(out[:-1] / (rows * 27), conv_oracle(conv, x)[:-1])
    n_plans = len(cache)
    rule.a_write(conv, x * 2, out, "reference", cache)
    assert len(cache) == n_plans
    close(out[:-1] / (rows * 27), conv_oracle(conv, x * 2)[:-1])
    g = torch.full((4,), 5.0)
    assert rule.g_write(conv, grad, g, False, "reference", cache) == 2 * 25
    close(g / 50, conv_g_oracle(grad))
    rule.g_write(conv, grad, g, True, "reference", cache)
    close(g / 50, 2 * conv_g_oracle(grad))


def test_a_subclass_overriding_a_statistic_is_what_the_collector_takes():
    """One statistic API: a subclass of a built-in rule that changes a_write only is
    called by the collector, and keeps its base's g_write."""

    class HalfLinearRule(LinearRule):
        def a_write(self, module, x, out, impl, cache):
            rows = super().a_write(module, x, out, impl, cache)
            out.div_(2)
            return rows

    class Half(nn.Linear):
        pass

    register_fisher_rule(Half, HalfLinearRule())
    lin = Half(3, 2)
    x, grad = torch.randn(4, 3), torch.randn(4, 2)
    collector = FisherCollector(lin, impl="reference")
    lin(x).backward(grad)
    a, g = collector.layers[""].statistics()
    close(a[:-1], a_statistic(LinearRule(), lin, x, "reference")[:-1] / 2)
    assert a[-1] == 1.0  # the bias entry: the finish's constant
    close(g, g_statistic(LinearRule(), lin, grad, "reference"))
    collector.remove()


@pytest.mark.parametrize("per_dim", [False, True])
def test_statistics_under_autocast_are_float32(per_dim, monkeypatch):
    """The tap gather and a norm layer's sum of squares are matrix products, which
    autocast would run in bfloat16."""
    from hf_triaccel.curvature.rules import conv as rules

    if per_dim:
        monkeypatch.setattr(rules, "MAX_SELECTOR_ELEMENTS", 0)
    torch.manual_seed(20)
    model = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.BatchNorm2d(5))
    collector = FisherCollector(model, impl="reference")
    x = torch.randn(2, 3, 6, 6) * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model[0](x)
        out = model[1](h)
    out.float().square().sum().backward()
    conv_a, _ = collector.layers["0"].statistics()
    close(conv_a, conv_oracle(model[0], x), rtol=1e-6)
    norm_a, _ = collector.layers["1"].statistics()
    close(norm_a, norm_a_oracle(h.detach().float()), rtol=1e-6)
    collector.remove()


def test_conv_a_under_float64_default_dtype():
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(2, 2, 5, 5)
    expected = conv_oracle(conv, x)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        conv64 = nn.Conv2d(2, 3, 3, padding=1)
        conv64.load_state_dict(conv.state_dict())
        a = a_statistic(rule_for(conv64), conv64, x.double(), "reference")
    finally:
        torch.set_default_dtype(old)
    torch.testing.assert_close(a.double(), expected, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- linear


@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 5), (5,)], ids=["2d", "3d", "unbatched"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(shape, bias):
    torch.manual_seed(6)
    lin = nn.Linear(5, 4, bias=bias)
    x = torch.randn(shape)
    grad = torch.randn(*shape[:-1], 4)
    expected_a = mean_sq_rows(x)
    if bias:
        expected_a = torch.cat([expected_a, torch.ones(1, dtype=torch.float64)])
    for impl in ("reference", "foreach"):
        a, g = stats(lin, x, grad, impl)
        close(a, expected_a)
        close(g, mean_sq_rows(grad))


def test_hf_conv1d():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(7)
    layer = Conv1D(7, 5)  # nf=7 outputs, nx=5 inputs, weight stored (5, 7)
    assert isinstance(rule_for(layer), HFConv1DRule)
    x = torch.randn(2, 3, 5)
    grad = torch.randn(2, 3, 7)
    a, g = stats(layer, x, grad)
    close(a, torch.cat([mean_sq_rows(x), torch.ones(1, dtype=torch.float64)]))
    close(g, mean_sq_rows(grad))


# --------------------------------------------------------------------------- norms


def test_batchnorm2d():
    torch.manual_seed(8)
    bn = nn.BatchNorm2d(5)
    x = torch.randn(3, 5, 7, 9) * 2 + 1
    grad = torch.randn(3, 5, 7, 9)
    a, g = stats(bn, x, grad)
    # written out for 4-D: u_c = sum_{n,h,w} x / (H W)^2
    u = x.double().sum((0, 2, 3)) / (7 * 9) ** 2
    close(a, torch.stack([u.square().sum(), torch.tensor(5.0, dtype=torch.float64)]) / 9)
    close(a, norm_a_oracle(x))
    close(g, grad.double().sum((0, 2, 3)).square() / 3)


@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 10)])
def test_batchnorm1d(shape):
    torch.manual_seed(9)
    bn = nn.BatchNorm1d(4)
    x, grad = torch.randn(shape), torch.randn(shape)
    a, g = stats(bn, x, grad)
    close(a, norm_a_oracle(x))
    close(g, channel_g_oracle(grad))


def test_groupnorm():
    torch.manual_seed(10)
    gn = nn.GroupNorm(2, 6)
    x, grad = torch.randn(3, 6, 5, 4), torch.randn(3, 6, 5, 4)
    a, g = stats(gn, x, grad)
    close(a, norm_a_oracle(x))
    close(g, channel_g_oracle(grad))


@pytest.mark.parametrize("cls", [nn.LayerNorm, nn.RMSNorm])
@pytest.mark.parametrize("shape", [(6, 8), (3, 5, 8)], ids=["2d", "3d"])
def test_layernorm_rmsnorm(cls, shape):
    torch.manual_seed(11)
    norm = cls(8)
    x, grad = torch.randn(shape) + 0.5, torch.randn(shape)
    a, g = stats(norm, x, grad)
    B = shape[0]
    if len(shape) == 2:  # dim 1 is the feature dim; nothing reduced but the batch: R = 1
        u = x.double().sum(0)
        close(a, torch.stack([u.square().sum(), torch.tensor(8.0).double()]) / B**2)
    else:  # (B, T, D): u_t = sum_{b,d} x / D^2, a = [sum_t u_t^2, T] / B^2
        u = x.double().sum((0, 2)) / 8**2
        close(a, torch.stack([u.square().sum(), torch.tensor(5.0).double()]) / B**2)
    close(a, norm_a_oracle(x))
    close(g, last_dim_g_oracle(grad))


def test_layernorm_multi_dim_normalized_shape():
    torch.manual_seed(12)
    ln = nn.LayerNorm((5, 8))
    x, grad = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    a, g = stats(ln, x, grad)
    close(a, norm_a_oracle(x))
    # one entry per affine element: summed over the batch only
    close(g, (grad.double().sum(0).square() / 3).reshape(-1))


def test_layernorm_shape_mismatch_is_a_clear_error():
    ln = nn.LayerNorm(4)
    with pytest.raises(ValueError, match="normalized_shape"):
        g_statistic(rule_for(ln), ln, torch.randn(2, 3, 5), "reference")


def test_channels_first_layernorms():
    """timm's LayerNorm2d and transformers' channels-first LayerNorm normalise dim 1:
    their affine (one entry per channel) takes g per channel."""
    from timm.layers import LayerNorm2d
    from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm

    torch.manual_seed(13)
    # W == C on purpose: the trailing dim alone cannot tell the layout
    x, grad = torch.randn(2, 6, 5, 6), torch.randn(2, 6, 5, 6)
    for norm in (LayerNorm2d(6), ConvNextLayerNorm(6, data_format="channels_first")):
        y = norm(x)
        assert y.shape == x.shape
        a, g = stats(norm, x, grad)
        close(a, norm_a_oracle(x))
        close(g, channel_g_oracle(grad))
    # channels-last ConvNext layer norm is an ordinary LayerNorm
    norm = ConvNextLayerNorm(6, data_format="channels_last")
    xl = x.permute(0, 2, 3, 1)
    _, g = stats(norm, xl, grad.permute(0, 2, 3, 1))
    close(g, last_dim_g_oracle(grad.permute(0, 2, 3, 1)))


@pytest.mark.parametrize(
    "module",
    [
        nn.LayerNorm(4, elementwise_affine=False),
        nn.RMSNorm(4, elementwise_affine=False),
        nn.BatchNorm2d(4, affine=False),
        nn.BatchNorm1d(4, affine=False),
        nn.GroupNorm(2, 4, affine=False),
    ],
    ids=lambda m: type(m).__name__,
)
def test_norm_without_affine_gets_no_factors(module):
    rule = rule_for(module)
    assert rule.sizes(module) == (2, 4)
    assert set(rule.layouts(module)) == {"weight", "bias"}
    four_d = isinstance(module, nn.BatchNorm2d)
    model = nn.Sequential(nn.Conv2d(4, 4, 1) if four_d else nn.Linear(4, 4), module)
    x = torch.randn(3, 4, 2, 2) if four_d else torch.randn(3, 4)
    collector = FisherCollector(model, impl="reference")
    assert list(collector.layers) == ["0"]
    assert not module._forward_hooks
    model(x).square().sum().backward()
    collector.fold(0.8)
    assert collector.layers["0"].a_count == 0
    collector.remove()


def test_layernorm_without_bias_gets_weight_factors_only():
    ln = nn.LayerNorm(4, bias=False)
    collector = FisherCollector(ln, impl="reference")
    assert set(collector.layers[""].layouts) == {"weight"}
    assert collector.factors_for(ln.weight) is not None
    collector.remove()


# --------------------------------------------------------------------------- embedding


def test_embedding():
    torch.manual_seed(14)
    emb = nn.Embedding(11, 4, padding_idx=0)
    idx = torch.randint(0, 11, (3, 7))
    grad = torch.randn(3, 7, 4)
    a, g = stats(emb, idx, grad)
    one_hot = F.one_hot(idx, 11).double()  # the embedding is a Linear on one-hot rows
    close(a, mean_sq_rows(one_hot))
    close(g, mean_sq_rows(grad))
    a32, _ = stats(emb, idx.int(), grad)
    close(a32, mean_sq_rows(one_hot))


# --------------------------------------------------------------------------- timm BatchNormAct2d


def _bn_act_stats(bn_act):
    torch.manual_seed(15)
    x = torch.randn(3, 4, 5, 5)
    w = torch.randn(3, 4, 5, 5)
    collector = FisherCollector(bn_act, impl="reference")
    (bn_act(x) * w).sum().backward()
    layer = collector.layers[""]
    collector.remove()
    # the gradient w.r.t. the batch-norm output (before the activation)
    y = F.batch_norm(
        x, None, None, bn_act.weight.detach(), bn_act.bias.detach(), True, 0.0, bn_act.eps
    ).requires_grad_()
    (bn_act.act(bn_act.drop(y.clone())) * w).sum().backward()
    return layer, x, y.grad


def test_timm_batchnormact2d_is_matched_as_batchnorm():
    from timm.layers import BatchNormAct2d

    bn_act = BatchNormAct2d(4, apply_act=False)
    assert isinstance(rule_for(bn_act), ChannelNormRule)
    layer, x, grad = _bn_act_stats(bn_act)
    assert layer.a_count == layer.g_count == 1
    a_sum, g_sum = layer.statistics()
    close(a_sum, norm_a_oracle(x))  # the hook input is the batch-norm input
    close(g_sum, channel_g_oracle(grad))


def test_timm_batchnormact2d_g_is_taken_before_the_activation():
    from timm.layers import BatchNormAct2d

    bn_act = BatchNormAct2d(4, act_layer=nn.ReLU)
    layer, x, grad = _bn_act_stats(bn_act)
    a_sum, g_sum = layer.statistics()
    close(a_sum, norm_a_oracle(x))
    close(g_sum, channel_g_oracle(grad))


# --------------------------------------------------------------------------- dtypes


def test_low_precision_inputs_give_float32_stats_without_overflow():
    """fp16/bf16 activations: statistics in float32, no fp16 overflow of x^2."""
    torch.manual_seed(16)
    cases = [
        (nn.Linear(5, 3), (4, 5), (4, 3)),
        (nn.Conv2d(3, 2, 3, padding=1), (2, 3, 5, 5), (2, 2, 5, 5)),
        (nn.BatchNorm2d(3), (2, 3, 4, 4), (2, 3, 4, 4)),
        (nn.LayerNorm(5), (2, 3, 5), (2, 3, 5)),
    ]
    for dtype in (torch.float16, torch.bfloat16):
        for module, xs, gs in cases:
            x = (torch.randn(xs) * 400).to(dtype)  # x^2 > fp16 max (65504)
            grad = (torch.randn(gs) * 400).to(dtype)
            a, g = stats(module, x, grad)
            assert torch.isfinite(a).all() and torch.isfinite(g).all()
            # same statistic from the same (rounded) values in float32
            a32, g32 = stats(module, x.float(), grad.float())
            close(a, a32, rtol=1e-6)
            close(g, g32, rtol=1e-6)


# --------------------------------------------------------------------------- layouts


def _check_layout(module, expected: dict[str, callable]):
    rule = rule_for(module)
    a_len, g_len = rule.sizes(module)
    a = torch.rand(a_len) + 0.1
    g = torch.rand(g_len) + 0.1
    layouts = rule.layouts(module)
    checked = 0
    for name, p in module.named_parameters(recurse=False):
        F_ = preconditioner(p, ParamFactors(g, a, layouts[name]), DAMPING)
        assert F_.shape == p.shape
        torch.testing.assert_close(F_, expected[name](g, a).reshape(p.shape) + DAMPING)
        checked += 1
    assert checked == len(expected)


def test_layout_linear():
    _check_layout(
        nn.Linear(5, 3),
        {"weight": lambda g, a: torch.outer(g, a[:5]), "bias": lambda g, a: g * a[-1]},
    )
    _check_layout(nn.Linear(5, 3, bias=False), {"weight": lambda g, a: torch.outer(g, a)})


def test_layout_conv():
    _check_layout(  # a in (C_in/groups, kh, kw) order, then the bias entry
        nn.Conv2d(4, 6, (3, 2), groups=2),
        {
            "weight": lambda g, a: g[:, None, None, None] * a[:-1].view(2, 3, 2),
            "bias": lambda g, a: g * a[-1],
        },
    )
    _check_layout(
        nn.Conv1d(3, 2, 4, bias=False),
        {"weight": lambda g, a: g[:, None, None] * a.view(3, 4)},
    )


def test_layout_hf_conv1d():
    from transformers.pytorch_utils import Conv1D

    _check_layout(  # weight stored (d_in, d_out)
        Conv1D(3, 5),
        {"weight": lambda g, a: torch.outer(a[:5], g), "bias": lambda g, a: g * a[-1]},
    )


def test_layout_embedding():
    _check_layout(nn.Embedding(7, 3), {"weight": lambda g, a: torch.outer(a, g)})


@pytest.mark.parametrize(
    "module",
    [nn.BatchNorm2d(4), nn.GroupNorm(2, 4), nn.LayerNorm(4), nn.RMSNorm(4)],
    ids=lambda m: type(m).__name__,
)
def test_layout_norms(module):
    expected = {"weight": lambda g, a: g * a[0], "bias": lambda g, a: g * a[1]}
    if isinstance(module, nn.RMSNorm):
        del expected["bias"]
    _check_layout(module, expected)


def test_layout_layernorm_multi_dim():
    _check_layout(
        nn.LayerNorm((2, 3)),
        {"weight": lambda g, a: g.view(2, 3) * a[0], "bias": lambda g, a: g.view(2, 3) * a[1]},
    )


# --------------------------------------------------------------------------- lookup


def test_rule_lookup():
    class MyLinear(nn.Linear):
        pass

    from timm.layers import BatchNormAct2d

    assert isinstance(rule_for(MyLinear(2, 2)), LinearRule)
    assert isinstance(rule_for(nn.Conv3d(1, 1, 1)), ConvRule)
    assert isinstance(rule_for(nn.SyncBatchNorm(2)), ChannelNormRule)
    assert isinstance(rule_for(BatchNormAct2d(2)), ChannelNormRule)
    assert isinstance(rule_for(nn.LayerNorm(2)), LastDimNormRule)
    assert isinstance(rule_for(nn.Embedding(2, 2)), EmbeddingRule)
    for unsupported in (
        nn.ConvTranspose2d(1, 1, 1),
        nn.ReLU(),
        nn.InstanceNorm2d(2),
        nn.Bilinear(1, 1, 1),
    ):
        assert rule_for(unsupported) is None


def test_multihead_attention_out_proj_is_not_claimed():
    """MultiheadAttention reads out_proj.weight without calling out_proj: a layer there
    would never see a statistic. Every layer the collector does claim must see one."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    assert rule_for(layer.self_attn.out_proj) is None
    collector = FisherCollector(layer, impl="reference")
    assert sorted(collector.layers) == ["linear1", "linear2", "norm1", "norm2"]
    layer(torch.randn(2, 3, 8)).square().sum().backward()
    for name, ly in collector.layers.items():
        assert ly.a_count == ly.g_count == 1, name
    collector.remove()
