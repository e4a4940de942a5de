"""Figures (matplotlib, written as PNG, readable at 1600 pixels wide): the peak of one training
step per strategy and its memory over the step, stacked by category, like the figures of the
PyTorch tutorial on fusing the optimizer step into backward; the gate's failed memory and time
rows, recorded against now; the coordinate check's width sweep; the ZeRO paper's table."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hookbench.measure.coord_check import QUANTITIES, CoordCheck
from hookbench.measure.memory import CATEGORIES, MemoryResult, byte_unit, format_bytes
from hookbench.measure.zero_paper import Row, paper_bytes

__all__ = ["coord_check", "memory_timeline", "recorded_against_now", "zero_paper"]

# 14.5 inches at 110 dpi: 1595 pixels wide, three timelines a row of 4.8 inches each
_WIDTH_IN, _GRID_COLUMNS = 14.5, 3

_COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868",
           "activations": "#c44e52", "temporaries": "#8172b3"}


def memory_timeline(results: Sequence[MemoryResult], path: str | Path) -> Path:
    """Write a PNG readable at 1600 pixels wide: on top, every strategy's peak in one panel,
    stacked by category (what each saves, side by side); below, a grid of three panels a row,
    each a strategy's memory over the step, stacked by category, on one shared scale."""
    plt = _pyplot()
    columns = min(_GRID_COLUMNS, len(results))
    grid_rows = -(-len(results) // columns)
    bars_height = 1.0 + 0.32 * len(results)
    fig = plt.figure(figsize=(_WIDTH_IN, bars_height + 3.3 * grid_rows))
    grid = fig.add_gridspec(1 + grid_rows, columns,
                            height_ratios=[bars_height, *[3.3] * grid_rows])
    unit, size = byte_unit(max(r.peak for r in results))  # one scale: the highest peak's
    peaks = fig.add_subplot(grid[0, :])
    left = [0.0] * len(results)
    for c in CATEGORIES:  # each category's share at the peak, strategy by strategy
        widths = [r.peak_breakdown[c] / size for r in results]
        peaks.barh(range(len(results)), widths, left=left, color=_COLORS[c], label=c)
        left = [a + b for a, b in zip(left, widths)]
    for i, r in enumerate(results):
        peaks.text(r.peak / size, i, f" {format_bytes(r.peak)}", va="center", fontsize=8)
    peaks.set_yticks(range(len(results)), [r.strategy for r in results], fontsize=8)
    peaks.invert_yaxis()  # the first strategy (the standard step) on top
    peaks.set_xlim(0, 1.15 * max(r.peak for r in results) / size)
    peaks.set_xlabel(f"peak ({unit}), by category at the peak", fontsize=8)
    peaks.legend(loc="lower right", fontsize=7, ncols=len(CATEGORIES))
    peaks.set_title(f"{results[0].model}, batch {results[0].batch_size}, backend "
                    f"{results[0].backend}: the peak of one training step per strategy",
                    fontsize=10)
    first = None
    for k, r in enumerate(results):
        ax = fig.add_subplot(grid[1 + k // columns, k % columns], sharey=first)
        first = first or ax
        xs = range(len(r.timeline))
        series = [[v[i] / size for _, v in r.timeline] for i in range(len(CATEGORIES))]
        ax.stackplot(xs, *series, colors=[_COLORS[c] for c in CATEGORIES])
        start = 0
        for i in range(1, len(r.timeline) + 1):  # phase boundaries as thin lines with names
            if i == len(r.timeline) or r.timeline[i][0] != r.timeline[start][0]:
                if i - start >= len(r.timeline) // 20:  # too short to label legibly
                    ax.axvline(start, color="black", lw=0.4, alpha=0.4)
                    ax.text(start, 0.0, f" {r.timeline[start][0]}", fontsize=7, rotation=90,
                            va="bottom")
                start = i
        ax.axhline(r.peak / size, color="black", ls="--", lw=0.8)
        ax.set_title(f"{r.strategy}: peak {format_bytes(r.peak)}", fontsize=9)
        ax.set_xlabel("allocation events in one step", fontsize=8)
        if k % columns == 0:
            ax.set_ylabel(unit)
        ax.tick_params(labelsize=7)
    return _save(fig, path)


def recorded_against_now(panels: Sequence[dict], path: str | Path, title: str) -> Path:
    """Write a PNG of the gate's failed memory and time rows, one panel each: recorded (grey)
    against now (red) per quantity, with the limit the row was held to as a tick. A panel is
    ``{"title", "unit", "bars": {quantity: (recorded, now)}, "limits": {quantity: value}}``."""
    plt = _pyplot()
    columns = min(2, len(panels))
    grid_rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(grid_rows, columns, squeeze=False, layout="constrained", figsize=(
        _WIDTH_IN, (0.5 * max(len(p["bars"]) for p in panels) + 1.5) * grid_rows + 0.4))
    for ax, panel in zip(axes.flat, panels):
        labels = list(panel["bars"])
        ys = range(len(labels))
        recorded, now = zip(*panel["bars"].values())
        ax.barh([y - 0.2 for y in ys], recorded, height=0.4, color="#9e9e9e", label="recorded")
        ax.barh([y + 0.2 for y in ys], now, height=0.4, color="#c44e52", label="now")
        for y, label in enumerate(labels):
            if label in panel.get("limits", {}):
                limit = panel["limits"][label]
                ax.plot([limit, limit], [y - 0.45, y + 0.45], color="black", lw=1.5)
            for value, dy in ((recorded[y], -0.2), (now[y], 0.2)):
                ax.text(value, y + dy, f" {value:.3g}", va="center", fontsize=7)
        ax.set_yticks(list(ys), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.2 * max([*recorded, *now, *panel.get("limits", {}).values()]))
        ax.set_xlabel(panel["unit"] + ("; black tick: the limit" if panel.get("limits")
                                       else ""), fontsize=8)
        ax.set_title(panel["title"], fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def coord_check(result: CoordCheck, path: str | Path) -> Path:
    """Write the coordinate-check PNG: width against mean |x_t| (top row) and mean |x_t - x_0|
    (bottom row) on log-log axes, one panel per step, one line per layer; each panel's title
    gives its largest growth and shrinkage across widths (flat lines: muP is right)."""
    plt = _pyplot()
    steps = result.steps + 1
    fig, axes = plt.subplots(2, steps, figsize=(3.2 * steps, 6.4), sharey="row", squeeze=False)
    all_cells = result.cells()
    for row, quantity in enumerate(QUANTITIES):
        for t, ax in enumerate(axes[row]):
            cells = [c for c in all_cells if c[1] == quantity and c[2] == t]
            if not cells:  # no change at step 0
                ax.axis("off")
                continue
            for layer, stats in result.coords.items():
                ax.plot(result.widths, stats[quantity][t], marker=".", lw=1, label=layer)
            up, down = max(c[3] for c in cells), max(c[4] for c in cells)
            bad = " !" if max(up, down) > result.band else ""
            ax.set_title(f"{quantity}, step {t}: up {up:.2f}x, down {down:.2f}x{bad}", fontsize=8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("width")
        axes[row][row].set_ylabel("mean |x_t|" if row == 0 else "mean |x_t - x_0|")
    axes[0][-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(result.verdict(), fontsize=8)
    return _save(fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    if not fig.get_constrained_layout():
        fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def zero_paper(rows: Sequence[Row], path: str | Path) -> Path:
    """Write a PNG of rank 0's model states against N, measured (points) and the paper's
    formula (lines), per stage; returns its path."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    worlds = sorted({r.world for r in rows if r.stage})
    dense = [2 ** (k / 4) for k in range(4 * max(worlds).bit_length() + 1)]
    for stage, label, color in ((0, "data parallel", "#c44e52"), (1, "P_os (stage 1)", "#dd8452"),
                                (2, "P_os+g (stage 2)", "#4c72b0")):
        ax.plot(dense, [paper_bytes(stage, n) / 1e9 for n in dense], color=color, lw=1,
                alpha=0.6)
        measured = [r for r in rows if r.stage == stage]
        # Data parallelism holds the same at every N: its one measurement, at each N.
        xs = [1, *worlds] if stage == 0 else [r.world for r in measured]
        ys = [r.model_states / 1e9 for r in measured] * (len(xs) if stage == 0 else 1)
        ax.plot(xs, ys, "o", color=color, label=f"{label}, measured")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel ranks N")
    ax.set_ylabel("model states per rank (GB)")
    ax.set_title("ZeRO, 7.5 B parameters, K = 12: measured on fake tensors (points), "
                 "paper's formula (lines)", fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, path)
