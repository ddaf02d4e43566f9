"""The summary of an eval (what summary.json, the report and the MLflow run hold), from the stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stapoctl.data.benches import PAPER_BENCHES
from stapoctl.eval.metrics import summarize


def summarize_jobs(jobs, conf, model_spec, model_path, out_dir, limit, wall_s, engine_s) -> dict[str, Any]:
    results = []
    for job in jobs:
        ids = [p.id for p in job["problems"]]
        stats = summarize(job["store"].for_ids(ids), job["k"])
        results.append({"bench": job["bench"], "decoding": job["decoding"].name, "k": job["k"],
                        "temperature": job["decoding"].temperature, "top_p": job["decoding"].top_p,
                        "generated_problems": job["generated"], "reused_problems": job["reused"],
                        "jsonl": str(job["store"].path), **stats})
    averages = {}
    for dec in dict.fromkeys(r["decoding"] for r in results):
        paper = [r for r in results if r["decoding"] == dec and r["bench"] in PAPER_BENCHES]
        if paper:
            averages[dec] = {"benches": len(paper),
                             "avg": sum(r[f"avg@{r['k']}"] for r in paper) / len(paper)}
    return {"model": model_spec or "(embedded tiny)", "model_name": _display_name(model_spec, model_path),
            "model_path": model_path, "output_dir": str(out_dir),
            "limit": limit, "max_response_length": int(conf.eval.max_response_length),
            "wall_s": round(wall_s, 1), "engine_s": round(engine_s, 1), "results": results, "averages": averages}


def _display_name(model_spec: str, model_path: str) -> str:
    """Short row label: tiny-<hash>, run <id>/step_N, or the hub id."""
    path = Path(model_path)
    if path.name == "model" and path.parent.name.startswith("step_"):
        return f"{path.parent.parent.parent.name[:8]}/{path.parent.name}"
    return path.name if path.exists() else model_path
