"""Session-wide fixtures.

`shared_home`: one STAPOCTL_HOME with one reduced warm-started tiny model, built once per test
session (~80 s) and shared by every engine test that trains or evaluates the embedded default.
Each test still keeps its own MLflow store and run dirs (pass `tracking.uri=` / output dirs under
tmp_path), so tests stay independent while the expensive build is paid once.
Developers iterating on engine tests can set STAPOCTL_TEST_HOME=<dir> to keep that model across
sessions (the build is cached by its config hash, so a stale model is never reused).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

# the real warm-start recipe, shortened: ~80 s to build; the model boxes some toy answers, so
# GRPO groups have non-zero advantages and a few RL steps have a real gradient
TINY_OVERRIDES = ["model.tiny.warm_start_steps=250", "data.toy.num_heldout=64"]
# ../shared/data beside the checkout; STAPOCTL_SHARED_DATA points a worktree elsewhere at it
SHARED_DATA = Path(os.environ.get("STAPOCTL_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")


@pytest.fixture(scope="session")
def shared_home(tmp_path_factory) -> SimpleNamespace:
    """home: the STAPOCTL_HOME; overrides: the Hydra overrides selecting its model; model_dir."""
    from stapoctl.config.compose import compose_config
    from stapoctl.models.tiny import ensure_base_model

    import os

    home = Path(os.environ["STAPOCTL_TEST_HOME"]) if os.environ.get("STAPOCTL_TEST_HOME") else \
        tmp_path_factory.mktemp("shared_home")
    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_HOME", str(home))
    try:
        conf = compose_config(TINY_OVERRIDES)
        model_dir = ensure_base_model(conf.model, conf.data)
    finally:
        mp.undo()
    return SimpleNamespace(home=Path(home), overrides=list(TINY_OVERRIDES), model_dir=Path(model_dir))
