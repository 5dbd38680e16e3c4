"""CIFAR-stem timm models: registration, shapes and strides."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
from torch import nn

from hf_triaccel.integrations.timm_models import create_cifar_model, register_cifar_models

NAMES = ["resnet18_cifar", "efficientnet_b0_cifar"]


def test_registering_twice_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert register_cifar_models() == NAMES
        assert register_cifar_models() == NAMES
    assert set(NAMES) <= set(timm.list_models("*_cifar"))


@pytest.mark.parametrize("name", NAMES)
def test_models_give_logits_on_32x32(name):
    register_cifar_models()
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10).eval()
    with torch.no_grad():
        logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10)
    assert torch.isfinite(logits).all()
    assert model.pretrained_cfg["input_size"] == (3, 32, 32)
    data_cfg = timm.data.resolve_data_config(model=model)
    assert data_cfg["input_size"] == (3, 32, 32)


def test_resnet18_cifar_stem():
    model = create_cifar_model("resnet18_cifar")
    assert model.conv1.kernel_size == (3, 3)
    assert model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    assert model.num_classes == 10
    # only the stem differs from timm's resnet18 (7x7 -> 3x3 conv1)
    stock = timm.create_model("resnet18", num_classes=10)
    extra = sum(p.numel() for p in stock.parameters()) - sum(p.numel() for p in model.parameters())
    assert extra == 64 * 3 * (7 * 7 - 3 * 3)
    assert [f["reduction"] for f in model.feature_info] == [1, 1, 2, 4, 8]
    # the spatial size reaches the last stage at 4x4 instead of 1x1
    features = model.forward_features(torch.zeros(1, 3, 32, 32))
    assert features.shape == (1, 512, 4, 4)


def test_efficientnet_b0_cifar_stem():
    model = create_cifar_model("efficientnet_b0_cifar", num_classes=100)
    assert model.conv_stem.stride == (1, 1)
    assert model.num_classes == 100
    features = model.forward_features(torch.zeros(1, 3, 32, 32))
    assert features.shape[-2:] == (2, 2)
