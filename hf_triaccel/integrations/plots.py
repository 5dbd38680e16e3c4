"""PNG plots of a training run from its log history: loss, accuracy and memory over the
optimizer steps (beside a baseline run when there is one), and the precision map.

A history is the list of log entries a run recorded, each a dict holding ``step`` (the
optimizer step it was logged at: a training log covers the window that ends there, an
evaluation is the model at that step) and the Trainer's log keys: ``loss`` for training
logs, ``eval_loss`` / ``eval_accuracy`` for evaluations, ``peak_memory_gb`` where the
telemetry measured it (CUDA only). Runs with the same schedule line up step for step.
Figures are drawn on matplotlib's Agg canvas, so no display is needed and no global
backend is changed.

Example:
    >>> history = [{"step": 10, "loss": 2.3}, {"step": 20, "loss": 1.9},
    ...            {"step": 20, "eval_loss": 1.8, "eval_accuracy": 0.41}]
    >>> plot_run("out", {"adafisher": history})  # doctest: +SKIP
    {'loss': 'loss.png', 'accuracy': 'accuracy.png'}
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

History = Sequence[Mapping[str, Any]]

PLOT_FILES = {
    "loss": "loss.png",
    "accuracy": "accuracy.png",
    "memory": "memory.png",
    "precision_map": "precision_map.png",
}
_STEP_LABEL = "optimizer step"


def series(history: History, key: str) -> tuple[list[float], list[float]]:
    """The ``(step, value)`` points of ``key`` in a history, in logging order.

    Example:
        >>> series([{"step": 10, "loss": 2.0}, {"step": 20}], "loss")
        ([10], [2.0])
    """
    points = [(e["step"], e[key]) for e in history if e.get(key) is not None]
    return [t for t, _ in points], [v for _, v in points]


def _figure(title: str, ylabel: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(_STEP_LABEL)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, ax, path: Path) -> None:
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_loss(runs: Mapping[str, History], path: Path) -> bool:
    fig, ax = _figure("Loss", "cross-entropy")
    drawn = False
    for i, (label, history) in enumerate(runs.items()):
        colour = f"C{i}"
        t, v = series(history, "loss")
        if t:
            ax.plot(t, v, color=colour, lw=1.2, label=f"{label}: training")
        te, ve = series(history, "eval_loss")
        if te:
            ax.plot(te, ve, "o--", color=colour, ms=4, lw=0.8, label=f"{label}: evaluation")
        drawn = drawn or bool(t or te)
    if drawn:
        _save(fig, ax, path)
    return drawn


def _plot_single(
    runs: Mapping[str, History], key: str, title: str, ylabel: str, scale: float, path: Path
) -> bool:
    fig, ax = _figure(title, ylabel)
    drawn = False
    for i, (label, history) in enumerate(runs.items()):
        t, v = series(history, key)
        if t:
            ax.plot(t, [scale * x for x in v], "o-", color=f"C{i}", ms=3, lw=1.2, label=label)
            drawn = True
    if drawn:
        _save(fig, ax, path)
    return drawn


def plot_run(
    output_dir: str | os.PathLike,
    runs: Mapping[str, History],
    *,
    precision_events: Sequence[Any] | None = None,
    last_step: int | None = None,
) -> dict[str, str]:
    """Writes the run's PNG plots into ``output_dir``; a plot without data is skipped.

    Args:
        output_dir: the folder to write into (created if needed).
        runs: label -> history, the run first, then the runs it is compared with (each
            gets its own colour, in this order, in every plot).
        precision_events: the run's precision-change events
            (:class:`~hf_triaccel.precision.PrecisionEvent` or their dicts), if it has a
            precision map.
        last_step: the step the precision map ends at (the run's last optimizer step).

    Returns:
        plot name (``loss``, ``accuracy``, ``memory``, ``precision_map``) -> file name
        inside ``output_dir``, for the plots that were written.

    Example:
        >>> plot_run("out", {"adafisher": run, "adamw_torch_fused": baseline})  # doctest: +SKIP
        {'loss': 'loss.png', 'accuracy': 'accuracy.png', 'memory': 'memory.png'}
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawn = {
        "loss": _plot_loss(runs, out / PLOT_FILES["loss"]),
        "accuracy": _plot_single(
            runs,
            "eval_accuracy",
            "Evaluation accuracy",
            "accuracy (%)",
            100.0,
            out / PLOT_FILES["accuracy"],
        ),
        "memory": _plot_single(
            runs,
            "peak_memory_gb",
            "Peak GPU memory since the start of training",
            "GiB (torch.cuda.max_memory_allocated)",
            1.0,
            out / PLOT_FILES["memory"],
        ),
    }
    if precision_events:
        from hf_triaccel.precision import plot_precision_map

        plot_precision_map(precision_events, out / PLOT_FILES["precision_map"], last_step=last_step)
        drawn["precision_map"] = True
    return {name: PLOT_FILES[name] for name, done in drawn.items() if done}
