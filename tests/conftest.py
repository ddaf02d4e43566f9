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
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
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


# -- one Ray head for the tests that submit to one ---------------------------------------------------
RAY = str(Path(sys.executable).with_name("ray"))


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="session")
def ray_head():
    """A Ray head (`ray start --head --block`, our child): address, token path, env for clients.
    One for the session (test_submit_ray, test_doctor, test_sweep_parallel_e2e): the tests that use
    it run one after another and it stops once they are done (see `pytest_runtest_teardown`)."""
    root = Path(tempfile.mkdtemp(prefix="rayh", dir="/tmp"))  # short: Ray's unix sockets live below it
    token = root / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "RAY_USAGE_STATS_ENABLED": "0"}
    gcs, dash, client, agent, agent_grpc, metrics, rt_env = free_ports(7)
    cmd = [RAY, "start", "--head", "--block", f"--port={gcs}", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={rt_env}",
           "--num-cpus=2", f"--temp-dir={root / 'ray'}", "--disable-usage-stats"]
    log = open(root / "head.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"

    def stop() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(root, ignore_errors=True)

    _SHARED["ray_head"] = stop
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2)
            except urllib.error.HTTPError as exc:  # 401: up, and it wants the token
                if exc.code == 401:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not come up: {(root / 'head.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield {"address": address, "token": token, "root": root, "gcs": f"127.0.0.1:{gcs}"}
    finally:
        _SHARED.pop("ray_head", None)
        stop()


# -- engines started once per configuration ----------------------------------------------------------
# The in-process end-to-end tests share one `EngineSession` (`engine_pool`): one Ray for all of
# them and, between runs whose engine key agrees (`trainer/session.py engine_key`), a learner reset
# + weight push instead of a new start. The tests that use it run last, module by module in
# POOL_ORDER, so modules whose runs have the same key follow each other: first the embedded
# default's key (1 worker, sync, fp32, default lengths), then two workers, other transports, bf16.
# Every start's reason (the settings that changed, or "previous engines discarded") is in the
# table at the end of the run. Every other test (those modules' engine-free ones included) runs
# before, in its usual order, with no pool alive; a pooled module's own-process chain (test_sweep_e2e's
# sweep process, test_fault_recovery's P1/P2) runs beside the pool's idle engines.
POOL_ORDER = (
    "test_scale_out.py",  # 2x2 (its resume on the same engines), then the embedded default's key
    "test_train_e2e.py", "test_golden_run.py", "test_sweep_e2e.py",  # the sweep's resume on the default's engines
    "test_loss_modules_e2e.py",  # loss.modules: a method of one's own on those engines, edited, reloaded by a reset
    "test_weight_sync.py",  # its learner reset to its own settings on those engines
    "test_resume_retention_e2e.py", "test_session.py",  # ends on fresh default engines
    "test_fault_recovery.py",  # P3 on those; P4 on fresh ones after P3's learner died
    "test_async.py",  # rollout threads pinned to every core: the default's engines in sync and async mode
    "test_sampling_contract_e2e.py",  # test_async's pins: T != 1 and top-p < 1 on those engines
    "test_dynamic_sampling.py",  # sync on the default's engines, then async on two workers
    "test_weight_transport_e2e.py",  # the object store on those two workers, then gloo, then TP 2
    "test_weight_sync_faults.py",  # fresh engines (its hooks' variables)
    "test_recipes_e2e.py",  # bf16
    "test_config_matrix.py",  # its bf16 runs first on those engines, then the default's key, then two workers
)
_SHARED: dict = {}  # fixture name → how to stop it early


@pytest.fixture(scope="session")
def ray_runtime():
    """One local Ray for the in-process engine tests: the modules that build actors by hand and the
    pool. Started here, before any module sets a test hook's variable (Ray would hand it to every
    later actor); stopped after the last of them."""
    import ray

    from stapoctl.launch.ray_runtime import ensure_ray, shutdown_ray

    started = not ray.is_initialized()
    ensure_ray(None)

    def stop() -> None:
        if started:
            shutdown_ray()

    _SHARED["ray_runtime"] = stop
    try:
        yield
    finally:
        if _SHARED.pop("ray_runtime", None) is not None:
            stop()


@pytest.fixture(scope="session")
def engine_pool(ray_runtime):
    """The shared `EngineSession` (pass it as `train(..., session=engine_pool)`); `discard()` it
    where a test needs fresh engines."""
    import io

    from rich.console import Console

    from stapoctl.trainer.session import EngineSession

    # its own lines ("starting new engines: <what differs>") recorded: `engine_pool.console.export_text()`
    session = EngineSession(Console(file=io.StringIO(), width=200, record=True))
    _SHARED["engine_pool"] = session.close
    try:
        yield session
    finally:
        _SHARED.pop("engine_pool", None)
        session.close()


def _uses(item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items) -> None:
    """The tests of a shared resource one after another, at the end: the Ray head's, then those on
    the shared local Ray (hand-built actors), then the pool's module by module in POOL_ORDER; the
    rest keep their order (a stable sort), first."""
    pooled = {Path(str(item.fspath)).name for item in items if _uses(item, "engine_pool")}
    unknown = sorted(pooled - set(POOL_ORDER))
    if unknown:
        raise pytest.UsageError(f"{', '.join(unknown)} use engine_pool: add them to tests/conftest.py POOL_ORDER "
                                "beside the modules whose engine key they share")
    rank = {name: i for i, name in enumerate(POOL_ORDER)}

    def key(item) -> tuple[int, int]:
        if _uses(item, "engine_pool"):
            return 3, rank[Path(str(item.fspath)).name]
        if _uses(item, "ray_runtime"):
            return 2, 0
        return (1, 0) if _uses(item, "ray_head") else (0, 0)

    items.sort(key=key)


_LAST_USER: dict[str, str] = {}  # fixture → node id of the last test that uses it, in the final order


def pytest_collection_finish(session) -> None:
    """After every reordering (this file's, and `--ff`/`--nf`'s, which may come after it)."""
    _LAST_USER.clear()
    for item in session.items:
        for fixture in ("ray_head", "ray_runtime", "engine_pool"):
            if _uses(item, fixture):
                _LAST_USER[fixture] = item.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A shared resource stops once its group is over: after the last test that uses it and its
    module's fixtures (their actors) are torn down. Under pytest-xdist a worker runs a part of the
    order: its shared resources end with its session."""
    try:
        return (yield)
    finally:
        if nextitem is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
            for fixture, stop in list(_SHARED.items()):
                if _LAST_USER.get(fixture) == item.nodeid:
                    _SHARED.pop(fixture, None)
                    stop()


# -- where the suite's time goes ---------------------------------------------------------------------
# Per module: setup + call + teardown of its tests, summed (module fixtures' engine starts included),
# printed after the run so the suite's budget (README: well under 30 minutes) is kept per file.
_MODULE_SECONDS: dict[str, float] = {}
SUMMARY_LINES: dict[str, str] = {}  # name → a line a module adds to the end of the summary


# Every engine start too, wherever its driver runs (this process, a `stapoctl train` child, a Ray
# or SLURM job): STAPOCTL_TEST_ENGINE_LOG names a file that `EngineLaunch.ready` appends its
# `engines.info` to (stapoctl/launch/engine_log.py); set here for the whole session, so child
# processes inherit it and jobs/ forwards it. `<log>.current` holds the running test's node id.
# Under pytest-xdist (README's fast tier, `-n 2`) each worker imports this file too: it writes a file
# of its own (its own `.current` beside it) in the folder of the controller, which made it before
# starting the workers (they inherit the variable), prints every file's starts and removes the folder.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER") if os.environ.get("STAPOCTL_TEST_ENGINE_LOG") else None
if _XDIST_WORKER:
    _ENGINE_LOG = Path(os.environ["STAPOCTL_TEST_ENGINE_LOG"]).with_name(f"starts-{_XDIST_WORKER}.jsonl")
else:
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
    from stapoctl.launch import engine_log

    engine_log.record_actors("fixture", t0, workers, setup_refs)


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
    starts = [s for log in sorted(_ENGINE_LOG.parent.glob("starts*.jsonl")) for s in engine_starts(log)]
    terminalreporter.section("engine starts (this process, subprocesses, Ray and SLURM jobs)")
    if starts:
        terminalreporter.write_line(" ".join(f"{p:>15}" for p in _PHASES) + "  kind          pid  module")
    for s in sorted(starts, key=lambda s: s.get("time", 0.0)):
        phases = " ".join(f"{float(s.get(p, 0.0)):15.1f}" for p in _PHASES)
        where = "this process" if s.get("pid") == os.getpid() else "child"
        why = f"  [{s['reason'][:70]}]" if s.get("reason") else ""
        terminalreporter.write_line(f"{phases}  {s.get('kind', 'train'):<8} {s.get('pid', 0):>8}  "
                                    f"{s.get('module') or '?'} ({where}){why}")
    seconds = sum(float(s.get("engines_s", 0.0)) for s in starts)
    terminalreporter.write_line(f"{len(starts)} engine starts, {seconds:.0f} s")
    for line in SUMMARY_LINES.values():  # a module's own summary (tests/test_config_matrix.py)
        terminalreporter.write_line(line)


def pytest_unconfigure(config) -> None:
    if not _XDIST_WORKER:  # the controller's folder: it prints the workers' starts after they end
        shutil.rmtree(_ENGINE_LOG.parent, ignore_errors=True)
