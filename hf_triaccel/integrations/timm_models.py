"""CIFAR-stem variants of timm models, registered in timm's model registry.

ImageNet stems shrink a 32x32 image to 8x8 (ResNet: stride-2 7x7 convolution plus
max-pool) or 16x16 (EfficientNet: stride-2 stem) before the first block, which costs
several points of accuracy on CIFAR-sized images. The variants here keep the body of
the timm model and only make the stem stride 1:

- ``resnet18_cifar``: timm ``resnet18`` with a 3x3 stride-1 ``conv1`` and no max-pool.
- ``efficientnet_b0_cifar``: timm ``efficientnet_b0`` with a stride-1 ``conv_stem``.

Both default to 10 classes; ``num_classes`` and timm's other model arguments pass through.
``pretrained=True`` loads the ImageNet weights of the base model; a stem whose weight
shape changes (the ResNet's) starts freshly initialised.

This is the one module of the package that imports timm.

Example:
    >>> import timm, torch
    >>> register_cifar_models()
    >>> model = timm.create_model("resnet18_cifar", num_classes=10)
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import timm
from timm.models import register_model
from torch import nn

_CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def _cifar_cfg(first_conv: str, classifier: str) -> dict[str, Any]:
    return {
        "url": "",
        "num_classes": 10,
        "input_size": (3, 32, 32),
        "pool_size": None,
        "crop_pct": 1.0,
        "interpolation": "bilinear",
        "mean": _CIFAR10_MEAN,
        "std": _CIFAR10_STD,
        "first_conv": first_conv,
        "classifier": classifier,
        "license": "apache-2.0",
    }


# Read by timm's register_model: it files these as the models' pretrained configs, so
# timm.data.resolve_data_config(model=...) gives 32x32 inputs and CIFAR statistics.
default_cfgs: dict[str, dict[str, Any]] = {
    "resnet18_cifar": _cifar_cfg("conv1", "fc"),
    "efficientnet_b0_cifar": _cifar_cfg("conv_stem", "classifier"),
}


def _finish(model: nn.Module, name: str, reduction_divisor: int) -> nn.Module:
    """Attaches the CIFAR config and rescales ``feature_info`` to the new stem stride."""
    cfg = dict(timm.models.get_pretrained_cfg(name).to_dict())
    cfg["num_classes"] = model.num_classes
    model.pretrained_cfg = model.default_cfg = cfg
    for info in getattr(model, "feature_info", []):
        info["reduction"] = max(1, info["reduction"] // reduction_divisor)
    return model


def resnet18_cifar(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """timm ``resnet18`` with a 3x3 stride-1 ``conv1`` and no max-pool (32x32 inputs).

    Args:
        pretrained: load the base model's ImageNet weights (``conv1`` starts fresh).
        **kwargs: timm model arguments (``num_classes`` defaults to 10).

    Example:
        >>> resnet18_cifar(num_classes=100).conv1.stride
        (1, 1)
    """
    kwargs.setdefault("num_classes", 10)
    model = timm.create_model("resnet18", pretrained=pretrained, **kwargs)
    old = model.conv1
    model.conv1 = nn.Conv2d(old.in_channels, old.out_channels, 3, 1, 1, bias=False)
    # the initialisation timm's ResNet gives its convolutions
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    # conv1 (stride 2) and the max-pool (stride 2) are gone: every reduction is 4x smaller
    return _finish(model, "resnet18_cifar", 4)


def efficientnet_b0_cifar(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """timm ``efficientnet_b0`` with a stride-1 stem convolution (32x32 inputs).

    Args:
        pretrained: load the base model's ImageNet weights (the stem keeps its weights).
        **kwargs: timm model arguments (``num_classes`` defaults to 10).

    Example:
        >>> efficientnet_b0_cifar().conv_stem.stride
        (1, 1)
    """
    kwargs.setdefault("num_classes", 10)
    model = timm.create_model("efficientnet_b0", pretrained=pretrained, **kwargs)
    # timm pads the 3x3 stem by 1 at stride 2, which is also the right padding at stride 1
    model.conv_stem.stride = (1, 1)
    return _finish(model, "efficientnet_b0_cifar", 2)


_ENTRYPOINTS: tuple[Callable[..., nn.Module], ...] = (resnet18_cifar, efficientnet_b0_cifar)


def register_cifar_models() -> list[str]:
    """Registers the CIFAR variants with timm; calling it again does nothing.

    Returns:
        The registered model names.

    Example:
        >>> register_cifar_models()
        ['resnet18_cifar', 'efficientnet_b0_cifar']
        >>> timm.create_model("efficientnet_b0_cifar").num_classes
        10
    """
    for fn in _ENTRYPOINTS:
        # timm warns and replaces on a second registration: register only once
        if not timm.models.is_model(fn.__name__):
            register_model(fn)
    return [fn.__name__ for fn in _ENTRYPOINTS]


def create_cifar_model(name: str = "resnet18_cifar", **kwargs: Any) -> nn.Module:
    """Registers the CIFAR variants if needed and builds one with ``timm.create_model``.

    Args:
        name: a registered model name (any timm model works too).
        **kwargs: passed to ``timm.create_model`` (``num_classes``, ``drop_rate``, ...).

    Example:
        >>> create_cifar_model("resnet18_cifar", num_classes=100).fc.out_features
        100
    """
    register_cifar_models()
    return timm.create_model(name, **kwargs)
