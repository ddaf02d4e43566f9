"""Learning per wall-clock minute of the whole command, and the engines' start-up, side by side.

    stapoctl bench learning [--repeats 2] [--steps 60] [--quick]

Each repeat runs the embedded default twice from a cold process: `stapoctl train` (the CLI
itself, timed from process start to exit: imports, Ray, vLLM, DeepSpeed, 60 steps, final
checkpoint, shutdown) and a TRL `GRPOTrainer` script (imports, model load, 60 steps, final
save) on the same base model, prompts in the same order, batch, lr, clip range, token-mean
loss, beta 0, fp32 and reward. The two sides alternate which goes first. Both runs skip periodic
validation (`eval.every_n_steps=0`; TRL has none) and save once, at the end.

Afterwards one evaluator (held-out toy problems, 4 samples each at T=1.0, transformers
sampling) scores the base model and every final model. Learning per minute =
(final accuracy - base accuracy) / whole-command minutes; the row's ratio is stapoctl / TRL.

A whole run is one sample: `all` uses 2 repeats (each costs ~2-3 min today); pass
`--repeats 5` for five. stapoctl's default loss is STAPO; TRL has no S2T mask and runs its
`dapo` loss (the same DAPO surrogate without the mask; the mask's cost is the loss_overhead row).

On an AMD CPU, one more TRL run starts under the MKL shim that stapoctl preloads into its engine
actors (`launch/mkl_shim.py`); the info row `learning_per_minute_trl_mkl_shim` compares with it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import _ours  # noqa: E402
import _peers  # noqa: E402

TARGET_RATIO = 1.0
TARGET_ENGINES_S = 15.0


def stapoctl_run(steps: int, workdir: Path) -> dict:
    uri = f"sqlite:///{workdir}/mlflow.db"
    args = [f"trainer.total_steps={steps}", f"trainer.save_freq={steps}", "eval.every_n_steps=0",
            "trainer.log_samples=0", f"tracking.uri={uri}", f"trainer.output_dir={workdir}/run",
            "tracking.experiment=bench"]
    out = _ours.whole_command(args)
    run = _ours.read_run(uri, out["run_id"]) if out["run_id"] else {}
    from stapoctl.checkpoint import find_checkpoint

    ckpt = find_checkpoint(workdir / "run")
    out.update(model=str(ckpt / "model") if ckpt else None, metrics=run.get("metrics", {}),
               step_end_ms=run.get("step_end_ms", {}))
    return out


def main(argv=None) -> int:
    from rich.console import Console

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.base_args(p, repeats=2)
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the embedded default's)")
    a = p.parse_args(argv)
    console = Console()
    if H.trl_missing(console):
        return 2
    conf = _peers.compose([])
    steps = 10 if a.quick else int(a.steps or conf.trainer.total_steps)
    repeats = 1 if a.quick else a.repeats
    base = _peers.model_dir("tiny", conf)
    env = H.environment()
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="stapoctl-bench-learning-"))
    ours, peers = [], []
    load = H.LoadWatch()
    try:
        for r in range(repeats):
            for side in (("ours", "peer") if r % 2 == 0 else ("peer", "ours")):
                load.mark(side)
                if side == "ours":
                    console.print(f"repeat {r + 1}/{repeats}: stapoctl train ({steps} steps, whole command) …")
                    ours.append(stapoctl_run(steps, tmp / f"ours{r}"))
                else:
                    console.print(f"repeat {r + 1}/{repeats}: TRL GRPOTrainer ({steps} steps, whole script) …")
                    res = _peers.run("trl", {"overrides": [], "model_dir": base, "steps": steps,
                                             "save_dir": str(tmp / f"peer{r}"), "output_dir": str(tmp / f"trl{r}"),
                                             "loss_check": r == 0})
                    res["model"] = str(tmp / f"peer{r}")
                    peers.append(res)
                load.mark(side)
        shim_env, shim = _peers.mkl_shim_env(), None
        if shim_env:  # once: how much of the ratio is the library stapoctl preloads into its actors
            console.print(f"TRL GRPOTrainer with stapoctl's MKL shim preloaded ({steps} steps, whole script) …")
            load.mark("peer")
            shim = _peers.run("trl", {"overrides": [], "model_dir": base, "steps": steps,
                                      "save_dir": str(tmp / "peer_shim"), "output_dir": str(tmp / "trl_shim")},
                              env=shim_env)
            load.mark("peer")
            shim["model"] = str(tmp / "peer_shim")
        console.print("held-out toy accuracy of the base and every final model …")
        models = {"base": base, **{f"ours{i}": o["model"] for i, o in enumerate(ours) if o["model"]},
                  **{f"peer{i}": x["model"] for i, x in enumerate(peers)},
                  **({"peer_shim": shim["model"]} if shim else {})}
        acc = _peers.run("toy_accuracy", {"overrides": [], "models": models})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    b = acc["base"]
    # accuracy points (percent) gained per minute of the whole command
    ours_rate = [100 * (acc.get(f"ours{i}", float("nan")) - b) / (o["wall_s"] / 60) for i, o in enumerate(ours)]
    peer_rate = [100 * (acc[f"peer{i}"] - b) / (x["whole_s"] / 60) for i, x in enumerate(peers)]
    rows_per_step = int(conf.data.train_batch_size) * int(conf.rollout.n)
    ours_tok = [sum(float(v) for v in o["metrics"].get("response_length/mean", {}).values()) * rows_per_step
                for o in ours]
    peer_tok = [sum(x["gen_tokens"]) for x in peers]
    o_acc = H.summary([acc.get(f"ours{i}") for i in range(len(ours))])["median"]
    p_acc = H.summary([acc.get(f"peer{i}") for i in range(len(peers))])["median"]
    o_wall = H.summary([o["wall_s"] for o in ours])["median"]
    p_wall = H.summary([x["whole_s"] for x in peers])["median"]
    lc = peers[0].get("loss_check", {})
    checks = [
        H.check("learned", (o_acc or 0) > b and (p_acc or 0) > b,
                f"toy acc base {b:.1%} → {o_acc:.1%} vs {p_acc:.1%}"),
        H.check("tokens", H.within(H.summary(ours_tok)["median"], H.summary(peer_tok)["median"], 0.15),
                f"gen tokens/run {H.fmt(H.summary(ours_tok)['median'])} vs {H.fmt(H.summary(peer_tok)['median'])}"),
        H.check("loss", H.within(lc.get("trl"), lc.get("stapoctl"), 1e-5) if lc else None,
                f"same-batch DAPO loss {lc.get('stapoctl', float('nan')):.6g} vs {lc.get('trl', float('nan')):.6g}"),
        H.check("dtype", all(x["param_dtype"] == "float32" and not x["autocast"] for x in peers)
                and str(conf.model.dtype) == "float32", "fp32 both"),
        load.check(),
    ]
    best = H.min_ratio(ours_rate, peer_rate, lower_is_better=False)
    step_ms = [_ours.step_seconds({int(k): v for k, v in o["step_end_ms"].items()}) for o in ours]
    # the whole command outside the steps: process start → step 1 logged, last step logged → exit
    before = [min(o["step_end_ms"].values()) / 1e3 - o["spawn_epoch"] for o in ours if o["step_end_ms"]]
    after = [o["exit_epoch"] - max(o["step_end_ms"].values()) / 1e3 for o in ours if o["step_end_ms"]]
    o_step = H.summary([s for ss in step_ms for s in ss])["median"]
    p_step = H.summary([s for x in peers for s in x["step_s"][1:]])["median"]
    rows = [H.row(
        "learning_per_minute", f"learning per minute, embedded default, {steps} steps, whole command",
        ours=ours_rate, peer=peer_rate, unit="acc-pts/min", lower_is_better=False, target=TARGET_RATIO,
        target_text=f"≥ {TARGET_RATIO}× (stapoctl/TRL)", peer_label="TRL GRPOTrainer", checks=checks,
        notes=(f"ratio of the best runs {best or float('nan'):.2f}×; "
               f"whole command {H.fmt(o_wall, 's')} vs {H.fmt(p_wall, 's')} (time ratio "
               f"{(p_wall / o_wall) if o_wall else float('nan'):.2f}×); steady step {H.fmt(o_step, 's')} vs "
               f"{H.fmt(p_step, 's')}; stapoctl outside the steps: start → step 1 logged "
               f"{H.fmt(H.summary(before)['median'], 's')} (step 1 incl.), last step → exit "
               f"{H.fmt(H.summary(after)['median'], 's')}; accuracy gain per minute in points of held-out toy accuracy (T=1.0, "
               f"4 samples × {conf.data.toy.num_heldout} problems); no periodic validation, one final save "
               f"on both sides; stapoctl loss={conf.loss.name}, TRL loss_type=dapo."),
        extra={"accuracy": acc, "ours_wall_s": [o["wall_s"] for o in ours],
               "peer_whole_s": [x["whole_s"] for x in peers], "load": load.seen},
    )]
    if shim is not None:
        shim_rate = [100 * (acc["peer_shim"] - b) / (shim["whole_s"] / 60)]
        rows.append(H.row(
            "learning_per_minute_trl_mkl_shim", f"learning per minute, {steps} steps: TRL with the same MKL shim",
            ours=ours_rate, peer=shim_rate, unit="acc-pts/min", lower_is_better=False, target=None,
            target_text="(info)", peer_label="TRL GRPOTrainer + MKL shim",
            notes=(f"the row above against one TRL run started under LD_PRELOAD={shim_env['LD_PRELOAD']} "
                   f"(launch/mkl_shim.py), which stapoctl's engine actors get by default: whole script "
                   f"{H.fmt(shim['whole_s'], 's')}, toy acc {acc['peer_shim']:.1%}, steady step "
                   f"{H.fmt(H.summary(shim['step_s'][1:])['median'], 's')}."),
        ))
    rows.append(H.row(
        "engines_up", "engines up (Ray + vLLM actor + DeepSpeed learner), embedded default",
        ours=[o["engines_s"] for o in ours], peer=[x["startup_s"] for x in peers], unit="s", lower_is_better=True,
        target=TARGET_ENGINES_S, absolute=True, target_text=f"≤ {TARGET_ENGINES_S:.0f} s", peer_label="TRL ready",
        notes=("stapoctl: the driver's 'engines up in' (vLLM init " +
               ", ".join(H.fmt(o["vllm_init_s"], "s") for o in ours) + "; learner setup " +
               ", ".join(H.fmt(o["learner_setup_s"], "s") for o in ours) + ", in parallel); TRL: process start "
               "→ trainer built (imports + model load), for reference."),
    ))
    H.print_rows(rows, console, title=f"learning ({time.perf_counter() - t0:.0f} s)")
    H.publish("learning", rows, a, console, config={"steps": steps, "repeats": repeats},
              seconds=time.perf_counter() - t0, env=env,
              extra={"raw": {"ours": [{k: v for k, v in o.items() if k != "metrics"} for o in ours],
                             "ours_metrics": [o["metrics"] for o in ours], "peer": peers, "peer_mkl_shim": shim,
                             "accuracy": acc}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
