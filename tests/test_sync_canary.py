"""The weight-sync canary (trainer/sync_canary.py): its statistic, the p99 of |Δ log p| over each
rollout worker's response tokens, and its rule: the run's first measured step is the reference, a
later step alarms above max(the dtype's tolerance, `sync_canary_factor` × that reference). Numbers by
hand; the corrupt push on real engines is tests/test_weight_sync_faults.py."""

from __future__ import annotations

import pytest
import torch

from stapoctl.config.alarms import AlarmLimits
from stapoctl.trainer.sync_canary import SyncCanary, diff_p99, per_worker_p99

P99 = "rollout/logprob_diff_p99"


def _sides(off: dict[int, float], base: float = 2e-6, rows: int = 10, cols: int = 100):
    """Learner and vLLM log-probs of rows × cols response tokens, |Δ| = base everywhere but at the
    flat positions of `off` (position → |Δ|), and the response mask (all tokens)."""
    learner = torch.zeros(rows, cols)  # log p = 0: |Δ| exact in fp32
    d = torch.full((rows * cols,), base)
    for k, v in off.items():
        d[k] = v
    return learner, learner - d.view(rows, cols), torch.ones(rows, cols, dtype=torch.bool)


def test_the_p99_of_a_batch_by_hand():
    # 1000 tokens: sorted |Δ|, position 0.99 × 999 = 989.01 between the 990th and 991st values
    assert diff_p99(*_sides({})) == pytest.approx(2e-6, rel=1e-3)
    assert diff_p99(*_sides({7: 0.5})) == pytest.approx(2e-6, rel=1e-3)  # 1 in 1000 off: not in the p99
    ten = {k: 0.5 for k in range(0, 1000, 100)}  # 10 in 1000 off: the 991st value is 0.5, the 990th 2e-6
    assert diff_p99(*_sides(ten)) == pytest.approx(2e-6 + 0.01 * (0.5 - 2e-6), rel=1e-4)
    eleven = {**ten, 555: 0.5}  # 11: both are 0.5
    assert diff_p99(*_sides(eleven)) == pytest.approx(0.5)
    learner, vllm, mask = _sides({}, base=1e-3)  # every token off by 1e-3
    assert diff_p99(learner, vllm, mask) == pytest.approx(1e-3, rel=1e-4)
    mask[:, 50:] = False  # padding is no response token: a huge Δ there counts for nothing
    vllm[:, 50:] = -40.0
    assert diff_p99(learner, vllm, mask) == pytest.approx(1e-3, rel=1e-4)


def test_each_worker_gets_the_p99_of_its_own_rows():
    learner, vllm, mask = _sides({}, base=1e-6, rows=4, cols=10)
    vllm[2:] = learner[2:] - 1e-2  # worker 1's rows off by 1e-2 everywhere
    vllm[3, 9] = learner[3, 9] - 3.0  # and one token of 20 by 3: p99 at 0.99 × 19 = 18.81 → 1e-2 + 0.81 × 2.99
    got = per_worker_p99(learner, vllm, mask, [0, 0, 1, 1])
    assert set(got) == {f"{P99}/worker_0", f"{P99}/worker_1"}
    assert got[f"{P99}/worker_0"] == pytest.approx(1e-6, rel=1e-3)
    assert got[f"{P99}/worker_1"] == pytest.approx(1e-2 + 0.81 * 2.99, rel=1e-4)
    assert per_worker_p99(learner, vllm, mask, [0, 0, 0, 0]) == {}  # one worker: the batch's own p99
    assert per_worker_p99(learner, vllm, mask, [0, 1]) == {}  # rows not matched to workers: no guess


def test_fp32_a_rare_tail_does_not_fire_and_a_moved_policy_does():
    canary = SyncCanary(AlarmLimits(), "float32", "gloo")
    # the first measured step: the reference (top-p's differing kept sets: 1 in 1000 tokens off by 0.5)
    assert canary.feed(1, {P99: diff_p99(*_sides({7: 0.5})), "rollout/logprob_diff_max": 0.5}) == []
    assert canary.reference == pytest.approx(2e-6, rel=1e-3) and canary.reference_step == 1
    assert canary.threshold() == 1e-4  # max(1e-4, factor × 2e-6): the tolerance
    assert canary.feed(2, {P99: diff_p99(*_sides({3: 0.5}))}) == []
    [alarm] = canary.feed(3, {P99: diff_p99(*_sides({}, base=1e-3))})  # every token off by 1e-3
    assert alarm.name == "sync_canary" and alarm.action == "stop"
    assert "rollout worker 0's log-probs are 1.00e-03 from the learner's after the gloo push" in alarm.message
    assert "p99 |Δ log p|" in alarm.message and "tolerance 0.0001 in float32" in alarm.message
    assert "reference 2.00e-06 at step 1" in alarm.message
    assert canary.feed(4, {P99: 1.0}) == []  # once a run


@pytest.mark.parametrize("factor", [AlarmLimits().sync_canary_factor, 3.0])
def test_bf16_a_later_step_alarms_above_factor_times_the_first_steps_p99(factor):
    limits = AlarmLimits(sync_canary_bf16=0.05, sync_canary_factor=factor)  # a floor below 0.03 × factor
    canary = SyncCanary(limits, "bfloat16", "object_store")
    assert canary.feed(1, {P99: 0.03}) == []  # the kernels' mismatch, measured before any push
    assert canary.threshold() == pytest.approx(0.03 * factor)
    assert canary.feed(2, {P99: 0.03 * factor - 1e-6}) == []
    [alarm] = canary.feed(3, {P99: 0.03 * factor + 1e-6})
    assert f"limit {0.03 * factor:.2e}" in alarm.message
    assert f"reference 3.00e-02 at step 1 × sync_canary_factor {factor:g}" in alarm.message
    assert "tolerance 0.05 in bfloat16, trainer.alarm_limits.sync_canary_bf16" in alarm.message


def test_bf16_the_first_step_meets_the_tolerance_alone_and_stays_its_floor():
    tol = AlarmLimits().sync_canary_bf16
    [first] = SyncCanary(AlarmLimits(), "bfloat16", "nccl").feed(1, {P99: tol * 1.01})
    assert "the run's first measured step: no reference yet" in first.message
    canary = SyncCanary(AlarmLimits(sync_canary_factor=2.0), "bfloat16", "nccl")
    assert canary.feed(1, {P99: 1e-3}) == []  # a tiny reference: 2 × 1e-3 is below the floor
    assert canary.feed(2, {P99: tol * 0.99}) == []
    assert [a.name for a in canary.feed(3, {P99: tol * 1.01})] == ["sync_canary"]
    off = SyncCanary(AlarmLimits(sync_canary_factor=0.0), "bfloat16", "nccl")  # factor 0: the tolerance alone
    assert off.feed(1, {P99: 0.03}) == [] and off.threshold() == tol


def test_the_sync_canary_names_the_worker_above_its_threshold():
    names = {0: "rollout worker 0 (pid 11, node 10.0.0.1)", 1: "rollout worker 1 (pid 12, node 10.0.0.2)"}
    fp32 = SyncCanary(AlarmLimits(), "float32", "gloo", names.get)
    assert fp32.feed(1, {P99: 3e-6, f"{P99}/worker_0": 2e-6, f"{P99}/worker_1": 3e-6}) == []
    assert fp32.reference == 3e-6  # the highest worker's
    [alarm] = fp32.feed(2, {P99: 4e-3, f"{P99}/worker_0": 2e-6, f"{P99}/worker_1": 4e-3,
                            "rollout/logprob_diff_max/worker_0": 9.0})  # the max is not the statistic
    assert "rollout worker 1 (pid 12, node 10.0.0.2)'s log-probs are 4.00e-03" in alarm.message
    assert "after the gloo push" in alarm.message and "(also" not in alarm.message
    both = SyncCanary(AlarmLimits(), "float32", "gloo", names.get)
    [two] = both.feed(1, {f"{P99}/worker_0": 2e-4, f"{P99}/worker_1": 5e-4})
    assert "rollout worker 1 (pid 12" in two.message and "(also rollout worker 0 (pid 11" in two.message
    assert SyncCanary(AlarmLimits(sync_canary_fp32=0.0), "float32", "gloo").feed(1, {P99: 9.0}) == []
    assert SyncCanary(AlarmLimits(), "float32", "gloo").feed(1, {"rollout/logprob_diff_max": 9.0}) == []


def test_a_stale_async_step_is_not_a_failed_sync_nor_the_reference():
    canary = SyncCanary(AlarmLimits(), "float32", "gloo")
    assert canary.feed(3, {P99: 5e-2, "async/staleness": 1.0}) == []
    assert canary.reference is None  # sampled by an older policy: it measures no kernel
    assert [a.name for a in canary.feed(4, {P99: 5e-2, "async/staleness": 0.0})] == ["sync_canary"]
    nan = SyncCanary(AlarmLimits(), "float32", "gloo")
    assert nan.feed(1, {P99: float("nan")}) == [] and nan.reference is None  # a NaN is another failure's line


def test_the_step_logs_each_workers_p99_over_the_tokens_the_learner_measured():
    """StepRunner.update on a hand-made batch: rows 0-1 from worker 0 (every token off by 1e-3), rows
    2-3 from worker 1: row 2 truncated (10 tokens off by 5, outside the loss under the overlong filter),
    row 3 (3 tokens) off by 0.25."""
    from omegaconf import OmegaConf

    from stapoctl.learner.step_result import StepResult
    from stapoctl.rollout.batch import RolloutBatch
    from stapoctl.trainer.step_runner import StepRunner

    lengths, offs = (5, 8, 10, 3), (1e-3, 1e-3, 5.0, 0.25)
    batch = RolloutBatch.from_token_lists(
        [[1, 2], [3]], [[[5] * 5, [6] * 8], [[7] * 10, [8] * 3]], [[[0.0] * 5, [0.0] * 8], [[0.0] * 10, [0.0] * 3]],
        [[False, False], [True, False]], [["a", "b"], ["c", "d"]], pad_id=0, prompt_index=[0, 1])
    learner = -torch.tensor(offs)[:, None] * batch.response_mask.float()

    class Learners:
        def train_step(self, view, *args, **kwargs):
            return StepResult({"rollout/logprob_diff_max": 5.0}, old_log_probs=learner,
                              logprob_diff_rows=torch.tensor(offs))

    class Engines:
        learners = Learners()

        def wait_weights(self):
            pass

    def update(filtered: bool) -> dict:
        runner = StepRunner.__new__(StepRunner)
        runner.conf = OmegaConf.create({"rollout": {"logprob_check_every": 1}, "trainer": {"diagnostics_every": 0},
                                        "reward": {"overlong_filter": filtered}})
        runner.engines, runner.old_source, runner.start_step, runner.learner_version = Engines(), "recompute", 0, 0
        runner._worker_rows = [0, 0, 1, 1]
        return runner.update(batch, step=1)

    assert sum(lengths) == int(batch.response_mask.sum())
    m = update(filtered=True)
    assert m[f"{P99}/worker_0"] == pytest.approx(1e-3, rel=1e-5)
    assert m[f"{P99}/worker_1"] == pytest.approx(0.25)  # the filtered row's tokens are not the learner's
    # the batch: 13 tokens at 1e-3, 3 at 0.25; position 0.99 × 15 = 14.85 lies between two 0.25s
    assert m[P99] == pytest.approx(0.25)
    assert m["rollout/logprob_diff_max/worker_1"] == 5.0 and m["rollout/logprob_diff_max"] == 5.0  # as before
    whole = update(filtered=False)  # worker 1: 13 tokens, 10 at 5: 0.99 × 12 = 11.88 → 5
    assert whole[f"{P99}/worker_1"] == pytest.approx(5.0)
