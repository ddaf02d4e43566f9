"""RewardPool: parallel scoring with a hard per-check time limit that works off the main thread.

The pathological answer 9^{9^{9^{9}}} makes sympy try to evaluate 9^(9^387420489) while
comparing with 1 — by hand it had not finished after 8 s (left alone it runs on and grows).
math-verify's SIGALRM timeout cannot stop it in a thread or a Ray actor; the pool must.
"""

from __future__ import annotations

import threading
import time

import pytest
from omegaconf import OmegaConf

from stapoctl.config.schema import RewardConfig
from stapoctl.reward.pool import EquivalenceChecker, RewardPool

PATHOLOGICAL = "\\boxed{9^{9^{9^{9}}}}"
LIMIT_S = 1.0
SLACK_S = 4.0  # kill + replace + busy 2-core machine; far below "hangs forever"


def _cfg(**kw):
    return OmegaConf.structured(RewardConfig(**{"verify_timeout_s": LIMIT_S, "num_workers": 2, **kw}))


@pytest.fixture(scope="module")
def pool():
    p = RewardPool(_cfg())
    yield p
    p.close()


def test_score_batch_values_and_stats(pool):
    responses = [
        "\\boxed{\\frac{1}{2}}",  # 0.5 -> correct (symbolic check in a subprocess)
        "\\boxed{7}",  # reference 8 -> incorrect
        "answer 8",  # no box -> incorrect, counted as no_answer
        "\\boxed{1,000}",  # 1000 -> correct (string normalization)
    ]
    rewards, stats = pool.score(responses, ["0.5", "8", "8", "1000"])
    assert rewards == [1.0, -1.0, -1.0, 1.0]
    assert stats["reward/accuracy"] == 0.5
    assert stats["reward/mean"] == 0.0
    assert stats["reward/no_answer"] == 0.25
    assert stats["reward/verify_timeouts"] == 0.0 and stats["reward/verify_errors"] == 0.0


def test_correct_incorrect_values_configurable():
    p = RewardPool(_cfg(correct=1.0, incorrect=0.0, num_workers=1))
    try:
        rewards, _ = p.score(["\\boxed{2}", "\\boxed{3}"], ["2", "2"])
        assert rewards == [1.0, 0.0]
    finally:
        p.close()


def _score_pathological(pool):
    """Pathological check among normal ones: returns (rewards, stats, seconds)."""
    t0 = time.monotonic()
    rewards, stats = pool.score([PATHOLOGICAL, "\\boxed{\\frac{2}{4}}", "\\boxed{3}"], ["1", "0.5", "3"])
    return rewards, stats, time.monotonic() - t0


def _assert_timed_out(rewards, stats, seconds):
    assert rewards == [-1.0, 1.0, 1.0]  # the stuck check is incorrect, the others unaffected
    assert stats["reward/verify_timeouts"] == 1.0
    assert seconds < LIMIT_S + SLACK_S, seconds


def test_timeout_main_thread(pool):
    pool.score(["\\boxed{\\frac12}"], ["0.5"])  # children up before timing
    _assert_timed_out(*_score_pathological(pool))
    # the killed child was replaced: the pool still answers
    assert pool.score(["\\boxed{\\sqrt{8}}"], ["2\\sqrt{2}"])[0] == [1.0]


def test_timeout_in_non_main_thread(pool):
    pool.score(["\\boxed{\\frac12}"], ["0.5"])
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=_score_pathological(pool)))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "scoring hung in a worker thread"
    _assert_timed_out(*out["r"])


def test_is_equivalent_timeout_in_thread():
    """The public one-pair API is bounded too (shared checker), also off the main thread."""
    from stapoctl.reward import is_equivalent

    checker = EquivalenceChecker(num_workers=1)
    checker.check("\\frac12", "0.5")  # start the child outside the timed part
    out = {}

    def run():
        t0 = time.monotonic()
        out["verdict"] = checker.check("9^{9^{9^{9}}}", "1", timeout_s=LIMIT_S)
        out["s"] = time.monotonic() - t0

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    checker.close()
    assert out["verdict"] == (False, True)
    assert out["s"] < LIMIT_S + SLACK_S
    assert checker.timeouts == 1 and checker.restarts == 1

    # and through the one-pair public API, in a thread: bounded, incorrect
    is_equivalent("0.5", "\\frac{1}{2}")  # start the shared checker's child first
    thread = threading.Thread(target=lambda: out.update(
        t0=time.monotonic(), api=is_equivalent("9^{9^{9^{9}}}", "1", timeout_s=LIMIT_S), t1=time.monotonic()))
    thread.start()
    thread.join(timeout=60)
    assert out["api"] is False
    assert out["t1"] - out["t0"] < LIMIT_S + SLACK_S
    assert is_equivalent("0.5", "\\frac{1}{2}") is True  # the replaced child answers


@pytest.mark.engine
def test_timeout_inside_ray_actor_and_task(tmp_path, ray_runtime):
    """Where math-verify's own timeout silently never fires: inside Ray workers."""
    import ray

    from stapoctl.launch.ray_runtime import ensure_ray, shutdown_ray

    started_here = not ray.is_initialized()
    ensure_ray(OmegaConf.create({"num_cpus": 2}))
    try:
        cfg = RewardConfig(verify_timeout_s=LIMIT_S, num_workers=1)
        patho = PATHOLOGICAL

        # defined here so Ray ships it by value (this test module is not importable in workers)
        def score_pathological(pool):
            t0 = time.monotonic()
            rewards, stats = pool.score([patho, "\\boxed{\\frac{2}{4}}", "\\boxed{3}"], ["1", "0.5", "3"])
            return rewards, stats, time.monotonic() - t0

        @ray.remote(num_cpus=0)
        class Scorer:
            def __init__(self, cfg):
                self.pool = RewardPool(cfg)
                self.pool.score(["\\boxed{\\frac12}"], ["0.5"])  # warm children

            def run(self):
                return score_pathological(self.pool)

            def close(self):
                self.pool.close()

        @ray.remote(num_cpus=0)
        def score_task(cfg):
            p = RewardPool(cfg)
            try:
                p.score(["\\boxed{\\frac12}"], ["0.5"])
                return score_pathological(p)
            finally:
                p.close()

        actor = Scorer.remote(cfg)
        _assert_timed_out(*ray.get(actor.run.remote(), timeout=120))
        ray.get(actor.close.remote())
        ray.kill(actor)
        _assert_timed_out(*ray.get(score_task.remote(cfg), timeout=120))
    finally:
        if started_here:
            shutdown_ray()


def test_pool_refuses_bad_timeout():
    from stapoctl.errors import UserError

    with pytest.raises(UserError, match="reward.verify_timeout_s"):
        RewardPool(_cfg(verify_timeout_s=0))


CRASHING = "\\crash{x}"  # goes to a verifier process (no string rule decides it)


@pytest.mark.parametrize("kind", ["segv", "exit", "oom"])
def test_verifier_crash_scores_incorrect_and_is_counted(monkeypatch, kind):
    """A check that kills its verifier process (or raises MemoryError in it) costs only its own sample.

    The fault is real: verify_server's test hook (STAPOCTL_TEST_VERIFY_FAULT=KIND:ANSWER) segfaults,
    exits or allocates past the memory cap when it is asked about ANSWER.
    """
    monkeypatch.setenv("STAPOCTL_TEST_VERIFY_FAULT", f"{kind}:{CRASHING}")
    p = RewardPool(_cfg(num_workers=2))
    try:
        p.score(["\\boxed{\\frac12}"], ["0.5"])  # children up
        responses = ["\\boxed{\\frac{2}{4}}", f"\\boxed{{{CRASHING}}}", "\\boxed{\\sqrt{8}}", "\\boxed{7}"]
        rewards, stats = p.score(responses, ["0.5", "2", "2\\sqrt{2}", "7"])
        assert rewards == [1.0, -1.0, 1.0, 1.0]
        assert stats["reward/verify_errors"] == 1.0 and stats["reward/verify_timeouts"] == 0.0
        assert p.checker.errors == 1
        # a crash replaced the process; a MemoryError is answered by the process that survived it
        assert p.checker.restarts == (0 if kind == "oom" else 1)
        # the run goes on: the pool still judges, and the same answer crashes again, counted again
        assert p.score(["\\boxed{\\sqrt{8}}", f"\\boxed{{{CRASHING}}}"], ["2\\sqrt{2}", "2"])[0] == [1.0, -1.0]
        assert p.checker.errors == 2
    finally:
        p.close()


def test_verifier_that_cannot_start_is_an_error_not_a_hang():
    """A child dying at start-up raises after three tries instead of respawning forever.

    A 50 MB address-space cap is too small for the interpreter to import sympy: every child dies.
    """
    checker = EquivalenceChecker(num_workers=1, max_memory_gb=0.05)
    try:
        with pytest.raises(RuntimeError, match="exited during start-up 3 times"):
            checker.check("\\frac12", "0.5")
    finally:
        checker.close()
