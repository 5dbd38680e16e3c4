"""Full training-step time and peak memory: AdaFisherW against torch.optim.AdamW(fused=True).

One step is zero_grad + forward + backward + ``opt.step()`` of the CIFAR-stem
ResNet-18 at batch 512 under bf16 autocast, on one random batch (random images and
labels on the device). AdaFisherW is measured twice per implementation:

- refresh: ``update_every=1``, so every step takes the Fisher statistics in the
  forward/backward hooks and folds them (the collector is collecting);
- no refresh: ``update_every`` so large that only the first (warm-up) step refreshes;
  this is the step that runs on all but one step in ``update_every``.

Each step sits between two CUDA events, the host synchronises once after the last
step, and the median over many steps after warm-up is reported with the peak memory
allocated during the timed steps, both as ratios against AdamW(fused) measured in the
same run.

Usage:
    python benchmarks/bench_train_step.py --out "$OUT"
    python benchmarks/bench_train_step.py --channels-last --out "$OUT"
    python benchmarks/bench_train_step.py --smoke --out /tmp/bench   # CPU, tiny model
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    LR,
    WEIGHT_DECAY,
    base_parser,
    cifar_resnet18,
    count_params,
    environment,
    fmt,
    free_memory,
    markdown_table,
    out_dir,
    report_error,
    resolve_device,
    resolve_impls,
    summarize,
    synchronize,
    time_steps,
    write_results,
)
from torch import nn

from hf_triaccel import AdaFisherW

# an update_every no benchmark reaches: only the first warm-up step refreshes the factors
NEVER = 10**9


def make_optimizer(
    model: nn.Module, optimizer: str, impl: str | None, refresh: bool | None
) -> torch.optim.Optimizer:
    """AdamW(fused=True), or AdaFisherW refreshing its factors every step or never."""
    if optimizer == "AdamW":
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    return AdaFisherW.from_model(
        model, impl=impl, update_every=1 if refresh else NEVER, lr=LR, weight_decay=WEIGHT_DECAY
    )


def measure(
    optimizer: str,
    impl: str | None,
    refresh: bool | None,
    device: torch.device,
    args: Any,
) -> dict[str, Any]:
    """Times the training step with one optimizer; a failure becomes the row's note.

    Returns:
        A result row: optimizer, impl, refresh, status, timing fields, peak memory.
    """
    row: dict[str, Any] = {
        "optimizer": optimizer,
        "impl": impl or "fused",
        "refresh": refresh,
        "status": "ok",
        "median_ms": None,
        "peak_bytes": None,
        "note": None,
    }
    model = opt = None
    try:
        torch.manual_seed(0)
        model = cifar_resnet18(tiny=args.smoke).to(device).train()
        memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
        model = model.to(memory_format=memory_format)
        opt = make_optimizer(model, optimizer, impl, refresh)
        x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
        x = x.contiguous(memory_format=memory_format)
        y = torch.randint(0, 10, (args.batch_size,), device=device)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

        # warm-up outside the timed and memory-tracked region: cuDNN autotuning, Triton
        # compilation, lazily created optimizer state and the first Fisher fold
        for _ in range(args.warmup):
            step()
        synchronize(device)
        if refresh is not None and opt.collector.collecting != refresh:
            raise RuntimeError(f"collector.collecting is {opt.collector.collecting}, not {refresh}")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = time_steps(step, device, warmup=0, steps=args.steps)
        method = "cuda events" if device.type == "cuda" else "time.perf_counter"
        row.update(summarize(times, method))
        if device.type == "cuda":
            row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        row["n_params"] = count_params(model)
    except Exception as exc:  # a failing variant must not hide the others' results
        row["status"] = "error"
        row["note"] = report_error(exc)
    finally:
        if isinstance(opt, AdaFisherW):
            opt.collector.remove()
        # free this variant's activations and state before the next one is measured
        model = opt = None
        free_memory(device)
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Adds ``vs_adamw`` (time) and ``peak_vs_adamw`` (memory) against AdamW(fused)."""
    base = next((r for r in rows if r["optimizer"] == "AdamW" and r["median_ms"]), None)
    for r in rows:
        ok = base is not None and r["median_ms"]
        r["vs_adamw"] = r["median_ms"] / base["median_ms"] if ok else None
        both_peaks = ok and r["peak_bytes"] and base["peak_bytes"]
        r["peak_vs_adamw"] = r["peak_bytes"] / base["peak_bytes"] if both_peaks else None


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table."""
    headers = [
        "optimizer",
        "impl",
        "Fisher refresh",
        "step ms (median)",
        "p20-p80 ms",
        "x AdamW(fused)",
        "peak GiB",
        "peak x AdamW(fused)",
        "note",
    ]
    refresh = {None: "-", True: "every step", False: "no"}
    body = [
        [
            r["optimizer"],
            r["impl"],
            refresh[r["refresh"]],
            fmt(r["median_ms"]),
            f"{fmt(r.get('p20_ms'))}-{fmt(r.get('p80_ms'))}" if r["median_ms"] else "n/a",
            fmt(r["vs_adamw"], ".2f", "x"),
            fmt(r["peak_bytes"] / 2**30 if r["peak_bytes"] else None, ".2f"),
            fmt(r["peak_vs_adamw"], ".2f", "x"),
            (r["note"] or "")[:200],
        ]
        for r in rows
    ]
    return markdown_table(headers, body)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints a markdown table and writes bench_train_step.json.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        0, or 1 when a variant failed.
    """
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=None, help="default 512 (smoke: 8)")
    parser.add_argument("--image-size", type=int, default=None, help="default 32 (smoke: 16)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 20)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 100)")
    parser.add_argument(
        "--channels-last", action="store_true", help="model and input in channels_last"
    )
    args = parser.parse_args(argv)
    argv = list(argv) if argv is not None else sys.argv[1:]
    defaults = {
        "batch_size": (8, 512),
        "image_size": (16, 32),
        "warmup": (2, 20),
        "steps": (4, 100),
    }
    for name, (smoke, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    device = resolve_device(args.device)
    impls = resolve_impls(args.impls, device)
    if device.type == "cuda":
        # same autotuned convolutions for every optimizer
        torch.backends.cudnn.benchmark = True

    variants = [("AdamW", None, None)] + [
        ("AdaFisherW", impl, refresh) for impl in impls for refresh in (True, False)
    ]
    rows = [measure(name, impl, refresh, device, args) for name, impl, refresh in variants]
    add_ratios(rows)

    env = environment(__file__, argv, device)
    text = table(rows)
    print(f"device: {env['device']}; torch {env['torch']}, triton {env['triton']}")
    print(
        f"CIFAR ResNet-18, batch {args.batch_size}, {args.image_size}x{args.image_size}, "
        f"bf16 autocast, channels_last={args.channels_last}, "
        f"median of {args.steps} steps after {args.warmup} warm-up steps"
    )
    print(text)
    payload = {
        "env": env,
        "config": {
            "smoke": args.smoke,
            "impls": impls,
            "batch_size": args.batch_size,
            "image_size": args.image_size,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "channels_last": args.channels_last,
            "autocast": "bfloat16",
            "cudnn_benchmark": device.type == "cuda",
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
        },
        "results": rows,
    }
    path = write_results(out_dir(args.out), "bench_train_step", payload, text)
    print(f"wrote {path}")
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
