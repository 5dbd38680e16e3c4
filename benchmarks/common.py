"""Helpers shared by the benchmark scripts: timing, models, environment, output.

Every figure a benchmark reports is a median after warm-up, taken next to its
torch.optim.AdamW(fused=True) baseline in the same process (DESIGN.md section 6):
the baseline alone varies by more than 50% between runs on the same kind of GPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parent.parent
LR = 1e-3
WEIGHT_DECAY = 0.01


def base_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark shares.

    Args:
        description: what the script measures, shown by ``--help``.

    Returns:
        A parser with ``--out``, ``--smoke``, ``--device`` and ``--impls``.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--out",
        default=None,
        help="directory for the JSON and markdown results (default: $OUT, else the "
        "current directory)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny models and few repetitions, to check the script end to end (runs on CPU)",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="torch device (default: cuda when available, else cpu)",
    )
    parser.add_argument(
        "--impls",
        default=None,
        help="comma-separated AdaFisher implementations to measure (default: "
        "'triton,foreach' on CUDA, 'foreach,reference' elsewhere)",
    )
    return parser


def resolve_device(name: str | None) -> torch.device:
    """The device named on the command line, or CUDA when there is one."""
    if name is not None:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_impls(spec: str | None, device: torch.device) -> list[str]:
    """AdaFisher implementations to measure, from ``--impls`` or the device's default."""
    if spec:
        return [s.strip() for s in spec.split(",") if s.strip()]
    return ["triton", "foreach"] if device.type == "cuda" else ["foreach", "reference"]


def out_dir(arg: str | None) -> Path:
    """The results directory: ``--out``, else ``$OUT``, else the current directory."""
    path = Path(arg or os.environ.get("OUT") or ".")
    path.mkdir(parents=True, exist_ok=True)
    return path


def synchronize(device: torch.device) -> None:
    """Waits for queued device work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Collects garbage and returns cached device memory, between measured variants."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_steps(
    fn: Callable[[], Any], device: torch.device, *, warmup: int, steps: int
) -> list[float]:
    """Per-call times of ``fn`` in milliseconds.

    On CUDA each call sits between two events and the host synchronises only once,
    after the last call, so that the measurement adds no sync the workload would not
    have; a call's time then includes any gap the host leaves while launching it.
    Elsewhere each call is timed with ``time.perf_counter``.

    Args:
        fn: the work to time.
        device: where ``fn`` runs.
        warmup: untimed calls first.
        steps: timed calls.

    Returns:
        ``steps`` times in milliseconds.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        for start, end in zip(starts, ends, strict=True):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def summarize(times: Sequence[float], method: str) -> dict[str, Any]:
    """Median and 20th/80th percentiles of per-call times in milliseconds."""
    p20, p50, p80 = np.percentile(np.asarray(times, dtype=np.float64), [20, 50, 80])
    return {
        "median_ms": float(p50),
        "p20_ms": float(p20),
        "p80_ms": float(p80),
        "reps": len(times),
        "method": method,
    }


def benchmark(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup_ms: float = 100.0,
    rep_ms: float = 500.0,
    min_reps: int = 3,
) -> dict[str, Any]:
    """Median time of ``fn`` in milliseconds, with time budgets as in ``do_bench``.

    On CUDA with Triton this is ``triton.testing.do_bench``, which also flushes the
    L2 cache before each call so that small models are not timed from cache. Without
    Triton it falls back to CUDA events, and on CPU to ``time.perf_counter``; both
    size warm-up and repetitions from a first estimate, as ``do_bench`` does.

    Args:
        fn: the work to time.
        device: where ``fn`` runs.
        warmup_ms: time spent in untimed calls first.
        rep_ms: time spent in timed calls.
        min_reps: fewest timed calls of the fallback paths.

    Returns:
        ``median_ms``, ``p20_ms``, ``p80_ms``, ``reps`` (``None`` when ``do_bench``
        chose it) and ``method``.
    """
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            p20, p50, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
            return {
                "median_ms": float(p50),
                "p20_ms": float(p20),
                "p80_ms": float(p80),
                "reps": None,
                "method": "triton.testing.do_bench",
            }
    estimate = max(float(np.median(time_steps(fn, device, warmup=1, steps=3))), 1e-3)
    steps = max(min_reps, int(rep_ms / estimate))
    times = time_steps(fn, device, warmup=int(warmup_ms / estimate), steps=steps)
    return summarize(times, "cuda events" if device.type == "cuda" else "time.perf_counter")


def copy_bandwidth(device: torch.device, nbytes: int, **timing: float) -> dict[str, Any]:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written.

    Args:
        device: where to copy.
        nbytes: size of the copied tensor; large enough to leave the caches behind.
        **timing: ``warmup_ms`` / ``rep_ms`` for :func:`benchmark`.

    Returns:
        ``bytes`` (the tensor size), ``median_ms`` and ``gbytes_per_s`` (1e9 bytes/s).
    """
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = benchmark(lambda: dst.copy_(src), device, **timing)
    return {
        "bytes": src.numel() * 4,
        "median_ms": t["median_ms"],
        "gbytes_per_s": 2 * src.numel() * 4 / (t["median_ms"] * 1e-3) / 1e9,
    }


def cifar_resnet18(*, tiny: bool = False) -> nn.Module:
    """timm ResNet-18 with the CIFAR stem: 3x3 stride-1 conv1, no max-pool, 10 classes.

    Args:
        tiny: one block per stage and 8..64 channels, for CPU smoke runs.

    Returns:
        The model (11.17M parameters at full size), on the CPU, in train mode.
    """
    import timm

    size = dict(layers=(1, 1, 1, 1), channels=(8, 16, 32, 64), stem_width=8) if tiny else {}
    model = timm.create_model("resnet18", pretrained=False, num_classes=10, **size)
    model.conv1 = nn.Conv2d(
        3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False
    )
    model.maxpool = nn.Identity()
    return model


def vit_b16(*, tiny: bool = False) -> nn.Module:
    """timm ViT-B/16 at 224 pixels, randomly initialised.

    Args:
        tiny: 32-pixel images, 8-pixel patches, width 32, depth 2, 10 classes, for CPU
            smoke runs (same model class and module types).

    Returns:
        The model (86.6M parameters at full size), on the CPU, in train mode.
    """
    import timm

    size = (
        dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)
        if tiny
        else {}
    )
    return timm.create_model("vit_base_patch16_224", pretrained=False, **size)


def count_params(model: nn.Module) -> int:
    """Number of trainable parameter elements."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _version(package: str) -> str | None:
    # read from metadata so that recording a version does not import the package
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(script: str, argv: Sequence[str], device: torch.device) -> dict[str, Any]:
    """What a result was measured on and with, for the JSON record.

    Args:
        script: the benchmark's ``__file__``.
        argv: its command-line arguments.
        device: the device measured.

    Returns:
        Device name, library versions, UTC date, git commit and the command line.
    """
    try:
        script_path = str(Path(script).resolve().relative_to(REPO_ROOT))
    except ValueError:
        script_path = script
    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "device_type": device.type,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "timm": _version("timm"),
        "transformers": _version("transformers"),
        "hf_triaccel": _version("hf-triaccel"),
        "python": platform.python_version(),
        "git_commit": _git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", script_path, *argv]),
    }


def report_error(exc: BaseException) -> str:
    """Prints the traceback to stderr and returns a one-line description for a result row."""
    traceback.print_exception(exc, file=sys.stderr)
    return f"{type(exc).__name__}: {exc}".strip()


def fmt(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    """A number for a table cell, or ``n/a`` when it was not measured."""
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(directory: Path, name: str, payload: dict[str, Any], table: str) -> Path:
    """Writes ``<name>.json`` and ``<name>.md`` into ``directory``.

    Returns:
        The path of the JSON file.
    """
    path = directory / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    env = payload["env"]
    header = f"`{env['command']}` on {env['device']} ({env['date_utc']})\n\n"
    (directory / f"{name}.md").write_text(header + table + "\n")
    return path
