"""`stapoctl tokens RUN [--step N] [--open]`: where a run's per-token trace page is — a file on this
machine (the run dir's copy, else downloaded from the store) and its MLflow UI link."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from rich.console import Console

from stapoctl.errors import UserError
from stapoctl.tracking import keys
from stapoctl.tracking.token_page import FILE

_STEP = re.compile(r"step_(\d+)$")


def page_steps(client, run_id: str) -> list[int]:
    """The diagnostics steps of a run that hold a trace page, ascending."""
    steps = []
    for entry in client.list_artifacts(run_id, keys.DIAGNOSTICS_DIR):
        m = _STEP.search(entry.path)
        if entry.is_dir and m and any(a.path.endswith("/" + FILE) for a in client.list_artifacts(run_id, entry.path)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def locate(uri: Optional[str], run: str, step: Optional[int] = None, port: int = 5000) -> tuple[Path, str, int]:
    """(local path, MLflow UI link, step) of the page; one-line UserError when there is none."""
    import tempfile

    from stapoctl.tracking.run_ids import resolve_run_id
    from stapoctl.tracking.store_init import client as store_client
    from stapoctl.tracking.mlflow_run import tracking_uri

    run_id = resolve_run_id(run, uri, what="tokens")
    client = store_client(tracking_uri(uri))
    found = client.get_run(run_id)
    steps = page_steps(client, run_id)
    if not steps:
        raise UserError(f"tokens {run}: the run has no {keys.DIAGNOSTICS_DIR}/step_N/{FILE} yet (written every "
                        "trainer.diagnostics_every steps; a run from before the page has none)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise UserError(f"tokens {run} --step {step}: no page at that step; steps with one: "
                        + ", ".join(map(str, steps)))
    rel = f"{keys.DIAGNOSTICS_DIR}/step_{step:06d}/{FILE}"
    local = Path(found.data.tags.get(keys.RUN_DIR, "")) / rel
    if not found.data.tags.get(keys.RUN_DIR) or not local.is_file():
        local = Path(client.download_artifacts(run_id, rel, tempfile.mkdtemp(prefix="stapoctl-tokens-")))
    eid = found.info.experiment_id
    link = f"http://127.0.0.1:{port}/#/experiments/{eid}/runs/{run_id}/artifactPath/{rel}"
    return local, link, step


def show_tokens(uri: Optional[str], run: str, step: Optional[int], open_page: bool, console: Console) -> Path:
    """Print where the page is; `open_page`: open the local copy in the browser."""
    local, link, step = locate(uri, run, step)
    console.print(f"token trace of step {step}: {local}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"in the MLflow UI (`stapoctl ui` running): {link}", highlight=False, markup=False, soft_wrap=True)
    if open_page:
        import webbrowser

        if not webbrowser.open(local.resolve().as_uri()):
            console.print("no browser found here: open the file above", style="yellow", highlight=False)
    return local
