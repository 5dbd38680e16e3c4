"""The precision report of a run with adaptive precision: the precision map (PNG) and the
last signals (JSON).

matplotlib is optional: a run with ``triaccel_precision`` checks for it when training
starts (a warning names what to install) and skips the map without it, so nothing fails
once training is over.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_triaccel.curvature.signals import SignalTracker
from hf_triaccel.integrations.trainer_args import setting
from hf_triaccel.precision import PrecisionController, plot_precision_map

PRECISION_MAP_NAME = "precision_map.png"
SIGNALS_NAME = "signals.json"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_precision_report(
    folder: str | os.PathLike,
    precision: PrecisionController,
    signals: SignalTracker | None,
    last_step: int,
) -> None:
    """The precision map (PNG; skipped with a warning without matplotlib) and the last
    signals (JSON) in ``folder``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if not _has_matplotlib():
        warnings.warn(
            f"{PRECISION_MAP_NAME} skipped: matplotlib is not installed "
            "(pip install 'hf-triaccel[hf]')",
            stacklevel=2,
        )
    else:
        plot_precision_map(precision.events, out / PRECISION_MAP_NAME, last_step=last_step)
    if signals is not None:
        (out / SIGNALS_NAME).write_text(json.dumps(signals.as_dict(), indent=2))


class PrecisionReport(TrainerCallback):
    """Checks for matplotlib when training starts; writes the precision report of the
    ``trainer``'s controllers to ``triaccel_report_dir`` (when set) when it ends."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and not _has_matplotlib():
            warnings.warn(
                "triaccel_precision: matplotlib is not installed, so the precision map "
                f"({PRECISION_MAP_NAME}) will be skipped; install it with "
                "pip install 'hf-triaccel[hf]'",
                stacklevel=2,
            )

    def on_train_end(self, args, state, control, **kwargs):
        folder = setting(args, "triaccel_report_dir")
        trainer = self.trainer
        if folder is None or not state.is_world_process_zero or trainer.precision is None:
            return
        write_precision_report(folder, trainer.precision, trainer.signals, state.global_step)
