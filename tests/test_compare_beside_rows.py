"""`compare` beside its rows, on a real MLflow sqlite store: the inert knobs of each row's seeds
(tags stapoctl.inert.<knob>) and, because the rows differ in model.dtype, each row's mean flip
rate over its seeds' measured steps (hand-computed here)."""

from __future__ import annotations

import json
import statistics

from test_tracking_report import cli

WHY = ("loss=stapo's mask s2t acted on no token (stapo/spurious_count 0 in all 4 steps, τ_p=1e-09): the run "
       "trained as DAPO (stapo is DAPO plus the mask)")
# (dtype, seed) → rollout_corr/flip_rate at the measured steps 1..4
FLIPS = {("float32", 0): [0.0, 0.0, 0.0, 0.0], ("float32", 1): [0.0, 0.0, 1e-4, 0.0],
         ("bfloat16", 0): [3e-4, 1e-4, 2e-4, 0.0], ("bfloat16", 1): [5e-4, 3e-4, 1e-4, 1e-4]}


def build(root) -> str:
    from omegaconf import OmegaConf

    from stapoctl.tracking import keys, mlflow_run

    uri = f"sqlite:///{root / 'mlflow.db'}"
    for (dtype, seed), flips in FLIPS.items():
        with mlflow_run.start_run(uri=uri, experiment="stapoctl", run_name=f"{dtype}-{seed}",
                                  tags={keys.KIND: keys.KIND_TRAIN}):
            mlflow_run.log_config(OmegaConf.create({"loss": {"name": "stapo", "tau_p": 1e-9},
                                                    "model": {"dtype": dtype}, "trainer": {"seed": seed}}))
            for step, f in enumerate(flips, 1):
                mlflow_run.log_metrics({"rollout_corr/flip_rate": f, "val/toy/train/avg_at_4": 0.5}, step=step)
            if dtype == "float32":
                import mlflow

                mlflow.set_tag(keys.INERT_PREFIX + "loss.stapo.s2t", WHY)
    return uri


def test_compare_names_inert_knobs_and_flip_rates_beside_the_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = build(tmp_path)
    import mlflow

    ids = [r.info.run_id for r in mlflow.MlflowClient(uri).search_runs(["1"])]
    out = tmp_path / "cmp"
    res = cli("compare", *ids, "--uri", uri, "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    text = " ".join(res.stdout.split())
    assert "float32: loss=stapo's mask s2t acted on no token in 2 of 2 seeds — those trials trained " \
           "as DAPO" in text
    for dtype in ("float32", "bfloat16"):
        mean = statistics.fmean(statistics.fmean(FLIPS[(dtype, s)]) for s in (0, 1))
        assert f"{dtype}: mean flip rate {mean:.3e} of response tokens" in text, (dtype, text)
    table = json.loads((out / "table.json").read_text())
    assert len(table["beside_rows"]) == 3 and "## Beside the rows" in (out / "table.md").read_text()
    assert "(inert: loss.stapo.s2t)" in (out / "table.md").read_text()


def test_runs_names_the_inert_knobs_under_the_table(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = build(tmp_path)
    res = cli("runs", "--uri", uri, columns=80)
    assert res.returncode == 0, res.stdout
    lines = [" ".join(line.split()) for line in res.stdout.splitlines() if line.startswith("~ ")]
    assert len(lines) == 2 and all(line.split(" ", 2)[2] == "inert: " + " ".join(WHY.split()) for line in lines)
