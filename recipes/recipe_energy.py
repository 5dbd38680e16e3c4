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

import torch
from transformers import TrainerCallback

INTERVAL_S = 0.1


class EnergyMeter(TrainerCallback):
    """Integrates the GPU's power readings between ``on_train_begin`` and ``on_train_end``.

    Attributes:
        joules: the energy of the last run, ``None`` without a power reading.
        readings: how many power readings it integrated.
    """

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.joules: float | None = None
        self.readings = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
        last_time, last_watts = time.perf_counter(), torch.cuda.power_draw(device) / 1e3
        joules, readings, stopped = 0.0, 1, False
        while not stopped:  # one more reading once stopped: the run's last interval
            stopped = self._stop.wait(self.interval_s)
            now, watts = time.perf_counter(), torch.cuda.power_draw(device) / 1e3
            joules += 0.5 * (watts + last_watts) * (now - last_time)
            last_time, last_watts, readings = now, watts, readings + 1
        self.joules, self.readings = joules, readings

    def on_train_begin(self, args, state, control, **kwargs):
        self.joules, self.readings = None, 0
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
