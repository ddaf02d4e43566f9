"""Sweep definitions (`sweeps/NAME.yaml`) and the `stapoctl sweep NAME key=value …` command line.

A definition names an experiment, one swept Hydra key with its values, and seeds:

    experiment: tiny          # default tiny
    key: loss.tau_p           # `loss` sweeps methods (loss=grpo, loss=stapo, …)
    values: [2e-3, 2e-2, 2e-1]
    seeds: [0, 1, 2]          # default [0, 1, 2]; each sets trainer.seed
    overrides: []             # optional Hydra overrides for every trial

A value may carry overrides of its own, applied to its trials only (docs/SWEEPS.md):
`{value: dapo_full, set: [loss=dapo, trainer.dynamic_sampling=true]}`. When `set` sets the
swept key itself, the value is only the trials' label (run name, tag, row of `compare`).

Values are kept as written (`2e-3`, not 0.002): they become the trial's Hydra override, its
tag and its run name, so what the user typed is what the MLflow UI shows.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import yaml

from stapoctl import paths
from stapoctl.config import overrides as ov
from stapoctl.errors import UserError

FILE_FIELDS = ("experiment", "key", "values", "seeds", "overrides", "description")
VALUE_FIELDS = ("value", "set")  # a value entry with overrides of its own: {value: NAME, set: [k=v, …]}
# key=value words of the command line that belong to the sweep, not to Hydra
OPTIONS = ("values", "seeds", "resume", "force", "max_parallel", "confirm", "max_seeds", "delta")
# what the sweep itself sets in every trial: the command line may not set them too
SEED_KEY = "trainer.seed"
OWNED_KEYS = (SEED_KEY, "tracking.parent_run_id", "tracking.run_name", "tracking.tags", "resume")
# top-level config names a bare `word=` may mean (so `valuse=` is caught as a sweep typo)
_CONFIG_ROOTS = ("experiment", "resume", "model", "data", "loss", "rollout", "learner", "reward", "eval",
                 "tracking", "cluster", "trainer")


def sweeps_dir() -> Path:
    """Sweep files; STAPOCTL_SWEEPS lets a user keep their own elsewhere."""
    return Path(os.environ.get("STAPOCTL_SWEEPS") or paths.project_root() / "sweeps")


def available_sweeps() -> list[str]:
    root = sweeps_dir()
    return sorted(p.stem for p in root.glob("*.yaml")) if root.is_dir() else []


@dataclass(frozen=True)
class SweepDefinition:
    """What one sweep runs: every (value, seed) of `key`, with `overrides` on top of `experiment`."""

    name: str
    key: str
    values: tuple[str, ...]
    experiment: str = "tiny"
    seeds: tuple[int, ...] = (0, 1, 2)
    overrides: tuple[str, ...] = ()
    description: str = ""
    # (value, its own overrides) for the values that carry some, in the order of `values`
    value_overrides: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def overrides_of(self, value: str) -> tuple[str, ...]:
        """The overrides `value` carries for its own trials (none for a plain value)."""
        return dict(self.value_overrides).get(value, ())

    def with_values(self, values: tuple[str, ...]) -> "SweepDefinition":
        """Other values (`values=[…]` on the command line): a value the file gives overrides keeps them."""
        return replace(self, values=values, value_overrides=tuple(
            (v, own) for v, own in self.value_overrides if v in values))

    def to_yaml(self) -> str:
        """The resolved definition (the parent run's `sweep.yaml`); `from_yaml` reads it back."""
        d = asdict(self)
        del d["value_overrides"]
        sets = dict(self.value_overrides)
        d["values"] = [{"value": v, "set": list(sets[v])} if v in sets else v for v in self.values]
        d["seeds"], d["overrides"] = list(self.seeds), list(self.overrides)
        return yaml.safe_dump(d, sort_keys=False, default_flow_style=None, width=1000)

    @classmethod
    def from_yaml(cls, text: str, name: str, where: str) -> "SweepDefinition":
        return _from_mapping(_load_yaml(text, where), name, where)


@dataclass(frozen=True)
class SweepCommand:
    """A parsed `stapoctl sweep` command line."""

    definition: SweepDefinition
    resume: Optional[str] = None
    force: bool = False
    # which parts the command line set (a resume checks them against the recorded sweep)
    given: frozenset = field(default_factory=frozenset)
    cli_overrides: tuple[str, ...] = ()
    # trials running at once (None: the backend's default — 1 here, all on a Ray job server, the
    # preset's cluster.array_parallelism on SLURM); where they run, not what they compute
    max_parallel: Optional[int] = None
    # a confirmatory sweep (sweep/confirm.py): the pilot sweep sizing it, the most seeds a row may
    # take, and the difference (table units) powered for instead of the pilot's observed one
    confirm: Optional[str] = None
    max_seeds: Optional[int] = None
    delta: Optional[float] = None


def load_definition(name: str) -> SweepDefinition:
    """`sweeps/<name>.yaml`, checked field by field."""
    path = sweeps_dir() / f"{name.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        have = available_sweeps()
        near = difflib.get_close_matches(name, have, n=1, cutoff=0.5)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise UserError(f"no sweep '{name}' in {sweeps_dir()}{hint} (available: {', '.join(have) or 'none'})")
    return SweepDefinition.from_yaml(path.read_text(), path.stem, str(path))


def parse_command(name: str, args: list[str]) -> SweepCommand:
    """`values=[…]`, `seeds=[…]`, `resume=ID`, `force=true`, `max_parallel=K`, `confirm=PILOT`,
    `max_seeds=N`, `delta=D` are the sweep's; `experiment=` replaces the file's experiment; every
    other word is a Hydra override applied to every trial."""
    definition = load_definition(name)
    given: set[str] = set()
    opts: dict[str, Any] = {}
    cli: list[str] = []
    for item in args:
        o = ov.parse(item, "argument", "values=[2e-3,2e-2] or loss.lr=1e-6")
        key, value = (o.key, o.value) if o.kind == ov.SET else ("", "")  # the sweep's words are plain
        if key == "values":
            definition = definition.with_values(_values(value, "values"))
        elif key == "seeds":
            definition = replace(definition, seeds=_seeds(value, "seeds"))
        elif key == "experiment":
            definition = replace(definition, experiment=value)
        elif key in _COMMAND_OPTIONS:
            opts[key] = _COMMAND_OPTIONS[key](value, key)
            continue
        else:
            _check_override(o.key, definition)
            cli.append(item)
            given.add("overrides")
            continue
        given.add(key)
    if cli:
        definition = replace(definition, overrides=definition.overrides + tuple(cli))
    command = SweepCommand(definition, given=frozenset(given), cli_overrides=tuple(cli), **opts)
    _check_confirm(command)
    return command


def _check_confirm(command: SweepCommand) -> None:
    """confirm= sizes its own fresh seeds and is a new sweep; max_seeds= / delta= belong to it."""
    if command.confirm is None:
        extra = [k for k in ("max_seeds", "delta") if getattr(command, k) is not None]
        if extra:
            raise UserError(f"{extra[0]}= sizes a confirmatory sweep: give confirm=PILOT_SWEEP_ID too "
                            f"(e.g. confirm=1a2b3c4d {extra[0]}=…)")
        return
    if command.resume:
        raise UserError("confirm= and resume= together: a resume runs the recorded (already sized) sweep; "
                        "drop confirm=")
    if "seeds" in command.given:
        raise UserError("seeds= and confirm= together: a confirmatory sweep sizes its own seeds (fresh ones, "
                        "never the pilot's); drop seeds= (max_seeds=N caps them)")


def _sweep_id(value: str, what: str) -> str:
    spec = value.strip()
    if not spec:
        raise UserError(f"{what}= needs the sweep id (the parent run id, or a unique prefix of it)")
    return spec


def _positive_float(value: str, what: str) -> float:
    try:
        number = float(value.strip())
    except ValueError:
        number = 0.0
    if not number > 0 or number == float("inf"):
        raise UserError(f"{what}={value}: give the difference to power for in table units (points for "
                        f"accuracy), a number > 0 (e.g. {what}=3)")
    return number


def _at_least_two(value: str, what: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        number = 0
    if number < 2:
        raise UserError(f"{what}={value}: a row needs at least 2 seeds to have a spread (e.g. {what}=12)")
    return number


def override_key(item: str) -> str:
    return ov.key_of(item)


def _check_override(bare: str, definition: SweepDefinition) -> None:
    if "." not in bare and bare not in _CONFIG_ROOTS:
        near = difflib.get_close_matches(bare, OPTIONS, n=1, cutoff=0.6)
        if near:
            raise UserError(f"unknown sweep option '{bare}'; did you mean '{near[0]}'? "
                            f"(sweep options: {', '.join(OPTIONS)}; anything else is a Hydra override)")
    if bare == definition.key:
        raise UserError(f"{bare} is the key sweep '{definition.name}' varies: give its values as "
                        f"values=[…] instead of {bare}=…")
    if bare in OWNED_KEYS:
        what = {SEED_KEY: "seeds=[…] instead", "resume": "resume=SWEEP_ID for the sweep",
                "tracking.tags": "+tracking.tags.NAME=VALUE to add a tag"}.get(bare, "no override of it")
        raise UserError(f"{bare} is set by the sweep for each trial; use {what}")


# -- parsing helpers -------------------------------------------------------------------------
def _load_yaml(text: str, where: str) -> Any:
    # BaseLoader keeps every scalar a string: values stay as written (YAML 1.1 reads 2e-3 as a
    # string but 2.0e-3 as a float; here both stay what the user typed)
    try:
        return yaml.load(text, Loader=yaml.BaseLoader)
    except yaml.YAMLError as exc:
        raise UserError(f"{where}: not valid YAML ({str(exc).splitlines()[0]})") from None


def _swept_key(text: str, where: str) -> str:
    """The file's `key:` as Hydra reads a key; each trial sets it (`key=value`), so no prefix."""
    o = ov.parse(f"{text.strip()}=_", f"{where}: key")
    if o.kind != ov.SET or o.package is not None:
        raise UserError(f"{where}: key '{text.strip()}' must be a plain Hydra key such as loss.tau_p "
                        f"(each trial sets it as key=value): drop the +, ++, ~ or @package")
    return o.key


def _from_mapping(raw: Any, name: str, where: str) -> SweepDefinition:
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping with key:, values:, seeds: (see docs/SWEEPS.md)")
    for k in raw:
        if k not in FILE_FIELDS and k != "name":
            near = difflib.get_close_matches(k, FILE_FIELDS, n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise UserError(f"{where}: unknown field '{k}'{hint} (fields: {', '.join(FILE_FIELDS)})")
    if not isinstance(raw.get("key"), str) or not raw["key"].strip():
        raise UserError(f"{where}: 'key' must name the swept Hydra key, e.g. key: loss.tau_p (or key: loss)")
    if "values" not in raw:
        raise UserError(f"{where}: 'values' is missing: list the values of {raw['key']}, e.g. values: [2e-3, 2e-2]")
    overrides = raw.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise UserError(f"{where}: 'overrides' must be a list of key=value Hydra overrides")
    ov.parse_all(overrides, f"{where}: override")
    values, value_overrides = _value_entries(raw["values"], f"{where}: values")
    return SweepDefinition(
        name=str(raw.get("name") or name),
        key=_swept_key(raw["key"], where),
        values=values,
        value_overrides=value_overrides,
        experiment=str(raw.get("experiment") or "tiny"),
        seeds=_seeds(raw["seeds"], f"{where}: seeds") if "seeds" in raw else (0, 1, 2),
        overrides=tuple(overrides),
        description=str(raw.get("description") or ""),
    )


def _value_entries(value: Any, what: str) -> tuple[tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...]]:
    """A file's values: plain ones, or `{value: NAME, set: [key=value, …]}` entries whose
    overrides apply to that value's trials only. Returns (values, (value, overrides) pairs)."""
    if not isinstance(value, list):
        return _values(value, what), ()
    names: list[Any] = []
    sets: list[tuple[str, tuple[str, ...]]] = []
    for item in value:
        if isinstance(item, dict):
            name, own = _value_entry(item, what)
            sets += [(name, own)] if own else []
            item = name
        names.append(item)
    return _values(names, what), tuple(sets)


def _value_entry(item: dict, what: str) -> tuple[str, tuple[str, ...]]:
    """One `{value: NAME, set: [...]}` entry, checked: a name, Hydra overrides, none of them of a
    key the sweep sets itself (experiment, seed, tracking names and tags), no key twice."""
    form = "{value: NAME, set: [key=value, …]}"
    for k in item:
        if k not in VALUE_FIELDS:
            near = difflib.get_close_matches(str(k), VALUE_FIELDS, n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise UserError(f"{what}: unknown field '{k}' in a value entry{hint} (an entry is {form})")
    name = item.get("value")
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"{what}: a value entry needs value: NAME, e.g. {{value: dapo_full, set: [loss=dapo]}}")
    name, own = name.strip(), item.get("set") or []
    if not isinstance(own, list) or not all(isinstance(o, str) for o in own):
        raise UserError(f"{what}: the set of value '{name}' must be a list of key=value Hydra overrides, "
                        "e.g. set: [loss=dapo, trainer.dynamic_sampling=true]")
    seen: set[str] = set()
    for item_ in own:
        key = ov.parse(item_.strip(), f"{what}: the set of value '{name}' must be a list of key=value Hydra "
                       "overrides:", "loss=dapo").key
        if key == "experiment" or key in OWNED_KEYS:
            raise UserError(f"{what}: value '{name}' sets {key}, which the sweep sets for every trial: "
                            "drop it from its set")
        if key in seen:
            raise UserError(f"{what}: value '{name}' sets {key} twice")
        seen.add(key)
    return name, tuple(o.strip() for o in own)


def _as_list(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        text = value.strip()
        parsed = _load_yaml(text, what) if text.startswith("[") else [v for v in text.split(",")]
        value = parsed
    if not isinstance(value, list) or any(isinstance(v, (list, dict)) for v in value):
        raise UserError(f"{what}: expected a flat list, e.g. [2e-3, 2e-2]")
    return [str(v).strip() for v in value]


def _values(value: Any, what: str) -> tuple[str, ...]:
    items = _as_list(value, what)
    if not items or any(not v for v in items):
        raise UserError(f"{what}: give at least one non-empty value, e.g. values=[2e-3,2e-2]")
    dup = next((v for i, v in enumerate(items) if v in items[:i]), None)
    if dup is not None:
        raise UserError(f"{what}: '{dup}' appears twice")
    return tuple(items)


def _seeds(value: Any, what: str) -> tuple[int, ...]:
    items = _as_list(value, what)
    try:
        seeds = tuple(int(v) for v in items)
    except ValueError:
        raise UserError(f"{what}: expected integers, e.g. seeds=[0,1,2] (got {items})") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise UserError(f"{what}: give distinct integer seeds, e.g. seeds=[0,1,2]")
    return seeds


def _positive_int(value: str, what: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        number = 0
    if number < 1:
        raise UserError(f"{what}={value}: give the number of trials to run at once, an integer >= 1 "
                        f"(e.g. {what}=2)")
    return number


def _bool(value: str, what: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise UserError(f"{what}={value}: use true or false")


# the command-line words that set a SweepCommand field: word → its parser
_COMMAND_OPTIONS = {"resume": _sweep_id, "force": _bool, "max_parallel": _positive_int, "confirm": _sweep_id,
                    "max_seeds": _at_least_two, "delta": _positive_float}
