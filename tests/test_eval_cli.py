"""`stapoctl eval` end to end: tiny model → Ray → vLLM RolloutWorker → verifier pool → JSONL,
summary.json, MLflow; then a resumed run that only generates the new problems.

Two CLI runs share one module-scoped setup (a reduced warm-started tiny model under a tmp
STAPOCTL_HOME, built once; the CLI finds it in that cache through the default model spec).
AIME-level accuracy of a 0.5M-param model is ~0, so for the paper benchmarks the test checks
that every reported number is what the JSONL verdicts give, and that each verdict is what the
rule verifier says about the stored response; the toy benchmark checks a real, non-zero score.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stapoctl.data.benches import PAPER_BENCHES

from conftest import SHARED_DATA as SHARED, TINY_OVERRIDES as MODEL_OVERRIDES

REPO = Path(__file__).resolve().parents[1]
K = 8

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not (SHARED / "SOURCES.md").is_file(), reason=f"shared benchmark copies not at {SHARED}"),
]


def _cli(args, env, cwd):
    proc = subprocess.run([sys.executable, "-m", "stapoctl.cli", "eval", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_home):
    """First run: all six benchmarks + toy, both decodings, 2 problems each; then --limit 4."""
    home = shared_home.home
    out = tmp_path_factory.mktemp("eval_out")
    env = dict(os.environ, STAPOCTL_HOME=str(home), STAPOCTL_DATA=str(SHARED), COLUMNS="200",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.pop("MLFLOW_TRACKING_URI", None)
    model_dir = shared_home.model_dir
    uri = f"sqlite:///{out / 'mlflow.db'}"
    common = ["--bench", "all", "--bench", "toy", "--decoding", "both", "--k", str(K),
              *MODEL_OVERRIDES, f"eval.output_dir={out}", f"tracking.uri={uri}", "tracking.experiment=evaltest"]
    first_log = _cli(["--limit", "2", *common], env, home)
    first = json.loads((out / "summary.json").read_text())
    second_log = _cli(["--limit", "4", *common], env, home)
    second = json.loads((out / "summary.json").read_text())
    return {"first": first, "second": second, "first_log": first_log, "second_log": second_log,
            "uri": uri, "model_dir": model_dir, "out": out}


def _records(result):
    return [json.loads(line) for line in Path(result["jsonl"]).read_text().splitlines() if line.strip()]


def test_table2_printed_for_all_benchmarks(runs):
    log = runs["first_log"]
    for title in ("AIME24", "AIME25", "AMC23", "MATH500", "Minerva", "Olympiad", "Toy", "Avg"):
        assert title in log
    results = runs["first"]["results"]
    assert {(r["bench"], r["decoding"]) for r in results} == {
        (b, d) for b in (*PAPER_BENCHES, "toy") for d in ("train", "justrl")}
    assert runs["first"]["averages"]["train"]["benches"] == 6


def test_numbers_are_what_the_jsonl_verdicts_give(runs):
    from stapoctl.reward import extract_answer, is_equivalent

    for r in runs["second"]["results"]:
        recs = _records(r)
        by_id: dict[str, list[dict]] = {}
        for rec in recs:
            by_id.setdefault(rec["id"], []).append(rec)
        assert len(by_id) == 4 and all(len(v) == K for v in by_id.values())
        assert sorted(rec["sample_index"] for rec in next(iter(by_id.values()))) == list(range(K))
        # recompute avg@k, pass@k and the lengths by hand from the verdicts
        per_problem = [sum(x["correct"] for x in v) / K for v in by_id.values()]
        assert r[f"avg@{K}"] == pytest.approx(sum(per_problem) / 4)
        assert r[f"pass@{K}"] == pytest.approx(sum(p > 0 for p in per_problem) / 4)
        gen = [x for x in recs if not x["skipped"]]
        # every bench has prompts that fit the tiny context (3 or 4 of the first 4 of each paper bench),
        # so the checks below always have generated responses to check
        assert gen, f"{r['bench']} ({r['decoding']}): every prompt skipped, no verdict left to check"
        assert r["response_length"] == pytest.approx(sum(x["length"] for x in gen) / len(gen))
        assert r["truncation_rate"] == pytest.approx(sum(x["truncated"] for x in gen) / len(gen))
        for x in gen:  # every verdict is the rule verifier's on the stored response
            assert x["extracted"] == extract_answer(x["response"])
            assert x["answer_kind"] in ("scalar", "multiset", "tuple")  # data prep's, carried to the judge
            assert x["correct"] == (x["extracted"] is not None
                                    and is_equivalent(x["extracted"], x["reference"], kind=x["answer_kind"]))
            assert x["length"] <= 48  # the tiny experiment's eval.max_response_length
    paper = [r for r in runs["second"]["results"] if r["decoding"] == "train" and r["bench"] in PAPER_BENCHES]
    assert runs["second"]["averages"]["train"]["avg"] == pytest.approx(sum(r[f"avg@{K}"] for r in paper) / 6)


def test_toy_accuracy_is_non_trivial(runs):
    toy = {r["decoding"]: r for r in runs["second"]["results"] if r["bench"] == "toy"}
    base = json.loads((Path(runs["model_dir"]) / "base_eval.json").read_text())
    # 4 problems x 8 samples per decoding; the builder measured accuracy_t1 with transformers
    correct = sum(x["correct"] for r in toy.values() for x in _records(r))
    assert correct > 0
    assert all(r["no_answer_rate"] < 1.0 for r in toy.values())  # the model boxes answers
    assert abs(toy["train"][f"avg@{K}"] - base["accuracy_t1"]) < 0.4


def test_resume_generates_only_new_problems(runs):
    for r in runs["first"]["results"]:
        assert (r["generated_problems"], r["reused_problems"]) == (2, 0)
    for r in runs["second"]["results"]:
        assert (r["generated_problems"], r["reused_problems"]) == (2, 2), r["bench"]
    assert "problems generated now: 28, reused from earlier runs: 28" in runs["second_log"].replace("\n", " ")


def test_mlflow_eval_run_has_the_same_numbers(runs):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=runs["uri"])
    summary = runs["second"]
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["stapoctl.kind"] == "eval"
    assert run.data.tags["stapoctl.model"] == "(embedded tiny)"
    for r in summary["results"]:
        key = f"eval/{r['bench']}/{r['decoding']}/avg_at_{K}"
        assert run.data.metrics[key] == pytest.approx(r[f"avg@{K}"])
    assert run.data.metrics["eval/avg6/train/acc"] == pytest.approx(summary["averages"]["train"]["avg"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "generations")}
    assert len(artifacts) == 14  # 7 benchmarks × 2 decodings
    # the run spans the work it records: open while the engines generated and verified
    duration_s = (run.info.end_time - run.info.start_time) / 1000
    assert summary["engine_s"] > 1 and duration_s >= summary["engine_s"] - 0.1, (duration_s, summary["engine_s"])


def test_skipped_long_prompts_are_counted(runs):
    """Skipped = prompts of >= 512 tokens (the tiny context), recounted here from the records."""
    for r in runs["second"]["results"]:
        recs = _records(r)
        skipped = [x for x in recs if x["skipped"]]
        assert len(skipped) == r["skipped"] * K
        assert all(not x["correct"] and x["length"] == 0 and x["response"] == "" for x in skipped)
        assert all((x["prompt_tokens"] >= 512) == x["skipped"] for x in recs)
