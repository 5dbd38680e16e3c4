"""The one parameter-group rule: no weight decay on biases and normalisation weights.

Every entry point (``AdaFisher.from_model``, the Trainer integration, the Accelerate
helper, the optimizer factories) groups parameters with :func:`param_groups`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_triaccel._types import is_normalisation


def no_decay_names(model: nn.Module) -> set[str]:
    """Names (as in ``named_parameters()``) of the parameters that get no weight decay:
    biases, parameters of normalisation layers and one-dimensional parameters.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> sorted(no_decay_names(model))
        ['0.bias', '1.bias', '1.weight']
    """
    names = set()
    for module_name, module in model.named_modules():
        norm = is_normalisation(module)
        for attr, param in module.named_parameters(recurse=False):
            if norm or attr.endswith("bias") or param.ndim <= 1:
                names.add(f"{module_name}.{attr}" if module_name else attr)
    return names


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters of ``model`` in two groups: with ``weight_decay`` and
    without it (see :func:`no_decay_names`). Empty groups are left out.

    Example:
        >>> groups = param_groups(nn.Linear(4, 2), weight_decay=0.01)
        >>> [(len(g["params"]), g["weight_decay"]) for g in groups]
        [(1, 0.01), (1, 0.0)]
    """
    skip = no_decay_names(model)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name in skip else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]
