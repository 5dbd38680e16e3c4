"""Gradient release: each parameter stepped during the backward pass, its gradient freed.

On a step that does not refresh the Fisher factors, nothing of the update waits for the
whole backward pass: a parameter's step reads its own gradient, momentum, compensation and
the factors of its layer, which the last refresh fixed. So, from a
``register_post_accumulate_grad_hook`` hook, each parameter is stepped as soon as its
gradient is complete, and the gradient is dropped at once: the backward pass then holds
at most the gradients autograd has not yet finished, instead of all of them until
``optimizer.step()``. A refresh step (the factors are folded from the backward's
statistics before any update) keeps its gradients and steps in ``optimizer.step()``.

The per-parameter step is the same arithmetic as the group step: with float32 weights
the two runs agree bit for bit (``tests/optim/test_release.py``).

What cannot release, because it needs every gradient before any update or sees the
gradient after the hook: global-norm clipping, gradient accumulation over several
backward passes (and the elastic batch's pieces), fp16 loss scaling (unscaling and the
inf check), DDP (the all-reduce) and FSDP2. The optimizer refuses sharded parameters and
a multi-process run when it is built; a second backward pass before ``step()`` raises;
the Trainer turns release off for the others, saying why and what it costs
(:mod:`hf_triaccel.integrations.low_memory`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hf_triaccel.curvature.collection.sharding import is_sharded
from hf_triaccel.dispatch import resolve_impl
from hf_triaccel.optim.config import check_step_hyperparameters
from hf_triaccel.optim.functional import is_narrow, prepare_adafisher
from hf_triaccel.optim.plans import new_state

if TYPE_CHECKING:
    from hf_triaccel.optim.adafisher import AdaFisher


def check_releasable(params: list[torch.Tensor], owner: str) -> None:
    """Refuses, at the start of a run, what gradient release cannot step correctly.

    Raises:
        ValueError: a sharded (FSDP2) parameter, or a distributed run of more than one
            process (DDP all-reduces a gradient after the hook that would step it).

    Example:
        >>> check_releasable([torch.zeros(2, requires_grad=True)], "AdaFisherW")
    """
    if any(is_sharded(p) for p in params):
        raise ValueError(
            f"{owner}: release_grads=True with sharded (FSDP2) parameters: the gradient is "
            "reduce-scattered after the hook that would step it; leave release_grads=False"
        )
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_world_size() > 1:
        raise ValueError(
            f"{owner}: release_grads=True in a run of {torch.distributed.get_world_size()} "
            "processes: DDP all-reduces each gradient after the hook that would step it; "
            "leave release_grads=False (the gradients then cost their full size)"
        )


class GradientRelease:
    """The hooks that step ``optimizer``'s parameters during the backward pass.

    ``active`` says whether the coming backward pass releases (the optimizer sets it after
    each step: off when the next step refreshes the factors). ``released`` counts the
    parameters stepped by the hooks since the optimizer's last step, ``total`` since the
    start.

    Args:
        optimizer: an AdaFisher / AdaFisherW built with ``release_grads=True``.

    Example:
        >>> from torch import nn
        >>> from hf_triaccel.optim.adafisher import AdaFisherW
        >>> model = nn.Linear(4, 2)
        >>> opt = AdaFisherW.from_model(model, update_every=2, release_grads=True)
        >>> for _ in range(2):
        ...     model(torch.randn(8, 4)).square().mean().backward()
        ...     released = opt.release.released
        ...     opt.step(); opt.zero_grad()
        >>> released, model.weight.grad is None  # the second step released both
        (2, True)
    """

    def __init__(self, optimizer: AdaFisher) -> None:
        self.optimizer = optimizer
        self.active = False
        self.released = 0
        self.total = 0
        self._stepped: set[int] = set()
        self._updates: dict[int, tuple[tuple, Callable[..., None]]] = {}
        self._groups: dict[int, dict[str, Any]] = {}
        self._handles = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._groups[id(p)] = group
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def remove(self) -> None:
        """Removes the hooks (the optimizer then steps every parameter in ``step()``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.active = False

    def step_finished(self, refresh_next: bool) -> None:
        """Called by the optimizer at the end of ``step()``: the next backward pass
        releases unless the next step refreshes the factors."""
        self.total += self.released
        self.released = 0
        self._stepped.clear()
        scaler = getattr(self.optimizer.collector, "grad_scaler", None)
        if self._handles and scaler is not None and scaler.is_enabled():
            # known once the optimizer is wrapped: raised before any step released
            raise ValueError(
                f"{type(self.optimizer).__name__}: release_grads=True with fp16 loss scaling: "
                "the scaler unscales every gradient and checks it for inf before the update, "
                "which release would have taken already; leave release_grads=False"
            )
        self.active = bool(self._handles) and not refresh_next

    def _update_for(self, p: torch.Tensor, group: dict[str, Any]) -> Callable[..., None]:
        """The update bound to ``p``'s tensors, built again when any of them changed."""
        opt = self.optimizer
        entry = opt.state[p]
        rounding = opt.config.weight_rounding
        if not entry:
            entry.update(new_state(p, opt.config.resolved_state_dtype, rounding))
        if rounding == "kahan" and is_narrow(p.dtype) and "compensation" not in entry:
            entry["compensation"] = torch.zeros_like(p)
        collector = opt.collector
        generation = None if collector is None else collector.generation
        comp = entry.get("compensation")
        key = (
            p.data_ptr(),
            id(entry["momentum"]),
            id(entry["step"]),
            id(comp),
            generation,
            opt.impl,
        )
        cached = self._updates.get(id(p))
        if cached is not None and cached[0] == key:
            return cached[1]
        factors = None if collector is None else collector.param_factors().get(p)
        update = prepare_adafisher(
            [p],
            [entry["momentum"]],
            [factors],
            [entry["step"]],
            impl=resolve_impl(opt.impl, p.device),
            comps=[comp],
            rounding=rounding,
        )
        self._updates[id(p)] = (key, update)
        return update

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        if not self.active or p.grad is None:
            return
        if id(p) in self._stepped:
            raise RuntimeError(
                f"{type(self.optimizer).__name__}: a second backward pass before step() with "
                "release_grads=True; gradient accumulation over several backward passes "
                "cannot release (each would step the parameter): leave release_grads=False"
            )
        group = self._groups[id(p)]
        lr, beta = group["lr"], group["beta"]
        weight_decay, damping = group["weight_decay"], group["damping"]
        owner = type(self.optimizer).__name__
        check_step_hyperparameters(lr, beta, weight_decay, damping, owner=owner)
        update = self._update_for(p, group)
        self.optimizer.state[p]["step"].add_(1.0)
        update(
            [p.grad],
            lr=lr,
            beta=beta,
            weight_decay=weight_decay,
            damping=damping,
            decoupled=self.optimizer.decoupled,
            maximize=group["maximize"],
            seed=self.optimizer.rounding_seed_for(len(self._stepped)),
        )
        p.grad = None
        self._stepped.add(id(p))
        self.released += 1
