"""The runs `stapoctl compare` compares, read from MLflow: a sweep's children or the runs given,
grouped by swept value or by the config values that differ, with each run's final accuracies
(own eval/… metric, nested eval run, last validation, as `tracking.keys` documents)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from stapoctl.errors import UserError
from stapoctl.tracking import keys
from stapoctl.tracking.run_ids import resolve_run_id, short_ids


# last-step training metrics of the second table: (metric, column header)
TRAINING_COLUMNS = (
    (keys.SCORE, "score"),
    (keys.ACCURACY, "reward acc"),
    (keys.ENTROPY, "entropy"),
    (keys.SPURIOUS_RATIO, "spurious"),
    (keys.RESPONSE_LENGTH, "resp len"),
    (keys.CLIPFRAC, "clipfrac"),
)
# params that differ between seeds of one method (or are bookkeeping), never a grouping key
_NOT_A_GROUP = ("tracking.", "trainer.output_dir", "resume", "eval.output_dir", "model_path")


@dataclass
class Trial:
    """One run and what compare reads from it."""

    run: Any
    group: str
    seed: str
    finals: dict[tuple[str, str], tuple[float, int, str]] = field(default_factory=dict)  # (bench, dec) → (acc, k, source)

    @property
    def id(self) -> str:
        return self.run.info.run_id

    def last(self, metric: str) -> Optional[float]:
        return self.run.data.metrics.get(metric)


@dataclass
class Comparison:
    key: str  # what the rows are: the swept key, or the differing params
    groups: dict[str, list[Trial]]  # row label → its seeds, in row order
    sweeps: list[Any]  # the sweep parent runs compared (artifacts go there)
    numeric: bool  # row labels are numbers (accuracy vs value on an x axis)
    short: dict[str, str]  # run id → short id

    @property
    def trials(self) -> list[Trial]:
        return [t for ts in self.groups.values() for t in ts]

    def columns(self) -> list[tuple[str, str]]:
        """(bench, decoding) pairs present, paper order, T=1.0 before T=0.7."""
        from stapoctl.data.benches import EVAL_BENCHES

        present = {bd for t in self.trials for bd in t.finals}
        order = {b: i for i, b in enumerate(EVAL_BENCHES)}
        dec_order = {d: i for i, d in enumerate(keys.DECODING_LABEL)}
        return sorted(present, key=lambda bd: (order.get(bd[0], 99), bd[0], dec_order.get(bd[1], 9), bd[1]))


# -- collecting ---------------------------------------------------------------------------------
def mlflow_client(uri: Optional[str]):
    from mlflow.tracking import MlflowClient

    from stapoctl.tracking.mlflow_run import tracking_uri

    return MlflowClient(tracking_uri=tracking_uri(uri))


def _children(client, parent) -> list:
    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.`{keys.PARENT}` = '{parent.info.run_id}'",
                              order_by=["attributes.start_time ASC"], max_results=5000)
    return [r for r in runs if r.data.tags.get(keys.KIND, keys.KIND_TRAIN) == keys.KIND_TRAIN]


def _is_sweep(run, children: list) -> bool:
    return run.data.tags.get(keys.KIND) == keys.KIND_SWEEP or bool(children)


def _number(text: str) -> Optional[float]:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _seed(run) -> str:
    t, p = run.data.tags, run.data.params
    return t.get(keys.SEED) or p.get("trainer.seed") or p.get("seed") or ""


def _differing_params(runs: list) -> list[str]:
    names = sorted({k for r in runs for k in r.data.params})
    out = []
    for name in names:
        last = name.rsplit(".", 1)[-1]
        if "seed" in last or name.startswith(_NOT_A_GROUP) or name in _NOT_A_GROUP:
            continue
        if len({r.data.params.get(name) for r in runs}) > 1:
            out.append(name)
    return out


def _finals(run, evals: list) -> dict[tuple[str, str], tuple[float, int, str]]:
    """(bench, decoding) → (accuracy, k, source): own eval/ metric, newest nested eval, last val/."""
    out: dict[tuple[str, str], tuple[float, int, str]] = {}
    sources = [("eval", run.data.metrics, "eval")]
    if evals:
        sources.append(("eval", evals[0].data.metrics, "eval run"))
    sources.append(("val", run.data.metrics, "val"))
    for wanted, metrics, label in sources:
        for name, value in metrics.items():
            parsed = keys.parse_accuracy_metric(name)
            if not parsed or parsed[0] != wanted:
                continue
            _, bench, dec, k = parsed
            have = out.get((bench, dec))
            if have is None or (have[2] == label and k > have[1]):
                out[(bench, dec)] = (float(value), k, label)
    return out


def collect(uri: Optional[str], ids: Sequence[str]) -> Comparison:
    """Resolve ids (full or short), expand sweeps to their trials, group, read final accuracies."""
    if not ids:
        raise UserError("compare: give a sweep id or one or more run ids (see `stapoctl runs`)")
    client = mlflow_client(uri)
    runs, sweeps = [], []
    for spec in ids:
        run = client.get_run(resolve_run_id(spec, uri, what="compare"))
        kids = _children(client, run)
        if _is_sweep(run, kids):
            if not kids:
                raise UserError(f"compare: sweep {spec} has no trial runs yet (nested runs with "
                                f"tag {keys.PARENT}={run.info.run_id})")
            sweeps.append(run)
            runs += kids
        else:
            runs.append(run)
    seen = set()
    runs = [r for r in runs if not (r.info.run_id in seen or seen.add(r.info.run_id))]
    evals = _nested_evals(client, runs)

    sweep_keys = {s.data.params.get(keys.SWEEP_KEY, "") for s in sweeps}
    by_value = sweeps and all(keys.SWEEP_VALUE in r.data.tags for r in runs) and len(sweep_keys) == 1
    if by_value:
        key = sweep_keys.pop() or "value"
        label_of = {r.info.run_id: r.data.tags[keys.SWEEP_VALUE] for r in runs}
    else:
        diff = _differing_params(runs)
        key = ", ".join(diff) if diff else "runs"
        if len(diff) == 1:
            label_of = {r.info.run_id: r.data.params.get(diff[0], "") for r in runs}
        elif diff:
            label_of = {r.info.run_id: ", ".join(f"{d}={r.data.params.get(d, '')}" for d in diff) for r in runs}
        else:  # identical configs: one row (seeds of one method), or each run if no params at all
            any_params = any(r.data.params for r in runs)
            label_of = {r.info.run_id: ("all" if any_params else (r.info.run_name or r.info.run_id[:8])) for r in runs}
    groups: dict[str, list[Trial]] = {}
    for r in runs:
        label = label_of[r.info.run_id]
        groups.setdefault(label, []).append(Trial(r, label, _seed(r), _finals(r, evals.get(r.info.run_id, []))))
    numbers = {g: _number(g) for g in groups}
    numeric = len(groups) > 1 and all(v is not None for v in numbers.values())
    if numeric:
        groups = dict(sorted(groups.items(), key=lambda kv: numbers[kv[0]]))
    return Comparison(key, groups, sweeps, numeric, short_ids(_all_ids(client, runs)))


def _nested_evals(client, runs: list) -> dict[str, list]:
    """train run id → its eval runs, newest first."""
    exps = sorted({r.info.experiment_id for r in runs})
    found = client.search_runs(exps, filter_string=f"tags.`{keys.KIND}` = '{keys.KIND_EVAL}'",
                               order_by=["attributes.start_time DESC"], max_results=5000)
    out: dict[str, list] = {}
    for e in found:
        owner = e.data.tags.get(keys.TRAIN_RUN_ID) or e.data.tags.get(keys.PARENT)
        if owner:
            out.setdefault(owner, []).append(e)
    return out


def _all_ids(client, runs: list) -> list[str]:
    """Every run id of the experiments involved, so short ids are unique in the store."""
    from mlflow.entities import ViewType

    exps = sorted({r.info.experiment_id for r in runs})
    return [r.info.run_id for r in client.search_runs(exps, run_view_type=ViewType.ALL, max_results=50000)]


# -- aggregating ---------------------------------------------------------------------------------
