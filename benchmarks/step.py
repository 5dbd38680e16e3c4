"""Training step of a model: AdaFisherW against torch.optim.AdamW(fused=True) at its fastest.

zero_grad + forward under bf16 autocast + backward + ``opt.step()`` on one random batch,
for the CIFAR ResNet-18 (batch 512, 32x32), ViT-B/16 (``--model vit_base_patch16_224``:
batch 128, 224x224), the CIFAR EfficientNet-B0 (``efficientnet_b0_cifar``: batch 512,
32x32) or GPT-2 small (``gpt2``, transformers' ``GPT2Config()``: batch 8 of 1024 random
tokens, its language-model loss), in each of ``--layouts`` (default
``channels_last,nchw``: the layout hf_triaccel's Trainer gives a model with 2-D
convolutions, and torch's default; the text model has one layout, ``none``);
AdaFisherW refreshing its factors on every step and on none: step time and peak memory,
as ratios against the fastest AdamW(fused) row of the run (with ``--rounds``, every
variant measured in turn that many times: each ratio is the median of the rounds'
ratios). ``--host``: the step's host work (on a CPU the launches are counted, not run,
and the model narrowed). README.md: method and columns.

Usage:
    python -m benchmarks step [--model M] [--layouts L] [--host] --out "$OUT"
    python -m benchmarks step --smoke [--host] --out /tmp/bench   # CPU
"""

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import harness
from hf_triaccel import AdaFisherW
from hf_triaccel.integrations.layout import channels_last_batch, to_channels_last

NAME = "step"
HELP = "the training step: AdaFisherW refreshing every step and never, against AdamW(fused)"

# model -> (batch, image side or tokens a sample) of a full run; smoke runs take OPTIONS'
# smoke values
MODELS = {
    "resnet18_cifar": (512, 32),
    "vit_base_patch16_224": (128, 224),
    "efficientnet_b0_cifar": (512, 32),
    "gpt2": (8, 1024),
}
LAYOUTS = ("channels_last", "nchw")
OPTIONS = {
    "batch_size": (int, 8, None, "batch (default by --model; --host on a CPU: 4)"),
    "image_size": (int, None, None, "image side, or tokens a sample (default by --model)"),
    "warmup": (int, 2, 20, "untimed steps (--host: 3)"),
    "steps": (int, 4, 100, "timed steps (--host: 40, smoke 3)"),
    "rounds": (int, 1, 1, "rounds of every variant in turn; ratios: the median over rounds"),
}


def defaults(args: Any) -> dict[str, int]:
    """Defaults chosen by the flags: batch and image side by model (a smoke run keeps the
    tiny model's image side), and those of ``--host``: each step timed alone, a small
    batch on a CPU."""
    batch, side = MODELS[args.model]
    if args.smoke:
        side = harness.SIZES[args.model]["tiny"].get("img_size", 16)
    chosen = {"image_size": side} if args.smoke else {"batch_size": batch, "image_size": side}
    if args.host:
        cpu = {"batch_size": 4} if args.device.type != "cuda" else {}
        chosen.update(warmup=3, steps=3 if args.smoke else 40, **cpu)
    return chosen


def build(row: dict, args: Any) -> torch.nn.Module:
    """A fresh, identically seeded model on the device, in the row's layout."""
    model = harness.build_model(args.model, args.size).to(args.device)
    if row["layout"] == "channels_last":
        to_channels_last(model)  # as TriAccelTrainer does: models with 2-D convolutions
    return model


def random_batch_loss(
    model: torch.nn.Module, args: Any, channels_last: bool
) -> Callable[[], torch.Tensor]:
    """The loss of ``model`` on one random batch: random tokens as their own labels for a
    text model, random images of 10 classes otherwise."""
    if args.model in harness.TEXT_MODELS:
        shape = (args.batch_size, args.image_size)
        ids = torch.randint(0, model.config.vocab_size, shape, device=args.device)
        return lambda: model(input_ids=ids, labels=ids).loss
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=args.device)
    x = channels_last_batch(x) if channels_last else x
    y = torch.randint(0, 10, (args.batch_size,), device=args.device)
    return lambda: F.cross_entropy(model(x), y)


def prepare(row: dict, model: torch.nn.Module, args: Any) -> tuple[Any, Any]:
    """The optimizer of ``row`` and its training step, after the warm-up steps (cuDNN
    autotuning, Triton compilation, lazily created state, the first Fisher fold)."""
    every = 1 if row["refresh"] else harness.NEVER
    opt = harness.make_optimizer(row["optimizer"], model, impl=row["impl"], update_every=every)
    loss_of = random_batch_loss(model, args, channels_last=row["layout"] == "channels_last")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(args.device.type, dtype=torch.bfloat16):
            loss = loss_of()
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
        model = build(row, args)
        opt, step = prepare(row, model, args)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = harness.time_steps(step, device, warmup=0, steps=args.steps)
        row.update(harness.summarize(times, "cuda events" if cuda else "time.perf_counter"))
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device) if cuda else None
        if row["refresh"]:  # after the timing: the counting hooks cost host time
            row["refresh_bytes"] = harness.refresh_bytes(opt.collector, step)
    if isinstance(opt, AdaFisherW):
        opt.collector.remove()
    model = opt = step = None  # this variant's activations and state go before the next
    harness.free_memory(device)


def measure_rounds(rows: list[dict], args: Any) -> None:
    """``--rounds`` rounds of every variant in turn (:func:`measure`), so that a drift of
    the host's speed hits every variant alike: each row keeps its rounds' medians
    (``round_ms``), the median of those as its step time and their range as its spread;
    peak memory is the last round's."""
    medians: list[list[float]] = [[] for _ in rows]
    for _ in range(args.rounds):
        for row, kept in zip(rows, medians, strict=True):
            if row["status"] == "ok":
                measure(row, args)
                kept.append(row.get("median_ms"))
    if args.rounds > 1:
        for row, kept in zip(rows, medians, strict=True):
            row["round_ms"] = kept
            if row["status"] == "ok" and None not in kept:
                row.update(median_ms=float(np.median(kept)), p20_ms=min(kept), p80_ms=max(kept))


def measure_host(rows: list[dict], args: Any) -> None:
    """Operators, launches and host time per step of every variant; the variants take
    turns, so that a drift of the host's speed hits them alike."""
    base = build(rows[0], args)
    counter = harness.LaunchCounter(stub=args.device.type != "cuda")
    try:
        steps = []
        for row in rows:
            steps.append(prepare(row, copy.deepcopy(base), args)[1])
            before = counter.count
            row["aten_ops"] = harness.count_aten_ops(steps[-1])
            harness.synchronize(args.device)
            row.update(launches=counter.count - before, times=[])
            if args.device.type == "cpu":  # where the backward's hooks run in this thread
                row["python"] = harness.count_python(steps[-1])
        for _ in range(args.steps):
            for row, step in zip(rows, steps, strict=True):
                row["times"].append(harness.wall_ms(step, args.device, wait=False))
    finally:
        counter.restore()
    for row in rows:
        row["host_ms"] = float(np.median(row.pop("times")))


def python_total(row: dict, at: int) -> str:
    """A row's Python opcodes (``at=0``) or calls (``1``) per step, ``n/a`` uncounted."""
    counts = row.get("python")
    return "n/a" if counts is None else str(sum(v[at] for v in counts.values()))


def refresh_python_table(rows: list[dict], top: int = 20) -> str:
    """The functions whose Python work a refresh adds most: per function, the opcodes
    and calls of the refreshing AdaFisherW row less those of the one without refresh."""
    fisher = {r["refresh"]: r.get("python") for r in rows if r["optimizer"] == "AdaFisherW"}
    refresh, plain = fisher.get(True), fisher.get(False)
    if refresh is None or plain is None:
        return ""
    added = {
        name: (opcodes - plain.get(name, (0, 0))[0], calls - plain.get(name, (0, 0))[1])
        for name, (opcodes, calls) in refresh.items()
    }
    lines = ["| what a refresh adds: function | Python opcodes | calls |", "|---|---|---|"]
    for name, (opcodes, calls) in sorted(added.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| `{name}` | {opcodes} | {calls} |")
    total = [sum(v[i] for v in added.values()) for i in (0, 1)]
    lines.append(f"| all | {total[0]} | {total[1]} |")
    return "\n".join(lines)


def variants(args: Any) -> list[dict]:
    """AdamW(fused) in every layout first (the candidates for the baseline), then
    AdaFisherW per layout and implementation, refreshing on every step and on none;
    ``--host``: the first layout and Triton only."""
    layouts = args.layouts[:1] if args.host else args.layouts
    adamw = {"optimizer": "AdamW", "impl": "fused", "refresh": None}
    rows = [{**adamw, "layout": layout} for layout in layouts]
    for layout in layouts:
        for impl in ["triton"] if args.host else args.impls:
            rows += [
                {"optimizer": "AdaFisherW", "impl": impl, "refresh": r, "layout": layout}
                for r in (True, False)
            ]
    return [{**row, "status": "ok", "note": None} for row in rows]


def add_arguments(parser: Any) -> None:
    """The step's options (:data:`OPTIONS`, the model, layouts, ``--host``)."""
    harness.add_common(parser, OPTIONS)
    parser.add_argument("--model", choices=tuple(MODELS), default="resnet18_cifar")
    parser.add_argument(
        "--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {list(LAYOUTS)}"
    )
    parser.add_argument("--host", action="store_true", help="host work instead of device time")


def run(args: Any) -> int:
    """Runs the benchmark; returns 1 when a variant failed."""
    harness.resolve(args, defaults)
    args.layouts = harness.split(args.layouts, LAYOUTS, "--layouts")
    text = args.model in harness.TEXT_MODELS
    if text:
        args.layouts = ["none"]  # token ids have no memory format
    cuda = args.device.type == "cuda"
    torch.backends.cudnn.benchmark = cuda  # same autotuned convolutions for every variant
    rows = variants(args)
    if args.host:
        args.size = "full" if cuda else "narrow"  # the module structure: the same host work
        measure_host(rows, args)
    else:
        measure_rounds(rows, args)
    key = "host_ms" if args.host else "median_ms"
    adamw = [r for r in rows if r["optimizer"] == "AdamW" and r.get(key)]
    fastest = min(adamw, key=lambda r: r[key], default=None)
    baseline = lambda r: r is fastest
    harness.add_ratio(rows, key, "vs_adamw", baseline)
    if args.rounds > 1 and fastest is not None:  # each round's ratio, then their median
        for row in rows:
            pairs = zip(row["round_ms"], fastest["round_ms"], strict=False)  # failed rounds
            ratios = [ms / base for ms, base in pairs]
            row["round_vs_adamw"] = ratios
            row["vs_adamw"] = float(np.median(ratios)) if row.get(key) else None
    harness.add_ratio(rows, "peak_bytes", "peak_vs_adamw", baseline)
    refreshes = {None: "-", True: "every step", False: "no"}
    fmt = harness.fmt
    columns = {
        "optimizer": lambda r: r["optimizer"],
        "impl": lambda r: r["impl"],
        "layout": lambda r: r["layout"],
        "Fisher refresh": lambda r: refreshes[r["refresh"]],
    }
    if args.host:
        columns["aten ops"] = lambda r: r["aten_ops"]
        for name, at in (("Python opcodes", 0), ("Python calls", 1)):
            columns[name] = lambda r, at=at: python_total(r, at)
        columns["Triton launches"] = lambda r: r["launches"]
        columns["host ms"] = lambda r: fmt(r.get("host_ms"))
        # AdamW's update runs on a CPU within its host time: a ratio only on CUDA
        columns["x AdamW"] = lambda r: fmt(r["vs_adamw"] if cuda else None, ".2f", "x")
    else:
        columns["step ms (median)"] = lambda r: fmt(r.get("median_ms"))
        spread = "rounds' min-max ms" if args.rounds > 1 else "p20-p80 ms"
        columns[spread] = lambda r: f"{fmt(r.get('p20_ms'))}-{fmt(r.get('p80_ms'))}"
        columns["x AdamW(fused)"] = lambda r: fmt(r["vs_adamw"], ".2f", "x")
        if args.rounds > 1:
            columns["rounds: x AdamW(fused)"] = lambda r: " / ".join(
                fmt(x, ".2f", "x") for x in r.get("round_vs_adamw") or []
            )
        columns["peak GiB"] = lambda r: harness.gib(r.get("peak_bytes"))
        columns["peak x AdamW(fused)"] = lambda r: fmt(r["peak_vs_adamw"], ".2f", "x")
        columns["refresh reads GiB"] = lambda r: harness.gib(r.get("refresh_bytes"))
    columns["note"] = harness.note
    base_text = "none measured" if fastest is None else f"AdamW(fused), {fastest['layout']}"
    sample = f"{args.image_size} tokens" if text else f"{args.image_size}x{args.image_size}"
    print(
        f"{args.model} ({args.size}), batch {args.batch_size}, {sample}, bf16 autocast, "
        f"layouts {args.layouts}; {args.steps} timed steps "
        f"after {args.warmup} warm-up steps, {args.rounds} round(s); baseline of the ratios: "
        f"{base_text} (the fastest AdamW row)"
    )
    config = {"autocast": "bfloat16", "lr": harness.LR, "weight_decay": harness.WEIGHT_DECAY}
    config["baseline"] = None if fastest is None else {"optimizer": "AdamW(fused)", **fastest}
    payload = {"config": {**config, "cudnn_benchmark": cuda}, "results": rows}
    name = f"step_host_{args.model}" if args.host else f"step_{args.model}"
    text = harness.table(rows, columns)
    if args.host and args.device.type == "cpu":
        text += "\n\n" + refresh_python_table(rows)
    harness.finish(name, args, payload, text)
    return 1 if any(r["status"] == "error" for r in rows) else 0
