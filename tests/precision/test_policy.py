"""PrecisionPolicy: rule matching order, normalisation layers, bands and the margin."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_triaccel.precision import PrecisionPolicy, PrecisionRule, as_precision, is_normalisation


class LlamaRMSNorm(nn.Module):
    """A normalisation layer that does not subclass torch's (recognised by its name)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


def test_first_matching_rule_wins_in_the_order_given():
    policy = PrecisionPolicy(
        rules=[("encoder.0", "fp16"), ("encoder.*", "bf16"), (nn.Linear, "fp32")]
    )
    linear = nn.Linear(2, 2)
    assert policy.fixed("encoder.0", linear) == ("fp16", "rule")
    assert policy.fixed("encoder.1", linear) == ("bf16", "rule")
    assert policy.fixed("decoder.1", linear) == ("fp32", "rule")
    assert policy.fixed("decoder.1", nn.Conv2d(1, 1, 1)) is None
    reordered = PrecisionPolicy(rules=[(nn.Linear, "fp32"), ("encoder.0", "fp16")])
    assert reordered.fixed("encoder.0", linear) == ("fp32", "rule")


def test_normalisation_layers_stay_fp32_whatever_the_rules():
    policy = PrecisionPolicy(rules=[("*", "fp16"), ((nn.LayerNorm, nn.BatchNorm2d), "bf16")])
    for module in (nn.LayerNorm(4), nn.BatchNorm2d(4), nn.GroupNorm(2, 4), nn.RMSNorm(4)):
        assert policy.fixed("anything", module) == ("fp32", "norm")
    assert is_normalisation(LlamaRMSNorm())
    assert policy.fixed("x", LlamaRMSNorm()) == ("fp32", "norm")
    assert not is_normalisation(nn.Linear(2, 2))


def test_rules_accept_dtypes_and_reject_unknown_precisions():
    assert PrecisionRule("a", torch.float16).precision == "fp16"
    assert as_precision("bfloat16") == "bf16"
    with pytest.raises(ValueError):
        PrecisionRule("a", "fp8")
    with pytest.raises(TypeError):
        PrecisionRule(3, "fp32")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(fp32_fraction=0.7, fp16_fraction=0.5),
        dict(fp32_fraction=-0.1),
        dict(margin=0.5),
        dict(patience=0),
    ],
)
def test_invalid_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        PrecisionPolicy(**kwargs)


def test_bands_and_margin():
    policy = PrecisionPolicy(fp32_fraction=0.25, fp16_fraction=0.25, margin=0.05)
    assert [policy.propose(q, None) for q in (0.1, 0.3, 0.7, 0.8)] == [
        "fp32",
        "bf16",
        "bf16",
        "fp16",
    ]
    # inside the margin of the boundary: stay
    assert policy.propose(0.28, "fp32") == "fp32"
    assert policy.propose(0.22, "bf16") == "bf16"
    assert policy.propose(0.72, "fp16") == "fp16"
    assert policy.propose(0.78, "bf16") == "bf16"
    # beyond it: move, possibly across two bands
    assert policy.propose(0.31, "fp32") == "bf16"
    assert policy.propose(0.19, "bf16") == "fp32"
    assert policy.propose(0.9, "fp32") == "fp16"
    assert policy.propose(0.1, "fp16") == "fp32"
    assert PrecisionPolicy(fp16_fraction=0.0).propose(0.99, None) == "bf16"
