"""The Trainer's low-memory mode (``triaccel_low_memory=True``): AdaFisherW's momentum in
bfloat16, Kahan-compensated updates of bfloat16 weights, and gradient release where the
run allows it; the run's memory ledger in the efficiency report and the model card.

What blocks gradient release (:mod:`hf_triaccel.optim.release`) is found from the
arguments when the optimizer is built, and said in the log with what it costs (the
gradients' bytes, held on every step instead of one at a time): global-norm clipping
(``max_grad_norm``, 1.0 by default: set ``max_grad_norm=0`` to release), gradient
accumulation, the elastic batch, fp16 loss scaling, several processes.

The weights keep the dtype the model was loaded in: the mode saves most with a model
loaded in bfloat16 (``torch_dtype=torch.bfloat16``); with float32 weights it saves the
momentum's two bytes and the released gradients only, and the log says so.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn
from transformers import TrainingArguments

from hf_triaccel.memory.ledger import count_ledger, held_gradient_bytes, trainable

logger = logging.getLogger(__name__)

LOW_MEMORY_STATE = {"state_dtype": "bfloat16", "weight_rounding": "kahan"}
"""The optimizer settings ``triaccel_low_memory=True`` chooses (release aside)."""


def _low_memory(args: TrainingArguments) -> bool:
    return bool(getattr(args, "triaccel_low_memory", False))


def _processes(args: TrainingArguments) -> int:
    """The run's processes; while ``TrainingArguments`` are being built (their validation
    resolves the optimizer's settings) the launcher's ``WORLD_SIZE``."""
    try:
        return args.world_size
    except AttributeError:  # before TrainingArguments.__post_init__ set up the processes
        return int(os.environ.get("WORLD_SIZE", "1"))


def release_blockers(args: TrainingArguments) -> list[str]:
    """Why a run of ``args`` cannot release gradients (empty: it can).

    Example:
        >>> args = TrainingArguments(output_dir="out", max_grad_norm=1.0)
        >>> release_blockers(args)  # doctest: +ELLIPSIS
        ['max_grad_norm=1.0 clips by the norm of all the gradients, ...']
    """
    reasons = []
    if args.max_grad_norm is not None and args.max_grad_norm > 0:
        reasons.append(
            f"max_grad_norm={args.max_grad_norm} clips by the norm of all the gradients, "
            "known only when the backward pass ends (max_grad_norm=0 releases)"
        )
    if args.gradient_accumulation_steps > 1:
        reasons.append(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps} sums several "
            "backward passes into each gradient before the step"
        )
    if getattr(args, "elastic_batch", False) or args.auto_find_batch_size:
        reasons.append("the elastic batch may split a batch into several backward passes")
    if args.fp16:
        reasons.append("fp16 loss scaling unscales every gradient and checks it for inf first")
    processes = _processes(args)
    if processes > 1:
        reasons.append(f"{processes} processes: each gradient is all-reduced after the backward")
    return reasons


def low_memory_settings(args: TrainingArguments) -> dict[str, Any]:
    """The AdaFisherConfig fields ``triaccel_low_memory`` sets (none when it is off).

    Example:
        >>> args = TrainingArguments(output_dir="out", max_grad_norm=0.0)
        >>> args.triaccel_low_memory = True
        >>> low_memory_settings(args)["release_grads"]
        True
    """
    if not _low_memory(args):
        return {}
    return {**LOW_MEMORY_STATE, "release_grads": not release_blockers(args)}


def announce_low_memory(args: TrainingArguments, model: nn.Module) -> None:
    """Logs, at the start of the run, what the low-memory mode does here: the release
    blockers with the bytes they cost, and float32 weights that it leaves as they are."""
    if not _low_memory(args):
        return
    params = trainable(model)
    blockers = release_blockers(args)
    if blockers:
        cost = held_gradient_bytes(model, "held") - held_gradient_bytes(model, "released")
        logger.warning(
            "hf_triaccel low memory: gradient release off (%s); the gradients are held "
            "until the step: %.1f MB more than releasing (%.2f bytes per parameter)",
            "; ".join(blockers),
            cost / 1e6,
            cost / max(1, sum(p.numel() for p in params)),
        )
    wide = sum(p.numel() for p in params if p.dtype == torch.float32)
    if wide:
        logger.warning(
            "hf_triaccel low memory: %d parameters are float32 and stay so (load the model "
            "with torch_dtype=torch.bfloat16 for bfloat16 weights with compensated updates)",
            wide,
        )


def ledger_report(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The run's memory ledger for the logs, the efficiency report and the model card:
    bytes per parameter on a step that holds the gradients and, with gradient release, on
    a releasing one (``None`` without release; nothing before the optimizer's first step,
    which creates its state)."""
    if not optimizer.state:
        return {}
    release = getattr(optimizer, "release", None)
    held = count_ledger(model, optimizer, step="held")
    released = count_ledger(model, optimizer, step="released") if release is not None else None
    return {
        "bytes_per_parameter_held": round(held.per_parameter()["total"], 3),
        "bytes_per_parameter_released": (
            None if released is None else round(released.per_parameter()["total"], 3)
        ),
    }
