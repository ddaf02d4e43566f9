"""Bare top-level answer lists ("1, 3, 5"): their items, their kind, and how two are matched.

math-verify reads a bare comma list as a set, so a repeated value is dropped ("-2" matched
"-2,-2") and named quantities compare in any order. The checker compares such a list by its
answer kind instead: a tuple (order and repeats kept) or a multiset (order free, repeats kept).
Intervals, `\\{...\\}` sets and parenthesised tuples are one item each: they keep their own
semantics. Pure string work: no math-verify here (`equivalence` brings the item comparison).
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

KINDS = ("scalar", "multiset", "tuple")
_OPEN, _CLOSE = "([{", ")]}"
# a top-level separator: a comma (", and" too), or the word "and" between two items
_SEPARATOR = re.compile(r"\s*,\s*(?:and\s+)?|\s+and\s+")
_EQUATION = re.compile(r"^(?P<lhs>[^=<>]+?)\s*=\s*(?P<rhs>[^=]+)$")


def check_kind(kind: str | None, field: str = "answer_kind") -> str | None:
    """The kind itself, None for "by the gold's form"; ValueError naming the field otherwise."""
    if kind is None or kind in KINDS:
        return kind
    raise ValueError(f"{field} '{kind}' is not one of {', '.join(KINDS)}: leave it out to let the gold's form decide")


def split_list(answer: str) -> list[str]:
    """The top-level items of a normalized answer; [answer] when it is not a bare list.

    Brackets of any kind nest (intervals such as "(3,4]" close with the other bracket), so only
    commas (and the word "and") outside every bracket separate items; unbalanced: not a list."""
    items, depth, start, i = [], 0, 0, 0
    while i < len(answer):
        c = answer[i]
        if c == "\\" and answer[i + 1 : i + 2] in ("{", "}"):
            depth += 1 if answer[i + 1] == "{" else -1
            i += 2
            continue
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth < 0:
                return [answer.strip()]
        elif depth == 0 and (m := _SEPARATOR.match(answer, i)) and m.group().strip():
            items.append(answer[start:i])
            start = i = m.end()
            continue
        i += 1
    items.append(answer[start:])
    items = [s.strip() for s in items]
    return items if len(items) > 1 and all(items) and depth == 0 else [answer.strip()]


def unwrap(answer: str, count: int) -> list[str]:
    """The items of a prediction: "(2, -1, -18)" or "\\{1, 3, 5\\}" for a bare list of `count`."""
    items = split_list(answer)
    if len(items) == 1:
        for head, tail in (("(", ")"), ("\\{", "\\}")):
            inner = answer[len(head) : -len(tail)] if answer.startswith(head) and answer.endswith(tail) else None
            if inner is not None and len(split_list(inner)) == count:
                return split_list(inner)
    return items


def _is_tuple(item: str) -> bool:
    return item.startswith("(") and item.endswith(")") and len(split_list(item[1:-1])) > 1


def _lhs(item: str) -> str | None:
    m = _EQUATION.match(item)
    return re.sub(r"\s+", "", m.group("lhs")) if m else None


def form_kind(items: Sequence[str]) -> str:
    """The kind a list gold's own form says, where nothing else does.

    A list of tuples, or of equations of one unknown ("f(x)=x, f(x)=-x"), lists solutions: a
    multiset. Anything else is read as named quantities, a tuple: the strict reading, which can
    refuse a correct reordering but never pays for a swapped pair."""
    if len(items) < 2:
        return "scalar"
    if all(_is_tuple(i) for i in items):
        return "multiset"
    sides = {_lhs(i) for i in items}
    if len(sides) == 1 and None not in sides:
        return "multiset"
    return "tuple"


def match(kind: str, preds: Sequence[str], golds: Sequence[str], equal: Callable[[str, str], bool | None],
          cheap: Callable[[str, str], bool | None] | None = None) -> bool | None:
    """Whether the items match as `kind` says: True, False, or None where `equal` left a pair
    undecided (None) so that the answer depends on it. `equal(pred, gold)` is called lazily;
    `cheap` (a string verdict, None where it cannot tell) orders a multiset's candidates, so the
    string-equal pairs are tried before any costly `equal`."""
    if len(preds) != len(golds):
        return False
    if kind == "tuple":
        verdicts = [equal(p, g) for p, g in zip(preds, golds)]
        return False if False in verdicts else (None if None in verdicts else True)
    n = len(golds)
    hints = [[cheap(preds[j], golds[i]) if cheap else None for j in range(n)] for i in range(n)]
    order = [sorted((j for j in range(n) if hints[i][j] is not False), key=lambda j: hints[i][j] is not True)
             for i in range(n)]
    cache: dict[tuple[int, int], bool | None] = {}

    def edge(i: int, j: int, optimistic: bool) -> bool:
        if (i, j) not in cache:
            cache[(i, j)] = True if hints[i][j] else equal(preds[j], golds[i])
        verdict = cache[(i, j)]
        return verdict is True or (optimistic and verdict is None)

    if _perfect_matching(order, lambda i, j: edge(i, j, False)):
        return True
    return None if _perfect_matching(order, lambda i, j: edge(i, j, True)) else False


def _perfect_matching(order: list[list[int]], edge: Callable[[int, int], bool]) -> bool:
    """Each gold item i paired with its own prediction item j, tried in order[i] (Kuhn's
    augmenting paths)."""
    owner: list[int | None] = [None] * len(order)

    def place(i: int, seen: set[int]) -> bool:
        for j in order[i]:
            if j not in seen and edge(i, j):
                seen.add(j)
                if owner[j] is None or place(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return all(place(i, set()) for i in range(len(order)))
