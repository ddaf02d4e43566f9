"""The doctor's fast checks of what a run reads and writes, reusing the preflight checks that
`stapoctl train` runs (each raises one `UserError` line with its fix): the config, the model and
its tokenizer, the datasets (resolvable offline: `preflight.hub`), the MLflow store (reachable and
writable: a run created, a metric logged and read back, the run deleted), the checkpoints' disk,
and SLURM (partition and account) when the run is for SLURM."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from stapoctl.doctor.rows import Row, failed, from_error, not_applicable, passed

DOCTOR_EXPERIMENT = "stapoctl-doctor"
MODEL_FIX = ("set model.path to a local model dir (config.json, weights, tokenizer) or a hub id that is in "
             "the Hugging Face cache")
DATA_FIX = "run `stapoctl data prep NAME` (or point data.source / data.root at the files)"
MLFLOW_FIX = "start the MLflow server, or point tracking.uri / MLFLOW_TRACKING_URI at a reachable, writable store"
DISK_FIX = "free space, or write elsewhere (trainer.output_dir=… or STAPOCTL_HOME)"


def check_config(conf: DictConfig) -> Row:
    from stapoctl.config.validate import validate_config

    validate_config(conf)
    return passed("config", f"experiment={conf.experiment} loss={conf.loss.name} model={conf.model.path or 'tiny'} "
                            f"cluster={conf.cluster.name}")


def check_model(conf: DictConfig) -> tuple[Row, Optional[str]]:
    """(the row, the model dir or hub id the engines load; None when it does not resolve)."""
    from stapoctl.models.resolve import resolve_model
    from stapoctl.preflight.hub import check_hub_model
    from stapoctl.preflight.model import check_model as preflight_model

    spec = str(conf.model.path or "")
    try:
        check_hub_model(spec, "model.path")
        path = str(resolve_model(spec, conf))  # "" builds (or finds) the embedded tiny model
        preflight_model(conf, spec or path, "model.path", context_key="rollout.max_response_length")
        if conf.reward.get("model_verifier"):
            check_hub_model(str(conf.reward.model_verifier), "reward.model_verifier")
    except Exception as exc:
        return from_error("model + tokenizer", exc, MODEL_FIX), None
    return passed("model + tokenizer", f"{path} ({_architecture(path)}); tokenizer loads"
                  + ("; chat template" if conf.data.template == "chat" else "")), path


def _architecture(path: str) -> str:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return "from the hub cache"
    return ", ".join(config.get("architectures") or []) or str(config.get("model_type", "?"))


def check_datasets(conf: DictConfig) -> Row:
    """The training set and, with periodic validation, every benchmark (as `validate_train` does)."""
    from stapoctl.preflight.dataset import check_dataset, train_dataset

    train = train_dataset(conf)
    check_dataset(conf, train)
    checked = [f"train {train}"]
    if int(conf.eval.every_n_steps or 0) > 0:
        from stapoctl.data.benches import expand_benches

        for bench in expand_benches(list(conf.eval.benches)):
            check_dataset(conf, bench, flag="eval.benches")
            checked.append(f"validation {bench}")
    return passed("datasets", ", ".join(checked) + " resolve here")


def check_mlflow(conf: DictConfig) -> Row:
    """Reachable and writable: a run in the `stapoctl-doctor` experiment, a metric logged and read
    back, the run deleted. An http server is asked /health first (5 s), so a dead one fails fast."""
    from mlflow import MlflowClient

    from stapoctl.preflight.run_dir import check_tracking
    from stapoctl.tracking.mlflow_run import setup, tracking_uri

    uri = tracking_uri(conf.tracking.uri)
    check_tracking(uri)
    setup(uri, DOCTOR_EXPERIMENT)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(DOCTOR_EXPERIMENT)
    run = client.create_run(experiment.experiment_id, run_name="doctor-probe")
    run_id = run.info.run_id
    try:
        client.log_metric(run_id, "doctor/probe", 0.125, step=1)
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, "doctor/probe")]
    finally:
        client.delete_run(run_id)
    if history != [(1, 0.125)]:
        return failed("MLflow", f"{uri}: a metric logged to run {run_id} read back as {history}", MLFLOW_FIX)
    return passed("MLflow", f"{uri}: run created in '{DOCTOR_EXPERIMENT}', metric logged and read back, run deleted")


def check_disk(conf: DictConfig) -> Row:
    """The checkpoints' directory: writable, trainer.min_free_gb free, and room for the run's
    checkpoints as the memory plan counts them (when it can size the model)."""
    from stapoctl.preflight.run_dir import check_free_space, check_writable, output_root

    root, what = output_root(conf)
    check_writable(root, what)
    min_free = float(conf.trainer.get("min_free_gb", 0) or 0)
    check_free_space(root, what, min_free)
    detail = f"{root}: writable, {shutil.disk_usage(root).free / 1e9:,.1f} GB free (trainer.min_free_gb={min_free:g})"
    try:
        from stapoctl.preflight.memory_plan import build_plan

        disk = build_plan(conf).disk
    except Exception:  # a model the plan cannot size here (an uncached hub id): min_free_gb only
        disk = None
    if disk is None:
        return passed("disk", detail)
    need = f"{disk.checkpoints} checkpoint(s) × {_size(disk.per_checkpoint_gib)} = {_size(disk.total_gib)}"
    if not disk.fits:
        return failed("disk", f"{root}: the run keeps {need} and the disk has {_size(disk.free_gib or 0)} free",
                      "set trainer.keep_checkpoints=K, a larger trainer.save_freq, or trainer.output_dir on a bigger disk")
    return passed("disk", f"{detail}; the run keeps {need}")


def _size(gib: float) -> str:
    return f"{gib:,.1f} GiB" if gib >= 0.95 else f"{gib * 1024:,.0f} MiB"


# -- SLURM ---------------------------------------------------------------------------------------
def _run(cmd: list[str], timeout_s: float = 15.0) -> tuple[int, str]:
    """(exit code, stdout or the first line of stderr); 127 when the command is not here."""
    if not shutil.which(cmd[0]):
        return 127, f"{cmd[0]} not on PATH"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 124, f"{cmd[0]} did not answer ({type(exc).__name__})"
    if out.returncode != 0:
        return out.returncode, (out.stderr.strip().splitlines() or ["no output"])[-1]
    return 0, out.stdout


def partition_states(text: str) -> dict[str, tuple[str, int]]:
    """sinfo -h -o '%R|%a|%D' → partition → (availability, nodes)."""
    out: dict[str, tuple[str, int]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[0]:
            avail, nodes = out.get(parts[0], (parts[1], 0))
            out[parts[0]] = (avail, nodes + int(parts[2] or 0))
    return out


def _accounts() -> tuple[Optional[list[str]], str]:
    """This user's SLURM accounts (sacctmgr), or (None, why they could not be listed)."""
    code, text = _run(["sacctmgr", "-n", "-P", "show", "assoc", f"user={getpass.getuser()}", "format=account"])
    if code != 0:
        return None, text
    return sorted({a.strip() for a in text.splitlines() if a.strip()}), ""


def check_slurm(conf: DictConfig) -> Row:
    c = conf.cluster
    if c.name != "slurm":
        code, text = _run(["sinfo", "-h", "-o", "%R|%a|%D"], timeout_s=5.0)
        found = (f"sinfo here lists {', '.join(partition_states(text)) or 'no partition'}" if code == 0
                 else f"no SLURM here ({text})")
        return not_applicable("SLURM", f"cluster={c.name}; {found}")
    code, text = _run(["sinfo", "-h", "-o", "%R|%a|%D"])
    if code != 0:
        return failed("SLURM", f"sinfo: {text}", "run where a SLURM client and slurmctld answer (a login node), "
                      "or start one with cluster/local-slurm/start.sh")
    states = partition_states(text)
    name = str(c.partition or "")
    if name and name not in states:
        return failed("SLURM", f"cluster.partition='{name}': no such partition (sinfo lists {', '.join(states)})",
                      f"set cluster.partition to one of {', '.join(states)}")
    if name and states[name][0] != "up":
        return failed("SLURM", f"partition {name} is {states[name][0]}", "pick a partition that is up (sinfo)")
    where = f"partition {name} up, {states[name][1]} node(s)" if name else \
        f"no cluster.partition (SLURM's default); partitions {', '.join(states)}"
    accounts, why = _accounts()
    if c.account and accounts is not None and c.account not in accounts:
        return failed("SLURM", f"{where}; cluster.account='{c.account}' is not one of yours ({', '.join(accounts) or 'none'})",
                      f"set cluster.account to one of {', '.join(accounts) or 'your accounts (sacctmgr show assoc)'}")
    account = (f"account {c.account}" if c.account else "no cluster.account") + \
        (f" (accounts not listed: {why})" if accounts is None else "")
    return passed("SLURM", f"{where}; {account}; on {os.uname().nodename}")
