"""The precision controller: per-module compute precision from sensitivity, with hysteresis.

:class:`PrecisionController` holds one decision per module, applies it with
:class:`~hf_triaccel.precision.hooks.PrecisionHook`, and changes it when the sensitivity
ranking says so (:class:`~hf_triaccel.precision.policy.PrecisionPolicy`). Modules without
a decision follow the surrounding autocast (the Trainer's bf16/fp16 setting, or none).

Driven by a :class:`~hf_triaccel.curvature.signals.SignalTracker`, everything happens
inside ``optimizer.step()``: at each evaluation of the tracker the controller polls the
fp16 overflow accumulators and re-ranks the modules; in between it polls the accumulators
every ``poll_every`` optimizer steps (one host sync each time). Every change is logged as a
:class:`PrecisionEvent`.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from hf_triaccel.curvature.signals import ModuleSignals, SignalTracker
from hf_triaccel.precision.costs import cost_shares, forward_cost, has_weight
from hf_triaccel.precision.hooks import PrecisionHook
from hf_triaccel.precision.policy import PRECISIONS, PrecisionPolicy


@dataclass(frozen=True)
class PrecisionEvent:
    """One change of a module's compute precision.

    ``old`` is ``None`` when the module followed the surrounding autocast before.
    ``reason`` is ``"norm"`` (normalisation layer), ``"rule"`` (user rule), ``"initial"``
    (first ranking), ``"rank"`` (ranking, after hysteresis) or ``"overflow"`` (an fp16
    output overflowed).
    """

    step: int
    module: str
    old: str | None
    new: str
    reason: str


class PrecisionController:
    """Chooses and applies each module's compute precision (fp32, bf16 or fp16).

    Args:
        model: the (unwrapped) model whose modules are hooked; names are those of
            ``model.named_modules()``, as in the Fisher collector. Its floating
            parameters must be float32 (autocast mixed precision keeps them so).
        policy: rules, ranking fractions and hysteresis (default :class:`PrecisionPolicy`).
        tracker: the signal tracker; when given, the controller follows its evaluations
            and optimizer steps (see the module docstring).
        poll_every: optimizer steps between two polls of the fp16 overflow accumulators
            (besides the poll at every evaluation); 0 polls at evaluations only.

    Attributes:
        decisions: the current precision by module name (modules absent follow the
            surrounding autocast).
        events: every change, in order.
        overflowed: modules whose fp16 output overflowed; they stay at bf16 or above.
        costs: multiply-adds per forward of each rankable module, measured on its first
            forward (empty until then).
        activations: floating input and output elements per forward of each rankable
            module, measured with ``costs``.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        >>> policy = PrecisionPolicy(fp32_fraction=0.5, fp16_fraction=0.5)
        >>> controller = PrecisionController(model, policy)
        >>> controller.decisions
        {'1': 'fp32'}
        >>> controller.update({"0": 2.0, "2": 1.0}, step=200)
        >>> controller.decisions
        {'1': 'fp32', '0': 'fp32', '2': 'fp16'}
        >>> controller.remove()
    """

    def __init__(
        self,
        model: nn.Module,
        policy: PrecisionPolicy | None = None,
        *,
        tracker: SignalTracker | None = None,
        poll_every: int = 50,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(poll_every, int) or poll_every < 0:
            raise ValueError(f"poll_every={poll_every!r}: needs an int >= 0")
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.dtype != torch.float32:
                raise ValueError(
                    f"parameter {name!r} is {p.dtype}: per-module precision needs float32 "
                    "parameters (autocast mixed precision), not a model cast to half precision"
                )
        self.policy = policy or PrecisionPolicy()
        self.poll_every = poll_every
        self._modules = dict(model.named_modules())
        self.decisions: dict[str, str] = {}
        self.events: list[PrecisionEvent] = []
        self.overflowed: set[str] = set()
        self.evaluations = 0
        self._pending: dict[str, tuple[str, int]] = {}
        self._hooks: dict[str, PrecisionHook] = {}
        self._fixed: dict[str, tuple[str, str]] = {}
        for name, module in self._modules.items():
            fixed = self.policy.fixed(name, module)
            if fixed is not None:
                self._fixed[name] = fixed
        for rule in self.policy.rules:
            if not any(rule.matches(n, m) for n, m in self._modules.items()):
                warnings.warn(f"precision rule {rule.match!r} matches no module", stacklevel=2)
        # compute and activations per forward of each rankable module, measured once on
        # its first forward
        self.costs: dict[str, float] = {}
        self.activations: dict[str, float] = {}
        self._cost_hooks = {
            name: module.register_forward_hook(functools.partial(self._measure_cost, name))
            for name, module in self._modules.items()
            if name not in self._fixed and has_weight(module)
        }
        self.tracker = tracker
        self._listener = None if tracker is None else tracker.add_listener(self._on_step)
        self._removed = False
        self._apply_fixed(tracker.steps if tracker is not None else 0)

    # ------------------------------------------------------------------ decisions

    def _measure_cost(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        cost = forward_cost(module, args, output)
        if cost is not None:
            self.costs[name], self.activations[name] = cost
        self._cost_hooks.pop(name).remove()

    def _set(self, name: str, precision: str, step: int, reason: str) -> None:
        """Changes one module's precision and logs the change."""
        old = self.decisions.get(name)
        if old != precision:
            self._apply(name, precision)
            self.events.append(PrecisionEvent(step, name, old, precision, reason))

    def _apply(self, name: str, precision: str | None) -> None:
        """Sets one module's precision (``None``: follow the surrounding autocast)."""
        hook = self._hooks.get(name)
        if precision == "fp32" and isinstance(self._modules[name], _BatchNorm):
            # BatchNorm kernels take half-precision inputs with float32 parameters and
            # compute statistics, normalisation and running averages in float32 whatever
            # autocast says: fp32 is what they do unhooked. A hook would only add host
            # time, or, casting the input up, a float32 copy of every BatchNorm input.
            self.decisions[name] = precision
            return
        if precision is None:
            del self.decisions[name]
            if hook is not None:
                hook.remove()
                del self._hooks[name]
        else:
            self.decisions[name] = precision
            if hook is None:
                self._hooks[name] = PrecisionHook(self._modules[name], precision)
            else:
                hook.precision = precision
                hook.overflow = None

    def _floor(self, name: str, precision: str) -> str:
        """``precision`` raised to bf16 for modules that overflowed in fp16."""
        return "bf16" if precision == "fp16" and name in self.overflowed else precision

    def _apply_fixed(self, step: int) -> None:
        for name, (precision, reason) in self._fixed.items():
            self._set(name, self._floor(name, precision), step, reason)

    def update(self, sensitivity: Mapping[str, float], step: int) -> None:
        """Polls overflow, then ranks the modules by ``sensitivity`` and applies the policy.

        Modules fixed by a normalisation or user rule are left out of the ranking, as are
        modules whose sensitivity is not finite (no signal yet): they keep their precision.

        Args:
            sensitivity: sensitivity by module name (e.g. from :class:`SignalTracker`).
            step: the optimizer step, for the event log.
        """
        self._check_active()
        unknown = set(sensitivity) - set(self._modules)
        if unknown:
            raise KeyError(
                f"sensitivity names modules the model does not have: {sorted(unknown)[:5]}"
            )
        self.check_overflow(step)
        self.evaluations += 1
        candidates = {
            name: s
            for name, s in sensitivity.items()
            if name not in self._fixed and math.isfinite(s)
        }
        shares = cost_shares(candidates, self.costs, self.activations)
        # most sensitive per unit of cost first: a cheap module is protected cheaply
        ranked = sorted(candidates, key=lambda name: (-candidates[name] / max(shares[name]), name))
        before = [0.0, 0.0]
        for name in ranked:
            # the larger of the compute and activation shares up to the module's middle
            q = max(b + s / 2 for b, s in zip(before, shares[name], strict=True))
            before = [b + s for b, s in zip(before, shares[name], strict=True)]
            current = self.decisions.get(name)
            proposal = self._floor(name, self.policy.propose(q, current))
            if current is None:
                self._set(name, proposal, step, "initial")
                continue
            if proposal == current:
                self._pending.pop(name, None)
                continue
            previous, count = self._pending.get(name, (None, 0))
            count = count + 1 if previous == proposal else 1
            if count >= self.policy.patience:
                self._pending.pop(name, None)
                self._set(name, proposal, step, "rank")
            else:
                self._pending[name] = (proposal, count)

    def check_overflow(self, step: int) -> list[str]:
        """Reads the overflow accumulator of every fp16 module (one host sync) and moves
        the modules whose output overflowed to bf16. Returns their names.

        Under ``torch.distributed`` the flags are combined over processes (one
        all-reduce) so that every process keeps the same decisions; every process must
        then call this at the same steps, as the tracker-driven schedule does.
        """
        if self._removed:
            return []
        watched = sorted(n for n, p in self.decisions.items() if p == "fp16")
        if not watched:
            return []
        hooks = [self._hooks[n] for n in watched]
        device = next((h.overflow.device for h in hooks if h.overflow is not None), None)
        if device is None:
            device = next(self._modules[watched[0]].parameters(), torch.empty(0)).device
        flags = torch.stack(
            [
                torch.zeros((), device=device)
                if h.overflow is None
                else (~torch.isfinite(h.overflow)).to(device=device, dtype=torch.float32)
                for h in hooks
            ]
        )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        overflowed = flags.tolist()
        accumulators = [h.overflow for h in hooks if h.overflow is not None]
        if accumulators:
            torch._foreach_zero_(accumulators)
        moved = []
        for name, bad in zip(watched, overflowed, strict=True):
            if bad:
                self.overflowed.add(name)
                self._pending.pop(name, None)
                self._set(name, "bf16", step, "overflow")
                moved.append(name)
        return moved

    def _on_step(self, step: int, signals: dict[str, ModuleSignals] | None) -> None:
        if signals is not None:
            self.update({name: s.sensitivity for name, s in signals.items()}, step)
        elif self.poll_every and step % self.poll_every == 0:
            self.check_overflow(step)

    # ------------------------------------------------------------------ reporting

    def counts(self) -> dict[str, int]:
        """Number of modules per precision, as a telemetry provider (``precision_fp32``,
        ``precision_bf16``, ``precision_fp16``) plus ``precision_changes``, the number of
        logged events.

        Example:
            >>> controller = PrecisionController(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)))
            >>> controller.counts()
            {'precision_fp32': 1, 'precision_bf16': 0, 'precision_fp16': 0, 'precision_changes': 1}
        """
        out = {f"precision_{p}": 0 for p in PRECISIONS}
        for precision in self.decisions.values():
            out[f"precision_{precision}"] += 1
        out["precision_changes"] = len(self.events)
        return out

    def compute_shares(self) -> dict[str, float]:
        """Share of the measured compute (the ranked modules' multiply-adds) per
        precision; ``"autocast"`` for modules that follow the surrounding autocast.

        Example:
            >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 12))
            >>> controller = PrecisionController(model, PrecisionPolicy(fp16_fraction=0.0))
            >>> _ = model(torch.randn(1, 4))
            >>> controller.compute_shares()
            {'autocast': 1.0}
        """
        total = sum(self.costs.values())
        shares: dict[str, float] = {}
        for name, cost in self.costs.items():
            key = self.decisions.get(name, "autocast")
            shares[key] = shares.get(key, 0.0) + cost / total
        return shares

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Decisions, hysteresis state, overflowed modules and the event log.

        Overflow accumulators not yet polled are not saved: call :meth:`check_overflow`
        first to keep them.
        """
        return {
            "decisions": dict(self.decisions),
            "pending": {n: [p, c] for n, (p, c) in self._pending.items()},
            "overflowed": sorted(self.overflowed),
            "evaluations": self.evaluations,
            "events": [asdict(e) for e in self.events],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved; the module names must exist.

        The normalisation layers and user rules of this controller's policy are applied
        again afterwards (logged when they differ from the saved decisions).
        """
        self._check_active()
        named = set(state["decisions"]) | set(state["pending"]) | set(state["overflowed"])
        unknown = named - set(self._modules)
        if unknown:
            raise KeyError(
                f"precision state names modules the model does not have: {sorted(unknown)[:5]}"
            )
        for name, precision in state["decisions"].items():
            if precision not in PRECISIONS:
                raise ValueError(
                    f"saved precision {precision!r} of {name!r} is not one of {PRECISIONS}"
                )
        saved = dict(state["decisions"])
        for name in [n for n in self.decisions if n not in saved]:
            self._apply(name, None)
        for name, precision in saved.items():
            self._apply(name, precision)
        self.events = [PrecisionEvent(**e) for e in state["events"]]
        self._pending = {n: (p, int(c)) for n, (p, c) in state["pending"].items()}
        self.overflowed = set(state["overflowed"])
        self.evaluations = int(state["evaluations"])
        step = self.events[-1].step if self.events else 0
        self._apply_fixed(step)

    def _check_active(self) -> None:
        if self._removed:
            raise RuntimeError("the precision controller was removed")

    def remove(self) -> None:
        """Removes every hook and stops following the tracker; decisions stay readable.
        A removed controller makes no further decisions."""
        self._removed = True
        for handle in [*self._hooks.values(), *self._cost_hooks.values()]:
            handle.remove()
        self._hooks.clear()
        self._cost_hooks.clear()
        if self._listener is not None:
            self._listener.remove()
            self._listener = None

    def __repr__(self) -> str:
        counts = self.counts()
        inner = ", ".join(f"{p}={counts[f'precision_{p}']}" for p in PRECISIONS)
        return f"PrecisionController({inner})"
