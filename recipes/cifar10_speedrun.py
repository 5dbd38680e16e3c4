"""CIFAR-10 speedrun: AdaFisher against a same-run Muon baseline on an airbench-class net.

The net, data pipeline and test-time augmentation are in ``speedrun_net.py``, the
optimizers in ``speedrun_optim.py``. Every ``--config`` trains the same net, with the same
seeds, data order and schedule: batch 2000, label smoothing 0.2 (loss averaged over the
batch), 8 epochs, alternating flips and 2-pixel translation, bf16 autocast, learning rates
decaying linearly to zero. With ``--compile`` the net runs compiled, except on the steps
that refresh AdaFisher's Fisher statistics, whose hooks run eagerly.

Timing follows the public record: the GPU time (CUDA events) of training plus the
test-time-augmented evaluation. Not counted, and reported apart: decoding and moving the
data onto the device, the warm-up run of each configuration (which holds compilation),
and the plain evaluation after every epoch that gives the accuracy curve.

Usage:
    python recipes/cifar10_speedrun.py --data .data/cifar10 --compile --seeds 5 \\
        --config muon --config adafisher:on=head,lr=0.01 --out_dir outputs/cifar10_speedrun
    python recipes/cifar10_speedrun.py --help   # every flag; --config keys in speedrun_optim
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedrun_net import (  # noqa: E402
    DeviceData,
    EpochAugmenter,
    SpeedrunNet,
    count_correct,
    decode_split,
    whitening_filters,
)
from speedrun_optim import OptimSettings, SpeedrunOptimizer  # noqa: E402

WHITENING_IMAGES = 5000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--data", type=Path, required=True, help="folder with train/test.parquet")
    p.add_argument("--train_limit", type=int, default=None, help="first N training images")
    p.add_argument("--test_limit", type=int, default=None, help="first N test images")
    p.add_argument(
        "--config",
        action="append",
        help="preset[:key=value,...], repeatable (default: muon and adafisher); presets "
        "muon, adafisher; keys: OptimSettings fields, lr, on=block1+block2+block3+head+norms",
    )
    p.add_argument("--seeds", type=int, default=5, help="timed runs per config (seeds 0..N-1)")
    p.add_argument("--epochs", type=float, default=8.0)
    p.add_argument("--batch_size", type=int, default=2000)
    p.add_argument("--eval_batch", type=int, default=2000)
    p.add_argument("--label_smoothing", type=float, default=0.2)
    p.add_argument("--translate", type=int, default=2, help="pixels of random translation")
    p.add_argument("--widths", default="64,256,256", help="channels of the three blocks")
    p.add_argument("--compile", action="store_true", help="torch.compile the net")
    p.add_argument("--warmup_runs", type=int, default=None, help="default: 1 on CUDA, 0 on CPU")
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--out_dir", type=Path, default=Path("outputs/cifar10_speedrun"))
    p.add_argument("--plot", type=Path, default=None, help="default: OUT_DIR/speedrun_curves.png")
    p.add_argument("--no_plot", action="store_true")
    p.add_argument(
        "--max_wall", type=float, default=None, help="start no run after this many seconds"
    )
    args = p.parse_args(argv)
    args.settings = [OptimSettings.parse(c) for c in (args.config or ["muon", "adafisher"])]
    widths = tuple(int(w) for w in args.widths.split(","))
    if len(widths) != 3 or min(widths) < 1:
        p.error(f"--widths {args.widths!r}: needs three positive integers")
    args.widths = widths
    if args.seeds < 1 or args.epochs <= 0 or args.batch_size < 1:
        p.error("--seeds, --epochs and --batch_size must be positive")
    return args


class SegmentTimer:
    """Sums the device time of marked segments: CUDA events on a GPU, else a host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def segments(self) -> list[float]:
        """Seconds of each (start, stop) pair of marks."""
        if self.cuda:
            torch.cuda.synchronize()
            pairs = zip(self.marks[::2], self.marks[1::2], strict=True)
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in zip(self.marks[::2], self.marks[1::2], strict=True)]


class CollectorCache:
    """Keeps one FisherCollector alive across the runs of configurations that precondition
    the same modules, so that a compiled net sees the same hooks (no recompilation)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.entry: tuple[Any, Any] = (None, None)

    def get(self, settings: OptimSettings) -> tuple[Any, Any]:
        key = (settings.on, settings.adafisher_ema)
        if key != self.key and self.entry[0] is not None:
            self.entry[0].remove()
            self.entry = (None, None)
        self.key = key
        return self.entry

    def keep(self, opt: SpeedrunOptimizer) -> None:
        if opt.collector is not None:
            self.entry = (opt.collector, opt.initial_factors)


def train_run(
    net: SpeedrunNet,
    compiled: torch.nn.Module | None,
    data: DeviceData,
    whitening: torch.Tensor,
    settings: OptimSettings,
    seed: int,
    args: argparse.Namespace,
    collectors: CollectorCache,
) -> dict[str, Any]:
    """One training run; returns its accuracies and timed seconds."""
    device = data.train.device
    torch.manual_seed(seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    net.reset(whitening)
    net.train()
    opt = SpeedrunOptimizer(net, settings, args.batch_size, *collectors.get(settings))
    collectors.keep(opt)
    augmenter = EpochAugmenter(data.train, data.pad, generator)
    n, batch = data.train.shape[0], args.batch_size
    steps_per_epoch = n // batch
    if steps_per_epoch == 0:
        raise ValueError(f"--batch_size {batch} is larger than the {n} training images")
    total = max(1, round(args.epochs * steps_per_epoch))
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
    evaluate = net if compiled is None else compiled
    timer = SegmentTimer(device)
    epoch_correct, step, epoch = [], 0, 0
    while step < total:
        timer.mark()
        images = augmenter.epoch(epoch)
        order = torch.randperm(n, device=device, generator=generator)
        for i in range(min(steps_per_epoch, total - step)):
            index = order[i * batch : (i + 1) * batch]
            x = images[index].contiguous(memory_format=torch.channels_last)
            model = net if compiled is None or opt.refreshing else compiled
            with autocast:
                logits = model(x)
            loss = F.cross_entropy(
                logits.float(),
                data.train_labels[index],
                label_smoothing=args.label_smoothing,
            )
            loss.backward()
            opt.step(1.0 - step / total, step / steps_per_epoch)
            opt.zero_grad()
            step += 1
        timer.mark()
        epoch += 1
        net.eval()
        with autocast:
            epoch_correct.append(
                count_correct(evaluate, data.test, data.test_labels, args.eval_batch, tta=False)
            )
        net.train()
    timer.mark()
    net.eval()
    with autocast:
        tta_correct = count_correct(evaluate, data.test, data.test_labels, args.eval_batch, True)
    net.train()
    timer.mark()
    seconds = timer.segments()
    train_seconds = seconds[:-1]
    n_test = data.test.shape[0]
    curve = [int(c) / n_test for c in epoch_correct]
    elapsed = [sum(train_seconds[: i + 1]) for i in range(len(train_seconds))]
    return {
        "config": settings.label(),
        "seed": seed,
        "steps": total,
        "acc": curve[-1],
        "acc_tta": int(tta_correct) / n_test,
        "train_s": sum(train_seconds),
        "tta_s": seconds[-1],
        "time_s": sum(seconds),
        "epoch_acc": curve,
        "epoch_time_s": elapsed,
    }


def summarise(runs: list[dict[str, Any]], warmup_wall: float | None) -> dict[str, Any]:
    def mean_std(key: str) -> tuple[float, float]:
        values = [r[key] for r in runs]
        return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    walls = sorted(r["wall_s"] for r in runs)
    out = {"config": runs[0]["config"], "runs": len(runs)}
    for key in ("acc", "acc_tta", "train_s", "time_s"):
        out[key], out[f"{key}_std"] = mean_std(key)
    out["warmup_s"] = warmup_wall
    # the warm-up run's extra wall time over a timed run's is compilation and autotuning
    out["compile_s"] = None if warmup_wall is None else warmup_wall - walls[len(walls) // 2]
    return out


def table(summaries: list[dict[str, Any]]) -> str:
    lines = [
        "| config | runs | accuracy, TTA (%) | accuracy, no TTA (%) | timed s (train + TTA) "
        "| train s | compile s |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        compile_s = "-" if s["compile_s"] is None else f"{s['compile_s']:.1f}"
        lines.append(
            f"| {s['config']} | {s['runs']} | {100 * s['acc_tta']:.2f} +- "
            f"{100 * s['acc_tta_std']:.2f} | {100 * s['acc']:.2f} +- {100 * s['acc_std']:.2f} "
            f"| {s['time_s']:.3f} +- {s['time_s_std']:.3f} | {s['train_s']:.3f} | {compile_s} |"
        )
    return "\n".join(lines)


def plot_curves(path: Path, runs: list[dict[str, Any]], title: str) -> None:
    """Test accuracy after every epoch (no TTA; the final TTA accuracy as a star) against
    timed seconds, mean over seeds, one line per configuration; the right panel zooms on
    the last epochs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), width_ratios=(1, 1))
    tails = []
    for config in dict.fromkeys(r["config"] for r in runs):
        rs = [r for r in runs if r["config"] == config]
        times = [statistics.fmean(t) for t in zip(*(r["epoch_time_s"] for r in rs), strict=True)]
        accs = [100 * statistics.fmean(a) for a in zip(*(r["epoch_acc"] for r in rs), strict=True)]
        star = (
            statistics.fmean(r["time_s"] for r in rs),
            100 * statistics.fmean(r["acc_tta"] for r in rs),
        )
        tails.append((star[1], accs[-3:] + [star[1]]))
        for ax in axes:
            (line,) = ax.plot(times, accs, marker="o", ms=3, label=f"{config} (n={len(rs)})")
            ax.plot(*star, marker="*", ms=11, color=line.get_color())
    # the zoom shows the configurations within 2 points of the best final accuracy
    best = max(t[0] for t in tails)
    tail = [a for final, accs in tails if final >= best - 2.0 for a in accs]
    axes[1].set_ylim(min(tail) - 0.3, max(tail) + 0.3)
    axes[1].set_xlim(left=0.6 * max(r["time_s"] for r in runs))
    for ax in axes:
        ax.set_xlabel("timed seconds (training; star: + TTA evaluation)")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].set_title(title, fontsize=9)
    axes[1].set_title("last epochs", fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tick = time.perf_counter()
    train = decode_split(args.data / "train.parquet", args.train_limit)
    test = decode_split(args.data / "test.parquet", args.test_limit)
    decode_s = time.perf_counter() - tick
    tick = time.perf_counter()
    dtype = torch.bfloat16 if cuda else torch.float32
    data = DeviceData.from_arrays(train, test, device, dtype, args.translate)
    whitening = whitening_filters(data.unpadded_train()[:WHITENING_IMAGES]).to(device)
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - tick
    print(f"decode {decode_s:.1f} s, to device + whitening {load_s:.2f} s", flush=True)

    net = SpeedrunNet(args.widths).to(device)
    compiled = None
    if args.compile:
        dynamo = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo, name):
                setattr(dynamo, name, 64)
        compiled = torch.compile(net, dynamic=False)
    warmups = args.warmup_runs if args.warmup_runs is not None else int(cuda)
    collectors = CollectorCache()
    runs_path = args.out_dir / "runs.jsonl"
    runs_path.write_text("")
    all_runs, summaries, warmed = [], [], set()

    def timed_wall(seed: int, settings: OptimSettings) -> dict[str, Any]:
        tick = time.perf_counter()
        result = train_run(net, compiled, data, whitening, settings, seed, args, collectors)
        result["wall_s"] = time.perf_counter() - tick
        return result

    for settings in args.settings:
        if args.max_wall is not None and time.perf_counter() - started > args.max_wall:
            print(f"--max_wall reached: {settings.label()} not run", flush=True)
            continue
        # one warm-up per set of hooked modules: it holds compilation (the hooks are part
        # of the compiled graphs) and the first-call costs of kernels
        key = (settings.on, settings.adafisher_ema)
        warmup_wall = None
        for w in range(warmups if key not in warmed else 0):
            warmup_wall = timed_wall(10_000 + w, settings)["wall_s"]
        warmed.add(key)
        runs = []
        for seed in range(args.seeds):
            result = timed_wall(seed, settings)
            runs.append(result)
            with runs_path.open("a") as f:
                f.write(json.dumps(result) + "\n")
            print(
                f"{result['config']} seed {seed}: acc {100 * result['acc']:.2f} "
                f"TTA {100 * result['acc_tta']:.2f} time {result['time_s']:.3f} s "
                f"(wall {result['wall_s']:.2f} s)",
                flush=True,
            )
        all_runs += runs
        summaries.append(summarise(runs, warmup_wall))
    summary = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "command": "python recipes/cifar10_speedrun.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "decode_s": decode_s,
        "to_device_s": load_s,
        "configs": summaries,
    }
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if not args.no_plot and all_runs:
        plot_curves(
            args.plot or args.out_dir / "speedrun_curves.png",
            all_runs,
            f"CIFAR-10 speedrun, {summary['device']}, mean over seeds",
        )
    print(table(summaries), flush=True)
    return summary


if __name__ == "__main__":
    main()
