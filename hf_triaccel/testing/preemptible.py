"""A tiny training job to stop and restart: the subject of the preemption tests and of
the chaos benchmark (``benchmarks/chaos.py``).

``python -m hf_triaccel.testing.preemptible --output_dir D --config adafisherw`` trains a
two-layer network on a fixed synthetic set with ``TriAccelTrainer`` (or, with
``--trainer stock``, the stock ``transformers.Trainer`` with ``enable_jit_checkpoint``),
checkpoints every ``--save_steps``, evaluates every ``--eval_steps``, and resumes by
itself: the same command starts the run or continues it. The network counts in a buffer
how often each sample was trained on, so the saved state says whether every sample was
seen as often as in an uninterrupted run. When training ends it writes ``final.pt``
(the model's and the optimizer's state); each rank that stopped on a signal writes
``stop-<rank>.json``: the step it stopped at, and what it was doing when the signal came.

Under several processes (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` in
the environment) it trains with DDP over gloo; each rank writes its process id to
``pid-<rank>``.

Example:
    >>> sorted(CONFIGS)
    ['accumulation', 'adafisherw', 'adamw', 'adamw_accumulation', 'elastic', 'workers']
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing
import os
import sys
import time
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_triaccel.integrations.checkpoints import RESUME_OR_START
from hf_triaccel.integrations.preemption import EXIT_PREEMPTED
from hf_triaccel.integrations.trainer import TriAccelArguments, TriAccelTrainer

CONFIGS: dict[str, dict[str, Any]] = {
    "adafisherw": {"optim": "adafisherw"},
    "adamw": {"optim": "adamw_torch"},
    "accumulation": {"optim": "adafisherw", "gradient_accumulation_steps": 3},
    "adamw_accumulation": {"optim": "adamw_torch", "gradient_accumulation_steps": 3},
    "elastic": {"optim": "adafisherw", "elastic_batch": True},
    "workers": {"optim": "adamw_torch", "dataloader_num_workers": 2},
}
"""The configurations: ``TrainingArguments`` fields over the job's defaults."""

SAMPLES, FEATURES, CLASSES = 192, 8, 4


class IndexedSamples(torch.utils.data.Dataset):
    """A fixed synthetic classification set whose items carry their index."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, FEATURES, generator=generator)
        self.y = torch.randint(0, CLASSES, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i], "idx": torch.tensor(i)}


class CountingNet(nn.Module):
    """Two linear layers; in training mode ``seen[i]`` counts the passes over sample ``i``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))
        self.register_buffer("seen", torch.zeros(SAMPLES, dtype=torch.int64))

    def forward(self, x: torch.Tensor, labels: torch.Tensor, idx: torch.Tensor) -> dict:
        logits = self.body(x)
        if self.training:
            self.seen.index_add_(0, idx, torch.ones_like(idx))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Moments(TrainerCallback):
    """What the job is doing, with the time each activity began (``time.monotonic``)."""

    def __init__(self) -> None:
        self.timeline: list[tuple[float, str]] = [(time.monotonic(), "before training")]

    def _enter(self, what: str) -> None:
        if self.timeline[-1][1] != what:
            self.timeline.append((time.monotonic(), what))

    def on_step_begin(self, args, state, control, **kwargs):
        self._enter("step")

    def on_substep_end(self, args, state, control, **kwargs):
        self._enter("accumulation")

    def on_step_end(self, args, state, control, **kwargs):
        self._enter("save" if control.should_save else "data loading")

    def on_prediction_step(self, args, state, control, **kwargs):
        self._enter("evaluation")

    def on_save(self, args, state, control, **kwargs):
        self._enter("data loading")

    def at(self, moment: float) -> str:
        """The activity at ``moment``."""
        return [what for began, what in self.timeline if began <= moment][-1]


def _slow(cls: type, seconds: float, from_step: int) -> type:
    """``cls`` whose checkpoints from step ``from_step`` on take ``seconds`` longer, the wait
    between the weights and the optimizer's state (as a large model's save takes time)."""

    class SlowSaves(cls):
        def save_model(self, output_dir=None, _internal_call=False):
            super().save_model(output_dir, _internal_call)
            if _internal_call and self.state.global_step >= from_step:
                time.sleep(seconds)

    return SlowSaves


def build_trainer(options: argparse.Namespace) -> tuple[Trainer, Moments, Any]:
    """The job's trainer, its :class:`Moments` and its handler (``None`` for stock)."""
    torch.manual_seed(0)
    model = CountingNet()
    common = dict(
        output_dir=options.output_dir,
        num_train_epochs=options.epochs,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=16,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=options.save_steps,
        save_total_limit=options.save_total_limit,
        eval_strategy="steps",
        eval_steps=options.eval_steps,
        logging_steps=5,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_persistent_workers=False,
        **CONFIGS[options.config],
    )
    moments = Moments()
    if options.trainer == "stock":
        if common["optim"] == "adafisherw" or common.pop("elastic_batch", False):
            raise SystemExit(f"--trainer stock: configuration {options.config} is ours only")
        args = TrainingArguments(**common, enable_jit_checkpoint=True)
        cls = Trainer
    else:
        args = TriAccelArguments(**common, preemption_signals=options.signals)
        cls = TriAccelTrainer
    if options.slow_save:
        cls = _slow(cls, options.slow_save, options.slow_save_from)
    trainer = cls(
        model=model,
        args=args,
        train_dataset=IndexedSamples(SAMPLES, seed=1),
        eval_dataset=IndexedSamples(32, seed=2),
    )
    trainer.add_callback(moments)
    return trainer, moments, getattr(trainer, "preemption", None)


def stock_resume(output_dir: str) -> bool | None:
    """What a stock Trainer user's job script passes: ``True`` when a checkpoint folder
    exists (transformers then takes the newest folder), else ``None``."""
    if not os.path.isdir(output_dir):
        return None
    return True if any(n.startswith("checkpoint-") for n in os.listdir(output_dir)) else None


def final_state(trainer: Trainer) -> dict[str, Any]:
    """The model's and the optimizer's state, on the CPU."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    optimizer = trainer.optimizer
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def main(argv: list[str] | None = None) -> None:
    """Runs the job (flags: ``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="adafisherw")
    parser.add_argument("--trainer", choices=["triaccel", "stock"], default="triaccel")
    parser.add_argument("--signals", default="SIGTERM")
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--save_steps", type=int, default=10)
    parser.add_argument("--eval_steps", type=int, default=15)
    parser.add_argument("--save_total_limit", type=int, default=None)
    parser.add_argument("--slow_save", type=float, default=0.0, help="seconds added per save")
    parser.add_argument("--slow_save_from", type=int, default=0, help="from this step on")
    options = parser.parse_args(argv)
    os.makedirs(options.output_dir, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(options.output_dir, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    trainer, moments, handler = build_trainer(options)
    resume = stock_resume(options.output_dir) if options.trainer == "stock" else RESUME_OR_START
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        if handler is not None and (handler.stopped_at is not None or handler.watch.received):
            caught = handler.watch.received_at
            record = {
                "moment": None if caught is None else moments.at(caught),
                "stopped_at": handler.stopped_at,
                "agreements": handler.agreements,
                "agreement_seconds": handler.agreement_seconds,
            }
            with open(os.path.join(options.output_dir, f"stop-{rank}.json"), "w") as f:
                json.dump(record, f)
    if trainer.state.global_step < trainer.state.max_steps:
        sys.exit(EXIT_PREEMPTED)  # stopped early (the stock Trainer's stop returns)
    if trainer.args.process_index == 0:
        torch.save(final_state(trainer), os.path.join(options.output_dir, "final.pt"))


def _child(argv: list[str], env: dict[str, str], log: str) -> None:
    os.setsid()  # a process group of its own, as a scheduler's job step has
    # A fork copies the parent's intra-op thread pool without its threads: once the parent
    # has run a parallel torch operation, the child's first one waits on them forever.
    # One thread runs every operation inline (the reference run is launched alike).
    torch.set_num_threads(1)
    os.environ.update(env)
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True)
    main(argv)


def launch(argv: list[str], env: dict[str, str] | None = None) -> multiprocessing.Process:
    """Starts the job in a forked process (torch and transformers already imported, so it
    starts in well under a second), in a process group of its own; its output goes to
    ``job.log`` in the output folder."""
    out = argv[argv.index("--output_dir") + 1]
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, f"job-{(env or {}).get('RANK', '0')}.log")
    process = multiprocessing.get_context("fork").Process(
        target=_child, args=(argv, env or {}, log)
    )
    process.start()
    return process


def send(process: multiprocessing.Process, signum: int, group: bool = False) -> None:
    """Sends ``signum`` to the job, or to its whole process group (its DataLoader workers
    too); nothing when it has already ended."""
    try:
        if group:
            os.killpg(process.pid, signum)
            return
    except ProcessLookupError:
        pass  # no group yet (the job has not reached setsid): the job alone
    with contextlib.suppress(ProcessLookupError):  # it has ended
        os.kill(process.pid, signum)


def ddp_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of rank ``rank`` of a DDP job on this host."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_ranks(argv: list[str], world_size: int, port: int) -> list[multiprocessing.Process]:
    """Starts ``world_size`` ranks of the job (one process without DDP for 1)."""
    if world_size == 1:
        return [launch(argv)]
    return [launch(argv, ddp_env(rank, world_size, port)) for rank in range(world_size)]


def same_state(a: Any, b: Any) -> bool:
    """Whether two saved states are equal, tensors bit for bit (dtype and shape too)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def load_final(output_dir: str) -> dict[str, Any] | None:
    """The job's ``final.pt``, or ``None`` when it did not finish."""
    path = os.path.join(output_dir, "final.pt")
    return torch.load(path, weights_only=False) if os.path.isfile(path) else None


def stops(output_dir: str) -> list[dict[str, Any]]:
    """Every rank's ``stop-<rank>.json`` of the last launch, by rank."""
    found = []
    for name in sorted(os.listdir(output_dir)):
        if name.startswith("stop-") and name.endswith(".json"):
            with open(os.path.join(output_dir, name)) as f:
                found.append(json.load(f))
    return found


def clear_stops(output_dir: str) -> None:
    """Removes the last launch's ``stop-<rank>.json``."""
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        if name.startswith("stop-"):
            os.remove(os.path.join(output_dir, name))


if __name__ == "__main__":
    main()
