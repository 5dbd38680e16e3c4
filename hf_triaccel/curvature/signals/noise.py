"""The gradient noise ratio ``v = mean(E[g^2] - E[g]^2) / mean(E[g^2])``, from a few
sampled elements of each parameter.

The expectations are exponential moving averages over optimizer steps. Elementwise EMAs
would cost two buffers the size of every parameter; instead each parameter gets a fixed
random subset of elements (all of them when it is smaller), chosen once with a seeded
generator, and EMAs of ``g`` and ``g^2`` are kept for those elements only (O(1) memory
per tensor): a :class:`NoiseProbe`. At read time the EMAs are bias-corrected and the
variance is made unbiased for the EMA's effective sample size (reliability weights:
divided by ``1 - sum(w^2) / sum(w)^2``); per parameter the subset means estimate the
means over all its elements, and a module's ratio weights its parameters by their sizes;
the ratio is clipped to [0, 1], where the true value lies. Drift of the mean gradient
within the EMA window counts as noise.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class NoiseProbe:
    """EMAs of ``g`` and ``g^2`` at a fixed subset (``index``) of one parameter's elements.

    Example:
        >>> param = nn.Parameter(torch.zeros(3))
        >>> probe = noise_probes({"w": param}, 8, torch.Generator())["w"]
        >>> for grad in ([1.0, 1.0, 1.0], [3.0, 3.0, 3.0]):
        ...     param.grad = torch.tensor(grad)
        ...     update_probes([probe], beta=0.5)
        >>> [round(m.item(), 4) for m in probe.moments(beta=0.5)]  # unbiased variance, E[g^2]
        [2.0, 6.3333]
    """

    def __init__(
        self, param: nn.Parameter, index: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor
    ) -> None:
        self.param = param
        self.index = index
        self.m1 = m1
        self.m2 = m2
        self.count = 0

    def sample(self) -> torch.Tensor | None:
        """The sampled elements of the parameter's gradient (``None`` without a dense one)."""
        grad = self.param.grad
        if grad is None or grad.is_sparse:
            return None
        if self.index.device != grad.device:  # the model moved
            self.index, self.m1, self.m2 = (
                t.to(grad.device) for t in (self.index, self.m1, self.m2)
            )
        # one operation per parameter (a reshape would be a second): the sampling runs
        # for every parameter every few steps of a host-bound loop
        return grad.take(self.index).float()

    def moments(self, beta: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mean unbiased variance, mean E[g^2]) over the subset, or ``None`` (< 2 samples)."""
        if self.count < 2:
            return None
        n = self.count
        w_sum = 1.0 - beta**n
        w_sq = (1.0 - beta) ** 2 * (1.0 - beta ** (2 * n)) / (1.0 - beta**2)
        e1, e2 = self.m1 / w_sum, self.m2 / w_sum
        var = (e2 - e1 * e1).clamp_min(0.0) / (1.0 - w_sq / w_sum**2)
        return var.mean(), e2.mean()


def noise_probes(
    params: dict[str, nn.Parameter], samples: int, generator: torch.Generator
) -> dict[str, NoiseProbe]:
    """A probe of ``samples`` elements per parameter, by the same keys.

    The probes' indices and EMAs are views of three buffers per device: three tensors
    per parameter would each take an allocator block of at least 512 bytes, 50 times
    what a probe holds.
    """
    indices = {}
    for key, param in params.items():
        n = param.numel()
        # randint, not randperm: a permutation of a large embedding would be big
        indices[key] = (
            torch.arange(n) if n <= samples else torch.randint(n, (samples,), generator=generator)
        )
    probes = {}
    for device in {p.device for p in params.values()}:
        keys = [k for k, p in params.items() if p.device == device]
        sizes = [indices[k].numel() for k in keys]
        index = torch.cat([indices[k] for k in keys]).to(device)
        m1 = torch.zeros(index.numel(), device=device)
        m2 = torch.zeros_like(m1)
        parts = zip(keys, index.split(sizes), m1.split(sizes), m2.split(sizes), strict=True)
        for key, i, a, b in parts:
            probes[key] = NoiseProbe(params[key], i, a, b)
    return {key: probes[key] for key in params}


@torch.no_grad()
def update_probes(probes: Iterable[NoiseProbe], beta: float) -> None:
    """Folds the current gradients into the probes' EMAs (one batched operation per
    moment); probes of parameters without a gradient are left as they are."""
    taken, samples = [], []
    for probe in probes:
        s = probe.sample()
        if s is not None:
            taken.append(probe)
            samples.append(s)
    if not taken:
        return
    m1s, m2s = [p.m1 for p in taken], [p.m2 for p in taken]
    torch._foreach_mul_(m1s, beta)
    torch._foreach_add_(m1s, samples, alpha=1.0 - beta)
    torch._foreach_mul_(m2s, beta)
    torch._foreach_add_(m2s, torch._foreach_mul(samples, samples), alpha=1.0 - beta)
    for p in taken:
        p.count += 1


def noise_ratio(probes: Iterable[NoiseProbe], beta: float, device: torch.device) -> torch.Tensor:
    """One module's gradient noise ratio from the probes of its parameters, weighted by
    their sizes: a 0-d tensor, ``nan`` until two samples were taken.

    Example:
        >>> noise_ratio([], 0.9, torch.device("cpu"))
        tensor(nan)
    """
    var_sum = e2_sum = None
    for probe in probes:
        moments = probe.moments(beta)
        if moments is None:
            continue
        n = probe.param.numel()
        var_sum = moments[0] * n if var_sum is None else var_sum + moments[0] * n
        e2_sum = moments[1] * n if e2_sum is None else e2_sum + moments[1] * n
    if var_sum is None:
        return torch.tensor(float("nan"), device=device)
    # identically zero gradients carry no noise; the true ratio lies in [0, 1], the
    # estimate (unbiased numerator over unbiased denominator) may stray above 1
    ratio = (var_sum / e2_sum.clamp_min(1e-30)).clamp_max(1.0)
    return torch.where(e2_sum > 0, ratio, torch.zeros_like(e2_sum))
