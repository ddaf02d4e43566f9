"""Run-health alarms (trainer/alarms.py) on synthetic metric streams: each fires when its failure
shows, once, in one line, and a healthy stream (shaped like the embedded default run) fires none;
the loop's glue prints, tags and stops the run KILLED with the alarm named."""

from __future__ import annotations

import io
import random

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from stapoctl.config.alarms import AlarmLimits
from stapoctl.errors import AlarmStopped
from stapoctl.trainer import loop as loop_mod
from stapoctl.trainer.alarms import NAMES, HealthWatch, limits_from
from stapoctl.trainer.run_status import final_status


def healthy(step: int, rng: random.Random) -> dict:
    """A default-run-like step: entropy easing 0.26 → 0.20, accuracy climbing, nothing at the cap."""
    return {
        "actor/entropy": 0.26 - 0.001 * step + rng.gauss(0, 0.008),
        "actor/grad_norm": abs(rng.gauss(1.0, 0.25)),
        "response_length/clip_ratio": rng.choice([0.0, 0.0, 0.0, 1 / 64]),
        "reward/accuracy": min(0.95, 0.2 + 0.01 * step + rng.gauss(0, 0.05)),
        "rollout_corr/kl_k3": abs(rng.gauss(2e-4, 1e-4)),
        "stapo/spurious_ratio": abs(rng.gauss(3e-4, 2e-4)),
    }


def run(stream, limits=None) -> list:
    watch = HealthWatch(limits)
    return [a for step, m in enumerate(stream, 1) for a in watch.feed(step, m)]


def with_(n: int, seed: int = 0, **changes) -> list[dict]:
    """n healthy steps; changes[name] = f(step) → value overrides a metric from a step on."""
    rng = random.Random(seed)
    out = []
    for step in range(1, n + 1):
        m = healthy(step, rng)
        for name, f in changes.items():
            v = f(step)
            if v is not None:
                m[name.replace("__", "/")] = v
        out.append(m)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_a_healthy_stream_fires_nothing(seed):
    assert run(with_(200, seed)) == []


def fired(stream) -> list[tuple[str, int]]:
    return [(a.name, a.step) for a in run(stream)]


def test_entropy_below_the_floor():
    stream = with_(40, actor__entropy=lambda s: 0.02 if s >= 30 else None)
    assert fired(stream) == [("entropy_collapse", 30)]


def test_entropy_falling_faster_than_the_rate():
    """0.25 → 0.05 over 10 steps: still above the floor, but 80% of it gone."""
    stream = with_(40, actor__entropy=lambda s: None if s < 20 else max(0.05, 0.25 - 0.02 * (s - 20)))
    (alarm,) = run(stream)
    assert alarm.name == "entropy_collapse" and 25 <= alarm.step <= 31
    assert "fell" in alarm.message and "trainer.alarm_limits.entropy_drop" in alarm.message


def test_entropy_blowing_up():
    """A learning rate too high turns the policy to noise: entropy climbs instead of falling."""
    stream = with_(40, actor__entropy=lambda s: None if s < 20 else 0.25 * 1.5 ** (s - 19))
    (alarm,) = run(stream)
    assert alarm.name == "entropy_blowup" and 21 <= alarm.step <= 24 and "entropy_rise" in alarm.message


def test_grad_norm_spike():
    stream = with_(40, actor__grad_norm=lambda s: 25.0 if s == 30 else None)
    assert fired(stream) == [("grad_norm_spike", 30)]


def test_a_grad_norm_spike_needs_a_history():
    assert fired(with_(40, actor__grad_norm=lambda s: 25.0 if s == 3 else None)) == []


def test_length_at_the_cap_for_most_of_a_batch():
    stream = with_(40, response_length__clip_ratio=lambda s: 0.8 if s >= 20 else None)
    assert fired(stream) == [("length_at_cap", 22)]
    assert fired(with_(40, response_length__clip_ratio=lambda s: 0.8 if s in (20, 21, 23) else None)) == []


@pytest.mark.parametrize("level, where", [(0.0, "floor"), (1.0, "ceiling")])
def test_reward_flat_at_floor_or_ceiling(level, where):
    stream = with_(40, reward__accuracy=lambda s: level if s >= 15 else None)
    (alarm,) = run(stream)
    assert (alarm.name, alarm.step) == ("reward_flat", 24) and where in alarm.message


def test_rollout_mismatch_rising():
    stream = with_(40, rollout_corr__kl_k3=lambda s: 0.02 if s >= 25 else None)
    assert fired(stream) == [("rollout_mismatch", 26)]  # the 3-step mean crosses 0.01 at the second
    assert fired(with_(40, rollout_corr__kl_k3=lambda s: 0.02 if s == 25 else None)) == []  # one blip


def test_spurious_ratio_jumping():
    stream = with_(40, stapo__spurious_ratio=lambda s: 0.02 if s == 30 else None)
    assert fired(stream) == [("spurious_jump", 30)]


def test_every_alarm_fires_once_in_one_line():
    stream = with_(60, actor__entropy=lambda s: 0.01 if s >= 50 else 2.0 if s == 5 else None,
                   actor__grad_norm=lambda s: 40.0 if s == 30 else None,
                   response_length__clip_ratio=lambda s: 1.0 if s >= 40 else None,
                   reward__accuracy=lambda s: 0.0 if s >= 30 else None,
                   rollout_corr__kl_k3=lambda s: 0.1 if s >= 30 else None,
                   stapo__spurious_ratio=lambda s: 0.05 if s == 45 else None)
    alarms = run(stream)
    assert sorted(a.name for a in alarms) == sorted(NAMES)
    for a in alarms:
        assert "\n" not in a.message and a.message.startswith(f"alarm {a.name} at step {a.step}: ")


def test_missing_and_nan_metrics_are_skipped():
    watch = HealthWatch()
    assert watch.feed(1, {}) == [] and watch.feed(2, {"actor/entropy": float("nan")}) == []


def test_limits_from_a_config_that_predates_them():
    assert limits_from(None) == AlarmLimits()
    assert limits_from({"grad_z": 3, "entropy_floor": None}) == AlarmLimits(grad_z=3.0)
    assert fired(with_(40, actor__entropy=lambda s: 0.1)) == []  # low, but steady
    assert [a.name for a in run(with_(40, actor__entropy=lambda s: 0.1),
                                AlarmLimits(entropy_floor=0.15))] == ["entropy_collapse"]


class View:
    def __init__(self):
        self.out = io.StringIO()
        self.console = Console(file=self.out, width=80)


def loop_with(action: str, monkeypatch) -> tuple[loop_mod.Loop, dict]:
    tags: dict = {}
    monkeypatch.setattr(loop_mod, "set_tags", tags.update)
    conf = OmegaConf.create({"trainer": {"alarms": True, "alarm_action": action}})
    lp = loop_mod.Loop(conf, runner=None, sampler=None, run_id="abc123", run_dir=None, base_model="",
                       tokenizer_dir="", watch=HealthWatch())
    return lp, tags


@pytest.mark.parametrize("action, saves", [("warn", False), ("checkpoint", True), ("stop", True)])
def test_the_loop_prints_one_line_tags_the_run_and_acts(action, saves, monkeypatch):
    lp, tags = loop_with(action, monkeypatch)
    view = View()
    assert lp._alarms(view, 7, {"actor/entropy": 0.001}) is saves
    assert tags == {"stapoctl.alarm.entropy_collapse": "7"}
    lines = view.out.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("alarm entropy_collapse at step 7:")
    assert f"trainer.alarm_action={action}" in lines[0]
    assert lp._alarms(view, 8, {"actor/entropy": 0.001}) is False  # once a run
    if action != "stop":
        lp._end_if_alarmed(7)  # nothing to end
        return
    with pytest.raises(AlarmStopped) as exc:
        lp._end_if_alarmed(7)
    assert exc.value.alarms == ("entropy_collapse",) and exc.value.exit_code == 3
    assert "step_000007" in str(exc.value) and "resume=abc123" in str(exc.value)
    status, end_tags = final_status(exc.value)
    assert status == "KILLED" and "alarm entropy_collapse at step 7" in end_tags["stapoctl.stop_reason"]


def test_a_checkpoint_saved_before_alarms_existed_resumes_with_them_on(monkeypatch):
    """The saved config has no trainer.alarms / alarm_action / alarm_limits: resume validates, and
    the loop watches with the defaults; an override on the resume command line still applies."""
    from stapoctl.config.compose import compose_config
    from stapoctl.config.validate import validate_config
    from stapoctl.trainer.setup import resume_config

    saved = OmegaConf.to_container(compose_config([]), resolve=True)
    for key in ("alarms", "alarm_action", "alarm_limits"):
        del saved["trainer"][key]
    plain = resume_config(compose_config(["resume=/x"]), {"config": saved})
    assert "alarm_limits" not in plain.trainer
    validate_config(plain)
    assert plain.trainer.get("alarms", True) and limits_from(plain.trainer.get("alarm_limits")) == AlarmLimits()
    lp, tags = loop_with("warn", monkeypatch)
    lp.conf = plain
    assert lp._alarms(View(), 3, {"actor/entropy": 0.0}) is False and tags == {"stapoctl.alarm.entropy_collapse": "3"}
    stopping = resume_config(compose_config(["resume=/x", "trainer.alarm_action=stop"]), {"config": saved})
    assert stopping.trainer.alarm_action == "stop"


def recorded(name: str) -> list[tuple[int, dict]]:
    """A real run's per-step metrics (tests/data/alarm_streams.json, with the command that made it)."""
    import json
    from pathlib import Path

    run = json.loads((Path(__file__).parent / "data" / "alarm_streams.json").read_text())[name]
    return [(row[0], {k: v for k, v in zip(run["keys"], row[1:]) if v is not None}) for row in run["rows"]]


def test_the_embedded_default_run_raises_no_alarm():
    """`stapoctl train` (60 steps, STAPO, lr 1e-4): entropy 0.26 → ~0.2, accuracy 20% → ~75%."""
    watch = HealthWatch()
    steps = recorded("default_tiny_60")
    assert len(steps) == 61 and [a for step, m in steps for a in watch.feed(step, m)] == []


def test_the_embedded_default_at_lr_3e3_blows_up_and_the_alarms_say_so():
    """`stapoctl train loss=grpo learner.lr=3e-3 trainer.total_steps=30` (measured, docs/RUNS.md):
    the first step's updates wreck the policy — accuracy 0 from step 2, entropy 0.32 → 3.4 nats,
    most responses run to the length cap. Entropy rises, so entropy_collapse stays silent."""
    watch = HealthWatch()
    fired = [(a.name, a.step) for step, m in recorded("grpo_lr3e-3_30") for a in watch.feed(step, m)]
    assert fired == [("entropy_blowup", 4), ("length_at_cap", 5), ("reward_flat", 11)]


def test_entropy_minimisation_collapses_the_embedded_default_and_the_alarm_comes_first():
    """No learning rate alone collapses the embedded default's entropy (3e-4 holds ~0.2 nats; 1e-3 and
    3e-3 blow it up: docs/RUNS.md). Entropy minimisation does, measured: `stapoctl train loss=grpo
    loss.entropy_coef=-1 learner.lr=3e-4 trainer.total_steps=40` — entropy 0.25 → ~0.08 nats while
    the batch accuracy stays ~0.6. entropy_collapse fires first, with the reward far from its floor."""
    watch = HealthWatch()
    steps = recorded("grpo_entropy_min_lr3e-4_40")
    fired = [(a.name, a.step) for step, m in steps for a in watch.feed(step, m)]
    assert fired and fired[0][0] == "entropy_collapse", fired
    at = fired[0][1]
    acc = {step: m["reward/accuracy"] for step, m in steps if "reward/accuracy" in m}
    assert min(acc[s] for s in range(at - 2, at + 1)) > 0.3  # the reward is nowhere near its floor
    assert all(name != "reward_flat" for name, _ in fired)


class Source:
    """Steps whose entropy collapses at step 3 (a stand-in for PlainSteps: no engines)."""

    status = "fake"

    def __init__(self):
        self.closed = None

    def step(self, step: int):
        return None, {"actor/entropy": 0.001 if step >= 3 else 0.25}, {"at": step}

    def close(self, stopping: bool = False) -> None:
        self.closed = stopping


@pytest.mark.parametrize("action, steps, saves", [("warn", 10, []), ("checkpoint", 10, [3]), ("stop", 3, [3])])
def test_the_loop_checkpoints_or_stops_at_the_alarm_step(action, steps, saves, monkeypatch):
    from types import SimpleNamespace

    from stapoctl.trainer.run_record import ReplayCheck

    lp, tags = loop_with(action, monkeypatch)
    lp.runner = SimpleNamespace(engines=SimpleNamespace(wait_weights=lambda: None))
    source, saved, seen = Source(), [], []
    monkeypatch.setattr(lp, "_step_source", lambda *a: source)
    monkeypatch.setattr(lp, "_log_step", lambda view, step, *a: seen.append(step))
    monkeypatch.setattr(lp, "save", lambda step, state: saved.append((step, state["at"])))
    view = View()
    view.status = lambda *_: None
    last, at = lp._steps(view, 0, 0, loop_mod.Cadence(10, 0, 0, 0), ReplayCheck())
    assert seen == list(range(1, steps + 1)) and [s for s, _ in saved] == saves and all(s == a for s, a in saved)
    assert tags == {"stapoctl.alarm.entropy_collapse": "3"} and source.closed == (action == "stop")
    assert at == (3 if saves else 0)
