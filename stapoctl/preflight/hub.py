"""A Hugging Face hub model or dataset that this machine can neither find in its HF cache nor
download: one line before Ray starts, instead of ~75 lines of HF retries and a traceback from
inside the engines (compute nodes of a cluster often have no internet).

"Offline" is HF_HUB_OFFLINE set, or the hub endpoint not answering a HEAD within `PROBE_S`
seconds (probed once per process, on a thread, so a hanging DNS lookup cannot hold it longer).
An online machine with hub access is left to download as before.
"""

from __future__ import annotations

import functools
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from stapoctl.errors import UserError

PROBE_S = 3.0
_TRUE = {"1", "ON", "YES", "TRUE"}


def looks_like_hub_id(spec: str) -> bool:
    """ORG/NAME that is not a local path (the rule `models.resolve.resolve_model` applies)."""
    from stapoctl.models.resolve import _HUB_ID

    spec = (spec or "").strip()
    return bool(_HUB_ID.match(spec)) and not Path(spec).expanduser().exists()


def hub_cache() -> Path:
    """Where huggingface_hub looks, read at call time (its constants are fixed at import)."""
    from huggingface_hub import constants

    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def check_hub_model(spec: str, key: str) -> None:
    """A hub model id must be in the HF cache (config.json of a snapshot) or downloadable now."""
    if not looks_like_hub_id(spec):
        return
    from huggingface_hub import try_to_load_from_cache

    cache = hub_cache()
    if isinstance(try_to_load_from_cache(spec.strip(), "config.json", cache_dir=str(cache)), str):
        return
    reason = offline_reason()
    if reason:
        raise UserError(
            f"{key}={spec}: not in the Hugging Face cache {cache} and {reason}: download it on a machine "
            f"with hub access (`huggingface-cli download {spec}`), set HF_HOME to a cache that has it, "
            "or give a local model dir"
        )


def check_hub_dataset(hub_id: str, key: str) -> None:
    """A hub dataset must be in the hub cache or the `datasets` cache, or downloadable now."""
    cache = hub_cache()
    in_hub = any((cache / f"datasets--{hub_id.replace('/', '--')}" / "snapshots").glob("*"))
    datasets_home = os.environ.get("HF_DATASETS_CACHE") or str(cache.parent / "datasets")
    if in_hub or (Path(datasets_home).expanduser() / hub_id.replace("/", "___")).is_dir():
        return
    reason = offline_reason()
    if reason:
        raise UserError(
            f"{key}: the hub dataset {hub_id} is not in the Hugging Face cache {cache} and {reason}: run "
            f"`stapoctl data prep` on a machine with hub access and copy the data dir, set HF_HOME to a cache "
            "that has it, or give a local file (data.source / data.root)"
        )


def offline_reason() -> Optional[str]:
    """Why the hub cannot be reached now ("HF_HUB_OFFLINE is set", ...), or None."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE:
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    return _probe(constants.ENDPOINT)


@functools.lru_cache(maxsize=4)
def _probe(endpoint: str) -> Optional[str]:
    """HEAD the endpoint; any HTTP answer (even 4xx) means reachable. At most PROBE_S seconds."""
    result: list = ["the hub (" + endpoint + f") did not answer within {PROBE_S:g} s"]

    def head() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=PROBE_S).close()
            result[0] = None
        except urllib.error.HTTPError:
            result[0] = None
        except Exception as exc:  # DNS failure, refused, TLS, timeout: all "cannot reach it"
            result[0] = f"the hub ({endpoint}) cannot be reached ({type(exc).__name__})"

    thread = threading.Thread(target=head, name="stapoctl-hub-probe", daemon=True)
    thread.start()
    thread.join(PROBE_S)
    return result[0] if not thread.is_alive() else f"the hub ({endpoint}) did not answer within {PROBE_S:g} s"
