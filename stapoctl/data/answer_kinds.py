"""The answer kind of each problem (scalar / multiset / tuple): how the reward compares a gold
that is a bare comma list ("1, 3, 5"), written by data prep into each row as `answer_kind`.

Decided in this order: the exceptions below (by problem id); the gold's form where it is not a
bare list (scalar) or lists solutions (tuples, or values of one unknown "f(x)=x, f(x)=-x": a
multiset); the question (named quantities: a tuple; all values / roots / solutions: a
multiset); else the gold's form (`reward.lists.form_kind`: a tuple).
OlympiadBench's `is_multiple_answer` cannot tell "determine a and b" from "find all".
"""

from __future__ import annotations

import re

from stapoctl.reward.equivalence import normalize
from stapoctl.reward.lists import form_kind, split_list

# Problems whose question and gold disagree with the rules, each with why (ids as data prep
# writes them). Keep a reason beside every entry: the reward pays by this, so a change here (or
# in the cues below) changes verdicts: bump `VERIFIER` in reward/pool.py with it.
EXCEPTIONS: dict[str, str] = {
    # the gold lists the named quantities in an order the question does not fix
    "olympiadbench-2268": "multiset",  # asks "minimum and maximum", the gold is 5,1 (max, min)
    "olympiadbench-2277": "multiset",  # ages of "Paolo, Qing and Rayna", the gold is 7,14,18 (R, Q, P)
    "olympiadbench-2753": "multiset",  # asks "maximum and minimum", the gold is 1,2 (min, max)
    "olympiadbench-2754": "multiset",  # asks "maximum and minimum", the gold is 1,3 (min, max)
    # one solution (x, y, z) or one pair (f, g), though the question says "all"
    "olympiadbench-1687": "tuple",  # all pairs (f, g): the gold is the one pair f(n)=n, g(n)=1
    "olympiadbench-2575": "tuple",  # all real solutions of a system in x, y, z: the one (1,2,3)
    # the values carry no order the question names
    "olympiadbench-2235": "multiset",  # "determine these two sequences": ten integers, two runs
    "olympiadbench-2771": "multiset",  # "compute tan∠ABD": its two possible values
    # prose, not a list: "f(x)=a x+b, where b is an arbitrary integer, and a is ..."
    "olympiadbench-1965": "scalar",
}

_MATH = r"\$[^$]{1,60}\$"
# named quantities right after the ask: "determine $a$ and $b$", "the values of $a, h$ and $k$",
# "all real numbers $a, b$ and $c$", "compute $d(6), d(16)$, and $d(72)$"
_NAMED = re.compile(
    r"\b(?:determine|find|compute|calculate|what\s+are|solve\s+for|values?\s+of|both)\s+(?:the\s+)?"
    r"(?:(?:possible\s+)?values?\s+(?:of\s+)?)?(?:all\s+)?(?:(?:real|positive|nonnegative)\s+)?"
    rf"(?:(?:numbers|integers)\s+)?(?:both\s+)?{_MATH}(?:\s*,\s*{_MATH})*,?\s+and\s+{_MATH}",
    re.IGNORECASE,
)
_EXTREMES = r"(?:minimum|maximum|smallest|largest|least|greatest)"
_TUPLE_CUES = (_NAMED, re.compile(rf"\b{_EXTREMES}\s+and\s+{_EXTREMES}\b", re.IGNORECASE),
               re.compile(r"\bhow\s+many\s+of\s+each\b", re.IGNORECASE))
_MULTISET_CUE = re.compile(
    r"\b(?:all|every|possible|roots|solutions|list)\b|\bvalues\s+(?:of|for)\s+\$[^$,]+\$", re.IGNORECASE)


def question_kind(question: str) -> str | None:
    """tuple / multiset where the question says which, else None."""
    if any(cue.search(question) for cue in _TUPLE_CUES):
        return "tuple"
    return "multiset" if _MULTISET_CUE.search(question) else None


def answer_kind(row_id: str, question: str, gold: str) -> str:
    """The kind of one problem's gold (see the module's docstring for the order)."""
    if row_id in EXCEPTIONS:
        return EXCEPTIONS[row_id]
    if "," not in gold and "and" not in gold:  # no separator at all (DAPO's 17k integers): no list
        return "scalar"
    form = form_kind(split_list(normalize(gold, "tight")))
    if form in ("scalar", "multiset"):  # one item; or solutions: tuples, or values of one unknown
        return form
    return question_kind(question) or form
