"""`stapoctl train` end to end: the tiny experiment through real Ray + vLLM-CPU + DeepSpeed +
MLflow (sqlite) for a few steps, then a resume from the middle checkpoint that must draw the
same batch and compute the same loss as the uninterrupted run did.

The base model is the session's reduced warm start (`shared_home` in conftest.py), so the test is
hermetic; it answers a few toy problems, so some groups have non-zero advantages.
"""

from __future__ import annotations

import json

import pytest
import torch

TOTAL, SAVE = 3, 2
OVERRIDES = [
    f"trainer.total_steps={TOTAL}",
    f"trainer.save_freq={SAVE}",
    "eval.every_n_steps=2",
    "trainer.diagnostics_every=2",
    "learner.ppo_mini_batch_size=8",  # one PPO update per step: the loss sees the diagnostics' π, H and h*
]
SAME_AT_STEP_3 = ("batch/fingerprint", "batch/prompts_fingerprint", "critic/score/mean",
                  "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
                  "stapo/spurious_ratio")


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared_home):
    """One 3-step run and one resume from its step-2 checkpoint; both summaries and the store."""
    from rich.console import Console

    from stapoctl.config.compose import compose_config
    from stapoctl.trainer.driver import train

    home = shared_home.home
    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_HOME", str(home))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path_factory.mktemp('e2e_store') / 'mlflow.db'}"
    console = Console(width=120, record=True)
    try:
        first = train(compose_config(shared_home.overrides + OVERRIDES + [f"tracking.uri={uri}"]),
                      console=console)
        step2 = f"{first['run_dir']}/checkpoints/step_{SAVE:06d}"
        resumed = train(compose_config([f"resume={step2}", f"tracking.uri={uri}"]), console=console)
    finally:
        mp.undo()
    return {"first": first, "resumed": resumed, "uri": uri, "home": home, "log": console.export_text()}


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    import mlflow

    return [(m.step, m.value) for m in mlflow.MlflowClient(uri).get_metric_history(run_id, key)]


@pytest.mark.e2e
def test_metrics_are_logged_every_step(run):
    import mlflow

    first = run["first"]
    client = mlflow.MlflowClient(run["uri"])
    data = client.get_run(first["run_id"]).data
    assert data.tags["stapoctl.run_dir"] == first["run_dir"]
    assert data.params["loss.name"] == "stapo"
    # the run states which MKL kernels its learner ran (launch/mkl_shim.py): AVX-512 ones on an AMD CPU
    from stapoctl.launch import mkl_shim

    assert data.tags["stapoctl.learner_shared_prefix"] == "on"  # learner.shared_prefix=null: auto, CPU learner
    mkl = json.loads(data.tags["stapoctl.learner_mkl"])
    if mkl_shim.preload_env():
        assert mkl["amd_shim"] is True and mkl["code_path"] > 0, mkl
    else:
        assert mkl["amd_shim"] is False, mkl
    for key in ("actor/entropy", "actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm", "response_length/mean",
                "critic/score/mean", "reward/accuracy", "stapo/spurious_ratio",
                "timing_s/gen", "timing_s/ref", "timing_s/update", "timing_s/sync",
                "perf/gen_tokens_per_s", "perf/train_tokens_per_s"):
        steps = [s for s, _ in history(run["uri"], first["run_id"], key)]
        assert steps[:TOTAL] == list(range(1, TOTAL + 1)), key
    # the sync canary needs the learner's measuring pass: at a run's first step, every
    # rollout.logprob_check_every steps and with each token-diagnostics step (here every 2)
    canary = [s for s, _ in history(run["uri"], first["run_id"], "rollout/logprob_diff_max")]
    assert {1, 2} <= set(canary) <= set(range(1, TOTAL + 1)), canary
    # the weights vLLM sampled with are the learner's: the canary stays at float noise
    assert max(v for _, v in history(run["uri"], first["run_id"], "rollout/logprob_diff_max")) < 1e-4
    val = history(run["uri"], first["run_id"], "val/toy/train/avg_at_4")
    assert [s for s, _ in val][:3] == [0, 2, 3]
    assert all(0.0 <= v <= 1.0 for _, v in val)
    assert "MLflow store: sqlite:///" in run["log"]


@pytest.mark.e2e
def test_validation_records_its_protocol(run, tmp_path):
    """The run's validations wrote their protocol (eval/protocol.py): the artifact's sha256 is the
    tag, it describes what ran (the 64 held-out toy problems at k 4, the train decoding, the run's
    max tokens), and the resume, validating the same way, left it as it was."""
    import hashlib

    import mlflow

    from stapoctl.tracking import keys

    client = mlflow.MlflowClient(run["uri"])
    rid = run["first"]["run_id"]
    tag = client.get_run(rid).data.tags[keys.PROTOCOL]
    path = client.download_artifacts(rid, keys.PROTOCOL_ARTIFACT, str(tmp_path))
    raw = open(path, "rb").read()
    assert hashlib.sha256(raw).hexdigest() == tag
    protocol = json.loads(raw)
    assert protocol["benches"]["toy"]["problems"] == 64 and protocol["benches"]["toy"]["k"] == 4
    params = client.get_run(rid).data.params
    assert params["eval.decoding"] == "train"  # the tiny experiment validates at T=1.0 only
    assert protocol["decodings"] == {"train": {"temperature": 1.0, "top_p": 1.0}}
    assert protocol["max_tokens"] == int(params["eval.max_response_length"])
    assert run["resumed"]["run_id"] == rid  # the resume re-recorded it on the same run: still the one protocol


@pytest.mark.e2e
def test_checkpoints_are_complete_and_loadable(run):
    from transformers import AutoModelForCausalLM

    from stapoctl.checkpoint import latest_step_dir, resolve_resume

    import pathlib

    run_dir = run["first"]["run_dir"]
    root = f"{run_dir}/checkpoints"

    assert (pathlib.Path(root) / "latest").read_text().strip() == f"step_{TOTAL:06d}"
    assert latest_step_dir(pathlib.Path(run_dir)).name == f"step_{TOTAL:06d}"
    assert not list(pathlib.Path(root).glob(".step_*")), "a temp dir was left behind"
    step2 = pathlib.Path(root) / f"step_{SAVE:06d}"
    state = json.loads((step2 / "trainer_state.json").read_text())
    assert state["step"] == SAVE and state["mlflow_run_id"] == run["first"]["run_id"]
    assert state["sampler"] == {"epoch": 0, "position": SAVE * 8}
    assert (step2 / "state" / "ds").is_dir()
    model = AutoModelForCausalLM.from_pretrained(str(step2 / "model"))
    base = AutoModelForCausalLM.from_pretrained(state["base_model"])
    moved = max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(), base.state_dict().values()))
    assert moved > 0, "training did not change the weights"
    # a run id resolves (through the MLflow tag) to its run dir's newest checkpoint
    assert resolve_resume(run["first"]["run_id"], run["uri"]).name == f"step_{TOTAL:06d}"


@pytest.mark.e2e
def test_resume_reproduces_the_next_step(run):
    first, resumed = run["first"], run["resumed"]
    assert resumed["run_id"] == first["run_id"], "resume must continue the same MLflow run"
    # step 3 was logged by the first run; the resumed run recomputed it from the step-2
    # checkpoint, found the same batch, and did not log it again (one point per step)
    assert resumed["replayed"] == {"steps": [3], "mismatched": []}
    for key in SAME_AT_STEP_3:
        at3 = [v for s, v in history(run["uri"], first["run_id"], key) if s == 3]
        assert len(at3) == 1, (key, at3)
        assert resumed["final"][key] == pytest.approx(at3[0], rel=1e-5, abs=1e-6), key
    # step 3 had correct answers, hence a real gradient: equal losses are not trivially zero
    norms = [v for s, v in history(run["uri"], first["run_id"], "actor/grad_norm") if s == 3]
    assert norms[0] > 0, "step 3 had no learning signal: the reproduction check would be vacuous"


@pytest.mark.e2e
def test_token_diagnostics_are_artifacts_and_agree_with_the_loss(run, tmp_path):
    """diagnostics/step_000002/ holds the 000 §3 artifacts; with one mini-batch the loss saw the
    same π, H and h*, so its logged h*, token count and spurious count equal the diagnostics'."""
    import mlflow

    from stapoctl.tracking.token_diagnostics import FILES, SPURIOUS

    run_id = run["first"]["run_id"]
    client = mlflow.MlflowClient(run["uri"])
    listed = {a.path for a in client.list_artifacts(run_id, "diagnostics/step_000002")}
    assert listed == {f"diagnostics/step_000002/{f}" for f in FILES}
    local = client.download_artifacts(run_id, "diagnostics/step_000002/categories.json", str(tmp_path))
    diag = json.loads(open(local).read())
    at2 = {k: v for k in ("stapo/entropy_threshold", "loss/response_tokens", "stapo/spurious_count")
           for s, v in history(run["uri"], run_id, k) if s == 2}
    assert diag["h_star"] == [pytest.approx(at2["stapo/entropy_threshold"], abs=1e-5)]
    assert diag["response_tokens"] == at2["loss/response_tokens"] > 0
    assert diag["counts"][SPURIOUS] == at2["stapo/spurious_count"]
    assert sum(diag["counts"].values()) + diag["zero_advantage"] == diag["response_tokens"]
