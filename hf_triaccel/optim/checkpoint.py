"""AdaFisher's saved state: what a state dict must hold, and how a saved entry is restored.

The state dict holds, per param group, ``lr``, ``beta``, ``damping``, ``weight_decay``
(and ``maximize``, which groups saved before it existed default to ``False``) and the
refresh schedule (:data:`SCHEDULE_KEY`), and per parameter ``step`` (a one-element float32
tensor, or a number in torch's older format), ``momentum`` (shaped like the parameter: a
DTensor for a DTensor parameter) and, for a parameter of a layer with Fisher factors, the
factors of that layer (``fisher_a``, ``fisher_g``, and with ``ema="paper"``
``fisher_a_used``, ``fisher_g_used``: full vectors, shared by the layer's parameters).
Those are the parts that ``torch.distributed.checkpoint.state_dict`` keeps. hf_triaccel 0.2
kept the factors by layer name and the schedule under :data:`FISHER_KEY`; such state dicts
still load.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from hf_triaccel.curvature.collection.sharding import is_sharded
from hf_triaccel.optim.functional import compute_dtype

FISHER_KEY = "fisher"
"""Where hf_triaccel 0.2's state dicts kept the Fisher factors and the refresh schedule."""

SCHEDULE_KEY = "fisher_steps"
"""The param-group entry of a saved state dict that holds the refresh schedule: the
optimizer steps taken, the same in every group."""

ROUNDING_SEED_KEY = "rounding_seed"
"""The param-group entry of a saved state dict that holds the seed of stochastic rounding."""

GROUP_KEYS = ("lr", "beta", "damping", "weight_decay")
STATE_KEYS = ("step", "momentum")


def check_loadable(state_dict: Mapping[str, Any], owner: str) -> None:
    """Refuses a state dict that another optimizer wrote, naming what it lacks.

    Args:
        state_dict: the torch part of the state dict (``state`` and ``param_groups``).
        owner: the name errors start with.

    Raises:
        ValueError: an entry is missing.

    Example:
        >>> adamw = {"state": {0: {"step": 1.0, "exp_avg": 0, "exp_avg_sq": 0}},
        ...          "param_groups": [{"lr": 1e-3, "beta": 0.9, "damping": 1e-3,
        ...                            "weight_decay": 0.0, "params": [0]}]}
        >>> check_loadable(adamw, "AdaFisher.load_state_dict")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: AdaFisher.load_state_dict: the state of parameter 0 has no ['momentum'] ...
    """
    missing = [k for k in ("state", "param_groups") if k not in state_dict]
    if missing:
        raise ValueError(f"{owner}: the state dict has no {missing} (it has {sorted(state_dict)})")
    for i, group in enumerate(state_dict["param_groups"]):
        missing = [k for k in GROUP_KEYS if k not in group]
        if missing:
            present = sorted(k for k in group if k != "params")
            raise ValueError(
                f"{owner}: param group {i} has no {missing} (it has {present}); "
                "the state dict was not written by AdaFisher or AdaFisherW"
            )
    for pid, entry in state_dict["state"].items():
        missing = [k for k in STATE_KEYS if k not in entry]
        if missing:
            raise ValueError(
                f"{owner}: the state of parameter {pid} has no {missing} (it has "
                f"{sorted(entry)}); the state dict was not written by AdaFisher or AdaFisherW"
            )


def saved_schedule(groups: list[dict[str, Any]]) -> tuple[int | None, list[dict[str, Any]]]:
    """The refresh schedule saved in param groups (``None`` when none holds one) and the
    groups without it.

    Example:
        >>> saved_schedule([{"lr": 0.1, "fisher_steps": 7, "params": [0]}])
        (7, [{'lr': 0.1, 'params': [0]}])
    """
    found = [g[SCHEDULE_KEY] for g in groups if SCHEDULE_KEY in g]
    rest = [{k: v for k, v in g.items() if k != SCHEDULE_KEY} for g in groups]
    return (int(found[0]) if found else None), rest


def restore_states(
    optimizer: Optimizer,
    state_dict: Mapping[str, Any],
    factor_tensors: Mapping[torch.Tensor, dict[str, torch.Tensor]] | None = None,
    *,
    state_dtype: torch.dtype | None = None,
) -> None:
    """Sets each parameter's state from its saved entry, after torch's
    ``load_state_dict``: torch casts the momentum to the parameter's dtype (a bfloat16
    one would lose bits) and leaves ``step`` as saved. The restored ``step`` is a
    float32 tensor, the ``momentum`` of ``state_dtype`` (default: the parameter's compute
    dtype), a saved ``compensation`` of the parameter's dtype, all on its device and all
    copies (torch would share the tensors of an optimizer's live ``state_dict()``).

    ``factor_tensors`` gives, per parameter, its live factor tensors by state key (the
    collector's :meth:`~hf_triaccel.curvature.collector.FisherCollector.checkpoint_tensors`):
    saved factors are copied into them, and the state holds the live tensors.

    Raises:
        ValueError: a saved momentum whose shape or sharding does not match its
            parameter's, or saved factors of another length.

    Example:
        >>> p = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        >>> optimizer = torch.optim.SGD([p])
        >>> restore_states(optimizer, {"state": {0: {"step": 3, "momentum": torch.ones(2)}},
        ...                            "param_groups": [{"params": [0]}]})
        >>> optimizer.state[p]["step"], optimizer.state[p]["momentum"].dtype
        (tensor(3.), torch.float64)
    """
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, p in zip(saved_ids, params, strict=True):
        if pid not in state_dict["state"]:
            continue
        saved = state_dict["state"][pid]
        momentum = saved["momentum"]
        if momentum.shape != p.shape or is_sharded(momentum) != is_sharded(p):
            kinds = ["a DTensor" if is_sharded(t) else "a tensor" for t in (momentum, p)]
            raise ValueError(
                f"the saved momentum of parameter {pid} is {kinds[0]} of shape "
                f"{tuple(momentum.shape)}, the parameter {kinds[1]} of shape {tuple(p.shape)}; "
                "a sharded (FSDP2) model's optimizer state loads through "
                "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict"
            )
        step = torch.as_tensor(saved["step"], dtype=torch.float32)  # a number in older torch
        state = {
            "step": step.to(p.device, copy=True),
            "momentum": momentum.to(p.device, state_dtype or compute_dtype(p.dtype), copy=True),
        }
        if "compensation" in saved:
            state["compensation"] = saved["compensation"].to(p.device, p.dtype, copy=True)
        live = {} if factor_tensors is None else factor_tensors.get(p, {})
        for key, tensor in live.items():
            if key in saved:
                if saved[key].shape != tensor.shape:
                    raise ValueError(
                        f"the saved {key} of parameter {pid} has shape "
                        f"{tuple(saved[key].shape)}, its layer's factor {tuple(tensor.shape)}"
                    )
                tensor.copy_(saved[key])
        state.update(live)
        optimizer.state[p] = state


def keep_in_state_dict(optimizer: Optimizer, key: str, **parts: Any) -> None:
    """Saves the state of ``parts`` (objects with ``state_dict`` / ``load_state_dict``,
    such as the precision controller) in ``optimizer.state_dict()`` and restores it in
    ``optimizer.load_state_dict()``, through torch's public optimizer hooks.

    The state is an entry ``key`` of the first param group, as the refresh schedule is:
    ``torch.distributed.checkpoint.state_dict`` (Accelerate's and the Trainer's FSDP2
    checkpoints) keeps only ``state`` and ``param_groups``, and a group's entries
    besides ``params``. The entry is the state serialised by ``torch.save`` into bytes:
    ``torch.distributed.checkpoint`` loads into a state dict of the same structure, and
    the parts' states change structure as training goes (logs grow, signals appear),
    while one value loads whatever it holds; ``torch.load(weights_only=True)`` reads it.
    A state dict holding ``key`` at its top level as a plain dict (hf_triaccel 0.2)
    still loads.

    Example:
        >>> class Counter:
        ...     def __init__(self): self.n = 0
        ...     def state_dict(self): return {"n": self.n}
        ...     def load_state_dict(self, state): self.n = state["n"]
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> saved, restored = Counter(), Counter()
        >>> saved.n = 5
        >>> first, second = torch.optim.SGD([p]), torch.optim.SGD([p])
        >>> keep_in_state_dict(first, "counter", counter=saved)
        >>> keep_in_state_dict(second, "counter", counter=restored)
        >>> second.load_state_dict(first.state_dict())
        >>> restored.n, "counter" in second.param_groups[0]
        (5, False)
    """

    def save(opt: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        # the groups of a state dict are copies: the live param groups stay as they are
        buffer = io.BytesIO()
        torch.save({name: p.state_dict() for name, p in parts.items()}, buffer)
        state_dict["param_groups"][0][key] = buffer.getvalue()
        return state_dict

    def load(opt: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = dict(state_dict)
        saved = state_dict.pop(key, None)
        groups = []
        for group in state_dict.get("param_groups", []):
            if key in group:
                group = dict(group)
                saved = group.pop(key)
            groups.append(group)
        state_dict["param_groups"] = groups
        if isinstance(saved, bytes):
            saved = torch.load(io.BytesIO(saved), weights_only=True)
        if saved is not None:
            for name, part in parts.items():
                part.load_state_dict(saved[name])
        return state_dict

    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(load)
