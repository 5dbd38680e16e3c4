"""Optimizers of ``recipes/cifar10_speedrun.py``: Muon on conv filters viewed as matrices,
AdaFisher on the layers named in the settings, SGD-Nesterov on the rest.

Example:
    >>> from speedrun_net import SpeedrunNet
    >>> net = SpeedrunNet(widths=(8, 16, 16))
    >>> opt = SpeedrunOptimizer(net, OptimSettings.parse("adafisher:lr=0.01,on=head"), batch=4)
    >>> sorted(opt.adafisher_modules)
    ['head']
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from hf_triaccel import AdaFisherW, FisherCollector

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADAFISHER_PARTS = ("block1", "block2", "block3", "head", "norms")
PRESETS = {"muon": (), "adafisher": ("block1", "block2", "block3", "head")}


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz iteration that Muon uses to orthogonalise a 2-D update,
    in bf16, on the wide orientation of ``g``.

    Example:
        >>> s = torch.linalg.svdvals(newton_schulz(torch.randn(16, 64)).float())
        >>> bool(((s > 0.5) & (s < 1.5)).all())
        True
    """
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16()
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class NewtonSchulzMuon(Optimizer):
    """Muon for torch versions without ``torch.optim.Muon``, with the same arguments and
    arithmetic: momentum as an EMA, Nesterov, Newton-Schulz, the update scaled by
    sqrt(max(1, rows / cols)), decoupled weight decay.

    Example:
        >>> p = torch.zeros(4, 8)
        >>> p.grad = torch.randn(4, 8)
        >>> NewtonSchulzMuon([p], lr=0.1).step()
    """

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True):
        super().__init__(
            params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)
        )

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = newton_schulz(update)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                scale = math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
                p.add_(update, alpha=-group["lr"] * scale)


class FilterMuon:
    """Muon over conv filters, each viewed as an (out, in * k * k) matrix.

    ``torch.optim.Muon`` (where the installed torch has it, else
    :class:`NewtonSchulzMuon`) steps 2-D aliases that share the filters' storage; each
    step hands them the filters' gradients, viewed the same way.

    Example:
        >>> conv = nn.Conv2d(2, 4, 3)
        >>> conv.weight.grad = torch.randn_like(conv.weight)
        >>> before = conv.weight.detach().clone()
        >>> FilterMuon([conv.weight], lr=0.1, momentum=0.6).step()
        >>> bool((conv.weight != before).any())
        True
    """

    def __init__(self, filters: list[torch.Tensor], lr: float, momentum: float) -> None:
        if any(not f.is_contiguous() for f in filters):
            raise ValueError("FilterMuon needs contiguous filters (not channels-last)")
        self.filters = filters
        self.matrices = [f.detach().view(f.shape[0], -1) for f in filters]
        muon = getattr(torch.optim, "Muon", NewtonSchulzMuon)
        self.optimizer = muon(
            self.matrices, lr=lr, momentum=momentum, nesterov=True, weight_decay=0.0
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self) -> None:
        for f, m in zip(self.filters, self.matrices, strict=True):
            m.grad = None if f.grad is None else f.grad.reshape(m.shape)
        self.optimizer.step()


@dataclass
class OptimSettings:
    """One optimizer configuration of the speedrun (a ``--config`` value).

    Args:
        name: the preset it started from.
        on: parts trained by AdaFisherW (of :data:`ADAFISHER_PARTS`: a block's two conv
            filters, the head, or ``norms``, every BatchNorm bias); the other filters get
            Muon, the head and the biases SGD-Nesterov.
        muon_lr, muon_momentum: Muon's.
        adafisher_lr, adafisher_beta, adafisher_damping, adafisher_gamma,
            adafisher_update_every, adafisher_ema, adafisher_weight_decay: AdaFisherW's;
            the factors are refreshed every 10 steps rather than the library's default
            for long runs, since a run here is a few hundred steps.
        adafisher_head_lr: AdaFisherW's learning rate for the head (default: adafisher_lr).
        bias_lr, head_lr, sgd_momentum: SGD-Nesterov's.
        decay: weight decay per sample of the SGD groups (times the batch: the decay
            that one step applies at the peak learning rate).
        whiten_bias_epochs: epochs over which the whitening bias's learning rate decays
            linearly to zero (then it stays frozen).
        renorm: rescale every trained filter tensor to Frobenius norm sqrt(out) before
            each step (the net is scale-invariant in them: BatchNorm follows).
    """

    name: str = "muon"
    on: tuple[str, ...] = ()
    muon_lr: float = 0.24
    muon_momentum: float = 0.6
    adafisher_lr: float = 0.03
    adafisher_head_lr: float | None = None
    adafisher_beta: float = 0.9
    adafisher_damping: float = 1e-3
    adafisher_gamma: float = 0.8
    adafisher_update_every: int | None = 10
    adafisher_ema: str = "reference"
    adafisher_weight_decay: float = 0.0
    bias_lr: float = 0.053
    head_lr: float = 0.67
    sgd_momentum: float = 0.85
    decay: float = 2e-6
    whiten_bias_epochs: float = 3.0
    renorm: bool = True

    @classmethod
    def parse(cls, spec: str) -> OptimSettings:
        """``preset[:key=value,...]``: a preset of :data:`PRESETS`, then overrides by field
        name; ``lr`` is the preset's own learning rate, ``on`` a ``+``-joined part list.

        Example:
            >>> OptimSettings.parse("adafisher:lr=0.01,on=block1+head").on
            ('block1', 'head')
        """
        name, _, rest = spec.partition(":")
        if name not in PRESETS:
            raise ValueError(f"--config {spec!r}: preset {name!r} is not one of {sorted(PRESETS)}")
        settings = cls(name=name, on=PRESETS[name])
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "name"}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            key = {"lr": f"{name}_lr"}.get(key, key)
            if key not in fields or not value:
                raise ValueError(
                    f"--config {spec!r}: {item!r} is not key=value with a key of "
                    f"{sorted(['lr', *fields])}"
                )
            setattr(settings, key, _convert(key, value, fields[key].type))
        settings.validate(spec)
        return settings

    def validate(self, spec: str) -> None:
        unknown = set(self.on) - set(ADAFISHER_PARTS)
        if unknown:
            raise ValueError(f"--config {spec!r}: on={sorted(unknown)} not among {ADAFISHER_PARTS}")
        if self.adafisher_ema not in ("reference", "paper"):
            raise ValueError(f"--config {spec!r}: adafisher_ema must be reference or paper")

    def label(self) -> str:
        """A short name for tables and plots: the preset and what differs from it."""
        base = OptimSettings(name=self.name, on=PRESETS[self.name])
        diffs = [
            f"{f.name}={_show(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(base, f.name)
        ]
        return self.name + (f" ({', '.join(diffs)})" if diffs else "")


def _convert(key: str, value: str, annotation: str) -> Any:
    if key == "on":
        return tuple(v for v in value.split("+") if v)
    if annotation == "bool":
        return value.lower() in ("1", "true", "yes")
    if annotation == "str":
        return value
    if "None" in annotation and value.lower() == "none":
        return None
    try:
        return int(value) if annotation.startswith("int") else float(value)
    except ValueError:
        raise ValueError(f"--config: {key}={value!r} is not a number") from None


def _show(value: Any) -> str:
    return "+".join(value) if isinstance(value, tuple) else str(value)


class SpeedrunOptimizer:
    """Every optimizer of one run, stepped together under one learning-rate factor.

    Args:
        net: a :class:`speedrun_net.SpeedrunNet`.
        settings: the configuration.
        batch: the batch size (scales ``settings.decay``).
        collector: a :class:`FisherCollector` on ``net`` covering exactly the AdaFisher
            modules, to reuse (its factors are reset to ``initial_factors``); built when
            ``None``.
        initial_factors: ``collector.state_dict()`` right after it was built.
    """

    def __init__(
        self,
        net: nn.Module,
        settings: OptimSettings,
        batch: int,
        collector: FisherCollector | None = None,
        initial_factors: dict | None = None,
    ) -> None:
        s = self.settings = settings
        modules = dict(net.named_modules())
        on = set(s.on)
        names = [f"{b}.conv{i}" for b in ("block1", "block2", "block3") if b in on for i in (1, 2)]
        names += ["head"] if "head" in on else []
        if "norms" in on:
            names += [n for n, m in modules.items() if isinstance(m, nn.BatchNorm2d)]
        self.adafisher_modules = names
        af_params = [p for n in names for p in modules[n].parameters() if p.requires_grad]
        af_ids = {id(p) for p in af_params}
        self.filters = net.filters()
        muon_filters = [f for f in self.filters if id(f) not in af_ids]
        decay = s.decay * batch
        sgd_groups = [{"params": [net.whiten.bias], "lr": s.bias_lr, "name": "whiten_bias"}]
        norm_biases = [
            m.bias
            for m in modules.values()
            if isinstance(m, nn.BatchNorm2d) and id(m.bias) not in af_ids
        ]
        if norm_biases:
            sgd_groups.append({"params": norm_biases, "lr": s.bias_lr, "name": "norm_biases"})
        if "head" not in on:
            sgd_groups.append({"params": [net.head.weight], "lr": s.head_lr, "name": "head"})
        for g in sgd_groups:
            g["weight_decay"] = decay / g["lr"]
        fused = {"fused": True} if net.head.weight.is_cuda else {}
        self.optimizers: list[Any] = [
            torch.optim.SGD(sgd_groups, momentum=s.sgd_momentum, nesterov=True, **fused)
        ]
        if muon_filters:
            self.optimizers.append(FilterMuon(muon_filters, s.muon_lr, s.muon_momentum))
        self.collector = None
        if af_params:
            if collector is None:
                leaves = (n for n, m in modules.items() if n and not list(m.children()))
                excluded = tuple(n for n in leaves if n not in names)
                # factors from ones: the published seed, which the speedrun's settings
                # were tuned with (BENCHMARKS.md)
                collector = FisherCollector(
                    net, ema=s.adafisher_ema, factor_init="ones", exclude=excluded
                )
                initial_factors = collector.state_dict()
            elif initial_factors is not None:
                collector.load_state_dict(initial_factors)
            self.collector, self.initial_factors = collector, initial_factors
            head = [p for p in af_params if p is net.head.weight]
            groups = [{"params": [p for p in af_params if p is not net.head.weight]}]
            if head:
                groups.append({"params": head, "lr": s.adafisher_head_lr or s.adafisher_lr})
            groups = [g for g in groups if g["params"]]
            self.optimizers.append(
                AdaFisherW(
                    groups,
                    collector,
                    lr=s.adafisher_lr,
                    beta=s.adafisher_beta,
                    damping=s.adafisher_damping,
                    gamma=s.adafisher_gamma,
                    update_every=s.adafisher_update_every,
                    weight_decay=s.adafisher_weight_decay,
                    ema=s.adafisher_ema,
                    factor_init="ones",
                )
            )
        self.base = [[g["lr"] for g in opt.param_groups] for opt in self.optimizers]
        self.filter_norms = [math.sqrt(f.shape[0]) for f in self.filters]

    @property
    def refreshing(self) -> bool:
        """Whether the next forward/backward feeds AdaFisher's statistics (the collector's
        hooks run Python: that step runs outside the compiled graph)."""
        return self.collector is not None and self.collector.collecting

    @torch.no_grad()
    def step(self, lr_factor: float, epoch: float) -> None:
        """Sets every group's learning rate to its base times ``lr_factor`` (the whitening
        bias's to 0 after ``whiten_bias_epochs``), rescales the filters, steps."""
        for opt, bases in zip(self.optimizers, self.base, strict=True):
            for group, base in zip(opt.param_groups, bases, strict=True):
                factor = lr_factor
                if group.get("name") == "whiten_bias":
                    factor = max(0.0, 1.0 - epoch / self.settings.whiten_bias_epochs)
                group["lr"] = base * factor
        if self.settings.renorm:
            norms = torch._foreach_norm(self.filters)
            torch._foreach_mul_(self.filters, torch._foreach_reciprocal(norms))
            torch._foreach_mul_(self.filters, self.filter_norms)
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            if isinstance(opt, FilterMuon):
                for t in opt.filters + opt.matrices:
                    t.grad = None
            else:
                opt.zero_grad(set_to_none=True)
