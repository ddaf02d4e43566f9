"""`stapoctl compare SWEEP_ID | RUN_ID...`: runs grouped by method or swept value, seeds
aggregated, in the layout of 000 Table 2, plus the figures of 000 Figs. 3–5.

Rows are the sweep's values (tag `stapoctl.sweep_value`) or, for plain runs, the config values
that differ between them (seeds and bookkeeping keys aside), so three seeds of GRPO and three
of STAPO give two rows. Cells are mean ± sample std over seeds with the seed count; the
final accuracy of a run is read as `keys` documents (own eval/… metric, nested eval run, last
validation). Everything shown is also written as table.md / table.csv / table.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console

from stapoctl.analysis import figures
from stapoctl.analysis.collect import TRAINING_COLUMNS, Comparison, collect, mlflow_client
from stapoctl.analysis.tables import csv_text, markdown, records, tables
from stapoctl.tracking import keys


def default_out(comp: Comparison) -> Path:
    ids = [s.info.run_id for s in comp.sweeps] or [t.id for t in comp.trials]
    tail = "_".join(comp.short[i] for i in ids[:3]) + ("_etc" if len(ids) > 3 else "")
    return Path(f"compare-{tail}")


def compare(uri: Optional[str], ids: Sequence[str], console: Console, metrics: Sequence[str] = (),
            out: Optional[str] = None) -> dict[str, Path]:
    """Print both tables; write table.{md,csv,json} and the figures to out (a dir; a .png path
    names the training-curves file, as before); log them to each compared sweep under compare/."""
    comp = collect(uri, ids)
    columns = tuple((m, m) for m in metrics) if metrics else TRAINING_COLUMNS
    for heading, table in tables(comp, columns):
        console.print(f"[bold]{heading}[/]", highlight=False)
        console.print(table)
    curves_name = "training_curves.png"
    out_dir = Path(out) if out else default_out(comp)
    if out and out.endswith(".png"):
        out_dir, curves_name = Path(out).parent, Path(out).name
    out_dir.mkdir(parents=True, exist_ok=True)
    client = mlflow_client(uri)
    written = {"table.md": out_dir / "table.md", "table.csv": out_dir / "table.csv",
               "table.json": out_dir / "table.json"}
    written["table.md"].write_text(markdown(comp, columns))
    rows = records(comp, columns)
    written["table.csv"].write_text(csv_text(rows))
    written["table.json"].write_text(json.dumps(
        {"key": comp.key, "sweeps": [s.info.run_id for s in comp.sweeps], "rows": rows,
         "runs": [{"run_id": t.id, "group": t.group, "seed": t.seed, "name": t.run.info.run_name,
                   "finals": {f"{b}/{d}": {"value": v, "k": k, "source": s} for (b, d), (v, k, s) in t.finals.items()}}
                  for t in comp.trials]}, indent=1) + "\n")
    written.update(figures.draw_all(client, comp, out_dir, curves_name=curves_name, panels=list(metrics) or None))
    for sweep in comp.sweeps:
        for path in written.values():
            client.log_artifact(sweep.info.run_id, str(path), keys.COMPARE_DIR)
    console.print(f"written to [bold]{out_dir}[/]: " + ", ".join(p.name for p in written.values()), highlight=False)
    if comp.sweeps:
        console.print("logged to the sweep run" + ("s " if len(comp.sweeps) > 1 else " ")
                      + ", ".join(comp.short[s.info.run_id] for s in comp.sweeps) + f" under {keys.COMPARE_DIR}/",
                      highlight=False)
    return written
