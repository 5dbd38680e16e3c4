"""Memory layout: convolutional models and their image batches in channels_last.

cuDNN's fastest convolutions for bf16 and fp16 take and give channels-last (NHWC) tensors;
fed the default NCHW layout, a convolutional network either runs slower kernels or pays
a layout conversion around each convolution (BENCHMARKS.md has the measured difference).
hf_triaccel therefore puts every model with a 2-D convolution, and the 4-D image batches
fed to it, in ``torch.channels_last`` by default; models without one are left as they are.

A channels-last convolution weight is not contiguous, and safetensors refuses to write
non-contiguous tensors: every save path goes through :func:`contiguous_weights`, which
gives the weights plain row-major storage while they are written (files then load into
either layout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

_CONVOLUTIONS = (nn.Conv2d, nn.ConvTranspose2d)  # timm's and transformers' subclass these


def has_conv2d(model: nn.Module) -> bool:
    """Whether ``model`` holds a 2-D convolution (``nn.Conv2d`` / ``nn.ConvTranspose2d`` or
    a subclass, such as timm's padded convolutions).

    Example:
        >>> has_conv2d(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))
        True
        >>> has_conv2d(nn.Linear(4, 2))
        False
    """
    return any(isinstance(m, _CONVOLUTIONS) for m in model.modules())


def to_channels_last(model: nn.Module) -> bool:
    """Puts the 4-D parameters and buffers of a model with a 2-D convolution in
    ``torch.channels_last``, in place (the parameter objects stay the same, so an
    optimizer built on them keeps working); a model without one is left as it is.

    Only 4-D tensors change: ``model.to(memory_format=torch.channels_last)`` would refuse
    a model that also holds 5-D tensors (3-D convolutions).

    Returns:
        Whether the model has a 2-D convolution (and is now channels-last).

    Example:
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
        >>> to_channels_last(model), model[0].weight.is_contiguous()
        (True, False)
        >>> model[0].weight.is_contiguous(memory_format=torch.channels_last)
        True
        >>> to_channels_last(nn.Linear(4, 2))
        False
    """
    if not has_conv2d(model):
        return False
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.dim() == 4 and not tensor.is_contiguous(memory_format=torch.channels_last):
                tensor.data = tensor.data.contiguous(memory_format=torch.channels_last)
    return True


def channels_last_batch(batch: Any) -> Any:
    """``batch`` with every 4-D floating-point or ``uint8`` tensor (images) in
    ``torch.channels_last``: a tensor, or the tensors of a mapping, list or tuple (one
    level deep); other entries (labels, masks, token ids) are returned as they are.

    A tensor already channels-last is returned without a copy.

    Example:
        >>> batch = {"pixel_values": torch.zeros(2, 3, 8, 8), "labels": torch.zeros(2)}
        >>> out = channels_last_batch(batch)
        >>> out["pixel_values"].is_contiguous(memory_format=torch.channels_last)
        True
        >>> out["labels"] is batch["labels"]
        True
    """
    if isinstance(batch, torch.Tensor):
        return _image_to_channels_last(batch)
    if isinstance(batch, Mapping):
        converted = {key: _image_to_channels_last(value) for key, value in batch.items()}
        if all(converted[key] is value for key, value in batch.items()):
            return batch
        if type(batch) is dict:
            return converted
        try:  # the batch's own mapping class (transformers' BatchFeature)
            return type(batch)(converted)
        except TypeError:
            return converted
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):  # not a namedtuple
        converted = [_image_to_channels_last(value) for value in batch]
        if all(new is old for new, old in zip(converted, batch, strict=True)):
            return batch
        return type(batch)(converted)
    return batch


def _image_to_channels_last(value: Any) -> Any:
    if (
        isinstance(value, torch.Tensor)
        and value.dim() == 4
        and (value.is_floating_point() or value.dtype == torch.uint8)
    ):
        return value.contiguous(memory_format=torch.channels_last)
    return value


@contextlib.contextmanager
def contiguous_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Gives every parameter and buffer of ``model`` contiguous storage for the duration
    (a copy where needed), then puts the originals back.

    safetensors refuses non-contiguous tensors, and a channels-last convolution weight is
    one: saving inside this context writes plain row-major weights that load into any
    memory format, while the model keeps its own layout afterwards.

    Example:
        >>> conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        >>> with contiguous_weights(conv):
        ...     conv.weight.is_contiguous()
        True
        >>> conv.weight.is_contiguous()
        False
    """
    swapped = []
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not tensor.is_contiguous():
                swapped.append((tensor, tensor.data))
                tensor.data = tensor.data.contiguous()
    try:
        yield model
    finally:
        for tensor, original in swapped:
            tensor.data = original
