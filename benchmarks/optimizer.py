"""Optimizer-step time of AdaFisher / AdaFisherW against torch.optim.AdamW(fused=True).

``opt.step()`` alone on the fp32 CIFAR ResNet-18 and ViT-B/16, gradients in place: device
time, eager and in a CUDA graph, against AdamW run the same way (eager or in a CUDA
graph) and the HBM floor; ``--host``: its host time, torch operators and Triton launches
(on a CPU the launches are counted, not run, and the models narrowed). README.md: method
and columns.

Usage:
    python -m benchmarks optimizer [--host] --out "$OUT"
    python -m benchmarks optimizer --smoke [--host] --out /tmp/bench   # CPU
"""

import functools
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import harness
from hf_triaccel import AdaFisher

NAME = "optimizer"
HELP = "opt.step() alone against AdamW(fused), eager and in a CUDA graph; --host: its host cost"

# bytes moved per parameter by a fused fp32 AdaFisher update: read theta, grad and
# momentum, write theta and momentum (the factors are per row / column, negligible)
BYTES_PER_PARAM = 20
# name -> (timm model, input of AdaFisher's priming forward at full size, smaller sizes)
MODELS = {
    "resnet18-cifar": ("resnet18_cifar", (128, 3, 32, 32), (4, 3, 16, 16)),
    "vit-b16": ("vit_base_patch16_224", (16, 3, 224, 224), (2, 3, 32, 32)),
}
OPTIONS = {
    "warmup_ms": (float, 5.0, 100.0, "warm-up budget per timing"),
    "rep_ms": (float, 20.0, 1000.0, "timed budget per timing"),
    "step_reps": (int, 20, 2000, "--host: timed steps per optimizer"),
}


def ready_optimizer(kind: str, impl: str, model: torch.nn.Module, shape, lr) -> Any:
    """The optimizer with the model's gradients in place; AdaFisher after one real
    forward/backward and step, so that its factors hold a real fold and no later step
    refreshes them (checked)."""
    opt = harness.make_optimizer(kind, model, impl=impl, update_every=harness.NEVER, lr=lr)
    if isinstance(opt, AdaFisher):
        device = next(model.parameters()).device
        model.zero_grad(set_to_none=True)
        logits = model(torch.randn(*shape, device=device))
        y = torch.randint(0, logits.shape[-1], (shape[0],), device=device)
        F.cross_entropy(logits, y).backward()
        opt.step()
        if opt.collector.collecting:
            raise RuntimeError("the collector still collects after the priming step")
    return opt


def capture_step(opt: torch.optim.Optimizer, device: torch.device) -> torch.cuda.CUDAGraph:
    """Captures one ``opt.step()`` in a CUDA graph, after warm-up steps on a side stream
    (which also compile any Triton kernel: compiling cannot be captured)."""
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


def run_model(name: str, variants: list, args: Any, mode: str) -> list:
    """Builds model ``name`` once and measures every ``(optimizer, impl)`` variant's step
    on it; ``mode``: ``"eager"``, ``"graph"`` or ``"host"``. Returns one row each."""
    (timm_name, full_shape, smoke_shape), device = MODELS[name], args.device
    classes = {"num_classes": 10} if mode == "host" else {}
    model = harness.build_model(timm_name, args.size, **classes).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.randn_like(p) for p in params]
    rows = []
    for kind, impl in variants:
        row = {"model": name, "optimizer": kind, "impl": impl, "cuda_graph": mode == "graph"}
        row.update(status="ok", median_ms=None, tensors=len(params), note=None)
        row["n_params"] = sum(p.numel() for p in params)
        opt = step = None
        with harness.variant(row):
            lr = torch.tensor(harness.LR, device=device) if mode == "graph" else harness.LR
            shape = full_shape if args.size == "full" else smoke_shape
            opt = ready_optimizer(kind, impl, model, shape, lr)
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            step = opt.step
            if mode == "graph":
                step = capture_step(opt, device).replay
                before = params[0].detach().clone()
                step()
                harness.synchronize(device)
                if torch.equal(before, params[0]):
                    raise RuntimeError("the captured step left the parameters unchanged")
            if mode == "host":
                row.update(host_costs(step, device, args.step_reps, args.counter))
            else:
                row.update(harness.benchmark(step, device, **args.timing))
        if isinstance(opt, AdaFisher):
            opt.collector.remove()
        opt = step = None  # the optimizer state and the graph's pool go before the next
        harness.free_memory(device)
        rows.append(row)
    return rows


def host_costs(step: Any, device: torch.device, reps: int, counter: Any) -> dict[str, Any]:
    """Host time (median, 20th percentile), operators and launches of a step."""
    for _ in range(5):
        step()
    harness.synchronize(device)
    before = counter.count
    ops = harness.count_aten_ops(step)
    launches = counter.count - before
    times = [harness.wall_ms(step, device, wait=False) for _ in range(reps)]
    harness.synchronize(device)
    us = 1e3 * np.percentile(times, [50, 20])
    return {"host_us": float(us[0]), "p20_us": float(us[1]), "aten_ops": ops, "launches": launches}


def add_arguments(parser: Any) -> None:
    """The measurement's options."""
    harness.add_common(parser, OPTIONS)
    parser.add_argument("--host", action="store_true", help="host work instead of device time")


def run(args: Any) -> int:
    """Runs the benchmark; returns 1 when a variant that is not a CUDA graph failed."""
    harness.resolve(args)
    args.timing = {"warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms}
    if args.host:
        return host(args)
    # device-to-device copy bandwidth: bytes read plus bytes written, 1e9 bytes/s
    nbytes = (1 << 22) if args.smoke else (1 << 31)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=args.device)
    copy = functools.partial(torch.empty_like(src).copy_, src)
    ms = harness.benchmark(copy, args.device, **args.timing)["median_ms"]
    bandwidth = {"bytes": nbytes, "median_ms": ms, "gbytes_per_s": 2 * nbytes / ms / 1e6}
    del src, copy  # the models need the memory
    eager = [("AdamW", "fused")]
    eager += [(kind, impl) for impl in args.impls for kind in ("AdaFisher", "AdaFisherW")]
    rows = [r for name in MODELS for r in run_model(name, eager, args, "eager")]
    # graphs last: a failed capture cannot disturb the eager measurements
    graphed = [("AdamW", "fused")] + [("AdaFisher", impl) for impl in args.impls]
    for name in MODELS:
        if args.device.type == "cuda":
            rows += run_model(name, graphed, args, "graph")
            continue
        for kind, impl in graphed:
            row = {"model": name, "optimizer": kind, "impl": impl, "cuda_graph": True}
            rows.append({**row, "status": "skipped", "median_ms": None, "note": "needs CUDA"})
    models = {}
    for name in MODELS:  # each row against AdamW of its model run the same way
        mine = [r for r in rows if r["model"] == name]
        for graph in (False, True):
            same = [r for r in mine if r["cuda_graph"] == graph]
            adamw = lambda r: r["optimizer"] == "AdamW"
            harness.add_ratio(same, "median_ms", "vs_adamw", adamw)
        floor_ms = BYTES_PER_PARAM * mine[0]["n_params"] / bandwidth["gbytes_per_s"] / 1e6
        models[name] = {"n_params": mine[0]["n_params"], "hbm_floor_ms": floor_ms}
        for r in mine:
            r["vs_hbm_floor"] = r["median_ms"] / floor_ms if r["median_ms"] else None
    print(f"copy bandwidth (read + write): {bandwidth['gbytes_per_s']:.0f} GB/s")
    for name, m in models.items():
        print(f"{name}: {m['n_params'] / 1e6:.2f}M params, HBM floor {m['hbm_floor_ms']:.4f} ms")
    fmt = harness.fmt
    columns = {
        "model": lambda r: r["model"],
        "optimizer": lambda r: r["optimizer"],
        "impl": lambda r: r["impl"],
        "CUDA graph": lambda r: "yes" if r["cuda_graph"] else "no",
        "step ms (median)": lambda r: fmt(r["median_ms"]),
        "p20-p80 ms": lambda r: f"{fmt(r.get('p20_ms'))}-{fmt(r.get('p80_ms'))}",
        "x AdamW(fused)": lambda r: fmt(r["vs_adamw"], ".2f", "x"),
        f"x HBM floor ({BYTES_PER_PARAM} B/param)": lambda r: fmt(r["vs_hbm_floor"], ".2f", "x"),
        "note": harness.note,
    }
    config = {"lr": harness.LR, "weight_decay": harness.WEIGHT_DECAY, "param_dtype": "float32"}
    payload = {"config": config, "copy_bandwidth": bandwidth, "models": models, "results": rows}
    harness.finish("optimizer", args, payload, harness.table(rows, columns))
    return 1 if any(r["status"] == "error" and not r["cuda_graph"] for r in rows) else 0


def host(args: Any) -> int:
    """``--host``: AdamW(fused) and AdaFisherW(triton) per model, narrowed on a CPU."""
    cuda = args.device.type == "cuda"
    args.size = "full" if cuda else "narrow"  # the module structure: the same host work
    args.counter = harness.LaunchCounter(stub=not cuda)
    variants = [("AdamW", "fused"), ("AdaFisherW", "triton")]
    try:
        rows = [r for name in MODELS for r in run_model(name, variants, args, "host")]
    finally:
        args.counter.restore()
    for name in MODELS:
        mine = [r for r in rows if r["model"] == name]
        harness.add_ratio(mine, "host_us", "vs_adamw", lambda r: r["optimizer"] == "AdamW")
    fmt = harness.fmt
    columns = {
        "model": lambda r: r["model"],
        "optimizer": lambda r: f"{r['optimizer']}({r['impl']})",
        "tensors": lambda r: r["tensors"],
        "opt.step() host us": lambda r: fmt(r.get("host_us"), ".1f"),
        "p20 us": lambda r: fmt(r.get("p20_us"), ".1f"),
        "aten ops": lambda r: r.get("aten_ops"),
        "launches": lambda r: r.get("launches"),
        # AdamW's update runs on a CPU within its host time: a ratio only on CUDA
        "x AdamW": lambda r: fmt(r["vs_adamw"] if cuda else None, ".2f", "x"),
        "note": harness.note,
    }
    del args.counter
    payload = {"config": {"stub_kernels": not cuda}, "results": rows}
    harness.finish("optimizer_host", args, payload, harness.table(rows, columns))
    return 1 if any(r["status"] == "error" for r in rows) else 0
