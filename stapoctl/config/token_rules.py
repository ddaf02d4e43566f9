"""`loss.token_rules`: the grammar of a token rule, parsed and checked without torch.

A rule is a condition over a response token and an action on its term of the policy loss:

    {adv: pos, prob: [0, 0.002], entropy_q: [0, 0.8], action: mask}        # STAPO's S2T rule
    {entropy_q: [0, 0.8], action: mask, renorm: false}                      # 20-Entropy
    {adv: neg, rel_position: [0.5, 1], action: scale, scale: 0.5, name: late_neg}
    {prob: [0, 0.1], action: weight, fn: surprisal}
    {adv: pos, prob_q: [0, 0.1], mean_entropy: [0, 0.3], action: scale, scale: 1.1}  # STARE's L+ (gated)
    {action: weight, fn: old_prob, alpha: 0.3}                              # AR: 0.3·π_old + 0.7

Conditions (all given ones must hold; none = every token): ``adv`` pos | neg | any; bands
``[low, high]`` meaning low <= x < high on ``prob`` (π(y_t) of the current policy), ``entropy`` (H_t,
absolute), ``entropy_q`` (quantiles of H over the mini-batch's response tokens, as STAPO's h*),
``position`` (0-based index in the response), ``rel_position`` (index / response length, in [0, 1)),
``prob_q`` (quantiles of π among the response tokens of the rule's advantage sign: [0, 0.1] is that
sign's 10% least likely tokens) and ``mean_entropy`` (the mini-batch's mean H over its response
tokens, the same for every token: a gate that turns the rule on or off for the whole batch).
The upper bound is strict so that [0, τ) is exactly "π < τ" and [q, 1] is its complement; ``null``
leaves an end open, and the top of a bounded range (prob 1, entropy_q 1, rel_position 1) does too, so
[0.8, 1] includes the highest entropy. Actions: ``mask`` (``renorm: true``, the default, also
drops the token from the denominator, STAPO's renormalisation; false keeps it counted),
``scale`` with ``scale: c >= 0``, ``weight`` with ``fn: NAME`` (a registered weight function f) and
optionally ``alpha: a`` (the factor is a·f + (1 − a); default 1, f itself).
Each token takes the action of the first rule it matches (the list is ordered).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Optional

from stapoctl.errors import UserError

ADV_SIGNS = ("any", "pos", "neg")
ACTIONS = ("mask", "scale", "weight")
# band key -> (lowest value, highest value, is the top an open end, integers only)
BANDS: dict[str, tuple[float, float, bool, bool]] = {
    "prob": (0.0, 1.0, True, False),
    "entropy": (0.0, math.inf, False, False),
    "entropy_q": (0.0, 1.0, True, False),
    "position": (0.0, math.inf, False, True),
    "rel_position": (0.0, 1.0, True, False),
    "prob_q": (0.0, 1.0, True, False),
    "mean_entropy": (0.0, math.inf, False, False),
}
EXAMPLES = {"prob": "[0, 0.002]", "entropy": "[0, 1.5]", "entropy_q": "[0, 0.8]", "position": "[0, 64]",
            "rel_position": "[0.5, 1]", "prob_q": "[0, 0.1]", "mean_entropy": "[0, 0.3]"}
KEYS = ("name", "adv", *BANDS, "action", "renorm", "scale", "fn", "alpha")
EXAMPLE = "{adv: pos, prob: [0, 0.002], entropy_q: [0, 0.8], action: mask}"
# the built-in weight functions (losses/rules.py registers them and any added at run time)
TOKEN_WEIGHT_FNS: set[str] = {"prob", "one_minus_prob", "surprisal", "old_prob"}

Band = tuple[Optional[float], Optional[float]]  # (low, high); None = open end


@dataclass(frozen=True)
class TokenRule:
    """One parsed rule; a band end of None is open. Presets build these directly."""

    name: str
    action: str
    adv: str = "any"
    prob: Optional[Band] = None
    entropy: Optional[Band] = None
    entropy_q: Optional[Band] = None
    position: Optional[Band] = None
    rel_position: Optional[Band] = None
    prob_q: Optional[Band] = None
    mean_entropy: Optional[Band] = None
    renorm: bool = True
    scale: float = 1.0
    fn: str = ""
    alpha: float = 1.0

    def text(self) -> str:
        """The rule in the grammar it is written in (`stapoctl losses`, logs)."""
        parts = [f"adv: {self.adv}"] if self.adv != "any" else []
        for key in BANDS:
            band = getattr(self, key)
            if band is not None:
                top = 1 if BANDS[key][2] else None  # an open top is written 1 where the range ends there
                parts.append(f"{key}: [{_num(band[0], 0)}, {_num(band[1], top)}]")
        parts.append(f"action: {self.action}")
        if self.action == "mask" and not self.renorm:
            parts.append("renorm: false")
        if self.action == "scale":
            parts.append(f"scale: {_num(self.scale, 0)}")
        if self.action == "weight":
            parts.append(f"fn: {self.fn}" + (f", alpha: {_num(self.alpha, 0)}" if self.alpha != 1.0 else ""))
        return "{" + ", ".join(parts) + "}"


def _num(x: Optional[float], open_as: Any) -> str:
    if x is None:
        return "null" if open_as is None else str(open_as)
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _fail(where: str, key: str, value: Any, why: str) -> UserError:
    return UserError(f"{where}.{key}={_show(value)}: {why}")


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _number(where: str, key: str, band: Any, x: Any) -> Optional[float]:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x):
        raise _fail(where, key, band, f"the ends must be numbers or null, e.g. {key}: {EXAMPLES[key]}")
    return float(x)


def parse_band(where: str, key: str, value: Any) -> Band:
    """[low, high] → (low, high) with open ends as None; one-line errors name the fix."""
    lowest, highest, top_open, integers = BANDS[key]
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _fail(where, key, value, f"a band is a list [low, high] (low <= x < high), e.g. {key}: {EXAMPLES[key]}")
    low, high = (_number(where, key, value, x) for x in value)
    for x in (low, high):
        if x is not None and not lowest <= x <= highest and not math.isinf(x):
            raise _fail(where, key, value, f"the ends must lie in [{_num(lowest, 0)}, {_num(highest, 0)}]")
        if x is not None and integers and not math.isinf(x) and not float(x).is_integer():
            raise _fail(where, key, value, "positions are whole token indices, e.g. position: [0, 64]")
    if low is not None and high is not None and low >= high:
        raise _fail(where, key, value, f"an empty band (low <= x < high needs low < high), e.g. {key}: {EXAMPLES[key]}")
    low = None if low is None or low <= lowest or math.isinf(low) else low
    high = None if high is None or math.isinf(high) or (top_open and high >= highest) else high
    return low, high


def _known_keys(where: str, raw: dict) -> None:
    for key in raw:
        if key not in KEYS:
            near = difflib.get_close_matches(str(key), KEYS, n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise _fail(where, str(key), raw[key], f"unknown key: {hint}(keys: {', '.join(KEYS)})")


def _action(where: str, raw: dict) -> dict[str, Any]:
    action = raw.get("action")
    if action not in ACTIONS:
        raise _fail(where, "action", action, f"must be {', '.join(ACTIONS[:-1])} or {ACTIONS[-1]}, e.g. action: mask")
    for key, owner in (("renorm", "mask"), ("scale", "scale"), ("fn", "weight"), ("alpha", "weight")):
        if key in raw and action != owner:
            raise _fail(where, key, raw[key], f"only action: {owner} takes {key} (this rule has action: {action})")
    out: dict[str, Any] = {"action": action}
    if action == "mask":
        renorm = raw.get("renorm", True)
        if not isinstance(renorm, bool):
            raise _fail(where, "renorm", renorm, "must be true (STAPO's renormalised denominator) or false")
        out["renorm"] = renorm
    elif action == "scale":
        c = raw.get("scale")
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not c >= 0 or math.isinf(c):
            raise _fail(where, "scale", c, "action: scale needs scale: c, a finite number >= 0 (0 silences "
                                           "without renormalising), e.g. scale: 0.5")
        out["scale"] = float(c)
    else:
        fn = raw.get("fn")
        if fn not in TOKEN_WEIGHT_FNS:
            raise _fail(where, "fn", fn, f"action: weight needs fn: NAME, a registered weight function "
                                         f"({', '.join(sorted(TOKEN_WEIGHT_FNS))})")
        out["fn"] = fn
        a = raw.get("alpha", 1.0)
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise _fail(where, "alpha", a, "alpha: a mixes the weight with 1 (a·f + 1 − a), a number in [0, 1], "
                                           "e.g. alpha: 0.3")
        out["alpha"] = float(a)
    return out


def parse_rule(raw: Any, index: int, field: str = "token_rules") -> TokenRule:
    """One rule from its dict (YAML / command line); the first bad field raises a one-line UserError."""
    where = f"{field}[{index}]"
    if isinstance(raw, TokenRule):
        return raw
    if not hasattr(raw, "keys"):
        raise UserError(f"{where}={_show(raw)}: a rule is a dict, e.g. {field}=[{EXAMPLE}]")
    raw = dict(raw)
    _known_keys(where, raw)
    adv = raw.get("adv", "any")
    if adv not in ADV_SIGNS:
        raise _fail(where, "adv", adv, "must be pos (A > 0), neg (A < 0) or any")
    name = raw.get("name", f"r{index}")
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise _fail(where, "name", name, "a label of letters, digits, _ or - (it names the rule's metrics)")
    bands = {k: parse_band(where, k, raw[k]) for k in BANDS if raw.get(k) is not None}
    bands = {k: band for k, band in bands.items() if band != (None, None)}  # open at both ends: no condition
    return TokenRule(name=name, adv=adv, **bands, **_action(where, raw))


def parse_rules(raw: Any, field: str = "token_rules") -> tuple[TokenRule, ...]:
    """The ordered rules of a config field (a list of dicts; None or [] = no rules)."""
    if raw is None:
        return ()
    if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__") or hasattr(raw, "keys"):
        raise UserError(f"{field}={_show(raw)}: a list of rules, e.g. {field}=[{EXAMPLE}]")
    rules = tuple(parse_rule(r, i, field) for i, r in enumerate(raw))
    names = [r.name for r in rules]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise UserError(f"{field}[{i}].name={name}: another rule has this name (names label the metrics)")
    return rules
