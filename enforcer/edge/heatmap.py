"""The slowdown matrix of an interference report as a PNG heatmap.

matplotlib is optional (the `report` extra: `pip install '.[report]'` in a checkout) and
heavy, so it is imported only here and only when a heatmap is drawn; without it the
caller gets one line that names the fix, and writes the rest of the report as usual. The
figure is made without pyplot: no global state, no display needed.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from enforcer.core.interference.stats import Cell, Report
from enforcer.core.model import format_bytes

MISSING = (
    "heatmap.png was not written: matplotlib is not installed; pip install matplotlib (or, "
    "in the vram-enforcer checkout this was installed from, pip install '.[report]')"
)


def write_heatmap(report: Report, path: Path) -> str | None:
    """Draw the report's slowdowns into `path`; None when done, else why not (one line)."""
    try:
        from matplotlib import colormaps  # noqa: PLC0415 - optional, and heavy
        from matplotlib.figure import Figure  # noqa: PLC0415
        from matplotlib.patches import Rectangle  # noqa: PLC0415
    except ImportError:
        return MISSING
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font cache notes
    names = report.names
    cells = [[report.cell(a, b) for b in names] for a in names]
    values = [[c.slowdown if c.slowdown is not None else math.nan for c in row] for row in cells]
    worst = max((v for row in values for v in row if not math.isnan(v)), default=1.0)
    size = len(names)
    figure = Figure(figsize=(2.5 + 1.4 * size, 1.6 + 1.1 * size), layout="constrained")
    ax = figure.add_subplot()
    cmap = colormaps["YlOrRd"].with_extremes(bad="#d9d9d9")
    top = max(2.0, worst)
    image = ax.imshow(values, cmap=cmap, vmin=1.0, vmax=top)
    for i, row in enumerate(cells):
        for j, cell in enumerate(row):
            if cell.failures:  # a cell with runs that went wrong is hatched
                ax.add_patch(
                    Rectangle(
                        (j - 0.5, i - 0.5),
                        1,
                        1,
                        fill=False,
                        hatch="//",
                        edgecolor="#555555",
                        linewidth=0,
                    )
                )
            red, green, blue, _ = cmap((values[i][j] - 1.0) / (top - 1.0))
            dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
            ax.text(
                j,
                i,
                _label(cell, report.max_spread),
                ha="center",
                va="center",
                fontsize=8,
                color="white" if dark else "black",
            )
    ax.set_xticks(range(size), [f"next to {n}" for n in names], rotation=30, ha="right")
    ax.set_yticks(range(size), [_row(report.cell(n, None)) for n in names])
    ax.set_xlabel(
        f"* repetitions spread more than {report.max_spread:.0%}\n~ the neighbour "
        "ended first\nhatched: runs that went wrong",
        fontsize=7,
    )
    title = "Slowdown next to a neighbour (time / time alone)"
    ax.set_title(title + (" - PARTIAL" if report.partial else ""), fontsize=10)
    figure.colorbar(image, ax=ax, label="slowdown (x)")
    figure.savefig(path, dpi=120)
    return None


def _row(alone: Cell) -> str:
    """A row's name, with how busy the workload keeps the GPU alone: what it asks of the
    SMs, next to what a neighbour costs it."""
    if alone.sm_percent is None:
        return alone.workload
    return f"{alone.workload}\nSM {alone.sm_percent:.0f}% alone"


def _label(cell: Cell, max_spread: float) -> str:
    """The slowdown and its marks, what went wrong (`OOM 1/3`), the peak GPU memory."""
    lines = [f"{cell.slowdown:.2f}x{cell.marks(max_spread)}"] if cell.slowdown is not None else []
    lines += cell.failure_marks or ([] if lines else ["-"])
    if cell.peak_bytes:
        lines.append(format_bytes(cell.peak_bytes))
    return "\n".join(lines)
