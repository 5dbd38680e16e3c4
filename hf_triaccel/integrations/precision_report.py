"""The precision report of a run with adaptive precision: the precision map (PNG) and the
last signals (JSON).

matplotlib is optional: a run with adaptive precision checks for it when training starts
(:class:`~hf_triaccel.integrations.callback.TriAccelCallback`; a warning names what to
install) and skips the map without it, so nothing fails once training is over.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from hf_triaccel.curvature.signals import SignalTracker
from hf_triaccel.precision import PrecisionController, plot_precision_map

PRECISION_MAP_NAME = "precision_map.png"
SIGNALS_NAME = "signals.json"


def has_matplotlib() -> bool:
    """Whether matplotlib imports (the precision map needs it)."""
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
    if not has_matplotlib():
        warnings.warn(
            f"{PRECISION_MAP_NAME} skipped: matplotlib is not installed "
            "(pip install 'hf-triaccel[hf]')",
            stacklevel=2,
        )
    else:
        plot_precision_map(precision.events, out / PRECISION_MAP_NAME, last_step=last_step)
    if signals is not None:
        (out / SIGNALS_NAME).write_text(json.dumps(signals.as_dict(), indent=2))
