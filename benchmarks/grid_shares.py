"""The token grid's mechanism table for docs/RESULTS.md: per 000 Table 1 cell, its share of the
response tokens, of the positive-advantage tokens and of the gradient (`shadow/<cell>/*`, logged by
every trial's `loss.shadow=[table1]`), and the rollout–training |Δlogp| of its tokens, averaged over
every step of the sweep's unmasked rows (the base row by default), then mean ± std over seeds.

grad/token > 1 means the cell's tokens carry more than their share of the update (000's claim for
the spurious cell, Â > 0 · π < τ_p · H < h*). The eight cells partition every token with Â ≠ 0, so
their gradient shares sum to 1 at every step: each step's shares are divided by that sum, which
corrects runs logged before a mini-batch without gradient was left out of the step's mean (it
counted 0 then, e.g. 0.75 for a step with one such mini-batch in four) and changes nothing after. `stapoctl compare` draws the same shares over training
(token_grid_grad_share.png); this prints the numbers.

    STAPOCTL_HOME=... python benchmarks/grid_shares.py SWEEP_ID [--rows base] [--uri URI]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARTS = ("token_share", "pos_adv_share", "grad_share", "abs_dlogp")


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def _cell(values: list[float], scale: float, digits: int) -> str:
    values = [scale * v for v in values if not math.isnan(v)]
    if not values:
        return "–"
    if len(values) < 2:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def main() -> int:
    from stapoctl.config.shadow_rules import CELLS, SPURIOUS_CELL
    from stapoctl.sweep import layout, store
    from stapoctl.tracking.mlflow_run import tracking_uri
    from stapoctl.tracking.run_ids import resolve_run_id

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep")
    ap.add_argument("--rows", default="base", help="comma-separated sweep values to average over")
    ap.add_argument("--uri")
    args = ap.parse_args()
    uri = tracking_uri(args.uri)
    sweep_id = resolve_run_id(args.sweep, uri, what="sweep")
    client = store.client(uri)
    rows = set(args.rows.split(","))
    per_seed: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    runs = [r for r in store.children(sweep_id, uri)
            if r.info.status == "FINISHED" and r.data.tags.get(layout.SWEEP_VALUE) in rows]
    if not runs:
        print(f"no FINISHED trial of rows {sorted(rows)} in sweep {sweep_id[:8]}", file=sys.stderr)
        return 1
    for run in runs:
        hist = {(cell, part): {m.step: m.value for m in client.get_metric_history(run.info.run_id,
                                                                                  f"shadow/{cell}/{part}")}
                for cell, *_ in CELLS for part in PARTS}
        total: dict[int, float] = defaultdict(float)
        for cell, *_ in CELLS:
            for step, v in hist[cell, "grad_share"].items():
                total[step] += v
        for cell, *_ in CELLS:
            hist[cell, "grad_share"] = {s: v / total[s] for s, v in hist[cell, "grad_share"].items() if total[s] > 0}
            for part in PARTS:
                values = list(hist[cell, part].values())
                per_seed[cell][part].append(_mean(values) if values else float("nan"))
    print(f"sweep {sweep_id[:8]}, rows {', '.join(sorted(rows))}: {len(runs)} trials, mean over steps, "
          "then mean ± std over trials")
    print("| cell | tokens ‰ | pos-adv tokens ‰ | gradient ‰ | gradient / tokens | mean abs Δlogp |")
    print("|---|---|---|---|---|---|")
    for cell, *_ in CELLS:
        r = per_seed[cell]
        ratio = [g / t if t > 0 else float("nan") for g, t in zip(r["grad_share"], r["token_share"])]
        name = f"**{cell}** (spurious)" if cell == SPURIOUS_CELL else cell
        print(f"| {name} | {_cell(r['token_share'], 1e3, 2)} | {_cell(r['pos_adv_share'], 1e3, 2)} | "
              f"{_cell(r['grad_share'], 1e3, 2)} | {_cell(ratio, 1.0, 2)} | {_cell(r['abs_dlogp'], 1.0, 5)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
