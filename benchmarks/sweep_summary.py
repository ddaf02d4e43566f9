"""The per-value summary docs/RESULTS.md prints for a sweep: final and peak held-out accuracy,
and the mechanism (how many tokens the S2T criterion picked, entropy, clipping), mean ± std
over seeds.

`stapoctl compare` shows last-step values; a last step is one noisy batch, so the mechanism
columns here average over the run's steps (spurious ratio = S2T-picked / response tokens,
masked share of the positive-advantage tokens, clip fraction: over every step; entropy: over
the last 10). GRPO logs the same S2T counts without applying the mask, so rows compare.

    STAPOCTL_HOME=... python benchmarks/sweep_summary.py SWEEP_ID [--uri URI]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VAL = "val/toy/train/avg_at_4"
COLUMNS = (
    ("final acc %", lambda h: 100 * h[VAL][-1][1]),
    ("peak acc % (step)", None),  # special: value and step
    ("spurious ratio ‰", lambda h: 1e3 * _mean(v for _, v in h["stapo/spurious_ratio"])),
    ("masked pos-adv ‰", lambda h: 1e3 * _mean(v for _, v in h["stapo/masked_pos_adv_ratio"])),
    ("entropy (last 10)", lambda h: _mean(v for _, v in h["actor/entropy"][-10:])),
    ("clipfrac ‰", lambda h: 1e3 * _mean(v for _, v in h["actor/pg_clipfrac"])),
)
# shown only when a sweep's runs logged them (recipe knobs): means over the run's steps
OPTIONAL = (
    ("Δlogp max", "rollout/logprob_diff_max", 1.0),
    ("mismatch k3 ‰", "rollout_corr/kl_k3", 1e3),
    ("IS weight mean", "rollout_corr/weight_mean", 1.0),
    ("kept share", "dynamic_sampling/kept_frac", 1.0),
    ("gen rounds", "dynamic_sampling/gen_rounds", 1.0),
)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _cell(values: list[float], digits: int) -> str:
    if len(values) < 2:
        return f"{values[0]:.{digits}f}" if values else "–"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def main() -> int:
    from stapoctl.sweep import layout, store
    from stapoctl.tracking.mlflow_run import tracking_uri
    from stapoctl.tracking.run_ids import resolve_run_id

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep")
    ap.add_argument("--uri")
    args = ap.parse_args()
    uri = tracking_uri(args.uri)
    sweep_id = resolve_run_id(args.sweep, uri, what="sweep")
    client = store.client(uri)
    rows: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    order: list[str] = []
    for run in store.children(sweep_id, uri):
        if run.info.status != "FINISHED":
            continue
        value = run.data.tags[layout.SWEEP_VALUE]
        if value not in order:
            order.append(value)
        h = {k: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, k),
                                                   key=lambda m: m.step)]
             for k in (VAL, "stapo/spurious_ratio", "stapo/masked_pos_adv_ratio",
                       "actor/entropy", "actor/pg_clipfrac", *(key for _, key, _ in OPTIONAL))}
        for name, fn in COLUMNS:
            if fn is None:
                step, best = max(h[VAL], key=lambda sv: (sv[1], -sv[0]))
                rows[value]["peak"].append(100 * best)
                rows[value]["peak_step"].append(step)
            else:
                rows[value][name].append(fn(h))
        for name, key, scale in OPTIONAL:
            if h[key]:
                rows[value][name].append(scale * _mean(v for _, v in h[key]))
        rows[value]["seeds"].append(run.data.tags.get(layout.SEED, "?"))
    key = client.get_run(sweep_id).data.params.get(layout.P_KEY, "value")
    extra = [name for name, _, _ in OPTIONAL if any(rows[v][name] for v in order)]
    print(f"| {key} | seeds | " + " | ".join([n for n, _ in COLUMNS] + extra) + " |")
    print("|---" * (len(COLUMNS) + len(extra) + 2) + "|")
    for value in order:
        r = rows[value]
        cells = []
        for name, fn in COLUMNS:
            if fn is None:
                cells.append(f"{_cell(r['peak'], 1)} ({_cell([float(s) for s in r['peak_step']], 0)})")
            else:
                cells.append(_cell(r[name], 1 if "%" in name else 3))
        cells.extend(_cell(r[name], 3) for name in extra)
        print(f"| {value} | {len(r['seeds'])} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
