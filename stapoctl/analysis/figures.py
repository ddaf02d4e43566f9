"""The figures of `stapoctl compare` (matplotlib, Agg, PNG):

- accuracy vs the swept value with error bars (000 Fig. 4; log x axis when the values are
  positive and span a decade or more), or a bar chart when the rows are methods; the bars are
  the bootstrap 95% CI of the mean over seeds, ± std where a row has fewer than 3 seeds;
- training curves per row, mean over seeds with a min–max band (000 Figs. 3 and 5): training
  reward accuracy, held-out accuracy, entropy, spurious ratio, response length, clip fraction;
- the per-category LM-head gradient-norm proxies the loss library logs (000 Fig. 2b over time);
- for the token grid (rows = 000 Table 1's cells), Δaccuracy per cell and each cell's gradient share
  over training (`grid_figures.py`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from stapoctl.analysis import grid_figures
from stapoctl.analysis.cells import accuracy_cells, column_header
from stapoctl.analysis.statistics import mean_ci
from stapoctl.tracking import keys

CURVES = (keys.ACCURACY, "val", keys.ENTROPY, keys.SPURIOUS_RATIO, keys.RESPONSE_LENGTH, keys.CLIPFRAC)
TITLES = {
    keys.SCORE: "training reward (mean score)",
    keys.ACCURACY: "training reward accuracy",
    keys.ENTROPY: "policy entropy (nats)",
    keys.SPURIOUS_RATIO: "spurious ratio (silenced / response tokens)",
    keys.RESPONSE_LENGTH: "response length (tokens)",
    keys.CLIPFRAC: "PPO clip fraction",
    **{v: f"LM-head grad-norm proxy: {k}" for k, v in keys.GRAD_NORM.items()},
}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(n: int) -> list:
    plt = _plt()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def _title(metric: str) -> str:
    from stapoctl.data.benches import TITLES as BENCH

    parsed = keys.parse_accuracy_metric(metric)
    if parsed:
        source, bench, dec, k = parsed
        what = "held-out" if source == "val" else "eval"
        return f"{what} {BENCH.get(bench, bench)} avg@{k} ({keys.DECODING_LABEL.get(dec, dec)})"
    return TITLES.get(metric, metric)


def _slug(text: str) -> str:
    return re.sub(r"[^\w.-]+", "_", text).strip("_") or "value"


class _Histories:
    """Metric histories from the store, one query per (run, metric); last write per step wins
    (a resumed run logs its resume step twice)."""

    def __init__(self, client) -> None:
        self.client, self.cache = client, {}

    def __call__(self, run_id: str, metric: str) -> dict[int, float]:
        if (run_id, metric) not in self.cache:
            hist = sorted(self.client.get_metric_history(run_id, metric), key=lambda m: (m.step, m.timestamp))
            self.cache[(run_id, metric)] = {m.step: m.value for m in hist}
        return self.cache[(run_id, metric)]


def _band(series: list[dict[int, float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """steps, mean, min, max over the runs that logged each step."""
    steps = sorted({s for h in series for s in h})
    vals = [[h[s] for h in series if s in h] for s in steps]
    return (np.array(steps), np.array([np.mean(v) for v in vals]), np.array([np.min(v) for v in vals]),
            np.array([np.max(v) for v in vals]))


def curves(hist: _Histories, comp: Any, metrics: Sequence[str], path: Path, title: str) -> Optional[Path]:
    """A panel per metric, a line per row (mean over seeds) with its min–max band."""
    metrics = [m for m in metrics if any(t.last(m) is not None for t in comp.trials)]
    if not metrics:
        return None
    plt = _plt()
    ncols = min(3, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.0 * ncols, 3.4 * nrows + 0.5), squeeze=False)
    colors = _colors(len(comp.groups))
    for ax, metric in zip(axes.flat, metrics):
        for color, (group, trials) in zip(colors, comp.groups.items()):
            series = [h for h in (hist(t.id, metric) for t in trials) if h]
            if not series:
                continue
            steps, mean, lo, hi = _band(series)
            scale = 100.0 if keys.parse_accuracy_metric(metric) or metric == keys.ACCURACY else 1.0
            ax.plot(steps, mean * scale, color=color, lw=1.6, marker="o" if len(steps) <= 12 else None, ms=3,
                    label=f"{group} (n={len(series)})")
            if len(series) > 1:
                ax.fill_between(steps, lo * scale, hi * scale, color=color, alpha=0.18, lw=0)
        ax.set_title(_title(metric) + (" (%)" if keys.parse_accuracy_metric(metric) or metric == keys.ACCURACY
                                       else ""), fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat:  # the first panel may miss a row that logged nothing there
        h, lab = ax.get_legend_handles_labels()
        if len(lab) > len(labels):
            handles, labels = h, lab
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6), fontsize=9,
               title=f"{comp.key} · mean over seeds, band = min–max", title_fontsize=9, frameon=False)
    fig.suptitle(title, y=0.005, va="bottom", fontsize=9, color="0.35")
    top = 1.0 - (0.05 + 0.2 * (1 + math.ceil(len(labels) / 6))) / (3.4 * nrows + 0.5)  # room for the legend
    fig.tight_layout(rect=(0, 0.03, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _accuracy_columns(comp: Any) -> tuple[list[str], dict[str, dict[str, Any]]]:
    cells = accuracy_cells(comp)
    cols = list(next(iter(cells.values()), {}).keys())
    return cols, cells


ERR_TITLE = "mean, bootstrap 95% CI over seeds; ± std if n < 3"


def _yerr(cells: Sequence[Any]) -> np.ndarray:
    """(2, n) error bars in %: below/above the mean to the CI's ends, ± std without a CI."""
    out = np.zeros((2, len(cells)))
    for i, c in enumerate(cells):
        ci = mean_ci(c.values)[0] if c.n else None
        if ci is not None:
            out[:, i] = [100 * max(0.0, c.mean - ci[0]), 100 * max(0.0, ci[1] - c.mean)]
        elif c.n:
            out[:, i] = 100 * (c.std or 0.0)
    return out


def _column_label(col: str) -> str:
    return column_header(col)


def accuracy_vs_value(comp: Any, path: Path) -> Optional[Path]:
    """000 Fig. 4: final accuracy against the swept number, 95% CI (± std below 3 seeds) over seeds."""
    cols, cells = _accuracy_columns(comp)
    if not cols or not comp.numeric:
        return None
    plt = _plt()
    xs = np.array([float(g) for g in comp.groups])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for color, col in zip(_colors(len(cols)), cols):
        rows = [(x, cells[g][col]) for x, g in zip(xs, comp.groups) if cells[g][col].n]
        if not rows:
            continue
        x = np.array([r[0] for r in rows])
        y = np.array([100 * r[1].mean for r in rows])
        err = _yerr([r[1] for r in rows])
        ax.errorbar(x, y, yerr=err, color=color, marker="o", capsize=4, lw=1.6, label=_column_label(col))
        for xi, yi, (_, c) in zip(x, y, rows):
            ax.annotate(f"n={c.n}", (xi, yi), textcoords="offset points", xytext=(4, 6), fontsize=7, color="0.4")
    if (xs > 0).all() and xs.max() / xs.min() >= 10:
        ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(list(comp.groups), fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel(comp.key)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"final accuracy vs {comp.key}\n({ERR_TITLE})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accuracy_by_group(comp: Any, path: Path) -> Optional[Path]:
    """Methods side by side (000 Table 2 as bars), 95% CI (± std below 3 seeds) over seeds."""
    cols, cells = _accuracy_columns(comp)
    if not cols or comp.numeric:
        return None
    plt = _plt()
    groups = list(comp.groups)
    width = 0.8 / len(cols)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(cols)) ** 0.5 + 2), 4.2))
    base = np.arange(len(groups))
    for i, (color, col) in enumerate(zip(_colors(len(cols)), cols)):
        y = [100 * (cells[g][col].mean or 0.0) for g in groups]
        err = _yerr([cells[g][col] for g in groups])
        bars = ax.bar(base + (i - (len(cols) - 1) / 2) * width, y, width, yerr=err, capsize=3, color=color,
                      label=_column_label(col))
        for b, g, e in zip(bars, groups, err[1]):
            if cells[g][col].n:
                ax.annotate(f"{b.get_height():.1f}", (b.get_x() + b.get_width() / 2, b.get_height() + e),
                            textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
    ax.set_xticks(base)
    ax.set_xticklabels(groups, fontsize=9, rotation=20 if max(len(g) for g in groups) > 12 else 0, ha="right"
                       if max(len(g) for g in groups) > 12 else "center")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"final accuracy by {comp.key}\n({ERR_TITLE})", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_all(client, comp: Any, out_dir: Path, curves_name: str = "training_curves.png",
             panels: Optional[Sequence[str]] = None) -> dict[str, Path]:
    """Every figure that has data; name → path."""
    hist = _Histories(client)
    out: dict[str, Path] = {}
    key = _slug(comp.key)
    for name, draw in ((f"accuracy_vs_{key}.png", accuracy_vs_value), (f"accuracy_by_{key}.png", accuracy_by_group)):
        if draw(comp, out_dir / name):
            out[name] = out_dir / name
    if panels:
        metrics = list(panels)
    else:
        val = sorted({m for t in comp.trials for m in t.run.data.metrics
                      if (keys.parse_accuracy_metric(m) or ("",))[0] == "val"})
        first = keys.ACCURACY if any(t.last(keys.ACCURACY) is not None for t in comp.trials) else keys.SCORE
        metrics = [first] + val + [m for m in CURVES[2:]]
    runs = ", ".join(comp.short[t.id] for t in comp.trials[:12]) + (" …" if len(comp.trials) > 12 else "")
    if curves(hist, comp, metrics, out_dir / curves_name, f"runs: {runs}"):
        out[curves_name] = out_dir / curves_name
    if curves(hist, comp, list(keys.GRAD_NORM.values()), out_dir / "grad_norms.png",
              "per-token |coef|·‖e(y)−π‖·‖h‖ averaged over each category's tokens (losses/diagnostics.py)"):
        out["grad_norms.png"] = out_dir / "grad_norms.png"
    for name, draw in (("token_grid_delta.png", lambda p: grid_figures.delta_heatmap(comp, p)),
                       ("token_grid_grad_share.png", lambda p: grid_figures.grad_share_curves(hist, comp, p))):
        if draw(out_dir / name):
            out[name] = out_dir / name
    return out
