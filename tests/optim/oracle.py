"""A plain float64 implementation of AdaFisher (docs/design.md, "AdaFisher"), written
independently of the package, for a Conv2d / BatchNorm2d / Linear model. Tests compare
the package to it, and two float32 trajectories to each other, within
:func:`rounding_bound`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _normalise(x: torch.Tensor, relative: bool) -> torch.Tensor:
    span = x.max() - x.min()
    tiny = torch.finfo(torch.float32).tiny
    return (x - x.min()) / (span * (1 + 1e-6) + tiny if relative else span + 1e-6)


def rounding_bound(dtype: torch.dtype, steps: int, damping: float) -> float:
    """How far a trajectory run in ``dtype`` may drift from exact arithmetic, relative
    to the parameters' norm: unit roundoff x steps x 1 / damping.

    Each step rounds its result at unit roundoff u (``eps / 2``), and the steps' errors
    add up. The condition factor is 1 / damping: the preconditioner F = g * a + damping
    is at least ``damping``, and its factors are normalised to [0, 1] (``ema="paper"``)
    or are smaller still (``ema="reference"``), so a rounding error of u in a factor
    entry is a relative error of up to u / damping in F, hence in the step, where F
    is smallest.
    """
    return torch.finfo(dtype).eps / 2 * steps / damping


class OracleAdaFisher:
    """Unfused AdaFisher(W) on a float64 copy of ``model`` (Conv2d, BatchNorm2d, Linear)."""

    def __init__(
        self,
        model,
        *,
        lr,
        beta=0.9,
        damping=1e-3,
        gamma=0.8,
        update_every=100,
        weight_decay=0.0,
        decoupled=False,
        ema="reference",
        normalise="absolute",
        factor_init="zeros",
    ):
        self.model = model
        self.lr, self.beta, self.damping, self.gamma = lr, beta, damping, gamma
        self.update_every, self.wd, self.decoupled, self.ema = (
            update_every,
            weight_decay,
            decoupled,
            ema,
        )
        self.relative = normalise == "relative"
        self.seed = torch.zeros_like if factor_init == "zeros" else torch.ones_like
        self.t = 0
        self.layers = [
            m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.Linear))
        ]
        self.A = {m: None for m in self.layers}
        self.G = {m: None for m in self.layers}
        self.mom = {p: torch.zeros_like(p) for p in model.parameters()}
        self._inputs, self._outputs = {}, {}
        for m in self.layers:
            m.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self._inputs[module] = args[0].detach()
        output.retain_grad()
        self._outputs[module] = output

    def _stats(self, m):
        x = self._inputs[m]
        go = self._outputs[m].grad
        b = x.shape[0]
        if isinstance(m, nn.Linear):
            a = (x * x).mean(0)
            if m.bias is not None:
                a = torch.cat([a, a.new_ones(1)])
            g = (go * go).mean(0)
        elif isinstance(m, nn.Conv2d):
            cols = F.unfold(
                x, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride
            )
            rows = cols.transpose(1, 2).reshape(-1, cols.shape[1])  # (B*L, D)
            d = rows.shape[1]
            if m.bias is not None:
                rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], 1)
            a = (rows * rows).sum(0) / (rows.shape[0] * d)
            g3 = go.reshape(b, go.shape[1], -1)
            g = (g3 * g3).sum((0, 2)) / (b * g3.shape[2])
        else:  # BatchNorm2d
            hw = x.shape[2] * x.shape[3]
            u = x.sum((0, 2, 3)) / hw**2
            a = torch.stack([(u * u).sum(), u.new_tensor(float(x.shape[1]))]) / b**2
            s = go.sum((0, 2, 3))
            g = s * s / b
        return a, g

    def _fisher(self, m, p, name):
        if self.A[m] is None:
            return torch.ones_like(p)
        a, g = self.A[m], self.G[m]
        if self.ema == "paper":
            a, g = _normalise(a, self.relative), _normalise(g, self.relative)
        if isinstance(m, nn.BatchNorm2d):
            return g * a[0 if name == "weight" else 1] + self.damping
        if name == "bias":
            return g * a[-1] + self.damping
        return (torch.outer(g, a[: p[0].numel()]) + self.damping).view_as(p)

    def step(self):
        refresh = self.t % self.update_every == 0
        if refresh:
            for m in self.layers:
                a, g = self._stats(m)
                if self.A[m] is None:
                    self.A[m], self.G[m] = self.seed(a), self.seed(g)
                if self.ema == "reference":
                    new_a, new_g = _normalise(a, self.relative), _normalise(g, self.relative)
                    self.A[m] = 0.1 * self.gamma * self.A[m] + 0.01 * self.gamma * new_a
                    self.G[m] = 0.1 * self.gamma * self.G[m] + 0.01 * self.gamma * new_g
                else:
                    self.A[m] = self.gamma * self.A[m] + (1 - self.gamma) * a
                    self.G[m] = self.gamma * self.G[m] + (1 - self.gamma) * g
        self.t += 1
        with torch.no_grad():
            for m in self.layers:
                for name, p in m.named_parameters(recurse=False):
                    grad = p.grad
                    bc = 1 - self.beta**self.t
                    fisher = self._fisher(m, p, name)
                    if self.decoupled:
                        self.mom[p] = self.beta * self.mom[p] + (1 - self.beta) * grad
                        p -= self.lr * (self.mom[p] / (bc * fisher) + self.wd * p)
                    else:
                        gg = grad + self.wd * p
                        self.mom[p] = self.beta * self.mom[p] + (1 - self.beta) * gg
                        p -= self.lr / bc * self.mom[p] / fisher
