"""`stapoctl submit --dry-run` and the one-line errors of submit/jobs; no engine, no cluster.

The multi-node sbatch script is parsed (node count, GPUs, Ray-on-SLURM bootstrap) and checked by
`bash -n`; it is not run here (this machine has one node).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def cli(*args: str, home, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "STAPOCTL_HOME": str(home), **(extra_env or {})}
    return subprocess.run([sys.executable, "-m", "stapoctl.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def submit(*args: str, home, dry_run: bool = True, follow: bool = False) -> str:
    """`stapoctl submit ARGS` in this process (the CLI only composes and calls submit_run)."""
    from rich.console import Console

    from stapoctl.config.compose import compose_config
    from stapoctl.jobs.submit import submit_run

    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_HOME", str(home))
    console = Console(record=True, width=200)
    try:
        rc = submit_run(compose_config(list(args)), list(args), dry_run=dry_run, follow=follow, console=console)
    finally:
        mp.undo()
    assert rc == 0
    return console.export_text()


def sbatch_flags(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script, flags=re.M))


@pytest.fixture(scope="module")
def two_node(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    res = cli("submit", "cluster=slurm", "cluster.preset=example_2node_8gpu", "experiment=stapo_qwen3_8b",
              "--dry-run", home=home)
    assert res.returncode == 0, res.stderr
    script = res.stdout[res.stdout.index("#!/bin/bash"):]
    script = script[: script.index("\n\n", script.index("# command")) + 1]
    return {"script": script, "home": home, "out": res.stdout}


def test_two_node_script_asks_for_two_nodes_of_eight_gpus(two_node):
    flags = sbatch_flags(two_node["script"])
    assert flags["nodes"] == "2"
    assert flags["gpus-per-node"] == "8"
    assert flags["ntasks-per-node"] == "1"
    assert flags["cpus-per-task"] == "96"
    assert flags["mem"] == "960GB"
    assert flags["time"] == "2880"
    assert (flags["partition"], flags["account"], flags["qos"], flags["constraint"]) == (
        "gpu", "my-project", "normal", "h100")
    assert flags["signal"].startswith("USR2@")  # submitit's time-limit/preemption hook
    assert "array" not in flags


def test_two_node_script_bootstraps_ray_then_runs_one_driver(two_node):
    lines = two_node["script"].splitlines()
    text = two_node["script"]
    # the preset's setup lines come before anything that needs the environment
    assert lines.index("module load cuda/12.4") < next(i for i, line in enumerate(lines) if "ray.scripts.scripts" in line)
    head = next(line for line in lines if "start --head" in line)
    assert '-w "$ray_head"' in head and "--num-gpus=8" in head and "--port=6379" in head
    assert "--dashboard-host=127.0.0.1" in head and head.rstrip().endswith("&")
    worker = next(line for line in lines if "start --block --address" in line)
    assert '-w "$ray_node"' in worker and "--num-gpus=8" in worker
    assert 'for ray_node in "${ray_nodes[@]:1}"' in text  # every node but the head
    assert re.search(r'export STAPOCTL_RAY_ADDRESS="\$ray_head_ip:6379"', text)
    driver = lines[-1] if lines[-1].strip() else lines[-2]
    assert driver.startswith("srun ") and "--nodes=1 --ntasks=1" in driver and "submitit.core._submit" in driver
    assert text.index("STAPOCTL_RAY_ADDRESS=") < text.index(driver)
    assert "export RAY_AUTH_MODE=token" in text
    assert f"export STAPOCTL_HOME={two_node['home']}" in text
    job = next(line for line in lines if line.startswith("# job: stapoctl train"))
    assert "experiment=stapo_qwen3_8b" in job and "tracking.uri=" in job
    checked = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_dry_run_submits_nothing(two_node):
    assert not (two_node["home"] / "jobs").exists()
    assert "nothing submitted" in two_node["out"]


def test_single_node_local_preset_sizes_ray_to_the_allocation(tmp_path):
    out = submit("cluster=slurm", "cluster.preset=local", "cluster.mem_gb=3.5", home=tmp_path)
    flags = sbatch_flags(out)
    assert flags["nodes"] == "1" and flags["cpus-per-task"] == "2" and flags["mem"] == "3584MB"
    assert flags["partition"] == "debug" and "gpus-per-node" not in flags
    assert "ray.scripts.scripts" not in out  # one node: the job starts its own local Ray
    job = next(line for line in out.splitlines() if line.startswith("# job:"))
    assert "cluster.num_cpus=2" in job and "cluster.num_gpus=0" in job


def test_ray_dry_run_prints_the_job_spec(tmp_path):
    out = submit("cluster=ray", "cluster.address=http://127.0.0.1:8265", "loss=grpo", home=tmp_path)
    spec = json.loads(out[out.index("{"):])
    assert spec["address"] == "http://127.0.0.1:8265"
    assert spec["entrypoint"].startswith(f"{sys.executable} -m stapoctl.cli train ")
    assert "loss=grpo" in spec["entrypoint"] and "cluster.address=auto" in spec["entrypoint"]
    assert spec["metadata"]["stapoctl.ship_code"] == "path"  # loopback: this checkout, nothing uploaded
    assert spec["runtime_env"]["env_vars"]["STAPOCTL_HOME"] == str(tmp_path)
    remote = submit("cluster=ray", "cluster.address=http://10.0.0.7:8265", home=tmp_path)
    spec = json.loads(remote[remote.index("{"):])
    assert spec["metadata"]["stapoctl.ship_code"] == "upload"
    assert ".venv" in spec["runtime_env"]["excludes"] and ".git" in spec["runtime_env"]["excludes"]
    assert not (tmp_path / "jobs").exists()


@pytest.mark.parametrize(
    "args, flags, words",
    [
        (["cluster=slurm", "cluster.preset=lcoal"], {}, ["cluster.preset='lcoal'", "did you mean 'local'"]),
        (["cluster=slurm"], {"follow": True}, ["--follow", "--dry-run"]),
        (["trainer.total_steps=3"], {}, ["cluster=ray or cluster=slurm", "stapoctl train"]),
        (["cluster=ray"], {}, ["cluster.address=http://HOST:8265"]),
        (["cluster=ray", "cluster.address=ray://head:10001"], {}, ["job server"]),
        (["cluster=ray", "cluster.address=http://127.0.0.1:9"], {"dry_run": False},
         ["cluster.address=http://127.0.0.1:9", "no Ray job server"]),
        (["cluster=ray", "cluster.address=http://127.0.0.1:8265", "cluster.ship_code=rsync"], {}, ["cluster.ship_code"]),
        (["cluster=slurm", "cluster.nodes=0"], {}, ["cluster.nodes=0"]),
        (["cluster=slurm", "data.train_batch_size=7"], {}, ["learner.ppo_mini_batch_size"]),
    ],
)
def test_bad_input_is_a_user_error_naming_the_field(tmp_path, args, flags, words):
    from stapoctl.errors import UserError

    with pytest.raises(UserError) as err:
        submit(*args, home=tmp_path, **flags)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_the_cli_prints_a_bad_input_as_one_line_and_exits_2(tmp_path):
    res = cli("submit", "cluster=slurm", "cluster.preset=nope", "--dry-run", home=tmp_path)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "cluster.preset='nope'" in res.stderr and "Traceback" not in res.stderr


def test_unknown_preset_field_names_the_field(tmp_path, monkeypatch):
    from stapoctl.errors import UserError

    presets = tmp_path / "presets"
    presets.mkdir()
    (presets / "site.yaml").write_text("partition: gpu\ngpus_per_nod: 8\n")
    monkeypatch.setenv("STAPOCTL_SLURM_PRESETS", str(presets))
    with pytest.raises(UserError, match="gpus_per_nod.*did you mean 'gpus_per_node'"):
        submit("cluster=slurm", "cluster.preset=site", home=tmp_path)


def test_command_line_wins_over_the_preset(tmp_path):
    flags = sbatch_flags(submit("cluster=slurm", "cluster.preset=example_2node_8gpu", "cluster.nodes=1",
                                "cluster.partition=debug", home=tmp_path))
    assert flags["nodes"] == "1" and flags["gpus-per-node"] == "8"  # nodes from the CLI, GPUs from the preset


def test_jobs_unknown_id_names_it_and_the_way_out(tmp_path, monkeypatch):
    from rich.console import Console

    from stapoctl.errors import UserError
    from stapoctl.jobs import control as jobs

    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path))
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    with pytest.raises(UserError, match="raysubmit_nope.*--address"):
        jobs.show_status("raysubmit_nope", Console())
    console = Console(record=True)
    jobs.list_jobs(console)
    assert "no jobs submitted from here yet" in console.export_text()


SUBMITTERS = ["stapoctl.jobs.submit", "stapoctl.jobs.slurm", "stapoctl.jobs.ray_jobs", "stapoctl.jobs.control"]
TRAINER_SIDE = ["stapoctl.trainer.driver", "stapoctl.trainer.engines", "stapoctl.launch.ray_runtime"]


@pytest.mark.parametrize("imported, forbidden", [(SUBMITTERS, ["stapoctl.trainer.driver"]),
                                                 (TRAINER_SIDE, [*SUBMITTERS, "submitit"])])
def test_submitters_sit_above_the_trainer(imported, forbidden):
    """launch/ holds the Ray runtime the trainer uses, jobs/ the submitters that call the
    trainer: importing one side must not pull in the other (no import cycle, and the trainer
    cannot tell which launcher started it)."""
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {imported!r}]; "
            f"leaked = [m for m in {forbidden!r} if m in sys.modules]; assert not leaked, leaked; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


def test_two_node_script_waits_for_every_node_and_never_announces_loopback(two_node):
    """#49 R2: the driver starts only once every node of the allocation joined Ray with its GPUs (a
    bounded wait that names the missing node), and the head's address is never 127.x."""
    from stapoctl.jobs import sbatch

    text = two_node["script"]
    wait = next(line for line in text.splitlines() if "stapoctl.jobs.ray_nodes" in line)
    assert '--gpus-per-node=8' in wait and '"${ray_nodes[@]}"' in wait and wait.rstrip().endswith("|| exit 1")
    driver = next(line for line in reversed(text.splitlines()) if "submitit.core._submit" in line)
    assert text.index(wait) < text.index(driver)
    assert "hostname --ip-address" not in text
    here = subprocess.run(["bash", "-c", sbatch.head_ip_command(None)], capture_output=True, text=True)
    assert here.returncode == 0 and here.stdout.strip() and not here.stdout.startswith("127.")
    assert "dev ib0" in sbatch.head_ip_command("ib0")


def test_the_node_wait_names_who_is_missing():
    from stapoctl.jobs.ray_nodes import missing

    alive = [{"Alive": True, "NodeManagerHostname": "gpu001.cluster", "Resources": {"GPU": 8.0}},
             {"Alive": True, "NodeManagerHostname": "gpu002", "Resources": {"CPU": 96.0}},  # its GPUs not seen
             {"Alive": False, "NodeManagerHostname": "gpu003", "Resources": {"GPU": 8.0}}]
    assert missing(alive, ["gpu001", "gpu002", "gpu003", "gpu004"], 8) == ["gpu002", "gpu003", "gpu004"]
    assert missing(alive, ["gpu001"], 8) == [] and missing(alive, ["gpu002"], 0) == []


@pytest.mark.engine
def test_the_node_wait_against_a_real_ray_head(ray_head):
    """One node joined (this one), one host that never will: exit 1 within its bound, naming it."""
    import socket
    import sys
    import time

    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ray_head["token"])}
    cmd = [sys.executable, "-m", "stapoctl.jobs.ray_nodes", f"--address={ray_head['gcs']}", "--timeout-s=3"]
    ok = subprocess.run([*cmd, socket.gethostname()], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0 and "all 1 node(s) joined" in ok.stdout, ok.stderr[-2000:]
    t0 = time.monotonic()
    bad = subprocess.run([*cmd, socket.gethostname(), "node-that-never-joins"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert bad.returncode == 1 and "node(s) node-that-never-joins did not join Ray" in bad.stderr, bad.stderr[-2000:]
    assert time.monotonic() - t0 < 60
