"""Removable forward hooks that run one module in a chosen compute precision.

The pre-hook opens a ``torch.autocast`` region for the module's forward and the post-hook
closes it, so the innermost decision wins: a bf16 module inside an fp32 parent computes
in bf16, and the parent's own operations stay fp32. fp32 disables autocast (CPU and CUDA
autocast take half-precision dtypes only) and casts half-precision floating inputs to
float32; the parameters are float32, as under autocast mixed precision. The post-hook is
registered with ``always_call=True`` so that the region is closed even when the forward
raises.

A module computing in another dtype than the surrounding autocast runs with cuDNN
autotuning (``torch.backends.cudnn.benchmark``) off, in its forward and in the backward
of the operation that produced its output (a convolution's). Autotuning a convolution in
a dtype it has not run in before tries algorithms with large workspaces, which showed as
slower epochs and a higher peak memory when convolutions moved to fp32 (BENCHMARKS.md).
These modules are few and small by design (the policy bounds their share of the compute
and of the activations), so cuDNN's heuristic choice of algorithm costs little.

Outputs leave a module in the form the surrounding code expects: where autocast is off
around the module (an fp32 parent, or training without autocast), half-precision outputs
of a bf16/fp16 module are cast to float32, as the module would have returned them without
its region; under a surrounding autocast they are left as they are (autocast casts them
where needed). Under a surrounding autocast, an fp32 module's float32 outputs are handed
on in autocast's dtype: the layers after it compute in half precision anyway, and a
float32 output would make them save float32 copies for the backward pass. Likewise an
fp32 module saves its half-precision inputs for the backward, not their float32 copies
(:mod:`hf_triaccel.precision.saved`).

A bf16 module under bf16 autocast computes as it would unhooked, so its hooks return at
once: on a host-bound step every forward's Python work counts.

fp16 modules are watched for overflow without a host sync: the floating inputs and the
outputs of each forward are summed in float32 (two reductions), and the output sum is
added to a device accumulator when the input sum is finite. Finite fp16 values sum far
below the float32 limit, while an inf or NaN propagates, so the accumulator turns
non-finite exactly when the module produced a non-finite output from finite inputs --
modules downstream of an overflow are not blamed for it. The controller reads every
accumulator at once when it polls.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_triaccel.precision.containers import cast_floating, float32_sum, tensors, to_float32
from hf_triaccel.precision.policy import DTYPES
from hf_triaccel.precision.saved import HalfInputs, saved_hooks_free


def _device_type(module: nn.Module, args: tuple, kwargs: dict) -> str:
    """Where the module computes: its first input's device, else its parameters'.

    Read at every call (the model may move after hooking); the input comes first because
    it is the cheap look-up, a few microseconds less per forward than the parameters.
    """
    if args and isinstance(args[0], torch.Tensor):
        return args[0].device.type
    for t in tensors((args, kwargs)):
        return t.device.type
    for t in module.parameters():
        return t.device.type
    return "cpu"


def _untuned_backward(output: Any) -> None:
    """Turns cuDNN autotuning off while autograd runs the nodes that produced ``output``
    (for a convolution, its backward), and back on after each."""
    nodes = {id(t.grad_fn): t.grad_fn for t in tensors(output) if t.grad_fn is not None}
    for node in nodes.values():
        saved: list[bool] = []

        def off(grad_outputs, saved=saved):
            saved.append(torch.backends.cudnn.benchmark)
            torch.backends.cudnn.benchmark = False

        def restore(grad_inputs, grad_outputs, saved=saved):
            torch.backends.cudnn.benchmark = saved.pop()

        node.register_prehook(off)
        node.register_hook(restore)


# an active forward: region, device type, precision, fp16 input sum, untuned, fp32 inputs
_Region = tuple[torch.autocast, str, str, torch.Tensor | None, bool, HalfInputs | None]


class PrecisionHook:
    """The hooks that make one module compute in ``precision``.

    Args:
        module: the module to hook.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``; :attr:`precision` may be changed
            later, taking effect at the next forward.

    Attributes:
        overflow: float32 device accumulator of the module's fp16 outputs (``None`` until
            the first fp16 forward); non-finite once an output overflowed from finite
            inputs.

    Example:
        >>> layer = nn.Linear(4, 4)
        >>> hook = PrecisionHook(layer, "bf16")
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     layer(torch.randn(2, 4)).dtype
        torch.bfloat16
        >>> layer(torch.randn(2, 4)).dtype  # cast back where autocast is off around it
        torch.float32
        >>> hook.remove()
        >>> layer(torch.randn(2, 4)).dtype
        torch.float32
    """

    def __init__(self, module: nn.Module, precision: str) -> None:
        if precision not in DTYPES:
            raise ValueError(f"unknown precision {precision!r}")
        self.precision = precision
        self.overflow: torch.Tensor | None = None
        # per active forward; None where the module computes as it would unhooked
        self._regions: list[_Region | None] = []
        # prepended, so that a later pre-hook that raises still finds the region open
        self._handles = [
            module.register_forward_pre_hook(self._enter, with_kwargs=True, prepend=True),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict):
        precision = self.precision
        device_type = _device_type(module, args, kwargs)
        ambient = (
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else torch.float32
        )
        if precision == "bf16" and ambient == torch.bfloat16:
            self._regions.append(None)
            return None
        untuned = torch.backends.cudnn.benchmark and DTYPES[precision] != ambient
        if precision == "fp32":
            region = torch.autocast(device_type, enabled=False)
        else:
            region = torch.autocast(device_type, dtype=DTYPES[precision])
        in_sum = None
        if precision == "fp16":
            with torch.no_grad():
                in_sum = float32_sum((args, kwargs))
        inputs = HalfInputs() if precision == "fp32" and saved_hooks_free() else None
        region.__enter__()
        if untuned:
            torch.backends.cudnn.benchmark = False
        self._regions.append((region, device_type, precision, in_sum, untuned, inputs))
        if inputs is not None:
            args, kwargs = inputs.cast(args), inputs.cast(kwargs)
            inputs.__enter__()
            return args, kwargs
        if precision == "fp32":
            return to_float32(args), to_float32(kwargs)
        return None

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self._regions:  # the forward failed before this module's pre-hook ran
            return None
        entry = self._regions.pop()
        if entry is None:
            return None
        region, device_type, precision, in_sum, untuned, inputs = entry
        if inputs is not None:
            inputs.__exit__(None, None, None)
        region.__exit__(None, None, None)
        if untuned:
            torch.backends.cudnn.benchmark = True
            _untuned_backward(output)
        if output is None:
            return None
        if precision == "fp32":
            if not torch.is_autocast_enabled(device_type):
                return None
            # the layers after it compute in half precision anyway: hand the output on in
            # autocast's dtype, so that they do not save float32 copies for the backward
            dtype = torch.get_autocast_dtype(device_type)
            return cast_floating(output, (torch.float32,), dtype)
        if precision == "fp16":
            self._watch(in_sum, output)
        if torch.is_autocast_enabled(device_type):
            return None
        return to_float32(output)

    def _watch(self, in_sum: torch.Tensor | None, output: Any) -> None:
        with torch.no_grad():
            out_sum = float32_sum(output)
            if out_sum is None:
                return
            if in_sum is not None:  # non-finite inputs: the overflow arose upstream
                finite_in = torch.isfinite(in_sum.to(out_sum.device))
                out_sum = torch.where(finite_in, out_sum, torch.zeros_like(out_sum))
            if self.overflow is None or self.overflow.device != out_sum.device:
                self.overflow = torch.zeros((), device=out_sum.device)
            self.overflow.add_(out_sum)

    def remove(self) -> None:
        """Removes both hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def attached(self) -> bool:
        """Whether the hooks are registered."""
        return bool(self._handles)
