"""Property tests of the reward over every gold answer of the shared benchmark and training files.

For each gold answer g the DAPO reward (extraction + equivalence, through the real verifier
pool) must accept `\\boxed{g}` and every equivalent rewrite of g that applies to it (`x.0`,
`$x$`, thousands separators, `a/b` for `\\frac{a}{b}`, `\\dfrac`, dropped `\\left( \\right)`),
and must reject every perturbation (a number changed, a sign flipped, a matrix entry changed).
The project may be stricter than math-verify on a pair, never more lenient: a wrong answer the
project pays for while math-verify rejects it is a bug of the project's own normalisation.

Every row of every file is checked (DAPO's 17,290 integer answers take seconds: strings decide
them). math-verify's own verdict is computed where it decides something; STAPOCTL_FULL_GOLD=1
computes it on every pair too (~10 min), for the comparison reported in docs/REWARD.md.
Files absent from the shared data folder skip with the reason.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field

import pytest
from omegaconf import OmegaConf

from conftest import SHARED_DATA
from stapoctl.config.schema import RewardConfig
from stapoctl.reward.pool import RewardPool

BENCHMARKS = ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]
TRAINING = "dapo_math_17k"
FULL = os.environ.get("STAPOCTL_FULL_GOLD") == "1"
OTHER_GOLD_TIMEOUT_S = 2.0

_INT = re.compile(r"\d+")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_SEPARATED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_MATRIX = re.compile(r"\\begin\{([pbvBV]?matrix)\}(.*?)\\end\{\1\}", re.S)
_FRAC = re.compile(r"\\[dt]?frac(?![A-Za-z])")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?=[()\[\]|]|\\[{}])")
_EVEN_CONTEXT = re.compile(r"(\\pm|\\mp|\\cos|\\cosh|\\sec|\|)\s*\(?\s*$")


# -- generators ----------------------------------------------------------------------------------
def _group(s: str, i: int) -> int | None:
    """Index just past the brace group opening at s[i] == '{' (None if unbalanced)."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "{" and s[j - 1 : j] != "\\":
            depth += 1
        elif s[j] == "}" and s[j - 1 : j] != "\\":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _fracs(gold: str):
    """(start, end, numerator, denominator) of each \\frac{A}{B} whose arguments are brace groups."""
    for m in _FRAC.finditer(gold):
        if m.end() >= len(gold) or gold[m.end()] != "{":
            continue
        mid = _group(gold, m.end())
        if mid is None or mid >= len(gold) or gold[mid] != "{":
            continue
        end = _group(gold, mid)
        if end is not None:
            yield m.start(), end, gold[m.end() + 1 : mid - 1], gold[mid + 1 : end - 1]


def _atom(s: str) -> bool:
    return bool(re.fullmatch(r"\d+|[A-Za-z]|\\pi", s.strip()))


def _has_symbolic_reading(gold: str) -> bool:
    """Whether math-verify parses the gold at all: "a/b" for "\\frac{a}{b}" is a symbolic rewrite;
    a gold that parses to nothing (e.g. "\\frac{1}{3} E_{1}": latex2sympy reads E as Euler's e and
    fails on E_1) can only be compared as a string."""
    from math_verify import parse
    from math_verify.parser import LatexExtractionConfig

    return any(not isinstance(x, str) for x in parse(f"${gold}$", [LatexExtractionConfig()]))


def rewrites(gold: str) -> list[tuple[str, str]]:
    """(kind, answer) equivalent to `gold`, each only where it applies to this gold."""
    out = [("boxed", gold), ("dollars", f"${gold}$")]
    if re.fullmatch(r"-?\d+", gold):
        out.append(("dot_zero", gold + ".0"))
    if _PLAIN_NUMBER.fullmatch(gold) and len(gold.lstrip("-").split(".")[0]) >= 4:
        sign, digits = ("-", gold[1:]) if gold.startswith("-") else ("", gold)
        whole, _, frac = digits.partition(".")
        out.append(("thousands", sign + f"{int(whole):,}" + (f".{frac}" if frac else "")))
    elif _SEPARATED.fullmatch(gold):
        out.append(("thousands", gold.replace(",", "")))
    fracs = [f for f in _fracs(gold) if _atom(f[2]) and _atom(f[3])]
    if "frac" in gold:
        out.append(("dfrac", _FRAC.sub(lambda m: "\\dfrac", gold)))
    if fracs and _has_symbolic_reading(gold):
        start, end, num, den = fracs[0]
        if gold[:start].strip() in ("", "-") and not gold[end:].strip():
            out.append(("slash", f"{gold[:start]}{num.strip()}/{den.strip()}"))
        elif not re.search(r"[\d^_]\s*$", gold[:start]):
            # parenthesised so precedence cannot change; never after a digit (2\frac12 is 2½)
            out.append(("slash", f"{gold[:start]}({num.strip()}/{den.strip()}){gold[end:]}"))
    if _LEFT_RIGHT.search(gold) and not re.search(r"\\(?:left|right)\.", gold):
        out.append(("no_left_right", _LEFT_RIGHT.sub("", gold)))
    return out


def _value_is_zero(number: str) -> bool:
    return float(number) == 0.0


def perturbations(gold: str) -> list[tuple[str, str]]:
    """(kind, answer) that are wrong for `gold`, each only where the change surely alters the value."""
    out = []
    ints = list(_INT.finditer(gold))
    if ints:
        m = ints[0]
        out.append(("number", gold[: m.start()] + str(int(m.group()) + 1) + gold[m.end() :]))
    number = _NUMBER.search(gold)
    if number and not _value_is_zero(number.group()) and not _EVEN_CONTEXT.search(gold[: number.start()]):
        # a sign flip of a nonzero number outside |.|, cos(.), \pm: the value changes
        head, tail = gold[: number.start()], gold[number.start() :]
        if head.endswith("-"):
            flipped = head[:-1] + ("" if not head[:-1].strip() or head[:-1].rstrip()[-1] in "({[,=" else "+") + tail
        else:
            flipped = head + "-" + tail
        out.append(("sign", flipped))
    for m in _MATRIX.finditer(gold):
        entries = list(_INT.finditer(m.group(2)))
        if len(entries) > 1:  # the first is already covered by "number"; change the last entry
            e = entries[-1]
            at = m.start(2)
            out.append(("matrix_entry", gold[: at + e.start()] + str(int(e.group()) + 1) + gold[at + e.end() :]))
    return out


# -- math-verify's own verdict -------------------------------------------------------------------
def math_verify_accepts(pred: str, gold: str) -> bool:
    """math-verify alone, as its README uses it: both answers boxed, default configs and timeouts."""
    from math_verify import parse, verify

    return bool(verify(_mv_parse(gold), parse(f"\\boxed{{{pred}}}")))


_mv_cache: dict[str, list] = {}


def _mv_parse(gold: str):
    from math_verify import parse

    if gold not in _mv_cache:
        _mv_cache[gold] = parse(f"\\boxed{{{gold}}}")
    return _mv_cache[gold]


# -- the check -----------------------------------------------------------------------------------
@dataclass
class Report:
    golds: int = 0
    checked: Counter = field(default_factory=Counter)  # kind -> pairs
    failures: list = field(default_factory=list)  # (kind, pred, gold, project verdict, math-verify verdict)
    mv_lenient: list = field(default_factory=list)  # wrong answers math-verify accepts (the project rejects)
    mv_strict: Counter = field(default_factory=Counter)  # rewrite kind -> math-verify rejects, project accepts
    timeouts: Counter = field(default_factory=Counter)  # kind -> checks past their deadline (scored incorrect)


def other_golds(golds: list[str]) -> list[tuple[str, str]]:
    """(another problem's gold, gold): the answer of the next row whose answer string differs.

    Two problems may share a value ("1/2" and "0.5"), so these pairs carry no verdict of their
    own: they check that the project accepts one only where math-verify does too.
    """
    out = []
    for i, gold in enumerate(golds):
        after = (golds[(i + j) % len(golds)] for j in range(1, len(golds)))
        other = next((g for g in after if g.strip() != gold.strip()), None)
        if other is not None:
            out.append((other, gold))
    return out


def check_golds(pool: RewardPool, golds: list[str], report: Report, *, all_math_verify: bool = False) -> Report:
    """Judge every gold, rewrite, perturbation and other-gold pair with the project's reward.

    math-verify's own verdict is computed where it decides something (the project accepting
    another problem's answer, a wrong verdict to report), or on every pair with all_math_verify.
    """
    pairs: list[tuple[str, str, str, bool | None]] = []  # kind, pred, gold, correct? (None: unknown)
    for gold in golds:
        report.golds += 1
        pairs += [(k, p, gold, True) for k, p in rewrites(gold)]
        pairs += [(k, p, gold, False) for k, p in perturbations(gold) if p != gold]
    responses = [f"Reasoning ... so the final answer is $\\boxed{{{p}}}$." for _, p, _, _ in pairs]
    verdicts = [(v.correct, v.timed_out) for v in pool.judge(responses, [g for _, _, g, _ in pairs])]
    # another problem's answer: no box needed, and a short deadline (a slow check of two unrelated
    # expressions ends in "not equal" either way; a timeout is scored incorrect)
    others = other_golds(golds)
    pairs += [("other_gold", p, g, None) for p, g in others]
    verdicts += [(ok, to) for ok, to, _ in pool.checker.check_detailed(others, OTHER_GOLD_TIMEOUT_S)]
    for (kind, pred, gold, good), (correct, timed_out) in zip(pairs, verdicts):
        report.checked[kind] += 1
        report.timeouts[kind] += bool(timed_out)
        needs_mv = all_math_verify or (correct and good is not True) or (good is not None and correct != good)
        mv = math_verify_accepts(pred, gold) if needs_mv else None
        wrong = (good is not None and correct != good) or (good is None and correct and not mv)
        if wrong:
            report.failures.append((kind, pred, gold, correct, mv))
        if mv and good is False:
            report.mv_lenient.append((kind, pred, gold))
        if mv is False and good and correct:
            report.mv_strict[kind] += 1
    return report


def load_golds(name: str) -> list[str]:
    path = SHARED_DATA / f"{name}.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent (no shared data folder beside the checkout; set STAPOCTL_SHARED_DATA)")
    with path.open(encoding="utf-8") as f:
        return [str(json.loads(line)["answer"]) for line in f if line.strip()]


@pytest.fixture(scope="module")
def pool():
    p = RewardPool(OmegaConf.structured(RewardConfig(verify_timeout_s=30.0, num_workers=2)))
    yield p
    p.close()


def _describe(report: Report) -> str:
    lines = [f"{k} {p!r} for gold {g!r}: project {'accepts' if c else 'rejects'}, math-verify "
             f"{ {True: 'accepts', False: 'rejects', None: 'not asked'}[mv]}"
             for k, p, g, c, mv in report.failures[:20]]
    return f"{len(report.failures)} wrong verdicts:\n" + "\n".join(lines)


@pytest.mark.parametrize("bench", BENCHMARKS)
def test_benchmark_golds(pool, bench):
    report = check_golds(pool, load_golds(bench), Report(), all_math_verify=FULL)
    assert not report.failures, _describe(report)
    assert report.checked["boxed"] == report.golds and report.checked["number"] > 0


def test_training_golds(pool):
    golds = load_golds(TRAINING)
    report = check_golds(pool, golds, Report(), all_math_verify=FULL)
    assert not report.failures, _describe(report)
    assert report.checked["dot_zero"] == len(golds)  # every DAPO answer is an integer


# -- the generators themselves (each rewrite applies only where it is equivalent) -----------------
@pytest.mark.parametrize(
    "gold,kind,expected",
    [
        ("12", "dot_zero", "12.0"),
        ("1.5", "dot_zero", None),  # 1.5.0 is not a number
        ("27648", "thousands", "27,648"),
        ("-1234.5", "thousands", "-1,234.5"),
        ("999", "thousands", None),
        ("\\frac{11}{2}", "slash", "11/2"),
        ("-\\frac{1}{4}", "slash", "-1/4"),
        ("2\\frac{1}{2}", "slash", None),  # mixed number: 2 1/2 would read as 21/2
        ("x^\\frac{1}{2}", "slash", None),  # exponent: x^((1)/(2)) would raise x to "("
        ("\\frac{1}{2}+\\frac{\\sqrt{3}}{2}", "slash", "(1/2)+\\frac{\\sqrt{3}}{2}"),
        ("\\frac{\\sqrt{3}}{2}", "slash", None),  # only a/b with a, b single numbers or letters
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "no_left_right", "( 3, \\frac{\\pi}{2} )"),
        ("\\left. x \\right|", "no_left_right", None),
    ],
)
def test_rewrites_apply_only_where_equivalent(gold, kind, expected):
    found = dict(rewrites(gold)).get(kind)
    assert found == expected


@pytest.mark.parametrize(
    "gold,kind,expected",
    [
        ("0", "sign", None),  # -0 is 0
        ("\\pm 3", "sign", None),  # ±(-3) is ±3
        ("|2|", "sign", None),
        ("-5", "sign", "5"),
        ("x-2", "sign", "x+2"),
        ("(-3, 4)", "sign", "(3, 4)"),
        ("\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}", "number",
         "\\begin{pmatrix} -2 & 0 \\\\ 0 & -1 \\end{pmatrix}"),
        ("\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}", "matrix_entry",
         "\\begin{pmatrix} -1 & 0 \\\\ 0 & -2 \\end{pmatrix}"),
    ],
)
def test_perturbations_change_the_value(gold, kind, expected):
    assert dict(perturbations(gold)).get(kind) == expected
