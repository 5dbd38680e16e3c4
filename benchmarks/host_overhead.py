"""Host-side cost of AdaFisher: the Fisher-refresh path and the optimizer step.

Both figures are host work, which bounds a step whenever the device waits for it:

- training step: torch operators (``aten::`` events of ``torch.profiler``, nested ones
  included), Triton launches and host time (``time.perf_counter`` from an idle device,
  no synchronisation inside the step) per training step of the CIFAR ResNet-18
  (``resnet18_cifar``, bf16 autocast): AdamW(fused=True), then AdaFisherW refreshing
  its Fisher factors on every step and on none; the refresh's cost is the difference
  of the last two rows.
- optimizer step: host time of ``opt.step()`` on ResNet-18 (62 tensors) and ViT-B/16
  (152 tensors), AdaFisherW (``impl="triton"``, a step that does not refresh the
  factors) and AdamW(fused=True), with the gradients left in place from step to step
  as in ``benchmarks/bench_optimizer.py``.

On a CPU the Triton kernels would run in Triton's interpreter, whose Python cost would
swamp every figure, so each launch is replaced by a stub that only counts it
(``--stub-kernels``, the default without CUDA): what remains is the host work a GPU run
does around its launches, plus, on a CPU, the execution of the few torch operators
left (a CPU runs them synchronously), and of AdamW's whole update: on a CPU, compare
operator counts and AdaFisher rows, not AdamW's times. The models are also shrunk on a
CPU, with the module structure (tensors, hooks) kept; ``--full-size`` keeps the widths.

Usage:
    python benchmarks/host_overhead.py --out "$OUT"          # CUDA: real kernels
    python benchmarks/host_overhead.py --out /tmp/host         # CPU: stubbed kernels
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():  # before Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import (  # noqa: E402
    LR,
    WEIGHT_DECAY,
    base_parser,
    environment,
    fmt,
    markdown_table,
    out_dir,
    resolve_device,
    synchronize,
    write_results,
)
from torch import nn  # noqa: E402

from hf_triaccel import AdaFisherW  # noqa: E402

NEVER = 10**9


class LaunchCounter:
    """Counts (and, with ``stub``, skips) the launches of the package's Triton kernels."""

    def __init__(self, stub: bool) -> None:
        from triton.runtime.jit import KernelInterface

        from hf_triaccel.kernels import stats, update

        self.count = 0
        self._patched = []
        for module in (stats, update):
            for kernel in vars(module).values():
                if isinstance(kernel, KernelInterface):
                    self._patch(kernel, stub)

    def _patch(self, kernel: Any, stub: bool) -> None:
        run = kernel.run

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return None if stub else run(*args, **kwargs)

        kernel.run = counted  # ``kernel[grid](...)`` calls ``kernel.run``
        self._patched.append(kernel)

    def restore(self) -> None:
        for kernel in self._patched:
            del kernel.run
        self._patched.clear()


def resnet18(tiny: bool) -> nn.Module:
    """The CIFAR ResNet-18 (41 hooked layers, 62 tensors); ``tiny``: 64 channels
    throughout (the stem has 64 whatever the width, so the first stage keeps it)."""
    from hf_triaccel.integrations.timm_models import create_cifar_model

    size = dict(channels=(64, 64, 64, 64)) if tiny else {}
    return create_cifar_model("resnet18_cifar", num_classes=10, **size)


def vit_b16(tiny: bool) -> nn.Module:
    """ViT-B/16 (152 tensors); ``tiny``: width 32 on 32x32 images, same depth."""
    import timm

    size = dict(img_size=32, patch_size=8, embed_dim=32, num_heads=2) if tiny else {}
    return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=10, **size)


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """``"adamw"``, or AdaFisherW refreshing on every step (``"refresh"``) or never."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    every = 1 if kind == "refresh" else NEVER
    return AdaFisherW.from_model(
        model, impl="triton", update_every=every, lr=LR, weight_decay=WEIGHT_DECAY
    )


def count_aten_ops(fn: Callable[[], Any]) -> int:
    """``aten::`` operator calls made by one call of ``fn`` (nested calls included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def host_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Host time of one call of ``fn`` in milliseconds: the device is idle when the call
    starts and is not waited for inside it, so that the figure is the host's own time
    (a device with work queued could make the host wait for a free launch slot)."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure_training_step(
    args: Any, device: torch.device, counter: LaunchCounter
) -> dict[str, dict[str, Any]]:
    """Operators, launches and host time per training step, for each optimizer."""
    torch.manual_seed(0)
    base = resnet18(args.tiny).to(device).train()
    x = torch.randn(args.batch_size, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    rows: dict[str, dict[str, Any]] = {}
    steps: dict[str, Callable[[], None]] = {}
    for kind in ("adamw", "refresh", "no_refresh"):
        model = copy.deepcopy(base)
        opt = make_optimizer(model, kind)

        def step(model=model, opt=opt) -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

        for _ in range(3):  # Triton compilation, optimizer state, cached tables and plans
            step()
        if kind != "adamw" and opt.collector.collecting != (kind == "refresh"):
            raise RuntimeError("the refresh schedule is not the one measured")
        synchronize(device)
        before = counter.count
        ops = count_aten_ops(step)
        synchronize(device)
        rows[kind] = {"aten_ops": ops, "launches": counter.count - before, "times": []}
        steps[kind] = step
    # the kinds take turns so that drift of the host's speed hits them alike
    for _ in range(args.reps):
        for kind, step in steps.items():
            rows[kind]["times"].append(host_ms(step, device))
    synchronize(device)
    for row in rows.values():
        row["host_ms"] = float(np.median(row.pop("times")))
    return rows


def measure_optimizer_step(
    name: str,
    build: Callable[[bool], nn.Module],
    args: Any,
    device: torch.device,
    counter: LaunchCounter,
) -> list[dict[str, Any]]:
    """Host time of ``opt.step()`` with the gradients in place, per optimizer."""
    torch.manual_seed(0)
    rows = []
    for kind in ("adamw", "no_refresh"):
        model = build(args.tiny).to(device).train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(model, kind)
        for p in params:
            p.grad = torch.randn_like(p)
        if kind != "adamw":
            opt.collector.collecting = False  # the step alone; refreshes are measured above
        for _ in range(5):
            opt.step()
        synchronize(device)
        before = counter.count
        ops = count_aten_ops(opt.step)
        launches = counter.count - before
        times = [host_ms(opt.step, device) for _ in range(args.step_reps)]
        synchronize(device)
        if kind != "adamw":
            opt.collector.remove()
        rows.append(
            {
                "model": name,
                "optimizer": "AdamW(fused)" if kind == "adamw" else "AdaFisherW(triton)",
                "tensors": len(params),
                "host_us": 1e3 * float(np.median(times)),
                "p20_us": 1e3 * float(np.percentile(times, 20)),
                "aten_ops": ops,
                "launches": launches,
            }
        )
    return rows


def tables(training: dict[str, dict[str, Any]], steps: list[dict[str, Any]], cuda: bool) -> str:
    """The two markdown tables; ratios against AdamW(fused) only where its time is host
    time alone (on CUDA)."""
    labels = {
        "adamw": "AdamW(fused)",
        "refresh": "AdaFisherW, refresh",
        "no_refresh": "AdaFisherW, no refresh",
    }
    adamw_ms = training["adamw"]["host_ms"]
    rows = [
        [
            label,
            str(training[kind]["aten_ops"]),
            str(training[kind]["launches"]),
            fmt(training[kind]["host_ms"]),
            fmt(training[kind]["host_ms"] / adamw_ms, ".2f", "x") if cuda else "n/a",
        ]
        for kind, label in labels.items()
    ]
    refresh, plain = training["refresh"], training["no_refresh"]
    rows.append(
        [
            "refresh - no refresh",
            str(refresh["aten_ops"] - plain["aten_ops"]),
            str(refresh["launches"] - plain["launches"]),
            fmt(refresh["host_ms"] - plain["host_ms"]),
            "",
        ]
    )
    first = markdown_table(
        ["resnet18_cifar training step", "aten ops", "Triton launches", "host ms", "x AdamW"],
        rows,
    )
    adamw_us = {s["model"]: s["host_us"] for s in steps if s["optimizer"] == "AdamW(fused)"}
    second = markdown_table(
        ["model", "optimizer", "tensors", "opt.step() host us", "p20 us", "aten ops", "launches"]
        + ["x AdamW"],
        [
            [
                s["model"],
                s["optimizer"],
                str(s["tensors"]),
                fmt(s["host_us"], ".1f"),
                fmt(s["p20_us"], ".1f"),
                str(s["aten_ops"]),
                str(s["launches"]),
                fmt(s["host_us"] / adamw_us[s["model"]], ".2f", "x") if cuda else "n/a",
            ]
            for s in steps
        ],
    )
    return first + "\n\n" + second


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=None, help="default: 512 (CUDA), 4")
    parser.add_argument("--reps", type=int, default=None, help="timed training steps per row")
    parser.add_argument("--step-reps", type=int, default=None, help="timed optimizer steps")
    parser.add_argument("--full-size", action="store_true", help="real widths on a CPU too")
    parser.add_argument(
        "--stub-kernels",
        default=None,
        action="store_true",
        help="count Triton launches without running them (default: on without CUDA)",
    )
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    args.tiny = not cuda and not args.full_size
    if args.stub_kernels is None:
        args.stub_kernels = not cuda
    args.batch_size = args.batch_size or (512 if cuda else 4)
    args.reps = args.reps or (3 if args.smoke else 40)
    args.step_reps = args.step_reps or (20 if args.smoke else 2000)
    if not cuda:
        # small CPU tensors: waking intra-op threads costs more than the work, and varies
        torch.set_num_threads(1)
    counter = LaunchCounter(stub=args.stub_kernels)
    try:
        training = measure_training_step(args, device, counter)
        steps = measure_optimizer_step("resnet18-cifar", resnet18, args, device, counter)
        steps += measure_optimizer_step("vit-b16", vit_b16, args, device, counter)
    finally:
        counter.restore()
    table = tables(training, steps, cuda)
    payload = {
        "env": environment(__file__, sys.argv[1:] if argv is None else argv, device),
        "config": {
            "batch_size": args.batch_size,
            "tiny": args.tiny,
            "stub_kernels": args.stub_kernels,
            "reps": args.reps,
            "step_reps": args.step_reps,
        },
        "training_step": training,
        "optimizer_step": steps,
    }
    write_results(out_dir(args.out), "host_overhead", payload, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
