"""`loss.modules` (#50 item 3): a method in the researcher's own module — one function, one typed config,
one registry line — composed, checked and resolved like a built-in one. The package is written under
tmp_path with a unique name per test; every test leaves LOSSES, LOSS_CONFIGS, Hydra's ConfigStore,
sys.path and sys.modules as it found them. The training run on the suite's engines (a rank that
imports it at set-up and reloads the edited file at a reset) is tests/test_loss_modules_e2e.py."""

from __future__ import annotations

import contextlib
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from test_bad_input import run_cli
from test_losses_methods import GROUPS, make_batch

from stapoctl.config import compose
from stapoctl.config.loss_modules import import_modules, load_on_rank, roots
from stapoctl.config.losses import LOSS_CONFIGS
from stapoctl.errors import UserError
from stapoctl.losses import LOSSES, compute_policy_loss

PREFIX = "lmtest_"


def method_source(loss: str, version: str) -> str:
    """What docs/LOSSES.md 'Adding a method in your own module' shows: the function, its config, the registry line."""
    return textwrap.dedent(f'''
        from dataclasses import dataclass

        from stapoctl.config.fields import spec
        from stapoctl.config.losses import AggFields
        from stapoctl.losses import register_loss
        from stapoctl.losses.pg import clipped_pg_loss


        @dataclass
        class MyClipConfig(AggFields):
            name: str = spec("{loss}", "registry key of the loss (loss=NAME)")
            my_bonus: float = spec(0.0, "added to the loss", range="[0, 1]")


        @register_loss("{loss}", MyClipConfig)
        def my_clip(batch, cfg):
            """DAPO's clipped surrogate plus a constant."""
            loss, metrics = clipped_pg_loss(batch, cfg)
            metrics["my_clip/version"] = {version}
            return loss + cfg.my_bonus, metrics
        ''')


def write_package(root: Path, version: str = "1.0", loss: str = "my_clip") -> str:
    """A package `lmtest_<hex>` under `root` whose `losses` module registers `loss`; its dotted name."""
    pkg = f"{PREFIX}{uuid.uuid4().hex[:10]}"
    (root / pkg).mkdir(parents=True)
    (root / pkg / "__init__.py").write_text("")
    (root / pkg / "losses.py").write_text(method_source(loss, version))
    return f"{pkg}.losses"


@contextlib.contextmanager
def restored():
    """Whatever was registered, put on sys.path or imported from the `lmtest_` packages inside is gone after."""
    losses, configs, path = dict(LOSSES), dict(LOSS_CONFIGS), list(sys.path)
    try:
        yield
    finally:
        _restore(losses, configs, path)


def _restore(losses: dict, configs: dict, path: list) -> None:
    added = (set(LOSSES) | set(LOSS_CONFIGS)) - set(losses)
    LOSSES.clear()
    LOSSES.update(losses)
    LOSS_CONFIGS.clear()
    LOSS_CONFIGS.update(configs)
    from hydra.core.config_store import ConfigStore

    for name in added:
        ConfigStore.instance().repo.get("loss", {}).pop(f"{name}.yaml", None)
        compose._stored_losses.pop(name, None)
    sys.path[:] = path
    for module in [m for m in sys.modules if m.startswith(PREFIX)]:
        del sys.modules[module]


@pytest.fixture(autouse=True)
def clean():
    with restored():
        yield


def policy_loss(name: str, cfg: dict):
    return compute_policy_loss(name, **make_batch(), **cfg, group_ids=torch.tensor(GROUPS), global_step=0)


def test_a_method_of_ones_own_module_composes_and_trains_like_a_built_in(tmp_path):
    module = write_package(tmp_path)
    sys.path.insert(0, str(tmp_path))  # PYTHONPATH
    with pytest.raises(UserError, match=r"unknown option 'loss=my_clip'.*loss\.modules=\[my_pkg\.my_losses\]"):
        compose.compose_config(["loss=my_clip"])  # not imported: the one line says how to name it

    cfg = compose.compose_config(["loss=my_clip", f"loss.modules=[{module}]", "loss.my_bonus=0.5"])

    assert cfg.loss.name == "my_clip" and list(cfg.loss.modules) == [module] and cfg.loss.my_bonus == 0.5
    assert compose.to_flat_dict(cfg)["loss.modules"] == [module]  # an MLflow param like every value
    from stapoctl.trainer.engine_settings import learner_args

    assert learner_args(cfg)["learner"]["loss_modules"] == [[module, str(tmp_path)]]
    with pytest.raises(UserError, match=r"loss\.my_bonus=2\.0 must lie in \[0, 1\]"):
        compose.compose_config(["loss=my_clip", f"loss.modules=[{module}]", "loss.my_bonus=2"])
    # the learner's call: the composed loss config as it ships to a rank, every field included
    from omegaconf import OmegaConf

    loss, metrics = policy_loss("my_clip", OmegaConf.to_container(cfg.loss, resolve=True))
    base, _ = policy_loss("dapo", {})
    assert metrics["my_clip/version"] == 1.0 and float(loss.detach()) == pytest.approx(float(base.detach()) + 0.5)


def test_a_module_that_cannot_be_imported_is_one_line(tmp_path, monkeypatch):
    missing = f"{PREFIX}{uuid.uuid4().hex[:10]}"
    with pytest.raises(UserError) as exc:
        compose.compose_config([f"loss.modules=[{missing}.losses]"])
    assert str(exc.value) == (f"loss.modules: cannot import '{missing}.losses' (ModuleNotFoundError: No module "
                              f"named '{missing}'): put its parent directory on PYTHONPATH or install it")
    # the module is there but fails: its own error, and what to fix
    (tmp_path / f"{missing}_bad.py").write_text("import lmtest_no_such_dependency\n")
    (tmp_path / f"{missing}_syntax.py").write_text("def f(:\n")
    sys.path.insert(0, str(tmp_path))
    with pytest.raises(UserError, match=r"No module named 'lmtest_no_such_dependency'\): install "
                                        r"'lmtest_no_such_dependency', which it imports$"):
        import_modules([f"{missing}_bad"])
    with pytest.raises(UserError, match=rf"cannot import '{missing}_syntax' \(SyntaxError: .*\): fix the module$"):
        import_modules([f"{missing}_syntax"])
    # through the CLI: exit 2, one line on stderr, no traceback, nothing started
    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "400")
    code, out, err = run_cli(["train", f"loss.modules=[{missing}.losses]"], monkeypatch)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err + out and len(lines) == 1, err
    assert lines[0] == f"error: {str(exc.value)}"
    assert not (tmp_path / "home" / "runs").exists()


def test_a_module_an_experiment_or_a_resumed_run_names_is_imported_before_the_check(tmp_path):
    """No `loss.modules=` on the command line (`resume=ID` alone): the config's own list is imported
    where the loss is looked up."""
    from omegaconf import OmegaConf

    from stapoctl.config.validate import _check_loss

    module = write_package(tmp_path)
    sys.path.insert(0, str(tmp_path))
    with pytest.raises(UserError, match="loss.name=my_clip: not a registered loss"):
        _check_loss(OmegaConf.create({"name": "my_clip", "my_bonus": 0.1}))
    assert module not in sys.modules

    _check_loss(OmegaConf.create({"name": "my_clip", "modules": [module], "my_bonus": 0.1}))

    assert module in sys.modules and LOSS_CONFIGS["my_clip"].__module__ == module


def test_a_reload_replaces_the_method_and_another_modules_name_is_refused(tmp_path):
    module = write_package(tmp_path)
    sys.path.insert(0, str(tmp_path))
    compose.compose_config(["loss=my_clip", f"loss.modules=[{module}]"])
    first_fn, first_cls = LOSSES["my_clip"].fn, LOSS_CONFIGS["my_clip"]
    assert policy_loss("my_clip", {})[1]["my_clip/version"] == 1.0
    # the researcher edits the method (another length too: a .pyc is stale by size or mtime)
    path = tmp_path / module.split(".")[0] / "losses.py"
    path.write_text(method_source("my_clip", "22.0").replace("0.0, \"added", "0.25, \"added"))

    load_on_rank([[module, str(tmp_path)]], rank=0)  # what a learner rank does at a reset

    assert LOSSES["my_clip"].fn is not first_fn and LOSS_CONFIGS["my_clip"] is not first_cls
    assert policy_loss("my_clip", {})[1]["my_clip/version"] == 22.0
    # the driver's ConfigStore follows the new config class (its new default)
    assert compose.compose_config(["loss=my_clip", f"loss.modules=[{module}]"]).loss.my_bonus == 0.25
    # another module registering the same name: refused, both named
    other = write_package(tmp_path)
    with pytest.raises(UserError) as exc:
        import_modules([other])
    assert str(exc.value).startswith(f"loss.modules: cannot import '{other}' (ValueError: loss 'my_clip' is "
                                     f"registered by {module} and again by {other}: rename one of them)")
    assert LOSSES["my_clip"].fn.__module__ == module
    with pytest.raises(UserError, match=f"registered by stapoctl.losses.pg and again by {PREFIX}"):
        import_modules([write_package(tmp_path, loss="dapo")])  # a built-in's name


@pytest.mark.parametrize("layout", ["package", "module"])
def test_a_rank_imports_the_module_from_the_root_the_driver_found_it_under(tmp_path, layout):
    """The rank's sys.path lacks the researcher's directory (a Ray worker started elsewhere)."""
    src = tmp_path / "src"
    src.mkdir()
    if layout == "package":
        module = write_package(src)
    else:
        module = f"{PREFIX}{uuid.uuid4().hex[:10]}"
        (src / f"{module}.py").write_text(method_source("my_clip", "3.0"))
    sys.path.insert(0, str(src))
    pairs = roots([module])  # the driver's side (learner_args)
    assert pairs == [[module, str(src)]]
    sys.path.remove(str(src))  # the rank's side: not on its path, never imported there
    for name in [m for m in sys.modules if m.startswith(PREFIX)]:
        del sys.modules[name]

    load_on_rank(pairs, rank=1)

    assert str(src) in sys.path and LOSSES["my_clip"].fn.__module__ == module
    with pytest.raises(UserError) as exc:
        load_on_rank([["lmtest_gone.losses", ""]], rank=2)
    assert str(exc.value) == ("loss.modules: cannot import 'lmtest_gone.losses' on learner rank 2 (ModuleNotFoundError: "
                              "No module named 'lmtest_gone'): put its parent directory on PYTHONPATH or install it "
                              "(at the same path on every node, or installed on every node)")


def test_a_ranks_error_at_a_reset_on_warm_engines_reaches_the_user_as_its_one_line(monkeypatch):
    """A UserError raised in a rank's `reset` comes back from ray.get as Ray's dual exception, whose text
    is the remote traceback: the session raises the rank's own one line instead."""
    import ray
    from ray.exceptions import RayTaskError

    from stapoctl.learner.group import LearnerGroup
    from stapoctl.trainer import engine_settings, session

    line = "loss.modules: cannot import 'x.y' on learner rank 0 (ModuleNotFoundError: No module named 'x')"
    remote = RayTaskError("reset", "Traceback (most recent call last):\n  File ...\nUserError: " + line,
                          UserError(line)).as_instanceof_cause()
    assert isinstance(remote, UserError) and "\n" in str(remote)  # what the CLI would print otherwise

    def get(refs, *a, **k):
        raise remote

    learner = type("Handle", (), {"reset": type("M", (), {"remote": staticmethod(lambda *a, **k: None)})})
    pool = session.EngineSession()
    pool.engines, pool.key = type("E", (), {"learners": LearnerGroup([learner]), "stall": None, "info": {}})(), "k"
    monkeypatch.setattr(session, "engine_key", lambda *a: "k")
    monkeypatch.setattr(pool, "_ensure_scorer", lambda conf: None)
    monkeypatch.setattr(engine_settings, "learner_args", lambda conf, ref: {"learner": {}, "loss": {}})
    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(UserError) as exc:
        pool.acquire(None, "policy")
    assert str(exc.value) == line and not isinstance(exc.value, RayTaskError)
