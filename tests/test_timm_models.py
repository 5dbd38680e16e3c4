"""The CIFAR / Tiny-ImageNet timm models: registration, shapes and strides, and saving and
loading with timm's own functions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

timm = pytest.importorskip("timm")

from safetensors.torch import load_file  # noqa: E402

from hf_triaccel.integrations.timm_models import (  # noqa: E402
    MODEL_NAMES,
    contiguous_weights,
    create_cifar_model,
    save_model,
)

INPUT = {"resnet18_cifar": 32, "efficientnet_b0_cifar": 32, "resnet18_tiny": 64}


# a fresh interpreter, outside the checkout (whose folder would shadow the installed
# package); the package comes from sys.argv[1]. timm has *_tiny models of its own, so the
# check is for ours.
_REGISTRIES = """
import sys
sys.path.insert(0, sys.argv[1])
import timm, timm.optim

def registries():
    return set(timm.list_models()), set(timm.optim.list_optimizers())

before = registries()
import hf_triaccel
from hf_triaccel import AdaFisherW, TriAccelArguments, TriAccelTrainer
assert registries() == before, "import hf_triaccel changed timm's registries"
import hf_triaccel.integrations.timm_models
print(sorted(timm.list_models(sys.argv[2:])), hf_triaccel.__file__)
"""


def test_import_leaves_timm_alone_until_a_timm_name_is_used(tmp_path):
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", _REGISTRIES, root, *MODEL_NAMES],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    names, package = out.stdout.split("\n")[-2].rsplit(" ", 1)
    assert names == str(sorted(MODEL_NAMES)) and package.startswith(root)
    assert set(MODEL_NAMES) == set(INPUT)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_models_give_logits_at_their_input_size(name):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10).eval()
    size = INPUT[name]
    with torch.no_grad():
        logits = model(torch.randn(2, 3, size, size))
    assert logits.shape == (2, 10) and torch.isfinite(logits).all()
    assert model.pretrained_cfg["input_size"] == (3, size, size)
    assert timm.data.resolve_model_data_config(model)["input_size"] == (3, size, size)


def test_default_classes():
    assert timm.create_model("resnet18_cifar").num_classes == 10
    assert timm.create_model("efficientnet_b0_cifar").num_classes == 10
    assert timm.create_model("resnet18_tiny").num_classes == 200


def test_resnet18_cifar_stem():
    model = create_cifar_model("resnet18_cifar")
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    # only the stem differs from timm's resnet18 (7x7 -> 3x3 conv1)
    stock = timm.create_model("resnet18", num_classes=10)
    extra = sum(p.numel() for p in stock.parameters()) - sum(p.numel() for p in model.parameters())
    assert extra == 64 * 3 * (7 * 7 - 3 * 3)
    assert [f["reduction"] for f in model.feature_info] == [1, 1, 2, 4, 8]
    # the spatial size reaches the last stage at 4x4 instead of 1x1
    assert model.forward_features(torch.zeros(1, 3, 32, 32)).shape == (1, 512, 4, 4)


def test_resnet18_tiny_downsamples_once_before_the_blocks():
    model = create_cifar_model("resnet18_tiny")
    assert model.conv1.stride == (1, 1) and model.maxpool.stride == 2
    assert [info["reduction"] for info in model.feature_info] == [1, 2, 4, 8, 16]
    assert model.forward_features(torch.zeros(1, 3, 64, 64)).shape == (1, 512, 4, 4)


def test_efficientnet_b0_cifar_stem():
    model = create_cifar_model("efficientnet_b0_cifar", num_classes=100)
    assert model.conv_stem.stride == (1, 1) and model.num_classes == 100
    assert model.forward_features(torch.zeros(1, 3, 32, 32)).shape[-2:] == (2, 2)


def test_smaller_resnets_through_timm_arguments():
    model = create_cifar_model("resnet18_cifar", layers=(1, 1, 1, 1), channels=(8, 16, 32, 64))
    assert model.num_features == 64 and len(model.layer1) == 1


def test_a_bare_name_has_no_weights_to_load():
    with pytest.raises(RuntimeError, match="No pretrained weights exist for resnet18_cifar"):
        timm.create_model("resnet18_cifar", pretrained=True)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_saved_model_loads_back_with_timm_alone(name, tmp_path):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=3).eval()
    size = INPUT[name]
    save_model(
        model,
        tmp_path,
        label_names=["cat", "dog", "bird"],
        mean=(0.5, 0.4, 0.3),
        std=(0.2, 0.2, 0.2),
        input_size=(3, size, size),
    )
    loaded = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    assert type(loaded) is type(model) and loaded.num_classes == 3
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    cfg = loaded.pretrained_cfg
    assert cfg["label_names"] == ["cat", "dog", "bird"]
    assert list(cfg["mean"]) == [0.5, 0.4, 0.3] and list(cfg["std"]) == [0.2, 0.2, 0.2]
    assert list(cfg["input_size"]) == [3, size, size]
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    # saving leaves the model's own config as it was
    assert model.pretrained_cfg["mean"] != (0.5, 0.4, 0.3)


def test_a_channels_last_model_saves_contiguous_weights(tmp_path):
    model = timm.create_model("resnet18_cifar", num_classes=2).to(memory_format=torch.channels_last)
    assert not model.conv1.weight.is_contiguous()
    save_model(model, tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert all(tensor.is_contiguous() for tensor in saved.values())
    assert torch.equal(saved["conv1.weight"], model.conv1.weight)
    # the model keeps its memory format
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    loaded = timm.create_model(f"local-dir:{tmp_path}", pretrained=True)
    assert torch.equal(loaded.layer4[1].conv2.weight, model.layer4[1].conv2.weight)


def test_contiguous_weights_restores_the_originals_after_an_error():
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    storage, strides = conv.weight.data_ptr(), conv.weight.stride()
    with pytest.raises(KeyError), contiguous_weights(conv):
        assert conv.weight.is_contiguous() and conv.weight.data_ptr() != storage
        raise KeyError
    assert (conv.weight.data_ptr(), conv.weight.stride()) == (storage, strides)
