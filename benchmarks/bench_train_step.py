"""Training step of the CIFAR ResNet-18: AdaFisherW against torch.optim.AdamW(fused=True).

zero_grad + forward under bf16 autocast + backward + ``opt.step()`` on one random batch,
AdaFisherW refreshing its factors on every step and on none: step time and peak memory;
``--host``: the step's host work (on a CPU the launches are counted, not run, and the
model narrowed). README.md: method and columns.

Usage:
    python benchmarks/bench_train_step.py [--host] [--channels-last] --out "$OUT"
    python benchmarks/bench_train_step.py --smoke [--host] --out /tmp/bench   # CPU
"""

import copy
from collections.abc import Sequence
from typing import Any

import harness
import numpy as np
import torch
import torch.nn.functional as F

from hf_triaccel import AdaFisherW

OPTIONS = {
    "batch_size": (int, 8, 512, "batch (--host on a CPU: 4)"),
    "image_size": (int, 16, 32, "image side"),
    "warmup": (int, 2, 20, "untimed steps (--host: 3)"),
    "steps": (int, 4, 100, "timed steps (--host: 40, smoke 3)"),
}


def host_defaults(args: Any) -> dict[str, int]:
    """The defaults of ``--host``: each step timed alone, a small batch on a CPU."""
    if not args.host:
        return {}
    cpu = {"batch_size": 4} if args.device.type != "cuda" else {}
    return {"warmup": 3, "steps": 3 if args.smoke else 40, **cpu}


def prepare(row: dict, model: torch.nn.Module, args: Any) -> tuple[Any, Any]:
    """The optimizer of ``row`` and its training step, after the warm-up steps (cuDNN
    autotuning, Triton compilation, lazily created state, the first Fisher fold)."""
    every = 1 if row["refresh"] else harness.NEVER
    opt = harness.make_optimizer(row["optimizer"], model, impl=row["impl"], update_every=every)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=args.device)
    x = x.contiguous(memory_format=args.memory_format)
    y = torch.randint(0, 10, (args.batch_size,), device=args.device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    harness.synchronize(args.device)
    if row["refresh"] is not None and opt.collector.collecting != row["refresh"]:
        raise RuntimeError(f"collector.collecting is {opt.collector.collecting}, not refresh")
    return opt, step


def measure(row: dict, args: Any) -> None:
    """Step time and peak memory of one variant, on a fresh, identically seeded model."""
    device, cuda, opt = args.device, args.device.type == "cuda", None
    with harness.variant(row):
        model = harness.build_model(size=args.size).to(device, memory_format=args.memory_format)
        opt, step = prepare(row, model, args)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = harness.time_steps(step, device, warmup=0, steps=args.steps)
        row.update(harness.summarize(times, "cuda events" if cuda else "time.perf_counter"))
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device) if cuda else None
    if isinstance(opt, AdaFisherW):
        opt.collector.remove()
    model = opt = step = None  # this variant's activations and state go before the next
    harness.free_memory(device)


def measure_host(rows: list[dict], args: Any) -> None:
    """Operators, launches and host time per step of every variant; the variants take
    turns, so that a drift of the host's speed hits them alike."""
    base = harness.build_model(size=args.size).to(args.device)
    counter = harness.LaunchCounter(stub=args.device.type != "cuda")
    try:
        steps = []
        for row in rows:
            steps.append(prepare(row, copy.deepcopy(base), args)[1])
            before = counter.count
            row["aten_ops"] = harness.count_aten_ops(steps[-1])
            harness.synchronize(args.device)
            row.update(launches=counter.count - before, times=[])
        for _ in range(args.steps):
            for row, step in zip(rows, steps, strict=True):
                row["times"].append(harness.wall_ms(step, args.device, wait=False))
    finally:
        counter.restore()
    for row in rows:
        row["host_ms"] = float(np.median(row.pop("times")))


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; returns 1 when a variant failed."""
    parser = harness.base_parser(__doc__.split("\n\n")[0], OPTIONS)
    parser.add_argument("--channels-last", action="store_true", help="model and input")
    parser.add_argument("--host", action="store_true", help="host work instead of device time")
    args = harness.parse(parser, argv, host_defaults)
    cuda = args.device.type == "cuda"
    args.memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.backends.cudnn.benchmark = cuda  # same autotuned convolutions for every variant
    rows = [{"optimizer": "AdamW", "impl": "fused", "refresh": None}]
    for impl in ["triton"] if args.host else args.impls:
        rows += [{"optimizer": "AdaFisherW", "impl": impl, "refresh": r} for r in (True, False)]
    rows = [{**row, "status": "ok", "note": None} for row in rows]
    if args.host:
        args.size = "full" if cuda else "narrow"  # the module structure: the same host work
        measure_host(rows, args)
    else:
        for row in rows:
            measure(row, args)
    adamw = lambda r: r["optimizer"] == "AdamW"
    harness.add_ratio(rows, "host_ms" if args.host else "median_ms", "vs_adamw", adamw)
    harness.add_ratio(rows, "peak_bytes", "peak_vs_adamw", adamw)
    refreshes = {None: "-", True: "every step", False: "no"}
    fmt = harness.fmt
    columns = {
        "optimizer": lambda r: r["optimizer"],
        "impl": lambda r: r["impl"],
        "Fisher refresh": lambda r: refreshes[r["refresh"]],
    }
    if args.host:
        columns["aten ops"] = lambda r: r["aten_ops"]
        columns["Triton launches"] = lambda r: r["launches"]
        columns["host ms"] = lambda r: fmt(r["host_ms"])
        # AdamW's update runs on a CPU within its host time: a ratio only on CUDA
        columns["x AdamW"] = lambda r: fmt(r["vs_adamw"] if cuda else None, ".2f", "x")
    else:
        columns["step ms (median)"] = lambda r: fmt(r["median_ms"])
        columns["p20-p80 ms"] = lambda r: f"{fmt(r.get('p20_ms'))}-{fmt(r.get('p80_ms'))}"
        columns["x AdamW(fused)"] = lambda r: fmt(r["vs_adamw"], ".2f", "x")
        columns["peak GiB"] = lambda r: harness.gib(r["peak_bytes"])
        columns["peak x AdamW(fused)"] = lambda r: fmt(r["peak_vs_adamw"], ".2f", "x")
    columns["note"] = harness.note
    print(
        f"resnet18_cifar ({args.size}), batch {args.batch_size}, {args.image_size}x"
        f"{args.image_size}, bf16 autocast, channels_last={args.channels_last}; "
        f"{args.steps} timed steps after {args.warmup} warm-up steps"
    )
    args.memory_format = str(args.memory_format)
    config = {"autocast": "bfloat16", "lr": harness.LR, "weight_decay": harness.WEIGHT_DECAY}
    payload = {"config": {**config, "cudnn_benchmark": cuda}, "results": rows}
    name = "bench_train_step_host" if args.host else "bench_train_step"
    harness.finish(name, __file__, args, payload, harness.table(rows, columns))
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
