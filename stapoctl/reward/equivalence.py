"""Answer equivalence: string normalization first, then math-verify's symbolic comparison.

`quick_verdict` decides what strings can; `equivalent_unbounded` is the raw symbolic check that
the verifier subprocesses of `reward.checker` run (its `is_equivalent` adds the hard deadline,
because math-verify's own timeout uses SIGALRM and silently does nothing off the main thread).
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from functools import lru_cache

from stapoctl.reward.lists import check_kind, form_kind, match, split_list, unwrap

# math-verify logs a warning on every call made with its signal timeout disabled.
logging.getLogger("math_verify").setLevel(logging.ERROR)

DEFAULT_TIMEOUT_S = 5.0

_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_UNIT_WORDS = (
    r"degrees?|deg|cm|mm|km|m|meters?|inches|inch|in|feet|foot|ft|units?|sq|square|"
    r"seconds?|sec|s|minutes?|min|hours?|hrs?|days?|dollars?|cents?|kg|g|grams?|lbs?|pounds?|mph|"
    r"liters?|ml|cups?|miles?"
)
_TRAILING_UNITS = re.compile(rf"(?<=[\d}}\s])\s*(?:\^\s*\{{?\s*[23]\s*\}}?)?\s*(?:{_UNIT_WORDS})\s*(?:\^\s*\{{?\s*[23]\s*\}}?)?$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?$")
_ASSIGNMENT = re.compile(r"^\s*[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?P<rhs>[^=]+)$")


# A double backslash (a matrix row break) is one token that no rewrite may start inside: held out
# as a placeholder while normalizing, its second backslash and the space after it can no longer be
# read as the spacing command "\ " (which turned "0 \\ 0" into "0 \0", so matrices differing in
# one entry compared equal).
_ROW_BREAK = "\x00"


def normalize(answer: str, separators: str = "loose") -> str:
    """Canonical string form: layout-only LaTeX removed, units and separators dropped.

    `separators`: which commas read as thousands separators of a whole-number answer: "loose"
    (also "8, 221": a prediction against a one-number gold), "tight" (only "8,221", "1{,}000",
    "10,\\!080": a gold reads as one number only so) or "none" (a prediction against a list gold).
    """
    s = answer.strip().replace("\x00", "")
    s = s.replace("\\\\", _ROW_BREAK)
    s = s.replace("\n", " ")
    s = re.sub(r",\s*\\!\s*", ",", s)  # 11,\! 111: the source space after a separator is layout
    s = re.sub(r"\\left\b|\\right\b", "", s)
    s = re.sub(r"\\[!,;: ]|\\quad|\\qquad", "", s)  # spacing commands (\, also thin space in 1\,000)
    s = s.replace("{,}", ",")  # 1{,}000
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace("\\displaystyle", "")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s)  # 30^\circ, 30^{\circ}
    s = s.replace("°", "").replace("\\%", "").replace("%", "").replace("\\$", "")
    # math-mode delimiters carry no value, also inside an answer ("x_0 \\cos t+$ $\\dot x_0", as
    # Minerva writes some): a "$" left inside splits it into two formulas when parsed
    s = s.replace("$", "").strip()
    # unwrap \text{...} etc. (repeat for nesting), keeping the words
    for _ in range(3):
        s = _TEXT_WRAPPERS.sub(lambda m: m.group(1), s)
    s = _TRAILING_UNITS.sub("", s).strip()
    s = s.rstrip(".").strip()
    if separators != "none" and _THOUSANDS.match(s if separators == "tight" else s.replace(" ", "")):
        s = s.replace(",", "").replace(" ", "")
    s = re.sub(r"\s+", " ", s).strip()
    return s.replace(_ROW_BREAK, "\\\\")


def _strip_assignment(pred: str, ref: str) -> str:
    """'x = 5' against a reference without '=' compares the right-hand side."""
    if "=" in ref:
        return pred
    m = _ASSIGNMENT.match(pred)
    return m.group("rhs").strip() if m else pred


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", s).lower()


def _forms(predicted: str, reference: str, kind: str | None) -> tuple[str, str, str, list[str]]:
    """(prediction, gold, kind, gold items), normalized as the gold reads: a thousands separator
    is one only where the gold is one number; against a list gold "5,125" is two items."""
    ref = normalize(reference, "tight")
    golds = split_list(ref)
    if len(golds) == 1:
        separators, kind = "loose", "scalar"
    else:
        separators, kind = "none", check_kind(kind) or form_kind(golds)
    pred = normalize(_strip_assignment(normalize(predicted, separators), ref), separators)
    return pred, ref, kind, golds


def _quick(pred: str, ref: str) -> bool | None:
    if not pred or not ref:
        return False
    if _squash(pred) == _squash(ref):
        return True
    if _NUMBER.match(pred) and _NUMBER.match(ref):  # two plain numbers: exact rational compare
        return Fraction(pred) == Fraction(ref)
    return None


def _item(pred: str, gold: str) -> str:
    return normalize(_strip_assignment(pred, gold), "none")  # "x=1, x=3": each item's own assignment


def quick_verdict(predicted: str | None, reference: str, kind: str | None = None) -> bool | None:
    """True/False when strings alone decide; None when a symbolic check is needed.

    `kind` (scalar / multiset / tuple, None: the gold's form decides) says how a bare list gold
    compares (`reward.lists`); it does not apply to a gold that is not a bare list."""
    if predicted is None:
        return False
    pred, ref, kind, golds = _forms(predicted, reference, kind)
    if kind == "scalar" or _squash(pred) == _squash(ref):
        return _quick(pred, ref)
    items = match(kind, unwrap(pred, len(golds)), golds, _item_quick)
    return False if items is False else None  # matching items still need math-verify's whole verdict


@lru_cache(maxsize=8192)
def _parse(expr: str):
    """math-verify parse of one normalized answer, cached (a reference is shared by a whole group).

    LaTeX first. The plain-expression reading is used only when it covers the whole answer:
    math-verify's own fallback takes any number it finds in an answer whose LaTeX it cannot
    parse, so "\\hbar\\omega(v+2/2)-\\frac{E_0^2}{2}" and "...(v+1/2)..." both became 2 and
    compared equal. An answer that parses as neither stays a string (compared as a string).
    """
    from math_verify import parse
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    latex = parse(f"${expr}$", extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                  parsing_timeout=None)
    if any(not isinstance(x, str) for x in latex):
        return latex
    plain = parse(expr, extraction_config=[ExprExtractionConfig()], parsing_timeout=None)
    if len(plain) == 2 and _squash(str(plain[1])) == _squash(expr):
        return plain
    return latex


def _symbolic(pred: str, ref: str) -> bool:
    from math_verify import verify

    gold, target = _parse(ref), _parse(pred)
    if not gold or not target:
        return False
    try:
        return bool(verify(gold, target, timeout_seconds=None))
    except Exception:  # a malformed expression sympy cannot compare is simply not equal
        return False


def _item_quick(pred: str, gold: str) -> bool | None:
    return _quick(_item(pred, gold), gold)


def _item_equal(pred: str, gold: str) -> bool:
    quick = _item_quick(pred, gold)
    return quick if quick is not None else _symbolic(_item(pred, gold), gold)


def equivalent_unbounded(predicted: str | None, reference: str, kind: str | None = None) -> bool:
    """The full check with no time limit: run it only where a deadline is enforced around it.

    A list gold's items must match as its kind says, and then the whole answer must pass
    math-verify too (its set reading), so a list verdict is never more lenient than math-verify.
    Both go to math-verify with ", " between items: it reads "5,125" as 5125, not as a list."""
    quick = quick_verdict(predicted, reference, kind)
    if quick is not None:
        return quick
    pred, ref, kind, golds = _forms(predicted or "", reference, kind)
    if kind == "scalar":
        return _symbolic(pred, ref)
    if not match(kind, unwrap(pred, len(golds)), golds, _item_equal, _item_quick):
        return False
    return _symbolic(", ".join(split_list(pred)), ", ".join(golds))
