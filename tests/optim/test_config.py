"""AdaFisherConfig, the checks shared with the optimizer, torch's flags, and the one
parameter-group rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hf_triaccel.optim.config import (
    DEFAULT_LR,
    AdaFisherConfig,
    check_step_hyperparameters,
    impl_from_torch_flags,
)
from hf_triaccel.optim.groups import no_decay_names, param_groups


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("lr", -1.0, "needs >= 0"),
        ("lr", float("nan"), "needs >= 0"),
        ("beta", 1.0, "needs 0 <= beta < 1"),
        ("damping", 0.0, "needs > 0"),
        ("gamma", 0.0, "needs 0 < gamma < 1"),
        ("update_every", 0, "integer >= 1"),
        ("update_every", 2.0, "integer >= 1"),
        ("weight_decay", -0.1, "needs >= 0"),
        ("ema", "fast", "must be one of"),
        ("normalise", "scaled", r"must be one of \('absolute', 'relative'\)"),
        ("factor_init", "random", r"must be one of \('zeros', 'ones'\)"),
    ],
)
def test_config_errors_name_the_owner_and_field(field, value, why):
    with pytest.raises(ValueError, match=f"AdaFisherConfig.{field}=.*{why}"):
        AdaFisherConfig(**{field: value})
    config = AdaFisherConfig()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"TriAccelArguments.{field}="):
        config.validate("TriAccelArguments")


def test_config_defaults_and_kwargs():
    config = AdaFisherConfig()
    assert config.lr == DEFAULT_LR and config.resolved_update_every == 100
    assert AdaFisherConfig(ema="paper").resolved_update_every == 1
    assert set(config.optimizer_kwargs()) == {f.name for f in dataclasses.fields(config)}
    with pytest.raises(ValueError, match="AdaFisherConfig.impl: impl='cuda' is not one of"):
        AdaFisherConfig(impl="cuda")
    with pytest.raises(ValueError, match="one element"):
        AdaFisherConfig(lr=torch.ones(2))
    AdaFisherConfig(lr=torch.tensor(1e-3))


def test_step_checks_read_no_tensor_value():
    """A tensor learning rate is checked for its size only (reading it would
    synchronise with the device at every step)."""
    check_step_hyperparameters(torch.tensor(-1.0), 0.9, 0.0, 1e-3)
    with pytest.raises(ValueError, match=r"adafisher\.weight_decay=-1"):
        check_step_hyperparameters(1e-3, 0.9, -1, 1e-3, owner="adafisher")


@pytest.mark.parametrize(
    "impl, flags, expected",
    [
        (None, {}, None),
        ("auto", {}, None),
        ("Reference", {}, "reference"),
        (None, {"foreach": True}, "foreach"),
        (None, {"foreach": False}, "reference"),
        (None, {"fused": True}, "triton"),
        (None, {"fused": False}, "foreach"),
        (None, {"fused": False, "foreach": False}, "reference"),
        ("auto", {"foreach": True}, "foreach"),
        ("triton", {"fused": True}, "triton"),
        ("reference", {"fused": False}, "reference"),
    ],
)
def test_torch_flags_choose_the_implementation(impl, flags, expected):
    assert impl_from_torch_flags(impl, **flags) == expected


@pytest.mark.parametrize(
    "impl, flags, match",
    [
        ("triton", {"foreach": True}, "impl='triton' and foreach=True"),
        ("foreach", {"foreach": False}, "impl='foreach' and foreach=False"),
        (None, {"foreach": True, "fused": True}, "foreach=True and fused=True"),
        ("triton", {"fused": False}, "impl='triton' and fused=False"),
        (None, {"capturable": True}, "capturable=True"),
        (None, {"differentiable": True}, "differentiable=True"),
        ("cuda", {}, "not one of"),
    ],
)
def test_conflicting_or_unsupported_flags_are_refused(impl, flags, match):
    with pytest.raises(ValueError, match=match):
        impl_from_torch_flags(impl, owner="AdaFisherW", **flags)


class LlamaRMSNorm(nn.Module):  # a third-party norm, recognised by its name
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


def test_no_decay_on_biases_norms_and_vectors():
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(5, 4),
            "proj": nn.Linear(4, 4),
            "norm": LlamaRMSNorm(4),
            "ln": nn.LayerNorm(4, bias=False),
        }
    )
    model.register_parameter("scale", nn.Parameter(torch.ones(4)))  # a 1-D parameter
    model["proj"].weight.requires_grad_(False)  # frozen: in no group
    assert no_decay_names(model) == {"proj.bias", "norm.weight", "ln.weight", "scale"}
    decay, no_decay = param_groups(model, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert [id(p) for p in decay["params"]] == [id(model["embed"].weight)]
    assert {id(p) for p in no_decay["params"]} == {
        id(p) for n, p in model.named_parameters() if n in no_decay_names(model)
    }
    # an empty group is left out
    assert [g["weight_decay"] for g in param_groups(nn.LayerNorm(3), 0.1)] == [0.0]
