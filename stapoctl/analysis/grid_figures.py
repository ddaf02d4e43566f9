"""The figures of the token grid (`stapoctl sweep token_grid`, sweeps/token_grid.yaml): rows are 000
Table 1's eight (Â, π, H) cells, each masked in its own trials, plus the unmasked base row.

- ``token_grid_delta.png``: a heatmap of Δaccuracy (row mean − base mean over seeds, in points) per
  cell, Â > 0 above Â < 0, one panel per accuracy column;
- ``token_grid_grad_share.png``: each cell's share of the gradient (``shadow/<cell>/grad_share``, the
  run's ``loss.shadow=[table1]``) over training in the base row, mean over seeds with a min–max
  band, against its share of the tokens (dashed): 000's claim that the spurious cell carries more
  gradient than its tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from stapoctl.analysis.cells import accuracy_cells, column_header
from stapoctl.config.shadow_rules import CELLS, SPURIOUS_CELL

BASE = "base"
# heatmap columns (π, H) in 000 Table 1's order, and rows (Â sign)
COLUMNS = (("high", "high"), ("high", "low"), ("low", "high"), ("low", "low"))
COLUMN_LABELS = ("π≥τp · H≥h*", "π≥τp · H<h*", "π<τp · H≥h*", "π<τp · H<h*")
SIGNS = (("pos", "Â > 0"), ("neg", "Â < 0"))
CELL_NAMES = tuple(c[0] for c in CELLS)


def is_grid(comp: Any) -> bool:
    """The rows are cells of the grid (a sweep of `loss.token_rules` labelled by cell)."""
    return any(group in CELL_NAMES for group in comp.groups)


def base_row(comp: Any) -> str:
    return BASE if BASE in comp.groups else next(iter(comp.groups))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def deltas(comp: Any) -> dict[str, dict[str, Optional[float]]]:
    """accuracy column → cell → Δ mean accuracy against the base row, in points (None: no value)."""
    cells = accuracy_cells(comp)
    base = base_row(comp)
    out: dict[str, dict[str, Optional[float]]] = {}
    for col in next(iter(cells.values()), {}):
        ref = cells.get(base, {}).get(col)
        out[col] = {name: (100.0 * (cells[name][col].mean - ref.mean)
                           if name in cells and cells[name][col].n and ref is not None and ref.n else None)
                    for name in CELL_NAMES}
    return out


def delta_heatmap(comp: Any, path: Path) -> Optional[Path]:
    """Δaccuracy per cell: 2 × 4 (Â sign × (π, H)), diverging colours centred on 0, n per cell."""
    table = deltas(comp)
    if not table or not is_grid(comp):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(table), figsize=(7.2 * len(table), 3.6), squeeze=False)
    seeds = {g: len(ts) for g, ts in comp.groups.items()}
    for ax, (col, by_cell) in zip(axes[0], table.items()):
        grid = np.full((2, 4), np.nan)
        for i, (sign, _) in enumerate(SIGNS):
            for j, (p, h) in enumerate(COLUMNS):
                value = by_cell[f"{sign}_{p}p_{h}h"]
                grid[i, j] = np.nan if value is None else value
        top = max(1e-9, float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0)
        image = ax.imshow(grid, cmap="RdBu", vmin=-top, vmax=top, aspect="auto")
        for i, (sign, _) in enumerate(SIGNS):
            for j, (p, h) in enumerate(COLUMNS):
                name = f"{sign}_{p}p_{h}h"
                text = "—" if np.isnan(grid[i, j]) else f"{grid[i, j]:+.1f} pt\nn={seeds.get(name, 0)}"
                dark = not np.isnan(grid[i, j]) and abs(grid[i, j]) > 0.6 * top
                ax.text(j, i, text, ha="center", va="center", fontsize=9, color="white" if dark else "black",
                        fontweight="bold" if name == SPURIOUS_CELL else "normal")
        ax.set_xticks(range(4), COLUMN_LABELS, fontsize=8)
        ax.set_yticks(range(2), [label for _, label in SIGNS], fontsize=9)
        ax.set_title(f"Δ {column_header(col)} vs {base_row(comp)} (masking the cell)", fontsize=10)
        fig.colorbar(image, ax=ax, label="Δ accuracy (points)", fraction=0.04, pad=0.02)
    fig.suptitle("token grid: each cell of 000 Table 1 masked (bold: the spurious cell); verdicts in table.md",
                 fontsize=9, color="0.35", y=0.01, va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _band(series: list[dict[int, float]]):
    steps = sorted({s for h in series for s in h})
    vals = [[h[s] for h in series if s in h] for s in steps]
    return (np.array(steps), np.array([np.mean(v) for v in vals]), np.array([np.min(v) for v in vals]),
            np.array([np.max(v) for v in vals]))


def grad_share_curves(hist: Callable[[str, str], dict[int, float]], comp: Any, path: Path) -> Optional[Path]:
    """A panel per cell: its gradient share (solid, min–max band over seeds) and token share (dashed) over
    training, in the base row's trials; None when no trial logged a cell's share."""
    trials = comp.groups.get(base_row(comp), [])
    series = {(name, part): [h for h in (hist(t.id, f"shadow/{name}/{part}") for t in trials) if h]
              for name in CELL_NAMES for part in ("grad_share", "token_share")}
    if not any(series.values()) or not is_grid(comp):
        return None
    plt = _plt()
    fig, axes = plt.subplots(2, 4, figsize=(17, 6.4), sharex=True, sharey=True)
    for i, (sign, sign_label) in enumerate(SIGNS):
        for j, ((p, h), label) in enumerate(zip(COLUMNS, COLUMN_LABELS)):
            ax, name = axes[i, j], f"{sign}_{p}p_{h}h"
            for part, style, color in (("grad_share", "-", "crimson"), ("token_share", "--", "0.3")):
                if series[(name, part)]:
                    steps, mean, lo, hi = _band(series[(name, part)])
                    ax.plot(steps, mean, style, color=color, lw=1.6, label=part.replace("_", " "))
                    ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)
            ax.set_title(f"{sign_label} · {label}" + ("  (spurious)" if name == SPURIOUS_CELL else ""), fontsize=9,
                         color="crimson" if name == SPURIOUS_CELL else "black")
            ax.grid(alpha=0.3)
            if i == 1:
                ax.set_xlabel("step")
    axes[0, 0].set_ylabel("share")
    axes[1, 0].set_ylabel("share")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=9, frameon=False)
    fig.suptitle(f"each cell's share of ΣG_t (solid) and of the tokens (dashed), row {base_row(comp)}, "
                 f"n={len(trials)} seeds (mean, band = min–max)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
