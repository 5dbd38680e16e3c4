"""Launching a compiled Triton kernel directly, with Triton's public launch as the fallback.

A launch through ``kernel[grid](...)`` binds and specialises its arguments again each
time, which costs more host time than many of the statistics' and the update's kernels
take on the device. So their launchers (:class:`~hf_triaccel.kernels.reductions.ReductionLaunch`,
the grouped launches of :mod:`~hf_triaccel.kernels.grouped`, the update's in
:mod:`~hf_triaccel.kernels.update`) launch publicly once, keep the compiled kernel that
launch returned (:func:`compiled_kernel`) and launch that directly from then on, with the
arguments Triton would pass it (:func:`launch_compiled`).

The direct launch uses Triton internals: ``CompiledKernel.run`` and the order of its
arguments, the kernel's ``function``, ``packed_metadata`` and ``launch_metadata``, the
launch hooks of ``triton.knobs`` and the driver's current stream, as
``JITFunction.run`` uses them (Triton 3.3 to 3.8 at least). A release may change them,
so it is used only where it is known to work, and every caller falls back to the public
launch otherwise:

- :func:`direct_launch_supported` is false off CUDA, under the interpreter, on a Triton
  older than 3.3 or without the internals above;
- on each CUDA device, before the first direct launch, a probe kernel launched directly
  must write what its public launch writes (:func:`check_direct_launch`): a launcher
  whose arguments differ raises or writes something else, and the direct launch is then
  off on that device, with a warning;
- :func:`compiled_kernel` gives ``None`` for a launch result without the attributes the
  direct launch reads, and the caller keeps launching publicly.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

# what a compiled kernel must carry for launch_compiled
COMPILED_ATTRIBUTES = ("run", "function", "packed_metadata", "launch_metadata")
# entries the probe kernel writes
_PROBE_N = 16


@functools.cache
def _internals() -> tuple | None:
    """What launching a compiled kernel directly needs, ``(knobs, current stream of a
    device, current device)``, or ``None`` where it is not known to work: under the
    interpreter, on a Triton older than 3.3 (which passed its launcher only the
    non-constexpr arguments), or without those internals."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    if version < (3, 3):
        return None
    try:
        from triton import knobs
        from triton.runtime.driver import driver

        active = driver.active  # a lazy proxy: its methods are looked up once
        found = knobs, active.get_current_stream, active.get_current_device
    except (ImportError, AttributeError, RuntimeError):
        return None
    if not all(hasattr(knobs.runtime, h) for h in ("launch_enter_hook", "launch_exit_hook")):
        return None
    return found


def compiled_kernel(handle: Any) -> Any:
    """The compiled kernel a ``kernel[grid](...)`` launch returned (some Triton versions
    return a future of it), or ``None`` when it lacks what :func:`launch_compiled` reads
    (an interpreted launch, or a Triton whose compiled kernels differ): the caller then
    keeps launching through ``kernel[grid](...)``.

    Example:
        >>> compiled_kernel(None) is None  # what an interpreted launch returns
        True
    """
    compiled = handle.result() if hasattr(handle, "result") else handle
    if compiled is None or not all(hasattr(compiled, a) for a in COMPILED_ATTRIBUTES):
        return None
    return compiled


def launch_compiled(compiled: Any, grid: tuple[int, ...], args: list) -> None:
    """Launches ``compiled`` on the current stream as ``JITFunction.run`` would, without
    binding and specialising the arguments again: ``args`` are every argument of the
    kernel in order, constexprs included, and must match what ``compiled`` was
    specialised on (the same constexprs, pointers of the same 16-byte alignment). Only
    where :func:`direct_launch_supported`.

    A pointer argument may be given as its tensor or as the tensor's address (an int):
    given a tensor, Triton's launcher asks the driver about the pointer
    (``cuPointerGetAttribute``) on every launch, host time that the callers here, whose
    tensors are on the device their plan was made for, save by passing addresses. The
    caller keeps the tensors alive until the launch is queued."""
    knobs, current_stream, current_device = _internals()
    stream = current_stream(current_device())
    enter_hook = knobs.runtime.launch_enter_hook
    metadata = None if enter_hook is None else compiled.launch_metadata(grid, stream, *args)
    dims = (*grid, 1, 1)
    compiled.run(
        dims[0],
        dims[1],
        dims[2],
        stream,
        compiled.function,
        compiled.packed_metadata,
        metadata,
        enter_hook,
        knobs.runtime.launch_exit_hook,
        *args,
    )


@triton.jit
def _probe_kernel(out_ptr, value, N: tl.constexpr):
    """``out[:N] = value``: the kernel :func:`check_direct_launch` launches both ways."""
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.full((N,), value, tl.int32))


def check_direct_launch(
    device: torch.device,
    kernel: Any = _probe_kernel,
    launch: Callable[[Any, tuple[int, ...], list], None] = launch_compiled,
) -> str:
    """Why compiled kernels cannot be launched directly on ``device`` ("" when they can):
    ``kernel`` (by default a probe that fills a vector with its ``value`` argument) is
    launched publicly, then its compiled kernel directly with another value through
    ``launch``; the vector must then hold that value.

    Example:
        >>> "lacks" in check_direct_launch(torch.device("cpu"))  # interpreted: no binary
        True
    """
    try:
        out = torch.zeros(_PROBE_N, dtype=torch.int32, device=device)
        compiled = compiled_kernel(kernel[(1,)](out, 7, N=_PROBE_N))
        if compiled is None:
            return f"the compiled kernel lacks one of {COMPILED_ATTRIBUTES}"
        launch(compiled, (1,), [out.data_ptr(), 11, _PROBE_N])
        written = out.tolist()  # waits for the launch
    except Exception as error:  # noqa: BLE001 (whatever breaks, the public launch remains)
        return f"{type(error).__name__}: {error}"
    if written != [11] * _PROBE_N:
        return f"a direct launch wrote {written[:4]}..., not [11, 11, 11, 11]..."
    return ""


# per CUDA device: whether the probe launched directly as it should
_CHECKED: dict[torch.device, bool] = {}


def direct_launch_supported(device: torch.device) -> bool:
    """Whether compiled kernels on ``device`` are launched with :func:`launch_compiled`
    (see the module: CUDA, the internals present, the probe passed on that device).

    Example:
        >>> direct_launch_supported(torch.device("cpu"))
        False
    """
    if device.type != "cuda" or _internals() is None:
        return False
    checked = _CHECKED.get(device)
    if checked is None:
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return False  # no probe inside a trace or a capture: asked again later
        with torch.cuda.device(device):
            why = check_direct_launch(device)
        if why:
            warnings.warn(
                f"Triton's compiled kernels cannot be launched directly here ({why}): "
                "hf_triaccel launches them through kernel[grid](...), at more host time per "
                "launch",
                RuntimeWarning,
                stacklevel=2,
            )
        checked = _CHECKED[device] = not why
    return checked
