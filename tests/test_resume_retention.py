"""Resume × checkpoint retention (no engines): whatever sequence of saves, rotations, crashes
and resumes a run goes through, at least one checkpoint verifies after every step, and nothing
that a later save or a restart reads is ever deleted.

A simulated driver does what `trainer/driver.py` + `loop.py` do with the checkpoint files, through
the same functions: at each (re)start the partial writes are cleared, the newest verified
checkpoint is the resume point (`checkpoint.latest_step_dir`), the run's tokenizer copy is made
(`run_files.tokenizer_dir`, from the resume point's model/ when the run has none) and the resume
point is protected from retention; each save writes a fake payload that, like
`StateIO._write_checkpoint`, copies the tokenizer files from that dir, then `checkpoint.prune`s
with the run's `keep_checkpoints` (which a resume may change). A crash is a process killed at any
file operation of the checkpoint and run-files code: from then on nothing more happens in it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stapoctl import checkpoint
from stapoctl.trainer import run_files


class Crash(BaseException):
    """The process is killed (SIGKILL): no handler, no `finally` work, runs after it."""


class Killer:
    """Counts the file operations of the checkpoint code; the `at`-th one (and every later one,
    the process being dead) raises `Crash` instead of happening."""

    def __init__(self, at):
        self.at, self.n, self.dead = at, 0, False

    def op(self, fn):
        def run(*args, **kwargs):
            self.n += 1
            if self.dead or (self.at is not None and self.n >= self.at):
                self.dead = True
                raise Crash()
            return fn(*args, **kwargs)
        return run


def _proxy(module, killer: Killer, names):
    ns = SimpleNamespace(**{k: getattr(module, k) for k in dir(module) if not k.startswith("__")})
    for name in names:
        setattr(ns, name, killer.op(getattr(module, name)))
    return ns


def _copy_tokenizer(source: str, dest: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(source) / f, dest / f)  # FileNotFoundError once the source is gone


def _payload(tokenizer: Path, step: int, killer: Killer):
    def write(tmp: Path) -> None:  # what the learner writes: model/ (+ the tokenizer), state/
        (tmp / "model").mkdir()
        (tmp / "model" / "config.json").write_text("{}")
        killer.op(lambda: None)()  # a kill between the files
        (tmp / "model" / "model.safetensors").write_bytes(step.to_bytes(4, "little") * 16)
        _copy_tokenizer(str(tokenizer), tmp / "model")
        (tmp / "state").mkdir()
        (tmp / "state" / "weights.bin").write_bytes(b"x" * (64 + step))
    return write


@contextlib.contextmanager
def _process(killer: Killer):
    """A driver process whose file operations `killer` may cut short."""
    with mock.patch.object(checkpoint, "os", _proxy(os, killer, ("rename", "fsync"))), \
            mock.patch.object(checkpoint, "shutil", _proxy(shutil, killer, ("rmtree",))), \
            mock.patch.object(run_files, "os", _proxy(os, killer, ("rename",))), \
            mock.patch.object(run_files, "_copy_tokenizer", killer.op(_copy_tokenizer)):
        yield


def _start(run_dir: Path, base: Path, killer: Killer):
    """A (re)start: debris cleared, the resume point, the tokenizer copy; (resume dir, step, tokenizer)."""
    checkpoint.remove_partial_writes(run_dir)
    resume = checkpoint.latest_step_dir(run_dir, checksums=True)
    step = checkpoint.read_trainer_state(resume)["step"] if resume else 0
    tok = run_files.tokenizer_dir(run_dir, str(resume / "model") if resume else str(base))
    return resume, step, tok


def _check(run_dir: Path, saved: list[int], resume, tok: Path, keep: int, alive: bool) -> None:
    newest = checkpoint.latest_step_dir(run_dir, checksums=True)
    if saved:  # what a restart reads: the newest save that returned, or one written after it
        assert newest is not None, f"no checkpoint verifies after saves {saved}"
        assert checkpoint.read_trainer_state(newest)["step"] >= saved[-1]
        assert (newest / "model" / "tokenizer.json").is_file()
    if alive:  # what this process still reads: its tokenizer copy and the checkpoint it resumed from
        assert (tok / "tokenizer.json").is_file()
        if resume is not None:
            assert checkpoint.verify(resume, checksums=True) is None, f"{resume.name} was deleted while in use"
        if keep > 0 and saved:  # retention still does its job
            extra = {resume.name} if resume is not None else set()
            assert len({p.name for p in checkpoint.step_dirs(run_dir)} - extra) <= keep + 1


def _simulate(base: Path, run_dir: Path, freq: int, total: int, keeps: list[int], crashes: list) -> list[int]:
    """Processes run until one reaches `total`; the i-th is killed at its `crashes[i]`-th file op."""
    saved: list[int] = []  # steps whose save returned (in any process)
    for life in range(len(crashes) + 1):
        killer = Killer(crashes[life] if life < len(crashes) else None)
        keep = keeps[min(life, len(keeps) - 1)]
        resume, tok = None, None
        try:
            with _process(killer):
                resume, start, tok = _start(run_dir, base, killer)
                for step in range(start + 1, total + 1):
                    if step % freq == 0 or step == total:
                        done = checkpoint.save(run_dir, step, _payload(tok, step, killer), {"step": step})
                        saved.append(step)
                        checkpoint.prune(run_dir, keep, done, protect=[resume] if resume else [])
                    _check(run_dir, saved, resume, tok, keep, alive=True)
        except Crash:
            _check(run_dir, saved, None, run_dir, keep, alive=False)
            continue
        return saved
    raise AssertionError("the last process has no crash and must finish")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(freq=st.integers(1, 4), total=st.integers(1, 14), keeps=st.lists(st.integers(0, 3), min_size=1, max_size=4),
       crashes=st.lists(st.one_of(st.none(), st.integers(1, 40)), max_size=4))
def test_retention_never_deletes_what_a_later_save_or_restart_reads(freq, total, keeps, crashes):
    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ, {"STAPOCTL_CKPT_FSYNC": "0"}):
        base = Path(tmp) / "base"
        base.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            (base / f).write_text(f"{f} of the base model")
        run_dir = Path(tmp) / "run"
        crashes = [c for c in crashes if c is not None] or crashes[:0]
        _simulate(base, run_dir, freq, total, keeps, crashes)  # a save cut short after its publish still counts
        assert checkpoint.read_trainer_state(checkpoint.latest_step_dir(run_dir, checksums=True))["step"] == total
        assert not checkpoint.partial_writes(run_dir)
        assert (run_dir / "tokenizer" / "tokenizer.json").read_text() == "tokenizer.json of the base model"


def test_the_issue_sequence_keeps_the_resume_point_and_the_tokenizer(tmp_path, monkeypatch):
    """save_freq=5: steps 5 (then the disk is full), resumed with keep_checkpoints=1 to 15."""
    monkeypatch.setenv("STAPOCTL_CKPT_FSYNC", "0")
    base, run_dir = tmp_path / "base", tmp_path / "run"
    base.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (base / f).write_text(f)
    killer = Killer(None)
    with _process(killer):
        checkpoint.save(run_dir, 5, _payload(run_files.tokenizer_dir(run_dir, str(base)), 5, killer), {"step": 5})
        shutil.rmtree(run_dir / "tokenizer")  # a run saved before the run had its own copy
        resume, start, tok = _start(run_dir, base, killer)
        assert (resume.name, start, tok) == ("step_000005", 5, run_dir / "tokenizer")
        for step in (10, 15):
            done = checkpoint.save(run_dir, step, _payload(tok, step, killer), {"step": step})
            removed = checkpoint.prune(run_dir, 1, done, protect=[resume])
        assert [p.name for p in removed] == ["step_000010"]
    assert [p.name for p in checkpoint.step_dirs(run_dir)] == ["step_000015", "step_000005"]
    # the next start resumes from step 15, and its first save rotates step 5 out
    with _process(killer):
        resume, start, tok = _start(run_dir, base, killer)
        done = checkpoint.save(run_dir, 20, _payload(tok, 20, killer), {"step": 20})
        checkpoint.prune(run_dir, 1, done, protect=[resume])
    assert [p.name for p in checkpoint.step_dirs(run_dir)] == ["step_000020", "step_000015"]


def test_a_starting_model_inside_a_checkpoint_is_copied_out_once(tmp_path, monkeypatch):
    """model.path=another run: its checkpoint may be rotated out by that run; ours keeps a copy."""
    monkeypatch.setenv("STAPOCTL_CKPT_FSYNC", "0")
    tok = tmp_path / "tok"
    tok.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tok / f).write_text(f)
    step = checkpoint.save(tmp_path / "other", 7, _payload(tok, 7, Killer(None)), {"step": 7})
    home = tmp_path / "home"
    copy = run_files.starting_model(str(step / "model"), home)
    assert Path(copy).parent == home / "models" and Path(copy).name.startswith("checkpoint-")
    assert (Path(copy) / "model.safetensors").read_bytes() == (step / "model" / "model.safetensors").read_bytes()
    assert run_files.starting_model(str(step / "model"), home) == copy  # once: the same content, the same copy
    shutil.rmtree(step)  # the other run's retention
    assert (Path(copy) / "config.json").is_file()
    assert run_files.starting_model(str(tmp_path / "tok"), home) == str(tmp_path / "tok")  # not a checkpoint


def test_the_disk_plan_counts_the_checkpoint_a_resume_keeps(tmp_path):
    from omegaconf import OmegaConf

    from stapoctl.config.compose import compose_config
    from stapoctl.config.shapes import known_shape
    from stapoctl.preflight.memory_plan import disk_plan

    conf = compose_config(["trainer.total_steps=100", "trainer.save_freq=5", "trainer.keep_checkpoints=2",
                           f"trainer.output_dir={tmp_path}"])
    shape = known_shape("Qwen/Qwen3-8B")
    assert disk_plan(conf, shape).checkpoints == 3  # the K kept and the newer one being verified
    OmegaConf.update(conf, "resume", str(tmp_path / "run"))
    assert disk_plan(conf, shape).checkpoints == 4  # and the one it resumed from, while it runs
