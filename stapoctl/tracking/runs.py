"""`stapoctl runs` and `stapoctl ui`: the terminal's and the browser's view of the run store.

`runs` fits an 80-column terminal: git-style short ids, nested runs (a sweep's trials, the
eval runs of a training run) indented under their parent. `ui` serves MLflow's UI and prints
the URL of the experiment's runs table (MLflow 3 opens an experiment on its GenAI overview,
where no run is in sight) and, per sweep, a saved view with its trials side by side.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stapoctl.errors import UserError
from stapoctl.tracking import keys
from stapoctl.tracking.mlflow_run import tracking_uri
from stapoctl.tracking.run_ids import short_ids

STATUS = {"FINISHED": "done", "RUNNING": "running", "FAILED": "failed", "KILLED": "killed", "SCHEDULED": "queued"}


def _client(uri: Optional[str]):
    from stapoctl.tracking.store_init import client

    return client(tracking_uri(uri))


def _experiment(client, uri: Optional[str], experiment: str):
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise UserError(
            f"no MLflow experiment '{experiment}' in {tracking_uri(uri)}: run `stapoctl train` first "
            "or set --experiment / --uri (MLFLOW_TRACKING_URI)"
        )
    return exp


def _accuracy(run) -> str:
    """The run's headline accuracy: eval before val, T=1.0 before T=0.7, paper avg first."""
    m = run.data.metrics
    best = None
    for name, value in m.items():
        parsed = keys.parse_accuracy_metric(name)
        if parsed:
            source, bench, dec, _ = parsed
            rank = (source != "eval", dec != "train", bench)
            if best is None or rank < best[0]:
                best = (rank, value)
    avg = [v for k, v in m.items() if k.startswith("eval/avg") and k.endswith("/train/acc")]
    value = avg[0] if avg else (best[1] if best else None)
    return f"{100 * value:.1f}%" if value is not None else ""


def _label(run, parent) -> str:
    """A root shows its name; a sweep's trial its value and seed; other children their name."""
    t = run.data.tags
    if t.get(keys.KIND) == keys.KIND_SWEEP:
        return f"sweep {t.get(keys.SWEEP_NAME) or run.info.run_name or ''}".strip()
    if parent is not None and keys.SWEEP_VALUE in t:
        seed = t.get(keys.SEED)
        return f"{t[keys.SWEEP_VALUE]}" + (f" · seed {seed}" if seed not in (None, "") else "")
    return run.info.run_name or ""


def _what(run) -> str:
    """loss for a training run, the swept key for a sweep, 'eval' for an evaluation."""
    t, p = run.data.tags, run.data.params
    kind = t.get(keys.KIND, keys.KIND_TRAIN)
    if kind == keys.KIND_SWEEP:
        return p.get(keys.SWEEP_KEY, "")
    if kind == keys.KIND_EVAL:
        return "eval"
    return p.get(keys.LOSS_NAME) or t.get(keys.LOSS, "")


def run_alarms(run) -> str:
    """`entropy_collapse@23, grad_norm_spike@40`: the run-health alarms a run raised (tag
    stapoctl.alarm.<name>=<step>), whatever its status."""
    t = run.data.tags
    found = sorted((k[len(keys.ALARM_PREFIX):], v) for k, v in t.items() if k.startswith(keys.ALARM_PREFIX))
    return ", ".join(f"{name}@{step}" for name, step in found)


def run_inert(run) -> dict[str, str]:
    """knob → why: the configured terms that never changed the run's updates (tags
    stapoctl.inert.<knob>, written at the run's end by trainer/inert.py)."""
    t = run.data.tags
    return {k[len(keys.INERT_PREFIX):]: v for k, v in sorted(t.items()) if k.startswith(keys.INERT_PREFIX)}


def alarm_stopped(run) -> list[str]:
    """The alarms that stopped a KILLED run (tag stapoctl.alarm_stopped): a result, not a gap;
    [] for any other run, including one a person stopped after an alarm had only warned."""
    if run.info.status != "KILLED":
        return []
    return [n for n in run.data.tags.get(keys.ALARM_STOPPED, "").split(",") if n]


def list_runs(uri: Optional[str], experiment: str, console: Console, max_results: int = 50) -> list:
    """Newest top-level runs first, each followed by its nested runs as a tree."""
    from mlflow.entities import ViewType

    client = _client(uri)
    exp = _experiment(client, uri, experiment)
    eid = [exp.experiment_id]
    roots = client.search_runs(eid, filter_string=f"tags.`{keys.PARENT}` IS NULL",
                               order_by=["attributes.start_time DESC"], max_results=max_results)
    nested = client.search_runs(eid, filter_string=f"tags.`{keys.PARENT}` IS NOT NULL",
                                order_by=["attributes.start_time ASC"], max_results=50000)
    kids: dict[str, list] = {}
    for r in nested:
        kids.setdefault(r.data.tags[keys.PARENT], []).append(r)
    every = [r.info.run_id for r in client.search_runs(eid, run_view_type=ViewType.ALL, max_results=50000)]
    short = short_ids(every)

    table = Table(box=None, padding=(0, 1), collapse_padding=True, pad_edge=False, show_edge=False,
                  header_style="bold")
    table.add_column("id", no_wrap=True, style="yellow")
    table.add_column("run", overflow="fold", ratio=1)
    table.add_column("loss/key", overflow="fold", max_width=18)
    for col in ("status", "step", "score", "acc"):
        table.add_column(col, no_wrap=True, justify="left" if col == "status" else "right")
    shown = []

    def add(run, parent, prefix: str, last: bool) -> None:
        m = run.data.metrics
        branch = "" if parent is None else prefix + ("└ " if last else "├ ")
        score = m.get(keys.SCORE)
        table.add_row(short[run.info.run_id], escape(branch + _label(run, parent)), escape(_what(run)),  # names: text
                      STATUS.get(run.info.status, run.info.status.lower()) + (" !" if run_alarms(run) else ""),
                      run.data.tags.get(keys.STEP, ""),
                      f"{score:+.2f}" if score is not None else "", _accuracy(run))
        shown.append(run)
        children = kids.get(run.info.run_id, [])
        for i, child in enumerate(children):
            deeper = "" if parent is None else prefix + ("  " if last else "│ ")
            add(child, run, deeper, i == len(children) - 1)

    for run in roots:
        add(run, None, "", True)
    console.print(f"[bold]runs in '{escape(experiment)}'[/]", highlight=False)
    console.print(f"store {tracking_uri(uri)}", style="dim", highlight=False, markup=False)
    if not roots:
        console.print("(no runs yet: `stapoctl train`)")
        return []
    console.print(table)
    for run in shown:
        if run_alarms(run):
            console.print(f"! {short[run.info.run_id]} alarm: {run_alarms(run)}", style="red", highlight=False,
                          markup=False, soft_wrap=True)
        if run_inert(run):
            console.print(f"~ {short[run.info.run_id]} inert: " + "; ".join(run_inert(run).values()), style="yellow",
                          highlight=False, markup=False, soft_wrap=True)
    console.print("Short ids work wherever a run id is taken (compare, eval --model, resume=).",
                  style="dim", highlight=False)
    return shown


# -- ui -------------------------------------------------------------------------------------------
SHARED_VIEW = "mlflow.sharedViewState."  # MLflow's "share view" experiment tags: ?viewStateShareKey=
SWEEP_METRICS = (keys.ACCURACY, keys.ENTROPY, keys.SPURIOUS_RATIO, keys.RESPONSE_LENGTH)


def sweep_view(client, sweep) -> str:
    """Register a shared runs-table view of a sweep (its trials grouped by swept value, seeds
    averaged, the swept param, the seed and key metrics as columns); returns its share key.

    MLflow's UI cannot be told by URL to expand a parent's nested runs, but it loads a view
    saved as the experiment tag `mlflow.sharedViewState.<key>` (what its "Share" button writes).
    """
    import json

    sid = sweep.data.tags.get(keys.SWEEP_ID) or sweep.info.run_id
    trials = client.search_runs([sweep.info.experiment_id], filter_string=f"tags.`{keys.SWEEP_ID}` = '{sid}'",
                                max_results=1000)
    key = sweep.data.params.get(keys.SWEEP_KEY, "")
    params = [p for p in (keys.LOSS_NAME if key == "loss" else key, "trainer.seed")
              if p and any(p in t.data.params for t in trials)]
    val = sorted({m for t in trials for m in t.data.metrics if keys.parse_accuracy_metric(m)})
    metrics = val + [m for m in SWEEP_METRICS if any(m in t.data.metrics for t in trials)]
    state = {
        "searchFilter": f"tags.`{keys.SWEEP_ID}` = '{sid}'",
        "orderByKey": "attributes.start_time", "orderByAsc": True,
        "groupBy": {"aggregateFunction": "average",
                    "groupByKeys": [{"mode": "tag", "groupByData": keys.SWEEP_VALUE}]},
        "selectedColumns": [f"params.`{p}`" for p in params] + [f"metrics.`{m}`" for m in metrics],
    }
    share = f"stapoctl-sweep-{sweep.info.run_id[:12]}"
    client.set_experiment_tag(sweep.info.experiment_id, SHARED_VIEW + share, json.dumps(state))
    return share


PLAIN_VIEW = "stapoctl-runs"


def runs_view(client, exp) -> str:
    """Register the shared view of the experiment's top-level runs (the sweeps' columns: final
    validation accuracy, reward, entropy, spurious ratio, response length, the loss and the seed);
    returns its share key. A plain run shows these instead of no metric column at all."""
    import json

    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{keys.PARENT}` IS NULL", max_results=200)
    val = sorted({m for r in runs for m in r.data.metrics if keys.parse_accuracy_metric(m)})
    metrics = val + [m for m in SWEEP_METRICS if any(m in r.data.metrics for r in runs)]
    params = [p for p in (keys.LOSS_NAME, "trainer.seed") if any(p in r.data.params for r in runs)]
    state = {"orderByKey": "attributes.start_time", "orderByAsc": False,
             "selectedColumns": [f"params.`{p}`" for p in params] + [f"metrics.`{m}`" for m in metrics]}
    client.set_experiment_tag(exp.experiment_id, SHARED_VIEW + PLAIN_VIEW, json.dumps(state))
    return PLAIN_VIEW


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def _unspecified(host: str) -> bool:
    import ipaddress

    try:
        return not host or ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def ui_links(uri: Optional[str], experiment: str, host: str, port: int,
             run: Optional[str] = None) -> list[tuple[str, str]]:
    """(what, URL) to print: the experiment's runs table (MLflow 3 opens an experiment on its
    GenAI overview otherwise), a view per recent sweep; or the one run / sweep asked for."""
    from stapoctl.tracking.run_ids import resolve_run_id

    shown_host = "127.0.0.1" if _unspecified(host) else host  # a wildcard bind is reached via loopback here
    base = f"http://{shown_host}:{port}/#/experiments"
    client = _client(uri)
    if run:
        found = client.get_run(resolve_run_id(run, uri, what="ui"))
        eid = found.info.experiment_id
        if found.data.tags.get(keys.KIND) == keys.KIND_SWEEP:
            return [(f"sweep {found.data.tags.get(keys.SWEEP_NAME, '')}: trials by value, seeds averaged",
                     f"{base}/{eid}/runs?viewStateShareKey={sweep_view(client, found)}")]
        return [(f"run {found.info.run_name}", f"{base}/{eid}/runs/{found.info.run_id}")]
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return [(f"no experiment '{experiment}' in the store yet: the experiment list", base)]
    links = [(f"runs of '{experiment}' (nested runs sit under their parent: expand ▸)",
              f"{base}/{exp.experiment_id}/runs?viewStateShareKey={runs_view(client, exp)}")]
    sweeps = client.search_runs([exp.experiment_id], filter_string=f"tags.`{keys.KIND}` = '{keys.KIND_SWEEP}'",
                                order_by=["attributes.start_time DESC"], max_results=3)
    for sw in sweeps:
        links.append((f"sweep {sw.data.tags.get(keys.SWEEP_NAME, '')} {sw.info.run_id[:7]}: trials by value",
                      f"{base}/{exp.experiment_id}/runs?viewStateShareKey={sweep_view(client, sw)}"))
    return links


def serve_ui(uri: Optional[str], host: str, port: int) -> int:
    """The MLflow UI on our store; bound to loopback unless the user asks otherwise. A fresh
    sqlite store is created first, through its lock (`store_init`): the server would create it
    unguarded, racing a run or sweep that opens it at the same moment."""
    from stapoctl.tracking.store_init import ensure

    ensure(tracking_uri(uri))
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", tracking_uri(uri),
        "--host", host, "--port", str(port), "--workers", "1",
    ]
    return run_process_group(cmd, env)


def run_process_group(cmd: list[str], env: dict, grace_s: float = 5.0) -> int:
    """Run `cmd` in its own process group until it exits or we get SIGTERM/SIGHUP/SIGINT, then
    end the whole group: `mlflow server` forks a uvicorn child that outlives a signal to its
    parent and keeps the port (and a closed terminal or a batch scheduler sends SIGHUP/SIGTERM)."""
    import signal

    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    got: list[int] = []
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, lambda signum, _frame: got.append(signum))
        except ValueError:  # not the main thread: the caller owns the signals
            break
    try:
        while proc.poll() is None and not got:
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
    finally:
        end_process_group(proc, grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + got[0] if got else int(proc.returncode or 0)


def end_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to every process of `proc`'s group, SIGKILL to what is left after `grace_s`."""
    import signal
    import time

    def signal_group(sig) -> bool:
        try:
            os.killpg(proc.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):  # the group is gone
            return False

    if not signal_group(signal.SIGTERM):
        proc.poll()
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader so the group can empty
        if not signal_group(0):
            return
        time.sleep(0.1)
    signal_group(signal.SIGKILL)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
