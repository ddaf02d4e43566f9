"""Bad input, one table: every row goes through the real CLI (`stapoctl.cli.main`, in-process) and
must exit 2 with exactly one line on stderr naming the field, no traceback, and nothing left
behind: no run dir, no eval output dir, no MLflow run, no model built, no Ray started.

Each row fails before anything expensive starts (that is what is being tested), so the whole
table runs in seconds; model rows use hand-made model dirs (a config.json, an empty weights file,
a few-token tokenizer) instead of the embedded model. Add a row for every bad input you meet.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

# (id, argv, text the one line must contain); {tmp} is the test's scratch dir (see `files`)
ROWS = [
    # out-of-range values (each declared beside its field: config.fields)
    ("tau_p_above_1", ["train", "loss.tau_p=1.5"], "loss.tau_p=1.5 must lie in (0, 1]"),
    ("tau_p_zero", ["train", "loss.tau_p=0"], "loss.tau_p=0.0 must lie in (0, 1]"),
    ("tau_h_above_1", ["train", "loss.tau_h=1.2"], "loss.tau_h=1.2 must lie in [0, 1]"),
    ("tau_h_negative", ["train", "loss.tau_h=-0.1"], "loss.tau_h=-0.1 must lie in [0, 1]"),
    ("clip_low_above_high", ["train", "loss.clip_ratio_low=0.3", "loss.clip_ratio_high=0.2"],
     "loss.clip_ratio_low=0.3 > loss.clip_ratio_high=0.2"),
    ("clip_low_negative", ["train", "loss.clip_ratio_low=-0.1"], "loss.clip_ratio_low=-0.1 must lie in [0, 1]"),
    ("clip_high_negative", ["train", "loss=grpo", "loss.clip_ratio_high=-0.2"], "loss.clip_ratio_high=-0.2"),
    ("lr_zero", ["train", "learner.lr=0"], "learner.lr=0.0 must lie in (0, inf)"),
    ("lr_negative", ["train", "learner.lr=-1e-6"], "learner.lr=-1e-06"),
    ("batch_not_divisible", ["train", "data.train_batch_size=6", "learner.ppo_mini_batch_size=4"],
     "data.train_batch_size=6 is not a multiple of learner.ppo_mini_batch_size=4"),
    ("n_below_2", ["train", "rollout.n=1"], "rollout.n=1 must lie in [2, inf) (group advantages"),
    ("total_steps_zero", ["train", "trainer.total_steps=0"], "trainer.total_steps=0 must lie in [1, inf)"),
    ("response_over_context", ["train", "rollout.max_response_length=1000"],
     "exceed the model's context of 512 (model.tiny.max_position_embeddings)"),
    ("top_p_zero", ["train", "rollout.top_p=0"], "rollout.top_p=0.0 must lie in (0, 1]"),
    # greedy rollouts: vLLM refuses n > 1 and the learner replays only tempered sampling (issue #48)
    ("temperature_zero", ["train", "rollout.temperature=0"],
     "rollout.temperature=0.0 must lie in [1e-05, inf) (vLLM decodes greedily below 1e-5"),
    ("zero_stage", ["train", "learner.zero_stage=4"], "learner.zero_stage=4 must be 0, 1, 2 or 3"),
    ("verify_timeout_zero", ["train", "reward.verify_timeout_s=0"], "reward.verify_timeout_s=0.0"),
    ("tr_grpo_weights_swapped", ["train", "loss=tr_grpo", "loss.weight_low=2"],
     "loss.weight_low=2.0 > loss.weight_high=1.4"),
    ("micro_batch", ["train", "learner.micro_batch_size=6"], "learner.micro_batch_size=6"),
    ("offload_without_zero", ["train", "learner.offload_optimizer=true"], "learner.offload_optimizer=true needs"),
    ("nccl_on_cpu", ["train", "rollout.weight_sync=nccl"], "rollout.weight_sync=nccl needs GPUs"),
    ("not_a_number", ["train", "trainer.total_steps=abc"], "trainer.total_steps=abc"),
    ("typo_key", ["train", "loss.tau_q=1"], "unknown config key 'loss.tau_q'; did you mean 'loss.tau_p'?"),
    # Hydra's append form adds any key silently: a `+` key must name a field (or a new key of a map field)
    ("appended_typo_key", ["train", "+trainer.total_stepz=5"],
     "unknown config key 'trainer.total_stepz'; did you mean 'trainer.total_steps'?"),
    ("force_appended_typo_key", ["train", "++trainer.total_stepz=5"],
     "unknown config key 'trainer.total_stepz'; did you mean 'trainer.total_steps'?"),
    ("appended_loss_typo", ["train", "loss=tr_grpo", "+loss.kl_coeff=0.001"],
     "unknown config key 'loss.kl_coeff'; did you mean 'loss.kl_coef'?"),
    ("appended_field_of_another_loss", ["train", "+loss.tau_mode=divide"],
     "unknown config key 'loss.tau_mode': loss=stapo has no such field (it is a field of loss=tr_grpo)"),
    ("appended_top_level_key", ["train", "+x=1"], "unknown config key 'x'"),
    # the recipe knobs of every loss (docs/LOSSES.md) and dynamic sampling
    ("kl_coef_negative", ["train", "loss.kl_coef=-0.1"], "loss.kl_coef=-0.1 must lie in [0, inf)"),
    ("kl_clamp_negative", ["train", "loss.kl_clamp=-1"], "loss.kl_clamp=-1.0 must lie in [0, inf)"),
    # token rules: one line per bad field of a rule, naming it and the fix
    ("token_rule_unknown_key", ["train", "loss.token_rules=[{adv: pos, prb: [0, 0.002], action: mask}]"],
     "loss.token_rules[0].prb=[0, 0.002]: unknown key: did you mean 'prob'?"),
    ("token_rule_empty_band", ["train", "loss.token_rules=[{entropy_q: [0.8, 0.2], action: mask}]"],
     "loss.token_rules[0].entropy_q=[0.8, 0.2]: an empty band (low <= x < high needs low < high), e.g. "
     "entropy_q: [0, 0.8]"),
    ("token_rule_negative_scale", ["train", "loss=grpo", "loss.token_rules=[{action: mask}, {action: scale, scale: -1}]"],
     "loss.token_rules[1].scale=-1: action: scale needs scale: c, a finite number >= 0"),
    # shadow rules: a preset name or a rule, refused the same way
    ("shadow_unknown_preset", ["train", "loss=grpo", "loss.shadow=[stapo,stapoo]"],
     "loss.shadow[1]=stapoo: not a preset; use advantage_reweighting, entropy20, stapo, stapo_high_entropy, "
     "stapo_prob_only, stare, table1"),
    ("shadow_bad_rule_in_a_list", ["train", "loss=grpo", "loss.shadow=[[{action: mask}, {adv: up, action: mask}]]"],
     "loss.shadow[0][1].adv=up: must be pos (A > 0), neg (A < 0) or any"),
    ("is_cap_below_1", ["train", "loss.rollout_is_cap=0.5"], "loss.rollout_is_cap=0.5 must lie in [1, inf)"),
    ("tr_weighted_on_grpo", ["train", "loss=grpo", "loss.kl_estimator=tr_weighted"],
     "loss.kl_estimator=tr_weighted is TR-GRPO's own weighted form"),
    ("unknown_kl_estimator", ["train", "loss.kl_estimator=k4"], "loss.kl_estimator=k4 must be k1, k2, k3, abs"),
    ("unknown_correction", ["train", "loss.rollout_correction=tis"],
     "loss.rollout_correction=tis must be auto, off, token_tis"),
    ("unknown_agg_mode", ["train", "loss.loss_agg_mode=seq-sum"], "loss.loss_agg_mode=seq-sum must be token-mean"),
    ("max_gen_batches_negative", ["train", "trainer.max_gen_batches=-1"], "trainer.max_gen_batches=-1 must lie"),
    ("alarm_action_unknown", ["train", "trainer.alarm_action=halt"],
     "trainer.alarm_action=halt must be warn, checkpoint or stop"),
    ("alarm_limit_out_of_range", ["train", "trainer.alarm_limits.entropy_drop=2"],
     "trainer.alarm_limits.entropy_drop=2.0 must lie in (0, 1]: e.g. trainer.alarm_limits.entropy_drop=0.5"),
    ("overlong_buffer_over_budget", ["train", "reward.overlong_buffer=48"],
     "reward.overlong_buffer=48 must be below rollout.max_response_length=48"),
    ("eval_decoding", ["train", "eval.decoding=greedy"], "eval.decoding=greedy must be train, justrl or both"),
    # a placement that cannot fit: fails at once, naming needed vs available and the fixes
    ("cpus_do_not_fit", ["train", "cluster.num_cpus=2", "rollout.num_workers=2"],
     "the run needs 3 CPU (2 rollout workers × 1 + 1 learner ranks × 1) and this machine has 2: "
     "set cluster.num_cpus"),
    ("verifier_cpus_do_not_fit", ["train", "cluster.num_cpus=2", "reward.model_verifier=x/y"],
     "reward.model_verifier_cpus=1.0"),
    ("custom_resource_locally", ["train", "+rollout.resources.rollout_node=1"], "rollout_node"),
    # GPUs asked for on a machine without one (skipped where a GPU exists)
    ("gpus_on_cpu_machine", ["train", "rollout.gpus_per_worker=1"], "rollout.gpus_per_worker=1.0 asks for GPUs"),
    ("learner_gpus_on_cpu_machine", ["train", "learner.gpus_per_rank=1"], "learner.gpus_per_rank=1.0 asks for GPUs"),
    # the model
    ("model_missing", ["train", "model={tmp}/no_such_model"], "no such directory"),
    ("model_not_causal_lm", ["train", "model={tmp}/bert"], "not a causal language model (BertModel"),
    ("model_without_weights", ["train", "model={tmp}/no_weights"], "no weights (*.safetensors or *.bin)"),
    ("model_without_tokenizer", ["train", "model={tmp}/no_tokenizer"], "no tokenizer in"),
    ("model_without_chat_template", ["train", "model={tmp}/no_chat", "data.template=chat"],
     "no chat template and data.template=chat: set data.template=plain"),
    ("model_context_too_short", ["train", "model={tmp}/short", "data.template=plain"],
     "exceed the model's context of 64 (max_position_embeddings"),
    ("model_is_a_file", ["train", "model={tmp}/a_file.txt"], "is a file"),
    # the dataset
    ("dataset_missing", ["train", "data.name=dapo-math-17k", "data.source={tmp}/nope.jsonl"],
     "data.source={tmp}/nope.jsonl: no such file"),
    ("dataset_empty", ["train", "data.name=dapo-math-17k", "data.source={tmp}/empty.jsonl"], "has no rows"),
    ("dataset_not_utf8", ["train", "data.name=dapo-math-17k", "data.source={tmp}/latin1.jsonl"], "is not UTF-8"),
    ("dataset_wrong_columns", ["train", "data.name=dapo-math-17k", "data.source={tmp}/columns.jsonl"],
     "each row needs 'problem'"),
    ("dataset_not_json", ["train", "data.name=dapo-math-17k", "data.source={tmp}/garbage.jsonl"], "invalid JSON"),
    ("dataset_wrong_type", ["train", "data.name=dapo-math-17k", "data.source={tmp}/rows.csv"],
     "data.source: {tmp}/rows.csv is a '.csv' file: give a .jsonl or .parquet file"),
    ("dataset_unknown", ["train", "data.name=dapo-math-18k"], "data.name=dapo-math-18k: unknown dataset"),
    ("validation_bench_unknown", ["train", "eval.every_n_steps=5", "eval.benches=[aime23]"],
     "eval.benches: aime23: unknown dataset 'aime23'"),
    # resume
    ("resume_nothing", ["train", "resume={tmp}/no_run"], "resume={tmp}/no_run: not a directory"),
    ("resume_no_checkpoint", ["train", "resume={tmp}"], "no complete checkpoint under"),
    ("resume_unknown_run_id", ["train", "resume=0123456789abcdef0123456789abcdef"],
     "resume=0123456789abcdef0123456789abcdef: no such run, the MLflow store"),
    ("eval_model_unknown_run_id", ["eval", "--model", "0123456789abcdef0123456789abcdef"], "no such run"),
    ("resume_other_experiment", ["train", "experiment=grpo_qwen3_1.7b", "resume={tmp}/other_run"],
     "is a run of experiment=stapo_qwen3_8b, not experiment=grpo_qwen3_1.7b"),
    # eval: the same model / dataset / benchmark checks
    ("eval_unknown_bench", ["eval", "--bench", "aime23"], "--bench aime23: unknown dataset 'aime23'; did you mean"),
    ("eval_training_set", ["eval", "--bench", "dapo-math-17k"], "--bench dapo-math-17k"),
    ("eval_model_missing", ["eval", "--model", "{tmp}/no_such_model"], "no such directory"),
    ("eval_model_not_causal_lm", ["eval", "--model", "{tmp}/bert"], "--model={tmp}/bert: not a causal language model"),
    ("eval_no_chat_template", ["eval", "--model", "{tmp}/no_chat"], "no chat template"),
    ("eval_bench_not_utf8", ["eval", "--bench", "aime24", "data.root={tmp}/bad_root"], "is not UTF-8"),
    ("eval_k_zero", ["eval", "--k", "0"], "--k 0"),
    ("eval_decoding", ["eval", "--decoding", "greedy"], "--decoding 'greedy'"),
    ("eval_limit_zero", ["eval", "--limit", "0"], "--limit 0"),
    ("eval_workers_do_not_fit", ["eval", "cluster.num_cpus=1", "rollout.num_workers=2"], "the run needs 2 CPU"),
    # a SLURM partition sinfo does not list (needs a SLURM: tests/run.sh starts a local one)
    ("slurm_partition_unknown", ["submit", "cluster=slurm", "cluster.partition=nope"], "cluster.partition='nope'"),
]

GPU_ROWS = {"gpus_on_cpu_machine", "learner_gpus_on_cpu_machine"}


def _params():
    out = []
    for row_id, argv, expected in ROWS:
        marks = []
        if row_id in GPU_ROWS:
            marks.append(pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: the request is valid"))
        if row_id.startswith("slurm_"):
            marks.append(pytest.mark.skipif(not _has_slurm(), reason="no SLURM here (cluster/local-slurm/start.sh)"))
        out.append(pytest.param(argv, expected, id=row_id, marks=marks))
    return out


def _has_slurm() -> bool:
    import shutil
    import subprocess

    if not shutil.which("sinfo"):
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# -- the scratch files the rows point at ---------------------------------------------------------------
def _tokenizer(out: Path, chat: bool) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "the", "answer", "is", "1", "2"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")
    if chat:
        fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(str(out))


def _model_dir(out: Path, *, arch: str = "Qwen3ForCausalLM", model_type: str = "qwen3", weights: bool = True,
               tokenizer: bool = True, chat: bool = True, context: int = 4096) -> None:
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type,
                                                 "max_position_embeddings": context}))
    if weights:
        (out / "model.safetensors").write_bytes(b"")  # presence is what is checked before the engine loads it
    if tokenizer:
        _tokenizer(out, chat)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bad_input")
    _model_dir(tmp / "bert", arch="BertModel", model_type="bert")
    _model_dir(tmp / "no_weights", weights=False)
    _model_dir(tmp / "no_tokenizer", tokenizer=False)
    _model_dir(tmp / "no_chat", chat=False)
    _model_dir(tmp / "short", context=64)
    (tmp / "a_file.txt").write_text("not a model\n")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "latin1.jsonl").write_bytes('{"problem": "Caf\xe9 prices", "answer": "3"}\n'.encode("latin-1"))
    (tmp / "columns.jsonl").write_text('{"q": "1+1?", "a": "2"}\n{"q": "2+2?", "a": "4"}\n')
    (tmp / "garbage.jsonl").write_text("this is not json\n")
    (tmp / "rows.csv").write_text("problem,answer\n1+1,2\n")
    (tmp / "bad_root").mkdir()
    (tmp / "bad_root" / "aime24.jsonl").write_bytes(b'{"problem": "\xff\xfe", "answer": "1"}\n')
    step = tmp / "other_run" / "checkpoints" / "step_000005"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({
        "step": 5, "mlflow_run_id": "0" * 32, "run_dir": str(tmp / "other_run"), "base_model": "Qwen/Qwen3-8B-Base",
        "sampler": {}, "config": {"experiment": "stapo_qwen3_8b", "tracking": {"experiment": "stapoctl"}}}))
    return tmp


# -- the CLI, in-process, exactly as `stapoctl` runs it ----------------------------------------------------
def run_cli(argv: list[str], monkeypatch) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `stapoctl ARGV` through `stapoctl.cli.main`."""
    from stapoctl import cli

    runner = CliRunner()
    monkeypatch.setattr(sys, "argv", ["stapoctl", *argv])
    with runner.isolation() as (out, err, _):
        cli.err_console.file = sys.stderr  # rich binds its stream when first used: bind the captured one
        cli.console.file = sys.stdout
        try:
            cli.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            cli.err_console.file = None  # back to the real streams
            cli.console.file = None
        return code, out.getvalue().decode(), err.getvalue().decode()


def _mlflow_runs(db: Path) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(db) as con:
        tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
        return con.execute("select count(*) from runs").fetchone()[0] if "runs" in tables else 0


@pytest.mark.parametrize("argv,expected", _params())
def test_bad_input_exits_2_with_one_line_and_leaves_nothing(argv, expected, files, tmp_path, monkeypatch):
    home, db = tmp_path / "home", tmp_path / "mlflow.db"
    monkeypatch.setenv("STAPOCTL_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")  # train, eval and resume all read it
    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.delenv("STAPOCTL_DATA", raising=False)
    # a row that slips past validation must fail here, not start engines or build the model
    from stapoctl.launch import ray_runtime
    from stapoctl.models import tiny

    def refuse(what):
        def call(*_a, **_k):
            raise AssertionError(f"{what} started: the bad input was not refused first")
        return call

    monkeypatch.setattr(ray_runtime, "ensure_ray", refuse("Ray"))
    monkeypatch.setattr(tiny, "ensure_base_model", refuse("the embedded model build"))
    argv = [a.replace("{tmp}", str(files)) for a in argv]
    expected = expected.replace("{tmp}", str(files))

    code, out, err = run_cli(argv, monkeypatch)

    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit {code}; stderr: {err}; stdout: {out[-2000:]}"
    assert "Traceback" not in err + out
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    # nothing left behind
    assert not (home / "runs").exists() and not (home / "eval").exists(), "a run/eval dir was created"
    assert not (home / "models").exists(), "the embedded model was built before the input was checked"
    assert _mlflow_runs(db) == 0 and _mlflow_runs(home / "mlflow.db") == 0, "an MLflow run was created"
    import ray

    assert not ray.is_initialized(), "Ray was started before the input was checked"

