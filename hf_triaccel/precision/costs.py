"""What a module costs per forward, as the precision policy weighs it: its multiply-adds
(compute time in fp32 grows with them) and the floating elements of its inputs and
outputs (the memory of float32 copies grows with them)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hf_triaccel.precision.containers import tensors


def has_weight(module: nn.Module) -> bool:
    """Whether the module has a weight tensor: the modules the ranking weighs.

    Example:
        >>> has_weight(nn.Linear(2, 2)), has_weight(nn.ReLU())
        (True, False)
    """
    return isinstance(getattr(module, "weight", None), torch.Tensor)


def macs_per_output(module: nn.Module, out: torch.Tensor) -> float:
    """Multiply-adds per output element: the weight's size over the output channels
    (Linear, ConvNd, transformers' Conv1D); 1 for lookups and elementwise weights.

    Example:
        >>> macs_per_output(nn.Conv2d(3, 8, 3), torch.zeros(1, 8, 4, 4))  # 3 x 3 x 3
        27.0
    """
    weight = module.weight
    if weight.dim() < 2 or isinstance(module, nn.Embedding):
        return 1.0
    channels = (
        getattr(module, "out_channels", None)
        or getattr(module, "out_features", None)
        or out.shape[-1]
    )
    return weight.numel() / channels


def forward_cost(module: nn.Module, args: Any, output: Any) -> tuple[float, float] | None:
    """(multiply-adds, floating input and output elements) of one forward, from its
    arguments and output; ``None`` when the output holds no tensor.

    Example:
        >>> layer = nn.Linear(4, 3)
        >>> x = torch.zeros(2, 4)
        >>> forward_cost(layer, (x,), layer(x))  # 6 outputs of 4 multiply-adds; 8 + 6 elements
        (24.0, 14)
    """
    out = output if isinstance(output, torch.Tensor) else next(tensors(output), None)
    if out is None:
        return None
    elements = sum(t.numel() for t in tensors((args, output)) if t.is_floating_point())
    return out.numel() * macs_per_output(module, out), elements


def cost_shares(
    names: Iterable[str], costs: Mapping[str, float], activations: Mapping[str, float]
) -> dict[str, tuple[float, float]]:
    """Each module's (compute share, activation share) among ``names``; equal shares
    until every one of them has been measured.

    Example:
        >>> cost_shares(["a", "b"], {"a": 3.0, "b": 1.0}, {"a": 1.0, "b": 1.0})
        {'a': (0.75, 0.5), 'b': (0.25, 0.5)}
    """
    names = list(names)
    if not all(costs.get(n, 0.0) > 0 for n in names):
        return dict.fromkeys(names, (1.0 / len(names),) * 2)
    compute = sum(costs[n] for n in names)
    elements = sum(activations[n] for n in names) or 1.0
    return {n: (costs[n] / compute, activations[n] / elements) for n in names}
