"""Where the engines' start-up goes: each piece timed alone, in a fresh process, N times.

    python benchmarks/_startup.py [--repeats 3] [--size tiny]

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
    a = p.parse_args(argv)
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
