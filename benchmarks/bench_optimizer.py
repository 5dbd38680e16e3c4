"""Optimizer-step time of AdaFisher / AdaFisherW against torch.optim.AdamW(fused=True).

Only ``opt.step()`` is timed. Gradients are filled with random values once and shared
by every optimizer; the step is then repeated many times. AdaFisher first runs one
real forward/backward and one step, so that its factors hold a real fold, with
``update_every`` so large that no timed step refreshes them: the timed step is the
steady-state update that runs on all but one step in ``update_every``.

Models: the CIFAR-stem ResNet-18 (11.2M parameters) and ViT-B/16 (86.6M), fp32.
Each time is reported next to AdamW(fused) measured in the same run, and against
the HBM floor of the update: 20 bytes per parameter (read parameter, gradient and
momentum, write parameter and momentum) at the device-to-device copy bandwidth
measured in the same run. A last set of rows captures the step in a CUDA graph
(learning rate as a tensor) to show that it is capturable and what it costs
without launch overhead; a capture that fails is reported, not raised.

Usage:
    python benchmarks/bench_optimizer.py --out "$OUT"
    python benchmarks/bench_optimizer.py --smoke --out /tmp/bench   # CPU, tiny models
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    LR,
    WEIGHT_DECAY,
    base_parser,
    benchmark,
    cifar_resnet18,
    copy_bandwidth,
    count_params,
    environment,
    fmt,
    free_memory,
    markdown_table,
    out_dir,
    report_error,
    resolve_device,
    resolve_impls,
    synchronize,
    vit_b16,
    write_results,
)
from torch import nn

from hf_triaccel import AdaFisher, AdaFisherW

# bytes moved per parameter by a fused fp32 AdaFisher update: read theta, grad and
# momentum, write theta and momentum (the factors are per row / column, negligible)
BYTES_PER_PARAM = 20
# an update_every no benchmark reaches: only the priming step refreshes the factors
NEVER = 10**9
ADAFISHER = {"AdaFisher": AdaFisher, "AdaFisherW": AdaFisherW}


@dataclass(frozen=True)
class ModelSpec:
    """A model to benchmark and the input of its priming forward pass."""

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]


def model_specs(smoke: bool) -> list[ModelSpec]:
    """The benchmarked models, tiny under ``--smoke``."""
    return [
        ModelSpec(
            "resnet18-cifar",
            partial(cifar_resnet18, tiny=smoke),
            (4, 3, 16, 16) if smoke else (128, 3, 32, 32),
        ),
        ModelSpec(
            "vit-b16", partial(vit_b16, tiny=smoke), (2, 3, 32, 32) if smoke else (16, 3, 224, 224)
        ),
    ]


def prime(model: nn.Module, input_shape: Sequence[int], device: torch.device) -> None:
    """One forward/backward on random data, so that the collector has statistics."""
    x = torch.randn(*input_shape, device=device)
    logits = model(x)
    y = torch.randint(0, logits.shape[-1], (input_shape[0],), device=device)
    F.cross_entropy(logits, y).backward()


def make_optimizer(
    kind: str,
    impl: str,
    model: nn.Module,
    spec: ModelSpec,
    device: torch.device,
    *,
    lr: float | torch.Tensor,
) -> torch.optim.Optimizer:
    """Builds an optimizer and, for AdaFisher, runs the priming step.

    Args:
        kind: ``"AdamW"``, ``"AdaFisher"`` or ``"AdaFisherW"``.
        impl: the AdaFisher implementation (ignored for AdamW, which is always fused).
        model: the model whose parameters are optimised.
        spec: its benchmark spec (priming input).
        device: where it lives.
        lr: learning rate; a tensor makes the step capturable in a CUDA graph.

    Returns:
        The optimizer, ready for steps that do not refresh any Fisher factor.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "AdamW":
        return torch.optim.AdamW(
            params,
            lr=lr,
            weight_decay=WEIGHT_DECAY,
            fused=True,
            capturable=isinstance(lr, torch.Tensor),
        )
    opt = ADAFISHER[kind].from_model(
        model, impl=impl, update_every=NEVER, lr=lr, weight_decay=WEIGHT_DECAY
    )
    model.zero_grad(set_to_none=True)
    prime(model, spec.input_shape, device)
    opt.step()
    if opt.collector.collecting:
        raise RuntimeError("the collector still collects after the priming step")
    return opt


def install_grads(model: nn.Module, grads: list[torch.Tensor]) -> None:
    """Points every parameter's ``.grad`` at the shared random gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p, g in zip(params, grads, strict=True):
        p.grad = g


def capture_step(opt: torch.optim.Optimizer, device: torch.device) -> torch.cuda.CUDAGraph:
    """Captures one ``opt.step()`` in a CUDA graph.

    Warm-up runs on a side stream first, as torch requires, which also compiles any
    Triton kernel before capture (compiling cannot be captured).
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph


def measure(
    spec: ModelSpec,
    model: nn.Module,
    grads: list[torch.Tensor],
    kind: str,
    impl: str,
    device: torch.device,
    timing: dict[str, float],
    *,
    cuda_graph: bool,
) -> dict[str, Any]:
    """Times one optimizer's step on one model; failures become the row's note.

    Returns:
        A result row: model, optimizer, impl, cuda_graph, status (``ok`` / ``error``),
        timing fields and a note.
    """
    row: dict[str, Any] = {
        "model": spec.name,
        "optimizer": kind,
        "impl": "fused" if kind == "AdamW" else impl,
        "cuda_graph": cuda_graph,
        "status": "ok",
        "median_ms": None,
        "note": None,
    }
    opt = graph = None
    try:
        lr = torch.tensor(LR, device=device) if cuda_graph else LR
        opt = make_optimizer(kind, impl, model, spec, device, lr=lr)
        install_grads(model, grads)
        if cuda_graph:
            graph = capture_step(opt, device)
            probe = next(p for p in model.parameters() if p.requires_grad)
            before = probe.detach().clone()
            graph.replay()
            synchronize(device)
            if torch.equal(before, probe):
                raise RuntimeError("the captured step left the parameters unchanged")
            row.update(benchmark(graph.replay, device, **timing))
        else:
            row.update(benchmark(opt.step, device, **timing))
    except Exception as exc:  # a failing variant must not hide the others' results
        row["status"] = "error"
        row["note"] = report_error(exc)
    finally:
        if isinstance(opt, AdaFisher):
            opt.collector.remove()
        # drop the optimizer state and the graph's memory pool before the next variant
        opt = graph = None
        free_memory(device)
    return row


def run_model(
    spec: ModelSpec,
    variants: list[tuple[str, str]],
    device: torch.device,
    timing: dict[str, float],
    *,
    cuda_graph: bool,
) -> tuple[int, list[dict[str, Any]]]:
    """Builds ``spec``'s model once and measures every variant on it.

    Returns:
        The model's parameter count and one row per variant.
    """
    torch.manual_seed(0)
    model = spec.build().to(device).train()
    grads = [torch.randn_like(p) for p in model.parameters() if p.requires_grad]
    rows = [
        measure(spec, model, grads, kind, impl, device, timing, cuda_graph=cuda_graph)
        for kind, impl in variants
    ]
    n_params = count_params(model)
    del model, grads
    free_memory(device)
    return n_params, rows


def add_ratios(rows: list[dict[str, Any]], floors: dict[str, float]) -> None:
    """Adds ``vs_adamw`` (against eager AdamW(fused), same model, same run) and
    ``vs_hbm_floor`` to every measured row."""
    base = {
        r["model"]: r["median_ms"]
        for r in rows
        if r["optimizer"] == "AdamW" and not r["cuda_graph"] and r["median_ms"]
    }
    for r in rows:
        ms = r["median_ms"]
        r["vs_adamw"] = ms / base[r["model"]] if ms and r["model"] in base else None
        r["vs_hbm_floor"] = ms / floors[r["model"]] if ms else None


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table."""
    headers = [
        "model",
        "optimizer",
        "impl",
        "CUDA graph",
        "step ms (median)",
        "p20-p80 ms",
        "x AdamW(fused)",
        f"x HBM floor ({BYTES_PER_PARAM} B/param)",
        "note",
    ]
    body = [
        [
            r["model"],
            r["optimizer"],
            r["impl"],
            "yes" if r["cuda_graph"] else "no",
            fmt(r["median_ms"]),
            f"{fmt(r.get('p20_ms'))}-{fmt(r.get('p80_ms'))}" if r["median_ms"] else "n/a",
            fmt(r["vs_adamw"], ".2f", "x"),
            fmt(r["vs_hbm_floor"], ".2f", "x"),
            (r["note"] or "")[:200],
        ]
        for r in rows
    ]
    return markdown_table(headers, body)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints a markdown table and writes bench_optimizer.json.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        0, or 1 when an eager (non-graph) variant failed.
    """
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--warmup-ms", type=float, default=None, help="warm-up budget per timing")
    parser.add_argument("--rep-ms", type=float, default=None, help="timed budget per timing")
    args = parser.parse_args(argv)
    argv = list(argv) if argv is not None else sys.argv[1:]
    device = resolve_device(args.device)
    impls = resolve_impls(args.impls, device)
    timing = (
        {"warmup_ms": 5.0, "rep_ms": 20.0} if args.smoke else {"warmup_ms": 100.0, "rep_ms": 1000.0}
    )
    if args.warmup_ms is not None:
        timing["warmup_ms"] = args.warmup_ms
    if args.rep_ms is not None:
        timing["rep_ms"] = args.rep_ms
    specs = model_specs(args.smoke)

    bandwidth = copy_bandwidth(device, (1 << 22) if args.smoke else (1 << 31), **timing)
    eager = [("AdamW", "fused")] + [(k, impl) for impl in impls for k in ADAFISHER]
    rows: list[dict[str, Any]] = []
    models: dict[str, dict[str, Any]] = {}
    for spec in specs:
        n_params, model_rows = run_model(spec, eager, device, timing, cuda_graph=False)
        floor_ms = BYTES_PER_PARAM * n_params / (bandwidth["gbytes_per_s"] * 1e9) * 1e3
        models[spec.name] = {"n_params": n_params, "hbm_floor_ms": floor_ms}
        rows += model_rows
    # graphs last: a failed capture cannot disturb the eager measurements
    graphed = [("AdamW", "fused")] + [("AdaFisher", impl) for impl in impls]
    for spec in specs:
        if device.type == "cuda":
            rows += run_model(spec, graphed, device, timing, cuda_graph=True)[1]
        else:
            rows += [
                {
                    "model": spec.name,
                    "optimizer": kind,
                    "impl": "fused" if kind == "AdamW" else impl,
                    "cuda_graph": True,
                    "status": "skipped",
                    "median_ms": None,
                    "note": "CUDA graphs need a CUDA device",
                }
                for kind, impl in graphed
            ]
    add_ratios(rows, {name: m["hbm_floor_ms"] for name, m in models.items()})

    env = environment(__file__, argv, device)
    text = table(rows)
    print(f"device: {env['device']}; torch {env['torch']}, triton {env['triton']}")
    print(
        f"copy bandwidth (read + write): {bandwidth['gbytes_per_s']:.0f} GB/s "
        f"over {bandwidth['bytes'] / 2**20:.0f} MiB"
    )
    for name, m in models.items():
        print(
            f"{name}: {m['n_params'] / 1e6:.2f}M params, HBM floor "
            f"{m['hbm_floor_ms']:.4f} ms at {BYTES_PER_PARAM} B/param"
        )
    print(text)
    payload = {
        "env": env,
        "config": {
            "smoke": args.smoke,
            "impls": impls,
            "timing": timing,
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
            "param_dtype": "float32",
            "bytes_per_param": BYTES_PER_PARAM,
        },
        "copy_bandwidth": bandwidth,
        "models": models,
        "results": rows,
    }
    path = write_results(out_dir(args.out), "bench_optimizer", payload, text)
    print(f"wrote {path}")
    failed = [r for r in rows if r["status"] == "error" and not r["cuda_graph"]]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
