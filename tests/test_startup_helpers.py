"""The start-up helpers engines use: imports under a paused GC, and Ray's context without Ray."""

from __future__ import annotations

import gc
import subprocess
import sys

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
