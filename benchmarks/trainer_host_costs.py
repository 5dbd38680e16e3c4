"""Host microseconds of each thing a Trainer step does, next to the hand-written loop's.

A CIFAR ResNet-18 step at batch 512 is bound by the host (the GPU waits for launches),
so every microsecond of Python a Trainer step adds is a microsecond of wall time. This
times, on the process's own host, the pieces of ``TriAccelTrainer``'s step with
AdamW(fused) that the loop of ``bench_trainer.py`` does not run or runs otherwise: the
``model.train()`` the Trainer calls every step, Accelerate's ``unwrap_model`` (which
``TriAccelTrainer``'s loss path called every step and now keeps per model), its
``is_lomo_available`` check (twice in each ``AcceleratedOptimizer.step``), the module's
``zero_grad`` against the optimizer's, Accelerate's gradient clipping against torch's,
the wrapped optimizer step and scheduler, the callbacks of a step, and the Trainer's data
loader against the loop's. Launching pieces are timed for their host time only: the
device is synchronised before and after each timed block, never inside it.

Usage:
    python benchmarks/trainer_host_costs.py --data /path/to/cifar10 --out "$OUT"
    python benchmarks/trainer_host_costs.py --smoke --out /tmp/costs    # CPU, seconds
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import accelerate.optimizer
import bench_trainer as bench
import harness
import torch

from hf_triaccel.integrations.trainer import TriAccelArguments, TriAccelTrainer

OPTIONS = {
    "batch_size": bench.OPTIONS["batch_size"],
    "repeats": (int, 3, 5, "timed blocks of each piece; the table gives the best and median"),
}


def timer(device: torch.device, repeats: int) -> Callable[..., dict[str, float]]:
    """``time(fn, calls, setup)``: microseconds per call of ``fn`` over ``repeats`` blocks
    of ``calls`` calls (``setup`` before each block, untimed), the best and the median."""

    def time_it(fn: Callable[[], Any], calls: int, setup: Callable[[], Any] | None = None):
        blocks = []
        for _ in range(repeats):
            if setup is not None:
                setup()
            harness.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            blocks.append(1e6 * (time.perf_counter() - start) / calls)
            harness.synchronize(device)
        blocks.sort()
        return {"best_us": blocks[0], "median_us": blocks[len(blocks) // 2]}

    return time_it


def measure(args: Any, data: Any) -> list[dict[str, Any]]:
    """Builds the Trainer (three steps trained, so that everything is set up) and times
    each piece; returns the rows."""
    device = args.device
    model = harness.build_model(bench.MODEL, args.size, num_classes=data.num_classes)
    clock = harness.StepClock(device, warmup=1, steps=2)
    trainer = harness.train(
        TriAccelTrainer,
        TriAccelArguments,
        model,
        data,
        clock,
        optim="adamw_torch_fused",
        learning_rate=1e-3,
        per_device_train_batch_size=args.batch_size,
        max_steps=3,
        bf16=args.bf16,
        device_data_augment=True,
        eval_strategy="no",
        logging_strategy="no",
        triaccel_channels_last=True,
        max_grad_norm=1.0,
        label_smoothing_factor=bench.LABEL_SMOOTHING,
    )
    model, parameters = trainer.model, list(trainer.model.parameters())

    def set_gradients() -> None:
        for p in parameters:
            p.grad = torch.zeros_like(p)

    time_it = timer(device, args.repeats)
    handler, state = trainer.callback_handler, (trainer.args, trainer.state, trainer.control)
    loader = harness.endless(trainer.get_train_dataloader())
    batches = harness.endless(harness.image_batches(data, args.batch_size, channels_last=True))
    pieces: list[tuple[str, str, Callable[[], Any], int, Callable[[], Any] | None]] = [
        ("Trainer", "model.train()", model.train, 200, None),
        (
            "Trainer",
            "accelerator.unwrap_model(model), once a step before the loss path kept it",
            lambda: trainer.accelerator.unwrap_model(model, keep_torch_compile=False),
            200,
            None,
        ),
        ("Trainer", "is_lomo_available()", accelerate.optimizer.is_lomo_available, 200, None),
        ("Trainer", "model.zero_grad()", model.zero_grad, 1, set_gradients),
        ("loop", "optimizer.zero_grad()", trainer.optimizer.optimizer.zero_grad, 1, set_gradients),
        (
            "Trainer",
            "accelerator.clip_grad_norm_",
            lambda: trainer.accelerator.clip_grad_norm_(model.parameters(), 1.0),
            50,
            set_gradients,
        ),
        (
            "loop",
            "torch.nn.utils.clip_grad_norm_",
            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
            50,
            set_gradients,
        ),
        ("Trainer", "AcceleratedOptimizer.step()", trainer.optimizer.step, 50, set_gradients),
        ("loop", "AdamW(fused).step()", trainer.optimizer.optimizer.step, 50, set_gradients),
        ("Trainer", "AcceleratedScheduler.step()", trainer.lr_scheduler.step, 50, None),
        (
            "Trainer",
            "callbacks of a step",
            lambda: (handler.on_step_begin(*state), handler.on_step_end(*state)),
            200,
            None,
        ),
        ("Trainer", "data loader: next batch", lambda: next(loader), 20, None),
        ("loop", "GPUBatchLoader: next batch", lambda: next(batches), 20, None),
    ]
    rows = []
    for runner, piece, fn, calls, setup in pieces:
        rows.append({"runner": runner, "piece": piece, "calls": calls, **time_it(fn, calls, setup)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Times the pieces; writes trainer_host_costs.json / .md."""
    parser = harness.base_parser(__doc__.split("\n\n")[0], OPTIONS, impls=False)
    parser.add_argument("--data", default="embedded", help="'embedded' or a parquet folder")
    args = harness.parse(parser, argv)
    args.bf16 = args.device.type == "cuda"
    data = harness.load_images(args.data, "train", smoke=args.smoke, n=4 * args.batch_size)
    data = data.to(args.device)
    rows = measure(args, data)
    columns = {
        "runner": lambda r: r["runner"],
        "piece": lambda r: r["piece"],
        "calls a block": lambda r: r["calls"],
        "best us": lambda r: harness.fmt(r["best_us"], ".1f"),
        "median us": lambda r: harness.fmt(r["median_us"], ".1f"),
    }
    config = {"model": bench.MODEL, "autocast": args.bf16, "layout": "channels_last"}
    payload = {"config": config, "results": rows}
    harness.finish("trainer_host_costs", __file__, args, payload, harness.table(rows, columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
