"""CIFAR and Tiny-ImageNet variants of timm models, registered in timm's model registry,
and saving a trained one so that timm alone loads it back.

ImageNet stems shrink a 32x32 image to 8x8 (ResNet: stride-2 7x7 convolution plus
max-pool) or 16x16 (EfficientNet: stride-2 stem) before the first block, which costs
several points of accuracy on small images. The variants keep the body of the timm model
and only change the stem:

- ``resnet18_cifar``: timm ``resnet18`` with a 3x3 stride-1 ``conv1`` and no max-pool
  (32x32 images, 10 classes by default).
- ``efficientnet_b0_cifar``: timm ``efficientnet_b0`` with a stride-1 ``conv_stem``
  (32x32 images, 10 classes by default).
- ``resnet18_tiny``: ``resnet18_cifar`` with the stride-2 max-pool kept, so that on 64x64
  Tiny-ImageNet images (200 classes by default) its first block sees 32x32 maps.

Importing this module registers them, as timm's own model modules do (``import
hf_triaccel`` alone leaves timm as it is). They are built by timm's own machinery, so
``timm.create_model`` rebuilds a saved one from its ``config.json`` and loads its weights:
:func:`save_model` writes the folder with ``timm.models.save_for_hf``, and
``timm.create_model("local-dir:FOLDER", pretrained=True)`` or
``timm.create_model("hf-hub:user/name", pretrained=True)`` loads it.
``pretrained=True`` on a bare name has no weights to load: these models train from
scratch.

Example:
    >>> import timm, torch
    >>> model = timm.create_model("resnet18_cifar", num_classes=10)
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import timm
from timm.models import build_model_with_cfg, register_model, resolve_pretrained_cfg
from timm.models.resnet import BasicBlock, ResNet
from torch import nn

from hf_triaccel.integrations.layout import contiguous_weights

_CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR10_STD = (0.2470, 0.2435, 0.2616)
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def _cfg(first_conv: str, classifier: str, num_classes: int, size: int, mean, std) -> dict:
    return {
        "url": "",
        "num_classes": num_classes,
        "input_size": (3, size, size),
        "pool_size": None,
        "crop_pct": 1.0,
        "interpolation": "bilinear",
        "mean": mean,
        "std": std,
        "first_conv": first_conv,
        "classifier": classifier,
        "license": "apache-2.0",
    }


# Read by timm's register_model: it files these as the models' pretrained configs, so
# timm.data.resolve_data_config(model=...) gives the input size and statistics; a saved
# model's config.json replaces the statistics with those of its training set.
default_cfgs: dict[str, dict[str, Any]] = {
    "resnet18_cifar": _cfg("conv1", "fc", 10, 32, _CIFAR10_MEAN, _CIFAR10_STD),
    "efficientnet_b0_cifar": _cfg("conv_stem", "classifier", 10, 32, _CIFAR10_MEAN, _CIFAR10_STD),
    "resnet18_tiny": _cfg("conv1", "fc", 200, 64, _IMAGENET_MEAN, _IMAGENET_STD),
}
MODEL_NAMES = tuple(default_cfgs)


class SmallImageResNet(ResNet):
    """timm's ``ResNet`` with a 3x3 stride-1 stem convolution, for small images.

    Args:
        keep_maxpool: keep the stride-2 max-pool after the stem (Tiny-ImageNet); without
            it (CIFAR) the first block works at the input resolution.
        **kwargs: ``ResNet`` arguments (``block``, ``layers``, ``num_classes``, ``channels``...).

    Example:
        >>> model = SmallImageResNet(block=BasicBlock, layers=(1, 1, 1, 1), num_classes=3)
        >>> model.conv1.stride, type(model.maxpool).__name__
        ((1, 1), 'Identity')
    """

    def __init__(self, *, keep_maxpool: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        old = self.conv1
        self.conv1 = nn.Conv2d(old.in_channels, old.out_channels, 3, 1, 1, bias=False)
        # the initialisation timm's ResNet gives its convolutions
        nn.init.kaiming_normal_(self.conv1.weight, mode="fan_out", nonlinearity="relu")
        if not keep_maxpool:
            self.maxpool = nn.Identity()
        # the stride-2 conv1 is gone (and the stride-2 max-pool unless kept)
        divisor = 2 if keep_maxpool else 4
        for info in self.feature_info:
            info["reduction"] = max(1, info["reduction"] // divisor)


def _small_resnet(variant: str, pretrained: bool, keep_maxpool: bool, **kwargs: Any) -> ResNet:
    kwargs.setdefault("layers", (2, 2, 2, 2))
    return build_model_with_cfg(
        SmallImageResNet, variant, pretrained, block=BasicBlock, keep_maxpool=keep_maxpool, **kwargs
    )


@register_model
def resnet18_cifar(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """timm ``resnet18`` with a 3x3 stride-1 ``conv1`` and no max-pool (32x32 inputs).

    Args:
        pretrained: load the weights the pretrained config points to (a saved model's
            folder or Hub repository, see :func:`save_model`).
        **kwargs: timm model arguments (``num_classes`` defaults to 10; ``layers``,
            ``channels``, ``stem_width`` make it smaller or larger).

    Example:
        >>> resnet18_cifar(num_classes=100).conv1.stride
        (1, 1)
    """
    return _small_resnet("resnet18_cifar", pretrained, keep_maxpool=False, **kwargs)


@register_model
def resnet18_tiny(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """timm ``resnet18`` for 64x64 images (Tiny-ImageNet): a 3x3 stride-1 ``conv1``, then
    the stride-2 max-pool, so the first block sees 32x32 maps as on CIFAR.

    Args:
        pretrained: as for :func:`resnet18_cifar`.
        **kwargs: timm model arguments (``num_classes`` defaults to 200).

    Example:
        >>> import torch
        >>> resnet18_tiny()(torch.zeros(2, 3, 64, 64)).shape
        torch.Size([2, 200])
    """
    return _small_resnet("resnet18_tiny", pretrained, keep_maxpool=True, **kwargs)


@register_model
def efficientnet_b0_cifar(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """timm ``efficientnet_b0`` with a stride-1 stem convolution (32x32 inputs).

    Built by timm's ``efficientnet_b0`` entry point under this model's pretrained config,
    which is where the weights load from; the stride change leaves every weight's shape.

    Args:
        pretrained: as for :func:`resnet18_cifar`.
        **kwargs: timm model arguments (``num_classes`` defaults to 10).

    Example:
        >>> efficientnet_b0_cifar().conv_stem.stride
        (1, 1)
    """
    cfg = resolve_pretrained_cfg(
        "efficientnet_b0_cifar",
        pretrained_cfg=kwargs.pop("pretrained_cfg", None),
        pretrained_cfg_overlay=kwargs.pop("pretrained_cfg_overlay", None),
    ).to_dict()
    kwargs.setdefault("num_classes", cfg["num_classes"])
    model = timm.create_model(
        "efficientnet_b0", pretrained=pretrained, pretrained_cfg=cfg, **kwargs
    )
    # timm pads the 3x3 stem by 1 at stride 2, which is also the right padding at stride 1
    model.conv_stem.stride = (1, 1)
    for info in model.feature_info:
        info["reduction"] = max(1, info["reduction"] // 2)
    return model


def create_cifar_model(name: str = "resnet18_cifar", **kwargs: Any) -> nn.Module:
    """``timm.create_model`` for this module's models (any timm name works too).

    Example:
        >>> create_cifar_model("resnet18_cifar", num_classes=100).fc.out_features
        100
    """
    return timm.create_model(name, **kwargs)


def save_model(
    model: nn.Module,
    folder: str | os.PathLike,
    *,
    label_names: Sequence[str] | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    input_size: Sequence[int] | None = None,
) -> None:
    """Saves a timm model with ``timm.models.save_for_hf``: ``model.safetensors`` (contiguous
    weights, see :func:`contiguous_weights`) and ``config.json`` (architecture, classes,
    class names, input size and normalisation).

    ``timm.create_model("local-dir:FOLDER", pretrained=True)`` loads it back, and so does
    ``timm.create_model("hf-hub:user/name", pretrained=True)`` once the folder is on the Hub
    (after importing this module, which registers its architectures).

    Args:
        model: a model built by ``timm.create_model``.
        folder: where to write (created if needed).
        label_names: one name per class, stored as timm's ``label_names``.
        mean: per-channel input mean the model was trained with, in [0, 1] units.
        std: per-channel input standard deviation, same units.
        input_size: ``(channels, height, width)`` the model was trained at.

    Example:
        >>> import tempfile
        >>> model = timm.create_model("resnet18_cifar", num_classes=2)
        >>> folder = tempfile.mkdtemp()
        >>> save_model(model, folder, label_names=["cat", "dog"], mean=(0.5,) * 3, std=(0.25,) * 3)
        >>> loaded = timm.create_model(f"local-dir:{folder}", pretrained=True)
        >>> loaded.pretrained_cfg["label_names"], loaded.pretrained_cfg["mean"]
        (['cat', 'dog'], [0.5, 0.5, 0.5])
    """
    updates = {"mean": mean, "std": std, "input_size": input_size}
    updates = {key: tuple(value) for key, value in updates.items() if value is not None}
    original = model.pretrained_cfg
    # save_for_hf writes the model's pretrained config: give it the training figures
    model.pretrained_cfg = {**original, **updates}
    try:
        with contiguous_weights(model):
            timm.models.save_for_hf(
                model,
                folder,
                model_config={"label_names": list(label_names)} if label_names else None,
                safe_serialization=True,
            )
    finally:
        model.pretrained_cfg = original
