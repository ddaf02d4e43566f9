"""Full RL step, rollout tokens/s, weight sync and async-vs-sync, side by side, per model size.

    stapoctl bench rl_step [--sizes tiny,25m] [--repeats 5] [--quick]

Per size, one `stapoctl train` run (the trainer's own loop on the real engines: vLLM rollout
actor, DeepSpeed learner, object-store weight sync) of 1 + R steps, and one TRL `GRPOTrainer`
run of 1 + R steps on the same model dir, prompts (in stapoctl's sampler order), batch
structure, lr, clip range, token-mean (DAPO) loss, beta 0, fp32 and reward function. Step 1 of
each side is the warm-up (first-shape kernels, allocator); steps 2..R+1 are the R samples.
Engines start once per run, not per repeat.

Rows (ratio > 1 = stapoctl better, except the "≤" ceilings):
- full_step_<size>: seconds per step, TRL / stapoctl (targets: tiny >= 1.3, 25m >= 1.5).
- full_step_<size>_trl_mkl_shim (info, AMD CPUs): the same, against TRL started under the MKL
  shim that stapoctl preloads into its engine actors (`launch/mkl_shim.py`): how much of the
  row above is that library.
- rollout_tokens_<size>: generated tokens/s of the rollout (vLLM actor, Ray call included) vs
  transformers `generate` inside TRL's step (same batch, sampling, lengths) (25m >= 1.5).
- weight_sync_<size>: learner -> every vLLM worker, per step, / a plain torch copy of the same
  state dict into preallocated tensors (25m <= 2).
- async_<size>: steps per minute of `trainer.mode=async` / the synchronous loop (>= 1.5); "not
  available yet" while the config has no trainer.mode.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import _ours  # noqa: E402
import _peers  # noqa: E402

TARGETS = {"full_step": {"tiny": 1.3, "25m": 1.5}, "rollout_tokens": {"25m": 1.5},
           "weight_sync": {"25m": 2.0}, "async": {"tiny": 1.5, "25m": 1.5}}
# token-mean DAPO loss on both sides (TRL loss_type="dapo"), the setting
BASE_OVERRIDES = ["loss=dapo"]
TOKENS_TOL = 0.15  # sampled lengths differ run to run; 15% on the per-step mean catches a real gap
LOSS_TOL = 1e-5


def _vals(d: dict, steps: list[int]) -> list[float]:
    return [float(d[str(s)]) for s in steps if str(s) in d]


def _median(xs):
    return H.summary(xs)["median"]


def measure(size: str, repeats: int, console) -> tuple[list[dict], dict]:
    from stapoctl.trainer.engine_settings import thread_counts

    conf0 = _peers.compose(BASE_OVERRIDES)
    mdir = _peers.model_dir(size, conf0)
    overrides = BASE_OVERRIDES + ([] if size == "tiny" else [f"model.path={mdir}"])
    conf = _peers.compose(overrides)
    rows_per_step = int(conf.data.train_batch_size) * int(conf.rollout.n)
    steps = repeats + 1

    load = H.LoadWatch()
    console.print(f"[bold]{size}[/]: stapoctl train, {steps} steps (step 1 = warm-up) …")
    load.mark("ours")
    ours = _ours.train(overrides, steps)
    load.mark("ours")
    m = ours["metrics"]
    measured = [s for s in range(2, steps + 1)]
    ours_step = _ours.step_seconds({int(k): v for k, v in ours["step_end_ms"].items()})
    ours_tokens = [x * rows_per_step for x in _vals(m["response_length/mean"], measured)]
    ours_gen = _vals(m["timing_s/gen"], measured)
    ours_tps = [t / g for t, g in zip(ours_tokens, ours_gen)]

    console.print(f"[bold]{size}[/]: TRL GRPOTrainer, {steps} steps …")
    load.mark("peer")
    peer = _peers.run("trl", {"overrides": overrides, "model_dir": mdir, "steps": steps, "loss_check": True})
    load.mark("peer")
    peer_step = peer["step_s"][1:]
    peer_tokens = peer["gen_tokens"][1:]
    peer_tps = [t / g for t, g in zip(peer_tokens, peer["gen_s"][1:])]
    shim_env, peer_shim = _peers.mkl_shim_env(), None
    if shim_env:
        console.print(f"[bold]{size}[/]: TRL GRPOTrainer with stapoctl's MKL shim preloaded, {steps} steps …")
        load.mark("peer")
        peer_shim = _peers.run("trl", {"overrides": overrides, "model_dir": mdir, "steps": steps}, env=shim_env)
        load.mark("peer")

    console.print(f"[bold]{size}[/]: torch copy of the state dict …")
    copy = _peers.run("torch_copy", {"model_dir": mdir, "repeats": max(repeats, 5)})

    dtype = str(conf.model.dtype)
    dtype_ok = dtype == "float32" and peer["param_dtype"] == "float32" and not peer["autocast"]
    dtype_check = H.check("dtype", dtype_ok, f"dtype {dtype} vs {peer['param_dtype']}"
                          f"{' +autocast' if peer['autocast'] else ''}")
    tok_o, tok_p = _median(ours_tokens), _median(peer_tokens)
    tokens_check = H.check("tokens", H.within(tok_o, tok_p, TOKENS_TOL),
                           f"gen tokens/step {H.fmt(tok_o)} vs {H.fmt(tok_p)}")
    lc = peer.get("loss_check", {})
    loss_ok = H.within(lc.get("trl"), lc.get("stapoctl"), LOSS_TOL) if lc else None
    if lc and abs(lc["trl"]) < 1e-9 and abs(lc["stapoctl"]) < 1e-9:
        loss_ok = True
    loss_check = H.check("loss", loss_ok, f"same-batch loss {lc.get('stapoctl', float('nan')):.6g} vs "
                                          f"{lc.get('trl', float('nan')):.6g} (TRL loss_type={peer['loss_type']})")
    st = peer["structure"]
    structure = (f"TRL per_device_train_batch_size={st['per_device_train_batch_size']}, grad_accum="
                 f"{st['gradient_accumulation_steps']}, steps_per_generation={st['steps_per_generation']}, "
                 f"num_iterations={st['num_iterations']} (= {conf.data.train_batch_size} prompts x "
                 f"{conf.rollout.n}, mini-batch {conf.learner.ppo_mini_batch_size} prompts, micro-batch "
                 f"{conf.learner.micro_batch_size} rows)")
    phases = {k.split("/")[1]: _median(_vals(m[k], measured)) for k in _ours.PHASES if m.get(k)}
    peer_update = [s - c for s, c in zip(peer["step_s"], peer["score_s"][: len(peer["step_s"])])][1:]
    peer_phases = {"gen": _median(peer["gen_s"][1:]), "reward": _median(peer["reward_s"][1:]),
                   "old_logprob+adv": _median([c - g - r for c, g, r in zip(peer["score_s"], peer["gen_s"],
                                                                           peer["reward_s"])][1:]),
                   "update": _median(peer_update), "step": _median(peer_step)}
    split = ("stapoctl " + " · ".join(f"{k} {H.fmt(v)}" for k, v in phases.items() if k != "sync_load")
             + " | TRL " + " · ".join(f"{k} {H.fmt(v)}" for k, v in peer_phases.items()))
    label = {"tiny": "embedded tiny (0.46M)", "25m": "random Qwen3 h512 L8 (25M)"}[size]
    rows = [H.row(
        f"full_step_{size}", f"full RL step, {label}", ours=ours_step, peer=peer_step, unit="s",
        lower_is_better=True, target=TARGETS["full_step"].get(size),
        target_text=f"≥ {TARGETS['full_step'][size]}× (TRL/stapoctl)", peer_label="TRL GRPOTrainer",
        checks=[tokens_check, loss_check, dtype_check, load.check()],
        notes=(f"ratio of the best steps {H.min_ratio(ours_step, peer_step, True) or float('nan'):.2f}×. {split}. "
               f"{structure}; TRL threads {peer['torch_threads']}, optim {peer['optim']}."),
        extra={"ours_phases_s": phases, "peer_phases_s": peer_phases, "engines": ours.get("engines", {}),
               "load": load.seen},
    )]
    if peer_shim is not None:
        shim_step = peer_shim["step_s"][1:]
        tok_shim = _median(peer_shim["gen_tokens"][1:])
        rows.append(H.row(
            f"full_step_{size}_trl_mkl_shim", f"full RL step, {label}: TRL with the same MKL shim", ours=ours_step,
            peer=shim_step, unit="s", lower_is_better=True, target=None, target_text="(info)",
            peer_label="TRL GRPOTrainer + MKL shim",
            checks=[H.check("tokens", H.within(tok_o, tok_shim, TOKENS_TOL),
                            f"gen tokens/step {H.fmt(tok_o)} vs {H.fmt(tok_shim)}"),
                    dtype_check],
            notes=(f"the row above, with TRL's process also started under LD_PRELOAD={shim_env['LD_PRELOAD']} "
                   f"(launch/mkl_shim.py: MKL's AVX-512 kernels on this AMD CPU), which stapoctl's engine "
                   f"actors get by default: how much of that row's ratio is the library. TRL step "
                   f"{H.fmt(_median(shim_step), 's')} with it, {H.fmt(_median(peer_step), 's')} without."),
        ))
    t_rollout = TARGETS["rollout_tokens"].get(size)
    rows.append(H.row(
        f"rollout_tokens_{size}", f"rollout tokens/s (n={conf.rollout.n}), {label}", ours=ours_tps,
        peer=peer_tps, unit="tok/s", lower_is_better=False, target=t_rollout,
        target_text=f"≥ {t_rollout}×" if t_rollout else "(info)", ours_label="vLLM rollout actor",
        peer_label="transformers generate",
        checks=[H.check("tokens", H.within(tok_o, tok_p, TOKENS_TOL),
                        f"tokens/call {H.fmt(tok_o)} vs {H.fmt(tok_p)}"),
                H.check("sampling", True, f"T={conf.rollout.temperature} top_p={conf.rollout.top_p} top_k off, "
                                          f"≤{conf.rollout.max_response_length} new"), dtype_check, load.check()],
        notes=f"ratio of the best calls {H.min_ratio(ours_tps, peer_tps, False) or float('nan'):.2f}×; "
              f"{conf.data.train_batch_size} prompts × {conf.rollout.n}; stapoctl: timing_s/gen (the rollout "
              f"actor's vLLM generate call, {thread_counts(conf)[0]} threads in the synchronous loop, 32-token "
              f"KV blocks with prefix caching); transformers: TRL's generate call ({peer['torch_threads']} threads).",
    ))
    sync = _vals(m.get("timing_s/sync", {}), measured)
    ratio = (_median(sync) / _median(copy["copy_s"])) if sync and copy["copy_s"] else None
    t_sync = TARGETS["weight_sync"].get(size)
    rows.append(H.row(
        f"weight_sync_{size}", f"weight sync learner → {conf.rollout.num_workers} vLLM worker(s), {label}",
        ours=sync, peer=copy["copy_s"], unit="s", lower_is_better=True, ratio=ratio, target=t_sync,
        target_max=True, target_text=f"≤ {t_sync}× (sync/copy)" if t_sync else "(info)",
        peer_label="torch copy_", status="" if t_sync else ("INFO" if ratio else ""),
        checks=[H.check("bytes", True, f"{copy['tensors']} tensors, {copy['bytes'] / 2**20:.1f} MiB fp32 "
                                       f"(tied weights under both names, as the learner sends them)")],
        notes=f"stapoctl: timing_s/sync (learner state dict → object store → reload in vLLM; load alone "
              f"{H.fmt(_median(_vals(m.get('timing_s/sync_load', {}), measured)), 's')}); copy: "
              f"{copy['torch_threads']} threads.",
    ))
    rows.append(async_row(size, label, overrides, steps, ours_step, tok_o, rows_per_step, console))
    raw = {"ours": ours, "peer": peer, "peer_mkl_shim": peer_shim, "copy": copy, "model_dir": mdir,
           "overrides": overrides}
    return rows, raw


def async_row(size, label, overrides, steps, sync_step, sync_tokens, rows_per_step, console) -> dict:
    key, target = f"async_{size}", TARGETS["async"][size]
    title = f"async vs sync steps/min, {label}"
    common = dict(unit="s/step", lower_is_better=True, target=target, ours_label="trainer.mode=async",
                  peer_label="synchronous loop", target_text=f"≥ {target}× on 2 cores")
    if not _ours.has_key(overrides, "trainer.mode"):
        return H.row(key, title, ours=None, peer=sync_step, status="NOT AVAILABLE",
                     notes="not available yet: the config has no trainer.mode", **common)
    console.print(f"[bold]{size}[/]: stapoctl train trainer.mode=async, {steps} steps …")
    run = _ours.train(overrides + ["trainer.mode=async"], steps)
    step = _ours.step_seconds({int(k): v for k, v in run["step_end_ms"].items()})
    lengths = [float(v) for k, v in run["metrics"]["response_length/mean"].items() if int(k) > 1]
    tok = _median([x * rows_per_step for x in lengths])
    return H.row(key, title, ours=step, peer=sync_step,
                 checks=[H.check("tokens", H.within(tok, sync_tokens, TOKENS_TOL),
                                 f"gen tokens/step {H.fmt(tok)} vs {H.fmt(sync_tokens)}"),
                         H.check("steps", len(step) == len(sync_step), f"{len(step)} vs {len(sync_step)} steps")],
                 notes="ratio = steps/min async ÷ sync (= sync s/step ÷ async s/step); one-step-off data in async.",
                 **common)


def main(argv=None) -> int:
    from rich.console import Console

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.base_args(p)
    p.add_argument("--sizes", default="tiny,25m", help="comma list of tiny, 25m (default both)")
    a = p.parse_args(argv)
    console = Console()
    if H.trl_missing(console):
        return 2
    sizes = ["tiny"] if a.quick else [s.strip() for s in a.sizes.split(",") if s.strip()]
    repeats = 2 if a.quick else a.repeats
    t0 = time.perf_counter()
    env = H.environment()
    rows = []
    for size in sizes:
        if size not in ("tiny", *_peers.SIZES):
            console.print(f"[red]error:[/] --sizes: unknown size '{size}' (use tiny or 25m)")
            return 2
    for size in sizes:
        t1 = time.perf_counter()
        r, raw = measure(size, repeats, console)
        rows += r
        raw["ours"].pop("params", None)
        # one results file per size, so `--sizes tiny` leaves the 25m results alone
        H.publish(f"rl_step_{size}", r, a, console, config={"size": size, "repeats": repeats,
                                                            "overrides": BASE_OVERRIDES},
                  seconds=time.perf_counter() - t1, env=env, extra={"raw": raw})
    H.print_rows(rows, console, title=f"rl_step ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
