"""Session-wide fixtures.

`shared_home`: one STAPOCTL_HOME with one reduced warm-started tiny model, built once per test
session (~80 s) and shared by every engine test that trains or evaluates the embedded default.
Each test still keeps its own MLflow store and run dirs (pass `tracking.uri=` / output dirs under
tmp_path), so tests stay independent while the expensive build is paid once.
Developers iterating on engine tests can set STAPOCTL_TEST_HOME=<dir> to keep that model across
sessions (the build is cached by its config hash, so a stale model is never reused).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

# the real warm-start recipe, shortened: ~80 s to build; the model boxes some toy answers, so
# GRPO groups have non-zero advantages and a few RL steps have a real gradient
TINY_OVERRIDES = ["model.tiny.warm_start_steps=250", "data.toy.num_heldout=64"]
# ../shared/data beside the checkout; STAPOCTL_SHARED_DATA points a worktree elsewhere at it
SHARED_DATA = Path(os.environ.get("STAPOCTL_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")


@pytest.fixture(scope="session")
def shared_home(tmp_path_factory) -> SimpleNamespace:
    """home: the STAPOCTL_HOME; overrides: the Hydra overrides selecting its model; model_dir."""
    from stapoctl.config.compose import compose_config
    from stapoctl.models.tiny import ensure_base_model

    home = Path(os.environ["STAPOCTL_TEST_HOME"]) if os.environ.get("STAPOCTL_TEST_HOME") else \
        tmp_path_factory.mktemp("shared_home")
    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_HOME", str(home))
    try:
        conf = compose_config(TINY_OVERRIDES)
        model_dir = ensure_base_model(conf.model, conf.data)
    finally:
        mp.undo()
    return SimpleNamespace(home=Path(home), overrides=list(TINY_OVERRIDES), model_dir=Path(model_dir))


@pytest.fixture(scope="session")
def training_store(shared_home, tmp_path_factory):
    """`with training_store("name", common) as t:` in a module fixture: see `_training_store`."""
    return lambda name, common=(): _training_store(shared_home, tmp_path_factory, name, common)


@contextlib.contextmanager
def _training_store(shared_home: SimpleNamespace, tmp_path_factory, name: str, common=()):
    """What an engine test that trains needs: its own sqlite MLflow store, STAPOCTL_HOME on the
    shared tiny model, a recording console and `conf(extra)` = shared + common + extra overrides
    against that store."""
    from rich.console import Console

    from stapoctl.config.compose import compose_config

    uri = f"sqlite:///{tmp_path_factory.mktemp(name) / 'mlflow.db'}"
    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_HOME", str(shared_home.home))

    def conf(extra=()):
        return compose_config(shared_home.overrides + list(common) + list(extra) + [f"tracking.uri={uri}"])

    try:
        yield SimpleNamespace(uri=uri, conf=conf, console=Console(width=120, record=True))
    finally:
        mp.undo()


# -- where the suite's time goes ---------------------------------------------------------------------
# Per module: setup + call + teardown of its tests, summed (module fixtures' engine starts included),
# printed after the run so the suite's budget (README: well under 30 minutes) is kept per file.
_MODULE_SECONDS: dict[str, float] = {}


# Every engine start too, wherever its driver runs (this process, a `stapoctl train` child, a Ray
# or SLURM job): STAPOCTL_TEST_ENGINE_LOG names a file that `EngineLaunch.ready` appends its
# `engines.info` to (stapoctl/launch/engine_log.py); set here for the whole session, so child
# processes inherit it and jobs/ forwards it. `<log>.current` holds the running test's node id.
_ENGINE_LOG = Path(tempfile.mkdtemp(prefix="stapoctl-engine-log-")) / "starts.jsonl"
os.environ["STAPOCTL_TEST_ENGINE_LOG"] = str(_ENGINE_LOG)
_PHASES = ("ray_s", "vllm_init_s", "learner_setup_s", "engines_s")


def pytest_runtest_logstart(nodeid, location) -> None:
    Path(f"{_ENGINE_LOG}.current").write_text(nodeid)


def pytest_runtest_logreport(report) -> None:
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + float(report.duration or 0.0)


def count_engine_start(t0: float, workers=(), setup_refs=()) -> None:
    """A module fixture's hand-built actors (vLLM workers, learner ranks) counted in the table
    beside the starts `EngineLaunch.ready`, eval and the judge record themselves."""
    import time

    import ray

    from stapoctl.launch import engine_log

    worker_info = ray.get([w.info.remote() for w in workers])
    learner_info = ray.get(list(setup_refs))
    engine_log.record_start({"ray_s": 0.0, "vllm_init_s": max([w["init_s"] for w in worker_info], default=0.0),
                             "learner_setup_s": max([x["setup_s"] for x in learner_info], default=0.0),
                             "engines_s": time.perf_counter() - t0}, kind="fixture")


def engine_starts(log: Path = _ENGINE_LOG) -> list[dict]:
    """The starts the hook recorded; a line torn by a killed driver is skipped."""
    starts = []
    for line in (log.read_text().splitlines() if log.is_file() else []):
        try:
            starts.append(json.loads(line))
        except ValueError:
            pass
    return starts


def pytest_terminal_summary(terminalreporter) -> None:
    if not _MODULE_SECONDS:
        return
    total = sum(_MODULE_SECONDS.values())
    terminalreporter.section(f"time per test module ({total:.0f} s in tests)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:4.1f}%  {module}")
    starts = engine_starts()
    terminalreporter.section("engine starts (this process, subprocesses, Ray and SLURM jobs)")
    if starts:
        terminalreporter.write_line(" ".join(f"{p:>15}" for p in _PHASES) + "  kind          pid  module")
    for s in sorted(starts, key=lambda s: s.get("time", 0.0)):
        phases = " ".join(f"{float(s.get(p, 0.0)):15.1f}" for p in _PHASES)
        where = "this process" if s.get("pid") == os.getpid() else "child"
        terminalreporter.write_line(f"{phases}  {s.get('kind', 'train'):<8} {s.get('pid', 0):>8}  "
                                    f"{s.get('module') or '?'} ({where})")
    seconds = sum(float(s.get("engines_s", 0.0)) for s in starts)
    terminalreporter.write_line(f"{len(starts)} engine starts, {seconds:.0f} s")


def pytest_unconfigure(config) -> None:
    shutil.rmtree(_ENGINE_LOG.parent, ignore_errors=True)
