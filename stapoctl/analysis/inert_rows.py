"""What `compare` says beside a row about its trials' token decisions: the configured terms that
never changed an update (tags `stapoctl.inert.<knob>`, trainer/inert.py) counted over the row's
seeds, and, when rows differ in model dtype or weight transport, each row's mean flip rate (the
share of response tokens whose rule decision changes under vLLM's π, `rollout_corr/flip_rate`).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from stapoctl.analysis.collect import Comparison
from stapoctl.tracking.runs import run_inert

FLIP_RATE = "rollout_corr/flip_rate"
# the params whose difference between rows changes the training–inference drift
DRIFT_PARAMS = ("model.dtype", "rollout.weight_sync")
_LINE = re.compile(r"^(?P<what>[^()]*?)(?: \((?P<evidence>[^()]*)\))?(?:: (?P<means>.*))?$")


def inert_lines(comp: Comparison) -> list[str]:
    """One line per (row, knob) inert in some of the row's seeds, e.g. `stapo: loss=stapo's mask
    s2t acted on no token in 3 of 5 seeds — those trials trained as DAPO`."""
    out = []
    for group, trials in comp.groups.items():
        found: dict[str, list[str]] = {}
        for t in trials:
            for knob, why in run_inert(t.run).items():
                found.setdefault(knob, []).append(why)
        for knob, whys in found.items():
            m = _LINE.match(whys[0])
            what = m.group("what") if m else knob
            means = (m.group("means") or "") if m else ""
            tail = ""
            if "trained as " in means:
                tail = " — those trials trained as " + means.split("trained as ", 1)[1].split(" (")[0]
            elif means:
                tail = f" — {means}"
            out.append(f"{group}: {what} in {len(whys)} of {len(trials)} seed{'s' if len(trials) != 1 else ''}{tail}")
    return out


def drift_differs(comp: Comparison) -> bool:
    """Whether the rows differ in model dtype or weight transport (the flip rate then belongs in the table)."""
    for param in DRIFT_PARAMS:
        values = {t.run.data.params.get(param) for t in comp.trials}
        if len(values - {None}) > 1:
            return True
    tagged = {t.run.data.tags.get("stapoctl.weight_sync") for t in comp.trials}
    return len(tagged - {None}) > 1


def mean_flip_rate(client: Any, run) -> Optional[float]:
    """The mean of a run's `rollout_corr/flip_rate` over the steps that measured it."""
    values = [m.value for m in client.get_metric_history(run.info.run_id, FLIP_RATE)]
    return sum(values) / len(values) if values else None


def flip_lines(comp: Comparison, client: Any) -> list[str]:
    """Per row, the mean flip rate over its seeds' measured steps, when rows differ in dtype or transport."""
    if not drift_differs(comp):
        return []
    out = []
    for group, trials in comp.groups.items():
        rates = [r for r in (mean_flip_rate(client, t.run) for t in trials) if r is not None]
        if rates:
            out.append(f"{group}: mean flip rate {sum(rates) / len(rates):.3e} of response tokens "
                       f"({FLIP_RATE}, {len(rates)} seed{'s' if len(rates) != 1 else ''}; dtype "
                       f"{'/'.join(sorted({str(t.run.data.params.get('model.dtype')) for t in trials}))})")
    return out


def row_lines(comp: Comparison, client: Any) -> list[str]:
    """Everything said beside the rows: inert knobs, then flip rates."""
    return inert_lines(comp) + flip_lines(comp, client)
