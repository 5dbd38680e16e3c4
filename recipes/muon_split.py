"""Muon on a transformer's hidden weight matrices, AdamW on the rest, as one optimizer the
Trainer drives: the usual split of Muon runs on language models.

``torch.optim.Muon`` orthogonalises the momentum of each 2-D hidden weight (attention and
MLP projections) with a Newton-Schulz iteration; it is not meant for embeddings, the
output layer, norms or biases, which AdamW steps here, each part with its own learning
rate. :class:`MuonWithAdamW` holds both as one ``torch.optim.Optimizer`` whose parameter
groups are the two optimizers' own groups: the Trainer's learning-rate schedule scales
every group from its own initial rate, and one state dict saves and resumes both.

Example:
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16,
    ...                                    n_positions=8))
    >>> [name for name, _ in hidden_matrices(model)]  # doctest: +NORMALIZE_WHITESPACE
    ['transformer.h.0.attn.c_attn.weight', 'transformer.h.0.attn.c_proj.weight',
     'transformer.h.0.mlp.c_fc.weight', 'transformer.h.0.mlp.c_proj.weight']
    >>> groups = [{"params": list(model.parameters()), "weight_decay": 0.0}]
    >>> optimizer = MuonWithAdamW(groups, matrices=[p for _, p in hidden_matrices(model)],
    ...                           lr=0.02, adamw_lr=3e-4)
    >>> [(g["muon"], len(g["params"])) for g in optimizer.param_groups]
    [(True, 4), (False, 12)]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

# the modules whose 2-D weights are hidden matrices: transformers' GPT-2 Conv1D and Linear
# layers inside the blocks (not the embeddings nor the output layer, outside them)
MATRIX_MODULES = ("Conv1D", "Linear")
ADJUST_LR = ("original", "match_rms_adamw")


def hidden_matrices(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The 2-D weights of the linear layers inside the transformer blocks (``.h.`` in
    GPT-2's names), the matrices Muon steps; embeddings, the output layer (tied to the
    input embedding), norms and biases are left out."""
    found = []
    for module_name, module in model.named_modules():
        if type(module).__name__ not in MATRIX_MODULES or ".h." not in f".{module_name}.":
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.ndim == 2 and weight.requires_grad:
            found.append((f"{module_name}.weight", weight))
    return found


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on ``matrices``, ``torch.optim.AdamW`` on every other
    parameter of ``params``, as one optimizer.

    Args:
        params: the parameter groups (the Trainer's: with and without weight decay); each
            splits into its matrices and the rest, keeping its other keys.
        matrices: the parameters Muon steps (:func:`hidden_matrices`).
        lr: Muon's learning rate.
        adamw_lr: AdamW's learning rate, for the rest.
        momentum: Muon's momentum (Nesterov).
        adjust_lr: Muon's ``adjust_lr_fn``: ``"match_rms_adamw"`` (the default here) scales
            each matrix's update to the RMS of an AdamW update, the same for a matrix and
            its transpose (GPT-2's Conv1D stores its weights as (in, out)); ``"original"``
            scales by sqrt(max(1, rows / cols)).
        betas, eps: AdamW's.
        fused: AdamW's fused kernel (``None``: torch's default).

    Every group has a ``muon`` key: ``True`` for Muon's groups.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        *,
        matrices: Sequence[torch.Tensor],
        lr: float,
        adamw_lr: float,
        momentum: float = 0.95,
        adjust_lr: str = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        fused: bool | None = None,
    ) -> None:
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"adjust_lr={adjust_lr!r}: one of {ADJUST_LR}")
        ids = {id(p) for p in matrices}
        muon_groups, adamw_groups = [], []
        for group in params:
            group = dict(group)
            ps = list(group.pop("params"))
            group.pop("lr", None)
            ours = [p for p in ps if id(p) in ids]
            rest = [p for p in ps if id(p) not in ids]
            if ours:
                muon_groups.append({**group, "params": ours, "lr": lr, "muon": True})
            if rest:
                adamw_groups.append({**group, "params": rest, "lr": adamw_lr, "muon": False})
        if not muon_groups:
            raise ValueError("MuonWithAdamW: no matrix among the parameters for Muon")
        self.muon = torch.optim.Muon(
            muon_groups, lr=lr, momentum=momentum, nesterov=True, adjust_lr_fn=adjust_lr
        )
        self.adamw = torch.optim.AdamW(
            adamw_groups or [{"params": [], "muon": False}],
            lr=adamw_lr,
            betas=betas,
            eps=eps,
            fused=fused,
        )
        # the two optimizers' group dicts (their defaults filled in) are this one's groups
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self._link()

    def _link(self) -> None:
        """Points the two optimizers at this one's groups and state (after a load too)."""
        self.muon.param_groups = [g for g in self.param_groups if g["muon"]]
        self.adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        if any(g["params"] for g in self.adamw.param_groups):
            self.adamw.step()
        return loss
