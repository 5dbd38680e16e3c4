"""How large the Fisher statistics are against the min-max normalisation's 1e-6.

Trains timm ``resnet18_cifar`` for a few AdaFisher steps under ``ema="paper"`` (whose
running factors are the raw statistics' EMA) on one batch of the embedded CIFAR-10 slice,
then prints, over the Fisher layers, the median, smallest and largest range (max - min) of
the raw activation and gradient EMAs and the largest entry of their normalised versions
(the factors the update reads). Under the published normalisation (``--normalise
absolute``) a normalised factor can reach 1 only when its range is well above the 1e-6 in
its denominator; ``relative`` is scale-free. Runs on the CPU in a minute or
two at the default batch.

Usage:
    python benchmarks/fisher_ranges.py [--batch_size 512] [--steps 2] [--normalise relative]
    python benchmarks/fisher_ranges.py --smoke
"""

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import harness
import torch
import torch.nn.functional as F

from hf_triaccel import AdaFisher
from hf_triaccel._types import NORMALISE_MODES


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(batch_size: int, steps: int, smoke: bool, normalise: str) -> dict[str, Any]:
    """The ranges after ``steps`` AdaFisher steps on one batch (see the module doc), with
    the statistics normalised by ``normalise``."""
    torch.manual_seed(0)
    data = harness.load_images("embedded", "train", smoke=smoke, n=batch_size, progress=False)
    mean, std = (torch.tensor(s).view(1, 3, 1, 1) for s in data.channel_stats())
    x = (data.images[:batch_size].float() / 255 - mean) / std
    y = data.labels[:batch_size]
    size = "narrow" if smoke else "full"
    model = harness.build_model("resnet18_cifar", size, num_classes=data.num_classes)
    optimizer = AdaFisher.from_model(model, lr=1e-2, ema="paper", normalise=normalise)
    for _ in range(steps):
        F.cross_entropy(model(x), y, label_smoothing=0.1).backward()
        optimizer.step()
        optimizer.zero_grad()
    layers = optimizer.collector.layers.values()
    return {
        "normalise": normalise,
        "batch_size": batch_size,
        "steps": steps,
        "layers": len(layers),
        "a_range": spread([float(ly.a_ema.max() - ly.a_ema.min()) for ly in layers]),
        "g_range": spread([float(ly.g_ema.max() - ly.g_ema.min()) for ly in layers]),
        "a_used_max": spread([float(ly.a.max()) for ly in layers]),
        "g_used_max": spread([float(ly.g.max()) for ly in layers]),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--normalise", choices=NORMALISE_MODES, default="absolute")
    parser.add_argument("--smoke", action="store_true", help="narrow model, random images")
    args = parser.parse_args(argv)
    batch_size = 16 if args.smoke else args.batch_size
    result = measure(batch_size, args.steps, args.smoke, args.normalise)
    for name in ("a_range", "g_range", "a_used_max", "g_used_max"):
        s = result[name]
        print(f"{name}: median {s['median']:.2e}, min {s['min']:.2e}, max {s['max']:.2e}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
