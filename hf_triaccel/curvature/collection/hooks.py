"""The module hooks that take a layer's statistics, as small objects.

:class:`ActivationHook` (a forward pre-hook) writes the activation sums of a layer's
input into a slot; :class:`OutputHook` (a forward hook on the layer, or on the
submodule whose output gradient the rule reads) registers on the output the gradient
hook (:class:`GradientTake`) that confirms that slot and takes the gradient sums;
:class:`LayerHook` does both, for a layer whose own output gradient is read. The
:class:`~hf_triaccel.curvature.collector.FisherCollector` registers them before the
forward of a refresh step and removes them after its fold, so that ordinary steps run
the model unhooked. A hook holds its layer and the :class:`HookState` that the
collector's hooks share (the batches, the implementation, the generation of the
factors' buffers), never the collector itself.

The reductions the hooks write are queued in three batches (:class:`RefreshBatches`).
The activation sums of layers whose forward keeps its input for the backward anyway
(:meth:`~hf_triaccel.curvature.rules.FisherRule.input_saved`) wait for the backward to
start: holding those inputs costs no memory. The gradient sums wait while the gradients
they hold take at most :data:`GRADIENT_BYTES_PER_PARAMETER` bytes per parameter of the
collector's layers, and at most until the backward ends. The others are launched when
their hook ends.

A copy of the model alone (an EMA or teacher copy) must not feed the collector: copied
or pickled, a hook becomes an :class:`InertHook`, which does nothing. A collector copied
or unpickled together with its model replaces those with hooks of its own.

A forward that activation checkpointing recomputes during the backward counts once: a
non-reentrant checkpoint (``use_reentrant=False``, the form transformers, timm, torch's
``checkpoint_wrapper`` and hf_triaccel's own use) took the statistic in the original forward,
so the recompute is skipped (:func:`in_checkpoint_recompute`); a reentrant checkpoint ran
the original forward without autograd, which takes no statistic, so its recompute does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_triaccel.curvature.collection.layer import LayerFactors, PendingStatistic
from hf_triaccel.curvature.rules.batching import StatisticsBatch, activate

# Gradients held, per parameter of the hooked layers: half of what AdaFisher saves against
# AdamW (one float32 state per parameter instead of two), so that the peak memory of a
# refresh step stays under AdamW's wherever the backward's own peak falls.
GRADIENT_BYTES_PER_PARAMETER = 2


class RefreshBatches:
    """A collector's three batches: activation sums, launched when the backward starts;
    gradient sums, launched before the gradients they hold pass ``budget`` bytes, and
    when the backward ends; and the activation sums of inputs that are not kept
    (``now``), launched when their hook ends."""

    __slots__ = ("activations", "gradients", "now", "task")

    def __init__(self, budget: int = 0) -> None:
        self.activations = StatisticsBatch()  # the inputs are alive anyway: no budget
        self.gradients = StatisticsBatch(budget)
        self.now = StatisticsBatch()
        self.task = -1  # the backward (graph task) whose end will flush the gradient sums

    def backward_started(self) -> None:
        """Called by each gradient hook: flushes the activation sums and, once per
        backward, asks the autograd engine to flush the gradient sums at its end."""
        self.activations.flush()
        task = torch._C._current_graph_task_id()
        if task == self.task:
            return
        # a new backward (one that failed never ended)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        self.task = task

    def _backward_ended(self) -> None:
        self.task = -1
        self.gradients.flush()

    def gradient_taken(self) -> None:
        """Called after a gradient hook queued its sums: flushes past the budget."""
        if self.gradients.nbytes > self.gradients.budget:
            self.gradients.flush()

    def flush(self) -> None:
        """Launches everything queued (before a fold reads the sums)."""
        self.activations.flush()
        self.gradients.flush()
        self.now.flush()

    def clear(self) -> None:
        """Forgets everything queued (a failed attempt's statistics are dropped)."""
        self.activations.clear()
        self.gradients.clear()
        self.now.clear()


class HookState:
    """What the hooks of one collector share, and all they see of it: the batches they
    queue into, the implementation of the statistics, and the generation of the layers'
    buffers, counted up when a hook moves a layer's tensors to where its module now
    computes (for whoever caches their addresses: the fold plans, the optimizer's).

    Example:
        >>> state = HookState(RefreshBatches(), impl="reference")
        >>> state.generation, len(state.batches.now)
        (0, 0)
    """

    __slots__ = ("batches", "impl", "generation")

    def __init__(self, batches: RefreshBatches, impl: str | None) -> None:
        self.batches = batches
        self.impl = impl
        self.generation = 0


def _saved_tensors_hooks_probe() -> Any:
    """torch's query of the innermost saved-tensor hooks, or ``None`` on a torch that
    has none (it is private): worked out once, as the hooks ask at every forward."""
    query = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        query(False)
    except (TypeError, RuntimeError):
        return None
    return query


_TOP_SAVED_TENSORS_HOOKS = _saved_tensors_hooks_probe()


def in_checkpoint_recompute() -> bool:
    """Whether a module forward running now is a non-reentrant checkpoint's recompute.

    Such a recompute runs inside the backward pass (torch's own test, as FSDP2 and
    ``torch.utils.module_tracker`` make it: a graph task is running) under the saved-tensor
    hooks the checkpoint pushes to collect the recomputed activations. A reentrant
    checkpoint recomputes in the backward too, but without saved-tensor hooks.

    Example:
        >>> in_checkpoint_recompute()  # a forward outside any backward
        False
    """
    return _recomputing(_saved_tensors_hooked())


def _recomputing(hooked: bool | None) -> bool:
    """:func:`in_checkpoint_recompute`, given what :func:`_saved_tensors_hooked` says (a
    torch that cannot say: take the statistic; the recompute's output gets no gradient,
    so it is never confirmed and still counts once)."""
    return bool(hooked) and torch._C._current_graph_task_id() != -1


def _saved_tensors_hooked() -> bool | None:
    """Whether saved-tensor hooks are active (activation checkpointing, offloading);
    ``None`` on a torch that cannot say."""
    query = _TOP_SAVED_TENSORS_HOOKS
    return None if query is None else query(False) is not None


# a device's type, by device: torch builds the string anew at each ``device.type``
_DEVICE_TYPES: dict[torch.device, str] = {}


def _kept(hooked: bool | None, x: torch.Tensor, device: torch.device) -> bool:
    """Whether a forward whose rule keeps its input for the backward
    (:meth:`~hf_triaccel.curvature.rules.FisherRule.input_saved`) keeps ``x`` itself:
    autocast (for ``device``'s type, where the layer computes) does not cast it first,
    and no saved-tensor hooks (activation checkpointing, offloading) take what the
    forward saves elsewhere (``hooked``: what :func:`_saved_tensors_hooked` says; unknown,
    the statistic is taken at once)."""
    if hooked is not False:
        return False
    device_type = _DEVICE_TYPES.get(device)
    if device_type is None:
        device_type = _DEVICE_TYPES[device] = device.type
    return not torch.is_autocast_enabled(device_type) or (
        x.dtype == torch.get_autocast_dtype(device_type)
    )


class InertHook:
    """What a copied or unpickled statistics hook becomes: a hook that does nothing.

    Example:
        >>> InertHook()(nn.Linear(2, 2), (torch.zeros(1, 2),), {}) is None
        True
    """

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _StatisticsHook:
    """What both hooks share: the layer they serve, the collector's :class:`HookState`,
    how they copy.

    Whether the layer's forward keeps its input for the backward
    (:meth:`~hf_triaccel.curvature.rules.FisherRule.input_saved`) is asked once, when the
    hooks are made (the collector makes them again at each refresh that follows steps
    without one).
    """

    __slots__ = ("state", "layer", "saved")

    def __init__(self, state: HookState, layer: LayerFactors) -> None:
        self.state = state
        self.layer = layer
        self.saved = layer.rule.input_saved(layer.module)

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        return InertHook()

    def __reduce__(self) -> tuple[type, tuple]:
        return InertHook, ()


class ActivationHook(_StatisticsHook):
    """Forward pre-hook: the activation sums of the layer's input, in a new slot."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        taken = self.take(module, args, kwargs)
        if taken is not None:
            self.layer.pending_a.append(taken)

    def take(
        self, module: nn.Module, args: tuple, kwargs: dict[str, Any]
    ) -> PendingStatistic | None:
        """Takes the activation sums of this forward's input; returns the record that
        waits for the gradient of its output, or ``None`` when this forward takes no
        statistic."""
        layer = self.layer
        # a shallow copy of the model shares the hook dicts: ignore the copy's calls
        if module is not layer.module or not torch.is_grad_enabled():
            return None
        hooked = _saved_tensors_hooked()  # asked once for both tests
        if _recomputing(hooked):
            return None
        x = args[0] if args else next(iter(kwargs.values()))
        state = self.state
        anchor = module._parameters.get(layer.anchor)
        if anchor is None:  # a parametrised or replaced parameter
            anchor = getattr(module, layer.anchor)
        device = anchor.device
        # an input the forward keeps anyway can wait for the backward, with the others
        kept = self.saved and _kept(hooked, x, device)
        if layer.follow(device):
            state.generation += 1  # whoever cached the factors' addresses
        batches = state.batches
        batch = batches.activations if kept else batches.now
        previous = activate(batch)
        try:
            pending = layer.take_activation(module, x.detach(), state.impl)
        finally:
            activate(previous)
        if not kept:
            batch.flush()
        return pending


class OutputHook(_StatisticsHook):
    """Forward hook: registers, on the output, the gradient hook that confirms the
    pending activation sums and takes the gradient sums.

    The statistic counts only when the gradient arrives, so a forward that no backward
    follows (an evaluation pass with autograd on) leaves no trace.
    """

    __slots__ = ()

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        layer = self.layer
        if module is not layer.output_module or not layer.pending_a:
            return
        self.on_gradient(layer.pending_a.pop(), output)

    def on_gradient(self, taken: PendingStatistic, output: Any) -> None:
        """Registers on ``output`` the gradient hook that confirms ``taken`` (what
        :meth:`ActivationHook.take` returned) and takes the gradient sums (nothing for an
        output without gradient)."""
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        node = output.grad_fn
        take = GradientTake(self.state, self.layer, taken)
        if node is None or torch.compiler.is_compiling():
            output.register_hook(take)
            return
        # A hook on the node that computes the output's gradient costs less host time
        # than a tensor hook and sees the same gradient: the node a tensor hook is kept
        # on, also when the output is later changed in place (an in-place activation).
        index = output.output_nr

        def node_hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            grad = grads[index]
            if grad is not None:  # no gradient reached this output
                take(grad)

        node.register_prehook(node_hook)


class LayerHook(ActivationHook, OutputHook):
    """Both in one forward hook (with keyword arguments), for a layer whose own output
    gradient its rule reads: one hook call per layer and forward instead of two.

    Example:
        >>> from hf_triaccel.curvature.collector import FisherCollector
        >>> collector = FisherCollector(nn.Linear(3, 2))
        >>> [type(h).__name__ for h in collector.layers[""].module._forward_hooks.values()]
        ['LayerHook']
        >>> collector.detach()
    """

    __slots__ = ()

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any):
        taken = self.take(module, args, kwargs)
        if taken is not None:
            self.on_gradient(taken, output)


class GradientTake:
    """The gradient hook of one forward: confirms its pending activation sums and takes
    the gradient sums of its output.

    Example:
        >>> from hf_triaccel.curvature.rules import rule_for
        >>> lin = nn.Linear(3, 2)
        >>> rule = rule_for(lin)
        >>> layer = LayerFactors.create("", lin, rule, rule.layouts(lin), False, True)
        >>> pending = layer.take_activation(lin, torch.ones(4, 3), "reference")
        >>> GradientTake(HookState(RefreshBatches(), "reference"), layer, pending)(torch.ones(4, 2))
        >>> layer.a_count, layer.g_count, layer.g_n
        (1, 1, 4.0)
    """

    __slots__ = ("state", "layer", "pending")

    def __init__(self, state: HookState, layer: LayerFactors, pending: PendingStatistic) -> None:
        self.state = state
        self.layer = layer
        self.pending = pending

    def __call__(self, grad: torch.Tensor) -> None:
        if self.pending.slot < 0:
            return  # a forward of a step already folded
        layer, batches = self.layer, self.state.batches
        if grad.requires_grad:  # a backward that builds a graph (create_graph)
            grad = grad.detach()
        batches.backward_started()
        layer.confirm(self.pending)
        previous = activate(batches.gradients)
        try:
            layer.take_gradient(grad, self.state.impl)
        finally:
            activate(previous)
        batches.gradient_taken()
