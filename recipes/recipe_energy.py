"""GPU energy over a training run, from NVML power readings, for the model card's
``co2_eq_emissions``.

A background thread reads the GPU's power draw (``torch.cuda.power_draw``, NVML) every
:data:`INTERVAL_S` seconds while ``Trainer.train()`` runs; the energy is the trapezoid
integral of the readings over time. Each process measures its own GPU; the recipe sums
them. Without a CUDA GPU or NVML (``nvidia-ml-py``) there is no reading, and the card
says so instead of estimating.

Example:
    >>> meter = EnergyMeter()
    >>> meter.available() in (True, False)
    True
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch
from transformers import TrainerCallback

INTERVAL_S = 0.1


class EnergyMeter(TrainerCallback):
    """Integrates the GPU's power readings between ``on_train_begin`` and ``on_train_end``.

    Attributes:
        samples: the last run's ``(seconds, watts)`` readings.
        joules: their integral, ``None`` without a power reading.
    """

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self.joules: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def readings(self) -> int:
        """How many power readings the last run took."""
        return len(self.samples)

    @staticmethod
    def available() -> bool:
        """Whether this process can read its GPU's power draw."""
        if not torch.cuda.is_available():
            return False
        try:
            torch.cuda.power_draw()
        # torch raises ModuleNotFoundError without pynvml, NVML's own error types otherwise
        except Exception:
            return False
        return True

    def _sample(self, device: int) -> None:
        stopped = False
        while True:  # a last reading once stopped: the run's last interval
            self.samples.append((time.perf_counter(), torch.cuda.power_draw(device) / 1e3))
            if stopped:
                return
            stopped = self._stop.wait(self.interval_s)

    def on_train_begin(self, args, state, control, **kwargs):
        self.samples, self.joules = [], None
        if not self.available():
            return
        self._stop.clear()
        device = torch.cuda.current_device()
        self._thread = threading.Thread(target=self._sample, args=(device,), daemon=True)
        self._thread.start()

    def on_train_end(self, args, state, control, **kwargs):
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.joules = integrate(self.samples)


def integrate(samples: Sequence[tuple[float, float]]) -> float:
    """The energy in joules of ``(seconds, watts)`` readings: the trapezoid rule.

    Example:
        >>> integrate([(0.0, 100.0), (0.5, 300.0), (1.5, 300.0)])
        400.0
    """
    return sum(0.5 * (w0 + w1) * (t1 - t0) for (t0, w0), (t1, w1) in pairwise(samples))


def total_energy(trainer: Any, meter: EnergyMeter) -> dict[str, Any] | None:
    """The GPU energy of the run, summed over the processes; ``None`` when a process had
    no power reading."""
    joules = meter.joules
    if trainer.args.world_size > 1:
        both = torch.tensor([joules or 0.0, float(joules is None)], device=trainer.args.device)
        both = trainer.accelerator.reduce(both, reduction="sum")
        joules = None if both[1].item() else both[0].item()
    if joules is None:
        return None
    return {"energy_kwh": round(joules / 3.6e6, 6), "power_readings": meter.readings}
