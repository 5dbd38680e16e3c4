"""Where a Fisher refresh's time goes: torch.profiler over training steps of AdaFisherW
refreshing on every step, of AdaFisherW refreshing on none and of AdamW(fused), on the
models of ``python -m benchmarks step`` (same batch, layout and bf16 autocast).

Three tables, per training step (a mean over ``--steps`` profiled steps, after
``python -m benchmarks step``'s warm-up):

- **phases**: host milliseconds (the time in the range, its children included) and the
  device milliseconds of the kernels it launched, with calls, for zero_grad, forward,
  backward and the optimizer step, and inside them the statistics each rule writes in
  the hooks (``a`` in the forward, ``g`` in the backward) and the fold;
- **totals**: kernel launches, host synchronisations, ``cudaMalloc`` calls, ``aten``
  operators, the device's busy time and the step's wall time (the median over ten times
  as many steps timed without the profiler, as ``python -m benchmarks step`` times them);
- **what a refresh adds**: the kernels (on a CPU: the operators) whose time per step grows
  most from the no-refresh step to the refresh step, with their calls.

``--trace`` also writes the Chrome trace of the refresh variant (``chrome://tracing`` or
Perfetto). A CPU run (``--smoke``) profiles the host side only.

Usage:
    python -m benchmarks refresh [--model M] [--layout L] [--trace] --out "$OUT"
    python -m benchmarks refresh --smoke --out /tmp/profile    # CPU, seconds
"""

from __future__ import annotations

import contextlib
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks import harness
from benchmarks import step as bench
from hf_triaccel import AdaFisherW
from hf_triaccel.curvature.collection.layer import LayerFactors
from hf_triaccel.curvature.collector import FisherCollector
from hf_triaccel.curvature.rules.batching import StatisticsBatch

NAME = "refresh"
HELP = "where a Fisher refresh's time goes: torch.profiler over the step"

OPTIONS = {
    "batch_size": bench.OPTIONS["batch_size"],
    "image_size": bench.OPTIONS["image_size"],
    "warmup": (int, 2, 10, "untimed steps before the profiled and the timed ones"),
    "steps": (int, 2, 5, "profiled steps, and ten times as many timed ones"),
    "top": (int, 8, 15, "rows of the 'what a refresh adds' table"),
}
VARIANTS = {  # name -> step row (the layout is the run's)
    "AdamW(fused)": {"optimizer": "AdamW", "impl": "fused", "refresh": None},
    "AdaFisherW, no refresh": {"optimizer": "AdaFisherW", "refresh": False},
    "AdaFisherW, refresh every step": {"optimizer": "AdaFisherW", "refresh": True},
}
REFRESH, NO_REFRESH = "AdaFisherW, refresh every step", "AdaFisherW, no refresh"
PHASES = ("zero_grad", "forward", "backward", "optimizer step")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


@contextlib.contextmanager
def labelled_statistics() -> Iterator[None]:
    """Names the statistics and the fold in the profile: each layer's ``a`` and ``g``
    writes as ``a: RULE`` / ``g: RULE``, the launches of what they queued as ``flush``
    (wherever it runs: the backward's start and end, past the gradient budget, the fold)
    and the collector's fold as ``fold``. Labels cost host time of their own, so only
    profiled steps carry them."""
    take_a, take_g, fold, flush = (
        LayerFactors.take_activation,
        LayerFactors.take_gradient,
        FisherCollector.fold,
        StatisticsBatch.flush,
    )

    def labelled(method: Callable, label: Callable[[Any], str]) -> Callable:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            with record_function(label(self)):
                return method(self, *args, **kwargs)

        return call

    LayerFactors.take_activation = labelled(take_a, lambda ly: f"a: {type(ly.rule).__name__}")
    LayerFactors.take_gradient = labelled(take_g, lambda ly: f"g: {type(ly.rule).__name__}")
    FisherCollector.fold = labelled(fold, lambda _: "fold")
    StatisticsBatch.flush = labelled(flush, lambda _: "flush")
    try:
        yield
    finally:
        LayerFactors.take_activation, LayerFactors.take_gradient = take_a, take_g
        FisherCollector.fold, StatisticsBatch.flush = fold, flush


def phased_step(opt: torch.optim.Optimizer, loss_of: Callable, device: torch.device) -> Callable:
    """``step``'s training step, each phase in a profiler range."""

    def step() -> None:
        with record_function("zero_grad"):
            opt.zero_grad(set_to_none=True)
        with record_function("forward"), torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of()
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer step"):
            opt.step()

    return step


def kernel_events(events: Sequence[Any]) -> list[Any]:
    """The device's kernels (and copies) among the profile's events; a labelled range
    shows on the device too, as an annotation that is not work of its own."""
    return [
        e
        for e in events
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]


def per_step(events: Sequence[Any], steps: int, cuda: bool) -> dict[str, Any]:
    """The profile of ``steps`` steps, per step: the labelled ranges (calls, host ms,
    device ms), the totals and the time per kernel (per operator on a CPU)."""
    ranges: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for e in events:
        labelled = e.name in PHASES or e.name in ("fold", "flush") or e.name[:3] in ("a: ", "g: ")
        if labelled and e.device_type == DeviceType.CPU:
            entry = ranges[e.name]
            entry[0] += 1
            entry[1] += e.cpu_time_total / 1e3
            entry[2] += e.device_time_total / 1e3 if cuda else 0.0
    kernels = kernel_events(events)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels if cuda else (e for e in events if e.name.startswith("aten::")):
        entry = by_name[e.name]
        entry[0] += 1
        entry[1] += (e.device_time_total if cuda else e.self_cpu_time_total) / 1e3
    return {
        "ranges": {k: [v[0] / steps, v[1] / steps, v[2] / steps] for k, v in ranges.items()},
        **totals(events, steps, cuda),
        "by_name": {k: [v[0] / steps, v[1] / steps] for k, v in by_name.items()},
    }


def totals(events: Sequence[Any], steps: int, cuda: bool) -> dict[str, float]:
    """Per step: kernel launches, host synchronisations, ``cudaMalloc`` calls, ``aten``
    operators and the device's busy milliseconds."""
    names = Counter(e.name for e in events)
    return {
        "launches": sum(names[n] for n in LAUNCHES) / steps,
        # reading a device scalar (.item()) waits for the device; on a CPU it waits for nothing
        "syncs": (sum(names[n] for n in SYNCS) + cuda * names["aten::_local_scalar_dense"]) / steps,
        "mallocs": names["cudaMalloc"] / steps,
        "aten_ops": sum(c for n, c in names.items() if n.startswith("aten::")) / steps,
        "device_busy_ms": sum(e.device_time_total for e in kernel_events(events)) / 1e3 / steps,
    }


def profile_variant(name: str, args: Any) -> dict[str, Any]:
    """One variant on a fresh, identically seeded model: its profile per step and its
    median wall time per step."""
    row = {**VARIANTS[name], "layout": args.layout}
    row.setdefault("impl", args.impls[0])
    model = bench.build(row, args)
    opt, _ = bench.prepare(row, model, args)
    loss_of = bench.random_batch_loss(model, args, channels_last=args.layout == "channels_last")
    step = phased_step(opt, loss_of, args.device)
    times = harness.time_steps(step, args.device, warmup=0, steps=10 * args.steps)
    activities = [ProfilerActivity.CPU]
    cuda = args.device.type == "cuda"
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with labelled_statistics(), profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        harness.synchronize(args.device)
    if args.trace and name == REFRESH:
        prof.export_chrome_trace(str(harness.out_dir(args) / f"refresh_{args.model}.trace.json"))
    result = per_step(prof.events(), args.steps, cuda)
    result["wall_ms"] = statistics.median(times)
    if isinstance(opt, AdaFisherW):
        opt.collector.remove()
    return result


def phase_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per labelled range of any variant: the phases in step order, each
    followed by the statistics and fold that run inside it."""
    labels = set().union(*(r["ranges"] for r in results.values()))
    inside = {
        "forward": sorted(x for x in labels if x.startswith("a: ")),
        # most flushes run in the backward; the row counts them all
        "backward": sorted(x for x in labels if x.startswith("g: "))
        + ["flush"] * ("flush" in labels),
        "optimizer step": ["fold"] if "fold" in labels else [],
    }
    order = [(p, False) for p in PHASES]
    order = [x for p, _ in order for x in [(p, False), *((c, True) for c in inside.get(p, []))]]
    rows = []
    for label, nested in order:
        row = {"range": ("  " if nested else "") + label}
        for name, result in results.items():
            row[name] = result["ranges"].get(label)
        rows.append(row)
    return rows


def growth(more: dict[str, list[float]], less: dict[str, list[float]], top: int) -> list[dict]:
    """The ``top`` names whose ``[calls, ms]`` per step grow most from ``less`` to ``more``."""
    rows = []
    for name, (calls, ms) in more.items():
        base_calls, base_ms = less.get(name, (0.0, 0.0))
        rows.append({"name": name, "calls": calls - base_calls, "ms": ms - base_ms})
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top]


def range_cell(value: list[float] | None, cuda: bool) -> str:
    """A labelled range's ``[calls, host ms, device ms]`` as a table cell."""
    if value is None:
        return ""
    calls, host, device = value
    return f"{calls:g} / {host:.3f} / {device:.3f}" if cuda else f"{calls:g} / {host:.3f}"


def totals_table(results: dict[str, dict[str, Any]], cuda: bool) -> str:
    """The totals per step of each variant (see :func:`totals`) and its wall time."""
    fmt = harness.fmt
    return harness.table(
        [{"variant": name, **result} for name, result in results.items()],
        {
            "variant": lambda r: r["variant"],
            "wall ms": lambda r: fmt(r["wall_ms"]),
            "device busy ms": lambda r: fmt(r["device_busy_ms"]) if cuda else "",
            "launches": lambda r: f"{r['launches']:g}",
            "host syncs": lambda r: f"{r['syncs']:g}",
            "cudaMalloc": lambda r: f"{r['mallocs']:g}",
            "aten ops": lambda r: f"{r['aten_ops']:g}",
        },
    )


def short(name: str, width: int = 70) -> str:
    """A kernel's name cut to ``width`` characters (templated names run to pages)."""
    return name if len(name) <= width else name[: width - 3] + "..."


def tables(results: dict[str, dict[str, Any]], top: int, cuda: bool) -> str:
    """The three tables (see the module doc), as Markdown."""
    unit = "calls / host ms / device ms" if cuda else "calls / host ms"
    phases = harness.table(
        phase_rows(results),
        {"range (per step)": lambda r: r["range"]}
        | {f"{name}: {unit}": (lambda r, n=name: range_cell(r[n], cuda)) for name in results},
    )
    what = "kernel" if cuda else "operator (self host time)"
    added = harness.table(
        growth(results[REFRESH]["by_name"], results[NO_REFRESH]["by_name"], top),
        {
            what: lambda r: short(r["name"]),
            "calls added per step": lambda r: f"{r['calls']:g}",
            "ms added per step": lambda r: harness.fmt(r["ms"]),
        },
    )
    return (
        f"Phases\n\n{phases}\n\nTotals per step\n\n{totals_table(results, cuda)}\n\n"
        f"What a refresh adds (refresh every step less no refresh)\n\n{added}"
    )


def add_arguments(parser: Any) -> None:
    """The measurement's options."""
    harness.add_common(parser, OPTIONS)
    parser.add_argument("--model", choices=tuple(bench.MODELS), default="resnet18_cifar")
    parser.add_argument("--layout", choices=bench.LAYOUTS, default="channels_last")
    parser.add_argument("--trace", action="store_true", help="write the refresh's Chrome trace")
    parser.set_defaults(host=False)  # the step's defaults read it


def run(args: Any) -> int:
    """Profiles the variants and writes the tables (``refresh_MODEL.json/.md``)."""
    harness.resolve(args, bench.defaults)
    if args.model in harness.TEXT_MODELS:
        args.layout = "none"
    cuda = args.device.type == "cuda"
    torch.backends.cudnn.benchmark = cuda
    results = {name: profile_variant(name, args) for name in VARIANTS}
    sample = f"{args.image_size} tokens" if args.model in harness.TEXT_MODELS else "images"
    header = (
        f"{args.model} ({args.size}), batch {args.batch_size} of {sample} of side "
        f"{args.image_size}, layout {args.layout}, bf16 autocast, AdaFisherW {args.impls[0]}; "
        f"{args.steps} profiled steps after {args.warmup} warm-up steps, wall time the "
        f"median of {10 * args.steps} steps timed without the profiler\n\n"
    )
    text = header + tables(results, args.top, cuda)
    harness.finish(f"refresh_{args.model}", args, {"results": results}, text)
    return 0
