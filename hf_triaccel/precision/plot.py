"""The precision map over training steps, rendered from a controller's event log."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hf_triaccel.precision.controller import PrecisionEvent

COLOURS = {"fp32": "#1f5fbf", "bf16": "#2ca02c", "fp16": "#ff8c1a", None: "#d9d9d9"}
LABELS = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", None: "surrounding autocast"}


def _segments(
    events: Sequence[PrecisionEvent], end: float
) -> dict[str, list[tuple[float, float, str | None]]]:
    """Per module, its (start, stop, precision) intervals; ``None`` before its first event."""
    state: dict[str, tuple[float, str | None]] = {}
    out: dict[str, list[tuple[float, float, str | None]]] = {}
    for e in sorted(events, key=lambda e: e.step):  # stable: same-step events keep their order
        start, precision = state.get(e.module, (0.0, None))
        out.setdefault(e.module, [])
        if e.step > start:
            out[e.module].append((start, float(e.step), precision))
        state[e.module] = (float(max(e.step, start)), e.new)
    for name, (start, precision) in state.items():
        if end > start:
            out[name].append((start, end, precision))
    return out


def plot_precision_map(
    events: Iterable[PrecisionEvent | Mapping[str, Any]],
    path: str | os.PathLike,
    *,
    last_step: int | None = None,
    title: str = "Compute precision per module",
) -> str:
    """Draws each module's compute precision over the steps as a PNG.

    One row per module (in order of first event), coloured by precision, from step 0 to
    ``last_step`` (default: a little after the last event). Needs matplotlib, imported
    here; drawn with the Agg canvas, so no display and no global backend change.

    Args:
        events: :attr:`PrecisionController.events`, or their dicts from ``state_dict()``.
        path: the PNG file to write.
        last_step: the step the map ends at.
        title: the figure title.

    Returns:
        ``path`` as a string.

    Example:
        >>> events = [PrecisionEvent(0, "norm", None, "fp32", "norm"),
        ...           PrecisionEvent(200, "fc", None, "bf16", "initial")]
        >>> plot_precision_map(events, "precision.png", last_step=400)  # doctest: +SKIP
        'precision.png'
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    evs = [e if isinstance(e, PrecisionEvent) else PrecisionEvent(**e) for e in events]
    if not evs:
        raise ValueError("no precision events to plot")
    last_event = max(e.step for e in evs)
    end = float(last_step if last_step is not None else last_event + max(1, last_event // 10))
    if end <= last_event:
        end = last_event + 1.0
    segments = _segments(evs, end)
    names = list(segments)
    fig = Figure(figsize=(10, 1.5 + 0.25 * len(names)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for row, name in enumerate(names):
        for precision in COLOURS:
            bars = [(a, b - a) for a, b, p in segments[name] if p == precision]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLOURS[precision])
    ax.set_yticks(range(len(names)), [n or "(root)" for n in names], fontsize=7)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.set_xlabel("optimizer step")
    ax.set_title(title)
    used = {p for segs in segments.values() for *_, p in segs}
    ax.legend(
        handles=[Patch(color=COLOURS[p], label=LABELS[p]) for p in COLOURS if p in used],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    return os.fspath(path)
