"""Text is printed as text: a message or value holding `[/x]` (gloo's `[/…/pair.cc:553]`, an override
value) reaches the terminal literally, never read as rich markup (a `MarkupError` traceback, exit 1,
instead of the one line); and `rollout.tensor_parallel_size` above this machine's cores is refused
before an MLflow run exists. Engine-free: the CLI paths run `python -m stapoctl.cli` up to preflight.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
GLOO = "Connection closed by peer [/opt/gloo/transport/tcp/pair.cc:553]"


def stapoctl(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STAPOCTL_HOME": str(tmp_path / "home"), "COLUMNS": "80",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return subprocess.run([sys.executable, "-m", "stapoctl.cli", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "MarkupError" not in err, err
    return lines[0]


def render(*renderables, **kw) -> str:
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    for r in renderables:
        console.print(r, **kw)
    return out.getvalue()


# -- (a) the command line: bad input holding `[/x]` is one line, exit 2 ---------------------------
@pytest.mark.parametrize("argv,expected", [
    (["train", "rollout.weight_sync='[/x]'"], "rollout.weight_sync=[/x] must be"),  # a choice field
    (["train", "loss.tau_p='[/x]'"], "loss.tau_p='[/x]'"),  # a float field
    (["train", "trainer.run_name=a[/x]"], "'trainer.run_name=a[/x]' is not a Hydra override"),
    (["train", "--cfg", "[/x]"], "--cfg '[/x]' is not supported"),  # cli.fail
])
def test_bad_value_with_markup_is_one_plain_line_exit_2(tmp_path, argv, expected):
    proc = stapoctl(tmp_path, *argv)
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith("error: ") and expected in line
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "home" / "runs").exists()


# -- (b) the top-level printer of `main()`: UserError, RunFailed, RunStopped -----------------------
def _main_raising(exc: BaseException, monkeypatch, capsys) -> tuple[int, str]:
    """`stapoctl.cli.main` with its Typer app replaced by one that raises `exc` (a command that failed)."""
    from stapoctl import cli

    def app():
        raise exc

    monkeypatch.setattr(cli, "app", app)
    monkeypatch.setattr(cli, "_AS_PROCESS", False)  # main sets it; restored after the test
    monkeypatch.setattr(cli.err_console, "_file", None)  # sys.stderr at print time (capsys's); restored to None
    with pytest.raises(SystemExit) as info:
        cli.main()
    captured = capsys.readouterr()
    assert captured.out == ""
    return info.value.code, captured.err


def test_user_error_with_markup_prints_literally(monkeypatch, capsys):
    from stapoctl.errors import UserError

    message = "rollout.weight_sync=[/x] must be auto, object_store, gloo, nccl or ipc; [bold]not styled[/bold]"
    code, err = _main_raising(UserError(message), monkeypatch, capsys)
    assert code == 2
    assert one_line(err) == f"error: {message}"  # over 80 columns, and still one line


def test_run_failed_with_gloo_message_prints_literally(monkeypatch, capsys):
    from stapoctl.errors import EngineFault, RunFailed

    for exc in (RunFailed(f"rollout worker 1 died during the weight push: {GLOO}"), EngineFault(GLOO)):
        code, err = _main_raising(exc, monkeypatch, capsys)
        assert code == 1
        assert one_line(err) == f"failed: {exc}"


def test_run_stopped_with_markup_prints_literally(monkeypatch, capsys):
    from stapoctl.errors import AlarmStopped, RunStopped

    code, err = _main_raising(RunStopped("stopped by SIGTERM at [/x] step 3", 15), monkeypatch, capsys)
    assert (code, one_line(err)) == (143, "stopped: stopped by SIGTERM at [/x] step 3")
    code, err = _main_raising(AlarmStopped("alarm [red]entropy[/red] collapsed"), monkeypatch, capsys)
    assert (code, one_line(err)) == (3, "stopped: alarm [red]entropy[/red] collapsed")


# -- (c) tensor parallelism above the cores: refused before any run -------------------------------
def test_tensor_parallel_above_cores_refused_before_a_run(tmp_path):
    cores = len(os.sched_getaffinity(0))
    db = tmp_path / "store.db"
    proc = stapoctl(tmp_path, "train", f"rollout.tensor_parallel_size={cores + 1}", f"tracking.uri=sqlite:///{db}")
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert f"rollout.tensor_parallel_size={cores + 1}" in line
    assert f"lower rollout.tensor_parallel_size to {cores} or less" in line
    assert not db.exists() and not (tmp_path / "mlflow.db").exists()  # no MLflow store, so no run
    assert not (tmp_path / "home" / "runs").exists()  # no run dir


def test_tensor_parallel_check_only_for_local_cpu(monkeypatch):
    from stapoctl.config.compose import compose_config
    from stapoctl.errors import UserError
    from stapoctl.preflight import machine

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 1})
    conf = compose_config(["rollout.tensor_parallel_size=3"])
    with pytest.raises(UserError, match=r"^rollout.tensor_parallel_size=3 needs a CPU core per tensor-parallel "
                                        r"rank and this machine has 2: lower rollout.tensor_parallel_size to 2"):
        machine.check_machine(conf)
    machine.check_cpu_tensor_parallel(compose_config(["rollout.tensor_parallel_size=2"]), on_gpu=False)
    machine.check_cpu_tensor_parallel(conf, on_gpu=True)  # vLLM on CUDA: a GPU per rank, not a core
    machine.check_machine(compose_config(["rollout.tensor_parallel_size=3", "cluster.address=ray://head:10001"]))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|1")  # the user's binding wins, as in the actor
    machine.check_cpu_tensor_parallel(conf, on_gpu=False)


# -- (d) the helpers and the tables that carry engine or user text ---------------------------------
def test_labelled_keeps_the_label_style_and_the_text_as_text():
    from stapoctl.errors import labelled

    text = labelled("error:", GLOO)
    assert text.plain == f"error: {GLOO}"
    assert [(s.start, s.end, str(s.style)) for s in text.spans] == [(0, 6, "bold red")]
    assert labelled("stopped:", "[/x]", "yellow").spans[0].style == "yellow"
    assert render(labelled("warning:", "[bold]x[/bold] [/x]", "yellow"), soft_wrap=True) == \
        "warning: [bold]x[/bold] [/x]\n"


def test_doctor_table_prints_exceptions_literally():
    from stapoctl.doctor.rows import FAIL, Row, table

    row = Row("weight sync", FAIL, f"gloo broadcast: {GLOO}", fix="rerun with rollout.weight_sync='[/x]'")
    out = render(table([row], title="stapoctl doctor · node[/x]"))
    assert "pair.cc:553]" in out and "weight_sync='[/x]'" in out and "node[/x]" in out


def test_sweep_lines_print_run_names_and_errors_literally():
    from stapoctl.sweep.outcome import Outcome, alarm_line
    from stapoctl.sweep.plan import Trial

    trial = Trial(index=0, value="[/x]", seed=1, run_name="tau[/x]", tags={})
    out = render(alarm_line("trial 1/1 tau[/x]", Outcome(trial, "KILLED (alarm)", "r1", 0.5), ["entropy[/x]"]))
    assert "trial 1/1 tau[/x] stopped by the alarm entropy[/x]" in out
