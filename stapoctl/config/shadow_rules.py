"""`loss.shadow`: token rules that are only measured, parsed and checked without torch.

A shadow is a set of tokens a method *would* touch; the loss library logs, per step, its share of
the response tokens, of the positive-advantage tokens and of the gradient (losses/shadow.py), and
never lets it change the update. So a plain GRPO run can measure STAPO's claim that the tokens it
silences carry an outsized share of the gradient. Each entry of the list is one of:

    stapo                                              # a preset: the rules of a registered method
    table1                                             # 000 Table 1: eight shadows, one per cell
    {adv: pos, prob: [0, 0.01], action: mask, name: rare}    # one rule (the grammar of token_rules)
    [{adv: pos, prob: [0, 0.01], action: mask, name: rare}, {...}]  # rules taken together

A preset takes this run's τ_p, τ_h (and the S2T fields it shares with the method); the shadow's
tokens are those any of its rules takes, first match winning as in ``token_rules``. A rule list is
named by its first rule. Names label the metrics (``shadow/<name>/grad_share``) and must differ.
"""

from __future__ import annotations

from typing import Any

from stapoctl.config.token_rules import TokenRule, parse_rule, parse_rules
from stapoctl.errors import UserError

TABLE1 = "table1"
EXAMPLE = "loss.shadow=[stapo,entropy20]"
# 000 Table 1's eight cells as (name, advantage sign, π < τ_p, H < h*), in the table's order
CELLS: tuple[tuple[str, str, bool, bool], ...] = tuple(
    (f"{adv}_{'low' if low_p else 'high'}p_{'low' if low_h else 'high'}h", adv, low_p, low_h)
    for adv in ("pos", "neg") for low_p in (False, True) for low_h in (False, True))
SPURIOUS_CELL = "pos_lowp_lowh"  # 000's destructive regime: Â > 0, π < τ_p, H < h*


def cell_rules(tau_p: float, tau_h: float) -> tuple[TokenRule, ...]:
    """The eight cells as mask rules with the bands the losses use: π < τ_p is prob [0, τ_p), H < h*
    is entropy_q [0, 1 − τ_h) (STAPO's h*); their complements close the partition."""
    q = 1.0 - tau_h
    return tuple(TokenRule(name=name, adv=adv, action="mask",
                           prob=(None, tau_p) if low_p else (tau_p, None),
                           entropy_q=(None, q) if low_h else (q, None))
                 for name, adv, low_p, low_h in CELLS)


def _preset(name: str, cfg: Any, configs: dict[str, type], where: str) -> tuple[tuple[str, tuple], ...]:
    if name == TABLE1:
        return tuple((rule.name, (rule,)) for rule in cell_rules(cfg.tau_p, cfg.tau_h))
    presets = sorted(k for k, cls in configs.items() if cls().preset_rules())
    if name not in presets:
        raise UserError(f"{where}={name}: not a preset; use {', '.join(presets + [TABLE1])}, or a rule such as "
                        "{adv: pos, prob: [0, 0.002], action: mask, name: rare}")
    shared = {k: getattr(cfg, k) for k in ("tau_p", "tau_h", "quantile_interpolation") if hasattr(cfg, k)}
    return ((name, configs[name](**shared).preset_rules()),)


def parse_shadows(raw: Any, cfg: Any, configs: dict[str, type],
                  field: str = "shadow") -> tuple[tuple[str, tuple[TokenRule, ...]], ...]:
    """(name, rules) per shadow; ``configs``: the loss registry (name → config class) presets come from.
    A bad entry raises a one-line UserError naming it and the fix."""
    if raw is None:
        return ()
    if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__") or hasattr(raw, "keys"):
        raise UserError(f"{field}={raw}: a list of presets or rules, e.g. {EXAMPLE}")
    out: list[tuple[str, tuple[TokenRule, ...]]] = []
    for i, entry in enumerate(raw):
        where = f"{field}[{i}]"
        if isinstance(entry, str):
            out += _preset(entry.strip(), cfg, configs, where)
        elif hasattr(entry, "keys"):
            rule = parse_rule(entry, i, field)
            out.append((rule.name if "name" in entry else f"s{i}", (rule,)))
        elif hasattr(entry, "__iter__") and list(entry):
            rules = parse_rules(list(entry), where)
            out.append((rules[0].name if "name" in rules_given(entry) else f"s{i}", rules))
        else:
            raise UserError(f"{where}={entry}: a preset name, a rule dict or a list of rules, e.g. {EXAMPLE}")
    _distinct(out, field)
    return tuple(out)


def rules_given(entry: Any) -> Any:
    first = list(entry)[0]
    return first if hasattr(first, "keys") else {}


def _distinct(shadows: list[tuple[str, tuple]], field: str) -> None:
    names = [name for name, _ in shadows]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise UserError(f"{field}: two shadows are named {name} (names label the metrics "
                            "shadow/<name>/...): give its rule another name, e.g. name: rare2")

