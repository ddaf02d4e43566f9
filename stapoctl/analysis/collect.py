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
    alarms: list[str] = field(default_factory=list)  # the run-health alarms that stopped it (still a result)
    # source of its finals ("val", "eval", "eval run") → (protocol sha256 or "unknown", the run tagged)
    protocols: dict[str, tuple[str, str]] = field(default_factory=dict)

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
    notes: list[str] = field(default_factory=list)  # one line each: runs left out (a (value, seed) twice, FAILED, …)
    lost: dict[str, list[str]] = field(default_factory=dict)  # row → short ids of its FAILED / KILLED trials

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


def _protocols(run, evals: list, finals: dict) -> dict[str, tuple[str, str]]:
    """Per source the run's finals came from: (the protocol sha256 of that evaluation, the run
    whose tag it is); `keys.PROTOCOL_UNKNOWN` for a run recorded before protocols were."""
    holder = {"val": run, "eval": run, "eval run": evals[0] if evals else run}
    return {src: (holder[src].data.tags.get(keys.PROTOCOL, keys.PROTOCOL_UNKNOWN), holder[src].info.run_id)
            for src in sorted({v[2] for v in finals.values()})}


def collect(uri: Optional[str], ids: Sequence[str]) -> Comparison:
    """Resolve ids (full or short), expand sweeps to their trials, group, read final accuracies.

    Sweeps of one key merge by swept value: seeds 3–4 added later as another sweep, or two sweeps
    that share values (`ablation` and `baselines` both run grpo and stapo), give one row per
    value. A (value, seed) present twice (in two sweeps, or an earlier attempt of a trial) counts
    once: the newer FINISHED run is kept and `notes` says which run was dropped. A FAILED or
    KILLED trial is left out and named (`lost`), one an alarm stopped counts. Sweeps of
    different keys are refused in one line."""
    if not ids:
        raise UserError("compare: give a sweep id or one or more run ids (see `stapoctl runs`)")
    client = mlflow_client(uri)
    runs, sweeps = _expand(client, uri, ids)
    evals = _nested_evals(client, runs)
    short = short_ids(_all_ids(client, runs))
    notes: list[str] = []
    key, label_of = _labels(runs, sweeps, short)
    if key is not None:
        runs, notes = _one_per_trial(runs, label_of, key, short)
        running = [r for r in runs if r.info.status == "RUNNING"]
        if running and len(running) < len(runs):  # a sweep still under way: its finished trials only
            runs = [r for r in runs if r.info.status != "RUNNING"]
            notes.append(f"compare: left out {len(running)} trial(s) still RUNNING "
                         f"({', '.join(short.get(r.info.run_id, r.info.run_id[:8]) for r in running)})")
    else:
        key, label_of = _param_labels(runs)
    runs, lost, more = _results_only(runs, label_of, key, short)
    notes += more
    groups: dict[str, list[Trial]] = {}
    for r in runs:
        label = label_of[r.info.run_id]
        finals = _finals(r, evals.get(r.info.run_id, []))
        groups.setdefault(label, []).append(Trial(r, label, _seed(r), finals, alarms(r),
                                                  _protocols(r, evals.get(r.info.run_id, []), finals)))
    numbers = {g: _number(g) for g in groups}
    numeric = len(groups) > 1 and all(v is not None for v in numbers.values())
    if numeric:
        groups = dict(sorted(groups.items(), key=lambda kv: numbers[kv[0]]))
    return Comparison(key, groups, sweeps, numeric, short, notes, lost)


def _expand(client, uri: Optional[str], ids: Sequence[str]) -> tuple[list, list]:
    """(the runs, the sweeps among the ids): a sweep stands for its trial runs."""
    runs, sweeps = [], []
    for spec in ids:
        run = client.get_run(resolve_run_id(spec, uri, what="compare"))
        kids = _children(client, run)
        if _is_sweep(run, kids):
            if not kids:
                raise UserError(f"compare: sweep {spec} has no trial runs yet (nested runs with "
                                f"tag {keys.PARENT}={run.info.run_id})")
            if all(s.info.run_id != run.info.run_id for s in sweeps):
                sweeps.append(run)
            runs += kids
        else:
            runs.append(run)
    seen: set[str] = set()
    return [r for r in runs if not (r.info.run_id in seen or seen.add(r.info.run_id))], sweeps


def _labels(runs: list, sweeps: list, short: dict[str, str]) -> tuple[Optional[str], dict[str, str]]:
    """(the swept key, run id → its value) when every run is a sweep trial, else (None, {}).
    Values equal as numbers share the first spelling seen (`2e-3` and `0.002`: one row)."""
    if not sweeps or not all(keys.SWEEP_VALUE in r.data.tags for r in runs):
        return None, {}
    by_key: dict[str, Any] = {}
    for s in sweeps:
        by_key.setdefault(s.data.params.get(keys.SWEEP_KEY, ""), s)
    named = {k: s for k, s in by_key.items() if k}
    if len(named) > 1:
        (k1, s1), (k2, s2) = list(named.items())[:2]
        raise UserError(f"compare: sweep {short.get(s1.info.run_id, s1.info.run_id)} varies {k1} and sweep "
                        f"{short.get(s2.info.run_id, s2.info.run_id)} varies {k2}: sweeps merge only by the same "
                        "key; compare them one at a time")
    label_of = {r.info.run_id: r.data.tags[keys.SWEEP_VALUE] for r in runs}
    values = list(dict.fromkeys(label_of.values()))
    if all(_number(v) is not None for v in values):
        first: dict[float, str] = {}
        same = {v: first.setdefault(_number(v), v) for v in values}
        label_of = {rid: same[v] for rid, v in label_of.items()}
    return (next(iter(named), "") or "value"), label_of


def alarms(run) -> list[str]:
    """The run-health alarms that stopped a KILLED run (tag stapoctl.alarm_stopped)."""
    from stapoctl.tracking.runs import alarm_stopped

    return sorted(alarm_stopped(run))


def raised(run) -> list[str]:
    """The run-health alarms a run raised (tags stapoctl.alarm.<name>), whatever its status: a
    FINISHED run warned of (trainer.alarm_action=warn) is a result, shown with them."""
    return sorted(k[len(keys.ALARM_PREFIX):] for k in run.data.tags if k.startswith(keys.ALARM_PREFIX))


def is_result(run) -> bool:
    """FINISHED, or stopped by a run-health alarm: what the method did, its last validation the result."""
    return run.info.status == "FINISHED" or bool(alarms(run))


def where(key: str, label: str, seed: str) -> str:
    """`loss=grpo seed 2`: a trial in words."""
    return (label if "=" in label else f"{key}={label}") + (f" seed {seed}" if seed else "")


def _results_only(runs: list, label_of: dict[str, str], key: str,
                  short: dict[str, str]) -> tuple[list, dict[str, list[str]], list[str]]:
    """(the runs that are results, row → its FAILED / KILLED trials, notes). A trial that FAILED or
    a person KILLED is no result, but dropping it silently would favour the method that broke:
    each is named in a note and counted against its row. One an alarm stopped counts, marked."""
    def name(r, extra: str) -> str:
        return f"{short.get(r.info.run_id, r.info.run_id[:8])} ({where(key, label_of[r.info.run_id], _seed(r))}, {extra})"

    gone = [r for r in runs if r.info.status in ("FAILED", "KILLED") and not is_result(r)]
    lost: dict[str, list[str]] = {}
    for r in gone:
        lost.setdefault(label_of[r.info.run_id], []).append(short.get(r.info.run_id, r.info.run_id[:8]))
    notes = []
    if gone:
        notes.append(f"compare: left out {len(gone)} trial(s) that FAILED or were KILLED: "
                     + ", ".join(name(r, r.info.status) for r in gone))
    stopped = [r for r in runs if alarms(r)]
    if stopped:
        notes.append(f"compare: counted {len(stopped)} trial(s) stopped by a run-health alarm, at their last "
                     "validation: " + ", ".join(name(r, "alarm " + ", ".join(alarms(r))) for r in stopped))
    warned = [r for r in runs if r.info.status == "FINISHED" and raised(r)]
    if warned:
        notes.append(f"compare: {len(warned)} finished trial(s) raised a run-health alarm and went on: "
                     + ", ".join(name(r, "alarm " + ", ".join(raised(r))) for r in warned))
    gone_ids = {r.info.run_id for r in gone}
    kept = [r for r in runs if r.info.run_id not in gone_ids]
    if not kept:
        raise UserError("compare: nothing to compare: every run FAILED or was KILLED ("
                        + ", ".join(name(r, r.info.status) for r in gone) + ")")
    return kept, lost, notes


def _rank(run) -> tuple[bool, int]:
    """The run a (value, seed) keeps: a result (FINISHED, or stopped by an alarm) first, then the
    newer (ended, else started, last)."""
    return is_result(run), int(run.info.end_time or run.info.start_time or 0)


def _one_per_trial(runs: list, label_of: dict[str, str], key: str, short: dict[str, str]) -> tuple[list, list[str]]:
    """One run per (value, seed); a note for each run left out."""
    kept: dict[tuple[str, str], Any] = {}
    notes: list[str] = []

    def name(run) -> str:
        sweep = run.data.tags.get(keys.SWEEP_ID, "")
        return f"{short.get(run.info.run_id, run.info.run_id)} ({run.info.status}, sweep {short.get(sweep, sweep or '?')})"

    for r in runs:
        seed = _seed(r)
        slot = (label_of[r.info.run_id], seed or r.info.run_id)  # an unknown seed is never a duplicate
        have = kept.get(slot)
        if have is None:
            kept[slot] = r
            continue
        keep, drop = (r, have) if _rank(r) > _rank(have) else (have, r)
        kept[slot] = keep
        which = ("the newer finished run" if keep.info.status == "FINISHED" else "the run an alarm stopped (a result)"
                 if alarms(keep) and not is_result(drop) else "the newer run (neither a result)")
        notes.append(f"compare: {key}={slot[0]} seed {seed} appears twice: dropped run {name(drop)}, "
                     f"kept {which} {name(keep)}")
    ids = {r.info.run_id for r in kept.values()}
    return [r for r in runs if r.info.run_id in ids], notes


def _param_labels(runs: list) -> tuple[str, dict[str, str]]:
    """Plain runs: rows by the config values that differ between them (seeds aside)."""
    diff = _differing_params(runs)
    key = ", ".join(diff) if diff else "runs"
    if len(diff) == 1:
        return key, {r.info.run_id: r.data.params.get(diff[0], "") for r in runs}
    if diff:
        return key, {r.info.run_id: ", ".join(f"{d}={r.data.params.get(d, '')}" for d in diff) for r in runs}
    # identical configs: one row (seeds of one method), or each run if no params at all
    any_params = any(r.data.params for r in runs)
    return key, {r.info.run_id: ("all" if any_params else (r.info.run_name or r.info.run_id[:8])) for r in runs}


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
