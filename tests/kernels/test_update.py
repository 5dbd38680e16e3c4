"""The fused AdaFisher kernel against the reference implementation, and the dispatcher
that routes the tensors the kernel does not take.

On the CPU the kernel runs under Triton's interpreter (see conftest.py), so the
shapes are small but chosen to hit every indexing case: odd sizes, a tensor spanning
several chunks with a partial last one, one that is an exact multiple of the chunk
size, and factor layouts whose quotient and remainder both wrap inside a chunk.
Tests marked ``gpu`` run the same comparisons at real sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hf_triaccel._types import FactorLayout, ParamFactors
from hf_triaccel.curvature.rules import in_out_layout, out_in_layout, per_entry_layout
from hf_triaccel.kernels.update import (
    BLOCK,
    FUSED_DTYPES,
    FusedAdaFisher,
    cache_info,
    clear_cache,
    fused_adafisher,
)
from hf_triaccel.optim.functional import adafisher, prepare_adafisher

HYPER = dict(beta=0.9, damping=1e-3)
# Per spec: shape, then (g length, a length, layout) or None for F = 1.
SMALL_SPECS = [
    ((7, 13), (7, 14, out_in_layout(7, 13))),  # Linear weight
    ((7,), (7, 14, per_entry_layout(7, 13))),  # its bias: the last a entry
    ((6, 3, 3, 3), (6, 27, out_in_layout(6, 27))),  # Conv2d weight
    ((45, 101), (101, 45, in_out_layout(45, 101))),  # Embedding: chunks, the last partial
    ((5,), (5, 2, per_entry_layout(5, 0))),  # LayerNorm weight ...
    ((5,), (5, 2, per_entry_layout(5, 1))),  # ... and bias
    ((2 * BLOCK,), (2 * BLOCK, 1, per_entry_layout(2 * BLOCK, 0))),  # two full chunks
    # both the quotient and the remainder wrap inside every chunk, start offsets are odd
    ((2500,), (4, 7, FactorLayout(g_div=3, g_mod=4, a_div=5, a_mod=5, a_off=2))),
    # a row longer than a chunk: the a index is constant over most chunks
    ((3, 1500), (3, 2, FactorLayout(g_div=1500, g_mod=3, a_div=3000, a_mod=2))),
    ((1, 3, 11), None),  # no factors (a position embedding, say)
    ((2,), None),
]


def make_case(specs, dtype, seed, device="cpu"):
    """Random params, momenta, factors and (not yet incremented) steps."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    params = [rand(*shape).to(dtype) for shape, _ in specs]
    moms = [rand(*shape) for shape, _ in specs]
    factors = []
    for _, fac in specs:
        if fac is None:
            factors.append(None)
        else:
            g_len, a_len, layout = fac
            g = torch.rand(g_len, generator=gen).to(device) + 0.5
            a = torch.rand(a_len, generator=gen).to(device) + 0.5
            factors.append(ParamFactors(g, a, layout))
    steps = [torch.zeros((), device=device) for _ in specs]
    return params, moms, factors, steps


def reference(params, grads, moms, factors, steps, **kwargs):
    """The reference implementation, through the public dispatcher."""
    adafisher(params, grads, moms, factors, steps, impl="reference", **kwargs)


def fresh_grads(params, gen):
    return [torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in params]


def clone_all(tensors):
    return [t.clone() for t in tensors]


@dataclass
class Trajectory:
    """Both implementations after the same steps from the same inputs."""

    params: list[torch.Tensor]  # fused
    ref_params: list[torch.Tensor]
    moms: list[torch.Tensor]  # fused
    ref_moms: list[torch.Tensor]
    start_params: list[torch.Tensor]
    start_moms: list[torch.Tensor]
    peak: list[torch.Tensor]  # largest |param| each reference element took, start included


def run_both(specs, *, dtype, n_steps, lr, weight_decay, decoupled, seed=0, device="cpu"):
    """Runs the fused kernel and the reference side by side, fresh gradients each step."""
    params, moms, factors, steps = make_case(specs, dtype, seed, device)
    ref_params, ref_moms, ref_steps = clone_all(params), clone_all(moms), clone_all(steps)
    start_params, start_moms = clone_all(params), clone_all(moms)
    peak = [p.float().abs() for p in params]
    gen = torch.Generator().manual_seed(seed + 1)
    kwargs = dict(lr=lr, weight_decay=weight_decay, decoupled=decoupled, **HYPER)
    for _ in range(n_steps):
        grads = fresh_grads(params, gen)
        torch._foreach_add_(steps, 1.0)
        torch._foreach_add_(ref_steps, 1.0)
        fused_adafisher(params, grads, moms, factors, steps, **kwargs)
        reference(ref_params, grads, ref_moms, factors, ref_steps, **kwargs)
        peak = [torch.maximum(m, p.float().abs()) for m, p in zip(peak, ref_params, strict=True)]
    return Trajectory(params, ref_params, moms, ref_moms, start_params, start_moms, peak)


def assert_matches(fused, ref, dtype, peak=None):
    """float32: within 1e-6. Lower precision: a float32 result that differs in its last
    bits (fused multiply-adds, GPU division) can round one unit in the last place the
    other way; later steps carry that absolute difference while the value may shrink,
    so it is bounded by two units at the largest magnitude the element took (``peak``)."""
    for i, (a, b) in enumerate(zip(fused, ref, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"tensor {i}")
            continue
        scale = torch.maximum(a.float().abs(), b.float().abs())
        if peak is not None:
            scale = torch.maximum(scale, peak[i])
        diff = (a.float() - b.float()).abs()
        bound = 2 * torch.finfo(dtype).eps * scale + 1e-7
        assert (diff <= bound).all(), f"tensor {i}: {(diff / bound).max().item():.2f}x the bound"


def assert_moms_match(fused, ref, param_dtype):
    """Momenta are float32, but with L2 decay they see the parameter, whose last unit
    may differ in a lower precision (see :func:`assert_matches`)."""
    tol = 1e-6 if param_dtype == torch.float32 else 1e-4
    for i, (a, b) in enumerate(zip(fused, ref, strict=True)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"momentum {i}")


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_float32_trajectory_matches_reference(device, decoupled, weight_decay, lr_kind):
    lr = 0.01 if lr_kind == "float" else torch.tensor(0.01, device=device)
    run = run_both(
        SMALL_SPECS,
        dtype=torch.float32,
        n_steps=5,
        lr=lr,
        weight_decay=weight_decay,
        decoupled=decoupled,
        device=device,
    )
    assert_matches(run.params, run.ref_params, torch.float32)
    assert_matches(run.moms, run.ref_moms, torch.float32)
    after, before = run.params + run.moms, run.start_params + run.start_moms
    for a, b in zip(after, before, strict=True):
        assert (a != b).all(), "an element was not updated"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoupled", [False, True])
def test_low_precision_params_match_reference(device, dtype, decoupled):
    run = run_both(
        SMALL_SPECS,
        dtype=dtype,
        n_steps=5,
        lr=0.01,
        weight_decay=0.1,
        decoupled=decoupled,
        device=device,
    )
    assert_matches(run.params, run.ref_params, dtype, run.peak)
    assert_moms_match(run.moms, run.ref_moms, dtype)
    for a, b in zip(run.moms, run.start_moms, strict=True):
        assert (a != b).all(), "a momentum element was not updated"


def test_mixed_dtypes_one_launch_per_group(device):
    """bf16 params with float32 and with bf16 grads, float32 and fp16 params: four groups."""
    specs = SMALL_SPECS[:4]
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float32, torch.float16]
    cases = [make_case(specs, dt, seed, device) for seed, dt in enumerate(dtypes)]
    params, moms, factors, steps = ([t for case in cases for t in case[k]] for k in range(4))
    grads = fresh_grads(params, torch.Generator().manual_seed(3))
    n = len(specs)
    grads[:n] = [g.float() for g in grads[:n]]  # the first bf16 block has float32 grads
    torch._foreach_add_(steps, 1.0)
    ref_params, ref_moms, p0 = clone_all(params), clone_all(moms), clone_all(params)
    kwargs = dict(lr=0.01, weight_decay=0.01, decoupled=True, **HYPER)
    bound = FusedAdaFisher(params, moms, factors, steps)
    assert bound(grads, **kwargs) == ()
    reference(ref_params, grads, ref_moms, factors, steps, **kwargs)
    assert bound.launches == [
        (torch.bfloat16, torch.float32, False, n),
        (torch.bfloat16, torch.bfloat16, False, n),
        (torch.float32, torch.float32, False, n),
        (torch.float16, torch.float16, False, n),
    ]
    peak = [p.float().abs() for p in p0]
    for lo in range(0, len(params), n):
        hi = lo + n
        assert_matches(params[lo:hi], ref_params[lo:hi], params[lo].dtype, peak[lo:hi])
    assert_matches(moms, ref_moms, torch.float32)


def test_tables_are_cached_and_gradients_rebuilt_alone(device):
    params, moms, factors, steps = make_case(SMALL_SPECS[:3], torch.float32, 0, device)
    gen = torch.Generator().manual_seed(0)
    grads = fresh_grads(params, gen)
    kwargs = dict(lr=0.01, weight_decay=0.0, decoupled=False, **HYPER)
    torch._foreach_add_(steps, 1.0)
    clear_cache()
    fused_adafisher(params, grads, moms, factors, steps, **kwargs)
    fused_adafisher(params, grads, moms, factors, steps, **kwargs)
    assert cache_info() == {"cached": 1, "plans": 1, "grad_tables": 1}
    # new gradient tensors (zero_grad(set_to_none=True)): only their table is rebuilt
    fused_adafisher(params, fresh_grads(params, gen), moms, factors, steps, **kwargs)
    assert cache_info() == {"cached": 1, "plans": 1, "grad_tables": 2}
    # a factor vector moved (FisherCollector.to): the tables are rebuilt
    factors[0].g.data = factors[0].g.data.clone()
    fused_adafisher(params, grads, moms, factors, steps, **kwargs)
    assert cache_info()["plans"] == 2


def test_cached_tables_follow_moved_factors(device):
    """Values written into moved factor vectors are the ones the kernel reads."""
    params, moms, factors, steps = make_case(SMALL_SPECS[:2], torch.float32, 0, device)
    ref_params, ref_moms = clone_all(params), clone_all(moms)
    grads = fresh_grads(params, torch.Generator().manual_seed(0))
    torch._foreach_add_(steps, 1.0)
    kwargs = dict(lr=0.01, weight_decay=0.0, decoupled=False, **HYPER)
    fused_adafisher(params, grads, moms, factors, steps, **kwargs)
    reference(ref_params, grads, ref_moms, factors, steps, **kwargs)
    factors[0].g.data = factors[0].g.data * 3.0
    fused_adafisher(params, grads, moms, factors, steps, **kwargs)
    reference(ref_params, grads, ref_moms, factors, steps, **kwargs)
    assert_matches(params, ref_params, torch.float32)


def test_non_contiguous_tensors_are_left_to_the_dispatcher(device):
    """The kernel leaves a tensor it cannot walk untouched and returns its position;
    the dispatcher updates it on the foreach path."""
    params, moms, factors, steps = make_case(SMALL_SPECS[:2], torch.float32, 0, device)
    params[0] = params[0].t().contiguous().t()  # (7, 13) stored column-major
    moms[0] = moms[0].t().contiguous().t()
    assert not params[0].is_contiguous()
    ref_params, ref_moms = clone_all(params), clone_all(moms)
    grads = fresh_grads(params, torch.Generator().manual_seed(0))
    torch._foreach_add_(steps, 1.0)
    kwargs = dict(lr=0.01, weight_decay=0.1, decoupled=False, **HYPER)
    reference(ref_params, grads, ref_moms, factors, steps, **kwargs)
    kernel_params, kernel_moms = clone_all(params), clone_all(moms)
    assert fused_adafisher(kernel_params, grads, kernel_moms, factors, steps, **kwargs) == (0,)
    assert torch.equal(kernel_params[0], params[0]) and torch.equal(kernel_moms[0], moms[0])
    assert_matches(kernel_params[1:], ref_params[1:], torch.float32)
    adafisher(params, grads, moms, factors, steps, impl="triton", **kwargs)
    assert_matches(params, ref_params, torch.float32)
    assert_matches(moms, ref_moms, torch.float32)


def _channels_last(tensors, positions):
    out = list(tensors)
    for i in positions:
        out[i] = out[i].contiguous(memory_format=torch.channels_last)
        assert out[i].dim() != 4 or not out[i].is_contiguous()
    return out


# conv weights whose memory order differs from their logical order (kh * kw > 1, C_in > 1),
# one spanning several chunks; a 4-D tensor without factors
CHANNELS_LAST_SPECS = [
    ((6, 3, 3, 3), (6, 27, out_in_layout(6, 27))),
    ((5, 7, 3, 2), (5, 43, out_in_layout(5, 42))),  # a bias entry after the weight's
    ((9, 40, 2, 3), (9, 240, out_in_layout(9, 240))),
    ((2, 3, 4, 5), None),
    ((4,), (4, 43, per_entry_layout(4, 42))),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_weights_use_the_kernel(device, dtype):
    """A channels-last weight (with gradient and momentum alike) is updated by the kernel,
    with each memory position mapped back to its factor entry."""
    params, moms, factors, steps = make_case(CHANNELS_LAST_SPECS, dtype, 3, device)
    four_d = [i for i, p in enumerate(params) if p.dim() == 4]
    params, moms = _channels_last(params, four_d), _channels_last(moms, four_d)
    ref_params, ref_moms = clone_all(params), clone_all(moms)
    gen = torch.Generator().manual_seed(4)
    kwargs = dict(lr=0.01, weight_decay=0.05, decoupled=False, **HYPER)
    peak = [p.float().abs() for p in params]
    bound = FusedAdaFisher(params, moms, factors, steps)
    for _ in range(3):
        grads = _channels_last(fresh_grads(params, gen), four_d)
        torch._foreach_add_(steps, 1.0)
        assert bound(grads, **kwargs) == ()
        reference(ref_params, grads, ref_moms, factors, steps, **kwargs)
        peak = [torch.maximum(m, p.float().abs()) for m, p in zip(peak, ref_params, strict=True)]
    assert sorted(channels_last for *_, channels_last, _ in bound.launches) == [False, True]
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in params[:4])
    assert_matches(params, ref_params, dtype, peak)
    assert_moms_match(moms, ref_moms, dtype)


def test_channels_last_with_another_layout_is_left_to_the_dispatcher(device):
    """A layout that is not a conv weight's cannot be permuted: the foreach path."""
    lay = FactorLayout(g_div=1, g_mod=4, a_div=4, a_mod=27)  # an (in, out)-style layout
    params, moms, factors, steps = make_case([((4, 3, 3, 3), (4, 27, lay))], torch.float32, 5)
    params, moms = _channels_last(params, [0]), _channels_last(moms, [0])
    grads = _channels_last(fresh_grads(params, torch.Generator().manual_seed(5)), [0])
    ref_params, ref_moms = clone_all(params), clone_all(moms)
    torch._foreach_add_(steps, 1.0)
    kwargs = dict(lr=0.01, weight_decay=0.0, decoupled=True, **HYPER)
    untouched = clone_all(params)
    assert fused_adafisher(params, grads, moms, factors, steps, **kwargs) == (0,)
    assert torch.equal(params[0], untouched[0])
    update = prepare_adafisher(params, moms, factors, steps, impl="triton")
    update(grads, maximize=False, **kwargs)
    reference(ref_params, grads, ref_moms, factors, steps, **kwargs)
    assert_matches(params, ref_params, torch.float32)


def test_bound_update_checks_only_params_and_grads(device):
    """FusedAdaFisher: tables built once; new gradient tensors reload only their table;
    a moved or cast parameter rebuilds them; results match the reference throughout."""
    params, moms, factors, steps = make_case(SMALL_SPECS[:4], torch.float32, 6, device)
    ref_params, ref_moms = clone_all(params), clone_all(moms)
    gen = torch.Generator().manual_seed(6)
    kwargs = dict(lr=0.01, weight_decay=0.01, decoupled=True, **HYPER)
    bound = FusedAdaFisher(params, moms, factors, steps)
    clear_cache()

    def step(grads):
        torch._foreach_add_(steps, 1.0)
        bound(grads, **kwargs)
        reference(ref_params, grads, ref_moms, factors, steps, **kwargs)
        assert_matches(params, ref_params, torch.float32)
        assert_matches(moms, ref_moms, torch.float32)

    grads = fresh_grads(params, gen)
    step(grads)
    step(grads)
    assert cache_info() == {"cached": 0, "plans": 1, "grad_tables": 1}
    step(fresh_grads(params, gen))
    assert cache_info()["plans"] == 1 and cache_info()["grad_tables"] == 2
    params[1].data = params[1].data.clone()  # a parameter reallocated (model.to, say)
    ref_params[1].data.copy_(params[1].data)
    step(grads)
    assert cache_info()["plans"] == 2
    step([g.to(torch.bfloat16) for g in grads])  # a new gradient dtype: new groups
    assert cache_info()["plans"] == 3
    with pytest.raises(ValueError, match="gradients"):
        bound(grads[:-1], **kwargs)


def test_functional_dispatches_to_the_kernel(device):
    params, moms, factors, steps = make_case(SMALL_SPECS[:4], torch.float32, 5, device)
    ref_params, ref_moms = clone_all(params), clone_all(moms)
    grads = fresh_grads(params, torch.Generator().manual_seed(5))
    torch._foreach_add_(steps, 1.0)
    kwargs = dict(lr=0.01, weight_decay=0.1, decoupled=True, **HYPER)
    clear_cache()
    adafisher(params, grads, moms, factors, steps, impl="triton", **kwargs)
    adafisher(ref_params, grads, ref_moms, factors, steps, impl="reference", **kwargs)
    assert cache_info()["plans"] == 1
    assert_matches(params, ref_params, torch.float32)


@pytest.mark.parametrize("decoupled", [False, True])
def test_maximize_flips_the_gradient_first(device, decoupled):
    """maximize=True is the update with the gradient negated before the weight decay is
    added, as in torch's optimizers: kernel and reference alike."""
    params, moms, factors, steps = make_case(SMALL_SPECS, torch.float32, 7, device)
    ref_params, ref_moms = clone_all(params), clone_all(moms)
    neg_params, neg_moms = clone_all(params), clone_all(moms)
    grads = fresh_grads(params, torch.Generator().manual_seed(7))
    torch._foreach_add_(steps, 1.0)
    kwargs = dict(lr=0.01, weight_decay=0.1, decoupled=decoupled, **HYPER)
    assert fused_adafisher(params, grads, moms, factors, steps, maximize=True, **kwargs) == ()
    reference(ref_params, grads, ref_moms, factors, steps, maximize=True, **kwargs)
    negated = [-g for g in grads]
    reference(neg_params, negated, neg_moms, factors, steps, maximize=False, **kwargs)
    for got, want in ((ref_params, neg_params), (ref_moms, neg_moms)):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)  # negation is exact: the same arithmetic follows
    assert_matches(params, ref_params, torch.float32)
    assert_matches(moms, ref_moms, torch.float32)


def assert_float64_close(got, want, steps: int) -> None:
    """Two float64 updates of the same arithmetic in another order: each of the update's
    few operations (fewer than 8) rounds at float64's unit roundoff, per step, relative
    to the largest magnitude the tensor holds."""
    u = torch.finfo(torch.float64).eps / 2
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype == torch.float64
        scale = float(torch.maximum(a.abs(), b.abs()).max())
        torch.testing.assert_close(a, b, rtol=0, atol=8 * steps * u * scale, msg=f"tensor {i}")


def test_float64_parameters_are_updated_in_float64(device):
    """With impl="triton", the dispatcher gives the kernel the float32 parameters and
    updates the float64 ones on the foreach path, in float64 with float64 momenta. The
    step (lr 1e-13) is far below float32's resolution at the parameters' magnitude, so
    float32 arithmetic anywhere would show at once."""
    assert torch.float64 not in FUSED_DTYPES
    specs = SMALL_SPECS[:4]
    p32, m32, f32, s32 = make_case(specs, torch.float32, 8, device)
    p64, m64, f64, s64 = make_case(specs, torch.float64, 8, device)
    m64 = [m.double() for m in m64]
    params, moms, factors, steps = p32 + p64, m32 + m64, f32 + f64, s32 + s64
    ref_params, ref_moms = clone_all(params), clone_all(moms)
    start = clone_all(p64)
    kwargs = dict(lr=1e-13, weight_decay=0.1, decoupled=False, **HYPER)
    update = prepare_adafisher(params, moms, factors, steps, impl="triton")
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        grads = fresh_grads(params, gen)
        torch._foreach_add_(steps, 1.0)
        update(grads, maximize=False, **kwargs)
        reference(ref_params, grads, ref_moms, factors, steps, **kwargs)
    n = len(specs)
    assert_matches(params[:n], ref_params[:n], torch.float32)
    assert_float64_close(params[n:], ref_params[n:], steps=3)
    assert_float64_close(moms[n:], ref_moms[n:], steps=3)
    for p, p0 in zip(params[n:], start, strict=True):
        moved = (p - p0).abs().max()
        assert 0 < moved < torch.finfo(torch.float32).eps * p0.abs().max() / 100
    # a momentum may be stored narrower (state_dtype), never of another shape or kind
    with pytest.raises(ValueError, match="momentum must be a floating-point tensor"):
        adafisher(p64, grads[n:], [m.flatten() for m in m64], f64, s64, impl="reference", **kwargs)
    with pytest.raises(ValueError, match="momentum must be a floating-point tensor"):
        adafisher(p64, grads[n:], [m.long() for m in m64], f64, s64, impl="reference", **kwargs)


def test_empty_tensors_and_lists_are_no_ops(device):
    kwargs = dict(lr=0.1, weight_decay=0.0, decoupled=False, **HYPER)
    fused_adafisher([], [], [], [], [], **kwargs)
    p, g, m = (torch.empty(0, 3, device=device) for _ in range(3))
    fused_adafisher([p], [g], [m], [None], [torch.ones((), device=device)], **kwargs)


def test_invalid_inputs_raise(device):
    kwargs = dict(lr=0.1, weight_decay=0.0, decoupled=False, **HYPER)
    p, g, m = (torch.randn(4, 3, device=device) for _ in range(3))
    s = torch.ones((), device=device)
    g_short = torch.rand(3, device=device)  # out_in_layout(4, 3) reads 4 g entries
    short = ParamFactors(g_short, torch.rand(3, device=device), out_in_layout(4, 3))
    with pytest.raises(ValueError, match="reads past"):
        fused_adafisher([p], [g], [m], [short], [s], **kwargs)
    with pytest.raises(ValueError, match="gradient"):
        fused_adafisher([p], [torch.randn(5, device=device)], [m], [None], [s], **kwargs)
    with pytest.raises(ValueError, match="momentum"):
        fused_adafisher([p], [g], [m.double()], [None], [s], **kwargs)
    with pytest.raises(TypeError, match="float64"):  # the dispatcher's, not the kernel's
        fused_adafisher([p.double()], [g], [m], [None], [s], **kwargs)


# --------------------------------------------------------------------------- GPU, real sizes


def resnet18_specs():
    """The parameter shapes of torchvision's ResNet-18 with their factor layouts."""

    def conv(c_out, c_in, k):
        d = c_in * k * k
        return [((c_out, c_in, k, k), (c_out, d, out_in_layout(c_out, d)))]

    def bn(c):
        return [((c,), (c, 2, per_entry_layout(c, 0))), ((c,), (c, 2, per_entry_layout(c, 1)))]

    specs = conv(64, 3, 7) + bn(64)
    c_in = 64
    for c in (64, 128, 256, 512):
        for block in range(2):
            first = block == 0 and c != 64
            specs += conv(c, c_in, 3) + bn(c) + conv(c, c, 3) + bn(c)
            if first:
                specs += conv(c, c_in, 1) + bn(c)
            c_in = c
    specs += [
        ((1000, 512), (1000, 513, out_in_layout(1000, 512))),
        ((1000,), (1000, 513, per_entry_layout(1000, 512))),
    ]
    return specs


MLP_SPECS = [
    ((3072, 768), (3072, 769, out_in_layout(3072, 768))),
    ((3072,), (3072, 769, per_entry_layout(3072, 768))),
    ((768, 3072), (768, 3073, out_in_layout(768, 3072))),
    ((50257, 768), (768, 50257, in_out_layout(50257, 768))),  # a GPT-2 embedding
    ((1, 197, 768), None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("specs", [resnet18_specs(), MLP_SPECS], ids=["resnet18", "mlp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [False, True])
def test_gpu_real_sizes_match_reference(device, specs, dtype, decoupled):
    run = run_both(
        specs,
        dtype=dtype,
        n_steps=3,
        lr=torch.tensor(1e-3, device=device),
        weight_decay=0.05,
        decoupled=decoupled,
        device=device,
    )
    # (no every-element-changed check: among 10^7 elements some updates round away)
    assert_matches(run.params, run.ref_params, dtype, run.peak)
    assert_moms_match(run.moms, run.ref_moms, dtype)


@pytest.mark.gpu
def test_gpu_later_steps_launch_the_compiled_kernel_directly(device, monkeypatch):
    """Triton binds the arguments once per group and settings; the steps after that
    launch the compiled kernel directly, and still match the reference."""
    from hf_triaccel.kernels import update

    bound = []
    run = update._adafisher_kernel.run
    monkeypatch.setattr(
        update._adafisher_kernel, "run", lambda *a, **k: bound.append(1) or run(*a, **k)
    )
    clear_cache()
    lr = torch.tensor(0.01, device=device)
    result = run_both(
        SMALL_SPECS, dtype=torch.float32, n_steps=4, lr=lr, weight_decay=0.1, decoupled=True,
        device=device,
    )  # fmt: skip
    assert len(bound) == 1  # one group: float32, contiguous
    assert_matches(result.params, result.ref_params, torch.float32)
    assert_matches(result.moms, result.ref_moms, torch.float32)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(device):
    """With cached tables a step is capturable; replays see new grads and a new lr."""
    params, moms, factors, steps = make_case(MLP_SPECS[:3], torch.float32, 0, device)
    ref_params, ref_moms, ref_steps = clone_all(params), clone_all(moms), clone_all(steps)
    gen = torch.Generator().manual_seed(1)
    grads = fresh_grads(params, gen)  # static gradient buffers
    lr = torch.tensor(1e-3, device=device)
    kwargs = dict(weight_decay=0.05, decoupled=True, **HYPER)

    def step():
        torch._foreach_add_(steps, 1.0)
        fused_adafisher(params, grads, moms, factors, steps, lr=lr, **kwargs)

    # warm up (builds the tables) on a side stream, then undo its effect
    snapshot = clone_all(params) + clone_all(moms)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch._foreach_copy_(params + moms, snapshot)
    torch._foreach_zero_(steps)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records the kernels without running them
        step()
    for k in range(3):
        new = fresh_grads(params, gen)
        torch._foreach_copy_(grads, new)
        lr.fill_(1e-3 * (k + 1))
        graph.replay()
        torch._foreach_add_(ref_steps, 1.0)
        reference(ref_params, new, ref_moms, factors, ref_steps, lr=1e-3 * (k + 1), **kwargs)
    torch.cuda.synchronize()
    assert_matches(params, ref_params, torch.float32)
    assert_matches(moms, ref_moms, torch.float32)
