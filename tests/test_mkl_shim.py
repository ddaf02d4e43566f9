"""The MKL vendor shim (`launch/mkl_shim.py`): built, preloaded into Ray actors, and it changes
MKL's kernel choice without changing the numbers beyond rounding."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from stapoctl.errors import UserError
from stapoctl.launch import mkl_shim

AMD = mkl_shim.cpu_vendor() == "AuthenticAMD"
HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))

PROBE = """
import json, torch
from stapoctl.launch import mkl_shim
torch.manual_seed(0)
torch.set_num_threads(1)
a, b = torch.randn(96, 512), torch.randn(512, 384)
print(json.dumps({"path": mkl_shim.mkl_code_path(), "loaded": mkl_shim.loaded_here(), "mm": (a @ b).flatten()[:2000].tolist()}))
"""


def probe(env_extra: dict) -> dict:
    env = {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, **env_extra}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def restore_mode():
    yield
    mkl_shim.configure("auto", remote=False)


@pytest.mark.skipif(not (AMD and HAS_CC), reason="the shim applies to AMD CPUs and needs a C compiler")
def test_shim_makes_mkl_leave_its_generic_path_with_the_same_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path))
    lib = mkl_shim.build()
    assert lib is not None and lib.exists() and lib.parent == tmp_path / "lib"
    assert mkl_shim.build() == lib  # built once, then reused
    plain, shimmed = probe({}), probe({"LD_PRELOAD": str(lib)})
    assert plain["loaded"] is False and shimmed["loaded"] is True
    assert plain["path"] == 0, "MKL took a vendor-specific path on this AMD CPU without the shim"
    assert shimmed["path"] > plain["path"]
    import torch

    x, y = torch.tensor(plain["mm"]), torch.tensor(shimmed["mm"])
    assert torch.allclose(x, y, rtol=1e-5, atol=1e-4)  # other kernels, other rounding, same product


def test_preload_env_follows_the_mode_and_keeps_other_preloads(tmp_path, monkeypatch, restore_mode):
    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path))
    monkeypatch.setenv("LD_PRELOAD", "/opt/other/libfoo.so")
    mkl_shim.configure("off")
    assert mkl_shim.preload_env() == {}
    mkl_shim.configure("auto", remote=True)  # a remote cluster's nodes may not see the file
    assert mkl_shim.preload_env() == {}
    for mode, remote in (("auto", False), ("on", True)):
        mkl_shim.configure(mode, remote=remote)
        env = mkl_shim.preload_env()
        if AMD and HAS_CC:
            assert env == {"LD_PRELOAD": f"{mkl_shim.library_path()}:/opt/other/libfoo.so"}
        else:
            assert env == {}
    with pytest.raises(UserError, match="cluster.mkl_amd_shim='sometimes'"):
        mkl_shim.configure("sometimes")


@pytest.mark.skipif(not AMD, reason="without an AMD CPU the shim is never wanted")
def test_without_a_compiler_auto_skips_and_on_says_what_to_do(tmp_path, monkeypatch, restore_mode):
    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    mkl_shim.configure("auto")
    assert mkl_shim.preload_env() == {}
    mkl_shim.configure("on")
    with pytest.raises(UserError, match=r"cluster.mkl_amd_shim=on needs a C compiler .* set cluster.mkl_amd_shim=off"):
        mkl_shim.preload_env()


@pytest.mark.engine  # a local Ray instance
@pytest.mark.skipif(not (AMD and HAS_CC), reason="the shim applies to AMD CPUs and needs a C compiler")
def test_ray_actors_of_a_local_instance_run_with_the_shim():
    """Ray starts actor processes with their runtime env's variables, LD_PRELOAD included."""
    code = """
import ray
from stapoctl.launch import mkl_shim
from stapoctl.launch.ray_runtime import actor_env, ensure_ray, shutdown_ray
from types import SimpleNamespace
ensure_ray(SimpleNamespace(address=None, num_cpus=1, num_gpus=None, mkl_amd_shim="auto"))
Probe = ray.remote(num_cpus=0)(type("Probe", (), {"ask": lambda self: (mkl_shim.loaded_here(), mkl_shim.mkl_code_path())}))
inside = ray.get(Probe.options(runtime_env={"env_vars": actor_env()}).remote().ask.remote())
print("RESULT", inside[0], inside[1], mkl_shim.loaded_here())
shutdown_ray()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    _, loaded, path, driver_loaded = line[0].split()
    assert loaded == "True" and int(path) > 0
    assert driver_loaded == "False"  # the driver's own process is left as it started
