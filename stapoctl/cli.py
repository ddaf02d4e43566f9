"""`stapoctl` command line: parse, compose the Hydra config, dispatch. No logic lives here.

Engines are imported lazily inside each command so `stapoctl --help` answers at once.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import typer
from rich.console import Console

app = typer.Typer(
    name="stapoctl",
    help="Experiment orchestrator for RL of LLM reasoning (STAPO, GRPO, DAPO, 20-Entropy, "
    "WAPO, TR-GRPO, ...) on Ray + vLLM + DeepSpeed + MLflow.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
data_app = typer.Typer(help="Prepare training and benchmark datasets.", no_args_is_help=True)
app.add_typer(data_app, name="data")

console = Console()
err_console = Console(stderr=True)

OVERRIDES_HELP = (
    "Hydra overrides, e.g. experiment=stapo_qwen3_8b loss=stapo loss.tau_p=2e-3 "
    "model=Qwen/Qwen3-8B-Base cluster=slurm"
)


def fail(message: str, code: int = 2) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def not_implemented(command: str) -> None:
    fail(f"`stapoctl {command}` is not implemented yet")


def _compose(overrides: Optional[List[str]]):
    from stapoctl.config.compose import compose_config

    return compose_config(list(overrides or []))


@app.command(context_settings={"allow_extra_args": False})
def train(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    cfg: Optional[str] = typer.Option(
        None, "--cfg", help="'job': print the resolved config and placement plan, start nothing"
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Same as --cfg job."),
) -> None:
    """Train a policy: data → vLLM rollouts → reward → loss → DeepSpeed update → weight sync."""
    conf = _compose(overrides)
    if dry_run or cfg is not None:
        if cfg not in (None, "job"):
            fail(f"--cfg '{cfg}' is not supported: use --cfg job")
        from stapoctl.launch.plan import print_plan

        print_plan(conf, console)
        return
    from stapoctl.trainer.driver import train as run_train

    run_train(conf, console=console)


@app.command(name="eval")
def eval_cmd(
    bench: List[str] = typer.Option(
        ["toy"], "--bench", help="aime24 aime25 amc23 math500 minerva olympiadbench toy, or all"
    ),
    model: Optional[str] = typer.Option(
        None, "--model", help="HF id, local dir, checkpoint dir or MLflow run id (default: tiny)"
    ),
    k: Optional[int] = typer.Option(None, "--k", help="Samples per problem (default: paper's)"),
    decoding: str = typer.Option("both", "--decoding", help="train | justrl | both"),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N problems"),
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
) -> None:
    """Evaluate a model: avg@k, pass@k, maj@k per benchmark and decoding config."""
    conf = _compose(overrides)
    from stapoctl.eval.runner import run_eval

    run_eval(conf, benches=bench, model=model, k=k, decoding=decoding, limit=limit, console=console)


@app.command()
def sweep(
    name: str = typer.Argument(..., help="A sweep in sweeps/: tau_p, tau_h, ablations, ..."),
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
) -> None:
    """Run a family of runs (MLflow parent run with one child per value and seed)."""
    not_implemented("sweep")


@data_app.command("prep")
def data_prep(
    name: str = typer.Argument(
        ..., help="dapo-math-17k | aime24 | aime25 | amc23 | math500 | minerva | olympiadbench | toy | all"
    ),
    source: Optional[str] = typer.Option(None, "--source", help="Local jsonl/parquet instead of the hub"),
    out: Optional[str] = typer.Option(None, "--out", help="Output dir (default: STAPOCTL_HOME/data)"),
    strict: bool = typer.Option(False, "--strict", help="Fail on the first malformed row"),
    template: str = typer.Option("chat", "--template", help="chat | plain"),
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
) -> None:
    """Normalize a dataset to jsonl rows {id, prompt, answer, ...} with the STAPO instruction."""
    conf = _compose(overrides)
    from stapoctl.data.prep import prep_command

    prep_command(conf, name=name, source=source, out=out, strict=strict, template=template, console=console)


@app.command()
def submit(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
) -> None:
    """Send `train` to a Ray cluster or SLURM (cluster=ray|slurm) instead of running here."""
    not_implemented("submit")


@app.command()
def runs(
    experiment: str = typer.Option("stapoctl", "--experiment", help="MLflow experiment name"),
    uri: Optional[str] = typer.Option(None, "--uri", help="MLflow store (default: MLFLOW_TRACKING_URI or the local one)"),
    limit: int = typer.Option(50, "--limit"),
) -> None:
    """List runs in the MLflow store with their key metrics."""
    from stapoctl.tracking.runs import list_runs

    list_runs(uri, experiment, console, max_results=limit)


@app.command()
def compare(
    run_ids: List[str] = typer.Argument(..., help="MLflow run ids"),
    metric: Optional[List[str]] = typer.Option(None, "--metric", help="Metric to plot (repeatable)"),
    out: Optional[str] = typer.Option(None, "--out", help="PNG path for the curves"),
    uri: Optional[str] = typer.Option(None, "--uri"),
) -> None:
    """Compare runs side by side: final metrics and a PNG of their curves."""
    from stapoctl.tracking.runs import DEFAULT_CURVES, compare_runs

    compare_runs(uri, run_ids, console, metrics=metric or DEFAULT_CURVES, out=out)


@app.command()
def ui(
    port: int = typer.Option(5000, "--port"),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback by default)"),
    uri: Optional[str] = typer.Option(None, "--uri"),
) -> None:
    """Start the MLflow UI on the run store."""
    from stapoctl.tracking.mlflow_run import tracking_uri
    from stapoctl.tracking.runs import serve_ui

    console.print(f"MLflow UI for {tracking_uri(uri)} at http://{host}:{port} (Ctrl-C to stop)")
    raise typer.Exit(serve_ui(uri, host, port))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    ctx: typer.Context,
    name: str = typer.Argument("all", help="A script in benchmarks/ (e.g. token_stats_memory), or all"),
) -> None:
    """Side-by-side benchmarks from benchmarks/ (ratios measured in one run, not absolute timings).

    Extra options are passed to the script, e.g. `stapoctl bench token_stats_memory --tokens 2048`.
    """
    import subprocess

    from stapoctl.paths import project_root

    scripts = {p.stem: p for p in sorted((project_root() / "benchmarks").glob("*.py"))}
    chosen = list(scripts) if name == "all" else [name.removesuffix(".py")]
    for stem in chosen:
        if stem not in scripts:
            fail(f"no benchmark '{stem}' in benchmarks/ (have: {', '.join(scripts) or 'none'})")
        console.rule(f"[bold]bench {stem}")
        rc = subprocess.call([sys.executable, str(scripts[stem]), *ctx.args])
        if rc:
            raise typer.Exit(rc)


@app.command()
def losses() -> None:
    """List the registered policy losses and their config fields."""
    from dataclasses import fields

    from rich.table import Table

    from stapoctl.losses import LOSSES

    table = Table(title="Policy losses (loss=NAME loss.FIELD=VALUE)")
    table.add_column("name", style="bold")
    table.add_column("what")
    table.add_column("config fields (defaults)")
    for name, spec in LOSSES.items():
        cfg = spec.config_cls()
        fields_text = ", ".join(
            f"{f.name}={getattr(cfg, f.name)!r}" for f in fields(cfg) if f.name != "name"
        )
        table.add_row(name, (spec.doc or "").strip().splitlines()[0] if spec.doc else "", fields_text)
    console.print(table)


def main() -> None:
    from stapoctl.errors import RunFailed, RunStopped, UserError

    try:
        app()
    except UserError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except RunStopped as exc:
        err_console.print(f"[yellow]stopped:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except RunFailed as exc:
        err_console.print(f"[bold red]failed:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
