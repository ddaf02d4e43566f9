"""The eval report in the console: Table 2 of the STAPO paper, then the per-benchmark details.

Table 2 prints one row per model with a column per benchmark plus the six-benchmark average;
each cell is avg@k in percent under the training decoding (T=1.0) with the JustRL decoding
(T=0.7, top-p 0.9) in parentheses. The detail table has every number behind those cells.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table

from stapoctl.data.benches import EVAL_BENCHES, PAPER_BENCHES, TITLES


def _pct(x: float, digits: int = 2) -> str:
    return f"{100 * x:.{digits}f}"


def _cell(by_dec: dict[str, dict], order: list[str]) -> str:
    values = [_pct(by_dec[d][f"avg@{by_dec[d]['k']}"]) for d in order if d in by_dec]
    if len(values) == 2:
        return f"{values[0]} ({values[1]})"
    return values[0] if values else "-"


def table2(summary: dict[str, Any]) -> Table:
    """Benchmarks × decodings in the paper's layout (avg@k, %)."""
    results = summary["results"]
    decodings = list(dict.fromkeys(r["decoding"] for r in results))
    benches = [b for b in EVAL_BENCHES if any(r["bench"] == b for r in results)]
    label = " (".join(decodings) + (")" if len(decodings) == 2 else "")
    table = Table(title=f"avg@k (%) — {label}", title_justify="left")
    table.add_column("Model", style="bold")
    for b in benches:
        k = next(r["k"] for r in results if r["bench"] == b)
        table.add_column(f"{TITLES[b]}\n@{k}", justify="right")
    averages = summary.get("averages", {})
    if averages:
        n = next(iter(averages.values()))["benches"]
        table.add_column("Avg" if n == len(PAPER_BENCHES) else f"Avg ({n} of {len(PAPER_BENCHES)})",
                         justify="right", style="bold")
    row = [escape(str(summary.get("model_name") or summary["model"]))]  # a path or hub id: text
    for b in benches:
        row.append(_cell({r["decoding"]: r for r in results if r["bench"] == b}, decodings))
    if averages:
        vals = [_pct(averages[d]["avg"]) for d in decodings if d in averages]
        row.append(f"{vals[0]} ({vals[1]})" if len(vals) == 2 else vals[0])
    table.add_row(*row)
    return table


def details(summary: dict[str, Any]) -> Table:
    """Every metric per (benchmark, decoding), fractions shown as percents (fits 80 columns)."""
    table = Table(title="Per benchmark and decoding (%, len in tokens)", title_justify="left",
                  box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False)
    for col in ("bench", "dec", "k", "N", "avg@k", "±CI95", "pass@k", "pass@1", "maj@k", "len", "trunc", "nobox"):
        table.add_column(col, justify="left" if col in ("bench", "dec") else "right", no_wrap=True)
    for r in summary["results"]:
        k = r["k"]
        p = lambda key: _pct(r[key], 1)  # noqa: E731
        table.add_row(
            TITLES.get(r["bench"], r["bench"]), r["decoding"], str(k), str(int(r["problems"])),
            p(f"avg@{k}"), p(f"avg@{k}_ci95"), p(f"pass@{k}"), p("pass@1"), p(f"maj@{k}"),
            f"{r['response_length']:.0f}", p("truncation_rate"), p("no_answer_rate"),
        )
    return table


def notes(summary: dict[str, Any]) -> list[str]:
    """Skipped prompts, timeouts, and what this invocation generated vs reused (resume)."""
    lines = []
    skipped: dict[str, tuple[int, int]] = {}  # the same prompts are skipped under every decoding
    for r in summary["results"]:
        name = TITLES.get(r["bench"], r["bench"])
        if r["skipped"]:
            skipped[name] = (int(r["skipped"]), int(r["problems"]))
        if r["verify_timeouts"]:
            lines.append(f"{name}/{r['decoding']}: {int(r['verify_timeouts'])} answer checks timed out (scored incorrect)")
    if skipped:
        lines.insert(0, "prompts longer than the model's context, skipped and scored incorrect: "
                     + ", ".join(f"{name} {n}/{total}" for name, (n, total) in skipped.items()))
    gen = sum(r["generated_problems"] for r in summary["results"])
    reused = sum(r["reused_problems"] for r in summary["results"])
    lines.append(f"problems generated now: {gen}, reused from earlier runs: {reused}")
    return lines


def print_report(summary: dict[str, Any], console: Any) -> None:
    console.print(table2(summary))
    console.print(details(summary))
    for line in notes(summary):
        console.print(line, highlight=False, markup=False)
    console.print(
        f"model: {summary['model_path']}  ·  max response {summary['max_response_length']} tokens  ·  "
        f"wall {summary['wall_s']:.1f}s (engines {summary['engine_s']:.1f}s)",
        highlight=False, markup=False,
    )
