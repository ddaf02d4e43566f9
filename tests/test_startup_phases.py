"""Start-up of the engines: the phase table `engines.info["startup"]` is built from, and the imports
the engine actors skip (`launch/import_gc.skip_unused_imports`) with the libraries still loading."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stapoctl.launch.ray_runtime import STARTUP_PHASES, startup_phases


def test_startup_phases_are_seconds_since_launch_with_the_slowest_actor_of_each_role():
    t0 = 1000.0
    driver = {"launch": t0, "ray_up": t0 + 2.0, "placement_ready": t0 + 2.2, "rollout_created": t0 + 2.5,
              "learner_setup_sent": t0 + 4.0, "actors_up": t0 + 9.0, "sync_linked": t0 + 9.1}
    fast = {"spawned": t0 + 2.6, "constructor": t0 + 3.5, "vllm_imported": t0 + 6.0, "engine_built": t0 + 7.0}
    slow = {"spawned": t0 + 2.7, "constructor": t0 + 3.9, "vllm_imported": t0 + 7.5, "engine_built": t0 + 8.9}
    learner = {"spawned": t0 + 2.8, "setup_called": t0 + 4.1, "imports": t0 + 6.5, "process_group": t0 + 7.2,
               "engine_built": t0 + 7.9, "first_forward": t0 + 8.0}
    phases = startup_phases(driver, [{"startup": fast}, {"startup": slow}], [{"startup": learner}])
    assert phases["ray.init"] == [0.0, 2.0]
    assert phases["vLLM actor: import vLLM"] == [3.9, 7.5]  # the actor that came up last
    assert phases["vLLM actor: engine init"] == [7.5, 8.9]
    assert phases["learner: DeepSpeed import + process group"] == [6.5, 7.2]
    assert phases["weight-sync link"] == [9.0, 9.1]
    assert list(phases) == [name for name, _, _ in STARTUP_PHASES]  # every phase, in the table's order
    json.dumps(phases)  # the engine log and the MLflow tags take it as it is
    # actors without marks (an older build, a fake in a test): the driver's phases only, no error
    partial = startup_phases(driver, [{}], [{"startup": {}}])
    assert partial == {"ray.init": [0.0, 2.0], "placement groups": [2.0, 2.2],
                       "learner: process up (rendezvous answered)": [2.5, 4.0], "weight-sync link": [9.0, 9.1]}
    assert startup_phases({}, [{"startup": fast}], []) == {}


def test_process_start_is_when_the_process_was_spawned():
    """The actors' "spawned" mark: a child's own reading against the parent's clock around its spawn
    (to 0.1 s; psutil's create_time was 0.4 s off here, the boot time rounded to the second)."""
    import time

    before = time.time()
    out = subprocess.run([sys.executable, "-c", "from stapoctl.launch.ray_runtime import process_start; "
                          "print(repr(process_start()))"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert before - 0.1 <= float(out.stdout) <= before + 1.0


_ACTOR_IMPORTS = """
import gc, json, os, sys
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", DS_ACCELERATOR="cpu", TORCHDYNAMO_DISABLE="1")
if sys.argv[1] == "skip":
    from stapoctl.launch.import_gc import skip_unused_imports
    skip_unused_imports()
from stapoctl.learner.engine_setup import import_training_stack
from stapoctl.rollout import vllm_engine
import_training_stack()
import transformers.loss.loss_for_object_detection as detection  # the scipy import, behind its own check
import deepspeed, deepspeed.comm  # the autotuner's MLflow import, behind try/except
import deepspeed.autotuning.autotuner as autotuner
vllm_engine.import_vllm(vllm_engine.EngineSpec(model_path="unused"))  # TP 1: the in-process engine's worker too
import vllm.multimodal.audio as audio  # vLLM's scipy.signal import, behind try/except
from vllm import LLM
from transformers import AutoModelForCausalLM
print(json.dumps({"loaded": {m: sys.modules.get(m) is not None for m in ("scipy", "mlflow", "sklearn")},
                  "autotuner_mlflow": autotuner.has_mlflow,
                  "cpu_worker": "vllm.v1.worker.cpu_worker" in sys.modules,
                  "frozen": gc.get_freeze_count()}))
"""


def test_engine_actors_skip_scipy_and_mlflow_and_vllm_deepspeed_transformers_still_load():
    """What both engine actors import (the learner's stack, then vLLM's with the CPU engine's worker
    module), in fresh interpreters: without the marks scipy and MLflow are imported (so the test can
    fail), with them neither is, and transformers, DeepSpeed and vLLM load and take their
    missing-package paths."""
    runs = {}
    for mode in ("plain", "skip"):
        out = subprocess.run([sys.executable, "-c", _ACTOR_IMPORTS, mode], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["plain"]["loaded"] == {"scipy": True, "mlflow": True, "sklearn": True}
    assert runs["plain"]["autotuner_mlflow"] is True
    assert runs["skip"]["loaded"] == {"scipy": False, "mlflow": False, "sklearn": False}
    assert runs["skip"]["autotuner_mlflow"] is False
    for run in runs.values():
        assert run["cpu_worker"] is True  # imported with vLLM, under the paused GC, then frozen
        assert run["frozen"] > 100_000


@pytest.mark.engine  # two local Ray instances
def test_engine_actors_run_at_the_drivers_priority_not_rays_worker_niceness():
    """Ray starts every worker at niceness 15; under `ensure_ray` (whose runtime env is the engines'
    `actor_env`) an actor runs at the driver's. Each in a fresh interpreter, against a plain
    `ray.init` (so the test can fail)."""
    code = """
import os, sys, ray
from types import SimpleNamespace
from stapoctl.launch.ray_runtime import actor_env, ensure_ray, shutdown_ray
if sys.argv[1] == "ours":
    ensure_ray(SimpleNamespace(address=None, num_cpus=2, num_gpus=None))
else:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
Probe = ray.remote(num_cpus=0)(type("Probe", (), {"nice": lambda self: os.nice(0)}))
bare = ray.get(Probe.remote().nice.remote())
engine = ray.get(Probe.options(runtime_env={"env_vars": actor_env()}).remote().nice.remote())
shutdown_ray()
print(os.nice(0), bare, engine)
"""
    seen = {}
    for mode in ("plain", "ours"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        seen[mode] = list(map(int, out.stdout.split()[-3:]))
    driver = seen["ours"][0]
    assert seen["plain"][1] == min(19, driver + 15)  # Ray's default (RAY_worker_niceness)
    assert seen["plain"][2] == driver  # an actor with the engines' environment, in anyone's Ray
    assert seen["ours"][1:] == [driver, driver]  # every worker of a Ray that ensure_ray started
