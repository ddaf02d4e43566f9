"""Reading runs back out of the MLflow store: `stapoctl runs`, `stapoctl compare`, `stapoctl ui`.

The MLflow UI is where researchers compare runs; these commands are the terminal's view of
the same store, and `compare` writes the curves as a PNG so a figure can go into a note.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.table import Table

from stapoctl.errors import UserError
from stapoctl.tracking.mlflow_run import tracking_uri

# MLflow refuses "@" in metric names: avg@k is logged as avg_at_k
DEFAULT_CURVES = ("val/toy/train/avg_at_4", "critic/score/mean", "actor/entropy", "stapo/spurious_ratio")


def _client(uri: str | None):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(uri))


def list_runs(uri: str | None, experiment: str, console: Console, max_results: int = 50) -> list:
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise UserError(
            f"no MLflow experiment '{experiment}' in {tracking_uri(uri)}: run `stapoctl train` first "
            "or set tracking.experiment / MLFLOW_TRACKING_URI"
        )
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=max_results)
    table = Table(title=f"runs in '{experiment}' ({tracking_uri(uri)})")
    table.add_column("run id", no_wrap=True, min_width=32)
    for col in ("name", "kind", "loss", "status", "steps", "score", "val acc"):
        table.add_column(col)
    for run in runs:
        m, p, t = run.data.metrics, run.data.params, run.data.tags
        val = next((f"{v:.3f}" for k, v in sorted(m.items()) if k.startswith("val/") and "/avg_at_" in k), "")
        table.add_row(
            run.info.run_id,
            run.info.run_name or "",
            t.get("stapoctl.kind", "train"),
            p.get("loss.name", ""),
            run.info.status,
            t.get("stapoctl.step", ""),
            f"{m['critic/score/mean']:.3f}" if "critic/score/mean" in m else "",
            val,
        )
    console.print(table)
    return runs


def compare_runs(
    uri: str | None,
    run_ids: Sequence[str],
    console: Console,
    metrics: Sequence[str] = DEFAULT_CURVES,
    out: str | None = None,
) -> Path:
    """Final values side by side and one PNG with a panel per metric (a line per run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow.exceptions import MlflowException

    client = _client(uri)
    runs = []
    for rid in run_ids:
        try:
            runs.append(client.get_run(rid))
        except MlflowException:
            raise UserError(f"run id '{rid}' not found in {tracking_uri(uri)}: see `stapoctl runs`") from None
    table = Table(title="final metrics")
    table.add_column("metric")
    for run in runs:
        table.add_column(run.info.run_name or run.info.run_id[:8])
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        finals = []
        for run in runs:
            hist = sorted(client.get_metric_history(run.info.run_id, metric), key=lambda h: h.step)
            if hist:
                ax.plot([h.step for h in hist], [h.value for h in hist], label=run.info.run_name or run.info.run_id[:8])
            finals.append(f"{hist[-1].value:.4g}" if hist else "—")
        table.add_row(metric, *finals)
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(out or f"compare_{'_'.join(r.info.run_id[:8] for r in runs)}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    console.print(table)
    console.print(f"curves written to [bold]{path}[/]")
    return path


def serve_ui(uri: str | None, host: str, port: int) -> int:
    """The MLflow UI on our store; bound to loopback unless the user asks otherwise."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", tracking_uri(uri),
        "--host", host, "--port", str(port), "--workers", "1",
    ]
    return subprocess.call(cmd, env=env)
