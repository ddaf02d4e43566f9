"""`loss.modules`: the researcher's own modules, imported before a loss is resolved, so a method
registered there (`stapoctl.losses.register_loss`) trains like a built-in one.

The driver imports them before Hydra composes `loss=NAME` (the group's option must exist by then:
`requested` reads them off the command line) and again where a config names them (`_check_loss` of
`config.validate`: an experiment's list, a resumed run's saved config). Each learner rank imports
them at its set-up and at every reset (`load_on_rank`), reloading one an earlier run imported, so
an edited method takes effect on warm engines. A rank's `sys.path` may lack the researcher's
directory (a Ray worker starts elsewhere): the driver sends, with each module, the `sys.path` entry
it found it under (`roots`). Here in `config` the loss library is never imported statically; the
user's module imports it itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, Iterable, Sequence

from stapoctl.errors import UserError

KEY = "loss.modules"


def requested(overrides: Iterable[str]) -> list[str]:
    """The modules a `loss.modules=[...]` override names (the last one wins, as in Hydra)."""
    from stapoctl.config import overrides as ov

    names: list[str] = []
    for item in overrides:
        o = ov.parse(item)
        if o.key == KEY and o.kind != ov.DELETE:
            value = ov._parser().parse_overrides([item])[0].value()  # Hydra's typed value: a list
            names = [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return names


def import_modules(names: Iterable[str], *, reload: bool = False, where: str = "") -> None:
    """Import each module (reload an imported one when `reload`); any failure is one line naming it."""
    names = list(names)
    if names:
        importlib.invalidate_caches()  # a module written since this process last looked
    for name in names:
        try:
            module = sys.modules.get(name)
            if module is None:
                importlib.import_module(name)
            elif reload:
                importlib.reload(module)
        except Exception as exc:  # the researcher's code: a missing module, a syntax error, a name clash
            raise UserError(_failure(name, exc, where)) from None


def _failure(name: str, exc: BaseException, where: str) -> str:
    lines = str(exc).strip().splitlines()
    cause = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing and (name == missing or name.startswith(missing + ".")):  # the module itself is not found
        fix = "put its parent directory on PYTHONPATH or install it"
        if where:
            fix += " (at the same path on every node, or installed on every node)"
    else:  # the module was found and failed: what it imports, or its own code
        fix = f"install {missing!r}, which it imports" if missing else "fix the module"
    return f"{KEY}: cannot import {name!r}{where} ({cause}): {fix}"


def _root(name: str) -> str:
    """The `sys.path` entry the module's top-level package or module was found under ('' if none)."""
    top = name.partition(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return ""
    if spec is None:
        return ""
    if spec.submodule_search_locations:  # a package (or namespace package): the directory holding it
        return os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))
    if spec.has_location and spec.origin:
        return os.path.dirname(os.path.abspath(spec.origin))
    return ""


def roots(names: Sequence[Any]) -> list[list[str]]:
    """[module, the directory to put on a rank's sys.path] for each module (the driver's view)."""
    return [[str(name), _root(str(name))] for name in names]


def load_on_rank(pairs: Sequence[Sequence[str]], rank: int) -> None:
    """A learner rank, before it resolves the loss (set-up, every reset): each module's directory
    on sys.path if missing, then each module imported, or reloaded when an earlier run imported it."""
    for _, root in pairs:
        if root and root not in sys.path:
            sys.path.append(root)  # after the rank's own entries: nothing it already imports is shadowed
    import_modules([name for name, _ in pairs], reload=True, where=f" on learner rank {rank}")
