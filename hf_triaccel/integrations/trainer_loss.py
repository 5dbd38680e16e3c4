"""How a batch reaches a model, and the loss of models that compute none.

The Trainer calls ``model(**batch)`` and uses the loss the model returns; hf_triaccel's
Trainer does the same for every model whose ``forward`` takes the whole batch by name
(or takes ``**kwargs``). Any other model (timm's ``forward(x) -> logits``) gets the
batch's inputs without the labels, by name when its ``forward`` names them all, else
positionally, and its loss is the one it returns, else the Trainer's
``compute_loss_func``, else cross-entropy on its logits (with the Trainer's label
smoothing).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def forward_parameters(model: nn.Module) -> tuple[set[str], bool]:
    """The names ``model.forward`` takes and whether it takes ``**kwargs``.

    Example:
        >>> forward_parameters(nn.Linear(2, 2))
        ({'input'}, False)
    """
    params = inspect.signature(model.forward).parameters.values()
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def feeds_positionally(model: nn.Module, keys: Iterable[str], label_names: Iterable[str]) -> bool:
    """Whether a batch with ``keys`` goes to ``model`` positionally: its ``forward`` takes
    no ``**kwargs`` and names none of the batch's non-label entries.

    Example:
        >>> class Timm(nn.Module):
        ...     def forward(self, x):
        ...         return x
        >>> feeds_positionally(Timm(), ["pixel_values", "labels"], ["labels"])
        True
        >>> class HFStyle(nn.Module):
        ...     def forward(self, pixel_values, labels=None):
        ...         return {"loss": pixel_values.sum()}
        >>> feeds_positionally(HFStyle(), ["pixel_values", "labels"], ["labels"])
        False
    """
    return takes_positionally(forward_parameters(model), keys, label_names)


def takes_whole_batch(signature: tuple[set[str], bool], keys: Iterable[str]) -> bool:
    """Whether ``forward`` (its :func:`forward_parameters`) takes every entry of a batch
    with ``keys`` by name, labels included: the Trainer's ``model(**batch)`` works.

    Example:
        >>> takes_whole_batch(({"x"}, False), ["x", "labels"])
        False
        >>> takes_whole_batch(({"x", "labels"}, False), ["x", "labels"])
        True
    """
    names, var_keyword = signature
    return var_keyword or set(keys) <= names


def takes_positionally(
    signature: tuple[set[str], bool], keys: Iterable[str], label_names: Iterable[str]
) -> bool:
    """:func:`feeds_positionally` from a :func:`forward_parameters` result."""
    names, var_keyword = signature
    features = set(keys) - set(label_names)
    return not var_keyword and bool(features) and not features & names


class LossRoutes:
    """Which loss path a batch takes for each model a Trainer step calls, looked up once.

    Unwrapping a model (Accelerate walks its module tree) and reading its ``forward``
    signature cost host time that a step bound by the host pays in full; both depend only
    on the model object a step calls (a compile wrapper, its eager module on refresh
    steps, a DDP wrapper) and the batch's keys, so they are kept per model object, which
    is held weakly: a wrapper that a later ``train()`` replaced is not kept alive.
    ``unwrap`` is Accelerate's ``unwrap_model`` (or any function returning the module that
    ``model`` wraps, compile wrappers included).

    Example:
        >>> unwrapped = []
        >>> routes = LossRoutes(unwrap=lambda m: unwrapped.append(m) or m)
        >>> model = nn.Linear(3, 4)
        >>> routes.lookup(model, ["input", "labels"])  # not every entry is forward's
        (False, ({'input'}, False))
        >>> routes.lookup(model, ["input"])
        (True, ({'input'}, False))
        >>> len(unwrapped)  # once for the model, whatever the batches
        1
    """

    def __init__(self, unwrap: Any) -> None:
        self.unwrap = unwrap
        # per model: its forward's signature, and by the batch's keys whether the
        # Trainer's own compute_loss takes the batch
        self._routes: weakref.WeakKeyDictionary[
            nn.Module, tuple[tuple[set[str], bool], dict[tuple[str, ...], bool]]
        ] = weakref.WeakKeyDictionary()

    def lookup(self, model: nn.Module, keys: Iterable[str]) -> tuple[bool, tuple[set[str], bool]]:
        """``(whether the Trainer's own compute_loss takes the batch, the signature of
        the model's own forward)`` for a batch with ``keys`` given to ``model``."""
        entry = self._routes.get(model)
        if entry is None:
            entry = self._routes[model] = (forward_parameters(self.unwrap(model)), {})
        signature, stock = entry
        names = tuple(keys)
        takes = stock.get(names)
        if takes is None:
            takes = stock[names] = takes_whole_batch(signature, names)
        return takes, signature


def _loss_of(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, Mapping):  # dict and transformers' ModelOutput
        return outputs.get("loss")
    return None


def _logits_of(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        return outputs["logits"]
    return outputs[0]


def fallback_loss(
    model: nn.Module,
    inputs: Mapping[str, Any],
    label_names: list[str],
    *,
    label_smoothing: float = 0.0,
    compute_loss_func: Any = None,
    num_items_in_batch: Any = None,
    signature: tuple[set[str], bool] | None = None,
) -> tuple[torch.Tensor, Any]:
    """Loss and outputs of a model that does not take the whole batch by name (see
    :func:`takes_whole_batch`).

    The non-label entries go to ``forward`` by name when it names them all, else
    positionally in the batch's order. The model's own loss is used when its outputs
    carry one; else ``compute_loss_func(outputs, labels,
    num_items_in_batch=...)`` when given; else cross-entropy on the logits (the output
    itself, its ``"logits"`` entry or its first element), computed in float32.
    ``signature``: the :func:`forward_parameters` of the model that ``model`` wraps (a
    ``torch.compile`` wrapper's own ``forward`` names nothing); default, ``model``'s.

    Returns:
        ``(loss, outputs)``; a bare logits tensor comes back as ``{"logits": logits}``,
        which the Trainer's prediction step reads as predictions.

    Example:
        >>> model = nn.Linear(3, 4)
        >>> batch = {"x": torch.randn(5, 3), "labels": torch.tensor([0, 1, 2, 3, 0])}
        >>> loss, out = fallback_loss(model, batch, ["labels"])
        >>> torch.allclose(loss, F.cross_entropy(out["logits"], batch["labels"]))
        True
    """
    features = {k: v for k, v in inputs.items() if k not in label_names}
    labels = inputs.get(label_names[0]) if label_names else None
    names, _ = forward_parameters(model) if signature is None else signature
    outputs = model(**features) if set(features) <= names else model(*features.values())
    loss = _loss_of(outputs)
    if loss is None:
        if compute_loss_func is not None:
            loss = compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        else:
            if labels is None:
                raise ValueError(
                    f"the model returned no loss and the batch has no {label_names!r} entry "
                    f"for the cross-entropy fallback; batch keys: {sorted(inputs)}"
                )
            logits = _logits_of(outputs)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing)
    if isinstance(outputs, torch.Tensor):
        outputs = {"logits": outputs}
    return loss, outputs
