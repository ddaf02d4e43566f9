"""`load_rows(name, ...)`: the one way training and evaluation get dataset rows.

Resolution order for real datasets: `data.source` (for the training set), a data root
(`data.root` / `STAPOCTL_DATA`) holding `<name>.jsonl`, files written by `stapoctl data prep`
(under STAPOCTL_HOME/data), then the hub. Rows are normalized on load and the prompt is
always rendered fresh with the given tokenizer, so a prepped file made for another model
still frames prompts for this one. `toy*` are generated from `data.toy`.
"""

from __future__ import annotations

import contextlib
import logging

from stapoctl.data import sources as S
from stapoctl.data import toy
from stapoctl.data.origin import apply_template, find_origin, normalized_rows, prep_progress
from stapoctl.data.templates import tokenizer_for_template
from stapoctl.errors import labelled

log = logging.getLogger("stapoctl.data")

DATASETS = tuple(S.SOURCES)


def toy_source_rows(name: str, data_cfg) -> list[dict]:
    return toy.rows(data_cfg.toy, "heldout" if name == "toy" else "train")


def load_rows(name: str, data_cfg, tokenizer_path=None, split: str | None = None, console=None) -> list[dict]:
    """Rows {id, prompt, answer, problem, ...} of a dataset, prompt templated per data_cfg.

    `split` overrides the hub split; malformed rows are skipped and counted in a warning
    (and printed on `console` when one is given).
    """
    name = S.canonical_name(name)
    tokenizer = tokenizer_for_template(data_cfg.template, tokenizer_path)
    with contextlib.ExitStack() as stack:
        progress = stack.enter_context(prep_progress(console)) if console is not None else None
        task = progress.add_task(f"data {name}", total=None) if progress else None
        tick = (lambda: progress.advance(task)) if progress else None
        if S.SOURCES[name].kind == "toy":
            rows = toy_source_rows(name, data_cfg)
        else:
            source = data_cfg.source if S.canonical_name(data_cfg.name) == name else None
            origin = find_origin(name, data_cfg, source, split, include_prepped=True)
            rows, stats = normalized_rows(name, origin, strict=False, on_row=tick)
            if stats.malformed:
                message = (f"{name}: skipped {stats.malformed} malformed of {stats.read} rows "
                           f"(first: {stats.problems[0]})")
                log.warning(message)
                if console is not None:
                    console.print(labelled("warning:", message, "yellow"), highlight=False)  # row text: text
            if stats.duplicates:
                log.info("%s: %d duplicate problems dropped, %d unique kept", name, stats.duplicates, stats.kept)
        out = apply_template(rows, template=data_cfg.template, instruction=data_cfg.instruction,
                             tokenizer=tokenizer)
        if progress:
            progress.update(task, completed=len(out), total=len(out))
    if console is not None:
        console.print(f"data {name}: {len(out)} prompts ({data_cfg.template} template)", highlight=False)
    return out
