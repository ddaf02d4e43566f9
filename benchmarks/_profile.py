"""Where a training step's time goes: py-spy inside the driver and every engine actor.

    python benchmarks/_profile.py [--size tiny|25m] [--steps 40] [--seconds 30] [--out DIR]

Starts `stapoctl train` (the bench's short configuration: no validation, no checkpoints) in
the background, waits until step 2 is logged (engines up, first shapes warm), then samples
the driver, the vLLM rollout actor(s) and the DeepSpeed learner(s) - found as descendants of
that very driver, never another user's Ray - with `py-spy record --nonblocking` for
`--seconds`. Writes the raw stacks per process and prints, per process, the share of samples
in the top functions (inclusive and self), plus the trainer's own per-phase timings from
MLflow. Needs py-spy (`pip install py-spy`); not part of `stapoctl bench all`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import _ours  # noqa: E402
import _peers  # noqa: E402

ROLES = (("rollout", re.compile(r"ray::RolloutWorker")), ("learner", re.compile(r"ray::Learner")))


def descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def find_actors(driver_pid: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for p in descendants(driver_pid):
        try:
            cmd = " ".join(p.cmdline())
        except Exception:
            continue
        for role, pat in ROLES:
            if pat.search(cmd):
                out.setdefault(role, []).append(p.pid)
    return out


def logged_steps(db: Path) -> int:
    import sqlite3

    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as c:
            row = c.execute("select max(step) from metrics where key='timing_s/step'").fetchone()
        return int(row[0] or 0)
    except sqlite3.Error:
        return 0


def frame_name(frame: str) -> str:
    """'fn (path/to/file.py:123)' -> 'fn (file.py)'; native frames kept short."""
    m = re.match(r"(.*?) \((.*?)(?::\d+)?\)$", frame)
    if not m:
        return frame
    fn, path = m.groups()
    parts = path.split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{fn} ({short})"


def aggregate(raw: Path, top: int = 25) -> dict:
    """Inclusive and self sample shares per function from py-spy's raw (collapsed) output."""
    incl: collections.Counter = collections.Counter()
    self_: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";")]
        total += n
        self_[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    share = (lambda c: [(f, round(100 * n / total, 1)) for f, n in c.most_common(top)]) if total else (lambda c: [])
    return {"samples": total, "inclusive_pct": share(incl), "self_pct": share(self_)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny", choices=["tiny", *_peers.SIZES])
    p.add_argument("--steps", type=int, default=40, help="steps of the profiled run (enough to cover --seconds)")
    p.add_argument("--seconds", type=float, default=30.0, help="sampling window, after step 2")
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    p.add_argument("--native", action="store_true", help="include native (C/C++) frames")
    p.add_argument("--out", default=None, help="folder for raw stacks and profile.json (default: a temp dir)")
    a = p.parse_args(argv)
    pyspy = Path(sys.executable).with_name("py-spy")
    if not pyspy.exists():
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    conf = _peers.compose(["loss=dapo"])
    mdir = _peers.model_dir(a.size, conf)
    overrides = ["loss=dapo"] + ([] if a.size == "tiny" else [f"model.path={mdir}"])
    out = Path(a.out or tempfile.mkdtemp(prefix=f"stapoctl-profile-{a.size}-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="stapoctl-profile-run-"))
    args = _ours.bench_overrides(str(work), a.steps, overrides)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(H.ROOT), os.environ.get("PYTHONPATH")) if x)}
    driver = subprocess.Popen([sys.executable, "-m", "stapoctl.cli", "train", *args], env=env,
                              stdout=open(out / "train.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.time()
        while logged_steps(work / "mlflow.db") < 2:
            if driver.poll() is not None:
                print(f"train exited early ({driver.returncode}); see {out / 'train.log'}", file=sys.stderr)
                return 1
            if time.time() - t0 > 900:
                raise TimeoutError("no step 2 after 15 min")
            time.sleep(0.5)
        actors = find_actors(driver.pid)
        targets = {"driver": [driver.pid], **actors}
        print(f"step 2 logged after {time.time() - t0:.0f} s; sampling {targets} for {a.seconds:.0f} s")
        step_before = logged_steps(work / "mlflow.db")
        procs = []
        for role, pids in targets.items():
            for i, pid in enumerate(pids):
                raw = out / f"{role}{i}.txt"
                cmd = [str(pyspy), "record", "--pid", str(pid), "--rate", str(a.rate), "--duration",
                       str(int(a.seconds)), "--format", "raw", "--nonblocking", "-o", str(raw)]
                if a.native:
                    cmd.append("--native")
                procs.append((role, i, raw, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        for _, _, _, pr in procs:
            pr.wait()
        step_after = logged_steps(work / "mlflow.db")
    finally:
        if driver.poll() is None:  # Ctrl-C: the trainer shuts vLLM, the learner and its Ray down
            driver.send_signal(signal.SIGINT)
            try:
                driver.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(driver.pid, signal.SIGKILL)
    report: dict = {"size": a.size, "steps_sampled": [step_before, step_after], "seconds": a.seconds,
                    "rate": a.rate, "processes": {}}
    for role, i, raw, pr in procs:
        if raw.exists():
            report["processes"][f"{role}{i}"] = aggregate(raw)
        else:
            report["processes"][f"{role}{i}"] = {"error": (pr.stderr.read() or b"").decode()[-500:]}
    (out / "profile.json").write_text(json.dumps(report, indent=2))
    for name, agg in report["processes"].items():
        print(f"\n== {name}: {agg.get('samples', 0)} samples (CPU-active, {a.rate}/s) ==")
        for f, pct in agg.get("inclusive_pct", [])[:25]:
            print(f"  {pct:5.1f}%  {f}")
        print("  -- self --")
        for f, pct in agg.get("self_pct", [])[:12]:
            print(f"  {pct:5.1f}%  {f}")
    print(f"\nraw stacks and profile.json in {out}")
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
