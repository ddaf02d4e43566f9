"""Inert knobs (trainer/inert.py): a configured term that never changed an update is named at the
run's end, tagged, raised as the `inert_knobs` alarm after `inert_steps` steps (warn by default),
and said beside its row by `compare`. The STAPO cases run the real loss library on batches whose
spurious tokens are counted independently here (numpy), so the evidence the watch reads is real."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from rich.console import Console

from stapoctl.config.compose import compose_config
from stapoctl.trainer import loop as loop_mod
from stapoctl.trainer.alarms import HealthWatch
from stapoctl.trainer.inert import InertWatch, knobs


def step_batch(seed: int, rows: int = 16, length: int = 32, vocab: int = 50) -> dict:
    """A batch shaped like a rollout: peaked next-token distributions, a sampled token per position,
    ±1 advantages per row; π, H exact from the distribution."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, length, vocab, generator=g) * 3.0
    probs = logits.softmax(-1)
    tokens = torch.multinomial(probs.reshape(-1, vocab), 1, generator=g).reshape(rows, length)
    lp = probs.gather(-1, tokens[..., None]).squeeze(-1).log()
    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    adv = torch.where(torch.rand(rows, generator=g) < 0.5, 1.0, -1.0)
    mask = torch.ones(rows, length, dtype=torch.bool)
    return dict(log_prob=lp, old_log_prob=lp, advantages=adv, response_mask=mask, entropy=ent)


def spurious_by_hand(b: dict, tau_p: float, tau_h: float = 0.2) -> int:
    """000 Eq. 1's S2T count: Â > 0, π < τ_p, H < h* = the (1 − τ_h) linear quantile of H."""
    ent = b["entropy"].numpy().ravel()
    h_star = np.quantile(ent, 1 - tau_h)
    pos = np.repeat(b["advantages"].numpy() > 0, b["log_prob"].shape[1])
    prob = np.exp(b["log_prob"].numpy().ravel())
    return int((pos & (prob < tau_p) & (ent < h_star)).sum())


def stapo_steps(tau_p: float, steps: int = 6) -> list[dict]:
    from stapoctl.losses import compute_policy_loss

    out = []
    for s in range(steps):
        b = step_batch(s)
        _, m = compute_policy_loss("stapo", **b, tau_p=tau_p)
        assert m["stapo/spurious_count"] == spurious_by_hand(b, tau_p)  # the loss's count is the mask's
        out.append(m)
    return out


def watch_for(overrides: list[str], after: int = 3) -> InertWatch:
    return InertWatch(knobs(compose_config(overrides)), after)


def test_stapo_at_tau_p_1e9_is_named_and_at_2e1_is_not():
    quiet, acting = stapo_steps(1e-9), stapo_steps(2e-1)
    assert sum(m["stapo/spurious_count"] for m in acting) > 0
    w = watch_for(["loss=stapo", "loss.tau_p=1e-9"])
    for step, m in enumerate(quiet, 1):
        w.feed(step, m)
    line, tags = w.summary()
    assert line == ("inert: loss=stapo's mask s2t acted on no token (stapo/spurious_count 0 in all 6 steps, "
                    "τ_p=1e-09): the run trained as DAPO (stapo is DAPO plus the mask)")
    assert list(tags) == ["stapoctl.inert.loss.stapo.s2t"]
    w2 = watch_for(["loss=stapo", "loss.tau_p=0.2"])
    for step, m in enumerate(acting, 1):
        w2.feed(step, m)
    assert w2.summary() == ("", {})


def test_the_alarm_fires_once_after_inert_steps_and_warns():
    w = watch_for(["loss=stapo", "loss.tau_p=1e-9"], after=3)
    fired = [(s, a) for s, m in enumerate(stapo_steps(1e-9), 1) for a in w.feed(s, m)]
    assert [(s, a.name, a.action) for s, a in fired] == [(3, "inert_knobs", "warn")]
    assert "stapo/spurious_count 0 in all 3 steps" in fired[0][1].message


def test_each_knob_reads_its_own_evidence():
    conf = ["loss=grpo", "loss.kl_coef=0.01", "loss.entropy_coef=0.001", "reward.overlong_buffer=8",
            "trainer.dynamic_sampling=true", "loss.rollout_correction=token_tis",
            "loss.token_rules=[{adv: pos, prob: [0, 0.001], action: mask, name: rare}]", "loss.shadow=[stapo]"]
    w = watch_for(conf, after=0)
    assert sorted(k.key for k in w.knobs) == sorted([
        "loss.token_rules.rare", "loss.kl_coef", "loss.entropy_coef", "reward.overlong_buffer",
        "trainer.dynamic_sampling", "loss.rollout_correction"])  # grpo's own rules are none: the shadow is not them
    quiet = {"rules/rare/token_ratio": 0.0, "actor/kl_loss": 0.0, "actor/entropy_loss": 0.0,
             "reward/overlong_frac": 0.0, "dynamic_sampling/kept_frac": 1.0, "rollout_corr/masked_frac": 0.0}
    w.feed(1, quiet)
    w.feed(2, {**quiet, "actor/kl_loss": 3e-4, "dynamic_sampling/kept_frac": 0.75})
    assert sorted(w.summary()[1]) == sorted("stapoctl.inert." + k for k in (
        "loss.token_rules.rare", "loss.entropy_coef", "reward.overlong_buffer", "loss.rollout_correction"))
    assert w.feed(3, quiet) == []  # after=0: no alarm, only the end line


def test_a_shadow_that_is_the_live_loss_is_named_from_the_config():
    w = watch_for(["loss=stapo", "loss.shadow=[stapo,entropy20]"])
    assert [k.key for k in w.inert()] == ["loss.shadow.stapo"]


def test_the_loop_warns_with_its_own_action_even_when_alarms_stop(monkeypatch):
    tags: dict = {}
    monkeypatch.setattr(loop_mod, "set_tags", tags.update)
    conf = OmegaConf.create({"trainer": {"alarms": True, "alarm_action": "stop"}})
    lp = loop_mod.Loop(conf, runner=None, sampler=None, run_id="abc", run_dir=None, base_model="", tokenizer_dir="",
                       watch=HealthWatch(), inert=watch_for(["loss=stapo", "loss.tau_p=1e-9"], after=2))
    view = SimpleNamespace(console=Console(file=io.StringIO(), width=100))
    steps = stapo_steps(1e-9, 2)
    assert lp._alarms(view, 1, steps[0]) is False
    assert lp._alarms(view, 2, steps[1]) is False and lp.alarmed == []  # warned, not stopped
    assert tags == {"stapoctl.alarm.inert_knobs": "2"}
    assert "(trainer.alarm_limits.inert_action=warn)" in view.console.file.getvalue()
    out = io.StringIO()
    lp._name_inert(Console(file=out, width=300))
    assert out.getvalue().startswith("inert: loss=stapo's mask s2t acted on no token") and \
        "stapoctl.inert.loss.stapo.s2t" in tags


def test_compare_says_it_beside_the_row():
    from stapoctl.analysis.collect import Comparison, Trial
    from stapoctl.analysis.inert_rows import inert_lines

    why = ("loss=stapo's mask s2t acted on no token (stapo/spurious_count 0 in all 60 steps, τ_p=1e-09): the run "
           "trained as DAPO (stapo is DAPO plus the mask)")

    def trial(i: int, inert: bool) -> Trial:
        tags = {"stapoctl.inert.loss.stapo.s2t": why} if inert else {}
        run = SimpleNamespace(info=SimpleNamespace(run_id=f"r{i}"), data=SimpleNamespace(tags=tags, params={}))
        return Trial(run, "stapo", str(i))

    comp = Comparison("loss", {"stapo": [trial(i, i < 3) for i in range(5)]}, [], False, {})
    assert inert_lines(comp) == ["stapo: loss=stapo's mask s2t acted on no token in 3 of 5 seeds — those trials "
                                 "trained as DAPO"]


@pytest.mark.parametrize("bad", ["trainer.alarm_limits.inert_action=never", "trainer.alarm_limits.inert_steps=-1"])
def test_bad_limits_are_one_line(bad):
    from stapoctl.config.validate import validate_config
    from stapoctl.errors import UserError

    with pytest.raises(UserError) as exc:
        validate_config(compose_config([bad]))
    assert "trainer.alarm_limits.inert_" in str(exc.value) and "\n" not in str(exc.value)


def test_the_embedded_default_run_names_no_inert_knob():
    """Replayed from the recorded default run (tests/data/alarm_streams.json): its mask acted on
    18 of 60 steps (first at step 3), so neither the alarm nor the end line names it."""
    import json
    from pathlib import Path

    rec = json.loads((Path(__file__).parent / "data" / "alarm_streams.json").read_text())["default_tiny_60"]
    col = rec["keys"].index("stapo/spurious_ratio") + 1
    w = watch_for([], after=20)  # the embedded default: loss=stapo, τ_p = 2e-3
    rows = [row for row in rec["rows"] if row[col] is not None]  # steps that logged the loss's metrics
    fired = [a for row in rows for a in w.feed(row[0], {"stapo/spurious_count": float(row[col] > 0)})]
    assert fired == [] and w.summary() == ("", {})
    assert sum(1 for row in rows if row[col] > 0) == 18


def test_a_resumed_run_counts_the_steps_its_journal_holds(tmp_path):
    """Resume at step 3 of a run whose mask acted at step 2: the journal (a real MetricBuffer on a
    sqlite store, reopened as a resume reopens it) holds that, so the end line names nothing; the
    steps after the checkpoint are left to the live feed."""
    import mlflow

    from stapoctl.tracking.metric_buffer import MetricBuffer

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = mlflow.MlflowClient(uri).create_run(mlflow.MlflowClient(uri).create_experiment("x")).info.run_id
    first = MetricBuffer(tmp_path / "run", run_id, uri)
    for step, count in enumerate([0.0, 2.0, 0.0, 0.0, 0.0], 1):
        first.log_metrics({"stapo/spurious_count": count}, step=step)
    first.close(timeout_s=30)
    again = MetricBuffer(tmp_path / "run", run_id, uri)
    try:
        w = watch_for(["loss=stapo"], after=0)
        w.seed(again, 3)
        assert w.steps == 3 and w.summary() == ("", {})
        late = watch_for(["loss=stapo"], after=0)
        late.seed(again, 1)  # a checkpoint before the step that acted: not yet evidence of acting
        assert list(late.summary()[1]) == ["stapoctl.inert.loss.stapo.s2t"]
    finally:
        again.close(timeout_s=30)
