"""The memory ledger: bytes of weights, gradients, optimizer state, Kahan compensation and
Fisher factors of a training run, counted from its tensors.

Activations are not in it: they depend on the batch, not on the optimizer. A tensor
shared by several owners (tied weights, the Fisher factors every parameter of a layer
refers to) is counted once.

Two steps are told apart. On a step that holds every gradient until ``optimizer.step()``
(a Fisher refresh, or any step without gradient release) the gradients are as large as
the trainable weights. On a step that releases them (:mod:`hf_triaccel.optim.release`)
each gradient is freed by the hook that steps its parameter, so at most a few exist at
once. :func:`measure_step` runs one step and records the most gradient bytes held as
``.grad`` at any point of its backward pass; :func:`count_ledger` counts a model and
optimizer as they stand, with the gradients a step of the given kind holds
(:func:`held_gradient_bytes`).

Example:
    >>> from torch import nn
    >>> model = nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> model(torch.randn(3, 4)).sum().backward(); opt.step()
    >>> ledger = count_ledger(model, opt, step="held")
    >>> ledger.parameters, ledger.weights, ledger.gradients, ledger.optimizer_state
    (10, 40, 40, 88)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn

STEPS = ("held", "released")
"""The kinds of step a ledger describes: gradients held until ``step()``, or released."""

COMPENSATION_KEY = "compensation"
FACTOR_PREFIX = "fisher_"


@dataclass(frozen=True)
class MemoryLedger:
    """Bytes by kind for one model and optimizer on one kind of step.

    Attributes:
        step: ``"held"`` (every gradient held until ``step()``; a Fisher refresh is one)
            or ``"released"``.
        parameters: trainable parameter elements (a tied weight counted once).
        weights: bytes of every parameter (trainable or not).
        gradients: bytes of ``.grad`` tensors held at the step's peak.
        optimizer_state: bytes of the optimizer's per-parameter state but the two below
            (momenta, moments, step counts).
        compensation: bytes of Kahan compensation buffers.
        fisher_factors: bytes of the Fisher factor vectors.
    """

    step: str
    parameters: int
    weights: int
    gradients: int
    optimizer_state: int
    compensation: int
    fisher_factors: int

    @property
    def total(self) -> int:
        """Every byte of the ledger."""
        return (
            self.weights
            + self.gradients
            + self.optimizer_state
            + self.compensation
            + self.fisher_factors
        )

    def per_parameter(self) -> dict[str, float]:
        """Each kind, and the total, in bytes per trainable parameter.

        Example:
            >>> MemoryLedger("held", 4, 8, 8, 16, 0, 0).per_parameter()["total"]
            8.0
        """
        kinds = ("weights", "gradients", "optimizer_state", "compensation", "fisher_factors")
        out = {k: getattr(self, k) / self.parameters for k in kinds}
        out["total"] = self.total / self.parameters
        return out

    def as_dict(self) -> dict[str, object]:
        """The fields, the total and the bytes per parameter, for JSON."""
        return {**asdict(self), "total": self.total, "per_parameter": self.per_parameter()}


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors with distinct storage regions (a shared tensor or view once)."""
    seen, out = set(), []
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in _unique(tensors))


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The model's trainable parameters, a tied one once."""
    return [p for p in _unique(model.parameters()) if p.requires_grad]


def held_gradient_bytes(model: nn.Module, step: str) -> int:
    """The gradient bytes a step of kind ``step`` holds at its peak: every trainable
    parameter's (of its dtype) when held, the largest one's when released.

    Example:
        >>> layer = nn.Linear(4, 2)
        >>> held_gradient_bytes(layer, "held"), held_gradient_bytes(layer, "released")
        (40, 32)
    """
    if step not in STEPS:
        raise ValueError(f"step={step!r}: must be one of {STEPS}")
    sizes = [p.numel() * p.element_size() for p in trainable(model)]
    if not sizes:
        return 0
    return sum(sizes) if step == "held" else max(sizes)


def count_ledger(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: str,
    gradient_bytes: int | None = None,
) -> MemoryLedger:
    """The ledger of ``model`` and ``optimizer`` as they stand (their state created by a
    first step), on a step of kind ``step``.

    Args:
        model: the model (its parameters are the weights).
        optimizer: any torch optimizer: its per-parameter state is counted by key, a
            ``compensation`` entry as compensation, ``fisher_*`` entries (and the factors
            of an optimizer's ``collector``) as Fisher factors, the rest as state.
        step: ``"held"`` or ``"released"``.
        gradient_bytes: the gradient bytes measured (:func:`measure_step`); default
            :func:`held_gradient_bytes`.

    Raises:
        ValueError: an unknown ``step``, or a model without trainable parameters.
    """
    params = trainable(model)
    if not params:
        raise ValueError("count_ledger: the model has no trainable parameters")
    state, compensation, factors = [], [], []
    for entry in optimizer.state.values():
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key == COMPENSATION_KEY:
                compensation.append(value)
            elif key.startswith(FACTOR_PREFIX):
                factors.append(value)
            else:
                state.append(value)
    collector = getattr(optimizer, "collector", None)
    if collector is not None:
        factors += [t for entry in collector.checkpoint_tensors().values() for t in entry.values()]
    if gradient_bytes is None:
        gradient_bytes = held_gradient_bytes(model, step)
    elif step not in STEPS:
        raise ValueError(f"step={step!r}: must be one of {STEPS}")
    return MemoryLedger(
        step=step,
        parameters=sum(p.numel() for p in params),
        weights=_nbytes(model.parameters()),
        gradients=gradient_bytes,
        optimizer_state=_nbytes(state),
        compensation=_nbytes(compensation),
        fisher_factors=_nbytes(factors),
    )


class GradientPeak:
    """The most bytes held as ``.grad`` by ``model``'s parameters at once during the
    backward passes it watches, seen from post-accumulate-grad hooks.

    A hook sees the gradients held when its parameter's gradient is complete; a hook
    registered earlier (gradient release) may have freed that gradient already, so it is
    counted as held at that moment either way.

    Example:
        >>> model = nn.Linear(4, 2)
        >>> with GradientPeak(model) as peak:
        ...     model(torch.randn(3, 4)).sum().backward()
        >>> peak.bytes
        40
    """

    def __init__(self, model: nn.Module) -> None:
        self.params = trainable(model)
        self.bytes = 0
        self._handles = []

    def __enter__(self) -> GradientPeak:
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, param: torch.Tensor) -> None:
        held = sum(
            p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None
        )
        if param.grad is None:  # freed by an earlier hook, held until then
            held += param.numel() * param.element_size()
        self.bytes = max(self.bytes, held)


def measure_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, run_step: Callable[[], None]
) -> MemoryLedger:
    """Runs one training step (``run_step``: forward, backward, ``optimizer.step()``,
    ``zero_grad``) and returns its ledger, the gradients as measured during its backward
    pass. The step is ``"released"`` when the optimizer's gradient release was active
    for it.

    Example:
        >>> from hf_triaccel.optim.adafisher import AdaFisherW
        >>> model = nn.Linear(4, 2)
        >>> opt = AdaFisherW.from_model(model, update_every=2, release_grads=True)
        >>> def step():
        ...     model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
        >>> [measure_step(model, opt, step).step for _ in range(3)]
        ['held', 'released', 'held']
    """
    release = getattr(optimizer, "release", None)
    released = release is not None and release.active
    with GradientPeak(model) as peak:
        run_step()
    step = "released" if released else "held"
    return count_ledger(model, optimizer, step=step, gradient_bytes=peak.bytes)
