"""`stapoctl data prep` and `load_rows` on the local copies in ../shared/data (never committed):
row counts, DAPO de-duplication, the instruction template, malformed rows, the hub schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from stapoctl.config.schema import STAPO_INSTRUCTION, DataConfig
from stapoctl.data import sources
from stapoctl.data.prep import prep_command
from stapoctl.data.registry import load_rows
from stapoctl.errors import UserError

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared = pytest.mark.skipif(
    not (SHARED / "SOURCES.md").is_file(),
    reason=f"shared benchmark copies not found at {SHARED} (CI clones the repo next to shared/)",
)

EXPECTED_ROWS = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva": 272, "olympiadbench": 675}


def conf(**data):
    from stapoctl.config.compose import compose_config

    cfg = compose_config([])
    OmegaConf.set_struct(cfg, False)
    for key, value in data.items():
        cfg.data[key] = value
    return cfg


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("STAPOCTL_DATA", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub lookup must fail at once, not retry
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return tmp_path / "home"


@needs_shared
def test_benchmarks_prep_with_their_row_counts_and_the_plain_template(home, tmp_path):
    cfg = conf(root=str(SHARED))
    out = tmp_path / "out"
    console = Console(file=open(os.devnull, "w"))
    stats = {s.name: s for s in (
        prep_command(cfg, name=n, source=None, out=str(out), strict=True, template="plain", console=console)[0]
        for n in EXPECTED_ROWS
    )}
    for name, count in EXPECTED_ROWS.items():
        rows = read_jsonl(out / f"{name}.jsonl")
        assert len(rows) == count == stats[name].read == stats[name].kept, name
        assert stats[name].malformed == 0 and stats[name].duplicates == 0
        assert len({r["id"] for r in rows}) == count
        for row in rows:
            assert list(row)[:3] == ["id", "prompt", "answer"]
            assert row["prompt"] == f"{row['problem']}\n{STAPO_INSTRUCTION}\n"
    aime = read_jsonl(out / "aime24.jsonl")[0]
    assert aime["id"] == "2024-I-1" and aime["answer"] == "204"  # SOURCES.md's check
    assert aime["url"].startswith("https://artofproblemsolving.com")  # source fields kept
    olymp = {r["id"]: r for r in read_jsonl(out / "olympiadbench.jsonl")}
    assert olymp["olympiadbench-1606"]["final_answer"] == ["2"]


@needs_shared
def test_dapo_math_17k_is_deduplicated_to_unique_prompts(home, tmp_path):
    cfg = conf()
    out = tmp_path / "out"
    [stats] = prep_command(cfg, name="dapo-math-17k", source=str(SHARED / "dapo_math_17k.jsonl"),
                           out=str(out), strict=True, template="plain", console=Console(file=open(os.devnull, "w")))
    # The shared copy is already unique by exact text (17,290 rows, SOURCES.md); 102 more
    # problems differ from an earlier one only in whitespace (double spaces after a period),
    # one of those pairs with different answers.
    assert (stats.read, stats.kept, stats.duplicates, stats.conflicting_duplicates) == (17290, 17188, 102, 1)
    rows = read_jsonl(out / "dapo-math-17k.jsonl")
    assert len(rows) == 17188
    by_problem = {r["problem"]: r for r in rows}
    single = "Assume that $f(a+b) = f(a) + f(b) + ab$, and that $f(75) - f(51) = 1230$. Find $f(100)$."
    twin = single.replace(". Find", ".  Find")
    twin_id = next(r["id"] for r in read_jsonl(SHARED / "dapo_math_17k.jsonl") if r["problem"] == twin)
    kept = by_problem[single]
    assert kept["answer"] == "3825" and kept["duplicate_ids"] == [twin_id]
    assert twin not in by_problem
    assert kept["source_prompt"].startswith("Solve the following math problem step by step.")
    assert kept["prompt"].endswith(f"{STAPO_INSTRUCTION}\n")  # STAPO's instruction, not DAPO's


def hub_dapo_row(problem: str, answer: str, index: str) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": sources.DAPO_PREFIX + problem + sources.DAPO_SUFFIX, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def test_hub_dapo_schema_from_a_parquet_source(home, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [hub_dapo_row("What is $2+3$?", "5", "u1"), hub_dapo_row("What is $2+3$?", "5", "u2"),
            hub_dapo_row("What is  $2+3$?", "5", "u3"), hub_dapo_row("Find $x$ if $x^2=49$, $x>0$.", "7", "u4")]
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    [stats] = prep_command(conf(), name="dapo_math_17k", source=str(path), out=str(tmp_path / "o"),
                           strict=True, template="plain", console=Console(file=open(os.devnull, "w")))
    assert (stats.read, stats.kept, stats.duplicates) == (4, 2, 2)
    out = read_jsonl(tmp_path / "o" / "dapo-math-17k.jsonl")
    assert [r["problem"] for r in out] == ["What is $2+3$?", "Find $x$ if $x^2=49$, $x>0$."]
    assert [r["answer"] for r in out] == ["5", "7"]
    assert out[0]["id"] == "dapo-u1" and out[0]["duplicate_ids"] == ["dapo-u2", "dapo-u3"]


BAD_ROWS = [
    '{"id": "r1", "problem": "What is 1+1?", "answer": "2"}',
    '{"id": "r2", "problem": "No answer here."}',
    "this line is not json",
    '{"id": "r4", "problem": ["a", "list"], "answer": "3"}',
    '{"id": "r5", "question": "Float answer?", "answer": 27.0}',
    '{"id": "r6", "problem": "Empty answer", "answer": "  "}',
]


def test_malformed_rows_are_counted_with_line_numbers_or_fail_strict(home, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(BAD_ROWS) + "\n")
    cfg, out = conf(), tmp_path / "o"
    [stats] = prep_command(cfg, name="aime24", source=str(path), out=str(out), strict=False,
                           template="plain", console=Console(file=open(os.devnull, "w")))
    assert (stats.read, stats.kept, stats.malformed) == (6, 2, 4)
    assert stats.problems == [
        f"{path}:2: missing answer",
        f"{path}:3: invalid JSON (Expecting value at column 1)",
        f"{path}:4: problem is a list, not a string",
        f"{path}:6: missing answer",
    ]
    kept = read_jsonl(out / "aime24.jsonl")
    assert [(r["id"], r["answer"]) for r in kept] == [("r1", "2"), ("r5", "27")]
    with pytest.raises(UserError, match=r"bad\.jsonl:2: missing answer .*--strict"):
        prep_command(cfg, name="aime24", source=str(path), out=str(tmp_path / "o2"), strict=True,
                     template="plain", console=Console(file=open(os.devnull, "w")))
    assert not (tmp_path / "o2" / "aime24.jsonl").exists()  # strict writes nothing


def test_strict_failure_is_one_line_from_the_cli(home, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(BAD_ROWS[:2]) + "\n")
    res = subprocess.run(
        [sys.executable, "-m", "stapoctl.cli", "data", "prep", "aime24", "--source", str(path),
         "--strict", "--template", "plain", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    )
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith("error:") and "bad.jsonl:2: missing answer" in lines[0]


@needs_shared
def test_data_root_env_is_used_before_the_hub_and_chat_template_applies(home, tmp_path, monkeypatch):
    from stapoctl.config.compose import compose_config
    from stapoctl.models.tiny import ensure_tokenizer

    cfg = compose_config([])
    monkeypatch.setenv("STAPOCTL_DATA", str(SHARED))
    tok_dir = ensure_tokenizer(cfg.model, cfg.data)  # the tiny model's tokenizer alone (seconds)
    rows = load_rows("aime24", cfg.data, tokenizer_path=tok_dir)
    assert len(rows) == 30
    first = rows[0]
    assert first["prompt"] == (
        f"<|im_start|>user\n{first['problem']}\n{STAPO_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    # dapo-math-17k is found under its file name dapo_math_17k.jsonl in the data root
    assert sources.local_file("dapo-math-17k", SHARED).name == "dapo_math_17k.jsonl"


def test_missing_local_data_falls_back_to_the_hub_and_says_how_to_go_offline(home, tmp_path):
    with pytest.raises(UserError, match=r"cannot load HuggingFaceH4/MATH-500 from the hub .*--source FILE"):
        load_rows("math500", DataConfig(template="plain"))


def test_unknown_dataset_and_chat_without_tokenizer_are_user_errors(home):
    with pytest.raises(UserError, match="unknown dataset 'aime2024'; did you mean 'aime24'"):
        load_rows("aime2024", DataConfig(template="plain"))
    with pytest.raises(UserError, match="--template plain"):
        load_rows("toy", DataConfig(template="chat"))


def test_answer_normalization_by_hand():
    assert sources.answer_text(27.0) == "27"
    assert sources.answer_text(0.5) == "0.5"
    assert sources.answer_text(["$69$"]) == "69"
    assert sources.answer_text(["$69$", "$84$"]) == "69, 84"
    assert sources.answer_text(" \\frac{1}{2} ") == "\\frac{1}{2}"
    for bad in (None, "", [], True):
        with pytest.raises(sources.MalformedRow):
            sources.answer_text(bad)
