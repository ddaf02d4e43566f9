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


def normalize(answer: str) -> str:
    """Canonical string form: layout-only LaTeX removed, units and separators dropped."""
    s = answer.strip().replace("\x00", "")
    s = s.replace("\\\\", _ROW_BREAK)
    s = s.replace("\n", " ")
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
    if _THOUSANDS.match(s.replace(" ", "")):
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


def quick_verdict(predicted: str | None, reference: str) -> bool | None:
    """True/False when strings alone decide; None when a symbolic check is needed."""
    if predicted is None:
        return False
    pred, ref = normalize(predicted), normalize(reference)
    if not pred or not ref:
        return False
    pred = normalize(_strip_assignment(pred, ref))
    if _squash(pred) == _squash(ref):
        return True
    if _NUMBER.match(pred) and _NUMBER.match(ref):  # two plain numbers: exact rational compare
        return Fraction(pred) == Fraction(ref)
    return None


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


def equivalent_unbounded(predicted: str | None, reference: str) -> bool:
    """The full check with no time limit: run it only where a deadline is enforced around it."""
    quick = quick_verdict(predicted, reference)
    if quick is not None:
        return quick
    from math_verify import verify

    ref = normalize(reference)
    pred = normalize(_strip_assignment(normalize(predicted or ""), ref))
    gold, target = _parse(ref), _parse(pred)
    if not gold or not target:
        return False
    try:
        return bool(verify(gold, target, timeout_seconds=None))
    except Exception:  # a malformed expression sympy cannot compare is simply not equal
        return False
