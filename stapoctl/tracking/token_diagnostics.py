"""Token diagnostics of 000 §3 for one scored batch: which of the 8 (π, Â, H) categories each
response token falls in, where the categories lie in the probability–entropy plane (Fig. 2a,
as 2-D histograms), and the spurious / silenced tokens decoded with their context (Tables 3–5).

π and H are the learner's (the recompute pass before the step's update); h* is computed as the
loss computes it: the (1 − τ_h) quantile of H over the response tokens of each PPO mini-batch
(`mini_rows` consecutive rows). Pure torch + numpy + matplotlib, so a hand-made batch tests it;
only `log_step`, the training loop's hook, touches MLflow.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from stapoctl.losses.diagnostics import token_categories
from stapoctl.losses.masks import entropy_threshold, s2t_mask

SPURIOUS = "p<tau,A>0,H<h"  # 000's destructive regime: Â > 0, π < τ_p, H < h*
# the loss-library keys of token_categories, in 000 Table 1's order, with a plot label
CATEGORIES = {
    "p>=tau,A>0,H>=h": "Â>0 · π≥τp · H≥h*",
    "p>=tau,A>0,H<h": "Â>0 · π≥τp · H<h*",
    "p<tau,A>0,H>=h": "Â>0 · π<τp · H≥h*",
    SPURIOUS: "Â>0 · π<τp · H<h*  (spurious)",
    "p>=tau,A<0,H>=h": "Â<0 · π≥τp · H≥h*",
    "p>=tau,A<0,H<h": "Â<0 · π≥τp · H<h*",
    "p<tau,A<0,H>=h": "Â<0 · π<τp · H≥h*",
    "p<tau,A<0,H<h": "Â<0 · π<τp · H<h*",
}
# what each STAPO-family loss silences (s2t_mask kind); other losses only measure S2T
SILENCING = {"stapo": "s2t", "stapo_prob_only": "prob_only", "stapo_high_entropy": "high_entropy"}
LOG10_PROB_EDGES = np.linspace(-8.0, 0.0, 33)  # π below 1e-8 lands in the first bin
FILES = ("categories.json", "prob_entropy.png", "spurious_tokens.md")


@dataclass
class TokenDiagnostics:
    tau_p: float
    tau_h: float
    thresholds: list[float]  # h* of each mini-batch
    response_tokens: int
    zero_advantage: int  # response tokens with Â = 0: no category (no policy gradient)
    counts: dict[str, int]
    prob_edges: np.ndarray  # log10 π bin edges
    entropy_edges: np.ndarray
    hist: dict[str, np.ndarray]  # category → counts [len(prob_edges)-1, len(entropy_edges)-1]
    tokens: list[dict] = field(default_factory=list)  # the listed tokens, rarest first
    listed_kind: str = "s2t"  # the criterion of `tokens` (s2t_mask kind)
    applied: bool = True  # whether the loss silenced them (False: S2T measured only)
    total_listed: int = 0  # tokens meeting the criterion (the table shows at most max_tokens)
    step: Optional[int] = None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "tau_p": self.tau_p, "tau_h": self.tau_h, "h_star": self.thresholds,
            "response_tokens": self.response_tokens, "zero_advantage": self.zero_advantage,
            "counts": self.counts,
            "fractions": {k: v / max(self.response_tokens, 1) for k, v in self.counts.items()},
            "histogram": {"x": "log10 pi (clipped to the first/last edge)", "y": "entropy H (nats)",
                          "log10_prob_edges": self.prob_edges.tolist(),
                          "entropy_edges": self.entropy_edges.tolist(),
                          "counts": {k: v.astype(int).tolist() for k, v in self.hist.items()}},
            "listed": {"criterion": self.listed_kind, "applied_by_loss": self.applied,
                       "total": self.total_listed, "tokens": self.tokens},
        }


def _thresholds(entropy: Tensor, mask: Tensor, tau_h: float, interpolation: str, mini_rows: int) -> Tensor:
    """h* per row: each mini-batch of `mini_rows` rows gets the quantile of its own tokens."""
    rows = entropy.shape[0]
    h = torch.zeros(rows, 1, dtype=torch.float32)
    for start in range(0, rows, mini_rows):
        sl = slice(start, min(start + mini_rows, rows))
        h[sl] = entropy_threshold(entropy[sl], mask[sl], tau_h, interpolation)
    return h


def _entropy_edges(entropy: Tensor, mask: Tensor, bins: int = 32) -> np.ndarray:
    top = float(entropy[mask].max()) if mask.any() else 1.0
    top = max(0.5, math.ceil(top * 2 + 1e-9) / 2)  # a round upper edge above the largest H
    return np.linspace(0.0, top, bins + 1)


def diagnose(
    response_ids: Tensor,
    response_mask: Tensor,
    advantages: Tensor,
    log_probs: Tensor,
    entropy: Tensor,
    *,
    tau_p: float,
    tau_h: float,
    interpolation: str = "linear",
    mini_rows: Optional[int] = None,
    prob_edges: Optional[Sequence[float]] = None,
    entropy_edges: Optional[Sequence[float]] = None,
    silencing: Optional[str] = "s2t",
    decode: Optional[Callable[[list[int]], str]] = None,
    context: int = 8,
    max_tokens: int = 50,
    step: Optional[int] = None,
) -> TokenDiagnostics:
    """Categories, histograms and the listed tokens of a batch ([N, R] tensors; Â may be [N]).

    silencing: the s2t_mask kind the loss applies (None: the loss silences nothing, and the
    tokens listed are those meeting the S2T criterion, marked as not applied).
    """
    mask = response_mask.to(torch.bool).cpu()
    lp, ent = log_probs.detach().float().cpu(), entropy.detach().float().cpu()
    adv = advantages.detach().float().cpu()
    adv = adv[:, None].expand_as(lp) if adv.dim() == 1 else adv
    prob = lp.exp()
    h = _thresholds(ent, mask, tau_h, interpolation, mini_rows or max(len(mask), 1))
    cats = token_categories(adv, prob, ent, mask, tau_p=tau_p, threshold=h)
    p_edges = np.asarray(prob_edges if prob_edges is not None else LOG10_PROB_EDGES, dtype=float)
    e_edges = np.asarray(entropy_edges if entropy_edges is not None else _entropy_edges(ent, mask), dtype=float)
    x = (lp / math.log(10)).clamp(min=p_edges[0], max=p_edges[-1]).numpy()
    y = ent.clamp(min=e_edges[0], max=e_edges[-1]).numpy()
    hist = {k: np.histogram2d(x[m.numpy()], y[m.numpy()], bins=[p_edges, e_edges])[0] for k, m in cats.items()}
    kind = silencing or "s2t"
    listed = s2t_mask(adv, prob, ent, mask, tau_p=tau_p, threshold=h, kind=kind)
    tokens = _listed_tokens(listed, response_ids, mask, prob, ent, adv, h, decode, context, max_tokens)
    return TokenDiagnostics(
        tau_p=float(tau_p), tau_h=float(tau_h),
        thresholds=sorted({round(float(v), 6) for v in h.flatten().tolist()}) if len(h) else [],
        response_tokens=int(mask.sum()), zero_advantage=int((mask & (adv == 0)).sum()),
        counts={k: int(m.sum()) for k, m in cats.items()}, prob_edges=p_edges, entropy_edges=e_edges,
        hist=hist, tokens=tokens, listed_kind=kind, applied=silencing is not None,
        total_listed=int(listed.sum()), step=step,
    )


def _listed_tokens(listed, ids, mask, prob, ent, adv, h, decode, context: int, max_tokens: int) -> list[dict]:
    """The rarest listed tokens with ±context response tokens, decoded when a decoder is given."""
    where = listed.nonzero().tolist()
    where.sort(key=lambda rc: float(prob[rc[0], rc[1]]))
    out = []
    for row, pos in where[:max_tokens]:
        length = int(mask[row].sum())
        seq = ids[row, :length].tolist()
        lo, hi = max(0, pos - context), min(length, pos + 1 + context)
        rec = {"row": row, "position": pos, "token_id": int(seq[pos]), "prob": float(prob[row, pos]),
               "entropy": float(ent[row, pos]), "advantage": float(adv[row, pos]), "h_star": float(h[row, 0])}
        if decode is not None:
            rec.update(token=decode([seq[pos]]), left=decode(seq[lo:pos]), right=decode(seq[pos + 1 : hi]),
                       cut_left=lo > 0, cut_right=hi < length)
        out.append(rec)
    return out


# -- rendering ---------------------------------------------------------------------------------
def _md(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "⏎").replace("`", "\\`")


def markdown_table(diag: TokenDiagnostics, loss_name: str = "") -> str:
    """000 Tables 3–5 as markdown: token, π, Â, H, h*, and the token in its context."""
    what = {"s2t": "Â>0 ∧ π<τ_p ∧ H<h* (S2T)", "prob_only": "Â>0 ∧ π<τ_p", "high_entropy": "Â>0 ∧ π<τ_p ∧ H≥h*"}
    head = "silenced by the loss" if diag.applied else f"spurious by S2T (measured; {loss_name or 'this loss'} does not silence)"
    lines = [
        f"# Tokens {head}" + (f" · step {diag.step}" if diag.step is not None else ""),
        "",
        f"Criterion {what[diag.listed_kind]}, τ_p = {diag.tau_p:g}, τ_h = {diag.tau_h:g}, "
        f"h* = {', '.join(f'{v:.4g}' for v in diag.thresholds) or '—'}. "
        f"{diag.total_listed} of {diag.response_tokens} response tokens"
        + (f"; the {len(diag.tokens)} rarest shown." if diag.total_listed > len(diag.tokens) else "."),
        "",
    ]
    if not diag.tokens:
        return "\n".join(lines + ["No token meets the criterion in this batch.", ""])
    decoded = "token" in diag.tokens[0]
    lines += ["| # | row:pos | token | π | Â | H | h* | context |", "|---|---|---|---|---|---|---|---|"]
    for i, t in enumerate(diag.tokens, 1):
        if decoded:
            ctx = ("…" if t["cut_left"] else "") + _md(t["left"]) + f"⟦{_md(t['token'])}⟧" + _md(t["right"]) + (
                "…" if t["cut_right"] else "")
            tok = f"`{t['token']}`" if "`" not in t["token"] and "|" not in t["token"] else _md(t["token"])
        else:
            ctx, tok = "", str(t["token_id"])
        lines.append(f"| {i} | {t['row']}:{t['position']} | {tok} | {t['prob']:.3%} | {t['advantage']:+.3g} | "
                     f"{t['entropy']:.3g} | {t['h_star']:.3g} | {ctx} |")
    return "\n".join(lines) + "\n"


def figure(diag: TokenDiagnostics, path: Path | str, title: str = "") -> Path:
    """Fig. 2a as two 2-D histograms (Â>0, Â<0) of log10 π × H, cut by τ_p and h*, counts per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    extent = [diag.prob_edges[0], diag.prob_edges[-1], diag.entropy_edges[0], diag.entropy_edges[-1]]
    x_tau = math.log10(diag.tau_p) if diag.tau_p > 0 else diag.prob_edges[0]
    image = None
    for ax, sign in zip(axes, ("A>0", "A<0")):
        keys = [k for k in CATEGORIES if f",{sign}," in k]
        total = sum(diag.hist[k] for k in keys)
        n = int(total.sum())
        if n:
            image = ax.imshow(total.T, origin="lower", aspect="auto", extent=extent, cmap="viridis",
                              norm=LogNorm(vmin=1, vmax=max(2.0, float(total.max()))), interpolation="nearest")
        ax.set_facecolor("#f4f4f4")
        ax.axvline(x_tau, color="crimson", lw=1.2, label=f"τp = {diag.tau_p:g}")
        for j, hv in enumerate(diag.thresholds):
            ax.axhline(hv, color="orange", lw=1.0, ls="--", label="h*" + (" (per mini-batch)" if len(diag.thresholds) > 1 else f" = {hv:.3g}") if j == 0 else None)
        h_mid = float(np.mean(diag.thresholds)) if diag.thresholds else 0.0
        corners = {  # (x, y) text anchors inside each quadrant
            "p<tau": (extent[0] + 0.03 * (extent[1] - extent[0]), "left"),
            "p>=tau": (extent[1] - 0.03 * (extent[1] - extent[0]), "right"),
        }
        for k in keys:
            p_part, _, h_part = k.split(",")
            xpos, ha = corners[p_part]
            ypos = h_mid + 0.06 * (extent[3] - extent[2]) if h_part == "H>=h" else h_mid - 0.06 * (extent[3] - extent[2])
            va = "bottom" if h_part == "H>=h" else "top"
            c = diag.counts[k]
            red = k == SPURIOUS
            ax.text(xpos, ypos, f"{c} ({c / max(diag.response_tokens, 1):.2%})" + ("\nspurious" if red else ""),
                    ha=ha, va=va, fontsize=9, color="crimson" if red else "black",
                    bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="crimson" if red else "0.6", alpha=0.85))
        ax.set_title(f"Â {sign[1]} 0 · {n} tokens", fontsize=10)
        ax.set_xlabel("log10 π(token)  (learner, before the update)")
        ax.set_xlim(extent[0], extent[1])
        ax.set_ylim(extent[2], extent[3])
        ax.legend(loc="upper center", fontsize=8, framealpha=0.85)
    axes[0].set_ylabel("entropy H (nats)")
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="tokens per cell", fraction=0.03, pad=0.02)
    head = title or "response tokens by category (000 Fig. 2a)"
    fig.suptitle(f"{head}" + (f" · step {diag.step}" if diag.step is not None else "")
                 + f" · {diag.response_tokens} tokens, {diag.zero_advantage} with Â = 0", fontsize=11)
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write(diag: TokenDiagnostics, out_dir: Path | str, loss_name: str = "") -> list[Path]:
    """categories.json, prob_entropy.png and spurious_tokens.md into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / FILES[0]).write_text(json.dumps(diag.to_json(), indent=1) + "\n")
    figure(diag, out / FILES[1], title=f"{loss_name} · response tokens by category" if loss_name else "")
    (out / FILES[2]).write_text(markdown_table(diag, loss_name))
    return [out / f for f in FILES]


def s2t_settings(loss: Any) -> tuple[Any, float, float, str]:
    """(typed loss config, τ_p, τ_h, quantile interpolation) of the run's loss config (a `loss` group
    mapping is built by `config.loss_settings`). A method whose config lacks the S2T fields is
    measured at their declared defaults (`config.losses.DiagnosticFields`)."""
    from stapoctl.config.fields import default_of
    from stapoctl.config.loss_settings import build_loss_config
    from stapoctl.config.losses import DiagnosticFields

    cfg = build_loss_config(loss) if isinstance(loss, Mapping) else loss
    tau_p, tau_h, interp = (getattr(cfg, k, default_of(DiagnosticFields, k))
                            for k in ("tau_p", "tau_h", "quantile_interpolation"))
    return cfg, float(tau_p), float(tau_h), str(interp)


def write_page(out_dir: Path | str, batch: Any, log_probs: Tensor, entropy: Tensor, loss_config: Any, *, step: int,
               mini_rows: int, decode: Callable[[list[int]], str], drift: Any, seed: int,
               counts: dict[str, int]) -> Path:
    """tokens.html (tracking/token_page.py): the per-token trace of a few groups, with the same π, H,
    h* and categories as categories.json. `loss_config`: the run's typed loss config (`s2t_settings`)."""
    from stapoctl.tracking.token_page import FILE, write_page as page

    cfg, tau_p, tau_h, interpolation = s2t_settings(loss_config)
    mask = batch.response_mask.to(torch.bool).cpu()
    lp, ent = log_probs.detach().float().cpu(), entropy.detach().float().cpu()
    adv = batch.advantages.detach().float().cpu()
    h = _thresholds(ent, mask, tau_h, interpolation, mini_rows)
    cats = token_categories(adv[:, None].expand_as(lp) if adv.dim() == 1 else adv, lp.exp(), ent, mask,
                            tau_p=tau_p, threshold=h)
    path = Path(out_dir) / FILE
    page(path, batch, lp, ent, h, cats, drift=drift, decode=decode, step=step, seed=seed,
         loss=str(cfg.name), labels=CATEGORIES, counts=counts)
    return path


def log_step(batch: Any, log_probs: Tensor, entropy: Tensor, loss_config: Any, *, step: int, mini_rows: int,
             decode: Callable[[list[int]], str], keep_dir: Optional[Path] = None,
             buffer: Any = None, drift: Any = None, seed: int = 0, upload: bool = True) -> TokenDiagnostics:
    """The training loop's hook: diagnose a scored batch and log it to the active MLflow run
    under diagnostics/step_NNNNNN/. With a journal-backed run (training; `buffer`, else the
    process's active one), the files are written to `keep_dir` and uploaded by the run's sender,
    so an MLflow outage never stalls a step. `upload=False` (tracking.log_artifacts=false): the
    files stay in `keep_dir` only."""
    import tempfile

    import mlflow

    from stapoctl.tracking.keys import DIAGNOSTICS_DIR
    from stapoctl.tracking.metric_buffer import active

    loss_config, tau_p, tau_h, interpolation = s2t_settings(loss_config)  # the driver's object, as it is
    name = str(loss_config.name)
    diag = diagnose(batch.response_ids, batch.response_mask, batch.advantages, log_probs, entropy,
                    tau_p=tau_p, tau_h=tau_h, interpolation=interpolation, mini_rows=mini_rows,
                    silencing=SILENCING.get(name), decode=decode, step=step)
    artifact_path = f"{DIAGNOSTICS_DIR}/step_{step:06d}"
    buffer = buffer if buffer is not None else active()
    page = dict(step=step, mini_rows=mini_rows, decode=decode, drift=drift, seed=seed, counts=diag.counts)
    if (buffer is not None or not upload) and keep_dir is not None:
        Path(keep_dir).mkdir(parents=True, exist_ok=True)
        write(diag, keep_dir, loss_name=name)
        write_page(keep_dir, batch, log_probs, entropy, loss_config, **page)
        if upload:
            buffer.log_artifacts(str(keep_dir), artifact_path)
        return diag
    if not upload:
        return diag
    with tempfile.TemporaryDirectory() as tmp:
        write(diag, tmp, loss_name=name)
        write_page(tmp, batch, log_probs, entropy, loss_config, **page)
        mlflow.log_artifacts(tmp, artifact_path)
    return diag
