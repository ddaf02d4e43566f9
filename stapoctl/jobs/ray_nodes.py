"""`python -m stapoctl.jobs.ray_nodes`: in a multi-node SLURM job, wait until every node of the
allocation has joined the job's Ray with its GPUs, before the driver starts (#49 R2). Without it the
driver's placement check could run while node 2's Ray is still starting and refuse the run at
once, with a resource-count fix that is wrong. Bounded: after `--timeout-s` one line names the
hosts that did not join, exit 1 (the sbatch script then stops before the driver)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence


def missing(alive: Sequence[dict], hosts: Sequence[str], gpus_per_node: float) -> list[str]:
    """The hosts of `hosts` without an alive Ray node that has `gpus_per_node` GPUs (`alive`: ray.nodes())."""
    joined = {}
    for node in alive:
        if node.get("Alive"):
            name = str(node.get("NodeManagerHostname") or "").split(".")[0]
            joined[name] = float((node.get("Resources") or {}).get("GPU", 0.0))
    return [h for h in hosts if joined.get(h.split(".")[0], -1.0) < float(gpus_per_node)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stapoctl.jobs.ray_nodes")
    parser.add_argument("--address", required=True)
    parser.add_argument("--gpus-per-node", type=float, default=0.0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("hosts", nargs="+")
    args = parser.parse_args(argv)
    import ray

    deadline = time.monotonic() + args.timeout_s
    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    try:
        while True:
            lost = missing(ray.nodes(), args.hosts, args.gpus_per_node)
            if not lost:
                print(f"stapoctl: all {len(args.hosts)} node(s) joined Ray at {args.address}", flush=True)
                return 0
            if time.monotonic() > deadline:
                print(f"stapoctl: node(s) {', '.join(lost)} did not join Ray at {args.address} with "
                      f"{args.gpus_per_node:g} GPU(s) within {args.timeout_s:.0f} s: see their `ray start` "
                      "output in this job's log (a wrong cluster.socket_ifname, a firewall, a GPU missing)",
                      file=sys.stderr, flush=True)
                return 1
            time.sleep(2.0)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
