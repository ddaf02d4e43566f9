"""The start-up helpers engines use: imports under a paused GC, and Ray's context without Ray."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from stapoctl.launch.import_gc import paused_gc


def test_paused_gc_freezes_what_was_imported_and_restores_the_gc():
    assert gc.isenabled()
    before = gc.get_freeze_count()
    with paused_gc():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]  # container objects the GC tracks
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + len(made)


def test_paused_gc_leaves_a_disabled_gc_disabled():
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_runtime_context_outside_ray_starts_no_ray():
    # a fresh interpreter: this test session may have Ray up already
    code = ("import ray; from stapoctl.launch.ray_runtime import runtime_context; "
            "assert runtime_context() is None; assert not ray.is_initialized(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_runtime_context_without_ray_imported_neither_imports_nor_needs_it():
    # a GPU node may run a learner where ray is not installed: asking must not import it
    code = ("import sys; from stapoctl.launch.ray_runtime import in_ray_actor, runtime_context; "
            "assert runtime_context() is None and not in_ray_actor(); assert 'ray' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_frozen_imports_are_released_at_exit():
    # gc.freeze keeps objects out of the interpreter's final collection unless they are thawed
    # at exit; triton's bindings (imported with torch here) then print "nanobind: leaked ..."
    code = ("from stapoctl.launch.import_gc import paused_gc\n"
            "with paused_gc():\n"
            "    import torch\n"
            "    from transformers import AutoModelForCausalLM\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert "leaked" not in out.stderr, out.stderr[-2000:]


def test_paused_gc_does_nothing_once_its_modules_are_loaded():
    # a second engine in one process must not freeze the first one's pending garbage
    before = gc.get_freeze_count()
    with paused_gc("gc", "sys"):  # both loaded
        assert gc.isenabled()
        made = [[i] for i in range(1000)]
    assert gc.get_freeze_count() < before + len(made)


def test_generic_tokenizer_is_what_autotokenizer_loads_and_only_for_the_generic_class(tmp_path):
    import json

    from transformers import AutoTokenizer

    from stapoctl.data.templates import generic_tokenizer, render_prompt
    from stapoctl.models.tokenizer import train_tokenizer

    corpus = [f"What is {a} * {b}? The answer is \\boxed{{{a * b}}}." for a in range(30) for b in range(30)]
    train_tokenizer(corpus, vocab_size=300, out_dir=tmp_path / "tok")
    light, auto = generic_tokenizer(str(tmp_path / "tok")), AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert type(light) is type(auto)
    texts = [render_prompt("What is 12 * 7?", template="chat", instruction="Box it.", tokenizer=tok)
             for tok in (light, auto)]
    assert texts[0] == texts[1] and "<|im_start|>assistant" in texts[0]
    assert light(texts, add_special_tokens=False)["input_ids"] == auto(texts, add_special_tokens=False)["input_ids"]
    assert (light.pad_token_id, light.eos_token_id) == (auto.pad_token_id, auto.eos_token_id)

    config = tmp_path / "tok" / "tokenizer_config.json"
    saved = json.loads(config.read_text())
    config.write_text(json.dumps({**saved, "tokenizer_class": "Qwen2Tokenizer"}))  # a model-specific class
    assert generic_tokenizer(str(tmp_path / "tok")) is None  # → AutoTokenizer resolves it
    assert generic_tokenizer(str(tmp_path / "missing")) is None


def test_without_full_collections_restores_the_gc_functions_even_on_error():
    from stapoctl.rollout.vllm_worker import _without_full_collections

    collect, unfreeze = gc.collect, gc.unfreeze
    try:
        with _without_full_collections():
            assert gc.collect() == 0 and gc.unfreeze() is None
            assert gc.collect is not collect
            raise KeyError("engine shutdown failed")
    except KeyError:
        pass
    assert gc.collect is collect and gc.unfreeze is unfreeze


def test_rollout_env_turns_dynamo_off_only_for_an_eager_cpu_engine():
    from stapoctl.rollout.vllm_engine import EngineSpec
    from stapoctl.rollout.vllm_worker import rollout_env

    assert rollout_env(EngineSpec(model_path="m"))["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in rollout_env(EngineSpec(model_path="m", enforce_eager=False))
    # a GPU actor gets none of the CPU settings, whatever the driver's machine has
    gpu = rollout_env(EngineSpec(model_path="m", num_threads=2), on_gpu=True)
    assert not {"TORCHDYNAMO_DISABLE", "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS"} & set(gpu)
    cpu = rollout_env(EngineSpec(model_path="m", num_threads=2))
    assert cpu["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and cpu["OMP_NUM_THREADS"] == "2"


@pytest.mark.engine  # a local Ray instance
def test_ray_shutdown_stops_the_monitor_first_and_leaves_nothing_running():
    """A fresh interpreter starts a local Ray: killing its autoscaler monitor leaves the instance
    working (a task still runs), and `shutdown_ray` then leaves no child process behind."""
    code = """
import psutil, ray
from stapoctl.launch.ray_runtime import _stop_autoscaler_monitor, shutdown_ray
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
def kids():
    return {c.pid: ' '.join(c.cmdline()) for c in psutil.Process().children() if c.is_running()
            and c.status() != psutil.STATUS_ZOMBIE}
before = kids()
monitors = [p for p, cmd in before.items() if 'autoscaler/_private/monitor.py' in cmd]
assert len(monitors) == 1, before
_stop_autoscaler_monitor()
psutil.Process(monitors[0]).wait(timeout=10)
after = kids()
assert set(after) == set(before) - set(monitors), (before, after)
assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42
shutdown_ray()
psutil.wait_procs(psutil.Process().children(), timeout=10)
left = kids()
assert not left, left
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-2000:]


def test_engine_actors_skip_scikit_learn_and_transformers_still_loads():
    """transformers imports scikit-learn only for assisted generation; an engine actor marks it
    absent first. In a fresh interpreter: without the mark sklearn is imported (so the test can
    fail), with it transformers' generation utilities and a Qwen3 model class still import."""
    code = """
import sys
{skip}
import transformers.generation.candidate_generator as cg
from transformers import AutoModelForCausalLM
from transformers.utils import is_sklearn_available
print(sys.modules.get("sklearn") is not None, is_sklearn_available())
"""
    runs = {}
    for skip in (False, True):
        body = code.format(skip="from stapoctl.launch.import_gc import skip_unused_imports; skip_unused_imports()"
                           if skip else "")
        out = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[skip] = out.stdout.split()
    assert runs[False] == ["True", "True"]
    assert runs[True] == ["False", "False"]


@pytest.mark.engine  # two local Ray instances
def test_local_ray_starts_no_idle_workers_and_tasks_still_run():
    """Ray prestarts one idle worker per CPU for the first driver; no engine actor can use them
    (each has its own runtime env), so `ensure_ray` turns that off. Counted in a fresh
    interpreter, against a plain `ray.init` that does prestart (so the count can fail)."""
    code = """
import sys, time, psutil, ray
from types import SimpleNamespace
from stapoctl.launch.ray_runtime import ensure_ray, shutdown_ray
if sys.argv[1] == "ours":
    ensure_ray(SimpleNamespace(address=None, num_cpus=2, num_gpus=None))
else:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
def idle():
    return sum(' '.join(c.cmdline()).startswith('ray::IDLE') for c in psutil.Process().children(recursive=True)
               if c.is_running() and c.status() != psutil.STATUS_ZOMBIE)  # a worker renames itself so
time.sleep(3)
n = idle()
assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42
from stapoctl.launch.ray_runtime import in_ray_actor
Probe = ray.remote(num_cpus=0)(type("Probe", (), {"inside": lambda self: in_ray_actor()}))
assert ray.get(Probe.remote().inside.remote()) is True and in_ray_actor() is False
shutdown_ray()
print(n)
"""
    counts = {}
    for who in ("ours", "plain"):
        out = subprocess.run([sys.executable, "-c", code, who], capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        counts[who] = int(out.stdout.split()[-1])
    assert counts == {"ours": 0, "plain": 2}


@pytest.mark.engine  # the session's tiny model (`shared_home`: its build is minutes)
def test_composing_and_checking_a_training_config_imports_no_torch(shared_home):
    # `stapoctl train` imports torch on a driver thread while Ray starts (~1 s of the start-up):
    # nothing before ray.init may import it for a CPU run
    code = ("import sys; from stapoctl.config.compose import compose_config; "
            "from stapoctl.trainer.setup import check_config, quiet_engine_logs; "
            f"conf = compose_config({shared_home.overrides!r}); check_config(conf); quiet_engine_logs(conf); "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    env = {**os.environ, "STAPOCTL_HOME": str(shared_home.home)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
