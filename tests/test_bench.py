"""The benchmark harness's bookkeeping (no engines, no timing): statistics, verdicts, the docs
table, and the stapoctl → TRL config mapping the RL rows rely on for equal work."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _harness as H  # noqa: E402
import _ours  # noqa: E402
import _peers  # noqa: E402


def test_summary_median_min_max_ignores_missing():
    s = H.summary([3.0, 1.0, None, float("nan"), 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)
    assert H.summary([])["n"] == 0 and H.summary([])["median"] is None


def test_ratio_orientation_and_verdicts():
    # costs: ratio = peer / ours, > 1 means stapoctl faster
    fast = H.row("k", "t", ours=[1.0, 1.0, 1.2], peer=[2.0, 2.0, 2.0], unit="s", lower_is_better=True,
                 target=1.5, target_text="")
    assert fast["ratio"] == pytest.approx(2.0) and fast["verdict"] == "PASS"
    slow = H.row("k", "t", ours=[4.0], peer=[2.0], unit="s", lower_is_better=True, target=1.5, target_text="")
    assert slow["ratio"] == pytest.approx(0.5) and slow["verdict"] == "MISS"
    # rates: ratio = ours / peer
    rate = H.row("k", "t", ours=[300.0], peer=[100.0], unit="tok/s", lower_is_better=False, target=1.5,
                 target_text="")
    assert rate["ratio"] == pytest.approx(3.0) and rate["verdict"] == "PASS"
    # ceilings (overhead, memory): explicit ratio, target_max
    ceil = H.row("k", "t", ours=[1.1], peer=[1.0], unit="s", lower_is_better=True, ratio=1.1, target=1.03,
                 target_max=True, target_text="")
    assert ceil["verdict"] == "MISS"
    # absolute bound on stapoctl's own median
    up = H.row("k", "t", ours=[12.0, 14.0, 30.0], peer=[5.0], unit="s", lower_is_better=True, target=15.0,
               absolute=True, target_text="")
    assert up["ratio"] is None and up["verdict"] == "PASS"


def test_a_ratio_with_failed_same_work_check_is_invalid_not_pass():
    r = H.row("k", "t", ours=[1.0], peer=[2.0], unit="s", lower_is_better=True, target=1.3, target_text="",
              checks=[H.check("tokens", False, "gen tokens/step 100 vs 1000")])
    assert r["verdict"] == "INVALID"
    assert H.within(100, 104, 0.05) and not H.within(100, 1000, 0.15) and H.within(None, 1, 0.1) is None


def test_docs_table_is_rewritten_between_markers(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    rows = [H.row("full_step_tiny", "full RL step, tiny | 0.46M", ours=[0.5, 0.6, 0.4], peer=[0.8], unit="s",
                  lower_is_better=True, target=1.3, target_text="≥ 1.3×", peer_label="TRL",
                  checks=[H.check("dtype", True, "fp32 both")], notes="a | note")]
    H.save("rl_step_tiny", rows, config={}, seconds=1.0, env={"date": "2026-01-01 00:00:00", "commit": "abc"},
           out_dir=results)
    docs = tmp_path / "PERFORMANCE.md"
    docs.write_text("# Performance\n\nintro\n\n" + H.TABLE_BEGIN + "\nold\n" + H.TABLE_END + "\n\n## Profile\nkept\n")
    H.write_docs(results, docs)
    text = docs.read_text()
    assert "old" not in text and "intro" in text and "## Profile\nkept" in text
    assert "0.50 s [0.40–0.60] n=3" in text and "**PASS**" in text and "- *full RL step" in text
    assert "full RL step, tiny \\| 0.46M |" in text  # a pipe inside a cell must not split the markdown row
    H.write_docs(results, docs)
    assert docs.read_text() == text  # idempotent
    fresh = tmp_path / "NEW.md"
    H.write_docs(results, fresh)
    assert H.TABLE_BEGIN in fresh.read_text()
    assert json.loads((results / "rl_step_tiny.json").read_text())["rows"][0]["key"] == "full_step_tiny"


def test_step_seconds_are_intervals_after_the_warm_up_step():
    ends = {1: 10_000, 2: 10_800, 3: 11_500, 4: 12_400}
    assert _ours.step_seconds(ends) == pytest.approx([0.8, 0.7, 0.9])
    assert _ours.step_seconds(ends, skip=2) == pytest.approx([0.7, 0.9])


@pytest.mark.parametrize(
    "overrides, expect",
    [
        # the embedded default: 4 mini-batches of 2 prompts x 8 = 16 rows, one micro-batch each
        ([], dict(per_device_train_batch_size=16, gradient_accumulation_steps=1, steps_per_generation=4,
                  num_iterations=1, optimizer_steps_per_rollout=4)),
        # the whole rollout as one mini-batch (8 prompts x 8 = 64 rows)
        (["learner.ppo_mini_batch_size=8"], dict(per_device_train_batch_size=64, gradient_accumulation_steps=1,
                                                 steps_per_generation=1, num_iterations=1,
                                                 optimizer_steps_per_rollout=1)),
        # 4 mini-batches of 2 prompts (16 rows), micro-batches of 8 rows, 2 epochs
        (["learner.ppo_mini_batch_size=2", "learner.micro_batch_size=8", "learner.ppo_epochs=2"],
         dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=8,
              num_iterations=2, optimizer_steps_per_rollout=8)),
    ],
)
def test_trl_follows_stapoctls_batch_structure(overrides, expect):
    assert _peers.trl_structure(_peers.compose(overrides)) == expect


def test_trl_config_matches_the_stapoctl_config_it_is_compared_with(tmp_path):
    """The stapoctl side of the mapping, without TRL (CI does not install the bench extra)."""
    conf = _peers.compose(["loss=dapo", "learner.ppo_mini_batch_size=2", "learner.micro_batch_size=8"])
    args = _peers.trl_kwargs(conf, rl_steps=6, output_dir=str(tmp_path))
    assert (args["bf16"], args["fp16"], args["use_cpu"], args["beta"]) == (False, False, True, 0.0)
    assert args["loss_type"] == "dapo" and args["epsilon"] == 0.2 and args["epsilon_high"] == 0.28
    assert args["learning_rate"] == conf.learner.lr and args["num_generations"] == conf.rollout.n
    assert args["max_completion_length"] == conf.rollout.max_response_length and args["top_k"] == 0
    # TRL's generation batch: steps_per_generation micro-batches = one stapoctl rollout (8 prompts x n)
    rows = args["per_device_train_batch_size"] * args["steps_per_generation"]
    assert rows == conf.data.train_batch_size * conf.rollout.n
    assert args["max_steps"] == 6 * 4 and not args["shuffle_dataset"]
    assert args["lr_scheduler_type"] == "constant" and args["warmup_steps"] == 0
    assert _peers.trl_kwargs(_peers.compose(["loss.loss_agg_mode=seq-mean-token-mean"]), 1, "o")["loss_type"] == "grpo"


def test_trl_takes_every_argument_of_the_mapping(tmp_path):
    """Where the bench extra is installed: TRL's own config accepts the mapping and derives the
    generation batch from it."""
    pytest.importorskip("trl")
    conf = _peers.compose(["loss=dapo", "learner.ppo_mini_batch_size=2", "learner.micro_batch_size=8"])
    args = _peers.trl_args(conf, rl_steps=6, output_dir=str(tmp_path))
    assert args.generation_batch_size == conf.data.train_batch_size * conf.rollout.n
    assert getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type) == "constant"


def test_every_stapoctl_name_the_benchmarks_import_exists():
    # the scripts import the package lazily, inside functions: a moved helper only fails when
    # that row runs (free_port's move broke `bench loss_overhead` once)
    import ast
    import importlib

    missing = []
    for script in sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stapoctl")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if hasattr(module, alias.name):
                    continue
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    missing.append(f"{script.name}: from {node.module} import {alias.name}")
    assert not missing, missing


def test_bench_all_runs_every_side_by_side_script_and_only_those():
    import _suite

    scripts = _suite.scripts()
    assert list(scripts)[:4] == list(_suite.FIRST)  # cheap ones first
    assert "sweep_summary" not in scripts and "sweep_overhead" not in scripts and "gpu_learner" not in scripts
    assert "grid_shares" not in scripts  # a report over a finished sweep, like sweep_summary
    for name, path in scripts.items():  # `bench all --quick` passes --quick to every script it runs
        assert "--quick" in path.read_text(), name


def test_gpu_learner_batch_has_both_outcomes_in_every_group_and_spread_lengths():
    import gpu_learner

    batch, rewards = gpu_learner.fixed_batch(prompts=3, n=4, prompt_len=16, response_len=40)
    assert len(batch) == 12 and batch.prompt_length == 16
    lengths = batch.response_mask.sum(1)
    assert int(lengths.min()) >= 10 and int(lengths.max()) <= 40 and len(set(lengths.tolist())) > 3
    groups = rewards.view(3, 4)
    assert bool((groups.max(1).values == 1).all() and (groups.min(1).values == -1).all())


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU message")
def test_gpu_learner_without_a_gpu_says_so_in_one_line():
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_learner.py"
    out = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "Traceback" not in out.stderr


def test_learner_budget_batch_spreads_lengths_and_its_sides_name_the_budget():
    import learner_budget

    batch, rewards = learner_budget.fixed_batch(512)
    lengths = batch.response_mask.sum(1)
    assert len(batch) == learner_budget.PROMPTS * learner_budget.N
    assert int(lengths.max()) <= 384 and int(lengths.max()) >= 4 * int(lengths.min())  # a spread >= 4x
    assert int(batch.prompt_length) + int(lengths.max()) <= 512  # the 25M model's context
    groups = rewards.view(learner_budget.PROMPTS, learner_budget.N)
    assert bool((groups.max(1).values == 1).all() and (groups.min(1).values == -1).all())
    assert learner_budget.SIDES["fixed"]["micro_batch_size"] == 8
    budget_sides = {k for k in learner_budget.SIDES if k.startswith("budget")}
    assert budget_sides == {"budget_rows", "budget_prompts", "budget_packed", "budget_packed_rows"}
    assert learner_budget.SIDES["budget_packed"]["remove_padding"] is True


def test_trl_side_of_learner_budget_pads_as_trl_does():
    """TRL's micro-batches of the budget bench's batch: the same rows and tokens, prompts left-padded
    and completions right-padded to the whole batch's longest, the window's token count attached."""
    import _trl_update
    import learner_budget

    batch, rewards = learner_budget.fixed_batch(512)
    batch = batch.with_(advantages=rewards)
    micro = _trl_update.micro_batches(batch, 8)
    longest_p, longest_r = int(batch.prompt_mask.sum(1).max()), int(batch.response_mask.sum(1).max())
    assert len(micro) == 4
    for k, mb in enumerate(micro):
        assert mb["prompt_ids"].shape == (8, longest_p) and mb["completion_ids"].shape == (8, longest_r)
        assert bool(mb["prompt_mask"][:, -1].all()) and bool(mb["completion_mask"][:, 0].all())
        assert int(mb["num_items_in_batch"]) == int(batch.response_mask.sum())
        assert mb["advantages"].tolist() == rewards[8 * k: 8 * k + 8].tolist()
    assert sum(int(mb["completion_mask"].sum()) for mb in micro) == int(batch.response_mask.sum())


def test_loss_clock_times_the_loss_library_and_restores_it():
    import torch

    import stapoctl.losses as L

    original = L.compute_policy_loss
    mask = torch.ones(2, 3, dtype=torch.bool)
    args = dict(log_prob=torch.zeros(2, 3), old_log_prob=torch.zeros(2, 3), advantages=torch.ones(2, 3),
                response_mask=mask, entropy=torch.ones(2, 3))
    with H.LossClock() as clock:
        assert L.compute_policy_loss is not original
        L.compute_policy_loss("grpo", **args)
        first = clock.t
        assert first > 0
        L.compute_policy_loss("grpo", **args)
        assert clock.t > first
    assert L.compute_policy_loss is original
