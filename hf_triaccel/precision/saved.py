"""An fp32 module's half-precision inputs, saved for the backward as they came in.

Inside an fp32 module the inputs are cast up to float32, and an operation that saves its
input for the backward (a convolution, a matmul) would keep that float32 copy until the
backward runs. :class:`HalfInputs` makes the module's saved-tensor hooks keep the
half-precision input instead and cast it again when the backward needs it: the same
values, without a float32 copy of the input held until the backward. Inside another
saved-tensor hook (e.g. non-reentrant activation checkpointing) the module leaves saving
to that hook (:func:`saved_hooks_free`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_triaccel.precision.containers import HALF, map_tensors


def saved_hooks_free() -> bool:
    """Whether saved-tensor hooks may be pushed: they are enabled and no other is active
    (ours would replace it for the tensors saved inside the module)."""
    autograd = torch._C._autograd
    try:
        return (
            autograd._saved_tensors_hooks_is_enabled()
            and autograd._top_saved_tensors_default_hooks(False) is None
        )
    except AttributeError:  # torch without these queries: stay out of the way
        return False


@dataclass(frozen=True)
class _SavedSource:
    """A saved float32 copy (or a view of it), kept as the tensor it was cast from."""

    source: torch.Tensor
    version: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class HalfInputs:
    """Casts a module's half-precision inputs to float32 and, while its forward runs,
    saves those float32 copies for the backward as the half-precision inputs.

    ``source.to(torch.float32)`` is deterministic in values and strides, so unpacking
    rebuilds exactly the tensor (or view) that was saved. A copy modified in place before
    it was saved no longer matches its source and is saved as it is; a source modified
    in place after the save makes the backward raise, as autograd does for saved tensors.

    Example:
        >>> x = torch.randn(3, dtype=torch.bfloat16, requires_grad=True)
        >>> inputs = HalfInputs()
        >>> (up,) = inputs.cast((x,))
        >>> with inputs:
        ...     y = up * up  # saves ``up`` for the backward: kept as ``x``
        >>> y.sum().backward()
        >>> torch.equal(x.grad, (2 * x.float()).bfloat16())
        True
    """

    def __init__(self) -> None:
        # storage address of each live copy -> (its source, its version when made)
        self._copies: dict[int, tuple[torch.Tensor, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def cast(self, obj: Any) -> Any:
        """``obj`` with its half-precision tensors cast to float32, the copies recorded."""
        return map_tensors(obj, self._upcast)

    def _upcast(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype not in HALF:
            return t
        copy_ = t.to(torch.float32)
        if copy_.numel() and copy_.layout == torch.strided:
            self._copies[copy_.untyped_storage().data_ptr()] = (t, copy_._version)
        return copy_

    def __enter__(self) -> None:
        if self._copies:
            self._hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._copies:
            self._hooks.__exit__(*exc)
            self._copies.clear()

    def _pack(self, t: torch.Tensor) -> Any:
        if t.dtype != torch.float32 or t.layout != torch.strided or not t.numel():
            return t
        entry = self._copies.get(t.untyped_storage().data_ptr())
        if entry is None or t._version != entry[1]:
            return t
        source = entry[0]
        return _SavedSource(source, source._version, t.size(), t.stride(), t.storage_offset())

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, _SavedSource):
            return packed
        if packed.source._version != packed.version:
            raise RuntimeError(
                "an input of an fp32 module, saved for the backward pass, was modified in "
                "place after the forward (its version went from "
                f"{packed.version} to {packed.source._version}); clone it before changing it"
            )
        full = packed.source.to(torch.float32)
        if (full.size(), full.stride(), packed.offset) == (packed.size, packed.stride, 0):
            return full  # the copy itself was saved, not a view of it
        return full.as_strided(packed.size, packed.stride, packed.offset)
