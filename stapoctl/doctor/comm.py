"""GPUs per node against what the run asks, and an all-reduce between two ranks over the
learner's backend: gloo on CPU (two processes, torch.distributed, the sum checked); on a node
with two GPUs or more, torch's NCCL and then vLLM's own NCCL communicator (`pynccl`, as vLLM's
troubleshooting script does). The rows that need CUDA are N/A without it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Optional

from omegaconf import DictConfig

from stapoctl.doctor.rows import Row, failed, not_applicable, passed
from stapoctl.errors import UserError

WORLD = 2
_ANSWER = "STAPOCTL-DOCTOR-RANK "
TIMEOUT_S = 120.0


# -- GPUs per node -------------------------------------------------------------------------------
def gpus_needed(conf: DictConfig) -> tuple[float, str]:
    """(GPUs the run asks in all, how: 'learner 2 × 1 + rollout 2 × 1'), as its placement asks them."""
    from stapoctl.launch.placement import role_plans, total_need

    plans = role_plans(conf.rollout, conf.learner)
    need = total_need(plans).get("GPU", 0.0)
    parts = [f"{p.role} {p.count} × {p.bundle.get('GPU', 0):g}" for p in plans if p.bundle.get("GPU", 0) > 0]
    if conf.reward.get("model_verifier") and float(conf.reward.model_verifier_gpus or 0) > 0:
        need += float(conf.reward.model_verifier_gpus)
        parts.append(f"verifier {float(conf.reward.model_verifier_gpus):g}")
    return need, " + ".join(parts)


def gpu_row(conf: DictConfig, have: int, device: str = "", cluster_gpus: Optional[float] = None) -> Row:
    """What the run asks (learner.num_ranks × gpus_per_rank + rollout workers × gpus_per_worker)
    against this node's GPUs and, under SLURM, cluster.gpus_per_node × cluster.nodes; on a Ray
    cluster (`cluster_gpus`: its GPUs, all nodes) against the cluster's (issue #49 BUG-2: the run
    spans its nodes, and the node the checks run on may have none)."""
    need, how = gpus_needed(conf)
    c = conf.cluster
    if cluster_gpus is not None and c.name != "slurm":
        if need > cluster_gpus:
            return failed("GPUs", f"the run asks {need:g} GPU(s) ({how}) and the Ray cluster has {cluster_gpus:g}",
                          "lower learner.num_ranks / rollout.num_workers, or add GPU nodes to the Ray cluster")
        return passed("GPUs", f"the Ray cluster has {cluster_gpus:g} GPU(s); the run asks {need:g}"
                      + (f" ({how})" if need else " (a CPU run)"))
    on_slurm = c.name == "slurm"
    if have == 0:
        if need == 0:
            return not_applicable("GPUs", "no CUDA device here; the run asks none (a CPU run)")
        return failed("GPUs", f"the run asks {need:g} GPU(s) ({how}) and torch sees no CUDA device here",
                      "run where the GPUs are (cluster=slurm), or set rollout.gpus_per_worker=0 "
                      "learner.gpus_per_rank=0 for a CPU run")
    per_node = int(c.gpus_per_node) if on_slurm else have
    nodes = int(c.nodes) if on_slurm else 1
    here = f"{have} × {device}" if device else f"{have} GPU(s)"
    if on_slurm and have < per_node:
        return failed("GPUs", f"cluster.gpus_per_node={per_node} but this node has {here}",
                      f"set cluster.gpus_per_node={have} (or fix the preset cluster/slurm/{c.preset or '<site>'}.yaml)")
    if need > per_node * nodes:
        where = f"{nodes} node(s) × {per_node}" if on_slurm else f"this node's {have}"
        return failed("GPUs", f"the run asks {need:g} GPU(s) ({how}) and has {where}",
                      "lower learner.num_ranks / rollout.num_workers, or raise cluster.nodes")
    asks = f"the run asks {need:g} ({how})" if need else "the run asks none (a CPU run)"
    return passed("GPUs", f"{here} per node" + (f" (cluster.gpus_per_node={per_node}, {nodes} node(s))"
                                                 if on_slurm else "") + f"; {asks}")


def check_gpus(conf: DictConfig) -> Row:
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpu_row(conf, have, torch.cuda.get_device_name(0) if have else "", ray_cluster_gpus(conf))


def ray_cluster_gpus(conf: DictConfig) -> Optional[float]:
    """The GPUs of the Ray cluster the run joins (`cluster.address`), all its nodes; None off one."""
    if not conf.cluster.get("address"):
        return None
    import ray

    from stapoctl.launch.ray_runtime import ensure_ray

    ensure_ray(conf.cluster)
    return float(ray.cluster_resources().get("GPU", 0.0))


# -- the all-reduce ------------------------------------------------------------------------------
def rendezvous_address(conf: Any = None) -> tuple[str, dict[str, str]]:
    """Where the doctor's ranks meet, and their interface variables: the address of
    `cluster.socket_ifname` (what NCCL and gloo bind in a multi-node run), else 127.0.0.1 — a node
    whose multi-node interface is not named is checked on loopback only, and the row says so."""
    from stapoctl.config.validate import PLAIN_IFNAME
    from stapoctl.launch.ray_runtime import interface_env

    env = interface_env(getattr(conf, "cluster", None))
    # one interface named plainly; a site's NCCL pattern (`^lo,docker0`, a prefix list) names no address
    name = next((v for v in (env.get("GLOO_SOCKET_IFNAME"), env.get("NCCL_SOCKET_IFNAME"))
                 if v and PLAIN_IFNAME.fullmatch(v)), None)
    if not name:
        return "127.0.0.1", env
    import psutil

    addrs = psutil.net_if_addrs().get(name, [])
    ipv4 = next((a.address for a in addrs if a.family == socket.AF_INET), None)
    if ipv4 is None:
        raise UserError(f"cluster.socket_ifname={name}: no interface of that name with an IPv4 address on this node "
                        f"(it has {', '.join(sorted(psutil.net_if_addrs()))}): name one of them")
    return ipv4, env


def _rank_main(rank: int, world: int, port: int, backend: str, host: str = "127.0.0.1") -> tuple[dict, Optional[str]]:
    """One rank (its own process): rank r contributes r + 1; (stage → mean result, error)."""
    try:
        import torch
        import torch.distributed as dist

        from stapoctl.learner import rendezvous

        store = rendezvous.connect(host, port, world, TIMEOUT_S / 2)  # the parent's (`run_ranks`)
        rendezvous.init_default_group("gloo" if backend == "gloo" else "nccl", store, rank, world, TIMEOUT_S / 2)
        results: dict[str, Any] = {}
        if backend == "gloo":
            t = torch.full((128,), float(rank + 1))
            dist.all_reduce(t)
            results["gloo"] = float(t.mean())
        else:
            results.update(_nccl_stages(rank, world))
        dist.destroy_process_group()
        return results, None
    except Exception as exc:
        return {}, f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def _nccl_stages(rank: int, world: int) -> dict[str, Any]:
    """torch's NCCL all-reduce, then vLLM's PyNcclCommunicator on a gloo group of the same ranks."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    t = torch.full((128,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    results: dict[str, Any] = {"nccl": float(t.mean())}
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        gloo = dist.new_group(ranks=list(range(world)), backend="gloo")
        comm = PyNcclCommunicator(group=gloo, device=rank)
        data = torch.full((128,), float(rank + 1), device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            reduced = comm.all_reduce(data, stream=stream)
        stream.synchronize()
        results["pynccl"] = float((reduced if reduced is not None else data).mean())
    except Exception as exc:
        results["pynccl"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    return results


def _answer(proc: subprocess.Popen, rank: int, timeout_s: float) -> tuple[dict, Optional[str]]:
    """A rank's (results, error) from the last line of its stdout."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {}, f"no answer within {timeout_s:.0f} s"
    lines = [line for line in out.splitlines() if line.startswith(_ANSWER)]
    if not lines:
        last = (err.strip().splitlines() or [f"exit code {proc.returncode}"])[-1][:200]
        return {}, f"died: {last}"
    results, error = json.loads(lines[-1][len(_ANSWER):])
    return results, error


def run_ranks(backend: str, world: int = WORLD, timeout_s: float = TIMEOUT_S, host: str = "127.0.0.1",
              env: Optional[dict] = None) -> dict[int, tuple[dict, Optional[str]]]:
    """rank → (stage → mean, error) of `world` ranks, each its own `python -m stapoctl.doctor.comm`
    (not multiprocessing's spawn, which re-runs the parent's main script: a Ray or SLURM job's).
    Their store listens here before they are started, on a port the OS picks at `host`: a port
    found free and bound later by rank 0, after its imports, may be taken meanwhile."""
    from stapoctl.learner import rendezvous

    store = rendezvous.listen(host, world, timeout_s)
    procs = [subprocess.Popen([sys.executable, "-m", "stapoctl.doctor.comm", str(r), str(world), str(store.port),
                               backend, host], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **(env or {})}) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    answers = {r: _answer(p, r, max(1.0, deadline - time.monotonic())) for r, p in enumerate(procs)}
    del store  # held until every rank answered
    return answers


def stage_row(check: str, stage: str, got: dict[int, tuple[dict, Optional[str]]], fix: str,
              world: int = WORLD) -> Row:
    """PASS when every rank's result of `stage` is the sum 1 + … + world."""
    want = world * (world + 1) / 2
    errors = [f"rank {r}: {err}" for r, (_, err) in sorted(got.items()) if err]
    if errors:
        return failed(check, "; ".join(errors), fix)
    values = [res.get(stage) for _, (res, _) in sorted(got.items())]
    bad = [v for v in values if not isinstance(v, float) or abs(v - want) > 1e-6]
    if bad:
        return failed(check, f"{world} ranks summed to {values} (expected {want:g})", fix)
    return passed(check, f"{world} ranks, sum {want:g} on every rank")


GLOO_FIX = ("check that 127.0.0.1 ports are free and not firewalled (GLOO_SOCKET_IFNAME names the interface "
            "on a multi-homed node)")
NCCL_FIX = "run with NCCL_DEBUG=INFO to see the transport that fails; check the driver and NCCL_SOCKET_IFNAME"


def allreduce_rows(conf: DictConfig) -> list[Row]:
    import torch

    rows: list[Row] = []
    host, env = rendezvous_address(conf)
    if float(conf.learner.gpus_per_rank or 0) > 0:
        rows.append(not_applicable("all-reduce gloo", "the learner runs on GPUs: NCCL below"))
    else:
        rows.append(_on(stage_row("all-reduce gloo", "gloo", run_ranks("gloo", host=host, env=env), GLOO_FIX), host))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < WORLD:
        why = "no CUDA device here" if gpus == 0 else "one GPU here: two ranks need two GPUs"
        return rows + [not_applicable("all-reduce NCCL", why), not_applicable("all-reduce vLLM pynccl", why)]
    got = run_ranks("nccl", host=host, env=env)
    rows.append(_on(stage_row("all-reduce NCCL", "nccl", got, NCCL_FIX), host))
    rows.append(stage_row("all-reduce vLLM pynccl", "pynccl", got,
                          "vLLM's NCCL library differs from torch's: set VLLM_NCCL_SO_PATH to torch's libnccl"))
    return rows


def _on(row: Row, host: str) -> Row:
    """The row's detail says where the ranks met (loopback checks no multi-node interface)."""
    where = (f"on {host} (cluster.socket_ifname's address)" if host != "127.0.0.1" else
             "on 127.0.0.1 (loopback only: set cluster.socket_ifname to check the interface a multi-node run uses)")
    return Row(row.check, row.status, f"{row.detail}; {where}", row.fix)


if __name__ == "__main__":  # one rank of `run_ranks`
    _rank, _world, _port, _backend = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    _host = sys.argv[5] if len(sys.argv) > 5 else "127.0.0.1"
    print(_ANSWER + json.dumps(_rank_main(_rank, _world, _port, _backend, _host)), flush=True)
