"""Hydra command-line overrides read by Hydra's own parser (`OverridesParser`), so every caller
sees the key and kind `compose` will see: `key=v` set, `+key=v` add, `++key=v` force-add,
`~key` / `~key=v` delete. Only the key and kind come from Hydra: it normalises values
(`[2e-3,2e-2]` comes back as `[0.002, 0.02]`), while sweep values, trial names, recorded params
and a resume's matching compare what the user typed, so `value` is the raw text after the `=`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

from stapoctl.errors import UserError

SET, ADD, FORCE_ADD, DELETE = "set", "add", "force_add", "delete"
GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


@dataclass(frozen=True)
class Override:
    text: str  # as written: what compose, a job's command line and a sweep's record receive
    key: str  # Hydra's key_or_group, without +, ++, ~ or @package
    kind: str  # SET, ADD, FORCE_ADD or DELETE
    package: str | None = None

    @property
    def value(self) -> str:
        """The value as typed ('' for `~key`): never Hydra's normalised form."""
        return self.text.partition("=")[2]


@lru_cache(maxsize=1)
def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


@lru_cache(maxsize=4096)
def parse(item: str, what: str = "override", example: str = "loss.tau_p=2e-3") -> Override:
    """One override; bad syntax is one line naming it (Hydra's own message is three)."""
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import OverrideParseException

    try:
        (o,) = _parser().parse_overrides([item])
    except OverrideParseException as exc:
        if "=" not in item and not item.lstrip().startswith("~"):
            raise UserError(f"{what} '{item}' has no '=': write key=value, e.g. {example} "
                            "(or ~key to delete a key)") from None
        raise UserError(f"{what} '{item}' is not a Hydra override ({_detail(str(exc), item)}): quote a "
                        f"value that holds spaces, '=', '~' or brackets, e.g. key='a=b' ({GRAMMAR})") from None
    kind = {OverrideType.ADD: ADD, OverrideType.FORCE_ADD: FORCE_ADD, OverrideType.DEL: DELETE}.get(o.type, SET)
    return Override(item, o.key_or_group, kind, o.package)


def _detail(message: str, item: str) -> str:
    """The line of Hydra's message that says what is wrong; a lexer's caret as a position."""
    lines = [ln for ln in message.splitlines() if ln.strip() and not ln.startswith(("See ", "Error parsing"))]
    if len(lines) >= 2 and lines[0].startswith("LexerNoViableAltException: ") and lines[1].strip() == "^":
        pos = lines[1].index("^") - len("LexerNoViableAltException: ")
        if 0 <= pos < len(item):
            return f"unexpected '{item[pos]}' at character {pos + 1}"
    return lines[0].strip() if lines else "bad syntax"


def parse_all(items: Iterable[str], what: str = "override") -> list[Override]:
    return [parse(item, what) for item in items]


def key_of(item: str) -> str:
    return parse(item).key


def keys(items: Iterable[str]) -> set[str]:
    """The keys these overrides touch (whatever their kind)."""
    return {parse(item).key for item in items}


def drop(items: Iterable[str], unwanted: Iterable[str]) -> list[str]:
    """The overrides, as written, except those of the unwanted keys."""
    gone = set(unwanted)
    return [item for item in items if parse(item).key not in gone]
