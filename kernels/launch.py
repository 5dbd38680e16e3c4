"""Launching a compiled Triton kernel again, with as little host time as it can take.

A statistic's or an optimizer step's kernel is launched many times with the same
geometry. Triton binds and specialises the arguments of every ``kernel[grid](...)``
call; after the first, the package keeps the compiled kernel and launches it directly
(:func:`direct_launcher`). Where the CUDA driver can say how the kernel's parameters are
laid out (``cuFuncGetParamInfo``, CUDA 12.4 on), a :class:`DriverLaunch` packs them
into a buffer kept with the kernel and calls ``cuLaunchKernel`` itself, as Triton's
launcher would for these kernels (one CTA per program, no cluster, cooperative or
programmatic-dependent launch, no scratch memory); elsewhere the compiled kernel goes
through Triton's own launcher, without the binding (:func:`launch_compiled`).

Example:
    >>> direct_launch_supported(torch.device("cpu"))
    False
"""

from __future__ import annotations

import ctypes
import functools
import operator
import os
import struct
from collections.abc import Callable
from typing import Any

import torch
import triton

# the parameter formats (``struct``) of the scalar types Triton passes by value
_SCALAR_FORMATS = {
    "i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q",
    "u1": "B", "u8": "B", "u16": "H", "u32": "I", "u64": "Q",
    "fp32": "f", "f32": "f", "fp64": "d",
}  # fmt: skip
_MAX_PARAMS = 1024  # more than any kernel here has: the end of the driver's answers


@functools.cache
def _direct_launch() -> tuple | None:
    """What launching a compiled kernel directly needs, ``(knobs, current stream of a
    device, current device)``, or ``None`` where it is not known to work: under the
    interpreter, or a Triton older than 3.3 (which passed its launcher only the
    non-constexpr arguments)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    try:
        from triton import knobs
        from triton.runtime.driver import driver
    except ImportError:
        return None
    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    if version < (3, 3):
        return None
    active = driver.active  # a lazy proxy: its methods are looked up once
    return knobs, active.get_current_stream, active.get_current_device


def direct_launch_supported(device: torch.device) -> bool:
    """Whether compiled kernels on ``device`` can be launched with :func:`direct_launcher`."""
    return device.type == "cuda" and _direct_launch() is not None


def launch_compiled(compiled: Any, grid: tuple[int, ...], args: list) -> None:
    """Launches ``compiled`` on the current stream through Triton's launcher, as
    ``JITFunction.run`` would, without binding and specialising the arguments again:
    ``args`` are every argument of the kernel in order, constexprs included, and must
    match what ``compiled`` was specialised on (the same constexprs, pointers of the
    same 16-byte alignment). Only where :func:`direct_launch_supported`.

    A pointer argument may be given as its tensor or as the tensor's address (an int):
    given a tensor, Triton's launcher asks the driver about the pointer
    (``cuPointerGetAttribute``) on every launch, host time that the callers here, whose
    tensors are on the device their plan was made for, save by passing addresses. The
    caller keeps the tensors alive until the launch is queued."""
    knobs, current_stream, current_device = _direct_launch()
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


def direct_launcher(handle: Any) -> Callable[[tuple[int, ...], list], None]:
    """The launch of the compiled kernel a ``kernel[grid](...)`` call returned (some
    Triton versions return a future of it): ``launcher(grid, args)``, ``args`` as
    :func:`launch_compiled` takes them (pointers as addresses), by the driver where a
    :class:`DriverLaunch` can be made for it."""
    compiled = handle.result() if hasattr(handle, "result") else handle
    driver = DriverLaunch.of(compiled)
    return driver if driver is not None else functools.partial(launch_compiled, compiled)


@functools.cache
def _driver() -> tuple[Any, Any] | None:
    """The CUDA driver's ``cuLaunchKernel`` and ``cuFuncGetParamInfo``, called with the
    interpreter lock held (a launch only queues work: holding it keeps a kernel's
    parameter buffer to one launch at a time), or ``None`` where the driver lacks them."""
    try:
        cuda = ctypes.PyDLL("libcuda.so.1")
        launch, param_info = cuda.cuLaunchKernel, cuda.cuFuncGetParamInfo
    except (OSError, AttributeError):
        return None
    launch.restype = param_info.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p]
    launch.argtypes += [ctypes.c_void_p, ctypes.c_void_p]
    size = ctypes.POINTER(ctypes.c_size_t)
    param_info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, size, size]
    return launch, param_info


def parameter_layout(
    signature: dict[str, str], params: list[tuple[int, int]]
) -> tuple[str, list[int]] | None:
    """How a kernel's arguments fill its parameters, or ``None`` when they cannot here.

    Args:
        signature: Triton's type of every argument by name, in order (``"constexpr"``
            for those compiled in, ``"*bf16"`` for a pointer, ``"i32"``, ``"fp32"``...).
        params: (offset, size) in bytes of each of the compiled kernel's parameters, as
            the driver reports them: the non-constexpr arguments in order, then any
            pointers Triton adds (its scratch buffers, passed as null).

    Returns:
        The ``struct`` format that packs the arguments (and the null pointers) at their
        offsets, and the positions in the argument list of the values it packs.

    Example:
        >>> signature = {"x": "*bf16", "n": "i32", "scale": "fp32", "BLOCK": "constexpr"}
        >>> parameter_layout(signature, [(0, 8), (8, 4), (12, 4), (16, 8)])
        ('<Qif8x', [0, 1, 2])
        >>> parameter_layout(signature, [(0, 8), (8, 8), (16, 4)]) is None  # n is 8 bytes
        True
    """
    types, positions = [], []
    for i, kind in enumerate(signature.values()):
        if kind == "constexpr":
            continue
        fmt = "Q" if kind.startswith("*") else _SCALAR_FORMATS.get(kind)
        if fmt is None:  # a tensor descriptor, a half-precision scalar
            return None
        types.append(fmt)
        positions.append(i)
    if len(params) < len(types):
        return None
    types += ["8x"] * (len(params) - len(types))  # Triton's scratch pointers: null
    fmt, end = "<", 0
    for kind, (offset, size) in zip(types, params, strict=True):
        if struct.calcsize("<" + kind) != size or offset < end:
            return None
        fmt += f"{offset - end}x" * (offset > end) + kind
        end = offset + size
    return fmt, positions


class DriverLaunch:
    """``cuLaunchKernel`` of one compiled Triton kernel, its parameters packed into a
    buffer kept with it: ``launch(grid, args)`` with ``args`` as :func:`launch_compiled`
    takes them. Made by :meth:`of`, for kernels whose launch needs nothing else."""

    __slots__ = (
        "compiled", "function", "block", "shared", "struct", "buffer", "params", "pick",
        "launch",
    )  # fmt: skip

    def __init__(self, compiled: Any, fmt: str, positions: list[int], offsets: list[int]):
        self.compiled = compiled
        self.function = compiled.function
        self.block = 32 * compiled.metadata.num_warps
        self.shared = compiled.metadata.shared
        self.struct = struct.Struct(fmt)
        self.buffer = ctypes.create_string_buffer(max(self.struct.size, 1))
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * max(len(offsets), 1))(*[base + o for o in offsets])
        # a tuple of the packed values, also for one value
        pick = operator.itemgetter(*positions) if positions else (lambda args: ())
        self.pick = pick if len(positions) != 1 else (lambda args, p=positions[0]: (args[p],))
        self.launch = _driver()[0]

    @classmethod
    def of(cls, compiled: Any) -> DriverLaunch | None:
        """The driver launch of ``compiled``, or ``None`` where Triton's launcher must
        launch it (a launch with more than a grid, block and shared memory, scratch
        memory, or parameters this module cannot lay out)."""
        driver = _driver()
        meta = getattr(compiled, "metadata", None)
        src = getattr(compiled, "src", None)
        if driver is None or meta is None or not hasattr(src, "signature"):
            return None
        plain = (
            getattr(meta, "num_ctas", 1) == 1
            and not getattr(meta, "launch_cooperative_grid", False)
            and not getattr(meta, "launch_pdl", False)
            and not getattr(meta, "global_scratch_size", 0)
            and not getattr(meta, "profile_scratch_size", 0)
            and meta.shared <= 48 * 1024
        )
        function = getattr(compiled, "function", None)
        if not plain or not function:
            return None
        params = _param_info(driver[1], function)
        layout = None if params is None else parameter_layout(src.signature, params)
        if layout is None:
            return None
        return cls(compiled, layout[0], layout[1], [offset for offset, _ in params])

    def __call__(self, grid: tuple[int, ...], args: list) -> None:
        knobs, current_stream, current_device = _direct_launch()
        if knobs.runtime.launch_enter_hook is not None:  # a profiler that watches launches
            launch_compiled(self.compiled, grid, args)
            return
        self.struct.pack_into(self.buffer, 0, *self.pick(args))
        dims = (*grid, 1, 1)
        stream = current_stream(current_device())
        error = self.launch(
            self.function, dims[0], dims[1], dims[2], self.block, 1, 1, self.shared,
            stream, self.params, None,
        )  # fmt: skip
        if error:
            raise RuntimeError(f"cuLaunchKernel failed with CUresult {error}")


def _param_info(info: Any, function: int) -> list[tuple[int, int]] | None:
    """(offset, size) of each parameter of ``function``, or ``None`` where the driver
    cannot say."""
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    params = []
    for index in range(_MAX_PARAMS):
        if info(function, index, ctypes.byref(offset), ctypes.byref(size)):
            break  # past the last parameter (or no answer at all)
        params.append((offset.value, size.value))
    return params or None
