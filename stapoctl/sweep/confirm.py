"""`stapoctl sweep NAME confirm=PILOT_SWEEP [max_seeds=N] [delta=D]`: a confirmatory sweep, sized
from a pilot sweep's per-row spread (`analysis/confirm.py`) and run on fresh seeds.

A pilot's seeds chose which differences look worth claiming, so they cannot also confirm them:
the confirmatory sweep runs seeds none of the pilot's trials (nor an earlier confirmation of it)
used, and `compare` tests it on those alone, the pilot's estimate beside it as exploratory. It
runs the pilot's design: the pilot's recorded experiment, overrides and the values' own
overrides, restricted to `values=[…]` when given; only where trials run (tracking., cluster.)
may change on the command line, as for a resume.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stapoctl.analysis.confirm import MAX_SEEDS, Sizing, fresh_seeds, size
from stapoctl.analysis.statistics import ALPHA, POWER
from stapoctl.errors import UserError
from stapoctl.sweep import layout, store
from stapoctl.sweep.definition import SweepCommand, SweepDefinition, override_key
from stapoctl.tracking import keys

WHERE_TRIALS_RUN = ("tracking.", "cluster.")  # what a confirmation may change of its pilot's design


@dataclass
class Confirmation:
    """The pilot, the sizing, and the pilot's design on fresh seeds (empty when refused)."""

    pilot: Any  # the pilot sweep's parent run
    sizing: Sizing
    definition: SweepDefinition
    extra: tuple[str, ...]  # tracking./cluster. overrides of this command line
    used: tuple[int, ...]  # seeds the pilot (and earlier confirmations of it) used

    @property
    def tags(self) -> dict[str, str]:
        return {keys.SWEEP_ROLE: keys.ROLE_CONFIRMATORY, keys.CONFIRMS: self.pilot.info.run_id}


def design(command: SweepCommand, uri: Optional[str], experiment: str) -> Confirmation:
    """Find the pilot, check the command against its design, size the rows, pick fresh seeds."""
    pilot = store.find_parent(command.confirm, uri, experiment, what="confirm")
    definition, extra = pilot_design(command, store.recorded_definition(pilot, uri))
    sizing = pilot_sizing(uri, pilot, definition, command.max_seeds or MAX_SEEDS, command.delta)
    used = used_seeds(pilot, uri)
    seeds = fresh_seeds(set(used), sizing.seeds) if sizing.refusal() is None else ()
    return Confirmation(pilot, sizing, replace(definition, seeds=seeds or definition.seeds), extra, used)


def pilot_design(command: SweepCommand, recorded: SweepDefinition) -> tuple[SweepDefinition, tuple[str, ...]]:
    """The pilot's recorded definition (values=[…]: a subset of its values); tracking./cluster.
    overrides of the command line go on top, anything else that differs is refused."""
    d, spec = command.definition, command.confirm
    if d.key != recorded.key:
        raise UserError(f"confirm={spec}: the pilot sweeps {recorded.key}, sweep '{d.name}' sweeps {d.key}: "
                        f"confirm it with `stapoctl sweep {recorded.name} confirm={spec}`")
    if "experiment" in command.given and d.experiment != recorded.experiment:
        raise UserError(f"confirm={spec}: experiment={d.experiment} differs from the pilot's {recorded.experiment}: "
                        "a confirmation runs the pilot's design; drop experiment=")
    values = d.values if "values" in command.given else recorded.values
    unknown = [v for v in values if v not in recorded.values]
    if unknown:
        raise UserError(f"confirm={spec}: the pilot has no value {', '.join(unknown)} (its values: "
                        f"{', '.join(recorded.values)}): confirm values it ran")
    if len(values) < 2:
        raise UserError(f"confirm={spec}: values=[{', '.join(values)}]: a confirmation tests rows against a "
                        "baseline; give two values or more, e.g. values=[grpo,wapo]")
    before = {override_key(o): o for o in recorded.overrides}
    extra = []
    for item in command.cli_overrides:
        key = override_key(item)
        if before.get(key) == item:
            continue
        if key not in before and key.startswith(WHERE_TRIALS_RUN):
            extra.append(item)
            continue
        was = f"the pilot's {before[key]}" if key in before else "nothing in the pilot"
        raise UserError(f"confirm={spec}: {item} differs from {was}: a confirmation runs the pilot's design "
                        f"(only {' / '.join(k + '*' for k in WHERE_TRIALS_RUN)} may be added); drop it")
    return recorded.with_values(tuple(values)), tuple(extra)


def pilot_sizing(uri: Optional[str], pilot: Any, definition: SweepDefinition, max_seeds: int,
                 delta: Optional[float]) -> Sizing:
    """Seeds per row from the pilot's trials of these values, on the metric compare tests."""
    from stapoctl.analysis.cells import default_test_metric, is_accuracy, seed_values
    from stapoctl.analysis.collect import collect
    from stapoctl.analysis.compare import only_rows, pick_baseline
    from stapoctl.analysis.statistics import Sample

    comp = collect(uri, [pilot.info.run_id])
    missing = [v for v in definition.values if v not in comp.groups]
    if missing:
        raise UserError(f"confirm={pilot.info.run_id[:8]}: the pilot has no counted trial of {', '.join(missing)} "
                        f"(rows: {', '.join(comp.groups)}): nothing to size it from")
    comp = only_rows(comp, list(definition.values))
    metric = default_test_metric(comp)
    if metric is None:
        raise UserError(f"confirm={pilot.info.run_id[:8]}: the pilot's trials have no val/… or eval/… accuracy "
                        "to size from")
    values, _ = seed_values(comp, metric)
    samples = [Sample(g, [v for _, v in sv], [s for s, _ in sv]) for g, sv in values.items()]
    scale = 100.0 if is_accuracy(comp, metric) else 1.0
    return size(samples, pick_baseline(list(comp.groups), None), metric, scale, max_seeds, delta)


def used_seeds(pilot: Any, uri: Optional[str]) -> tuple[int, ...]:
    """Every seed the pilot's trials (any status) and earlier confirmations of it ran or planned."""
    c = store.client(uri)
    sweeps = [pilot] + c.search_runs([pilot.info.experiment_id], max_results=1000,
                                     filter_string=f"tags.`{keys.CONFIRMS}` = '{pilot.info.run_id}'")
    used: set[int] = set()
    for sweep in sweeps:
        used |= _ints(sweep.data.params.get(layout.P_SEEDS, "").strip("[]").split(","))
        used |= _ints(r.data.tags.get(layout.SEED, "") for r in store.children(sweep.info.run_id, uri))
    return tuple(sorted(used))


def _ints(texts) -> set[int]:
    out = set()
    for text in texts:
        try:
            out.add(int(str(text).strip()))
        except ValueError:
            continue
    return out


def sizing_lines(conf: Confirmation) -> tuple[str, str]:
    """(heading, how it was sized) around the sizing table."""
    sz = conf.sizing
    heading = (f"confirm: sized from pilot {conf.pilot.info.run_id[:8]} on {sz.metric} against {sz.baseline} "
               f"({sz.n_baseline_pilot} pilot seeds)")
    runs = (f"every row and {sz.baseline} run {sz.seeds} fresh seeds {list(conf.definition.seeds)}"
            if sz.refusal() is None else "refused: see the line below")
    how = (f"{POWER:.0%} power, two-sided unpaired t-test at α = {ALPHA:g}/{sz.m} = {sz.alpha:.4g} (Bonferroni over "
           f"{sz.m} row(s)), at least {sz.floor_seeds} seeds so the permutation test can reach it; {runs} "
           f"(the pilot's: {list(conf.used)})")
    return heading, how


def sizing_table(conf: Confirmation) -> Table:
    """The rows, their pilot numbers and the seeds each needs, in table units."""
    sz = conf.sizing
    t = Table()
    for h in ("row", "pilot n", "pilot diff", "pooled sd", "powered for", "seeds needed"):
        t.add_column(h, justify="left" if h == "row" else "right")
    for r in sz.rows:
        num = lambda x, f=".2f": "—" if x is None else format(x * sz.scale, f)  # noqa: E731
        t.add_row(escape(r.group), str(r.n_pilot), num(r.diff, "+.2f"), num(r.sd), num(r.delta),
                  str(r.needed) if r.needed is not None else escape(r.why))
    return t


def record(sweep_id: str, uri: Optional[str], conf: Confirmation) -> None:
    """The sizing beside the sweep's definition, so the design can be read back with its reasons."""
    body = {"pilot": conf.pilot.info.run_id, "pilot_seeds": list(conf.used),
            "seeds": list(conf.definition.seeds), **conf.sizing.to_json()}
    store.client(uri).log_text(sweep_id, json.dumps(body, indent=1), keys.CONFIRM_SIZING)


def print_sizing(conf: Confirmation, console: Console) -> None:
    heading, how = sizing_lines(conf)
    console.print(f"[bold]{escape(heading)}[/]", highlight=False, soft_wrap=True)
    console.print(sizing_table(conf))
    console.print(how, highlight=False, markup=False, soft_wrap=True)
