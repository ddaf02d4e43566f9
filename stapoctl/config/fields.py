"""Valid values declared next to a config field: a range in interval notation or a set of choices.

    tau_p: float = spec(2e-3, "S2T threshold", range="(0, 1]")
    decoding: str = spec("both", choices=("train", "justrl", "both"))

The loss configs check their fields on construction and `config.validate` checks a composed
run config with the same declarations, so a new loss (or schema field) states its range once.
A subclass that only changes a field's default keeps the range its base class declared.
Dependency-free on purpose: `losses/` (pure torch) imports it.
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, field, fields, is_dataclass
from typing import Any, Iterator, Optional, Sequence

_INTERVAL = re.compile(r"^\s*([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])\s*$")


def spec(default: Any = MISSING, help: str = "", *, range: Optional[str] = None,
         choices: Optional[Sequence[Any]] = None, why: Optional[str] = None,
         default_factory: Any = MISSING) -> Any:
    """A dataclass field carrying its help text and its valid values (`why`: the reason, shown
    when a value is refused)."""
    metadata: dict[str, Any] = {"help": help}
    if why:
        metadata["why"] = why
    if range is not None:
        parse_interval(range)  # a typo in a declaration fails at import, not at the user
        metadata["range"] = range
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def parse_interval(text: str) -> tuple[bool, float, float, bool]:
    """'(0, 1]' → (low closed?, low, high, high closed?); 'inf' / '-inf' for open ends."""
    m = _INTERVAL.match(text)
    if not m:
        raise ValueError(f"bad interval {text!r}: write e.g. '(0, 1]' or '[1, inf)'")
    return m.group(1) == "[", float(m.group(2)), float(m.group(3)), m.group(4) == "]"


def in_interval(value: float, text: str) -> bool:
    low_closed, low, high, high_closed = parse_interval(text)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return False
    above = value >= low if low_closed else value > low
    below = value <= high if high_closed else value < high
    return above and below


def constraint(cls: type, name: str) -> dict[str, Any]:
    """The range / choices declared for `name`, by the class or the nearest base that declares one."""
    for klass in cls.__mro__:
        declared = getattr(klass, "__dataclass_fields__", {}).get(name)
        if declared is not None and ("range" in declared.metadata or "choices" in declared.metadata):
            return {k: declared.metadata[k] for k in ("range", "choices", "why") if k in declared.metadata}
    return {}


def problem(cls: type, name: str, value: Any) -> Optional[str]:
    """Why `value` is not valid for field `name` of `cls` ("must lie in (0, 1]"), else None.

    None is valid for Optional fields: their range applies to the value when one is given.
    """
    rule = constraint(cls, name)
    if value is None or not rule:
        return None
    if "choices" in rule and value not in rule["choices"]:
        options = [str(c) for c in rule["choices"]]
        return "must be " + (", ".join(options[:-1]) + " or " + options[-1] if len(options) > 1 else options[0])
    if "range" in rule and not in_interval(value, rule["range"]):
        return f"must lie in {rule['range']}" + (f" ({rule['why']})" if "why" in rule else "")
    return None


def problems(cls: type, values: Any) -> Iterator[tuple[str, Any, str]]:
    """(field, value, problem) for each field of dataclass `cls` whose value in `values` is invalid.

    `values` is an instance of `cls` or a mapping (a DictConfig node) with the fields as keys.
    """
    if not is_dataclass(cls):
        return
    for f in fields(cls):
        if isinstance(values, dict) or hasattr(values, "keys"):
            if f.name not in values:
                continue
            value = values[f.name]
        else:
            value = getattr(values, f.name, None)
        found = problem(cls, f.name, value)
        if found:
            yield f.name, value, found


def default_of(cls: type, name: str) -> Any:
    """The field's default (for "e.g." hints), or None."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:  # type: ignore[misc]
                return f.default_factory()  # type: ignore[misc]
    return None
