"""One checkpoint lookup for every reader (`resume=`, `stapoctl eval --model`, the plan), the
manifest hashed on several threads, the renames fsynced, and the one atomic-write helper of
`stapoctl/paths.py` (no engines)."""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from stapoctl import checkpoint, paths
from stapoctl.errors import UserError
from stapoctl.models.resolve import resolve_model

REPO = Path(__file__).resolve().parents[1]


def _payload(tmp: Path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=300,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp / "model")  # config.json, no weights
    (tmp / "state").mkdir()
    (tmp / "state" / "optim.pt").write_bytes(bytes(range(256)) * 16)


def _run(root: Path, steps=(10, 20)) -> Path:
    run = root / "run"
    for step in steps:
        checkpoint.save(run, step, _payload, {"step": step})
    return run


def _flip_a_byte(path: Path) -> None:
    """Same size, other bytes: only the sha256 sees it."""
    blob = bytearray(path.read_bytes())
    blob[7] ^= 0xFF
    path.write_bytes(bytes(blob))


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch):
    monkeypatch.setenv("STAPOCTL_CKPT_FSYNC", "0")


def test_a_run_dir_its_checkpoints_dir_and_a_step_dir_name_the_same_checkpoint(tmp_path):
    run = _run(tmp_path)
    s20 = run / "checkpoints" / "step_000020"
    for spec in (run, run / "checkpoints", s20):
        assert checkpoint.find_checkpoint(spec) == s20
        assert resolve_model(str(spec), None) == str(s20 / "model")
        assert checkpoint.resolve_resume(str(spec)) == s20.resolve()
    assert checkpoint.find_checkpoint(tmp_path / "empty") is None


def test_eval_model_skips_a_damaged_newest_checkpoint_as_resume_does(tmp_path):
    run = _run(tmp_path)
    _flip_a_byte(run / "checkpoints" / "step_000020" / "state" / "optim.pt")
    warnings: list[str] = []
    assert checkpoint.resolve_resume(str(run), warn=warnings.append).name == "step_000010"
    assert len(warnings) == 1 and "step_000020" in warnings[0] and "sha256" in warnings[0]
    assert resolve_model(str(run), None) == str(run / "checkpoints" / "step_000010" / "model")
    # named directly, the damaged step is refused by both, not loaded
    for call in (lambda s: checkpoint.resolve_resume(s), lambda s: resolve_model(s, None)):
        with pytest.raises(UserError, match=r"damaged \(state/optim.pt does not match its sha256\)"):
            call(str(run / "checkpoints" / "step_000020"))
    # the command itself: its preflight resolves the run dir to step 10 (whose model/ has no weights,
    # so it stops there, exit 2, before any engine) and names the skipped step once
    env = {**os.environ, "STAPOCTL_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "COLUMNS": "300"}
    res = subprocess.run([sys.executable, "-m", "stapoctl.cli", "eval", "--model", str(run), "--bench", "toy"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert err[-1].endswith(f"{run}/checkpoints/step_000010/model has config.json but no weights "
                            "(*.safetensors or *.bin)"), err
    skipped = [line for line in err if "step_000020" in line]
    assert skipped == [f"warning: skipping checkpoint {run}/checkpoints/step_000020: state/optim.pt does not "
                       "match its sha256"], err


def test_the_manifest_is_hashed_on_several_threads(tmp_path, monkeypatch):
    files = {f"f{i}.bin": os.urandom(3000 + i) for i in range(4)}
    for name, blob in files.items():
        (tmp_path / name).write_bytes(blob)
    (tmp_path / checkpoint.TRAINER_STATE).write_text("{}")
    meet = threading.Barrier(2, timeout=20)  # the first two hashes must be under way at once to get past it
    threads: set[int] = set()
    calls: list[Path] = []
    real = checkpoint._sha256

    def hashing_together(path):
        threads.add(threading.get_ident())
        calls.append(path)
        if len(calls) <= 2:
            meet.wait()
        return real(path)

    monkeypatch.setattr(checkpoint, "HASH_THREADS", 2)
    monkeypatch.setattr(checkpoint, "_sha256", hashing_together)
    written = checkpoint.write_manifest(tmp_path)["files"]
    assert {n: written[n]["sha256"] for n in files} == {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    assert checkpoint.verify(tmp_path, checksums=True) is None
    assert len(threads) == 2


def test_the_renames_of_a_save_are_fsynced(tmp_path, monkeypatch):
    synced: list[Path] = []
    monkeypatch.setattr(checkpoint, "fsync_dir", lambda p: synced.append(Path(p)))
    monkeypatch.setattr(paths, "fsync_dir", lambda p: synced.append(Path(p)))
    checkpoint.save(tmp_path, 1, _payload, {"step": 1})
    assert synced == []  # STAPOCTL_CKPT_FSYNC=0: none
    monkeypatch.setenv("STAPOCTL_CKPT_FSYNC", "1")
    final = checkpoint.save(tmp_path, 2, _payload, {"step": 2})
    root = tmp_path / "checkpoints"
    # the temp dir's entries before its rename (model/, state/, then itself), then checkpoints/ after
    # the step dir's rename and again after `latest`'s
    assert sorted(p.name for p in synced[:2]) == ["model", "state"] and synced[0].parent == synced[2]
    assert synced[2].parent == root and synced[2].name.startswith(".step_000002.")
    assert synced[3:] == [root, root]
    assert (root / "latest").read_text() == final.name + "\n"


def test_atomic_writes_of_one_file_from_many_threads_never_collide(tmp_path):
    target = tmp_path / "record.json"
    texts = [f"{i}\n" * 2000 for i in range(8)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(texts))

    def writer(text: str) -> None:
        start.wait()
        try:
            for _ in range(40):
                paths.write_atomic(target, text)
        except BaseException as exc:  # a shared temp name: one writer's replace takes another's file
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_text() in texts  # one writer's text, whole
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]  # no temp file left


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "rows.jsonl"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with paths.atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("the writer died")
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]
    with paths.atomic_path(target) as a, paths.atomic_path(target) as b:
        assert a != b and a.parent == b.parent == tmp_path  # a temp name each, on the same disk
        a.write_text("a")
        b.write_text("b")
    assert target.read_text() == "a"  # the outer block ends last: its file replaces the other's


def test_only_the_helper_replaces_files():
    """Every temp-file-then-replace writer goes through `paths.atomic_path` (a unique temp name)."""
    found = []
    for path in sorted((REPO / "stapoctl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "replace" and getattr(node.value, "id", "") == "os":
                found.append(path.relative_to(REPO).as_posix())
    assert found == ["stapoctl/paths.py"]
