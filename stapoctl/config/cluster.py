"""The `cluster` group: where a run executes (here, a Ray cluster, SLURM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from stapoctl.config.fields import spec
from stapoctl.config.ranges import NON_NEGATIVE, POSITIVE, POSITIVE_INT


@dataclass
class ClusterConfig:
    """Where a run executes. `stapoctl train` runs here (local, or joins cluster.address);
    `stapoctl submit cluster=ray|slurm` sends the same run to a Ray cluster's job server or to
    SLURM. SLURM values usually come from a site preset (cluster/slurm/<preset>.yaml); values
    given on the command line win over the preset's."""

    name: str = spec("local", choices=("local", "ray", "slurm"))
    # train: the Ray cluster to join (auto, HOST:PORT, ray://HOST:10001);
    # submit cluster=ray: the job server, http://HOST:8265 (the dashboard's address)
    address: Optional[str] = None
    num_cpus: Optional[int] = spec(None, range=POSITIVE_INT)
    num_gpus: Optional[int] = spec(None, range=NON_NEGATIVE)
    # MKL's AVX-512 kernels for torch on AMD CPUs (launch/mkl_shim.py: a one-line library preloaded into the
    # engine actors; the learner's update at 25M took 1.9 s instead of 3.5 s here). auto: local Ray on an AMD
    # CPU with a C compiler; on: also on a remote Ray cluster (its nodes must see STAPOCTL_HOME); off: never
    mkl_amd_shim: str = spec("auto", choices=("auto", "on", "off"))
    # how long a run waits for busy resources before it gives up (an impossible placement fails at once)
    placement_timeout_s: float = spec(60.0, range=POSITIVE)
    # the network interface NCCL and gloo bind on every node (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME in
    # every engine actor and SLURM job; `doctor` runs its all-reduce on its address): a multi-homed
    # node's wrong pick hangs a multi-node run's first rendezvous. null: the environment's, if exported
    socket_ifname: Optional[str] = None
    # interpreter with stapoctl's dependencies on the cluster's nodes (default: this one,
    # sys.executable, right when the nodes share this filesystem); "python" on a Ray cluster
    # whose nodes have their own environment
    python: Optional[str] = None
    # Ray jobs: how the code reaches the cluster. path: PYTHONPATH to this checkout (same
    # machine or shared filesystem, nothing uploaded); upload: the checkout as working_dir;
    # auto: path for a loopback address, else upload
    ship_code: str = spec("auto", choices=("auto", "path", "upload"))
    # SLURM (submitit)
    preset: Optional[str] = None  # a site preset: cluster/slurm/<preset>.yaml
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    nodes: int = 1  # > 1: a Ray head on the first node, Ray workers on the others
    gpus_per_node: int = 8
    # one GPU's memory in GiB (2**30 bytes, as torch reports total_memory) for the memory plan where no GPU is
    # visible (a login node, `plan`/`submit` for a cluster; SLURM presets set it). An 80 GB H100 shows
    # ≈79.6 GiB: say 79. Where the run executes and sees a card (train, its job, doctor) the card wins
    gpu_mem_gb: float = spec(80.0, range=POSITIVE)
    cpus_per_task: int = 16  # one task per node: the driver (1 node) or a Ray node
    mem_gb: Optional[float] = None  # per node; None: the site's default
    timeout_min: int = 60 * 24
    setup: List[str] = field(default_factory=list)  # shell lines before the job: module load, conda activate
    array_parallelism: int = 16  # sweeps as job arrays: trials running at once
    max_requeues: int = 3  # timeouts/preemptions a job may be requeued after (then it fails)
    ray_port: int = 6379  # the Ray head's port inside a multi-node allocation
    log_dir: Optional[str] = None  # submitit's folder (job scripts, logs); default STAPOCTL_HOME/jobs/<id>
