"""Step times of this package at two commits (or more), in one call: does a change slow
it down?

For a restructuring that must not change speed. Each commit's package is assembled in a
scratch folder (``hf_triaccel/``; up to dbf24d3 with the top-level ``kernels/``
moved into it, as pyproject.toml installed it then) and timed in its own process, the
commits taking turns ``--rounds`` times so that drift of the GPU's clocks falls on all.
A timed process uses only what every version of the package has
(``AdaFisherW.from_model``) and none of the harness, which imports the current package.

Rows: the CIFAR ResNet-18 (3x3 stride-1 stem, no max-pool; channels_last, bf16 autocast,
batch 512) training step (zero_grad + forward + backward + step) and the optimizer step
alone, for AdamW(fused), AdaFisherW with a Fisher refresh every step, and AdaFisherW
without one, medians after warm-up (``--smoke``: timm's ``test_resnet`` on a CPU,
AdaFisher's portable update). Usage, from the repository root::

    python -m benchmarks commits OLD NEW [MORE...] [--rounds 2] [--out DIR]
    python -m benchmarks commits HEAD~1 HEAD --smoke    # CPU, tiny sizes
    git archive dbf24d3 hf_triaccel kernels > old.tar   # where the history is not copied
    python -m benchmarks commits old.tar new.tar
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

NAME = "commits"
HELP = "the training and optimizer step of several commits' packages, in turn"

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = (("adamw", 0), ("adafisherw", 1), ("adafisherw", 10**9))  # (optimizer, update_every)


def assemble(commit: str, into: Path) -> Path:
    """The package of ``commit`` as an importable folder under ``into``: ``commit`` is
    a git revision, or a tar file that ``git archive REV hf_triaccel [kernels]`` wrote (for
    a machine that has the working tree but not its history). Commits up to dbf24d3 kept
    the kernels in a top-level ``kernels/`` folder, installed as ``hf_triaccel.kernels``."""
    into.mkdir(parents=True)
    if Path(commit).is_file():
        archive = Path(commit).read_bytes()
    else:
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "ls-tree", "--name-only", commit],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        folders = ["hf_triaccel"] + (["kernels"] if "kernels" in listed else [])
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit, *folders],
            check=True,
            capture_output=True,
        ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    if (into / "kernels").is_dir():
        (into / "kernels").rename(into / "hf_triaccel" / "kernels")
    return into


def measure(smoke: bool) -> list[dict]:
    """Times the variants with whichever package is first on the path (run in a child)."""
    import time

    import timm
    import torch
    import torch.nn.functional as F
    from torch import nn

    import hf_triaccel
    from hf_triaccel import AdaFisherW

    if not Path(hf_triaccel.__file__).is_relative_to(os.environ["PYTHONPATH"]):
        raise RuntimeError(f"timed {hf_triaccel.__file__}, not the commit's package")
    device = "cpu" if smoke else "cuda"
    batch, size, steps, warmup = (2, 16, 1, 0) if smoke else (512, 32, 20, 5)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)

    def median_ms(fn) -> float:
        for _ in range(warmup):
            fn()
        sync()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return 1e3 * sorted(times)[len(times) // 2]

    def variant(name: str, update_every: int) -> dict:
        if smoke:  # timm's smallest ResNet: the same code paths, in seconds on a CPU
            model = timm.create_model("test_resnet", num_classes=10)
        else:
            model = timm.create_model("resnet18", num_classes=10)
            model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
            model.maxpool = nn.Identity()
        model = model.to(device, memory_format=torch.channels_last)
        if name == "adamw":
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        else:
            # a CPU interprets Triton's kernels: the portable update, in smoke runs
            impl = {"impl": "foreach"} if smoke else {}
            optimizer = AdaFisherW.from_model(model, lr=1e-3, update_every=update_every, **impl)

        def backward() -> None:
            with torch.autocast(device, torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()

        def train_step() -> None:
            optimizer.zero_grad(set_to_none=True)
            backward()
            optimizer.step()

        train_ms = median_ms(train_step)
        backward()  # gradients (and statistics) for the optimizer step alone
        return {
            "optimizer": name,
            "update_every": update_every,
            "train_step_ms": train_ms,
            "optimizer_step_ms": median_ms(optimizer.step),
        }

    return [variant(name, update_every) for name, update_every in VARIANTS]


def summary(records: list[dict]) -> str:
    """Per commit and variant, the median over rounds of the training step, and of its
    ratio to AdamW's step in the same process (the host's speed drifts between them)."""
    adamw = {
        (r["commit"], r["round"]): r["train_step_ms"] for r in records if r["optimizer"] == "adamw"
    }
    rows: dict[tuple, list[tuple[float, float]]] = {}
    for r in records:
        ratio = r["train_step_ms"] / adamw[r["commit"], r["round"]]
        rows.setdefault((r["commit"], r["optimizer"], r["update_every"]), []).append(
            (r["train_step_ms"], ratio)
        )
    lines = ["| commit | optimizer | update_every | train step ms, median | x AdamW, median |"]
    lines.append("|---|---|---|---|---|")
    for (commit, optimizer, every), values in rows.items():
        ms, ratios = zip(*values, strict=True)
        lines.append(
            f"| {commit} | {optimizer} | {every} | {statistics.median(ms):.2f} | "
            f"{statistics.median(ratios):.3f}x |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The commits, the rounds, the output folder."""
    parser.add_argument(
        "commits", nargs="+", metavar="COMMIT", help="OLD NEW [MORE...]: revisions or archives"
    )
    parser.add_argument("--rounds", type=int, default=2, help="turns of every commit")
    parser.add_argument("--out", help="results directory (default: $OUT, else the current one)")
    parser.add_argument("--records", type=Path, help="JSON-lines file of the run's record")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")


def run(args: argparse.Namespace) -> int:
    """Times every commit's package in turn, in processes of their own; returns 1 when
    one failed."""
    from benchmarks import harness  # not in a timed process: it imports this package

    if len(args.commits) < 2:
        raise SystemExit("error: give at least two commits")
    args.device = torch.device("cpu" if args.smoke else "cuda")
    rows = []
    out = harness.out_dir(args)
    print("| commit | optimizer | update_every | train step ms | optimizer step ms |")
    print("|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        trees = {c: assemble(c, Path(scratch) / str(i)) for i, c in enumerate(args.commits)}
        for round_ in range(args.rounds):
            for commit, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": str(tree)}
                # the file itself, not the package: the commit's hf_triaccel comes first
                command = [sys.executable, __file__, "--smoke"] if args.smoke else []
                command = command or [sys.executable, __file__]
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode:
                    print(done.stderr, file=sys.stderr)
                    return 1
                for row in json.loads(done.stdout.strip().splitlines()[-1]):
                    rows.append({"commit": commit, "round": round_, **row})
                    print(
                        f"| {commit} | {row['optimizer']} | {row['update_every']} | "
                        f"{row['train_step_ms']:.2f} | {row['optimizer_step_ms']:.3f} |",
                        flush=True,
                    )
                # written after every process, so that a run cut short keeps its rounds
                (out / "commits_rounds.json").write_text(json.dumps(rows, indent=1))
    harness.finish(NAME, args, {"results": rows}, summary(rows))
    return 0


if __name__ == "__main__":  # one timed process, its package first on PYTHONPATH
    print(json.dumps(measure("--smoke" in sys.argv[1:])))
