"""Run ids as people type them: git-style short prefixes, resolved in one place.

`stapoctl runs` prints the shortest prefix (at least 7 hex digits) that is unique in the
store; `compare`, `eval --model`, `train resume=` and `ui --run` accept it, or the full id.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Optional

from stapoctl.errors import UserError
from stapoctl.tracking import keys

MIN_SHORT = 7
_RUN_ID = re.compile(r"^[0-9a-f]{%d,32}$" % MIN_SHORT)


def looks_like_run_id(spec: str) -> bool:
    """Full (32 hex) or short (≥ 7 hex) MLflow run id."""
    return bool(_RUN_ID.match((spec or "").strip()))


def short_ids(run_ids: Iterable[str], min_len: int = MIN_SHORT) -> dict[str, str]:
    """id → its shortest prefix of at least min_len that no other of run_ids shares."""
    ids = sorted(set(run_ids))
    out = {}
    for i, rid in enumerate(ids):
        # in sorted order the longest common prefix with any other id is with a neighbour
        common = 0
        for j in (i - 1, i + 1):
            if 0 <= j < len(ids):
                other = ids[j]
                n = 0
                while n < min(len(rid), len(other)) and rid[n] == other[n]:
                    n += 1
                common = max(common, n)
        out[rid] = rid[: max(min_len, common + 1)]
    return out


def _client(uri: Optional[str]):
    from stapoctl.tracking.mlflow_run import tracking_uri
    from stapoctl.tracking.store_init import client

    return client(tracking_uri(uri))


def resolve_run_id(spec: str, uri: Optional[str] = None, what: str = "run id") -> str:
    """The full run id for a full or short one; a one-line UserError naming `what` otherwise."""
    from mlflow.exceptions import MlflowException

    from stapoctl.tracking.mlflow_run import tracking_uri

    value = (spec or "").strip().lower()
    store = tracking_uri(uri)
    if not looks_like_run_id(value):
        raise UserError(f"{what} '{spec}': not a run id (7 to 32 hex digits, as `stapoctl runs` prints them)")
    client = _client(uri)
    if len(value) == 32:
        try:
            return client.get_run(value).info.run_id
        except MlflowException:
            raise UserError(f"{what} '{spec}': no such MLflow run in {store}: see `stapoctl runs` "
                            "(or set tracking.uri / MLFLOW_TRACKING_URI to the store it was logged in)") from None
    from mlflow.entities import ViewType

    exps = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    found = client.search_runs(exps, filter_string=f"attributes.run_id LIKE '{value}%'", max_results=10,
                               run_view_type=ViewType.ALL) if exps else []
    if not found:
        raise UserError(f"{what} '{spec}': no such MLflow run (no run id starts with it) in {store}: "
                        "see `stapoctl runs` "
                        "(or set tracking.uri / MLFLOW_TRACKING_URI to the store it was logged in)")
    if len(found) > 1:
        names = ", ".join(f"{r.info.run_id} ({r.info.run_name})" for r in found[:4])
        raise UserError(f"{what} '{spec}' is ambiguous: {len(found)} runs start with it ({names}); type more digits")
    return found[0].info.run_id


def run_dir_of(spec: str, uri: Optional[str] = None, what: str = "run id") -> Path:
    """A training run's directory (its `stapoctl.run_dir` tag) from a full or short run id."""
    run_id = resolve_run_id(spec, uri, what)
    run = _client(uri).get_run(run_id)
    run_dir = run.data.tags.get(keys.RUN_DIR)
    if not run_dir:
        raise UserError(f"{what} '{spec}': MLflow run {run_id} has no '{keys.RUN_DIR}' tag "
                        "(not a stapoctl training run)")
    return Path(run_dir)
