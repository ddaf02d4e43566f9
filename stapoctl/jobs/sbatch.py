"""Shell lines that go into a SLURM job's sbatch script before submitit runs the driver: the job's
environment, written out explicitly, and for multi-node allocations the Ray-on-SLURM bootstrap.

Multi-node (the pattern of Ray's SLURM guide): a Ray head on the first node of the allocation,
one Ray worker on every other node (each an `srun` step in the background, `--block` so SLURM
owns their lifetime), then the driver joins the head at $STAPOCTL_RAY_ADDRESS and Ray places
the rollout and learner actors across the nodes. Untested on real multi-node hardware: on this
project's machine only single-node allocations run; a test checks the script's structure.
"""

from __future__ import annotations

import shlex
from typing import Mapping

RAY_ADDRESS_ENV = "STAPOCTL_RAY_ADDRESS"  # read by the job body (jobs/slurm.py) → cluster.address


def env_lines(env: Mapping[str, str], pythonpath: str | None) -> list[str]:
    """`export` lines for the job; PYTHONPATH keeps whatever the site's setup lines put there."""
    lines = [f"export {key}={shlex.quote(str(value))}" for key, value in env.items()]
    if pythonpath:
        lines.append(f"export PYTHONPATH={shlex.quote(pythonpath)}${{PYTHONPATH:+:$PYTHONPATH}}")
    return lines


def head_ip_command(ifname: str | None) -> str:
    """The head's address as the other nodes reach it: `cluster.socket_ifname`'s IPv4 address when set
    (the interface NCCL and gloo use), else the first of `hostname -I` — never a loopback address
    (`hostname --ip-address` can give 127.0.1.1 from /etc/hosts: #49 R2)."""
    if ifname:
        return f"ip -4 -o addr show dev {shlex.quote(ifname)} | awk '{{print $4}}' | cut -d/ -f1 | head -n1"
    return "hostname -I | tr ' ' '\\n' | grep -v '^127\\.' | head -n1"


def ray_bootstrap_lines(python: str, nodes: int, gpus_per_node: int, port: int, ifname: str | None = None,
                        join_timeout_s: int = 300) -> list[str]:
    """Start Ray across the allocation's nodes, wait (bounded) until every node joined with its GPUs,
    and export its address for the driver."""
    ray = f"{python} -m ray.scripts.scripts"
    step = "srun --nodes=1 --ntasks=1 --overlap"
    gpus = f" --num-gpus={gpus_per_node}" if gpus_per_node else " --num-gpus=0"
    return [
        f"# Ray on SLURM: head on the first of {nodes} nodes, a worker on each other node, then the driver",
        "# (the standard pattern; untested on real multi-node hardware)",
        'ray_nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        'ray_head=${ray_nodes[0]}',
        f'ray_head_ip=$({step} -w "$ray_head" bash -c {shlex.quote(head_ip_command(ifname))})',
        f'export {RAY_ADDRESS_ENV}="$ray_head_ip:{port}"',
        f'{step} -w "$ray_head" {ray} start --head --block --node-ip-address="$ray_head_ip" --port={port} '
        f'--dashboard-host=127.0.0.1 --num-cpus="$SLURM_CPUS_PER_TASK"{gpus} &',
        f'for _ in $(seq 90); do {ray} status --address="${RAY_ADDRESS_ENV}" >/dev/null 2>&1 && break; sleep 2; done',
        'for ray_node in "${ray_nodes[@]:1}"; do',
        f'    {step} -w "$ray_node" {ray} start --block --address="${RAY_ADDRESS_ENV}" '
        f'--num-cpus="$SLURM_CPUS_PER_TASK"{gpus} &',
        "done",
        f'{python} -m stapoctl.jobs.ray_nodes --address="${RAY_ADDRESS_ENV}" --gpus-per-node={gpus_per_node} '
        f'--timeout-s={int(join_timeout_s)} "${{ray_nodes[@]}}" || exit 1',
    ]
