"""AdaFisher as a torch.optim optimizer: one validated configuration, the parameter-group
rule, float64 and complex parameters, torch's common flags, copies, and state dicts
from other optimizers and older formats."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_triaccel import AdaFisher, AdaFisherW, FisherCollector
from hf_triaccel.kernels.update import cache_info, clear_cache
from hf_triaccel.optim.config import AdaFisherConfig
from hf_triaccel.optim.groups import param_groups
from tests.optim.test_adafisher import batches, max_rel_diff, rounding_bound, small_cnn, train


def flat_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


# ------------------------------------------------------------------ one configuration


def test_constructor_validates_through_the_config():
    """Defaults and checks are AdaFisherConfig's; errors name the field; a param group's
    own values are checked when the group is added, not at its first step."""
    model = nn.Linear(3, 2)
    with pytest.warns(UserWarning, match="F = 1"):
        opt = AdaFisherW(model.parameters())
    assert opt.config == AdaFisherConfig()
    assert {k: opt.defaults[k] for k in ("lr", "beta", "damping", "weight_decay")} == {
        "lr": AdaFisherConfig.lr,
        "beta": AdaFisherConfig.beta,
        "damping": AdaFisherConfig.damping,
        "weight_decay": AdaFisherConfig.weight_decay,
    }
    assert opt.update_every == AdaFisherConfig().resolved_update_every
    with pytest.raises(ValueError, match=r"^AdaFisherW\.beta=1\.5: needs 0 <= beta < 1"):
        AdaFisherW.from_model(model, beta=1.5)
    with pytest.raises(TypeError, match=r"^AdaFisher: unknown hyperparameter \['momentum'\]"):
        AdaFisher(model.parameters(), momentum=0.9)
    with pytest.raises(ValueError, match="update_every=True"):
        AdaFisherW.from_model(model, update_every=True)
    with pytest.raises(ValueError, match=r"AdaFisher\.param_groups\[1\]\.lr=-1\.0"):
        AdaFisher.from_model(
            model, [{"params": [model.weight]}, {"params": [model.bias], "lr": -1.0}]
        )
    # a refused configuration leaves no hooks on the model
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "the model already had a FisherCollector"
        FisherCollector(model)


def test_from_model_groups_parameters_with_the_one_rule():
    """Without params, from_model puts biases and normalisation weights in a group
    without weight decay, exactly as optim.groups.param_groups does."""
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(36, 2), nn.LayerNorm(2)
    )
    opt = AdaFisherW.from_model(model, weight_decay=0.1)
    expected = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    for group, want in zip(opt.param_groups, expected, strict=True):
        assert [id(p) for p in group["params"]] == [id(p) for p in want["params"]]
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert decayed == {id(model[0].weight), id(model[3].weight)}


# --------------------------------------------------------------------------- dtypes


def test_float64_foreach_matches_the_loop():
    """float64 parameters are updated in float64 with float64 momenta: the foreach path
    matches the per-tensor loop to float64 rounding (as torch's own optimizer tests
    compare their foreach and for-loop paths in float64)."""
    torch.manual_seed(0)
    model = small_cnn().double()
    data = batches(8, seed=10)
    runs = {}
    for impl in ("reference", "foreach"):
        m = copy.deepcopy(model)
        opt = AdaFisherW.from_model(
            m, lr=1e-2, weight_decay=1e-2, update_every=3, ema="paper", impl=impl
        )
        train(m, opt, data, dtype=torch.float64)
        assert {opt.state[p]["momentum"].dtype for p in m.parameters()} == {torch.float64}
        runs[impl] = m
    bound = rounding_bound(torch.float64, len(data), 1e-3)
    assert max_rel_diff(runs["foreach"], runs["reference"]) < bound


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64])
def test_complex_parameters_are_refused(dtype):
    real = nn.Parameter(torch.zeros(3))
    other = torch.zeros(3, dtype=dtype)
    with pytest.raises(TypeError, match=r"param_groups\[0\]: parameter 1 is torch\."):
        AdaFisher([real, other])
    opt = AdaFisher.from_model(nn.Linear(3, 2))
    n = len(opt.param_groups)
    with pytest.raises(TypeError, match="complex"):
        opt.add_param_group({"params": [other]})
    assert len(opt.param_groups) == n


# ------------------------------------------------------------------------ torch flags


def test_torch_flags_at_their_defaults_and_foreach_fused_switches():
    """The flags that wrappers (timm's create_optimizer_v2, say) pass are accepted at
    their defaults; foreach / fused choose the implementation."""
    model = nn.Linear(3, 2)
    defaults = dict(maximize=False, foreach=None, fused=None, capturable=False)
    assert AdaFisherW.from_model(model, differentiable=False, **defaults).impl is None
    for flags, impl in (
        ({"foreach": True}, "foreach"),
        ({"foreach": False}, "reference"),
        ({"fused": True}, "triton"),
        ({"fused": False}, "foreach"),
        ({"impl": "foreach", "foreach": True}, "foreach"),
    ):
        opt = AdaFisherW.from_model(model, lr=1e-3, weight_decay=0.05, **flags)
        assert opt.impl == impl
        assert opt.collector.impl == impl
    for flags, match in (
        ({"differentiable": True}, "differentiable=True is not supported"),
        ({"capturable": True}, "capturable=True is not supported"),
        ({"impl": "triton", "foreach": True}, "impl='triton' and foreach=True"),
        ({"foreach": True, "fused": True}, "foreach=True and fused=True"),
    ):
        with pytest.raises(ValueError, match=match):
            AdaFisherW.from_model(model, **flags)


@pytest.mark.parametrize("impl", ["reference", "foreach"])
def test_maximize_ascends(impl):
    """maximize=True on a loss takes exactly the steps of maximize=False on its negative
    (the Fisher statistics square the output gradients: the sign leaves them alone)."""
    torch.manual_seed(0)
    model = small_cnn()
    twin = copy.deepcopy(model)
    kwargs = dict(lr=1e-2, weight_decay=1e-2, update_every=2, impl=impl)
    ascend = AdaFisher.from_model(model, maximize=True, **kwargs)
    descend = AdaFisher.from_model(twin, **kwargs)
    assert descend.param_groups[0]["maximize"] is False
    for x, y in batches(4, seed=11):
        (-F.cross_entropy(model(x), y)).backward()
        ascend.step()
        ascend.zero_grad()
        F.cross_entropy(twin(x), y).backward()
        descend.step()
        descend.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


# ----------------------------------------------------------------------------- copies


def test_deepcopy_steps_like_the_original():
    """A deep copy holds its own parameters, state and factors: given the same
    gradients it takes the same step, and leaves the original alone."""
    torch.manual_seed(0)
    model = small_cnn()
    opt = AdaFisherW.from_model(model, lr=1e-2, weight_decay=1e-2, update_every=1000)
    train(model, opt, batches(2, seed=12))
    x, y = batches(1, seed=13)[0]
    F.cross_entropy(model(x), y).backward()
    twin = copy.deepcopy(opt)
    assert twin.collector is not opt.collector and twin.update_every == 1000
    for p, q in zip(flat_params(opt), flat_params(twin), strict=True):
        assert q is not p
        q.grad = p.grad.clone()
    before = [p.detach().clone() for p in flat_params(opt)]
    twin.step()
    assert all(torch.equal(b, p) for b, p in zip(before, flat_params(opt), strict=True))
    opt.step()
    for p, q in zip(flat_params(opt), flat_params(twin), strict=True):
        assert torch.equal(p, q)


def test_pickle_round_trip_steps_like_the_original():
    """An optimizer without a collector (F = 1) pickles with its hyperparameters."""
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]
    with pytest.warns(UserWarning, match="F = 1"):
        opt = AdaFisher(params, lr=1e-2, beta=0.8, weight_decay=0.1, impl="foreach")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    copy_ = pickle.loads(pickle.dumps(opt))
    assert (copy_.impl, copy_.config, copy_.fisher_steps) == ("foreach", opt.config, 1)
    for p, q in zip(flat_params(opt), flat_params(copy_), strict=True):
        q.grad = p.grad.clone()
    opt.step()
    copy_.step()
    for p, q in zip(flat_params(opt), flat_params(copy_), strict=True):
        assert torch.equal(p, q)


# ----------------------------------------------------------------------- state dicts


def test_another_optimizers_state_is_refused_by_name():
    model = nn.Linear(3, 2)
    adamw = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    adamw.step()
    opt = AdaFisherW.from_model(model, list(model.parameters()))
    with pytest.raises(ValueError, match=r"param group 0 has no \['beta', 'damping'\]"):
        opt.load_state_dict(adamw.state_dict())
    # AdaFisher's param groups around AdamW's per-parameter state
    mixed = adamw.state_dict()
    mixed["param_groups"] = opt.state_dict()["param_groups"]
    with pytest.raises(ValueError, match=r"parameter 0 has no \['momentum'\]"):
        opt.load_state_dict(mixed)


def saved(opt: torch.optim.Optimizer) -> dict:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_older_state_formats_load_and_resume_exactly():
    """torch's older format (each ``step`` a Python number) and a state dict written
    before the ``maximize`` flag existed both load; the resumed run is the straight one."""
    torch.manual_seed(0)
    data = batches(6, seed=14)
    model = small_cnn()
    straight = copy.deepcopy(model)
    opt = AdaFisherW.from_model(straight, lr=1e-2, weight_decay=1e-3, update_every=2)
    train(straight, opt, data)

    first = copy.deepcopy(model)
    opt1 = AdaFisherW.from_model(first, lr=1e-2, weight_decay=1e-3, update_every=2)
    train(first, opt1, data[:3])
    state = saved(opt1)
    for entry in state["state"].values():
        entry["step"] = entry["step"].item()
    for group in state["param_groups"]:
        del group["maximize"]
    opt2 = AdaFisherW.from_model(first, lr=1e-2, weight_decay=1e-3, update_every=2)
    opt2.load_state_dict(state)
    assert all(group["maximize"] is False for group in opt2.param_groups)
    step = opt2.state[first[0].weight]["step"]
    assert step.dtype == torch.float32 and step.item() == 3.0
    train(first, opt2, data[3:])
    for p, q in zip(straight.parameters(), first.parameters(), strict=True):
        assert torch.equal(p, q)


def test_float64_momentum_survives_a_resume():
    model = nn.Linear(4, 2).double()
    opt = AdaFisher.from_model(model, lr=1e-2)
    model(torch.randn(3, 4, dtype=torch.float64)).square().sum().backward()
    opt.step()
    opt2 = AdaFisher.from_model(model, lr=1e-2)
    opt2.load_state_dict(saved(opt))
    momentum = opt2.state[model.weight]["momentum"]
    assert momentum.dtype == torch.float64
    assert torch.equal(momentum, opt.state[model.weight]["momentum"])
    assert momentum is not opt.state[model.weight]["momentum"]


# ------------------------------------------------------------------------- step plans


def test_fused_steps_reuse_their_tables():
    """The optimizer binds the fused update once: later steps with new gradient tensors
    (zero_grad(set_to_none=True)) reload only the gradient table."""
    pytest.importorskip("triton")
    model = small_cnn()
    opt = AdaFisherW.from_model(model, lr=1e-3, update_every=1000, impl="triton")
    clear_cache()
    train(model, opt, batches(3, seed=15))
    # one table set per param group (one device), built at the first step only
    assert cache_info()["plans"] == len(opt.param_groups) == 2
