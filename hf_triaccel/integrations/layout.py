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

FSDP2's ``fully_shard`` refuses non-contiguous parameters, and gathers the ones it shards
into contiguous storage for each forward: under FSDP2 the parameters stay contiguous, and
convolutions run in channels_last in one of two arrangements (``FSDP2_LAYOUTS``, chosen
by the ``HF_TRIACCEL_FSDP2_CHANNELS_LAST`` environment variable):

* ``"weights"`` (the default, the faster of the two in BENCHMARKS.md's "FSDP2" section):
  the format applied after sharding: the image batches are channels_last and each 2-D
  convolution takes a channels-last copy of its weight as FSDP2 gathered it, in its
  forward (:class:`ChannelsLastWeights`);
* ``"inputs"``: the weights stay contiguous and the image batches are channels_last; a
  convolution follows its input's memory format and converts the weight itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hf_triaccel.curvature.collection.sharding import is_sharded

_CONVOLUTIONS = (nn.Conv2d, nn.ConvTranspose2d)  # timm's and transformers' subclass these

FSDP2_LAYOUTS = ("inputs", "weights")
FSDP2_LAYOUT_VARIABLE = "HF_TRIACCEL_FSDP2_CHANNELS_LAST"
DEFAULT_FSDP2_LAYOUT = "weights"  # the faster on an H200 (BENCHMARKS.md, "FSDP2")


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


def to_channels_last(
    model: nn.Module, *, fsdp2: bool | None = None, layout: str | None = None
) -> bool:
    """Puts the 4-D parameters and buffers of a model with a 2-D convolution in
    ``torch.channels_last``, in place (the parameter objects stay the same, so an
    optimizer built on them keeps working); a model without one is left as it is.

    Only 4-D tensors change: ``model.to(memory_format=torch.channels_last)`` would refuse
    a model that also holds 5-D tensors (3-D convolutions). Parameters already sharded by
    FSDP2 (DTensors) are left to it.

    Args:
        model: the model, converted in place.
        fsdp2: whether the model is, or will be, sharded with FSDP2 (default:
            :func:`shards_with_fsdp2`). Its parameters then stay contiguous, as
            ``fully_shard`` requires, and the arrangement ``layout`` applies.
        layout: under FSDP2, one of ``FSDP2_LAYOUTS`` (default: :func:`fsdp2_layout`).
            ``"weights"`` attaches :class:`ChannelsLastWeights` to the convolutions.

    Returns:
        Whether the model has a 2-D convolution: whether its batches are to be
        channels-last.

    Example:
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
        >>> to_channels_last(model, fsdp2=False), model[0].weight.is_contiguous()
        (True, False)
        >>> model[0].weight.is_contiguous(memory_format=torch.channels_last)
        True
        >>> to_channels_last(nn.Linear(4, 2))
        False
        >>> sharded = nn.Conv2d(3, 4, 3)
        >>> to_channels_last(sharded, fsdp2=True, layout="inputs"), sharded.weight.is_contiguous()
        (True, True)
    """
    if layout is not None and layout not in FSDP2_LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {FSDP2_LAYOUTS}")
    if not has_conv2d(model):
        return False
    fsdp2 = shards_with_fsdp2() if fsdp2 is None else fsdp2
    tensors = list(model.buffers()) if fsdp2 else [*model.parameters(), *model.buffers()]
    with torch.no_grad():
        for tensor in tensors:
            if tensor.dim() != 4 or is_sharded(tensor):
                continue
            if not tensor.is_contiguous(memory_format=torch.channels_last):
                tensor.data = tensor.data.contiguous(memory_format=torch.channels_last)
    if fsdp2 and (layout or fsdp2_layout()) == "weights":
        ChannelsLastWeights.attach(model)
    return True


def shards_with_fsdp2() -> bool:
    """Whether this run shards its model with FSDP2 (``torch.distributed.fsdp.fully_shard``)
    as Accelerate is set up: the initialised Accelerate state, else the environment
    ``accelerate launch`` sets for an FSDP configuration (``ACCELERATE_USE_FSDP=true``,
    ``FSDP_VERSION=2``).

    Example:
        >>> shards_with_fsdp2()  # a process no FSDP launch set up
        False
    """
    try:
        from accelerate.state import AcceleratorState, is_initialized
        from accelerate.utils import DistributedType
    except ImportError:  # accelerate is optional
        AcceleratorState = None
    if AcceleratorState is not None and is_initialized():
        state = AcceleratorState()
        plugin = getattr(state, "fsdp_plugin", None)
        version = getattr(plugin, "fsdp_version", 1)
        return state.distributed_type == DistributedType.FSDP and version == 2
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    return fsdp and os.environ.get("FSDP_VERSION", "1") == "2"


def fsdp2_layout() -> str:
    """The channels_last arrangement under FSDP2: the ``HF_TRIACCEL_FSDP2_CHANNELS_LAST``
    environment variable, else ``DEFAULT_FSDP2_LAYOUT`` (see the module doc).

    Example:
        >>> fsdp2_layout() in FSDP2_LAYOUTS
        True
    """
    layout = os.environ.get(FSDP2_LAYOUT_VARIABLE, DEFAULT_FSDP2_LAYOUT)
    if layout not in FSDP2_LAYOUTS:
        raise ValueError(f"{FSDP2_LAYOUT_VARIABLE}={layout!r} is not one of {FSDP2_LAYOUTS}")
    return layout


class ChannelsLastWeights:
    """Forward pre-hook and hook of a 2-D convolution whose parameters must stay
    contiguous (FSDP2): its forward computes with a channels-last copy of the weight as the
    module holds it then (under FSDP2 the gathered parameter), put back when the forward
    ends, even by an error. The copy is part of the autograd graph, so the weight's
    gradient comes back in the parameter's own layout.

    Example:
        >>> conv = nn.Conv2d(3, 4, 3)
        >>> ChannelsLastWeights.attach(conv)
        >>> seen = []
        >>> _ = conv.register_forward_pre_hook(lambda m, args: seen.append(m.weight.stride()))
        >>> _ = conv(torch.zeros(1, 3, 5, 5))
        >>> seen, conv.weight.is_contiguous()
        ([(27, 1, 9, 3)], True)
    """

    def __init__(self) -> None:
        self.held: torch.Tensor | None = None

    @classmethod
    def attach(cls, model: nn.Module) -> None:
        """Hooks every 2-D convolution of ``model`` that has none yet."""
        for module in model.modules():
            if isinstance(module, _CONVOLUTIONS) and not any(
                isinstance(getattr(h, "__self__", None), cls)
                for h in module._forward_pre_hooks.values()
            ):
                hook = cls()
                module.register_forward_pre_hook(hook.before)
                module.register_forward_hook(hook.after, always_call=True)

    def before(self, module: nn.Module, args: tuple) -> None:
        self.held = module._parameters["weight"]
        module._parameters["weight"] = self.held.contiguous(memory_format=torch.channels_last)

    def after(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.held is not None:
            module._parameters["weight"], self.held = self.held, None


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
