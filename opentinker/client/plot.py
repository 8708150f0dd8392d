"""A metric curve (the quickstart's reward curve) as a PNG, drawn with matplotlib.

matplotlib is the optional ``plot`` extra (``pip install "opentinker[plot]"``); it is imported
when a curve is drawn, never with :mod:`opentinker.client`, so the thin client stays light.
The figure has axes with ticks, the labels "step" and the metric's name, a title, the raw
per-step values and their moving average.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["PLOT_INSTALL_HINT", "PlotUnavailableError", "curve_figure", "moving_average", "write_curve_png"]

PLOT_INSTALL_HINT = 'pip install "opentinker[plot]" (or pip install matplotlib)'
RAW_COLOR = "#96b4e6"  # the per-step values
SMOOTH_COLOR = "#1446aa"  # their moving average
_DPI = 100


class PlotUnavailableError(ImportError):
    """matplotlib is not installed; the message says how to get it."""


def moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def curve_figure(
    values: Sequence[float],
    *,
    width: int = 640,
    height: int = 360,
    smooth_window: int = 5,
    metric: str = "reward/mean",
    title: str | None = None,
    steps: Sequence[int] | None = None,
):
    """A matplotlib ``Figure``, ``width`` x ``height`` pixels: ``values`` (one per step;
    ``steps`` default 1, 2, ...) and their moving average over ``smooth_window`` steps, with
    the axis labels "step" and ``metric`` and a ``title``."""
    if not values:
        raise ValueError("write_curve_png: no values to plot")
    steps = list(steps) if steps is not None else list(range(1, len(values) + 1))
    if len(steps) != len(values):
        raise ValueError(f"write_curve_png: {len(steps)} steps for {len(values)} values")
    try:
        # A bare Figure (no pyplot) draws with the Agg renderer and leaves the process's
        # matplotlib backend alone.
        from matplotlib.figure import Figure
    except ImportError as error:
        raise PlotUnavailableError(f"drawing the {metric} curve needs matplotlib: {PLOT_INSTALL_HINT}") from error

    figure = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI)
    axes = figure.add_subplot()
    axes.plot(steps, values, color=RAW_COLOR, linewidth=1, label=metric)
    window = max(1, min(smooth_window, len(values)))
    axes.plot(steps, moving_average(values, window), color=SMOOTH_COLOR, linewidth=2.5,
              label=f"moving average ({window} steps)")
    if len(values) == 1:
        axes.scatter(steps, values, color=SMOOTH_COLOR)
    axes.set_xlabel("step")
    axes.set_ylabel(metric)
    axes.set_title(title or f"{metric} per training step")
    axes.grid(True, color="#e1e1e1")
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    return figure


def write_curve_png(values: Sequence[float], path: str | Path, **options: Any) -> Path:
    """Plot ``values`` (one per step) to the PNG ``path``; returns the path. ``options`` are
    those of :func:`curve_figure` (``width`` x ``height`` pixels, default 640 x 360, ``steps``,
    ``metric``, ``title``, ``smooth_window``). Raises :class:`PlotUnavailableError` without
    matplotlib."""
    figure = curve_figure(values, **options)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=_DPI)
    return path
