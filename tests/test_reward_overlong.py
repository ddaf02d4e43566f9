"""DAPO's soft overlong punishment (Eq. 13) and overlong filtering, by hand-computed numbers.

The formula at every boundary; the trainer side on a hand-made batch (no engines): the penalty
is added to the rule reward before advantages, the metrics, the learner's view with the filter,
and that a filtered row weighs exactly what a removed row weighs in the loss.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from stapoctl.config.loss_settings import build_loss_config
from stapoctl.reward.overlong import overlong_penalties, overlong_stats, soft_overlong_penalty
from stapoctl.rollout.batch import RolloutBatch


# L_max = 20, L_cache = 4: free up to 16 tokens, then -1/4 per token down to -1 at 20
@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (15, 0.0), (16, 0.0),  # |y| <= L_max - L_cache
    (17, -0.25), (18, -0.5), (19, -0.75), (20, -1.0),  # the ramp, -1 exactly at L_max
    (21, -1.0), (100, -1.0),  # beyond L_max
])
def test_penalty_at_each_boundary(length, expected):
    assert soft_overlong_penalty(length, 20, 4) == pytest.approx(expected)


def test_factor_scales_and_buffer_zero_is_off():
    assert soft_overlong_penalty(18, 20, 4, factor=0.5) == pytest.approx(-0.25)
    assert soft_overlong_penalty(25, 20, 4, factor=2.0) == pytest.approx(-2.0)
    assert soft_overlong_penalty(20, 20, 0) == 0.0 and soft_overlong_penalty(30, 20, 0, factor=3) == 0.0
    # the DAPO paper's recipe: 16384 expected + 4096 buffer = 20480
    assert soft_overlong_penalty(16384, 20480, 4096) == 0.0
    assert soft_overlong_penalty(18432, 20480, 4096) == pytest.approx(-0.5)
    assert overlong_penalties([16, 18, 20], 20, 4) == pytest.approx([0.0, -0.5, -1.0])


def test_stats():
    stats = overlong_stats([0.0, -0.5, -1.0, 0.0], [False, False, True, False], filtered=False)
    assert stats == pytest.approx({"reward/overlong_penalty_mean": -0.375, "reward/overlong_frac": 0.5,
                                   "reward/truncated_frac": 0.25})
    assert overlong_stats([0.0, -1.0], [False, True], filtered=True)["reward/overlong_filtered"] == 1.0


# -- the trainer side, on a hand-made batch ------------------------------------------------------------
def _batch() -> RolloutBatch:
    # L_max = 10, buffer 4 (free up to 6). prompt 0: lengths 5 (EOS) and 8 (EOS, -0.5);
    # prompt 1: length 10 (truncated, -1) and 3 (EOS)
    return RolloutBatch.from_token_lists(
        [[1, 2], [3]],
        [[[5] * 5, [6] * 8], [[7] * 10, [8] * 3]],
        [[[-0.1] * 5, [-0.2] * 8], [[-0.3] * 10, [-0.4] * 3]],
        [[False, False], [True, False]],
        [["a", "b"], ["c", "d"]],
        pad_id=0, prompt_index=[0, 1],
    )


def _runner(*, buffer=4, factor=1.0, filtered=False):
    from stapoctl.trainer.step_runner import StepRunner

    class Scorer:  # every response right: rule reward 1
        def score(self, texts, answers, questions, kinds=None):
            self.kinds = kinds
            return [1.0] * len(texts), {"reward/accuracy": 1.0}

    class Engines:
        def __init__(self):
            self.sent = None
            self.learners = self

        def wait_weights(self):  # no push in flight: the step's update waits on nothing
            pass

        def train_step(self, batch, *args, **kwargs):  # as `engines.learners` (a `LearnerGroup`)
            self.sent = batch
            from stapoctl.learner.step_result import StepResult

            return StepResult()

    runner = StepRunner.__new__(StepRunner)
    runner.conf = OmegaConf.create({
        "rollout": {"max_response_length": 10, "logprob_check_every": 0},
        "reward": {"overlong_buffer": buffer, "overlong_penalty": factor, "overlong_filter": filtered},
        "trainer": {"diagnostics_every": 0},
    })
    runner.scorer, runner.engines = Scorer(), Engines()
    runner.answers, runner.questions, runner.kinds = ["1", "2"], ["q1", "q2"], None
    # dr_grpo's advantage = R - group mean: easy to check by hand
    runner.loss_config = build_loss_config({"name": "grpo", "adv_estimator": "dr_grpo"})
    runner.old_source, runner.start_step, runner.learner_version, runner._worker_rows = "recompute", 0, 0, []
    return runner


def test_the_penalty_is_added_to_the_rule_reward_before_advantages():
    batch, m = _runner().score(_batch())
    assert batch.rewards.tolist() == pytest.approx([1.0, 0.5, 0.0, 1.0])
    assert batch.advantages.tolist() == pytest.approx([0.25, -0.25, -0.5, 0.5])
    assert m["reward/overlong_penalty_mean"] == pytest.approx(-0.375)
    assert m["reward/overlong_frac"] == 0.5 and m["reward/truncated_frac"] == 0.25
    assert "reward/overlong_filtered" not in m


def test_penalty_off_changes_nothing_and_the_metrics_keep_the_rules_verdict():
    from stapoctl.trainer.step_runner import batch_metrics

    runner = _runner(buffer=0)
    batch, m = runner.score(_batch())
    assert batch.rewards.tolist() == [1.0] * 4 and m["reward/overlong_frac"] == 0.0
    shaped_runner = _runner(factor=2.0)  # the truncated row's reward: 1 - 2 = -1, still a right answer
    shaped, _ = shaped_runner.score(_batch())
    assert shaped.rewards.tolist() == pytest.approx([1.0, 0.0, -1.0, 1.0])
    assert batch_metrics(shaped, shaped_runner.conf)["reward/accuracy"] == 1.0
    assert batch_metrics(shaped, shaped_runner.conf)["batch/solve_all"] == 1.0


def test_the_filter_clears_the_truncated_rows_of_the_learners_mask_only():
    runner = _runner(filtered=True)
    batch, m = runner.score(_batch())
    assert m["reward/overlong_filtered"] == 1.0
    runner.update(batch, step=1)
    sent = runner.engines.sent
    assert sent.response_mask.sum(1).tolist() == [5, 8, 0, 3]
    assert batch.response_mask.sum(1).tolist() == [5, 8, 10, 3]  # the metrics' view is whole
    assert torch.equal(sent.advantages, batch.advantages)
    runner_off = _runner(filtered=False)
    runner_off.update(batch, step=1)
    assert runner_off.engines.sent is batch  # no filter: the batch as it is


@pytest.mark.parametrize("loss", ["dapo", "grpo", "stapo"])
def test_a_filtered_row_weighs_what_a_removed_row_weighs(loss):
    """Clearing a row's mask takes it out of the loss and of its denominators (token-mean's token
    count, seq-mean's row count, STAPO's entropy quantile): same loss as without the row."""
    import dataclasses

    from stapoctl.config.losses import LOSS_CONFIGS
    from stapoctl.losses import compute_policy_loss
    from stapoctl.trainer.step_runner import loss_view

    gen = torch.Generator().manual_seed(0)
    batch = _runner().score(_batch())[0]
    n, r = batch.response_ids.shape
    lp = -torch.rand(n, r, generator=gen) * 3
    old = lp + 0.3 * torch.randn(n, r, generator=gen)
    ent = torch.rand(n, r, generator=gen)
    cfg = dataclasses.asdict(LOSS_CONFIGS[loss]())
    conf = OmegaConf.create({"reward": {"overlong_filter": True}})
    view = loss_view(batch, conf)

    def value(rows, mask):
        out, _ = compute_policy_loss(loss, log_prob=lp[rows], old_log_prob=old[rows], advantages=batch.advantages[rows],
                                     response_mask=mask[rows], entropy=ent[rows], group_ids=batch.group_ids[rows], **cfg)
        return float(out)

    kept = [0, 1, 3]
    assert value(list(range(n)), view.response_mask) == pytest.approx(value(kept, batch.response_mask), rel=1e-6)
    assert value(list(range(n)), batch.response_mask) != pytest.approx(value(kept, batch.response_mask), rel=1e-6)

