"""The Ray runtime every engine actor lives in: started once per process, quiet, and with the
package importable inside actors (vLLM loads our worker extension by its dotted name there).

Local runs use `address="local"` on purpose: a bare `ray.init()` would attach to whatever
cluster another user on the same machine started last (/tmp/ray/ray_current_cluster).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from stapoctl import paths
from stapoctl.errors import UserError

# Environment every engine actor gets, whatever the machine: small, quiet, deterministic.
_BASE_ACTOR_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CONFIGURE_LOGGING": "1",
    "RAY_DEDUP_LOGS": "1",
    "PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning,ignore::UserWarning",
    # Ray runs every worker process at niceness 15 unless its environment says otherwise (Ray's own
    # job supervisor sets 0 for a job's driver the same way). An engine actor at 15 got a few percent
    # of a core against anything at 0 beside it: the driver's set-up thread, Ray's own agents, a
    # verifier subprocess, another program. The engine actors are the run's critical path, so they
    # run at the driver's priority (docs/PERFORMANCE.md, "Start-up phase table").
    "RAY_worker_niceness": "0",
}


def _package_root() -> str:
    return str(Path(__file__).resolve().parent.parent.parent)


INTERFACE_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def interface_env(cluster_cfg: Any = None) -> dict[str, str]:
    """NCCL's and gloo's interface for every process of the run: `cluster.socket_ifname`, else what the
    driver's environment exports (forwarded explicitly: an actor on another node, or a SLURM job,
    does not inherit the driver's shell)."""
    name = getattr(cluster_cfg, "socket_ifname", None) if cluster_cfg is not None else None
    if name:
        return {key: str(name) for key in INTERFACE_VARS}
    return {key: os.environ[key] for key in INTERFACE_VARS if os.environ.get(key)}


def actor_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """env_vars for an actor's runtime_env: the package on PYTHONPATH plus engine settings.

    An editable install already makes the package importable; the PYTHONPATH entry covers a
    plain checkout (and costs nothing otherwise).
    """
    env = dict(_BASE_ACTOR_ENV)
    pythonpath = [_package_root()]
    if os.environ.get("PYTHONPATH"):
        pythonpath.append(os.environ["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(pythonpath))
    # STAPOCTL_HOME must agree between driver and actors (extension cache, models).
    env["STAPOCTL_HOME"] = str(paths.home())
    # STAPOCTL_TEST_SYNC_DELAY_S: a test hook (seconds a rollout actor waits inside a weight update,
    # between vLLM's start and receive: tests/test_weight_transport.py makes a rollout race it)
    # STAPOCTL_TEST_CORRUPT_PUSH: a test hook (rollout/vllm_worker.py: one actor's loaded weights corrupted)
    for key in ("HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "OMP_NUM_THREADS", "STAPOCTL_TEST_SYNC_DELAY_S",
                "STAPOCTL_TEST_CORRUPT_PUSH", *INTERFACE_VARS):
        if key in os.environ:
            env[key] = os.environ[key]
    from stapoctl.launch import mkl_shim

    env.update(mkl_shim.preload_env())  # MKL's AVX-512 kernels on AMD; {} elsewhere
    if extra:
        env.update(extra)
    return env


def ensure_ray(cluster_cfg: Any = None, *, log_to_driver: bool = False) -> bool:
    """Idempotent `ray.init`: a fresh local instance sized to this machine, or `cluster.address`.

    Returns True when this call started (or connected) Ray, so the caller knows whether the
    shutdown is its to do.
    """
    import ray

    from stapoctl.launch import mkl_shim

    address = getattr(cluster_cfg, "address", None) if cluster_cfg is not None else None
    if cluster_cfg is not None:  # None (e.g. the model verifier joining the run's Ray) keeps the run's choice
        mkl_shim.configure(str(getattr(cluster_cfg, "mkl_amd_shim", None) or "auto"), remote=bool(address))
        os.environ.update(interface_env(cluster_cfg))  # forwarded to every actor by actor_env
    if ray.is_initialized():
        return False
    num_cpus = getattr(cluster_cfg, "num_cpus", None) if cluster_cfg is not None else None
    num_gpus = getattr(cluster_cfg, "num_gpus", None) if cluster_cfg is not None else None
    kwargs: dict[str, Any] = dict(
        include_dashboard=False,
        log_to_driver=log_to_driver,
        logging_level="WARNING",
        configure_logging=True,
        ignore_reinit_error=True,
    )
    if address:
        # A remote cluster may not see this checkout: ship the package with the job.
        kwargs["address"] = address
        kwargs["runtime_env"] = {
            "py_modules": [str(Path(__file__).resolve().parent.parent)],
            "env_vars": {k: v for k, v in actor_env().items() if k not in ("PYTHONPATH", "STAPOCTL_HOME", "LD_PRELOAD")},
        }
    else:
        kwargs["address"] = "local"
        kwargs["num_cpus"] = int(num_cpus or len(os.sched_getaffinity(0)) or 1)
        if num_gpus is not None:
            kwargs["num_gpus"] = int(num_gpus)
        kwargs["runtime_env"] = {"env_vars": actor_env()}
        # Ray starts one idle worker per CPU for the first driver. Every engine actor has its own
        # runtime env, so none of them can take one: they only compete with the actors' imports
        # for the cores (engines up 9.2-9.5 -> 8.7-8.8 s here, `benchmarks/_startup.py`).
        kwargs["_system_config"] = {"prestart_worker_first_driver": False}
        # Keep Ray's own spill/log files out of the user's cwd and small.
        kwargs["object_store_memory"] = _object_store_bytes()
    _quiet_token_auth_notice()
    try:
        ray.init(**kwargs)
        return True
    except ConnectionError as exc:
        raise UserError(
            f"cluster.address={address!r}: cannot connect to a Ray cluster there ({exc}); "
            "check the address or drop cluster.address to run locally"
        ) from exc


class _DropTokenAuthNotice:
    """Drops Ray's "Token authentication is enabled ..." notice; every other record passes."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Token authentication is enabled")


def _quiet_token_auth_notice() -> None:
    """Ray >= 2.5x announces at every `ray.init` that it turned token authentication on (README
    "Ray authentication"): auth stays on, only the notice is dropped, once per process."""
    import logging

    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropTokenAuthNotice) for f in logger.filters):
        logger.addFilter(_DropTokenAuthNotice())


def _object_store_bytes() -> int:
    """A modest object store: rollouts and state dicts of small models fit in 512 MiB-2 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return int(min(max(total // 10, 512 << 20), 4 << 30))


def shutdown_ray() -> None:
    """Stop the Ray instance this process started (actors must shut their engines down first)."""
    import ray

    if ray.is_initialized():
        _stop_autoscaler_monitor()
        ray.shutdown()


def _stop_autoscaler_monitor() -> None:
    """Kill the autoscaler monitor of a Ray instance this process started, before `ray.shutdown`.

    `ray.shutdown` stops its processes one after another, each given 1 s to exit on SIGTERM; the
    monitor (which autoscales nothing on a local instance) always used the whole second. Killed
    first, the shutdown took 0.34 s instead of 1.36 s here. Only a child of this process is
    touched: when the driver joined an existing cluster, its monitor is not ours and stays.
    """
    try:
        import psutil

        monitor = "ray/autoscaler/_private/monitor.py"
        for child in psutil.Process().children():
            try:
                if any(arg.replace(os.sep, "/").endswith(monitor) for arg in child.cmdline()):
                    child.kill()
            except psutil.Error:
                continue
    except Exception:  # a slower shutdown, never a failed one
        pass


def runtime_context():
    """Ray's runtime context inside a Ray process, else None.

    `ray.get_runtime_context()` outside Ray starts a whole local instance (~5-10 s and a stray
    Ray left running); engines built directly in a test or a benchmark must not pay that. A
    process that has not imported ray is in no Ray (a GPU node may run a learner without it).
    """
    if "ray" not in sys.modules:
        return None
    import ray

    return ray.get_runtime_context() if ray.is_initialized() else None


def node_address(node_id: str) -> str:
    """A Ray node's IP address (what a person can ssh to), or its id where Ray does not say."""
    try:
        import ray

        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                return str(node.get("NodeManagerAddress") or node_id[:12])
    except Exception:
        pass
    return node_id[:12]


def process_start() -> float:
    """When this process started, epoch seconds (0 where it cannot be read). A Ray actor's process is
    spawned when the actor is created: its start minus the creation is Ray's spawn time. On Linux
    from the process's start tick and the uptime, both to 10 ms (psutil's `create_time` adds the
    boot time, which /proc/stat rounds to the second); elsewhere psutil's."""
    import time

    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, after "(comm)"
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return 0.0


def in_ray_actor() -> bool:
    """True inside a Ray actor's process (an engine actor), False in a driver or a test process."""
    ctx = runtime_context()
    return bool(ctx is not None and ctx.get_actor_id())


# (phase, mark it starts at, mark it ends at, whose marks): `startup_phases`' table. Driver marks are
# `trainer.engines.EngineLaunch.marks`; "rollout" and "learner" ones the slowest vLLM actor's and learner rank's own.
STARTUP_PHASES = (
    ("ray.init", ("driver", "launch"), ("driver", "ray_up")),
    ("placement groups", ("driver", "ray_up"), ("driver", "placement_ready")),
    ("vLLM actor: process spawn", ("driver", "placement_ready"), ("rollout", "spawned")),
    ("vLLM actor: spawn → constructor (Ray worker start)", ("rollout", "spawned"), ("rollout", "constructor")),
    ("vLLM actor: import vLLM", ("rollout", "constructor"), ("rollout", "vllm_imported")),
    ("vLLM actor: engine init", ("rollout", "vllm_imported"), ("rollout", "engine_built")),
    ("learner: process up (rendezvous answered)", ("driver", "rollout_created"), ("driver", "learner_setup_sent")),
    ("learner: setup call arrives", ("driver", "learner_setup_sent"), ("learner", "setup_called")),
    ("learner: imports (torch, transformers)", ("learner", "setup_called"), ("learner", "imports")),
    ("learner: DeepSpeed import + process group", ("learner", "imports"), ("learner", "process_group")),
    ("learner: model, optimizer, deepspeed.initialize", ("learner", "process_group"), ("learner", "engine_built")),
    ("learner: first forward", ("learner", "engine_built"), ("learner", "first_forward")),
    ("weight-sync link", ("driver", "actors_up"), ("driver", "sync_linked")),
)


def startup_phases(marks: dict, worker_info: list, learner_info: list) -> dict:
    """The engines' start-up as phases: {phase: [start, end]} in seconds since `launch_engines` began
    (`trainer.engines`' `info["startup"]`; `python benchmarks/_startup.py --whole` prints it as a table). The
    vLLM actor and the learner rank that came up last stand for their role."""
    t0 = float(marks.get("launch") or 0.0)
    sides = {"driver": marks,
             "rollout": max((w.get("startup") or {} for w in worker_info), key=lambda m: m.get("engine_built", 0), default={}),
             "learner": max((x.get("startup") or {} for x in learner_info), key=lambda m: m.get("first_forward", 0), default={})}
    out = {}
    for name, (side_a, key_a), (side_b, key_b) in STARTUP_PHASES:
        a, b = sides[side_a].get(key_a), sides[side_b].get(key_b)
        if a and b and t0:
            out[name] = [round(float(a) - t0, 3), round(float(b) - t0, 3)]
    return out
