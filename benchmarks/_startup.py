"""Where the engines' start-up goes: each piece timed alone, in a fresh process, N times.

    python benchmarks/_startup.py [--repeats 3] [--size tiny]
    python benchmarks/_startup.py --whole [--repeats 3] [--steps 60] [--env-b K=V ...]

`--whole`: the phase table of the whole `stapoctl train` (embedded default, no periodic validation,
one save at the end, as `stapoctl bench learning` runs it): the CLI in a fresh process, each phase's
start and end in seconds since the process was spawned, median over the repeats. The driver's
phases come from wrappers around the trainer's set-up functions (nothing else changes in the
command), the engines' from `engines.info["startup"]` (each actor's own marks), step 1 and the last
step from the MLflow store. `--env-b K=V`: a second side with that environment, alternated run by
run with the first (an A/B of an environment knob, or `--env-b PYTHONPATH=DIR`: another checkout's code,
measured side by side).

Pieces (medians): Python imports (torch, transformers, vllm, deepspeed, ray, mlflow, the
CLI's import chain), `ray.init` as the trainer does it, a no-op Ray actor's first call (worker
process spawn + runtime env), the vLLM engine's construction and its first generate at the
rollout's shape (in-process engine, as in the rollout actor), and the DeepSpeed learner's
`setup` (imports excluded). Then one real `start_engines` (everything, in parallel, as `train`
starts them) for comparison with the sum. A diagnostic for docs/PERFORMANCE.md; not part of
`stapoctl bench all`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import _peers  # noqa: E402

IMPORTS = {
    "import torch": "import torch",
    "import transformers (+AutoModelForCausalLM)": "import torch, transformers; from transformers import AutoModelForCausalLM",
    "import vllm (from vllm import LLM)": "import torch; from vllm import LLM",
    "import deepspeed": "import torch; import deepspeed",
    "import ray": "import ray",
    "import mlflow": "import mlflow",
    "stapoctl CLI → driver imports": "import stapoctl.cli; from stapoctl.trainer.driver import train; "
                                     "import stapoctl.trainer.engines, ray, mlflow",
}

PIECE = r'''
import json, os, sys, time
T = {}
def mark(k, t0): T[k] = time.perf_counter() - t0
what, model_dir = sys.argv[1], sys.argv[2]
if what == "ray":
    import ray
    from stapoctl.launch.ray_runtime import ensure_ray, shutdown_ray
    from stapoctl.config.compose import compose_config
    conf = compose_config([])
    t0 = time.perf_counter(); ensure_ray(conf.cluster); mark("ray.init", t0)
    @ray.remote(num_cpus=1)
    class Noop:
        def ping(self): return os.getpid()
    t0 = time.perf_counter(); a = Noop.remote(); ray.get(a.ping.remote()); mark("first call of a new actor", t0)
    t0 = time.perf_counter(); shutdown_ray(); mark("shutdown_ray (autoscaler monitor killed first)", t0)
elif what == "vllm":
    from stapoctl.rollout.vllm_engine import EngineSpec, configure_env, make_llm, generate
    from stapoctl.rollout.vllm_worker import rollout_env
    from stapoctl.config.compose import compose_config
    from stapoctl.trainer.engine_settings import max_model_len
    from stapoctl.sync.worker_extension import EXTENSION_CLS
    conf = compose_config([])
    spec = EngineSpec(model_path=model_dir, seed=0, max_model_len=max_model_len(conf, model_dir), dtype="float32",
                      kv_cache_gb=float(conf.rollout.kv_cache_gb), worker_extension_cls=EXTENSION_CLS)
    os.environ.update(rollout_env(spec))  # the rollout actor's environment
    configure_env()
    t0 = time.perf_counter(); import vllm; mark("rollout: import vllm (env set)", t0)
    t0 = time.perf_counter(); llm = make_llm(spec); mark("vLLM LLM(...) engine init", t0)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok("Compute 3 + 4 * 5. " * 2, add_special_tokens=False)["input_ids"]] * 8
    t0 = time.perf_counter(); generate(llm, prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=48, seed=1); mark("first generate (8x8, 48 tok)", t0)
    t0 = time.perf_counter(); generate(llm, prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=48, seed=2); mark("second generate (same shape)", t0)
elif what == "learner":
    import torch
    t0 = time.perf_counter(); import deepspeed; mark("learner: import deepspeed (torch loaded)", t0)
    from omegaconf import OmegaConf
    from stapoctl.config.compose import compose_config
    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.learner.engine_setup import free_port
    conf = compose_config([])
    l = Learner(0, 1)
    t0 = time.perf_counter()
    info = l.setup(model_dir, OmegaConf.to_container(conf.learner, resolve=True), OmegaConf.to_container(conf.loss, resolve=True),
                   n_per_prompt=8, master_port=free_port())
    mark("Learner.setup (DeepSpeed init + model load)", t0)
elif what == "engines":
    from rich.console import Console
    from stapoctl.config.compose import compose_config
    from stapoctl.trainer.engines import start_engines
    from stapoctl.launch.ray_runtime import shutdown_ray
    conf = compose_config([])
    t0 = time.perf_counter(); eng = start_engines(conf, model_dir, Console(quiet=True)); mark("start_engines (all, in parallel)", t0)
    for k in ("ray_s", "vllm_init_s", "learner_setup_s"):
        T["  info." + k] = eng.info[k]
    import ray
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok("Compute 3 + 4 * 5. " * 2, add_special_tokens=False)["input_ids"]] * 8
    t0 = time.perf_counter(); ray.get(eng.workers[0].generate.remote(prompts, n=8, max_tokens=48, seed=1)); mark("  first rollout call after start", t0)
    t0 = time.perf_counter(); eng.shutdown(); shutdown_ray(); mark("  shutdown", t0)
print(json.dumps(T))
'''


# The CLI as a user runs it (`python -m stapoctl.cli train ...`), with marks written as it goes (the
# CLI may leave by os._exit, so no atexit): argv = [marks file, CLI args...].
WHOLE = r'''
import json, sys, time
T0 = time.time()
path = sys.argv[1]
def mark(key, t=None):
    with open(path, "a") as fh:
        fh.write(json.dumps({key: t or time.time()}) + "\n")
mark("python_up", T0)
import stapoctl.cli as cli
mark("cli_imported")
from stapoctl.trainer import engines, setup
def wrap(owner, name, start=None, end=None):
    fn = getattr(owner, name)
    def wrapped(*a, **k):
        start and mark(start)
        out = fn(*a, **k)
        end and mark(end)
        return out
    setattr(owner, name, wrapped)
wrap(setup, "check_config", end="config_checked")
wrap(setup, "prepare_run", end="run_prepared")
wrap(setup, "_driver_setup", "driver_setup_start", "driver_setup_end")
wrap(setup, "start_engines_and_data", end="actors_created_and_data")
wrap(engines.EngineLaunch, "ready", "ready_wait", "engines_ready")
sys.argv = ["stapoctl", "train", *sys.argv[2:]]
cli.main()
'''

# (phase, from mark, to mark) of the whole command; marks are the driver's (WHOLE), "launch+X" the
# engines' phases (`engines.info["startup"]`, relative to `launch_engines`' start), "step_1" / "last_step"
# from MLflow and "exit" the process's end.
WHOLE_PHASES = (
    ("python + CLI imports", "spawn", "cli_imported"),
    ("compose + check config", "cli_imported", "config_checked"),
    ("resume point, preflight, model", "config_checked", "run_prepared"),
    ("driver set-up thread (torch, MLflow, tokenizer, data)", "driver_setup_start", "driver_setup_end"),
)


def whole_runs(repeats: int, steps: int, env_b: dict) -> dict:
    """`repeats` whole commands per side (A: this environment, B: + env_b when given), alternating."""
    import os
    import tempfile

    sides = {"A": {}} if not env_b else {"A": {}, "B": env_b}
    out: dict[str, list] = {k: [] for k in sides}
    for r in range(repeats):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            work = Path(tempfile.mkdtemp(prefix="stapoctl-startup-"))
            marks, log = work / "marks.jsonl", work / "engines.jsonl"
            uri = f"sqlite:///{work}/mlflow.db"
            args = [f"trainer.total_steps={steps}", f"trainer.save_freq={steps}", "eval.every_n_steps=0",
                    "trainer.log_samples=0", f"tracking.uri={uri}", f"trainer.output_dir={work}/run",
                    "tracking.experiment=bench"]
            env = {**os.environ, **sides[side], "STAPOCTL_TEST_ENGINE_LOG": str(log), "COLUMNS": "200",
                   # a side's own PYTHONPATH (another checkout's stapoctl) comes first
                   "PYTHONPATH": os.pathsep.join(x for x in (sides[side].get("PYTHONPATH"), str(H.ROOT),
                                                             os.environ.get("PYTHONPATH")) if x)}
            load = os.getloadavg()[0]
            spawn = time.time()
            # cwd: Ray puts the driver's sys.path[0] (`-c`: the cwd) on its workers' path, ahead of PYTHONPATH
            proc = subprocess.run([sys.executable, "-c", WHOLE, str(marks), *args], capture_output=True, text=True,
                                  env=env, timeout=900, cwd=sides[side].get("PYTHONPATH") or str(H.ROOT))
            end = time.time()
            if proc.returncode:
                raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
            t = {"spawn": spawn, "exit": end}
            for line in marks.read_text().splitlines():
                for k, v in json.loads(line).items():
                    t.setdefault(k, v)  # the first time a mark is reached
            info = json.loads(log.read_text().splitlines()[-1])
            launch = float(info["time"]) - float(info["engines_s"])  # record_start runs at the end of ready()
            for name, (a, b) in info.get("startup", {}).items():
                t[f"launch+{name}"] = (launch + a, launch + b)
            run_id = re.search(r"MLflow run ([0-9a-f]{32})", proc.stdout)
            if run_id:
                from mlflow.tracking import MlflowClient

                hist = MlflowClient(tracking_uri=uri).get_metric_history(run_id.group(1), "timing_s/step")
                ms = {int(m.step): m.timestamp / 1e3 for m in hist}
                if ms:
                    t["step_1"], t["last_step"] = ms[min(ms)], ms[max(ms)]
            out[side].append({"t": t, "engines_s": info["engines_s"], "vllm_init_s": info["vllm_init_s"],
                              "learner_setup_s": info["learner_setup_s"], "ray_s": info["ray_s"], "load": load})
            print(f"  {side} run {r + 1}: whole {end - spawn:.1f} s, step 1 at {t.get('step_1', end) - spawn:.1f} s, "
                  f"engines_s {info['engines_s']:.2f} (load {load:.1f})", flush=True)
    return out


def whole_table(runs: list) -> list[tuple[str, float, float]]:
    """(phase, median start, median end), seconds since the process was spawned."""
    rows: dict[str, list] = {}
    for run in runs:
        t = run["t"]
        def at(key):
            v = t.get(key)
            return v[1] if isinstance(v, tuple) else v
        spans = [(name, t.get(a), t.get(b)) for name, a, b in WHOLE_PHASES]
        spans += [(k[len("launch+"):], v[0], v[1]) for k, v in t.items() if k.startswith("launch+")]
        spans += [("actors created → engines ready (driver waits)", at("ready_wait"), at("engines_ready")),
                  ("engines ready → step 1 logged (MLflow run, step 1)", at("engines_ready"), at("step_1")),
                  ("steps 2..N", at("step_1"), at("last_step")),
                  ("last step → exit (save, shutdown)", at("last_step"), at("exit")),
                  ("whole command", t["spawn"], t["exit"])]
        for name, a, b in spans:
            if a and b:
                rows.setdefault(name, []).append((a - t["spawn"], b - t["spawn"]))
    return [(name, statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for name, v in rows.items()]


def print_whole(out: dict) -> None:
    for side, runs in out.items():
        print(f"side {side}: {len(runs)} run(s); engines_s {[round(r['engines_s'], 2) for r in runs]}, "
              f"load {[round(r['load'], 1) for r in runs]}")
        print(f"  {'phase':<60} {'start':>7} {'end':>7} {'takes':>7}")
        for name, a, b in whole_table(runs):
            print(f"  {name:<60} {a:7.2f} {b:7.2f} {b - a:7.2f}")


def timed(code: list[str], env_extra: dict | None = None) -> tuple[float, str]:
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(H.ROOT), os.environ.get("PYTHONPATH")) if x),
           "PYTHONWARNINGS": "ignore", **(env_extra or {})}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *code], capture_output=True, text=True, env=env, timeout=900)
    dt = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return dt, out.stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size", default="tiny", choices=["tiny", *_peers.SIZES])
    p.add_argument("--whole", action="store_true", help="the whole `stapoctl train`'s phase table instead")
    p.add_argument("--steps", type=int, default=None, help="--whole: RL steps (default: the embedded default's)")
    p.add_argument("--env-b", action="append", default=[], metavar="K=V", help="--whole: a second side's environment")
    p.add_argument("--json", default=None, help="--whole: also write the runs here")
    a = p.parse_args(argv)
    if a.whole:
        steps = int(a.steps or _peers.compose([]).trainer.total_steps)
        out = whole_runs(a.repeats, steps, dict(kv.split("=", 1) for kv in a.env_b))
        print_whole(out)
        if a.json:
            Path(a.json).write_text(json.dumps({"steps": steps, "env_b": a.env_b, "runs": out}, indent=1, default=str))
        return 0
    conf = _peers.compose([])
    mdir = _peers.model_dir(a.size, conf)
    results: dict[str, list[float]] = {}
    base, _ = timed(["-c", "pass"])
    for _ in range(a.repeats):
        for name, code in IMPORTS.items():
            dt, _ = timed(["-c", code])
            results.setdefault(name, []).append(dt - base)
        for piece in ("ray", "vllm", "learner", "engines"):
            _, out = timed(["-c", PIECE, piece, mdir])
            for k, v in json.loads(out.strip().splitlines()[-1]).items():
                results.setdefault(k, []).append(v)
    print(f"start-up pieces, {a.size} model, median of {a.repeats} fresh processes (interpreter start "
          f"{base:.2f} s subtracted from the imports)")
    for k, v in results.items():
        print(f"  {statistics.median(v):7.2f} s  [{min(v):.2f}–{max(v):.2f}]  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
