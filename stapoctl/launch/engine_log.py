"""A test-only hook: every engine start appended, as one JSON line, to the file that
`STAPOCTL_TEST_ENGINE_LOG` names (tests/conftest.py sets it for the whole session and prints the
starts after the run). `EngineLaunch.ready` calls `record_start` in whichever process is the
driver: pytest itself, a `stapoctl train` child, a Ray job or a SLURM job (`jobs/` forward the
variable), so starts outside the pytest process are counted too.

Starts that bypass `EngineLaunch.ready` record themselves with a `kind`: `stapoctl eval`'s
workers ("eval", eval/generation.py), the judge of `reward.model_verifier` ("judge") and the
test modules that build actors by hand ("fixture", tests/conftest.py `count_engine_start`).

The test that was running when the engines started is read from `<log>.current` (conftest
writes the running test's node id there). Unset, the hook does nothing: no file is opened.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

TEST_ENGINE_LOG = "STAPOCTL_TEST_ENGINE_LOG"


def forwarded() -> dict[str, str]:
    """The hook's variable for a job's environment where it is set ({} otherwise)."""
    return {TEST_ENGINE_LOG: os.environ[TEST_ENGINE_LOG]} if os.environ.get(TEST_ENGINE_LOG) else {}


def enabled() -> bool:
    """Whether the hook is on (callers skip the extra `info` round-trips it needs otherwise)."""
    return bool(os.environ.get(TEST_ENGINE_LOG))


def record_actors(kind: str, t0: float, workers=(), setup_refs=(), t_ray: float = 0.0) -> None:
    """A start that is not `EngineLaunch.ready`'s (eval's workers, a judge, a test's hand-built
    actors): waits for its vLLM actors' `info` and its learner ranks' set-up, then records the
    phases as `Engines.info` has them. Off (no wait, no file) unless the hook is set."""
    if not enabled():
        return
    import ray

    worker_info = ray.get([w.info.remote() for w in workers])
    learner_info = ray.get(list(setup_refs))
    record_start({"ray_s": t_ray, "vllm_init_s": max([w["init_s"] for w in worker_info], default=0.0),
                  "learner_setup_s": max([x["setup_s"] for x in learner_info], default=0.0),
                  "engines_s": time.perf_counter() - t0}, kind=kind)


def record_start(info: dict, log: Optional[str] = None, kind: str = "train") -> None:
    """Append `info` (an `Engines.info`) + its kind, pid, time and the running test to the hook's file."""
    path = log or os.environ.get(TEST_ENGINE_LOG)
    if not path:
        return
    test = ""
    try:
        with open(f"{path}.current", encoding="utf-8") as fh:
            test = fh.read().strip()
    except OSError:
        pass
    line = {**info, "kind": kind, "pid": os.getpid(), "time": time.time(), "test": test, "module": test.split("::", 1)[0]}
    try:
        with open(path, "a", encoding="utf-8") as fh:  # one short write: lines of concurrent drivers stay whole
            fh.write(json.dumps(line, default=str) + "\n")
    except OSError:
        pass  # a measurement only: never fails a run
