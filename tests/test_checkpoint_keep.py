"""`trainer.keep_checkpoints`: only the newest K step dirs stay, never `latest`'s (no engines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stapoctl import checkpoint


def _payload(tmp: Path) -> None:
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text("{}")
    (tmp / "state").mkdir()
    (tmp / "state" / "weights.bin").write_bytes(b"x" * 64)


def _save_steps(run_dir: Path, keep: int, steps=(10, 20, 30, 40, 50)) -> None:
    for step in steps:
        saved = checkpoint.save(run_dir, step, _payload, {"step": step})
        checkpoint.prune(run_dir, keep, saved)


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch):
    monkeypatch.setenv("STAPOCTL_CKPT_FSYNC", "0")


def test_keep_two_of_five(tmp_path):
    _save_steps(tmp_path, keep=2)
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step_000050", "step_000040"]
    assert checkpoint.latest_step_dir(tmp_path, checksums=True).name == "step_000050"
    assert checkpoint.find_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000050"
    assert not checkpoint.partial_writes(tmp_path)  # no debris left by the deletes


def test_zero_keeps_all(tmp_path):
    _save_steps(tmp_path, keep=0)
    assert len(checkpoint.step_dirs(tmp_path)) == 5


def test_nothing_goes_when_the_new_one_does_not_verify(tmp_path):
    _save_steps(tmp_path, keep=0, steps=(10, 20, 30))
    newest = tmp_path / "checkpoints" / "step_000030"
    (newest / "state" / "weights.bin").write_bytes(b"short")  # truncated: the manifest disagrees
    assert checkpoint.prune(tmp_path, 1, newest) == []
    assert len(checkpoint.step_dirs(tmp_path)) == 3


def test_latest_is_never_removed(tmp_path):
    _save_steps(tmp_path, keep=0, steps=(10, 20, 30))
    (tmp_path / "checkpoints" / "latest").write_text("step_000010\n")  # e.g. a resume re-saved an older step
    removed = checkpoint.prune(tmp_path, 1, tmp_path / "checkpoints" / "step_000030")
    assert [p.name for p in removed] == ["step_000020"]
    assert {p.name for p in checkpoint.step_dirs(tmp_path)} == {"step_000030", "step_000010"}


def test_the_field_is_declared():
    from stapoctl.config.compose import compose_config
    from stapoctl.config.validate import validate_config
    from stapoctl.errors import UserError

    assert compose_config([]).trainer.keep_checkpoints == 0
    with pytest.raises(UserError, match="trainer.keep_checkpoints"):
        validate_config(compose_config(["trainer.keep_checkpoints=-1"]))
