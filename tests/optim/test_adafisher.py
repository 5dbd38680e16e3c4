"""AdaFisher / AdaFisherW: the float64 oracle, implementation parity, and the torch.optim
contract (param groups, state_dict resume, closure, None grads, autocast, GradScaler)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel import AdaFisher, AdaFisherW, FisherCollector
from tests.optim.oracle import OracleAdaFisher, rounding_bound


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
    )


class ResidualBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        out += x
        return F.relu(out, inplace=True)


def resnet_style() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        ResidualBlock(8),
        ResidualBlock(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def batches(n: int, seed: int, shape=(4, 3, 8, 8), classes=5):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(*shape, generator=gen), torch.randint(0, classes, (shape[0],), generator=gen))
        for _ in range(n)
    ]


def train(model, opt, data, *, dtype=torch.float32):
    for x, y in data:
        loss = F.cross_entropy(model(x.to(dtype)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss


def max_rel_diff(m1: nn.Module, m2: nn.Module) -> float:
    return max(
        ((p1.double() - p2.double()).norm() / p2.double().norm()).item()
        for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True)
    )


@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW])
@pytest.mark.parametrize("ema", ["reference", "paper"])
@pytest.mark.parametrize("normalise", ["absolute", "relative"])
@pytest.mark.parametrize("factor_init", ["zeros", "ones"])
def test_reference_matches_float64_oracle(cls, ema, normalise, factor_init):
    torch.manual_seed(0)
    model = small_cnn()
    oracle_model = copy.deepcopy(model).double()
    # one param group, decayed like the oracle decays every parameter
    opt = cls.from_model(
        model,
        list(model.parameters()),
        lr=1e-2,
        weight_decay=1e-2,
        update_every=3,
        ema=ema,
        normalise=normalise,
        factor_init=factor_init,
        impl="reference",
    )
    oracle = OracleAdaFisher(
        oracle_model,
        lr=1e-2,
        weight_decay=1e-2,
        update_every=3,
        ema=ema,
        normalise=normalise,
        factor_init=factor_init,
        decoupled=cls is AdaFisherW,
    )
    data = batches(8, seed=1)
    for x, y in data:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        F.cross_entropy(oracle_model(x.double()), y).backward()
        oracle.step()
        oracle_model.zero_grad()
    assert max_rel_diff(model, oracle_model) < rounding_bound(torch.float32, len(data), 1e-3)


def factor_slack(shape) -> float:
    """How far two float32 summation orders may put a factor entry apart, as a fraction of
    the factor's largest entry, for images of ``shape`` (B, C, H, W) through a padded 3x3
    convolution first.

    A statistic sums n = B*H*W rows; two orders of summation differ by a random walk of
    about sqrt(n) unit roundoffs (4 sigma taken), relative to the sum. Min-max
    normalisation then divides by the statistic's spread: for standard-normal images the
    corner taps see (H-1)/H of the rows each way, so the spread is 1 - ((H-1)/H)^2 of the
    statistic and a difference grows by its inverse, twice over: the entry and the minimum
    each carry one (deeper layers' statistics spread wider). The normalised statistic lies
    in [0, 1], which the factor's fold scales alike.
    """
    batch, _, height, width = shape
    unit_roundoff = torch.finfo(torch.float32).eps / 2
    spread = 1 - ((height - 1) / height) ** 2
    return 2 * 4 * (batch * height * width) ** 0.5 * unit_roundoff / spread


def assert_lockstep_300_steps(cls, impl: str, device: torch.device, shape, rtol: float) -> None:
    """``impl`` against the reference loop over 300 steps (refreshes at 0, 100, 200).

    Before each step the ``impl`` model is given the reference model's weights, so both
    optimizers see the same gradients and statistics: their own state (momenta, factors,
    step counts) is what is compared, step after step. (Two free-running trajectories
    split wherever rounding differences carry an activation across a ReLU kink.)
    """
    torch.manual_seed(0)
    model = resnet_style().to(device)
    models = {name: copy.deepcopy(model) for name in ("reference", impl)}
    opts = {
        name: cls.from_model(m, lr=1e-4, weight_decay=5e-4, impl=name) for name, m in models.items()
    }
    worst = 0.0
    for x, y in batches(300, seed=2, shape=shape, classes=10):
        x, y = x.to(device), y.to(device)
        models[impl].load_state_dict(models["reference"].state_dict())
        for name, m in models.items():
            F.cross_entropy(m(x), y).backward()
            opts[name].step()
            opts[name].zero_grad()
        worst = max(worst, max_rel_diff(models[impl], models["reference"]))
    assert worst < rtol
    ref, fast = opts["reference"], opts[impl]
    pairs = zip(models["reference"].parameters(), models[impl].parameters(), strict=True)
    for p_ref, p_fast in pairs:
        momentum = ref.state[p_ref]["momentum"]
        # absolute slack at rtol of the tensor's scale: entries where the summed gradients
        # cancel to near zero carry the rounding of the large ones (on a GPU, convolution
        # backward kernels are free to sum in any order)
        torch.testing.assert_close(
            fast.state[p_fast]["momentum"],
            momentum,
            rtol=rtol,
            atol=rtol * float(momentum.abs().max()),
        )
        assert int(fast.state[p_fast]["step"]) == int(ref.state[p_ref]["step"]) == 300
    slack = factor_slack(shape)
    for name, layer in ref.collector.layers.items():
        for factor in ("a", "g"):
            expected = getattr(layer, factor)
            torch.testing.assert_close(
                getattr(fast.collector.layers[name], factor),
                expected,
                rtol=rtol,
                atol=slack * float(expected.abs().max()),
            )


@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW])
def test_foreach_matches_reference_over_300_steps(cls):
    assert_lockstep_300_steps(cls, "foreach", torch.device("cpu"), (4, 3, 6, 6), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW])
@pytest.mark.parametrize("impl", ["foreach", "triton"])
def test_fast_paths_match_reference_over_300_steps_on_gpu(cls, impl, device):
    """The same check on the GPU, batch 64 of 16x16 images: cuDNN and the Triton
    reductions sum in other orders than the CPU, hence the looser fp32 tolerance."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA device")
    assert_lockstep_300_steps(cls, impl, device, (64, 3, 16, 16), rtol=1e-4)


def test_triton_matches_reference_interpreted():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs TRITON_INTERPRET=1 without a GPU")
    torch.manual_seed(0)
    model = small_cnn()
    runs = {}
    for impl in ("reference", "triton"):
        m = copy.deepcopy(model)
        opt = AdaFisherW.from_model(m, lr=1e-2, weight_decay=1e-2, update_every=2, impl=impl)
        train(m, opt, batches(4, seed=3))
        runs[impl] = m
    assert max_rel_diff(runs["triton"], runs["reference"]) < 1e-5


def test_every_parameter_moves_and_unknown_modules_get_fallback():
    class Scaled(nn.Module):  # an unsupported module with its own parameter
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(5))

        def forward(self, x):
            return x * self.scale

    model = nn.Sequential(small_cnn(), Scaled())
    opt = AdaFisher.from_model(model, lr=1e-2, update_every=1)
    assert opt.collector.factors_for(model[1].scale) is None
    for x, y in batches(3, seed=4):
        before = [p.detach().clone() for p in model.parameters()]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        for b, p in zip(before, model.parameters(), strict=True):
            assert torch.isfinite(p).all()
            assert not torch.equal(b, p)


def test_param_groups_have_their_own_lr_and_decay():
    torch.manual_seed(0)
    model = small_cnn()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    collector = FisherCollector(model)
    opt = AdaFisherW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "lr": 0.0}],
        collector,
        lr=1e-2,
    )
    frozen = [p.detach().clone() for p in no_decay]
    train(model, opt, batches(2, seed=5))
    for b, p in zip(frozen, no_decay, strict=True):
        assert torch.equal(b, p)  # lr 0 group untouched
    assert opt.param_groups[0]["weight_decay"] == 0.1


def test_none_grads_are_skipped():
    model = nn.ModuleDict({"used": nn.Linear(4, 2), "unused": nn.Linear(4, 2)})
    opt = AdaFisher.from_model(model, lr=1e-2)
    before = model["unused"].weight.detach().clone()
    model["used"](torch.randn(3, 4)).sum().backward()
    opt.step()
    assert torch.equal(before, model["unused"].weight)
    assert model["unused"].weight not in opt.state


def test_step_counts_follow_which_parameters_have_gradients():
    """Each parameter keeps its own step count (a 0-d float32 tensor in its state, as in
    torch's optimizers) while the set of parameters with gradients changes."""
    model = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 2)})
    twin = copy.deepcopy(model)
    kwargs = dict(lr=1e-2, update_every=2, impl="reference")
    opt = AdaFisher.from_model(model, list(model.parameters()), **kwargs)
    opt_twin = AdaFisher.from_model(twin, list(twin.parameters()), **kwargs)
    x = torch.randn(3, 4)
    for uses in (("a",), ("a", "b"), ("b",), ("a",), ("a", "b")):
        for m, o in ((model, opt), (twin, opt_twin)):
            sum(m[k](x).square().sum() for k in uses).backward()
            o.step()
            o.zero_grad()
        # the twin's plans are rebuilt every step: same result as the cached ones
        opt_twin._plans = []
    for name, expected in (("a", 4.0), ("b", 3.0)):
        step = opt.state[model[name].weight]["step"]
        assert step.dtype == torch.float32 and step.dim() == 0 and step.item() == expected
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    sd = opt.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert [s["step"].item() for s in loaded["state"].values()] == [4.0, 4.0, 3.0, 3.0]


def test_added_param_group_and_switched_implementation(monkeypatch):
    """A param group added after the first step is stepped too; an implementation
    chosen by the environment variable between steps takes effect at the next one.
    Against a twin whose step plans are rebuilt at every step."""
    torch.manual_seed(0)
    model = small_cnn()
    twin = copy.deepcopy(model)
    opts = []
    for m, impl in ((model, None), (twin, "reference")):
        body = [p for n, p in m.named_parameters() if not n.startswith("6.")]
        opts.append(AdaFisherW([{"params": body}], FisherCollector(m), lr=1e-2, impl=impl))
    opt, twin_opt = opts
    monkeypatch.setenv("HF_TRIACCEL_IMPL", "foreach")
    for x, y in batches(4, seed=8):
        twin_opt._plans = []
        for m, o in ((model, opt), (twin, twin_opt)):
            F.cross_entropy(m(x), y).backward()
            o.step()
            m.zero_grad()  # the head's gradient too, before its group is added
        if len(opt.param_groups) == 1:
            for m, o in ((model, opt), (twin, twin_opt)):
                o.add_param_group({"params": list(m[6].parameters())})
            monkeypatch.setenv("HF_TRIACCEL_IMPL", "reference")
    # foreach and the loop round differently on the first steps: the drift bound of two
    # float32 trajectories over the 4 steps
    assert max_rel_diff(model, twin) < rounding_bound(torch.float32, 4, 1e-3)
    assert {part.impl for plan in opt._plans for part in plan.parts} == {"reference"}
    assert all(opt.state[p]["step"] == 3 for p in model[6].parameters())


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_triton_matches_reference_with_channels_last_weights(memory_format):
    """The fused kernel's channels-last path inside the optimizer (interpreted on CPU)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs TRITON_INTERPRET=1 without a GPU")
    torch.manual_seed(0)
    model = resnet_style().to(memory_format=memory_format)
    runs = {}
    for impl in ("reference", "triton"):
        m = copy.deepcopy(model)
        opt = AdaFisherW.from_model(m, lr=1e-3, weight_decay=1e-2, update_every=2, impl=impl)
        data = [(x.contiguous(memory_format=memory_format), y) for x, y in batches(3, seed=9)]
        train(m, opt, data)
        runs[impl] = m
    assert max_rel_diff(runs["triton"], runs["reference"]) < 1e-5
    conv = runs["triton"][0].weight
    assert conv.is_contiguous(memory_format=memory_format)


def test_closure_returns_loss():
    model = nn.Linear(4, 2)
    opt = AdaFisher.from_model(model, lr=1e-2)
    x = torch.randn(5, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0


@pytest.mark.parametrize("impl", ["reference", "foreach"])
def test_state_dict_resume_is_exact(impl):
    torch.manual_seed(0)
    data = batches(12, seed=6)
    model = small_cnn()
    straight = copy.deepcopy(model)
    opt = AdaFisherW.from_model(straight, lr=1e-2, weight_decay=1e-3, update_every=4, impl=impl)
    train(straight, opt, data)

    first = copy.deepcopy(model)
    opt1 = AdaFisherW.from_model(first, lr=1e-2, weight_decay=1e-3, update_every=4, impl=impl)
    train(first, opt1, data[:7])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    resumed = small_cnn()
    resumed.load_state_dict(saved["model"])
    opt2 = AdaFisherW.from_model(resumed, lr=1e-2, weight_decay=1e-3, update_every=4, impl=impl)
    opt2.load_state_dict(saved["opt"])
    train(resumed, opt2, data[7:])
    for p1, p2 in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p1, p2)


def test_factors_ride_in_the_per_parameter_state():
    """Each covered parameter's state holds its layer's factor vectors (shared by the
    layer's parameters); the refresh schedule rides in every saved param group."""
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    opt = AdaFisherW.from_model(model, ema="paper", update_every=2, impl="reference")
    train(model, opt, [(torch.randn(5, 4), torch.randint(0, 3, (5,))) for _ in range(3)])
    sd = opt.state_dict()
    layer = opt.collector.layers["0"]
    for p in model[0].parameters():
        entry = opt.state[p]
        assert entry["fisher_a"] is layer.a_ema and entry["fisher_g"] is layer.g_ema
        assert entry["fisher_a_used"] is layer.a and entry["fisher_g_used"] is layer.g
    assert {g["fisher_steps"] for g in sd["param_groups"]} == {3}
    assert sorted(sd["state"][0]) == [
        "fisher_a", "fisher_a_used", "fisher_g", "fisher_g_used", "momentum", "step"
    ]  # fmt: skip


def _resume_through(save_and_load):
    """Trains 7 steps, saves, loads into a fresh model and optimizer with
    ``save_and_load(model, opt, twin, twin_opt)``, trains 5 more on both: the same bits."""
    data = batches(12, seed=9)
    torch.manual_seed(0)
    model = small_cnn()
    twin = copy.deepcopy(model)
    hyper = dict(lr=1e-2, weight_decay=1e-3, update_every=4, impl="foreach")
    opt = AdaFisherW.from_model(model, **hyper)
    train(model, opt, data[:7])
    twin_opt = AdaFisherW.from_model(twin, **hyper)
    save_and_load(model, opt, twin, twin_opt)
    assert twin_opt.fisher_steps == 7 and not twin_opt.collector.collecting
    train(model, opt, data[7:])
    train(twin, twin_opt, data[7:])
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    layers = zip(opt.collector.layers.values(), twin_opt.collector.layers.values(), strict=True)
    for a, b in layers:
        assert torch.equal(a.a, b.a) and torch.equal(a.g, b.g)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_distributed_checkpoint_state_dict_resumes_exactly(tmp_path):
    """Through torch.distributed.checkpoint's state-dict functions and files, which keep
    only the per-parameter state and the param groups; a fresh optimizer takes one step
    with zero gradients and no learning rate to build its state before loading."""
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def save_and_load(model, opt, twin, twin_opt):
        msd, osd = get_state_dict(model, opt)
        save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
        msd2, osd2 = get_state_dict(twin, twin_opt)
        load({"model": msd2, "optim": osd2}, checkpoint_id=str(tmp_path))
        set_state_dict(twin, twin_opt, model_state_dict=msd2, optim_state_dict=osd2)

    _resume_through(save_and_load)


def test_state_dicts_of_the_0_2_format_still_load():
    """hf_triaccel 0.2 kept the factors by layer name and the schedule under "fisher"."""

    def save_and_load(model, opt, twin, twin_opt):
        sd = copy.deepcopy(opt.state_dict())
        for entry in sd["state"].values():
            for key in [k for k in entry if k.startswith("fisher_")]:
                del entry[key]
        for group in sd["param_groups"]:
            del group["fisher_steps"]
        sd["fisher"] = {"fisher_steps": opt.fisher_steps, "factors": opt.collector.state_dict()}
        twin.load_state_dict(model.state_dict())
        twin_opt.load_state_dict(sd)

    _resume_through(save_and_load)


def test_state_dict_before_first_step():
    model = small_cnn()
    opt = AdaFisher.from_model(model)
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert [g["fisher_steps"] for g in sd["param_groups"]] == [0, 0]
    assert "fisher_steps" not in opt.param_groups[0]  # the schedule lives in the optimizer


def test_bf16_params_keep_fp32_momentum_across_resume():
    model = nn.Linear(8, 4).to(torch.bfloat16)
    opt = AdaFisher.from_model(model, lr=1e-2)
    model(torch.randn(3, 8, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    opt2 = AdaFisher.from_model(model, lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[model.weight]["momentum"].dtype == torch.float32
    assert torch.equal(opt2.state[model.weight]["momentum"], opt.state[model.weight]["momentum"])


def test_autocast_bf16_statistics_are_fp32():
    model = small_cnn()
    opt = AdaFisher.from_model(model, lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(torch.randn(4, 3, 8, 8)), torch.randint(0, 5, (4,)))
    loss.backward()
    opt.step()
    for layer in opt.collector.layers.values():
        assert layer.a.dtype == torch.float32 and torch.isfinite(layer.a).all()
        assert torch.isfinite(layer.g).all()


class FakeScaler:
    """A GradScaler stand-in: the collector reads only ``is_enabled`` and ``_scale``."""

    def __init__(self, scale: float) -> None:
        self._scale = torch.tensor(scale)

    def is_enabled(self) -> bool:
        return True


def test_loss_scale_is_removed_from_statistics():
    torch.manual_seed(0)
    model = small_cnn()
    scaled = copy.deepcopy(model)
    x, y = batches(1, seed=7)[0]
    opt = AdaFisher.from_model(model, ema="paper", lr=0.0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt_s = AdaFisher.from_model(scaled, ema="paper", lr=0.0)
    opt_s.collector.grad_scaler = FakeScaler(1024.0)
    (F.cross_entropy(scaled(x), y) * 1024.0).backward()
    opt_s.step()
    for name, layer in opt.collector.layers.items():
        torch.testing.assert_close(
            opt_s.collector.layers[name].g_ema, layer.g_ema, rtol=1e-5, atol=0
        )


def test_statistics_are_taken_only_on_refresh_steps():
    model = nn.Linear(4, 3)
    opt = AdaFisher.from_model(model, lr=1e-2, update_every=3)
    flags = []
    for _ in range(7):
        flags.append(opt.collector.collecting)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    assert flags == [True, False, False, True, False, False, True]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1.0}, "lr"),
        ({"beta": 1.0}, "beta"),
        ({"damping": 0.0}, "damping"),
        ({"gamma": 1.5}, "gamma"),
        ({"update_every": 0}, "update_every"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"ema": "fast"}, "ema"),
        ({"impl": "cuda"}, "impl"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaFisher.from_model(nn.Linear(2, 2), **kwargs)


def test_without_collector_warns():
    with pytest.warns(UserWarning, match="F = 1"):
        AdaFisher(nn.Linear(2, 2).parameters())


def test_collector_ema_mismatch_raises():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="ema"):
        AdaFisher(model.parameters(), FisherCollector(model, ema="paper"))


@pytest.mark.gpu
def test_a_run_resumed_between_refreshes_updates_with_factors_on_the_gpu():
    """A resumed run builds its model and optimizer on the CPU, moves the model, loads the
    state, and its first step is no refresh: no hook has moved the factors yet."""

    def build() -> tuple[nn.Module, AdaFisherW]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        return model, AdaFisherW.from_model(model, lr=1e-2, update_every=2)

    def step(model: nn.Module, opt: AdaFisherW, x: torch.Tensor) -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    x = torch.randn(32, 8, device="cuda")
    model, opt = build()
    model.cuda()
    for _ in range(3):
        step(model, opt, x)
    resumed, resumed_opt = build()
    resumed.load_state_dict(model.state_dict())
    resumed.cuda()
    resumed_opt.load_state_dict(opt.state_dict())
    assert not resumed_opt.collector.collecting  # step 3 of a refresh every 2
    step(resumed, resumed_opt, x)
    step(model, opt, x)
    layer = next(iter(resumed_opt.collector.layers.values()))
    assert layer.a.device.type == "cuda"
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
