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


def test_version_and_short_help():
    from importlib.metadata import version

    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout == f"stapoctl {version('stapoctl')}\n", res.stderr
    assert run_cli("-h").stdout == run_cli("--help").stdout
    res = run_cli("train", "-h")
    assert res.returncode == 0 and " train [OPTIONS]" in res.stdout and "--dry-run" in res.stdout


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
    "method", ["grpo", "entropy20", "justrl", "stapo", "dapo"]
)
@pytest.mark.parametrize("size,model_id", [("1.7b", "Qwen/Qwen3-1.7B-Base"), ("14b", "Qwen/Qwen3-14B-Base")])
def test_every_paper_experiment_resolves(method, size, model_id):
    from stapoctl.config.compose import compose_config

    cfg = compose_config([f"experiment={method}_qwen3_{size}"])
    assert cfg.loss.name == method and cfg.model.path == model_id


@pytest.mark.parametrize("size", ["1.7b", "8b", "14b"])
def test_dapo_experiments_carry_dapos_recipe(size):
    """DAPO (arXiv 2503.14476): clip-higher + token-mean, dynamic sampling, 16384 + 4096 = 20480
    response tokens with the soft overlong punishment; the rest is Table 6 like the STAPO rows."""
    from stapoctl.config.compose import compose_config

    cfg = compose_config([f"experiment=dapo_qwen3_{size}"])
    assert cfg.loss.name == "dapo" and cfg.loss.loss_agg_mode == "token-mean"
    assert (cfg.loss.clip_ratio_low, cfg.loss.clip_ratio_high) == pytest.approx((0.2, 0.28))
    assert cfg.rollout.max_response_length == 20480 and cfg.reward.overlong_buffer == 4096
    assert cfg.reward.overlong_penalty == 1.0 and cfg.reward.overlong_filter is False
    assert cfg.trainer.dynamic_sampling is True
    assert cfg.data.train_batch_size == 256 and cfg.rollout.n == 8 and cfg.learner.lr == pytest.approx(1e-6)


def test_tiny_dapo_is_the_tiny_default_with_dapos_recipe():
    from stapoctl.config.compose import compose_config

    cfg, tiny = compose_config(["experiment=tiny_dapo"]), compose_config([])
    assert cfg.experiment == "tiny_dapo" and cfg.loss.name == "dapo" and cfg.trainer.dynamic_sampling is True
    assert cfg.reward.overlong_buffer == 16 and cfg.rollout.max_response_length == 48
    assert cfg.model == tiny.model and cfg.data == tiny.data and cfg.learner == tiny.learner


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
        ("+trainer.total_stepz=5", "unknown config key 'trainer.total_stepz'; did you mean 'trainer.total_steps'?"),
        ("reward.overlong_buffer=64", "reward.overlong_buffer=64 must be below rollout.max_response_length=48"),
    ],
)
def test_bad_input_is_one_line_naming_the_key_and_the_fix(override, expected):
    res = run_cli("train", "--dry-run", override)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error:") and expected in lines[0]


def test_appended_keys_that_name_a_field_or_a_map_entry_are_kept():
    """`+` is refused only where it names no field: map fields take new keys, a `+` on a declared
    field (of the schema or of the selected loss) is a plain override."""
    from stapoctl.config.compose import compose_config

    cfg = compose_config(["+rollout.resources.rollout_node=1", "+learner.resources.learner_node=1",
                          "+tracking.tags.team=rl", "++tracking.tags.group=a", "+trainer.total_steps=5",
                          "++trainer.save_freq=3", "loss=tr_grpo", "+loss.tau_mode=divide", "+loss.kl_coef=0.001"])
    assert dict(cfg.rollout.resources) == {"rollout_node": 1.0} and dict(cfg.learner.resources) == {"learner_node": 1.0}
    assert dict(cfg.tracking.tags) == {"team": "rl", "group": "a"}
    assert cfg.trainer.total_steps == 5 and cfg.trainer.save_freq == 3
    assert cfg.loss.tau_mode == "divide" and cfg.loss.kl_coef == pytest.approx(0.001)


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
        "justrl", "wapo", "tr_grpo", "ppl_shaping", "position_shaping", "stare", "advantage_reweighting",
    ):
        assert name in res.stdout
    # the one list field, on every loss, and the presets written as the rules they are
    assert res.stdout.count("token_rules=[]") == 13 and "kl_clamp=10.0" in res.stdout
    assert res.stdout.count("shadow=[]") == 13 and "loss.shadow=[stapo,table1]" in " ".join(res.stdout.split())
    assert "preset rules: {adv: pos, prob: [0, 0.002], entropy_q: [0, 0.8], action: mask}" in res.stdout
    assert "preset rules: {entropy_q: [0, 0.8], action: mask, renorm: false}" in res.stdout
    assert "loss.token_rules=[{adv: pos" in " ".join(res.stdout.split())  # the caption's example


RULES = ("loss.token_rules=[{adv: pos, prob: [0, 0.002], entropy_q: [0, 0.8], action: mask},"
         " {adv: neg, rel_position: [0.5, null], action: scale, scale: 0.5, name: late_neg}]")


def test_token_rules_from_the_command_line_reach_the_loss_unchanged_and_are_logged_in_full():
    """The list composes as Hydra parses it, is one MLflow param in full, and the dict the learner
    gets (`OmegaConf.to_container(conf.loss)`, passed as **cfg) drives the loss, micro-batched as the
    learner does: dapo + [STAPO's rule, a scale of late A < 0 tokens] equals stapo + [that scale]."""
    import torch
    from omegaconf import OmegaConf

    from stapoctl.config.compose import compose_config, to_flat_dict
    from stapoctl.losses import compute_policy_loss, prepare_minibatch, slice_context

    cfg = compose_config(["loss=dapo", RULES])
    rules = OmegaConf.to_container(cfg.loss.token_rules)
    assert rules == [{"adv": "pos", "prob": [0, 0.002], "entropy_q": [0, 0.8], "action": "mask"},
                     {"adv": "neg", "rel_position": [0.5, None], "action": "scale", "scale": 0.5, "name": "late_neg"}]
    logged = str(to_flat_dict(cfg)["loss.token_rules"])  # the param tracking.log_config writes (≤ 6000 chars)
    assert len(logged) < 6000
    assert all(part in logged for part in ("'entropy_q': [0, 0.8]", "'scale': 0.5", "'name': 'late_neg'"))
    dapo = dict(OmegaConf.to_container(cfg.loss, resolve=True))  # what the learner holds as loss_cfg
    stapo = dict(OmegaConf.to_container(compose_config(["loss=stapo", "+loss.token_rules=[" + RULES.split("},", 1)[1]]).loss,
                                        resolve=True))
    g = torch.Generator().manual_seed(0)
    lp = torch.rand(6, 7, generator=g).mul(-8.0)
    batch = dict(old_log_prob=lp + 0.1 * torch.randn(6, 7, generator=g), advantages=torch.tensor([1., -1, 2, -2, .5, 0]),
                 response_mask=torch.arange(7)[None] < torch.tensor([7, 5, 6, 3, 7, 4])[:, None],
                 entropy=torch.rand(6, 7, generator=g) * 2)
    losses = []
    plain = {**dapo, "token_rules": []}
    for loss_cfg in (dapo, stapo, plain):
        name = loss_cfg["name"]
        ctx = prepare_minibatch(name, log_prob=lp, **{k: v for k, v in batch.items() if k != "old_log_prob"},
                                **loss_cfg)
        total = sum(compute_policy_loss(name, log_prob=lp[r], **{k: v[r] for k, v in batch.items()},
                                        **slice_context(ctx, r), **loss_cfg)[0] for r in (slice(0, 2), slice(2, 6)))
        losses.append(total.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-7) and abs(losses[0] - losses[2]) > 1e-5  # the rules bite


def test_shadows_from_the_command_line_reach_the_loss_and_change_nothing_but_metrics():
    import torch
    from omegaconf import OmegaConf

    from stapoctl.config.compose import compose_config
    from stapoctl.losses import compute_policy_loss

    loss_cfg = dict(OmegaConf.to_container(compose_config(["loss=grpo", "loss.shadow=[stapo,entropy20]"]).loss,
                                           resolve=True))
    assert loss_cfg["shadow"] == ["stapo", "entropy20"]
    g = torch.Generator().manual_seed(1)
    batch = dict(log_prob=torch.rand(4, 6, generator=g).mul(-8.0), old_log_prob=torch.rand(4, 6, generator=g).mul(-8.0),
                 advantages=torch.tensor([1., -1, 2, -2]), response_mask=torch.ones(4, 6, dtype=torch.bool),
                 entropy=torch.rand(4, 6, generator=g))
    shadowed, m = compute_policy_loss("grpo", **batch, **loss_cfg)
    plain, _ = compute_policy_loss("grpo", **batch, **{**loss_cfg, "shadow": []})
    # 24 distinct H: the 0.8 quantile lies between the 19th and 20th smallest, so 19 tokens fall below it
    assert shadowed.item() == plain.item() and m["shadow/entropy20/token_share"] == pytest.approx(19 / 24)


def test_bench_names_the_available_benchmarks():
    res = run_cli("bench", "no_such_bench")
    assert res.returncode == 2
    assert "no benchmark 'no_such_bench'" in res.stderr and "token_stats_memory" in res.stderr
