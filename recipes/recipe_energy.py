"""GPU energy over a training run, from NVML's energy counter, for the model card's
``co2_eq_emissions``.

NVML counts the energy each GPU has drawn since its driver loaded
(``nvmlDeviceGetTotalEnergyConsumption``, millijoules; Volta and newer). The meter reads
that counter when ``Trainer.train()`` starts and when it ends: two queries, no thread
beside the training steps, and no sampling between power readings to integrate. Each
process measures its own GPU; the recipe sums them. Without a CUDA GPU, ``nvidia-ml-py``
or the counter (a GPU before Volta, a MIG instance) there is no reading, and the card says
so instead of estimating.

Example:
    >>> meter = EnergyMeter()
    >>> meter.on_train_begin(None, None, None)  # no counter here: nothing is read
    >>> meter.joules is None or meter.joules >= 0
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback

# NVML names a full GPU "GPU-<uuid>" and a MIG instance "MIG-<uuid>"; torch gives the bare uuid
_UUID_PREFIXES = ("GPU-", "MIG-")


def energy_counter() -> Callable[[], int] | None:
    """A function returning the millijoules the current CUDA device has drawn since its
    driver loaded, or ``None`` when this process cannot read that counter."""
    if not torch.cuda.is_available():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        for prefix in _UUID_PREFIXES:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(prefix + uuid)
                break
            except pynvml.NVMLError:
                continue
        else:
            return None
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # raises where unsupported
    # ModuleNotFoundError without nvidia-ml-py, NVML's own error types otherwise
    except Exception:
        return None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)


class EnergyMeter(TrainerCallback):
    """The GPU energy between ``on_train_begin`` and ``on_train_end``.

    Attributes:
        joules: the last run's energy on this process's GPU, ``None`` without a reading.
    """

    def __init__(self) -> None:
        self.joules: float | None = None
        self._read: Callable[[], int] | None = None
        self._start_mj = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.joules = None
        self._read = energy_counter()
        if self._read is not None:
            self._start_mj = self._read()

    def on_train_end(self, args, state, control, **kwargs):
        if self._read is not None:
            self.joules = (self._read() - self._start_mj) / 1e3
            self._read = None


def total_energy(trainer: Any, meter: EnergyMeter) -> dict[str, Any] | None:
    """The GPU energy of the run, summed over the processes; ``None`` when a process had
    no reading."""
    joules = meter.joules
    if trainer.args.world_size > 1:
        both = torch.tensor([joules or 0.0, float(joules is None)], device=trainer.args.device)
        both = trainer.accelerator.reduce(both, reduction="sum")
        joules = None if both[1].item() else both[0].item()
    if joules is None:
        return None
    return {"energy_kwh": round(joules / 3.6e6, 6)}
