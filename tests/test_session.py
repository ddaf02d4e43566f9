"""Engines reused across runs (a sweep's trials) equal fresh engines.

Run A (grpo) and then run B (stapo, another seed and lr) go through one `EngineSession`; run B
is then repeated with engines of its own. B's first step — the batch it sampled, its loss,
entropy and gradient norm — must be the same either way: a reset learner starts from the base
weights with a fresh optimizer, and the vLLM actors are back on the base weights.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

SAME = ("batch/fingerprint", "critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
        "stapo/spurious_ratio", "response_length/mean")
COMMON = ["trainer.total_steps=2", "trainer.save_freq=0", "eval.every_n_steps=0"]
RUN_A = ["loss=grpo", "trainer.seed=0"]
RUN_B = ["loss=stapo", "loss.tau_p=0.2", "trainer.seed=1", "learner.lr=2e-4"]


@pytest.fixture(scope="module")
def runs(training_store, engine_pool):
    """A then B on the suite's engines (A may find them running: the modules before it share their
    key), then B again on fresh ones."""
    from stapoctl.trainer.driver import train

    with training_store("session_store", COMMON) as t:
        a = train(t.conf(RUN_A), console=t.console, session=engine_pool)
        a_started = not engine_pool.engines.info["reused"]
        b_reused = train(t.conf(RUN_B), console=t.console, session=engine_pool)
        reused_info = dict(engine_pool.engines.info)
        engine_pool.discard()
        b_fresh = train(t.conf(RUN_B), console=t.console, session=engine_pool)
        fresh_info = dict(engine_pool.engines.info)
    return {"a": a, "b_reused": b_reused, "b_fresh": b_fresh, "uri": t.uri, "info": reused_info,
            "fresh_info": fresh_info, "a_started": a_started, "log": t.console.export_text()}


def first_step(uri: str, run_id: str) -> dict[str, float]:
    import mlflow

    client = mlflow.MlflowClient(uri)
    return {k: next(m.value for m in client.get_metric_history(run_id, k) if m.step == 1) for k in SAME}


def test_reused_engines_give_a_fresh_runs_first_step(runs):
    reused = first_step(runs["uri"], runs["b_reused"]["run_id"])
    fresh = first_step(runs["uri"], runs["b_fresh"]["run_id"])
    for key in SAME:
        assert reused[key] == pytest.approx(fresh[key], rel=1e-5, abs=1e-6), key
    assert reused["actor/grad_norm"] > 0, "no learning signal at step 1: the comparison would be vacuous"
    # and run A really was different work (else equal numbers would prove nothing about the reset)
    a = first_step(runs["uri"], runs["a"]["run_id"])
    assert a["batch/fingerprint"] != reused["batch/fingerprint"]


def test_the_second_run_reused_the_engines(runs):
    assert runs["info"]["reused"] is True and runs["fresh_info"]["reused"] is False
    # the start says why (the suite's start table prints it)
    assert runs["fresh_info"]["reason"] == "previous engines discarded", runs["fresh_info"]["reason"]
    assert "engines reused (learner reset + weight sync in" in runs["log"]
    assert runs["log"].count("engines up in") == 1 + runs["a_started"]  # the fresh run B's (and run A's start)
    import mlflow

    client = mlflow.MlflowClient(runs["uri"])
    statuses = {client.get_run(runs[k]["run_id"]).info.status for k in ("a", "b_reused", "b_fresh")}
    assert statuses == {"FINISHED"}


def _engine_processes() -> set[int]:
    """The engine actors in this test's own process tree: a Ray started here runs under pytest,
    and another suite's engines on this machine are none of this test's business."""
    import psutil

    out = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
            if proc.status() != psutil.STATUS_ZOMBIE and ("ray::RolloutWorker" in cmd or "ray::Learner" in cmd):
                out.add(proc.pid)
        except psutil.Error:
            pass
    return out


def _alive(pids: set[int]) -> set[int]:
    import psutil

    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.Error:
            pass
    return out


def test_a_refusal_after_the_engines_started_leaves_nothing_running(training_store, monkeypatch):
    """`train` starts Ray and the engine actors before it reads its data (so that set-up overlaps
    their start-up); a refusal there is still the one-line error, and what was started is gone:
    the actor processes it started (found in this process's tree while they ran, so one that
    outlives its Ray and leaves the tree is still caught)."""
    import time

    import ray

    from stapoctl.errors import UserError
    from stapoctl.trainer import engines
    from stapoctl.trainer.driver import train

    launched, started = [], set()
    real = engines.launch_engines
    before = _engine_processes()

    def spy(*args, **kwargs):
        launch = real(*args, **kwargs)
        launched.append(len(launch.workers) + len(launch.learners))
        deadline = time.monotonic() + 60
        while len(_engine_processes() - before) < launched[-1] and time.monotonic() < deadline:
            time.sleep(0.2)
        started.update(_engine_processes() - before)
        return launch

    monkeypatch.setattr(engines, "launch_engines", spy)
    was_up = ray.is_initialized()
    with training_store("refusal_store", COMMON) as t:
        with pytest.raises(UserError, match=r"data.max_prompt_length=1 tokens: raise it"):
            train(t.conf(["data.max_prompt_length=1"]), console=t.console)
    assert launched == [2], "the actors were not started before the data was read: nothing was tested"
    assert len(started) == 2, f"the two actor processes were not found in this test's process tree: {started}"
    assert _alive(started) == set(), "actor processes outlived the refusal"
    assert _engine_processes() <= before
    assert ray.is_initialized() == was_up  # the Ray it started is stopped
