"""The configuration matrix (issue #48 parts 3-4): tests/config_matrix.py's table checked whole without
engines (every leaf has one entry, every named test exists, every combination the pairwise array refuses is
refused in one line with exit 2), then its runs for real on the suite's shared engines (`e2e`): the table's
runs and the pairwise covering array's rows, each 2-3 steps, grouped so each engine key starts once.

Each run must finish (FINISHED), keep the fp32 log-prob contract at every measured step, log only finite
metrics (but config_matrix.NAN_BY_DESIGN), raise no alarm it did not ask for, and record every value it
set as an MLflow param; then each knob must show the effect the table says (`test_knob_effect`).
"""

from __future__ import annotations

import ast
import functools
import io
import itertools
import json
import math
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import config_matrix as M
from conftest import SUMMARY_LINES

ROOT = Path(__file__).resolve().parents[1]
CONTRACT, TOP_P_SHARE = 1e-4, 1e-3  # fp32: |Δ log p| per token; at top-p < 1 the share allowed above it
STATE = {"runs": 0, "keys": 0, "seconds": 0.0, "module_s": 0.0}


# -- the plan: every run's overrides, engine group by engine group ------------------------------------
def fmt(v) -> str:
    """A value as a Hydra override writes it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(fmt(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{fmt(x)}" for k, x in v.items()) + "}"
    s = str(v)
    return s if re.fullmatch(r"[\w.{}:/+-]+", s) else "'" + s.replace("'", "\\'") + "'"


def overrides_of(values: dict) -> list:
    """`key=value` of each leaf (a map's entries as `+key.entry=value`: Hydra adds them to the map)."""
    out = []
    for leaf, v in values.items():
        key = M.override_key(leaf)
        out += [f"+{key}.{k}={fmt(x)}" for k, x in v.items()] if isinstance(v, dict) else [f"{key}={fmt(v)}"]
    return out


def set_by(run: str) -> dict:
    """leaf → value of the table's entries that set a value in `run` (Run, and NoEffect with a run)."""
    return {leaf: e.value for leaf, e in M.TABLE.items()
            if isinstance(e, (M.Run, M.NoEffect)) and e.run == run and leaf != "loss.name"}


def common() -> list:
    return overrides_of(set_by("*"))


def _pairs(row: dict) -> set:
    return {((a, row[a].name), (b, row[b].name)) for a in row for b in row if a < b}


def pairwise_rows() -> list:
    """allpairspy's covering array, and the pairs its greedy search left out (it can, beside a filter) packed
    into rows of their own: each pair into the first extra row it fits without a refusal."""
    from allpairspy import AllPairs

    names = list(M.FACTORS)
    ok = lambda row: M.refused(dict(zip(names, (lv.name for lv in row)))) is None  # noqa: E731
    rows = [dict(zip(names, row)) for row in AllPairs([list(M.FACTORS[n]) for n in names], filter_func=ok)]
    left = sorted(p for p in _all_pairs() - set().union(*map(_pairs, rows)) if not M.refused(dict(p)))
    extra: list = []
    for (a, la), (b, lb) in left:
        for row in extra + [{}]:
            if all(row.get(f, lv) == lv for f, lv in ((a, la), (b, lb))) and not M.refused({**row, a: la, b: lb}):
                row.update({a: la, b: lb})
                if row not in extra:
                    extra.append(row)
                break
    for row in extra:  # the factors no left-out pair set: their first level that is not refused
        for n in names:
            row.setdefault(n, next(lv.name for lv in M.FACTORS[n] if not M.refused({**row, n: lv.name})))
        rows.append({n: _level(n, row[n]) for n in names})
    return rows


def _level(factor: str, name: str):
    return next(lv for lv in M.FACTORS[factor] if lv.name == name)


def _all_pairs() -> set:
    names = list(M.FACTORS)
    return {tuple(sorted(((a, la.name), (b, lb.name)))) for i, a in enumerate(names) for b in names[i + 1:]
            for la in M.FACTORS[a] for lb in M.FACTORS[b]}


def plan() -> list:
    """[(name, group, overrides, steps, alarms)] in the order they run."""
    out = []
    rows = pairwise_rows()
    for group in M.GROUP_ORDER:
        for name, spec in M.RUNS.items():
            if spec.group == group:
                values = overrides_of(set_by(name))
                ov = common() + list(M.GROUPS[group]) + list(spec.extra) + values + [f"trainer.total_steps={spec.steps}"]
                out.append((name, group, ov, spec.steps, spec.alarms))
        for i, row in enumerate(rows):
            if M.ENGINE_GROUP[row["engine"].name] == group:
                ov = common() + [o for lv in row.values() for o in lv.overrides]
                if row["mode"].name != "sync" and not any(o.startswith("rollout.num_threads=") for o in ov):
                    ov.append("rollout.num_threads={sync_threads}")  # async's auto threads would be another key
                out.append((f"pairwise{i:02d}", group, ov, 2, ()))
    return out


PLAN = plan()


def fill(text: str, ctx: dict) -> str:
    return re.sub(r"\{(run:)?(\w+)\}", lambda m: str(ctx["runs"][m.group(2)]["run_id"] if m.group(1) else ctx[m.group(2)]),
                  text)


# -- engine-free: the table whole ---------------------------------------------------------------------
def test_every_leaf_has_one_entry_and_every_entry_is_a_leaf():
    leaves = M.leaves()
    missing = sorted(set(leaves) - set(M.TABLE))
    stale = sorted(set(M.TABLE) - set(leaves))
    assert not missing, f"config leaves without an entry in tests/config_matrix.py TABLE: {missing}"
    assert not stale, f"TABLE entries for leaves the config no longer has: {stale}"
    for leaf, e in M.TABLE.items():
        assert isinstance(e, (M.Run, M.Covered, M.NoEffect)), leaf
        if isinstance(e, M.Run) and leaf != "loss.name" and "{" not in str(e.value):
            assert e.value != leaves[leaf], f"{leaf}: the run's value {e.value!r} is the default"


def test_every_run_and_observation_the_table_names_is_there():
    from stapoctl.config.losses import LOSS_CONFIGS

    assert set(M.LOSS_NAME) == set(LOSS_CONFIGS), "every registered loss runs for real (config_matrix.LOSS_NAME)"
    checks = {n[len("check_"):] for n in globals() if n.startswith("check_")}
    entries = [(leaf, e.run, e.observe) for leaf, e in M.TABLE.items() if isinstance(e, M.Run) and leaf != "loss.name"]
    entries += [(f"loss={k}", run, obs) for k, (run, obs) in M.LOSS_NAME.items()]
    methods = M.loss_leaves()
    for leaf, run, observe in entries:
        assert run == "*" or run in M.RUNS, (leaf, run)
        assert observe, f"{leaf}: a value run for real says how it shows"
        for o in observe:
            assert o.kind != "check" or o.key in checks, (leaf, o.key)
            assert o.kind not in ("differs", "same") or o.vs in M.RUNS, (leaf, o.vs)
        if leaf.count(".") == 2 and leaf.startswith("loss."):  # a method's own field: its run trains that method
            chosen = [o.split("=")[1] for o in M.RUNS[run].extra if o.startswith("loss=")] or ["stapo"]
            assert chosen[-1] in methods[leaf], (leaf, run, chosen)
    for leaf, e in M.TABLE.items():
        if isinstance(e, M.NoEffect) and e.run:
            assert e.run in M.RUNS and e.value is not None, leaf


@functools.lru_cache(maxsize=None)
def _named(test: str) -> tuple:
    path, _, name = test.partition("::")
    file = ROOT / path
    assert file.is_file(), f"{test}: no such file"
    src = file.read_text()
    funcs = {n.name: ast.get_source_segment(src, n) for n in ast.walk(ast.parse(src))
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert name in funcs, f"{test}: no such test"
    return funcs[name], src


def test_every_named_test_exists_and_names_its_field():
    named = [(leaf, e.test) for leaf, e in M.TABLE.items() if isinstance(e, M.Covered)]
    named += [(leaf, e.unit) for leaf, e in M.TABLE.items() if isinstance(e, (M.Run, M.NoEffect)) and e.unit]
    silent = []
    for leaf, test in named:
        body, module = _named(test)
        if leaf.split(".")[-1] not in body + module:
            silent.append(f"{test} (the entry of {leaf})")
    assert not silent, f"named tests that never name their field: {silent}"


def refused_pairs() -> list:
    names = list(M.FACTORS)
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for la in M.FACTORS[a]:
                for lb in M.FACTORS[b]:
                    if M.refused({a: la.name, b: lb.name}):
                        out.append(((a, la), (b, lb)))
    return out


def test_the_pairwise_array_covers_every_pair_that_is_not_refused():
    rows = pairwise_rows()
    left = {p for p in _all_pairs() - set().union(*map(_pairs, rows)) if not M.refused(dict(p))}
    assert not left, f"pairs no row covers: {sorted(left)}"
    assert not any(M.refused({f: lv.name for f, lv in row.items()}) for row in rows)


@pytest.mark.parametrize("pair", refused_pairs(), ids=lambda p: f"{p[0][1].name}+{p[1][1].name}")
def test_a_combination_refused_by_design_is_one_line_and_exit_2(pair, tmp_path):
    from stapoctl.config.compose import compose_config
    from stapoctl.errors import UserError

    overrides = [o for _, lv in pair for o in lv.overrides]
    with pytest.raises(UserError) as err:
        compose_config(overrides)
    assert "\n" not in str(err.value) and M.refused({f: lv.name for f, lv in pair})
    res = subprocess.run([sys.executable, "-m", "stapoctl.cli", "train", "--dry-run", *overrides], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200", "STAPOCTL_HOME": str(tmp_path)})
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and str(err.value) in lines[0], res.stderr


def test_every_run_of_the_matrix_composes():
    from stapoctl.config.compose import compose_config

    ctx = {"model_dir": "/nonexistent/model", "uri": "sqlite:////tmp/none.db", "out": "/tmp/out", "sync_threads": 2,
           "runs": {"base": {"run_id": "0" * 32}}}
    names = [name for name, *_ in PLAN]
    assert len(names) == len(set(names)) and set(M.RUNS) <= set(names)
    for name, group, overrides, *_ in PLAN:
        compose_config([fill(o, ctx) for o in overrides])


# -- the runs, for real --------------------------------------------------------------------------------
def metric_history(uri: str, run_id: str) -> dict:
    """key → {step: value} of a run, read from its sqlite store in one query (NaN kept as NaN)."""
    with sqlite3.connect(uri[len("sqlite:///"):]) as db:
        rows = db.execute("SELECT key, step, value, is_nan FROM metrics WHERE run_uuid = ?", (run_id,)).fetchall()
    out: dict = {}
    for key, step, value, is_nan in rows:
        out.setdefault(key, {})[int(step)] = math.nan if is_nan else float(value)
    return out


def record(client, uri: str, summary: dict, conf, reused: bool) -> dict:
    run = client.get_run(summary["run_id"])
    return {"run_id": summary["run_id"], "run_dir": summary["run_dir"], "status": run.info.status,
            "run_name": run.info.run_name, "experiment": client.get_experiment(run.info.experiment_id).name,
            "params": run.data.params, "tags": run.data.tags, "metrics": metric_history(uri, summary["run_id"]),
            "conf": conf, "reused": reused}


@pytest.fixture(scope="module")
def matrix(shared_home, engine_pool, tmp_path_factory):
    """Every planned run on the pool's engines, in PLAN's order: name → its record (or {"error": line})."""
    import mlflow
    from rich.console import Console

    from stapoctl.config.compose import compose_config
    from stapoctl.trainer.driver import train
    from stapoctl.trainer.engine_settings import thread_counts

    store = tmp_path_factory.mktemp("matrix")
    uri = f"sqlite:///{store / 'mlflow.db'}"
    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_HOME", str(shared_home.home))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    ctx = {"model_dir": str(shared_home.model_dir), "uri": uri, "runs": {},
           "sync_threads": thread_counts(compose_config(shared_home.overrides))[0]}  # the sync loop's auto threads
    keys, t0 = [], time.monotonic()
    try:
        for name, group, overrides, *_ in PLAN:
            ctx["out"] = str(store / name)
            conf = compose_config(shared_home.overrides + [fill(o, ctx) for o in overrides])
            try:
                summary = train(conf, console=Console(file=io.StringIO(), width=200), session=engine_pool)
            except Exception as exc:  # the run's own test names it
                ctx["runs"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                continue
            keys.append(engine_pool.key)
            ctx["runs"][name] = record(mlflow.MlflowClient(uri), uri, summary, conf, engine_pool.engines.info.get("reused"))
    finally:
        mp.undo()
    STATE.update(runs=len(PLAN), keys=len(set(keys)), seconds=time.monotonic() - t0)
    yield SimpleNamespace(runs=ctx["runs"], ctx=ctx, keys=keys, uri=uri, client=mlflow.MlflowClient(uri))


def _run(matrix, name: str) -> dict:
    rec = matrix.runs[name]
    assert "error" not in rec, f"{name}: {rec['error']}"
    return rec


@pytest.mark.e2e
def test_each_engine_key_started_once(matrix):
    """One key per engine group, its runs one after another: no run came back to engines it had left."""
    runs_of = [k for k, _ in itertools.groupby(matrix.keys)]
    assert len(runs_of) == len(set(runs_of)) == len(M.GROUP_ORDER), f"{len(runs_of)} stretches of {len(set(runs_of))} keys"


def _contract(rec: dict, top_p: float) -> None:
    """Every measured step whose batch the learner's current weights generated (async: a stale batch's
    log-probs are the previous policy's, by design)."""
    m = rec["metrics"]
    diff, frac = m.get("rollout/logprob_diff_max", {}), m.get("rollout/logprob_diff_frac_above_1e-4", {})
    fresh = {s: v for s, v in diff.items() if not m.get("async/staleness", {}).get(s)}
    assert fresh, f"no step measured the learner's log-probs against vLLM's on a fresh batch: {diff}"
    for step, value in sorted(fresh.items()):
        if top_p < 1 and step in frac:  # a kept set that differs on the two sides: ≤ 1e-3 of the tokens
            assert frac[step] <= TOP_P_SHARE, f"step {step}: {frac[step]:.2e} of the tokens differ by > {CONTRACT}"
        else:
            assert value <= CONTRACT, f"step {step}: rollout/logprob_diff_max {value:.3g} > {CONTRACT}"


@pytest.mark.e2e
@pytest.mark.parametrize("name, group, overrides, steps, alarms", PLAN, ids=[p[0] for p in PLAN])
def test_the_run_finishes_cleanly_and_records_its_values(matrix, name, group, overrides, steps, alarms):
    from omegaconf import OmegaConf

    rec = _run(matrix, name)
    conf = rec["conf"]
    assert rec["status"] == "FINISHED", rec["status"]
    if conf.model.dtype == "float32":
        _contract(rec, float(conf.rollout.top_p))
    bad = sorted(k for k, h in rec["metrics"].items() if k not in M.NAN_BY_DESIGN and not all(map(math.isfinite, h.values())))
    assert not bad, f"non-finite metrics: {bad}"
    raised = {k[len("stapoctl.alarm."):] for k in rec["tags"] if k.startswith("stapoctl.alarm.")}
    assert raised == set(alarms) and "stapoctl.alarm_stopped" not in rec["tags"], raised
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+")
        if "=" in o and "." in key:
            value = OmegaConf.select(conf, key)
            value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            flat = {f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value}
            for k, v in flat.items():
                assert rec["params"].get(k) == ("" if v is None else str(v)), (k, rec["params"].get(k), v)


def _metric(rec: dict, key: str, step) -> float:
    h = rec["metrics"].get(key, {})
    assert step in h, f"{key} not logged at step {step} (steps {sorted(h)})"
    return h[step]


OPS = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b, ">": lambda a, b: a > b,
       "<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b, "~": lambda a, b: math.isclose(a, b, rel_tol=1e-3)}


def observe(o: M.Obs, rec: dict, matrix) -> None:
    h, fill_ = rec["metrics"].get(o.key, {}), (lambda v: fill(v, matrix.ctx) if isinstance(v, str) else v)
    if o.kind in ("differs", "same"):
        a, b = _metric(rec, o.key, o.step), _metric(_run(matrix, o.vs), o.key, o.step)
        same = math.isclose(a, b, rel_tol=o.rel, abs_tol=0.0) if o.rel else a == b
        assert same == (o.kind == "same"), f"{o.key} at step {o.step}: {a!r} here, {b!r} in {o.vs}"
    elif o.kind == "cmp":
        assert h, f"{o.key} never logged"
        vals = {o.step: _metric(rec, o.key, o.step)} if o.step not in (None, "any") else h
        hits = [OPS[o.op](v, o.value) for v in vals.values()]
        assert (any(hits) if o.step == "any" else all(hits)), f"{o.key} {o.op} {o.value}: {vals}"
    elif o.kind in ("present", "absent"):
        assert bool(h) == (o.kind == "present"), f"{o.key}: {h}"
    elif o.kind == "steps":
        assert tuple(sorted(h)) == o.value, f"{o.key} logged at {sorted(h)}"
    elif o.kind == "tag":
        assert o.key in rec["tags"] and (o.value is None or rec["tags"][o.key] == fill_(o.value)), rec["tags"].get(o.key)
    elif o.kind == "param":
        assert rec["params"].get(o.key) == str(o.value), rec["params"].get(o.key)
    elif o.kind == "artifact":
        parent = o.key.rsplit("/", 1)[0]
        assert o.key in {a.path for a in matrix.client.list_artifacts(rec["run_id"], parent)}, o.key
    else:
        globals()[f"check_{o.key}"](rec, matrix)


EFFECTS = [pytest.param(leaf, e.run, e.observe, id=leaf,
                        marks=[pytest.mark.xfail(strict=True, reason=e.xfail)] if e.xfail else [])
           for leaf, e in M.TABLE.items() if isinstance(e, M.Run) and leaf != "loss.name"]
EFFECTS += [pytest.param(f"loss={k}", run, obs, id=f"loss.name={k}") for k, (run, obs) in M.LOSS_NAME.items()]


@pytest.mark.e2e
@pytest.mark.parametrize("leaf, run, observations", EFFECTS)
def test_knob_effect(matrix, leaf, run, observations):
    rec = _run(matrix, "base" if run == "*" else run)
    for o in observations:
        observe(o, rec, matrix)


@pytest.mark.e2e
@pytest.mark.parametrize("index", range(len(pairwise_rows())), ids=lambda i: f"pairwise{i:02d}")
def test_pairwise_row_shows_each_level(matrix, index):
    row = pairwise_rows()[index]
    rec = _run(matrix, f"pairwise{index:02d}")
    for factor, level in row.items():
        for o in level.observe:
            try:
                observe(o, rec, matrix)
            except AssertionError as exc:
                raise AssertionError(f"{factor}={level.name}: {exc}") from None


# -- the checks the table names (check_<name>) --------------------------------------------------------
def check_no_checkpoints(rec, matrix):
    assert not (Path(rec["run_dir"]) / "checkpoints").exists()


def check_in_store(rec, matrix):
    assert rec["params"]["tracking.uri"] == matrix.uri


def check_batching(rec, matrix):
    c = rec["conf"]
    per_step = c.data.train_batch_size // c.learner.ppo_mini_batch_size * c.learner.ppo_epochs  # one micro-batch each
    for s in (1, 2):
        assert _metric(rec, "actor/optimizer_steps", s) == s * per_step
        assert _metric(rec, "perf/update_micro_batches", s) == per_step


def check_responses(rec, matrix):
    c = rec["conf"]
    tokens, mean = _metric(rec, "loss/response_tokens", 1), _metric(rec, "response_length/mean", 1)
    assert tokens / mean == pytest.approx(c.rollout.n * c.data.train_batch_size, rel=1e-6)


def check_score_values(rec, matrix):
    c, m = rec["conf"], rec["metrics"]
    assert all(v == c.reward.incorrect for v in m["critic/score/min"].values())
    right = [s for s, a in m["reward/accuracy"].items() if a > 0]
    assert right, "no correct answer in the run: reward.correct unseen"
    assert all(m["critic/score/max"][s] == c.reward.correct for s in right)


def check_lr_schedule(rec, matrix):
    c = rec["conf"]
    for s in (1, 2):  # after s optimizer steps (one a step): lr · min(1, (s + 1) / warmup)
        assert _metric(rec, "actor/lr", s) == pytest.approx(c.learner.lr * min(1.0, (s + 1) / c.learner.warmup_steps))


def check_rollout_threads(rec, matrix):
    assert json.loads(rec["tags"]["stapoctl.threads"])["rollout"] == int(matrix.ctx["sync_threads"])


def check_learner_threads(rec, matrix):
    assert json.loads(rec["tags"]["stapoctl.threads"])["learner"] == rec["conf"].learner.num_threads


def _artifact(rec, matrix, path: str) -> str:
    return Path(matrix.client.download_artifacts(rec["run_id"], path, rec["run_dir"] + "/.matrix")).read_text()


def check_protocol_max_tokens(rec, matrix):
    assert json.loads(_artifact(rec, matrix, "eval_protocol.json"))["max_tokens"] == rec["conf"].eval.max_response_length


def check_samples(rec, matrix):
    assert _artifact(rec, matrix, "samples/step_000001.md").count("### reward") == rec["conf"].trainer.log_samples


def check_output_dir(rec, matrix):
    out = Path(rec["conf"].trainer.output_dir)
    assert Path(rec["run_dir"]) == out and (out / "checkpoints" / "step_000001").is_dir()


def check_experiment(rec, matrix):
    assert rec["experiment"] == rec["conf"].tracking.experiment


def check_run_name(rec, matrix):
    assert rec["run_name"] == rec["conf"].tracking.run_name


def check_no_artifacts(rec, matrix):
    assert not matrix.client.list_artifacts(rec["run_id"])


def check_no_alarm(rec, matrix):
    assert min(rec["metrics"]["actor/entropy"].values()) < rec["conf"].trainer.alarm_limits.entropy_floor  # it would fire
    assert not [k for k in rec["tags"] if k.startswith("stapoctl.alarm")]


def check_alarm_checkpoint(rec, matrix):
    assert (Path(rec["run_dir"]) / "checkpoints" / "step_000001").is_dir()  # trainer.save_freq=0: the alarm's


def check_finished(rec, matrix):
    assert rec["status"] == "FINISHED" and "stapoctl.alarm.sync_canary" in rec["tags"]


# -- the summary line ---------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _summary():
    t0 = time.monotonic()
    yield
    STATE["module_s"] += time.monotonic() - t0
    kinds = [type(e).__name__ for e in M.TABLE.values()]
    SUMMARY_LINES["config matrix"] = (
        f"config matrix: {len(M.TABLE)} fields covered ({kinds.count('Run')} run for real, {kinds.count('Covered')} "
        f"covered by named tests, {kinds.count('NoEffect')} no effect), {STATE['runs']} runs, {STATE['keys']} engine "
        f"keys, {STATE['seconds']:.0f} s (the module: {STATE['module_s']:.0f} s)")
