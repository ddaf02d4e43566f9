"""Eval pieces without an engine: protocol defaults, the resumable JSONL store, the report."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from stapoctl.errors import UserError
from stapoctl.data.benches import PAPER_BENCHES, expand_benches, samples_per_problem, select_decodings
from stapoctl.eval.report import print_report
from stapoctl.eval.runner import prepare_problems
from stapoctl.eval.store import SampleStore, model_slug, settings_key


def test_all_is_the_six_paper_benchmarks_in_table_order():
    assert expand_benches(["all"]) == ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]
    # toy is extra, deduplicated, comma lists accepted, aliases resolved
    assert expand_benches(["toy", "math-500,aime24", "aime24"]) == ["aime24", "math500", "toy"]


def test_bad_bench_and_decoding_are_one_line_user_errors():
    with pytest.raises(UserError, match="--bench dapo-math-17k"):
        expand_benches(["dapo-math-17k"])
    with pytest.raises(UserError, match="did you mean"):
        expand_benches(["aime42"])
    with pytest.raises(UserError, match="--decoding"):
        select_decodings("greedy")
    with pytest.raises(UserError, match="--k 0"):
        samples_per_problem("aime24", 0)


def test_paper_defaults():
    # STAPO §5.1: N=32 for AIME24/25 and AMC23, N=4 for the large sets
    assert [samples_per_problem(b, None) for b in PAPER_BENCHES] == [32, 32, 32, 4, 4, 4]
    assert samples_per_problem("aime24", 8) == 8
    train, justrl = select_decodings("both")
    assert (train.temperature, train.top_p) == (1.0, 1.0)
    assert (justrl.temperature, justrl.top_p) == (0.7, 0.9)


def _recs(pid, k, correct=False):
    return [{"id": pid, "sample_index": j, "correct": correct, "extracted": None, "length": 3,
             "truncated": False} for j in range(k)]


def test_store_resumes_whole_problems_and_drops_partial_ones(tmp_path):
    path = tmp_path / "b.jsonl"
    store = SampleStore(path, k=2)
    store.append(_recs("p1", 2) + _recs("p2", 2, True))
    # simulate a crash: one record of p3 written, then a torn line
    with path.open("a") as fh:
        fh.write(json.dumps(_recs("p3", 2)[0]) + "\n")
        fh.write('{"id": "p3", "sample_in')
    again = SampleStore(path, k=2)
    assert again.done_ids() == {"p1", "p2"}  # p3 will be generated again
    assert len(path.read_text().splitlines()) == 4  # the partial problem was removed from disk
    assert [r["id"] for r in again.for_ids(["p2"])] == ["p2", "p2"]


def test_store_refuses_a_corrupt_middle_line(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text('{"id": "p1", "sample_index": 0}\nnot json\n{"id": "p2", "sample_index": 0}\n')
    with pytest.raises(UserError, match="delete the file"):
        SampleStore(path, k=1)


def test_settings_key_and_slug_are_stable_and_distinct():
    a = settings_key({"model": "m", "k": 4, "temperature": 1.0})
    assert a == settings_key({"temperature": 1.0, "k": 4, "model": "m"})
    assert a != settings_key({"model": "m", "k": 4, "temperature": 0.7})
    assert model_slug("/x/runs/abc/checkpoints/step_000020/model") != model_slug("/y/runs/abc/checkpoints/step_000020/model")
    assert "/" not in model_slug("Qwen/Qwen3-8B-Base")


class _CharTokenizer:
    """One token per character: prompt length in tokens = len(prompt)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_prompts_longer_than_the_context_are_flagged():
    rows = [{"id": "a", "prompt": "x" * 9, "answer": "1"}, {"id": "b", "prompt": "x" * 10, "answer": "2"}]
    short, long = prepare_problems(rows, _CharTokenizer(), max_model_len=10)
    assert not short.too_long  # 9 tokens leave room for 1 generated token
    assert long.too_long  # 10 tokens fill the context: vLLM would reject it


def _summary():
    def result(bench, dec, k, avg):
        return {"bench": bench, "decoding": dec, "k": k, f"avg@{k}": avg, f"avg@{k}_ci95": 0.01,
                f"pass@{k}": avg, "pass@1": avg, f"maj@{k}": avg, "problems": 30.0, "samples": 30.0 * k,
                "skipped": 0.0, "response_length": 10.0, "truncation_rate": 0.0, "no_answer_rate": 0.5,
                "verify_timeouts": 0.0, "generated_problems": 30, "reused_problems": 0}

    results = []
    for i, b in enumerate(PAPER_BENCHES):
        k = 32 if i < 3 else 4
        results += [result(b, "train", k, 0.10 * (i + 1)), result(b, "justrl", k, 0.05 * (i + 1))]
    return {"model": "m", "model_name": "m", "model_path": "/m", "max_response_length": 48, "wall_s": 1.0,
            "engine_s": 1.0, "results": results,
            "averages": {"train": {"benches": 6, "avg": 0.35}, "justrl": {"benches": 6, "avg": 0.175}}}


def test_report_is_table2_shaped():
    console = Console(width=160, record=True)
    print_report(_summary(), console)
    text = console.export_text()
    for title in ("AIME24", "AIME25", "AMC23", "MATH500", "Minerva", "Olympiad", "Avg"):
        assert title in text
    # cells: T=1.0 value with the JustRL value in parentheses, in percent
    assert "10.00 (5.00)" in text and "60.00 (30.00)" in text
    assert "35.00 (17.50)" in text  # the six-benchmark average


def test_too_long_prompts_become_skipped_incorrect_records_without_an_engine():
    from stapoctl.data.benches import DECODINGS
    from stapoctl.eval.metrics import summarize
    from stapoctl.eval.runner import Problem, judge_problems

    problems = [Problem("long", list(range(600)), "5", "q", too_long=True)]
    seen = []
    recs = judge_problems([], None, problems, bench="aime24", decoding=DECODINGS["train"], k=3,
                          max_tokens=8, on_chunk=lambda r, n: seen.append(n))
    assert seen == [1] and len(recs) == 3
    assert all(r["skipped"] and not r["correct"] and r["prompt_tokens"] == 600 for r in recs)
    s = summarize(recs, 3)
    assert (s["avg@3"], s["skipped"], s["problems"]) == (0.0, 1.0, 1.0)


def test_eval_run_is_nested_under_the_training_run(tmp_path, monkeypatch):
    """--model <training run id> (a short one here): the eval run carries mlflow.parentRunId and
    stapoctl.train_run_id with the full id."""
    import mlflow
    from omegaconf import OmegaConf

    from stapoctl.eval.mlflow_log import eval_run, log_mlflow
    from stapoctl.tracking import mlflow_run

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with mlflow_run.start_run(uri=uri, experiment="e", run_name="train") as train:
        train_id = train.info.run_id
    conf = OmegaConf.create({"tracking": {"uri": uri, "experiment": "e", "log_artifacts": True},
                             "eval": {"seed": 0}})
    summary = _summary()
    summary["limit"] = None
    with eval_run(conf, train_id[:8], summary["model_path"]) as opened:
        log_mlflow(conf, summary, [])
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(opened.info.run_id)
    assert run.data.tags["mlflow.parentRunId"] == train_id
    assert run.data.tags["stapoctl.train_run_id"] == train_id
    assert run.data.tags["stapoctl.kind"] == "eval"
    assert run.data.metrics["eval/aime24/train/avg_at_32"] == pytest.approx(0.10)
    assert run.data.metrics["eval/avg6/justrl/acc"] == pytest.approx(0.175)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--bench", "gsm8k"], "unknown dataset 'gsm8k'"),
        (["--bench", "aime24", "--decoding", "greedy"], "--decoding 'greedy'"),
        (["--bench", "aime24", "--limit", "0"], "--limit 0"),
    ],
)
def test_cli_bad_input_is_one_line(args, message, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, STAPOCTL_HOME=str(tmp_path), PYTHONPATH=str(repo), COLUMNS="300")
    proc = subprocess.run([sys.executable, "-m", "stapoctl.cli", "eval", *args], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
