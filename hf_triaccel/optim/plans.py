"""What :meth:`AdaFisher.step <hf_triaccel.optim.adafisher.AdaFisher.step>` reuses for a
param group from step to step: the group's state, its parameters' factors and the update
bound to their tensors, one part per (device, sharded) pair.

A part of DTensor parameters (FSDP2) holds their local shards, with the momentum's local
shard and the slice of the factors that the local rows read; the step hands it the local
shards of the gradients. A shard with no rows on this process is stepped too (an empty
tensor), so that its step count, which is not a DTensor, is the same on every process, as
``torch.distributed.checkpoint`` expects of a replicated tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_triaccel._types import ParamFactors
from hf_triaccel.curvature.collection.sharding import is_sharded, local_tensor
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.dispatch import resolve_impl
from hf_triaccel.optim.functional import compute_dtype, is_narrow, prepare_adafisher


@dataclass
class DevicePart:
    """The parameters of one param group on one device that have gradients (their local
    shards, for DTensors)."""

    device: torch.device
    positions: list[int] | None  # their positions in the group; None: every parameter
    sharded: bool  # DTensor parameters: the gradients are DTensors too
    params: list[torch.Tensor]
    moms: list[torch.Tensor]
    comps: list[torch.Tensor | None]  # Kahan compensation buffers (None: none kept)
    rounding: str
    factors: list[ParamFactors | None]
    # One buffer of step counts, so that counting a step is one operation; each
    # parameter's state["step"] is a view of its entry, as torch optimizers keep it.
    counts: torch.Tensor
    steps: list[torch.Tensor]
    impl: str
    update: Callable[..., None]


@dataclass
class GroupPlan:
    """A param group's plan; valid while the group, the optimizer's state mapping, the set
    of the group's parameters with gradients and the collector's factor storage stay the
    same (a state entry replaced in place, other than by ``load_state_dict``, is not seen)."""

    group: dict[str, Any]
    state: dict[Any, Any]  # the optimizer's state mapping the momenta were taken from
    params: list[torch.Tensor]
    n_params: int
    has_grad: tuple[bool, ...]
    generation: int
    parts: list[DevicePart]


def new_state(
    p: torch.Tensor, state_dtype: torch.dtype | None, rounding: str
) -> dict[str, torch.Tensor]:
    """A parameter's first state: ``step`` 0, a zero ``momentum`` of ``state_dtype`` (or the
    arithmetic's), and with ``rounding="kahan"`` on a weight narrower than the arithmetic,
    a zero ``compensation`` of the weight's dtype.

    Example:
        >>> sorted(new_state(torch.zeros(2, dtype=torch.bfloat16), torch.bfloat16, "kahan"))
        ['compensation', 'momentum', 'step']
    """
    # DTensors like a DTensor parameter: checkpointing saves them sharded
    entry = {
        "step": torch.zeros((), dtype=torch.float32, device=p.device),
        "momentum": torch.zeros_like(p, dtype=state_dtype or compute_dtype(p.dtype)),
    }
    if rounding == "kahan" and is_narrow(p.dtype):
        entry["compensation"] = torch.zeros_like(p)
    return entry


def plan_group(
    state: dict[Any, Any],
    group: dict[str, Any],
    grads: list[torch.Tensor | None],
    has_grad: tuple[bool, ...],
    generation: int,
    *,
    collector: FisherCollector | None,
    impl: str | None,
    owner: str,
    state_dtype: torch.dtype | None = None,
    rounding: str = "nearest",
) -> GroupPlan:
    """Creates the missing ``state`` of ``group``'s parameters with gradients (``step``, a
    ``momentum`` shaped like the parameter, and the factors of its layer from
    ``collector``) and binds their update, one part per device.

    Args:
        state: the optimizer's per-parameter state.
        group: the param group.
        grads: its parameters' gradients (``None`` where none).
        has_grad: which of them have one.
        generation: the collector's generation the plan is made for.
        collector: the Fisher collector, or ``None`` (F = 1 everywhere).
        impl: the optimizer's implementation choice.
        owner: the optimizer's name, for errors.
        state_dtype: the momentum's dtype (``None``: the arithmetic's).
        rounding: how the weights store their updates (``weight_rounding``).

    Raises:
        RuntimeError: a sparse gradient.
    """
    params = group["params"]
    by_param = {} if collector is None else collector.param_factors()
    saved = {} if collector is None else collector.checkpoint_tensors()
    by_device: dict[tuple[torch.device, bool], list[int]] = {}
    for j, (p, g) in enumerate(zip(params, grads, strict=True)):
        if g is None:
            continue
        if g.is_sparse:
            raise RuntimeError(f"{owner} does not support sparse gradients")
        entry = state[p]
        if not entry:
            entry.update(new_state(p, state_dtype, rounding))
        entry.update(saved.get(p, {}))
        if rounding == "kahan" and is_narrow(p.dtype) and "compensation" not in entry:
            entry["compensation"] = torch.zeros_like(p)  # state saved without compensation
        by_device.setdefault((p.device, is_sharded(p)), []).append(j)
    parts = []
    for (device, sharded), positions in by_device.items():
        ps = [params[j] for j in positions]
        entries = [state[p] for p in ps]
        counts = torch.stack([e["step"] for e in entries]).to(device, torch.float32)
        steps = list(counts.unbind())
        for entry, step in zip(entries, steps, strict=True):
            entry["step"] = step
        factors = [by_param.get(p) for p in ps]
        moms = [local_tensor(e["momentum"]) for e in entries]
        comps = [e.get("compensation") for e in entries]
        comps = [None if c is None else local_tensor(c) for c in comps]
        ps = list(map(local_tensor, ps))
        resolved = resolve_impl(impl, device)
        parts.append(
            DevicePart(
                device=device,
                positions=None if len(positions) == len(params) else positions,
                sharded=sharded,
                params=ps,
                moms=moms,
                comps=comps,
                rounding=rounding,
                factors=factors,
                counts=counts,
                steps=steps,
                impl=resolved,
                update=prepare_adafisher(
                    ps, moms, factors, steps, impl=resolved, comps=comps, rounding=rounding
                ),
            )
        )
    return GroupPlan(group, state, params, len(params), has_grad, generation, parts)
