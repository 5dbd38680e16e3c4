"""Efficiency telemetry for the Trainer: step time, samples/s, peak memory, and a
JSON efficiency report.

The window metrics join each training log as it goes to the callbacks that report it
(console, TensorBoard, W&B, ...), but not ``TrainerState.log_history``: timings differ
between a run and its resumption, and the log history is what checkpoints keep and
resume tests compare. The report is written where transformers' tooling does not look:
a folder chosen for it, or beside the model that ``save_model`` writes."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback

REPORT_NAME = "efficiency_report.json"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Device name and package versions, for reports and benchmarks."""
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name()
        if cuda
        else f"cpu ({platform.processor() or 'unknown'})",
        "versions": {
            name: _version(name)
            for name in ("hf-triaccel", "torch", "triton", "transformers", "accelerate", "timm")
        },
        "python": platform.python_version(),
    }


class EfficiencyTelemetry(TrainerCallback):
    """Measures training efficiency without synchronising the device every step.

    Step time is wall time over a logging window divided by its optimizer steps: the
    host runs ahead of the device by a bounded queue, so over a window this is the
    device's pace. ``extra`` providers (precision map, micro-batch size...) add their
    own entries to every log and to the report.

    To reach the reporting callbacks, it must be the first callback of the trainer's
    handler (``TriAccelTrainer`` puts it there).

    Example:
        >>> telemetry = EfficiencyTelemetry()
        >>> telemetry.add_provider(lambda: {"micro_batch": 128})
    """

    def __init__(self) -> None:
        self._providers: dict[str, Callable[[], dict[str, Any]]] = {}
        self._train_start = 0.0
        self._window_start = 0.0
        self._window_steps = 0
        self._steps = 0
        self._samples_per_step = 0

    def add_provider(self, provider: Callable[[], dict[str, Any]], name: str | None = None) -> None:
        """Adds a callable whose dict is merged into every training log and the report;
        a provider added under the ``name`` of an earlier one replaces it."""
        self._providers[name or f"provider-{len(self._providers)}"] = provider

    def on_train_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        # the Trainer's batch: auto_find_batch_size may have made it smaller than the arguments'
        batch = state.train_batch_size or args.per_device_train_batch_size
        self._samples_per_step = batch * args.gradient_accumulation_steps * args.world_size
        self._train_start = self._window_start = time.perf_counter()
        self._window_steps = self._steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self._window_steps += 1
        self._steps += 1

    def window_metrics(self) -> dict[str, Any]:
        """Metrics since the previous call (one logging window), then starts a new window."""
        now = time.perf_counter()
        elapsed = now - self._window_start
        metrics: dict[str, Any] = {}
        if self._window_steps:
            metrics["step_time_ms"] = round(1e3 * elapsed / self._window_steps, 3)
            metrics["samples_per_second"] = round(
                self._window_steps * self._samples_per_step / elapsed, 2
            )
        metrics.update(self._memory())
        for provider in self._providers.values():
            metrics.update(provider())
        self._window_start, self._window_steps = now, 0
        return metrics

    @staticmethod
    def _memory() -> dict[str, float]:
        if not torch.cuda.is_available():
            return {}
        return {"peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 3)}

    def report(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole run's totals, device and versions."""
        runtime = time.perf_counter() - self._train_start
        samples = self._steps * self._samples_per_step
        out: dict[str, Any] = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **environment(),
            "train_runtime_s": round(runtime, 3),
            "optimizer_steps": self._steps,
            "samples": samples,
            "samples_per_second": round(samples / runtime, 2) if runtime > 0 else None,
            "step_time_ms": round(1e3 * runtime / self._steps, 3) if self._steps else None,
            **self._memory(),
        }
        for provider in self._providers.values():
            out.update(provider())
        out.update(extra or {})
        return out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs:  # a training log, not an evaluation one
            logs.update(self.window_metrics())

    def write_report(self, folder: str | os.PathLike) -> str:
        """Writes :meth:`report` to ``folder/efficiency_report.json``; returns the path."""
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, REPORT_NAME)
        with open(path, "w") as f:
            json.dump(self.report(), f, indent=2)
        return path

    def on_train_end(self, args, state, control, **kwargs):
        folder = getattr(args, "triaccel_report_dir", None)
        if folder is not None and state.is_world_process_zero:
            self.write_report(folder)
