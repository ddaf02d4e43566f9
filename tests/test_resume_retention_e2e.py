"""A full disk, resume × retention on real engines (issue #35's sequence), and an engine failure in
one line: one chain of three `stapoctl train` processes (three engine starts) checks all three.

`stapoctl train … trainer.save_freq=5 trainer.total_steps=15` on a tmpfs that fills at the step-10
checkpoint: one line (the dir, its free space, the step, the resume command), the MLflow run FAILED
with it, step_000005 intact and the partial step 10 gone. The space freed (`mount -o remount`), the
printed resume command run as it stands, with `trainer.keep_checkpoints=1` added, writes step 10,
rotates out what it may, and must still write step 15
(its save copied the tokenizer from the rotated-out step_000005/model: 93 lines of traceback) and end
FINISHED. Then the run's tokenizer copy is broken and the run extended by a step: the learner's
save raises inside its actor, and the user sees one line naming it, its stack kept in the run's
errors.log and MLflow. A tmpfs in an unprivileged mount namespace, as tests/test_disk_full.py.

The engine test below resumes with retention in-process and matches the uninterrupted run's
per-step loss.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_disk_full import _LOG_LINE, _namespace_mounts

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
set -u
mount -t tmpfs -o size="$SMALL" none "$MNT" || exit 90
"$PY" -m stapoctl.cli train "$@" trainer.output_dir="$MNT/run" >"$OUT/fail.out" 2>"$OUT/fail.err"
echo $? >"$OUT/fail.rc"
ls "$MNT/run/checkpoints" >"$OUT/fail.ls"
cp -a "$MNT/run" "$OUT/after_fail" && cp "$DB" "$OUT/after_fail.db"
mount -o remount,size="$BIG" none "$MNT" || exit 91
cmd=$(sed -n 's/.*`\(stapoctl train resume=[^`]*\)`.*/\1/p' "$OUT/fail.err" | head -n 1)
[ -n "$cmd" ] || exit 92
eval "\"\$PY\" -m stapoctl.cli ${cmd#stapoctl } trainer.keep_checkpoints=1" >"$OUT/resume.out" 2>"$OUT/resume.err"
echo $? >"$OUT/resume.rc"
ls "$MNT/run/checkpoints" >"$OUT/resume.ls"
cp "$DB" "$OUT/resume.db"
echo '{"not json' >"$MNT/run/tokenizer/tokenizer_config.json"
"$PY" -m stapoctl.cli train resume="$MNT/run" trainer.total_steps=16 tracking.uri="$URI" \
    >"$OUT/broken.out" 2>"$OUT/broken.err"
echo $? >"$OUT/broken.rc"
cp "$MNT/run/errors.log" "$OUT/errors.log" 2>/dev/null
ls "$MNT/run/checkpoints" >"$OUT/broken.ls"
"""


@pytest.fixture(scope="module")
def sequence(tmp_path_factory, shared_home):
    tmp = tmp_path_factory.mktemp("resume_retention")
    why = _namespace_mounts(tmp)
    if why:
        pytest.skip(f"needs a small tmpfs in a user mount namespace: {why}")
    ckpt = 3.7 * (shared_home.model_dir / "model.safetensors").stat().st_size  # see test_disk_full
    db, out, mnt = tmp / "mlflow.db", tmp / "out", tmp / "mnt"
    out.mkdir()
    mnt.mkdir()
    args = [f"model.path={shared_home.model_dir}", "plan.enforce=false", "trainer.save_freq=5",
            "trainer.total_steps=15", "eval.every_n_steps=0", "trainer.val_before_train=false",
            "trainer.min_free_gb=0", f"tracking.uri=sqlite:///{db}"]
    env = {**os.environ, "STAPOCTL_HOME": str(shared_home.home), "HF_HUB_OFFLINE": "1", "PY": sys.executable,
           "SMALL": f"{math.ceil(1.55 * ckpt / 2**20)}m", "BIG": f"{math.ceil(4 * ckpt / 2**20)}m",
           "MNT": str(mnt), "OUT": str(out), "URI": f"sqlite:///{db}", "DB": str(db),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("MLFLOW_TRACKING_URI", None)
    res = subprocess.run(["unshare", "-rm", "sh", "-c", SCRIPT, "sh", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, f"script exit {res.returncode}: {res.stderr[-3000:]}"
    text = {p.name: p.read_text() for p in out.iterdir() if p.is_file() and p.suffix != ".db"}
    return {"store": f"sqlite:///{db}", "resume_store": f"sqlite:///{out / 'resume.db'}", "mnt": str(mnt),
            "kept": out, **text}


def _said(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip() and not _LOG_LINE.match(line)]


@pytest.mark.e2e
def test_a_full_disk_ends_in_one_line_failed_and_the_printed_resume_continues(sequence):
    """(Was tests/test_disk_full.py's own chain of two engine starts.)"""
    from mlflow import MlflowClient

    from stapoctl import checkpoint

    kept, out, err = sequence["kept"], sequence["fail.out"], sequence["fail.err"]
    assert sequence["fail.rc"].strip() == "1", out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err
    said = _said(err)
    assert len(said) == 1, said
    line = said[0]
    assert line.startswith("failed: disk full: the step-10 checkpoint could not be written to "
                           f"{sequence['mnt']}/run/checkpoints (No space left on device; "), line
    assert re.search(r"; \d+(\.\d)? [kM]?B free there, step_000005 took \d+\.\d MB\)", line), line
    run_id = re.search(r"`stapoctl train resume=([0-9a-f]{32}) tracking\.uri=sqlite:///\S+`$", line).group(1)
    # the run is FAILED with that line; step 5 is whole, step 10's partial write is gone
    run = MlflowClient(f"sqlite:///{kept / 'after_fail.db'}").get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["stapoctl.error"] == line.removeprefix("failed: ")
    failed = kept / "after_fail"
    assert [p.name for p in checkpoint.step_dirs(failed)] == ["step_000005"]
    assert checkpoint.verify(failed / "checkpoints" / "step_000005", checksums=True) is None
    assert not checkpoint.partial_writes(failed)
    # the printed command, once there is room: continues from step 5
    assert sequence["resume.rc"].strip() == "0", sequence["resume.out"][-3000:] + sequence["resume.err"][-3000:]
    assert re.search(r"resuming from \S+/checkpoints/step_000005 \(step 5, MLflow run " + run_id,
                     " ".join(sequence["resume.out"].split()))


@pytest.mark.e2e
def test_a_resume_with_retention_after_a_full_disk_finishes(sequence):
    from mlflow import MlflowClient

    said = _said(sequence["fail.err"])
    assert sequence["fail.rc"].strip() == "1" and len(said) == 1, said
    assert said[0].startswith("failed: disk full: the step-10 checkpoint could not be written"), said
    assert sequence["fail.ls"].split() == ["latest", "step_000005"]

    out, err = sequence["resume.out"], sequence["resume.err"]
    assert sequence["resume.rc"].strip() == "0", out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err
    # step 10 rotated out by step 15; step 5, which this process's rollout actors load, kept while it ran
    assert sequence["resume.ls"].split() == ["latest", "step_000005", "step_000015"]
    run_id = re.search(r"MLflow run ([0-9a-f]{32})", " ".join(out.split())).group(1)
    run = MlflowClient(sequence["resume_store"]).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["actor/pg_loss"] is not None
    assert [m.step for m in MlflowClient(sequence["resume_store"]).get_metric_history(run_id, "actor/pg_loss")] == \
        list(range(1, 16))


@pytest.mark.e2e
def test_an_exception_inside_the_learner_during_a_save_is_one_line(sequence):
    from mlflow import MlflowClient

    out, err = sequence["broken.out"], sequence["broken.err"]
    said = _said(err)
    assert sequence["broken.rc"].strip() == "1", out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err and len(said) == 1, said
    line = said[0]
    run_dir = f"{sequence['mnt']}/run"
    assert re.fullmatch(
        r"failed: writing the step-16 checkpoint failed in learner rank 0 \(\w+Error: .+; its stack: "
        + re.escape(f"{run_dir}/errors.log and MLflow errors/step_000016.txt") + r"\): the run is FAILED; "
        r"step_000015 is intact: fix that and resume with `stapoctl train resume=[0-9a-f]{32} "
        r"tracking\.uri=sqlite:///\S+`", line), line
    assert "tokenizer_config.json" in sequence["errors.log"] or "JSON" in sequence["errors.log"]
    assert "step 16: learner rank 0, save() raised" in sequence["errors.log"]
    assert sequence["broken.ls"].split() == ["latest", "step_000005", "step_000015"]  # its resume point stays
    run_id = re.search(r"resume=([0-9a-f]{32})", line).group(1)
    run = MlflowClient(sequence["store"]).get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["stapoctl.error"] == line.removeprefix("failed: ")


# -- in-process: a resume with retention computes what the uninterrupted run computed --------------
STEPS = 6
SAME = ["trainer.save_freq=2", "eval.every_n_steps=0", "trainer.val_before_train=false", "trainer.min_free_gb=0",
        "loss.kl_coef=0.001"]  # β > 0: the frozen reference (the base model) is loaded again at the resume


@pytest.fixture(scope="module")
def straight_and_resumed(training_store, engine_pool):
    """A: 6 steps straight. B: 2 steps, then resumed to 6 with keep_checkpoints=1 (engines shared)."""
    from stapoctl.trainer.driver import train
    session = engine_pool  # the resume too runs on the engines as they run: its weights are pushed
    with training_store("resume_retention", SAME) as t:
        a = train(t.conf([f"trainer.total_steps={STEPS}"]), console=t.console, session=session)
        b = train(t.conf(["trainer.total_steps=2"]), console=t.console, session=session)
        b2 = train(t.conf([f"resume={b['run_dir']}", f"trainer.total_steps={STEPS}", "trainer.keep_checkpoints=1"]),
                   console=t.console, session=session)
        yield {"a": a, "b": b, "b2": b2, "uri": t.uri}


@pytest.mark.e2e
def test_a_resume_with_retention_matches_the_uninterrupted_run(straight_and_resumed):
    from mlflow import MlflowClient

    from stapoctl import checkpoint

    r = straight_and_resumed
    client = MlflowClient(r["uri"])
    assert r["b2"]["run_id"] == r["b"]["run_id"]

    def per_step(run_id: str, key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    straight, resumed = per_step(r["a"]["run_id"], "actor/pg_loss"), per_step(r["b"]["run_id"], "actor/pg_loss")
    assert sorted(straight) == sorted(resumed) == list(range(1, STEPS + 1))
    for step in straight:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5, abs=1e-7), step
    assert any(abs(v) > 1e-6 for v in straight.values()), "no learning signal: the comparison would be vacuous"
    kl = per_step(r["b"]["run_id"], "actor/kl_loss")
    assert kl[STEPS] == pytest.approx(per_step(r["a"]["run_id"], "actor/kl_loss")[STEPS], rel=1e-5, abs=1e-9)
    # step 4 rotated out by step 6; step 2, the resume point, kept while the resume ran
    run_dir = r["b"]["run_dir"]
    assert [p.name for p in checkpoint.step_dirs(run_dir)] == ["step_000006", "step_000002"]
    assert (checkpoint.latest_step_dir(run_dir, checksums=True) / "model" / "tokenizer_config.json").is_file()
    assert client.get_run(r["b"]["run_id"]).info.status == "FINISHED"
