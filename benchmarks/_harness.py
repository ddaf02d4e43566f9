"""What every side-by-side benchmark shares: statistics, the row format, results JSON, the
rich table and the docs/PERFORMANCE.md table.

A *row* compares one quantity measured on both sides in the same run: ``ours`` (stapoctl) and
``peer`` (TRL, transformers, plain torch, ...), each a list of samples summarised by median and
min/max. ``ratio`` is always oriented so that > 1 is better for stapoctl (a speed-up, or
peer/ours for costs), so one ``target`` reads "ratio >= target" — except rows whose target is
a ceiling (overheads, memory), flagged ``target_max``. ``checks`` are the same-work checks: a
ratio bought with a bug (fewer tokens, another loss, another dtype) fails them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's stapoctl, not another install's
    sys.path.insert(1, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "PERFORMANCE.md"
TABLE_BEGIN = "<!-- bench-table:begin (stapoctl bench --write-docs rewrites this block) -->"
TABLE_END = "<!-- bench-table:end -->"
# which row of the issue table each result row belongs to, in the order of the issue
ORDER = ("full_step_tiny", "full_step_25m", "learning_per_minute", "engines_up", "rollout_tokens_25m",
         "rollout_tokens_tiny", "async_tiny", "async_25m", "loss_overhead", "token_trace_overhead",
         "learner_budget_rows_25m", "learner_budget_prompts_25m", "learner_budget_packed_25m", "learner_budget_25m_trl",
         "weight_sync_25m", "weight_sync_tiny", "token_stats_memory", "zero3_logits_forward", "zero3_logits_step")


def summary(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and n of the samples (NaN-free); empty input gives n = 0."""
    xs = [float(x) for x in samples if x is not None and x == x]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "samples": []}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "samples": [round(x, 6) for x in xs]}


def check(name: str, ok: Optional[bool], detail: str) -> dict[str, Any]:
    """A same-work check: ok True/False, or None when it could not be evaluated."""
    return {"name": name, "ok": ok, "detail": detail}


def within(a: Optional[float], b: Optional[float], rel: float) -> Optional[bool]:
    if a is None or b is None:
        return None
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def row(
    key: str,
    title: str,
    *,
    ours: Optional[Sequence[float]],
    peer: Optional[Sequence[float]],
    unit: str,
    lower_is_better: bool,
    target: Optional[float],
    target_text: str,
    ours_label: str = "stapoctl",
    peer_label: str = "",
    checks: Iterable[dict] = (),
    notes: str = "",
    ratio: Optional[float] = None,
    target_max: bool = False,
    absolute: bool = False,
    status: str = "",
    extra: Optional[dict] = None,
) -> dict[str, Any]:
    """One result row. ratio defaults to peer/ours (costs) or ours/peer (rates), > 1 = stapoctl better.

    absolute=True: the target is a bound on stapoctl's own median (e.g. "engines up <= 15 s"),
    the peer is shown for reference only.
    """
    o, p = summary(ours or []), summary(peer or [])
    if ratio is None and o["median"] and p["median"] and not absolute:
        ratio = p["median"] / o["median"] if lower_is_better else o["median"] / p["median"]
    checks = list(checks)
    if status:
        verdict = status
    elif absolute and target is not None and o["median"] is not None:
        good = o["median"] <= target if lower_is_better else o["median"] >= target
        verdict = "PASS" if good else "MISS"
    elif ratio is None or target is None:
        verdict = "INFO" if target is None and ratio is not None else "N/A"
    else:
        verdict = "PASS" if (ratio <= target if target_max else ratio >= target) else "MISS"
    if verdict == "PASS" and any(c["ok"] is False for c in checks):
        verdict = "INVALID"  # the ratio holds, but the two sides did not do the same work
    return {
        "key": key, "title": title, "unit": unit, "lower_is_better": lower_is_better,
        "ours_label": ours_label, "peer_label": peer_label, "ours": o, "peer": p,
        "ratio": ratio, "target": target, "target_max": target_max, "absolute": absolute, "target_text": target_text,
        "verdict": verdict, "checks": checks, "notes": notes, **({"extra": extra} if extra else {}),
    }


def environment() -> dict[str, Any]:
    """Where and with what the numbers were taken (goes into every results file)."""
    versions = {}
    for mod in ("torch", "transformers", "vllm", "ray", "deepspeed", "trl"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "stapoctl"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except Exception:
        commit, dirty = "", False
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "versions": versions, "commit": commit + ("+dirty" if dirty else ""),
            "load_avg_1m_at_start": load, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def save(name: str, rows: list[dict], *, config: dict, seconds: float, env: Optional[dict] = None,
         extra: Optional[dict] = None, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    script = Path(sys.argv[0]).stem
    payload = {"bench": name, "command": " ".join(["stapoctl", "bench", script, *sys.argv[1:]]),
               "seconds": round(seconds, 1), "environment": env or environment(), "config": config,
               "rows": rows, **(extra or {})}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


# -- presentation -------------------------------------------------------------------------
def fmt(x: Optional[float], unit: str = "") -> str:
    if x is None:
        return "—"
    a = abs(x)
    s = f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 0.1 else f"{x:.3g}"
    return f"{s} {unit}".strip()


def side_text(s: dict, unit: str) -> str:
    if not s["n"]:
        return "—"
    if s["n"] == 1:
        return f"{fmt(s['median'], unit)} (n=1)"
    return f"{fmt(s['median'], unit)} [{fmt(s['min'])}–{fmt(s['max'])}] n={s['n']}"


def checks_text(checks: list[dict]) -> str:
    marks = {True: "✓", False: "✗", None: "?"}
    return "; ".join(f"{marks[c['ok']]} {c['detail']}" for c in checks)


def ratio_text(r: dict) -> str:
    return "—" if r["ratio"] is None else f"{r['ratio']:.2f}×"


def print_rows(rows: list[dict], console=None, title: str = "") -> None:
    """The rich table (both sides, ratio, target, verdict), then each row's same-work checks and notes."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 150)
    table = Table(title=title or None)
    for col in ("row", "stapoctl: median [min–max] n", "peer: median [min–max] n", "ratio", "target", "verdict"):
        table.add_column(escape(col), overflow="fold")
    colour = {"PASS": "green", "MISS": "red", "INVALID": "red", "INFO": "cyan"}
    for r in rows:
        v = r["verdict"]
        table.add_row(
            escape(r["title"]),
            escape(f"{r['ours_label']}: {side_text(r['ours'], r['unit'])}"),
            escape(f"{r['peer_label']}: {side_text(r['peer'], r['unit'])}") if r["peer_label"] else "—",
            ratio_text(r), escape(r["target_text"]), f"[{colour.get(v, 'yellow')}]{v}[/]",
        )
    console.print(table)
    for r in rows:
        if r["checks"]:
            console.print(f"[bold]{escape(r['title'])}[/] same work: {escape(checks_text(r['checks']))}", highlight=False)
        if r.get("notes"):
            console.print(f"[dim]  {escape(r['notes'])}[/]", highlight=False)


def docs_table(results_dir: Path = RESULTS) -> str:
    """The markdown table of every saved result, in the issue's order."""
    rows, sources = [], {}
    for path in sorted(results_dir.glob("*.json")):
        data = json.loads(path.read_text())
        for r in data.get("rows", []):
            rows.append(r)
            sources[r["key"]] = data
    rank = {k: i for i, k in enumerate(ORDER)}
    rows.sort(key=lambda r: (rank.get(r["key"], len(ORDER)), r["key"]))
    lines = [
        "| row | stapoctl: median [min–max] n | peer: median [min–max] n | ratio | target | verdict | same work | measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        env = sources[r["key"]].get("environment", {})
        when = f"{env.get('date', '?')[:10]} @{env.get('commit', '?')}"
        peer = f"{r['peer_label']}: {side_text(r['peer'], r['unit'])}" if r["peer_label"] else "—"
        cells = [r["title"], f"{r['ours_label']}: {side_text(r['ours'], r['unit'])}", peer, ratio_text(r),
                 r["target_text"], f"**{r['verdict']}**", checks_text(r["checks"]) or "—", when]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    notes = [f"- *{r['title']}*: {r['notes']}" for r in rows if r.get("notes")]
    return "\n".join(lines + ([""] + notes if notes else []))


def write_docs(results_dir: Path = RESULTS, docs: Path = DOCS) -> Path:
    """Replace the block between the markers in docs/PERFORMANCE.md (append it if absent)."""
    block = f"{TABLE_BEGIN}\n{docs_table(results_dir)}\n{TABLE_END}"
    text = docs.read_text() if docs.is_file() else "# Performance\n"
    if TABLE_BEGIN in text and TABLE_END in text:
        head, rest = text.split(TABLE_BEGIN, 1)
        _, tail = rest.split(TABLE_END, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    docs.write_text(text)
    return docs


# -- shared plumbing ------------------------------------------------------------------------
class LossClock:
    """Seconds spent inside the loss library's entry points (`prepare_minibatch`,
    `compute_policy_loss`), by wrapping them from outside: the learner imports them from
    `stapoctl.losses` at call time, so the wrap sees every call without an edit to the learner.

        with LossClock() as clock:
            clock.t = 0.0; learner.train_step(...); clock.t  # seconds of this step
    """

    NAMES = ("compute_policy_loss", "prepare_minibatch")

    def __enter__(self) -> "LossClock":
        import stapoctl.losses as L

        self.t, self._module = 0.0, L
        self._originals = {k: getattr(L, k) for k in self.NAMES}
        for k, fn in self._originals.items():
            setattr(L, k, self._clocked(fn))
        return self

    def _clocked(self, fn):
        def inner(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.t += time.perf_counter() - t0
        return inner

    def __exit__(self, *exc) -> None:
        for k, fn in self._originals.items():
            setattr(self._module, k, fn)


def base_args(parser, *, repeats: int = 5) -> None:
    parser.add_argument("--repeats", type=int, default=repeats, help=f"measured samples per side (default {repeats})")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: smallest sizes, fewest repeats; prints, does not save results")
    parser.add_argument("--out", default=str(RESULTS), help="results folder (default benchmarks/results)")
    parser.add_argument("--write-docs", action="store_true", help="rewrite the table in docs/PERFORMANCE.md")


def publish(name: str, rows: list[dict], args, console, *, config: dict, seconds: float, env: dict,
            extra: Optional[dict] = None) -> None:
    """Save the rows (unless --quick) and, with --write-docs, rewrite the docs table."""
    if args.quick:
        console.print("[dim]quick run: results not saved[/]")
        return
    path = save(name, rows, config=config, seconds=seconds, env=env, extra=extra, out_dir=Path(args.out))
    console.print(f"results: {path}")
    if args.write_docs:
        write_docs(Path(args.out))


def trl_missing(console) -> bool:
    """True (after telling the user how to install it) when TRL, the RL rows' peer, is absent."""
    try:
        import trl  # noqa: F401

        return False
    except ImportError:
        from rich.markup import escape

        console.print("[red]error:[/] " + escape(f"TRL (the peer of the RL rows) is not installed; install the bench "
                                                 f"extra: {sys.executable} -m pip install -e '{ROOT}[bench]'"),
                      highlight=False)
        return True


class LoadWatch:
    """The 1-minute load average at the start and end of each side's run: on this shared machine
    another agent's work shows up as noise, and the row says so instead of hiding it."""

    LIMIT = 2.5  # 2 cores; above this something besides the benchmark was running

    def __init__(self) -> None:
        self.seen: dict[str, list[float]] = {}

    def mark(self, side: str) -> None:
        try:
            self.seen.setdefault(side, []).append(round(os.getloadavg()[0], 2))
        except OSError:
            pass

    def check(self) -> dict[str, Any]:
        peak = max((x for v in self.seen.values() for x in v), default=None)
        if peak is None:
            return check("load", None, "load unknown")
        quiet = peak <= self.LIMIT
        return check("load", True if quiet else None,
                     f"load avg ≤ {peak:.1f}" + ("" if quiet else " (other work running: noisy)"))


def min_ratio(ours: Sequence[float], peer: Sequence[float], lower_is_better: bool) -> Optional[float]:
    """The ratio of the best samples: less sensitive to other load than the medians' ratio."""
    o = [x for x in ours if x == x]
    p = [x for x in peer if x == x]
    if not o or not p:
        return None
    return min(p) / min(o) if lower_is_better else max(o) / max(p)


def run_worker(script: Path, payload: dict, *, timeout: Optional[float] = None, env: Optional[dict] = None) -> dict:
    """Run `python script --worker JSON` in a fresh process (own imports, threads and memory);
    its last stdout line is the JSON answer; stderr passes through."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full_env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(script), "--worker", json.dumps(payload)], stdout=subprocess.PIPE,
                          text=True, timeout=timeout, env=full_env)
    if proc.returncode:
        raise RuntimeError(f"{script.name} worker exited with {proc.returncode}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])
