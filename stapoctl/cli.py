"""`stapoctl` command line: parse, compose the Hydra config, dispatch. No logic lives here.

Engines are imported lazily inside each command so `stapoctl --help` answers at once.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import typer
from rich.console import Console

from stapoctl.errors import RunFailed, RunStopped, UserError, labelled

app = typer.Typer(name="stapoctl", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
                  help="Experiment orchestrator for RL of LLM reasoning (STAPO, GRPO, DAPO, 20-Entropy, "
                  "WAPO, TR-GRPO, ...) on Ray + vLLM + DeepSpeed + MLflow.")
data_app = typer.Typer(help="Prepare training and benchmark datasets.", no_args_is_help=True)
app.add_typer(data_app, name="data")
jobs_app = typer.Typer(help="Jobs sent with `stapoctl submit` (Ray or SLURM): list, status, logs, stop.",
                       no_args_is_help=True)
app.add_typer(jobs_app, name="jobs")

console = Console()
err_console = Console(stderr=True)

OVERRIDES_HELP = ("Hydra overrides (key=value, +key=value to add, ~key to delete), e.g. experiment=stapo_qwen3_8b "
                  "loss=stapo loss.tau_p=2e-3 model=Qwen/Qwen3-8B-Base cluster=slurm")


@app.callback(invoke_without_command=True)
def _root(version: bool = typer.Option(False, "--version", help="Print stapoctl's version and exit.")) -> None:
    if version:  # the installed package's metadata: the version pip installed
        from importlib.metadata import version as installed
        console.print(f"stapoctl {installed('stapoctl')}", highlight=False)


def fail(message: str, code: int = 2) -> None:
    err_console.print(labelled("error:", message), highlight=False, soft_wrap=True)  # the text as text
    raise typer.Exit(code)


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
        from stapoctl.preflight.plan_report import dry_run as print_dry_run

        print_dry_run(conf, console)  # a plan that cannot fit ends the dry run with exit 2 too
        return
    from stapoctl.launch.import_gc import paused_gc

    with paused_gc("stapoctl.trainer.driver"):
        import ray  # noqa: F401  (the driver's heaviest import before the engines start; mlflow's follows them)
        from stapoctl.trainer.driver import train as run_train

    run_train(conf, console=console)
    _exit_now()


@app.command(context_settings={"allow_extra_args": False})
def plan(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    as_json: bool = typer.Option(False, "--json", help="The plan as JSON (for scripts)"),
) -> None:
    """Memory per role and GPU (learner, reference, vLLM KV cache) and checkpoint disk, before a run:
    exit 2 when it cannot fit."""
    conf = _compose(overrides)
    if conf.cluster.preset:  # the site preset's GPU memory, as `submit` would apply it
        from stapoctl.jobs.presets import apply

        conf = apply(conf, list(overrides or []))
    from stapoctl.preflight.plan_report import plan_command

    plan_command(conf, console, as_json=as_json)  # a plan that cannot fit: PlanRefused, exit 2


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
    from stapoctl.eval.command import run_eval

    run_eval(conf, benches=bench, model=model, k=k, decoding=decoding, limit=limit, console=console)


@app.command()
def sweep(
    name: str = typer.Argument(..., help="A sweep in sweeps/: tau_p, tau_h, ablation, baselines"),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="values=[...] seeds=[...] resume=SWEEP_ID confirm=PILOT_SWEEP max_seeds=N delta=D, and Hydra "
        "overrides for every trial, e.g. experiment=stapo_qwen3_1.7b trainer.total_steps=200"
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the trials (and a confirm's sizing); start nothing."),
) -> None:
    """Run a family of runs: an MLflow parent run with one child `train` run per value and seed."""
    from stapoctl.sweep.runner import sweep_command

    code = sweep_command(name, list(overrides or []), console, dry_run=dry_run)
    if code:
        raise typer.Exit(code)


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
    from stapoctl.models.resolve import chat_tokenizer_path

    prep_command(conf, name=name, source=source, out=out, strict=strict, template=template, console=console,
                 tokenizer_path=lambda: chat_tokenizer_path(conf))


@app.command(context_settings={"allow_extra_args": False})
def submit(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the sbatch script / Ray job spec; submit nothing"),
    follow: bool = typer.Option(False, "--follow", "-f", help="Stream the job's logs until it ends"),
) -> None:
    """Send `train` to a Ray cluster (cluster=ray cluster.address=http://HOST:8265) or to SLURM
    (cluster=slurm cluster.preset=NAME) instead of running it here."""
    conf = _compose(overrides)
    from stapoctl.jobs.submit import submit_run

    raise typer.Exit(submit_run(conf, list(overrides or []), dry_run=dry_run, follow=follow, console=console))


@app.command(context_settings={"allow_extra_args": False})
def doctor(
    overrides: Optional[List[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    no_wait: bool = typer.Option(False, "--no-wait", help="cluster=ray|slurm: print the job id, do not wait"),
    as_json: bool = typer.Option(False, "--json", help="The rows as one JSON document instead of the table"),
) -> None:
    """Self-test where a run would go (here, or cluster=ray|slurm as a short job): versions, GPUs, all-reduce,
    vLLM engine + KV cache, weight sync, MLflow, model, data, SLURM, disk. Exit 0 when every applicable row passes."""
    from stapoctl.doctor.command import doctor_command

    raise typer.Exit(doctor_command(_compose(overrides), list(overrides or []), console, as_json=as_json, wait=not no_wait))


ADDRESS_HELP = "Ray job server (http://HOST:8265) for a Ray job not submitted from here"


@jobs_app.command("list")
def jobs_list(limit: int = typer.Option(20, "--limit")) -> None:
    """Jobs submitted from here: backend, id, run name, state, where the logs are."""
    from stapoctl.jobs.control import list_jobs

    list_jobs(console, limit=limit)


@jobs_app.command("status")
def jobs_status(
    job_id: str = typer.Argument(..., help="SLURM job id (array task: 12_1) or Ray submission id"),
    address: Optional[str] = typer.Option(None, "--address", help=ADDRESS_HELP),
) -> None:
    """A job's state (array: each task's), with its MLflow run and log file."""
    from stapoctl.jobs.control import show_status

    show_status(job_id, console, address=address)


@jobs_app.command("logs")
def jobs_logs(
    job_id: str = typer.Argument(..., help="SLURM job id (array task: 12_1) or Ray submission id"),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep streaming until the job ends"),
    address: Optional[str] = typer.Option(None, "--address", help=ADDRESS_HELP),
) -> None:
    """A job's output (driver log for Ray, submitit's log file for SLURM)."""
    from stapoctl.jobs.control import show_logs

    raise typer.Exit(show_logs(job_id, console, follow=follow, address=address))


@jobs_app.command("stop")
def jobs_stop(
    job_id: str = typer.Argument(..., help="SLURM job id (array task: 12_1) or Ray submission id"),
    address: Optional[str] = typer.Option(None, "--address", help=ADDRESS_HELP),
) -> None:
    """Stop a job (Ray: stop_job; SLURM: scancel)."""
    from stapoctl.jobs.control import stop_job

    stop_job(job_id, console, address=address)


@app.command()
def runs(
    experiment: str = typer.Option("stapoctl", "--experiment", help="MLflow experiment name"),
    uri: Optional[str] = typer.Option(None, "--uri", help="MLflow store (default: MLFLOW_TRACKING_URI or the local one)"),
    limit: int = typer.Option(50, "--limit", help="Top-level runs to show (nested runs come with them)"),
) -> None:
    """List runs, newest first: short ids, sweeps with their trials as a tree, key metrics."""
    from stapoctl.tracking.runs import list_runs

    list_runs(uri, experiment, console, max_results=limit)


@app.command()
def compare(
    ids: List[str] = typer.Argument(..., help="A sweep id, or run ids (full or short, as `stapoctl runs` prints)"),
    metric: Optional[List[str]] = typer.Option(None, "--metric", help="Metric to plot and tabulate (repeatable)"),
    out: Optional[str] = typer.Option(None, "--out", help="Directory for tables and figures (default ./compare-<id>)"),
    test_metric: Optional[str] = typer.Option(None, "--test-metric", help="Metric the statistics test "
                                              "(default avg/<first decoding>: held-out accuracy over benches)"),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Row the others are tested against "
                                           "(default grpo if a row, else the first row)"),
    seeds_needed: Optional[float] = typer.Option(None, "--seeds-needed", help="Difference D (table units, "
                                                 "points for accuracy): seeds per row to detect it at 80% power"),
    rows: Optional[str] = typer.Option(None, "--rows", help="Only these rows, comma-separated (e.g. an ablation's)"),
    mixed_protocols: bool = typer.Option(False, "--mixed-protocols", help="Show runs evaluated under different "
                                         "protocols together (refused otherwise); the table says so"),
    uri: Optional[str] = typer.Option(None, "--uri"),
) -> None:
    """Table 2 of the paper (rows: methods or swept values; mean ± std over seeds), each row
    against a baseline (bootstrap CIs, permutation p, Holm, verdict) and figures."""
    from stapoctl.analysis.compare import compare as run_compare

    run_compare(uri, ids, console, metrics=metric or (), out=out, test_metric=test_metric, baseline=baseline,
                seeds_delta=seeds_needed, rows=[r.strip() for r in (rows or "").split(",") if r.strip()],
                mixed_protocols=mixed_protocols)


@app.command()
def ui(
    run: Optional[str] = typer.Argument(None, help="A sweep or run id: open its trials / its page"),
    port: int = typer.Option(5000, "--port"),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback by default)"),
    experiment: str = typer.Option("stapoctl", "--experiment", help="MLflow experiment name"),
    uri: Optional[str] = typer.Option(None, "--uri"),
) -> None:
    """Start the MLflow UI on the run store; print the URLs of the runs table and of each
    recent sweep's trials side by side."""
    from stapoctl.tracking.mlflow_run import tracking_uri
    from stapoctl.tracking.runs import is_loopback, serve_ui, ui_links

    if not is_loopback(host):
        err_console.print(labelled("warning:", f"--host {host} serves every run, metric and artifact of "
                          f"{tracking_uri(uri)} without authentication to anyone who can reach this machine; "
                          "keep the default 127.0.0.1 and use an SSH tunnel to view it remotely", "yellow"),
                          highlight=False, soft_wrap=True)
    links = ui_links(uri, experiment, host, port, run)
    console.print(f"MLflow UI for {tracking_uri(uri)} (Ctrl-C to stop); open", highlight=False, markup=False)
    for what, url in links:  # run names and store paths: text, never markup
        console.print(f"  {url}", style="bold", highlight=False, markup=False, soft_wrap=True)
        console.print(f"    {what}", style="dim", highlight=False, markup=False)
    sys.stdout.flush()  # before the server takes over the terminal (and for pipes)
    raise typer.Exit(serve_ui(uri, host, port))


@app.command()
def tokens(run: str = typer.Argument(..., help="A training run id (full or short, as `stapoctl runs` prints)"),
           step: Optional[int] = typer.Option(None, "--step", help="Diagnostics step (default: the newest)"),
           open_page: bool = typer.Option(False, "--open", help="Open the page in the browser"),
           uri: Optional[str] = typer.Option(None, "--uri")) -> None:
    """Where a run's per-token trace page (diagnostics/step_N/tokens.html) is: its path and MLflow UI link."""
    from stapoctl.tracking.token_link import show_tokens

    show_tokens(uri, run, step, open_page, console)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    ctx: typer.Context,
    name: str = typer.Argument("all", help="A script in benchmarks/ (rl_step, learning, loss_overhead, "
                                           "token_stats_memory), all, or docs (rewrite the docs table only)"),
) -> None:
    """Side-by-side benchmarks (stapoctl vs TRL / transformers / torch, measured in one run).

    Common options: --repeats N, --quick (smoke run, nothing saved), --write-docs (one script);
    `all` runs every script, saves benchmarks/results/*.json and rewrites docs/PERFORMANCE.md.
    Script options pass through, e.g. `stapoctl bench rl_step --sizes tiny`. Timings are only
    comparable on a quiet machine: nothing else running, a 1-minute load average (`uptime`) below
    1.5 on 2 cores (`all` warns above it; every row records the load it saw).
    """
    import subprocess

    from stapoctl.paths import project_root

    root = project_root() / "benchmarks"
    scripts = {p.stem: p for p in sorted(root.glob("*.py")) if not p.stem.startswith("_")}
    stem = name.removesuffix(".py")
    if stem in ("all", "docs"):
        raise typer.Exit(subprocess.call([sys.executable, str(root / "_suite.py"), stem, *ctx.args]))
    if stem not in scripts:
        fail(f"no benchmark '{stem}' in benchmarks/ (have: {', '.join(scripts) or 'none'}; or all, docs)")
    console.rule(f"[bold]bench {stem}")
    rc = subprocess.call([sys.executable, str(scripts[stem]), *ctx.args])
    if rc:
        raise typer.Exit(rc)


@app.command()
def losses() -> None:
    """List the registered policy losses and their config fields."""
    from dataclasses import fields

    from rich.markup import escape
    from rich.table import Table

    from stapoctl.config.token_rules import EXAMPLE
    from stapoctl.losses import LOSSES

    table = Table(title="Policy losses (loss=NAME loss.FIELD=VALUE)",
                  caption=escape(f"lists: token_rules, ordered and applied, e.g. 'loss.token_rules=[{EXAMPLE}]'; shadow, "
                                 "only measured, e.g. 'loss.shadow=[stapo,table1]' (docs/LOSSES.md)"))
    table.add_column("name", style="bold")
    table.add_column("what")
    table.add_column("config fields (defaults)")
    for name, spec in LOSSES.items():
        cfg = spec.config_cls()
        fields_text = ", ".join(
            f"{f.name}={getattr(cfg, f.name)!r}" for f in fields(cfg) if f.name != "name"
        )
        what = (spec.doc or "").strip().splitlines()[0] if spec.doc else ""
        preset = cfg.preset_rules() if hasattr(cfg, "preset_rules") else ()
        if preset:  # a preset of the rule engine: its rules in the token_rules grammar
            what += "\npreset rules: " + "; ".join(rule.text() for rule in preset)
        table.add_row(name, escape(what), escape(fields_text))
    console.print(table)


_AS_PROCESS = False  # set by `main`: this interpreter is the `stapoctl` process itself


def _exit_now(code: int = 0) -> None:
    """Leave a finished command without Python's finalisation (torch, Ray and MLflow torn down, the
    heap collected: ~1.5 s on 2 cores for memory the OS reclaims anyway); atexit handlers still run,
    and nothing is skipped while a non-daemon thread lives. Only as the `stapoctl` process."""
    import atexit
    import os
    import threading

    if not _AS_PROCESS or any(t.is_alive() and not t.daemon for t in threading.enumerate()
                              if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()  # CPython's own exit path calls this too
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    global _AS_PROCESS
    _AS_PROCESS = True
    try:
        app()
    except UserError as exc:
        err_console.print(labelled("error:", exc), highlight=False, soft_wrap=True)
        sys.exit(2)
    except RunStopped as exc:
        err_console.print(labelled("stopped:", exc, "yellow"), highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except RunFailed as exc:
        err_console.print(labelled("failed:", exc), highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
