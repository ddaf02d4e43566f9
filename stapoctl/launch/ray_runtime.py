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


def in_ray_actor() -> bool:
    """True inside a Ray actor's process (an engine actor), False in a driver or a test process."""
    ctx = runtime_context()
    return bool(ctx is not None and ctx.get_actor_id())
