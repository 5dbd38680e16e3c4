"""Whether ``torch.compile`` computes eager's outputs and gradients, op by op and for a
small timm ResNet.

Two measurements, each compiled against eager from the same weights and inputs:

- ``pool``: a 1x1 convolution, an optional ReLU, timm's shortcut average pool
  (``AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)``) and a 1x1 convolution,
  on maps of 1x1, 2x2 and 4x4. On a 1x1 map the pool's window overhangs the map.
- ``model``: timm's ``test_resnet`` at several image sizes, one forward and backward
  (at 16x16 its last shortcut pools a 1x1 map).

Each row gives the output's relative error and, over the parameters, the largest
relative gradient error and that parameter's gradient norm against eager's. Results are
printed as a table and a JSON line.

Usage:
    python benchmarks/compiled_gradients.py [--device cuda] [--backend inductor]
    python benchmarks/compiled_gradients.py --smoke      # CPU, aot_eager, seconds
"""

import argparse
import copy
import json
import sys
from collections.abc import Sequence
from typing import Any

import timm
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn


def compare(model: nn.Module, x: torch.Tensor, backend: str, loss: bool) -> dict[str, Any]:
    """Compiled ``model`` against an eager copy on ``x``: the output's relative error
    and the worst parameter's relative gradient error and norm ratio. ``loss``:
    backpropagate cross-entropy against fixed labels, else a fixed random output
    gradient."""
    torch._dynamo.reset()
    eager_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    outputs = [compiled(x), eager_model(x)]
    if loss:
        labels = torch.arange(x.shape[0], device=x.device) % outputs[1].shape[1]
        for out in outputs:
            F.cross_entropy(out, labels).backward()
    else:
        grad = torch.randn(outputs[1].shape, generator=torch.Generator().manual_seed(1))
        for out in outputs:
            out.backward(grad.to(out.device))
    got, want = (o.detach() for o in outputs)
    worst = {"name": None, "error": -1.0, "norm_ratio": 1.0}
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters(), strict=True):
        scale = q.grad.norm().clamp_min(1e-30)
        error = float((p.grad - q.grad).norm() / scale)
        if error > worst["error"]:
            worst = {"name": name, "error": error, "norm_ratio": float(p.grad.norm() / scale)}
    return {
        "output_error": float((got - want).norm() / want.norm().clamp_min(1e-30)),
        "worst_parameter": worst["name"],
        "gradient_error": worst["error"],
        "gradient_norm_ratio": worst["norm_ratio"],
    }


def pool_case(relu: bool, size: int, device: torch.device, backend: str) -> dict[str, Any]:
    torch.manual_seed(0)
    layers = [nn.Conv2d(16, 16, 1)] + [nn.ReLU()] * relu
    pool = nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
    model = nn.Sequential(*layers, pool, nn.Conv2d(16, 8, 1)).to(device)
    x = torch.randn(8, 16, size, size, device=device)
    return {"case": f"conv, {'relu, ' * relu}avg pool, conv on {size}x{size}"} | compare(
        model, x, backend, loss=False
    )


def model_case(size: int, device: torch.device, backend: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=10).to(device)
    x = torch.randn(8, 3, size, size, device=device)
    return {"case": f"timm test_resnet on {size}x{size}"} | compare(model, x, backend, loss=True)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64], help="model")
    parser.add_argument("--smoke", action="store_true", help="CPU, aot_eager, 1x1 and 16x16")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else args.device)
    backend = "aot_eager" if args.smoke else args.backend
    torch.backends.cudnn.allow_tf32 = False  # float32 convolutions on both sides
    maps, sizes = ([1], [16]) if args.smoke else ([1, 2, 4], args.sizes)
    rows = [pool_case(relu, m, device, backend) for relu in (False, True) for m in maps]
    rows += [model_case(s, device, backend) for s in sizes]
    print(f"torch {torch.__version__}, {device}, backend {backend}")
    print("| case | output error | worst gradient error | its norm ratio | parameter |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['output_error']:.2g} | {r['gradient_error']:.2g} "
            f"| {r['gradient_norm_ratio']:.3f} | {r['worst_parameter']} |"
        )
    print(json.dumps({"torch": torch.__version__, "device": str(device), "rows": rows}))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
