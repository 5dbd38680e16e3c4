"""bfloat16 / float16 weights: momentum in ``state_dtype``, Kahan-compensated and
stochastic rounding of the weight update, in every implementation, against a float64
oracle of the same arithmetic.

Tolerances, from the arithmetic. The implementations compute in float32, the oracle in
float64; both round to the storage dtype at the same points. A float32 chain of k
operations carries a relative error of at most about k * u (u = 2**-24) of the
magnitudes it adds; the bias correction 1 - beta**t, formed from beta**t, amplifies
beta**t's error by beta**t / (1 - beta**t) <= beta / (1 - beta) at t = 1. The chain
from the inputs to ``lr * direction`` has at most 8 roundings (momentum: 3; F: 2;
product with the bias correction, division, decay, learning rate: 4), so its relative
error is below (8 + beta / (1 - beta)) * u = :data:`CHAIN` * u. Errors are absolute, relative
to the magnitudes of the terms (a sum that cancels keeps its terms' error). Two values
a and b rounded to nearest in a narrow dtype differ by at most |a - b| plus one unit in
the last place (ulp) of that dtype.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from hf_triaccel.optim.adafisher import AdaFisherW
from hf_triaccel.optim.config import AdaFisherConfig
from hf_triaccel.optim.functional import adafisher

IMPLS = ("reference", "foreach", "triton")
BETA = 0.9
U32 = 2.0**-24
CHAIN = 8 + BETA / (1 - BETA)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |x| (float64), the smallest normal's below it."""
    info = torch.finfo(dtype)
    mag = x.double().abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


def oracle(p, grad, m, comp, step, *, lr, wd, rounding, fisher=None):
    """One AdaFisherW step in float64, rounded where the implementations store; also the
    float32 implementations' absolute error bounds on the momentum and on
    ``lr * direction`` (see the module docstring)."""
    theta, g, m0 = p.double(), grad.double(), m.double()
    mom = BETA * m0 + (1 - BETA) * g
    bc = 1 - BETA**step
    denom = bc if fisher is None else bc * fisher
    direction = mom / denom + wd * theta
    delta = lr * direction
    mom_err = 3 * U32 * (BETA * m0.abs() + (1 - BETA) * g.abs())
    delta_err = lr * ((mom_err + CHAIN * U32 * mom.abs()) / denom + 2 * U32 * wd * theta.abs())
    new_comp = None
    if rounding == "kahan":
        y = comp.double() - delta
        new = (theta + y).to(p.dtype)
        new_comp = (y - (new.double() - theta)).to(p.dtype)
    else:
        new = (theta - delta).to(p.dtype)
    return new, mom.to(m.dtype), new_comp, delta, theta, mom_err, delta_err


def tensors(dtype, state_dtype, n=2500, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(dtype)
    grad = torch.randn(n, generator=g).to(dtype)
    m = (0.1 * torch.randn(n, generator=g)).to(state_dtype)
    comp = (torch.randn(n, generator=g) * ulp(p, dtype) / 4).to(dtype)  # |c| < ulp(p) / 2
    return p, grad, m, comp


def check_one_step(impl, dtype, rounding, state_dtype, device, n=2500):
    """One step of ``impl`` on ``device`` against the float64 oracle (computed on the CPU)."""
    p, grad, m, comp = tensors(dtype, state_dtype, n=n)
    step, lr, wd = 3.0, 1e-2, 0.05
    want_p, want_m, want_c, delta, theta, mom_err, delta_err = oracle(
        p, grad, m, comp, step, lr=lr, wd=wd, rounding=rounding
    )
    moved = [t.to(device) for t in (p, grad, m, comp)]
    adafisher(
        [moved[0]],
        [moved[1]],
        [moved[2]],
        [None],
        [torch.tensor(step, device=device)],
        lr=lr,
        beta=BETA,
        weight_decay=wd,
        damping=1e-3,
        decoupled=True,
        impl=impl,
        comps=[moved[3]],
        rounding=rounding,
    )
    p, grad, m, comp = (t.cpu() for t in moved)
    # the stored momentum: its float32 error plus one ulp of its dtype
    span_m = torch.maximum(want_m.double().abs(), m.double().abs())
    assert ((m.double() - want_m.double()).abs() <= mom_err + ulp(span_m, state_dtype)).all()
    # the stored weight: the error of theta - delta (or theta + y) plus one ulp
    comp_in = comp.double() if rounding == "kahan" else 0.0
    sum_err = delta_err + U32 * (theta.abs() + delta.abs() + 2 * torch.as_tensor(comp_in).abs())
    span = torch.maximum(want_p.double().abs(), p.double().abs())
    assert ((p.double() - want_p.double()).abs() <= sum_err + ulp(span, dtype)).all()
    differ = (p != want_p).double().mean().item()
    assert differ < 0.05, f"{differ:.1%} of the weights one ulp off: not rounding noise"
    if rounding == "kahan":
        # the value carried, weight + compensation, is theta + y up to y's float32 error
        # and each compensation's own rounding (half an ulp of it)
        got = p.double() + comp.double()
        want = want_p.double() + want_c.double()
        bound = sum_err + (ulp(want_c, dtype) + ulp(comp, dtype)) / 2
        assert ((got - want).abs() <= bound).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rounding", ["nearest", "kahan"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_one_step_matches_the_float64_oracle(impl, dtype, rounding, state_dtype):
    check_one_step(impl, dtype, rounding, state_dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rounding", ["nearest", "kahan"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_triton_step_on_the_gpu_matches_the_float64_oracle(dtype, rounding, state_dtype):
    """The compiled kernel at a size of many programs, on the device."""
    check_one_step("triton", dtype, rounding, state_dtype, "cuda", n=1 << 20)


@pytest.mark.parametrize("impl", IMPLS)
def test_kahan_follows_the_exact_sum_where_rounding_to_nearest_stalls(impl):
    # each step moves the weight by a tenth of a bfloat16 ulp at 1.0: nearest rounding
    # drops every one, the compensated sum keeps them
    n, steps = 1024, 60
    grad = torch.ones(n, dtype=torch.bfloat16)
    lr = 2.0**-7 / 10  # bfloat16's ulp at 1.0 is 2**-7
    results = {}
    for rounding in ("nearest", "kahan"):
        p = torch.ones(n, dtype=torch.bfloat16)
        m, comp = torch.zeros(n, dtype=torch.bfloat16), torch.zeros_like(p)
        for t in range(1, steps + 1):
            # beta = 0: the direction is the gradient itself, the step -lr exactly
            adafisher(
                [p],
                [grad],
                [m],
                [None],
                [torch.tensor(float(t))],
                lr=lr,
                beta=0.0,
                weight_decay=0.0,
                damping=1e-3,
                decoupled=True,
                impl=impl,
                comps=[comp],
                rounding=rounding,
            )
        results[rounding] = p.double() + (comp.double() if rounding == "kahan" else 0)
    exact = 1.0 - steps * lr
    assert (results["nearest"] == 1.0).all()  # every update rounded away
    # per step, the compensation's own rounding (half an ulp of a value below half the
    # weight's ulp) and float32 error in y and theta + y
    per_step = ulp(torch.tensor(2.0**-8), torch.bfloat16) / 2 + 2 * U32 * 2
    assert ((results["kahan"] - exact).abs() <= steps * per_step).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_stochastic_rounding_brackets_and_is_unbiased(impl):
    n, steps = 4096, 40
    grad = torch.ones(n, dtype=torch.bfloat16)
    lr = 2.0**-7 * 0.3
    p = torch.ones(n, dtype=torch.bfloat16)
    m = torch.zeros(n, dtype=torch.bfloat16)
    for t in range(1, steps + 1):
        before = p.double()
        adafisher(
            [p],
            [grad],
            [m],
            [None],
            [torch.tensor(float(t))],
            lr=lr,
            beta=0.0,
            weight_decay=0.0,
            damping=1e-3,
            decoupled=True,
            impl=impl,
            rounding="stochastic",
            seed=t,
        )
        # one of the two bfloat16 neighbours of the exact value
        exact = before - lr
        spacing = ulp(exact, torch.bfloat16)
        assert ((p.double() - exact).abs() < spacing).all()
    # each rounding is unbiased with variance <= ulp**2 / 4; the spacing is at most 2**-7
    # on the way (the weights stay in [0.5, 1]), so the mean over n weights has standard
    # deviation <= 2**-7 * sqrt(steps / 4 / n); 5 of them
    exact = 1.0 - steps * lr
    sd = 2.0**-7 * (steps / 4 / n) ** 0.5
    assert abs(p.double().mean().item() - exact) <= 5 * sd
    assert p.double().std() > 0  # the weights did not all round alike


def test_stochastic_rounding_refuses_float16_weights():
    model = nn.Linear(4, 2).half()
    with pytest.raises(ValueError, match="weight_rounding='stochastic' rounds bfloat16"):
        AdaFisherW.from_model(model, weight_rounding="stochastic")


def test_config_names_bad_low_memory_fields():
    with pytest.raises(ValueError, match="state_dtype='int8'"):
        AdaFisherConfig(state_dtype="int8")
    with pytest.raises(ValueError, match="weight_rounding='up'"):
        AdaFisherConfig(weight_rounding="up")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(torch.bfloat16)


def _train(model, opt, batches):
    for x, y in batches:
        nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("impl", ["foreach", "triton"])
def test_resume_is_exact_with_compensation_and_bf16_state(impl):
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(16, 6, generator=g).to(torch.bfloat16),
            torch.randint(0, 3, (16,), generator=g),
        )
        for _ in range(8)
    ]
    settings = dict(
        lr=1e-2,
        update_every=3,
        state_dtype="bfloat16",
        weight_rounding="kahan",
        release_grads=True,
        impl=impl,
    )
    model = _model()
    opt = AdaFisherW.from_model(model, **settings)
    _train(model, opt, batches[:4])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    _train(model, opt, batches[4:])

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _model()
    resumed.load_state_dict(saved["model"])
    opt2 = AdaFisherW.from_model(resumed, **settings)
    opt2.load_state_dict(saved["opt"])
    for p in resumed.parameters():
        entry = opt2.state[p]
        assert entry["momentum"].dtype == torch.bfloat16
        assert entry["compensation"].dtype == torch.bfloat16
    _train(resumed, opt2, batches[4:])
    assert opt.release.total > 0 and opt2.release.total > 0
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
        for key in ("momentum", "compensation", "step"):
            assert torch.equal(opt.state[a][key], opt2.state[b][key])


def test_a_momentum_of_another_dtype_at_the_same_address_gets_its_own_tables():
    """The Triton path caches its tables by the tensors' addresses: a float32 momentum
    where a bfloat16 one was (freed memory reused, or a state reloaded in another dtype)
    must not be read with the bfloat16 one's tables."""
    pytest.importorskip("triton")
    results = {}
    for impl in ("reference", "triton"):
        p, grad, _, comp = tensors(torch.bfloat16, torch.float32)
        memory = torch.zeros(2500)  # one buffer, seen first as bfloat16, then as float32
        step = torch.tensor(3.0)  # every tensor at the same address both times
        for m in (memory.view(torch.bfloat16)[:2500], memory):
            m.copy_(0.1 * torch.ones(2500))
            adafisher(
                [p], [grad], [m], [None], [step], lr=1e-2, beta=BETA,
                weight_decay=0.05, damping=1e-3, decoupled=True, impl=impl, comps=[comp],
                rounding="kahan",
            )  # fmt: skip
        results[impl] = (p.clone(), memory.clone())
    (p_ref, m_ref), (p_fast, m_fast) = results["reference"], results["triton"]
    # the same arithmetic: each momentum within the rounding of its three float32
    # operations of the terms' magnitudes (the oracle's bound), twice for two computations
    grad = tensors(torch.bfloat16, torch.float32)[1].double()
    bound = 2 * 3 * U32 * (BETA * 0.1 + (1 - BETA) * grad.abs())
    assert ((m_fast.double() - m_ref.double()).abs() <= bound).all()
    span = torch.maximum(p_ref.double().abs(), p_fast.double().abs())
    assert ((p_fast.double() - p_ref.double()).abs() <= ulp(span, torch.bfloat16)).all()
