"""MKL's AVX-512 kernels on AMD CPUs: a one-function library preloaded into the engine actors.

torch's CPU wheel links Intel MKL for fp32 matmuls. MKL picks its kernels only after asking
whether the CPU is an Intel one (`mkl_serv_intel_cpu_true`). On any other vendor it takes its
generic path, whatever the CPU supports. On this machine (AMD EPYC, AVX-512) that path made
torch's matmuls 2-2.3x slower than with MKL's AVX-512 kernels, and the learner's update at 25M
took 3.5 s instead of 1.9 s (docs/PERFORMANCE.md). `MKL_DEBUG_CPU_TYPE`, the old switch, is gone
since MKL 2020. The usual workaround is a library that defines that one function to return 1,
loaded first (LD_PRELOAD), so that MKL chooses by the CPU's feature flags alone. The
features themselves are still checked, so a CPU without AVX-512 gets MKL's AVX2 kernels.

The library is built once with the system C compiler into STAPOCTL_HOME/lib. It goes into the
environment of the engine actors of a local Ray instance (`ray_runtime.actor_env`). It is left
out where the CPU is not AMD, where no compiler is found, with `cluster.mkl_amd_shim=off`, and
by default on a remote Ray cluster, whose nodes may not see this file (`on` forces it there).
vLLM's linear layers use oneDNN, which dispatches on features already, so the rollout gains
little. The learner, which runs plain torch, gains the most.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from stapoctl import paths
from stapoctl.errors import UserError

SOURCE = (
    "/* stapoctl (launch/mkl_shim.py): MKL takes its kernels by the CPU's features, not its vendor */\n"
    "int mkl_serv_intel_cpu_true(void) { return 1; }\n"
)
MODES = ("auto", "on", "off")

_mode = "auto"
_remote = False


def configure(mode: str = "auto", *, remote: bool = False) -> None:
    """Set by `ensure_ray` from `cluster.mkl_amd_shim` and whether Ray is a remote cluster."""
    global _mode, _remote
    if mode not in MODES:
        raise UserError(f"cluster.mkl_amd_shim='{mode}': use auto, on or off")
    _mode, _remote = mode, remote


def cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:10]
    return paths.home() / "lib" / f"libstapoctl_mkl_vendor_{digest}.so"


def build() -> Optional[Path]:
    """The shim, compiled on first use (~50 ms); None where no C compiler is found."""
    target = library_path()
    if target.exists():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "shim.c"
        src.write_text(SOURCE)
        try:  # atomic: runs started at once each build, one file wins
            with paths.atomic_path(target) as out:
                subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(src)], capture_output=True,
                               text=True, check=True)
        except subprocess.CalledProcessError:
            return None
    return target


def preload_env() -> dict[str, str]:
    """{"LD_PRELOAD": ...} for an engine actor's environment, or {} where the shim does not apply."""
    if _mode == "off" or (_mode == "auto" and _remote):
        return {}
    if platform.system() != "Linux" or cpu_vendor() != "AuthenticAMD":
        return {}
    lib = build()
    if lib is None:
        if _mode == "on":
            raise UserError("cluster.mkl_amd_shim=on needs a C compiler (cc or gcc, or $CC) to build its "
                            "one-line library: install one or set cluster.mkl_amd_shim=off")
        return {}
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and p != str(lib)]
    return {"LD_PRELOAD": ":".join([str(lib), *preload])}


def mkl_code_path() -> Optional[int]:
    """In this process: the code path MKL chose (`mkl_serv_cpu_detect`; 0 = its generic kernels),
    or None where torch carries no MKL. Logged with the run, so that the run states which."""
    import ctypes

    import torch

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        detect = ctypes.CDLL(str(lib)).mkl_serv_cpu_detect
    except (OSError, AttributeError):
        return None
    detect.restype = ctypes.c_int
    return int(detect())


def loaded_here() -> bool:
    """Whether this process runs with the shim loaded (its file is mapped)."""
    try:
        with open("/proc/self/maps") as f:
            return "libstapoctl_mkl_vendor_" in f.read()
    except OSError:
        return False
