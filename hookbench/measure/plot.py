"""Figures (matplotlib, written as PNG): memory over one training step, stacked by category, one
panel per strategy, like the figures of the PyTorch tutorial on fusing the optimizer step into
backward; and the coordinate check's width sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hookbench.measure.coord_check import QUANTITIES, CoordCheck
from hookbench.measure.memory import CATEGORIES, MemoryResult, byte_unit, format_bytes
from hookbench.measure.zero_paper import Row, paper_bytes

__all__ = ["coord_check", "memory_timeline", "zero_paper"]

_COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868",
           "activations": "#c44e52", "temporaries": "#8172b3"}


def memory_timeline(results: Sequence[MemoryResult], path: str | Path) -> Path:
    """Write a PNG with one stacked-area panel per result; returns its path."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), sharey=True,
                             squeeze=False)
    unit, size = byte_unit(max(r.peak for r in results))  # the shared axis: the highest peak's
    for ax, r in zip(axes[0], results):
        xs = range(len(r.timeline))
        series = [[v[i] / size for _, v in r.timeline] for i in range(len(CATEGORIES))]
        ax.stackplot(xs, *series, labels=CATEGORIES, colors=[_COLORS[c] for c in CATEGORIES])
        start = 0
        for i in range(1, len(r.timeline) + 1):  # phase boundaries as thin lines with names
            if i == len(r.timeline) or r.timeline[i][0] != r.timeline[start][0]:
                if i - start >= len(r.timeline) // 50:  # too short to label legibly
                    ax.axvline(start, color="black", lw=0.4, alpha=0.4)
                    ax.text(start, 0.0, f" {r.timeline[start][0]}", fontsize=7, rotation=90,
                            va="bottom")
                start = i
        ax.axhline(r.peak / size, color="black", ls="--", lw=0.8)
        ax.set_title(f"{r.strategy}\npeak {format_bytes(r.peak)} ({r.backend})", fontsize=9)
        ax.set_xlabel("allocation events in one step")
    axes[0][0].set_ylabel(unit)
    axes[0][-1].legend(loc="upper right", fontsize=7)
    fig.suptitle(f"{results[0].model}, batch {results[0].batch_size}: memory during one "
                 f"training step", fontsize=10)
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
