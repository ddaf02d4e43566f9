"""Rule verifier: boxed-answer extraction, equivalence and the DAPO reward on hand-written cases.

Each case carries the reason its expected verdict is right.
"""

from __future__ import annotations

import pytest

from stapoctl.reward import dapo_reward, extract_answer, is_equivalent, normalize

# (response, expected extraction, why)
EXTRACT_CASES = [
    ("so the answer is \\boxed{42}.", "42", "plain box"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "nested braces inside the box are kept whole"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", "two levels of nesting"),
    ("first \\boxed{1}, then corrected: \\boxed{2}", "2", "two boxes: the last one is the final answer"),
    ("\\boxed{}", "", "an empty box is a box with no answer (scored incorrect)"),
    ("the answer is 7", None, "no box means no answer, never the last number"),
    ("\\fbox{7}", "7", "\\fbox is the other boxing command"),
    ("thus \\boxed 5.", "5", "brace-less \\boxed 5 form, sentence period dropped"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", "escaped braces are content, not structure"),
    ("\\boxed{1} then \\boxed{2", "1", "an unclosed (truncated) last box is not an answer; the last closed one is"),
    ("$\\boxed{ 12 }$", "12", "surrounding whitespace inside the box is stripped"),
    ("", None, "empty response"),
    ("\\boxedx{3}", None, "\\boxedx is a different command, not a box"),
]


@pytest.mark.parametrize("response,expected,why", EXTRACT_CASES, ids=[c[2] for c in EXTRACT_CASES])
def test_extract_answer(response, expected, why):
    assert extract_answer(response) == expected, why


# (predicted, reference, equivalent?, why)
EQUIV_CASES = [
    ("\\frac12", "0.5", True, "1/2 written as a brace-less fraction equals the decimal 0.5"),
    ("0.5", "\\frac{1}{2}", True, "decimal vs fraction, the other way round"),
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True, "\\dfrac is display-style \\frac"),
    ("\\tfrac{3}{4}", "0.75", True, "\\tfrac is text-style \\frac; 3/4 = 0.75"),
    ("1,000", "1000", True, "thousands separator"),
    ("1{,}000", "1000", True, "LaTeX-protected thousands separator"),
    ("1\\,000", "1000", True, "thin space as thousands separator"),
    ("1,000,000", "10^6", True, "separated million equals 10^6 symbolically"),
    ("100", "1\\,000", False, "100 is not 1000"),
    ("1,2", "12", False, "a comma between single digits is a list, not a separator"),
    ("[1,2)", "[1, 2)", True, "same half-open interval, different spacing"),
    ("(1,2]", "[1,2]", False, "open vs closed left endpoint are different intervals"),
    ("(-\\infty, 3)", "(-\\infty,3)", True, "unbounded interval"),
    ("\\left(1,2\\right)", "(1,2)", True, "\\left/\\right are sizing only"),
    ("[0,1]\\cup[2,3]", "[2,3]\\cup[0,1]", True, "union of intervals is order-free"),
    ("\\{1,2\\}", "\\{2,1\\}", True, "sets are unordered"),
    ("\\{1,2\\}", "\\{1,3\\}", False, "different set elements"),
    ("30^\\circ", "30", True, "degree sign is a unit"),
    ("30^{\\circ}", "30", True, "braced degree sign"),
    ("5\\text{ cm}", "5", True, "trailing unit in \\text"),
    ("10\\%", "10", True, "percent sign on a percentage answer"),
    ("\\$18.90", "18.90", True, "dollar sign on a money answer"),
    ("42.", "42", True, "trailing sentence period"),
    ("x=5", "5", True, "variable assignment vs bare value"),
    ("x = 5", "x=5", True, "same equation, spacing differs"),
    ("y=3", "5", False, "assignment of a different value"),
    ("-3", "3", False, "sign matters"),
    ("2", "3", False, "different integers"),
    ("2\\sqrt{2}", "\\sqrt{8}", True, "sqrt(8) simplifies to 2 sqrt(2)"),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", True, "brace-less sqrt argument"),
    ("3\\sqrt{2}/2", "\\frac{3}{\\sqrt2}", True, "rationalised denominator"),
    ("x^2+2x+1", "(x+1)^2", True, "expanded vs factored polynomial"),
    ("x^2+1", "(x+1)^2", False, "different polynomials"),
    ("\\pi/2", "\\frac{\\pi}{2}", True, "slash vs \\frac with a constant"),
    ("1/3", "0.3333333", True, "math-verify rounds floats to 6 decimals"),
    ("0.333", "\\frac13", False, "0.333 is not 1/3 at 6-decimal precision"),
    ("\\infty", "\\infty", True, "infinity"),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True, "same column vector"),
    ("\\begin{pmatrix}1&0\\\\0&1\\end{pmatrix}", "\\begin{pmatrix}1&0\\\\0&2\\end{pmatrix}", False, "matrices differ in one entry"),
    ("\\text{Monday}", "Monday", True, "text answer wrapped in \\text"),
    ("monday", "Monday", True, "text answers compare case-insensitively"),
    ("Tuesday", "Monday", False, "different words"),
    ("\\text{(B)}", "B", True, "multiple-choice letter in parentheses"),
    ("", "5", False, "an empty box is never correct"),
    ("\\displaystyle\\frac{2}{4}", "\\frac{1}{2}", True, "display style and an unreduced fraction"),
    # wrong answers the reward once paid for (issue 13), found by tests/test_reward_gold.py
    ("\\begin{pmatrix} -2 & 0 \\\\ 0 & -1 \\end{pmatrix}", "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}", False,
     "a row break followed by a space is not the spacing command '\\ ': the entries still differ"),
    ("x_{1} \\cos (\\omega t)+$ $\\dot{x}_{0} \\sin (\\omega t) / \\omega",
     "x_{0} \\cos (\\omega t)+$ $\\dot{x}_{0} \\sin (\\omega t) / \\omega", False,
     "a '$' inside an answer must not split it so that only the last formula is compared"),
    ("x_{0} \\cos (\\omega t)+\\dot{x}_{0} \\sin (\\omega t) / \\omega",
     "x_{0} \\cos (\\omega t)+$ $\\dot{x}_{0} \\sin (\\omega t) / \\omega", True,
     "the same answer without Minerva's stray '$ $'"),
    ("\\hbar \\omega(v+2 / 2)-\\frac{E_{0}^{2} e^{2}}{2 m \\omega^{2}}",
     "\\hbar \\omega(v+1 / 2)-\\frac{E_{0}^{2} e^{2}}{2 m \\omega^{2}}", False,
     "an unparseable expression is not the stray number 2 found inside it (math-verify alone accepts)"),
    ("2", "\\hbar \\omega(v+1 / 2)-\\frac{E_{0}^{2} e^{2}}{2 m \\omega^{2}}", False,
     "nor is the bare number 2 that expression"),
    ("E_{2} - 3", "E_{1} + 3", False, "math-verify alone reads both as 3 (LaTeX fails on E_1, then a stray 3)"),
    ("1/3", "1/3", True, "a plain expression still parses without LaTeX"),
    ("2x+1", "1+2x", True, "a plain expression covering the whole answer is compared symbolically"),
]


@pytest.mark.parametrize("pred,ref,expected,why", EQUIV_CASES, ids=[c[3] for c in EQUIV_CASES])
def test_is_equivalent(pred, ref, expected, why):
    assert is_equivalent(pred, ref) is expected, why


def test_none_prediction_is_incorrect():
    assert is_equivalent(None, "5") is False


@pytest.mark.parametrize(
    "raw,normal",
    [
        ("\\left( \\dfrac{1}{2} \\right)", "( \\frac{1}{2} )"),  # sizing removed, dfrac -> frac
        ("1,234,567.5", "1234567.5"),  # separators dropped when the whole answer is a number
        ("90^\\circ.", "90"),  # degree sign and period dropped
        ("\\text{ 12 }\\text{ cm}", "12"),  # text unwrapped, unit dropped
        ("\\begin{pmatrix} 1 \\\\ 0 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 0 \\end{pmatrix}"),  # row break kept
        ("$x$ $+1$", "x +1"),  # math delimiters dropped, also inside
    ],
)
def test_normalize(raw, normal):
    assert normalize(raw) == normal


def test_dapo_reward_values():
    # correct: the boxed 1/2 equals the reference 0.5
    assert dapo_reward("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    # wrong box -> -1 (STAPO's R in {-1, 1})
    assert dapo_reward("\\boxed{3}", "4") == -1.0
    # right number but not boxed -> no answer -> -1
    assert dapo_reward("the answer is 4", "4") == -1.0
    # configurable values for other recipes (e.g. 1/0)
    assert dapo_reward("\\boxed{4}", "4", correct=1.0, incorrect=0.0) == 1.0
    assert dapo_reward("\\boxed{5}", "4", correct=1.0, incorrect=0.0) == 0.0
