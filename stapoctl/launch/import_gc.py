"""Heavy imports with Python's cyclic GC paused, their survivors frozen afterwards.

Importing vLLM, transformers or DeepSpeed creates hundreds of thousands of long-lived objects
(modules, classes, pydantic models). With the GC on, every few thousand allocations trigger a
collection that walks all of them again, and vLLM's engine init calls `gc.collect()` itself
five times. Measured here (2 cores, tiny model, in-process vLLM engine): import + `LLM(...)`
took 19.5-22.7 s as is and 15.6-15.8 s with the imports under `paused_gc()`, the engine init
alone 4.3-5.5 s → 2.2 s (`docs/PERFORMANCE.md`, engine start-up).

Only imports go in here: module-level objects live as long as the process anyway, so freezing
them (`gc.freeze`, moving them out of every later collection) changes no lifetime. An engine
built inside the block would be frozen too and never collected after `shutdown`, which matters
for processes that build several (evaluation, tests). For the same reason the block does
nothing once the modules it names are loaded: a second freeze would gain nothing and would
also freeze whatever garbage is pending then, e.g. an engine shut down a moment before.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
from typing import Iterator

# give frozen objects back to the interpreter's final collection; extension modules (triton's
# nanobind) otherwise report them as leaked at exit. Harmless when nothing was frozen.
atexit.register(gc.unfreeze)

# Imported by a library at import time but never used by an engine actor, each behind the library's
# own "is it installed?" check. `sys.modules[name] = None` is Python's own way to say "not
# installed": `importlib.util.find_spec` then answers None and `import name` raises ImportError,
# so the library takes its path for a missing package.
# - scikit-learn: transformers imports it (0.3-0.4 s here) only for assisted generation's candidate
#   heuristics, and the actors generate with vLLM.
# - scipy: transformers' object-detection losses (`if is_scipy_available()`) and vLLM's audio
#   resampler (`try: import scipy.signal`), in both actors; neither runs here.
# - MLflow (and pandas with it): DeepSpeed's autotuner (`try: import mlflow`) in the learner; the
#   driver alone logs to MLflow.
# CPU seconds of the imports, 3 fresh processes each: vLLM actor 9.45 -> 8.26 s, learner rank
# 6.20 -> 4.69 s (the step of `_startup.py` in docs/PERFORMANCE.md, "Start-up").
UNUSED_IN_ENGINES = ("sklearn", "scipy", "mlflow")


def skip_unused_imports() -> None:
    """In an engine actor's process, before its heavy imports (`ray_runtime.in_ray_actor`): not in
    a driver or a test process, which may need the module (TRL's trainers import scikit-learn).
    A module already loaded stays loaded."""
    for name in UNUSED_IN_ENGINES:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


@contextlib.contextmanager
def paused_gc(*modules: str) -> Iterator[None]:
    """`modules`: what the block imports; when all are loaded already, the block runs as is."""
    if modules and all(name in sys.modules for name in modules):
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
