"""The command line as a user meets it: help, dry-run config resolution, overrides, errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "stapoctl.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
    )


def resolved_yaml(out: str) -> dict:
    """The YAML block `--cfg job` prints between the rule and the placement table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "resolved config" in line) + 1
    end = next(i for i, line in enumerate(lines) if "Placement plan" in line)
    return yaml.safe_load("\n".join(lines[start:end]))


def test_help_lists_every_command():
    res = run_cli("--help")
    assert res.returncode == 0, res.stderr
    for command in ("train", "eval", "sweep", "data", "submit", "runs", "compare", "ui", "bench", "losses"):
        assert f" {command} " in res.stdout, f"{command} missing from --help"


def test_dry_run_prints_default_config_and_plan_without_starting_anything(tmp_path):
    res = run_cli("train", "--cfg", "job", env={"STAPOCTL_HOME": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    cfg = resolved_yaml(res.stdout)
    assert cfg["experiment"] == "tiny"
    assert cfg["loss"]["name"] == "stapo"
    assert cfg["loss"]["tau_p"] == pytest.approx(2e-3)
    assert cfg["model"]["path"] == ""  # the embedded tiny model
    assert "rollout (vLLM)" in res.stdout and "learner (DeepSpeed)" in res.stdout
    assert "nothing was started" in res.stdout
    # a dry run builds no model and opens no store
    assert not (tmp_path / "models").exists() and not (tmp_path / "mlflow.db").exists()


def test_overrides_reach_the_resolved_config():
    res = run_cli("train", "--dry-run", "loss=stapo", "loss.tau_p=2e-2", "loss.tau_h=0.6", "trainer.total_steps=7")
    assert res.returncode == 0, res.stderr
    cfg = resolved_yaml(res.stdout)
    assert cfg["loss"]["tau_p"] == pytest.approx(0.02)
    assert cfg["loss"]["tau_h"] == pytest.approx(0.6)
    assert cfg["trainer"]["total_steps"] == 7


def test_group_override_switches_the_loss_config_schema():
    res = run_cli("train", "--dry-run", "loss=grpo")
    assert res.returncode == 0, res.stderr
    cfg = resolved_yaml(res.stdout)
    assert cfg["loss"]["name"] == "grpo"
    # GRPO's own schema: symmetric clip and sequence-mean of token-mean, not STAPO's
    assert cfg["loss"]["clip_ratio_high"] == pytest.approx(0.2)
    assert cfg["loss"]["loss_agg_mode"] == "seq-mean-token-mean"
    assert "renormalize" not in cfg["loss"]


def test_paper_experiment_carries_table6_recipe():
    res = run_cli("train", "--dry-run", "experiment=stapo_qwen3_8b", "loss.tau_p=2e-3")
    assert res.returncode == 0, res.stderr
    cfg = resolved_yaml(res.stdout)
    # STAPO Table 6: 256 prompts/step, mini-batch 64, n=8, lr 1e-6 after 10 warm-up steps,
    # grad clip 1.0, max prompt 1k, max response 15k, rollout T=1.0/top-p=1.0
    assert cfg["model"]["path"] == "Qwen/Qwen3-8B-Base" and cfg["model"]["dtype"] == "bfloat16"
    assert cfg["data"]["train_batch_size"] == 256 and cfg["learner"]["ppo_mini_batch_size"] == 64
    assert cfg["rollout"]["n"] == 8 and cfg["rollout"]["temperature"] == 1.0 and cfg["rollout"]["top_p"] == 1.0
    assert cfg["learner"]["lr"] == pytest.approx(1e-6) and cfg["learner"]["warmup_steps"] == 10
    assert cfg["learner"]["grad_clip"] == 1.0
    assert cfg["data"]["max_prompt_length"] == 1024 and cfg["rollout"]["max_response_length"] == 15360
    assert cfg["loss"]["clip_ratio_low"] == pytest.approx(0.2) and cfg["loss"]["clip_ratio_high"] == pytest.approx(0.28)
    assert cfg["cluster"]["name"] == "slurm"


@pytest.mark.parametrize(
    "method", ["grpo", "entropy20", "justrl", "stapo"]
)
@pytest.mark.parametrize("size,model_id", [("1.7b", "Qwen/Qwen3-1.7B-Base"), ("14b", "Qwen/Qwen3-14B-Base")])
def test_every_paper_experiment_resolves(method, size, model_id):
    from stapoctl.config.compose import compose_config

    cfg = compose_config([f"experiment={method}_qwen3_{size}"])
    assert cfg.loss.name == method and cfg.model.path == model_id


def test_model_override_accepts_an_hf_id():
    from stapoctl.config.compose import compose_config

    cfg = compose_config(["model=Qwen/Qwen3-8B-Base"])
    assert cfg.model.path == "Qwen/Qwen3-8B-Base" and cfg.model.dtype == "bfloat16"


@pytest.mark.parametrize(
    "override,expected",
    [
        ("loss.tau_q=1", "unknown config key 'loss.tau_q'; did you mean 'loss.tau_p'?"),
        ("trainer.total_step=3", "unknown config key 'trainer.total_step'; did you mean 'trainer.total_steps'?"),
        ("loss=stapoo", "unknown option 'loss=stapoo': did you mean 'loss=stapo'?"),
        ("experiment=stapo_qwen3_9b", "did you mean 'stapo_qwen3_8b'?"),
        ("learner.zero_stage=7", "learner.zero_stage=7 must be 0, 1, 2 or 3"),
        ("trainer.total_steps=abc", "trainer.total_steps=abc"),
    ],
)
def test_bad_input_is_one_line_naming_the_key_and_the_fix(override, expected):
    res = run_cli("train", "--dry-run", override)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error:") and expected in lines[0]


def test_submit_without_a_cluster_points_at_train():
    res = run_cli("submit")
    assert res.returncode == 2
    assert res.stderr.strip() == ("error: stapoctl submit needs cluster=ray or cluster=slurm (cluster=local); "
                                  "to run here use `stapoctl train`")


def test_losses_command_lists_every_registered_method():
    res = run_cli("losses")
    assert res.returncode == 0, res.stderr
    for name in (
        "grpo", "dapo", "stapo", "stapo_prob_only", "stapo_high_entropy", "entropy20",
        "justrl", "wapo", "tr_grpo", "ppl_shaping", "position_shaping",
    ):
        assert name in res.stdout


def test_bench_names_the_available_benchmarks():
    res = run_cli("bench", "no_such_bench")
    assert res.returncode == 2
    assert "no benchmark 'no_such_bench'" in res.stderr and "token_stats_memory" in res.stderr
