"""The learner step at real lengths: token-budget micro-batches against fixed ones, same batch.

    stapoctl bench learner_budget [--repeats 3] [--budget 3584] [--quick]   # ~8 min on a quiet machine

stapoctl's DeepSpeed `Learner` (in this process, fp32, 2 threads, ZeRO-0, under the MKL library
stapoctl preloads into its learner actors: `launch/mkl_shim.py`) on the random 25M Qwen3 of the
other 25M rows (`_peers.SIZES["25m"]`: h512, 8 layers, vocab 512, context 512). One fixed batch of
4 prompts x 8 responses of random tokens: prompts of 24-64 tokens, responses spread uniformly over
48-384 tokens (8x), ±1 rewards, one PPO mini-batch (one optimizer step) with loss=dapo
(token-mean) and lr 0, so every repeat does the same work. The measured call is the update as a CPU
run makes it (`train_step` with vLLM's log-probs as the old ones and no measuring pass: the
mini-batch's no-grad pass for the loss's statistics, then the gradient passes); the old-log-prob
pass of a recomputing run (bf16, async) is timed once per side beside it.

Sides, alternating call by call (a round's order turns every round), each its own learner:
- fixed: `micro_batch_size=8` rows (the LearnerConfig default; here one prompt's 8 responses per
  micro-batch), `shared_prefix` auto (on for a CPU learner).
- budget, rows: `max_tokens_per_micro_batch=B` (default 3584 = the 8 x (64 + 384) tokens a fixed
  micro-batch of the longest rows holds: the same peak), `micro_batch_size=16` (the cap: the whole
  mini-batch), `shared_prefix=false` (each row its own unit, sorted by length).
- budget, prompts: the same with `shared_prefix=true` (a prompt's 8 rows stay together).
- budget, packed: `remove_padding=true` (learner/packing.py: each micro-batch in one sequence, no
  padding; the shared prefix auto = on: a prompt once, its responses attending to it), the same B
  counted in real tokens: the same peak. Info (in its notes): packed with `shared_prefix=false`.
- fixed without the shared prefix (info, in the notes): how much of a ratio is the prefix given up.

Rows: response tokens/s of the update, budget / fixed (target >= 1.5x), for each budget
side (packed: the issue's "no padding waste"); TRL's update of the same batch (`_trl_update.py`:
GRPOTrainer's own loss and backward on its padded micro-batches of 8 rows) against the packed side,
N/A where TRL is not installed. Same-work checks: one batch, one optimizer step, the same loss, grad norm and old log-probs on every side
(1e-5), fp32, load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import _peers  # noqa: E402

TARGET = 1.5
PROMPTS, N = 4, 8
PROMPT_LENS, RESPONSE_LENS = (24, 64), (48, 384)
QUICK_RESPONSE_LENS = (16, 128)
SIDES = {  # name -> learner overrides (budget sides get max_tokens_per_micro_batch at run time)
    "fixed": {"micro_batch_size": 8},
    "budget_rows": {"micro_batch_size": PROMPTS * N, "shared_prefix": False},
    "budget_prompts": {"micro_batch_size": PROMPTS * N, "shared_prefix": True},
    "budget_packed": {"micro_batch_size": PROMPTS * N, "remove_padding": True},  # shared prefix auto: on
    "budget_packed_rows": {"micro_batch_size": PROMPTS * N, "remove_padding": True, "shared_prefix": False},
    "fixed_no_prefix": {"micro_batch_size": 8, "shared_prefix": False},  # info: the shared prefix's share
}
SAME_TOL = 1e-5


def fixed_batch(vocab: int, response_lens=RESPONSE_LENS, prompts: int = PROMPTS, n: int = N, seed: int = 0):
    """Random prompts and responses of spread lengths, ±1 rewards (both outcomes in every group)."""
    import torch

    from stapoctl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, vocab, (int(torch.randint(PROMPT_LENS[0], PROMPT_LENS[1] + 1, (1,), generator=g)),),
                        generator=g).tolist() for _ in range(prompts)]
    rs, lps = [], []
    for _ in range(prompts):
        lens = torch.randint(response_lens[0], response_lens[1] + 1, (n,), generator=g).tolist()
        rs.append([torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens])
        lps.append([[0.0] * k for k in lens])
    batch = RolloutBatch.from_token_lists(ps, rs, lps, [[False] * n] * prompts, [[""] * n] * prompts, pad_id=0)
    rewards = (torch.randint(0, 2, (prompts * n,), generator=g) * 2 - 1).float()
    rewards[::n], rewards[1::n] = 1.0, -1.0
    return batch, rewards


def make_learner(conf, model_dir: str, overrides: dict, loss_cfg: dict):
    from omegaconf import OmegaConf

    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.learner.engine_setup import free_port

    lrn = OmegaConf.to_container(conf.learner, resolve=True)
    lrn.update(lr=0.0, ppo_mini_batch_size=PROMPTS, num_threads=2, zero_stage=0, **overrides)
    learner = Learner(0, 1)
    learner.setup(model_dir, lrn, loss_cfg, n_per_prompt=N, temperature=1.0, dtype="float32", seed=0,
                  max_response_length=RESPONSE_LENS[1], master_port=free_port())
    return learner


def cut_of(learner, batch) -> dict:
    """Micro-batches and padded tokens of the update and the log-prob pass, as the learner cuts them."""
    from stapoctl.learner.micro_batches import padded_tokens
    from stapoctl.learner.packing import packed_tokens

    p, r = batch.prompt_mask.sum(1).tolist(), batch.response_mask.sum(1).tolist()
    update, _ = learner._update_micro_batches(batch, slice(0, len(batch)))
    no_grad = learner._no_grad_micro_batches(batch)
    as_list = [mb if isinstance(mb, slice) else list(map(int, mb)) for mb in update]

    def cost(micro) -> int:  # what the forward runs: padded tokens, or packed ones
        if not learner.learner.get("remove_padding"):
            return padded_tokens(p, r, micro)
        rows = [range(len(p))[mb] if isinstance(mb, slice) else mb for mb in micro]
        g = batch.group_ids.tolist() if learner._together() else None
        return sum(packed_tokens([p[i] for i in mb], [r[i] for i in mb], g and [g[i] for i in mb]) for mb in rows)

    return {"update_micro_batches": len(update), "update_padded_tokens": cost(as_list),
            "log_prob_micro_batches": len(no_grad), "log_prob_padded_tokens": cost(no_grad),
            "real_tokens": int(sum(p) + sum(r)), "n_rows": len(batch),
            "update_cut": [str(mb) if isinstance(mb, slice) else mb for mb in as_list]}


def log_prob_pass(sides: dict, batch) -> tuple[dict, dict]:
    """Each side's old-log-prob pass over the batch once (its own cut): seconds and log-probs."""
    secs, lps = {}, {}
    for name, learner in sides.items():
        t0 = time.perf_counter()
        lps[name] = learner.compute_log_probs(batch)["log_prob"]
        secs[name] = time.perf_counter() - t0
    return secs, lps


def measure(calls: dict, repeats: int, load) -> tuple[dict, dict]:
    """Alternating updates, `calls[name](round)` each (stapoctl's: the CPU default path, vLLM's
    log-probs as the old ones, no measuring pass, so each update starts with its mini-batch's no-grad
    pass); per side the seconds and the last call's metrics."""
    secs = {k: [] for k in calls}
    metrics = {}
    names = list(calls)
    for r in range(repeats + 1):  # round 0 is the warm-up
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            load.mark(name)
            t0 = time.perf_counter()
            m = calls[name](r)
            dt = time.perf_counter() - t0
            if r:
                secs[name].append(dt)
            metrics[name] = m
    return secs, metrics


def update_calls(sides: dict, batch, trl) -> dict:
    """name -> one update of `batch`; TRL's (`_trl_update`) where `trl` = (trainer, its inputs)."""
    calls = {name: (lambda r, lrn=lrn: lrn.train_step(batch, r + 1, old_logprob_source="rollout", measure=False))
             for name, lrn in sides.items()}
    if trl is not None:
        import _trl_update

        calls["trl"] = lambda r: _trl_update.update(*trl)
    return calls


def same_work(metrics: dict, lps: dict, base: str = "fixed") -> list[dict]:
    out = []
    ref = metrics[base]
    if "trl" in metrics:
        t = metrics["trl"]
        ok = (abs(t["loss"] - ref["actor/pg_loss"]) <= SAME_TOL * max(1.0, abs(ref["actor/pg_loss"]))
              and abs(t["grad_norm"] - ref["actor/grad_norm"]) <= SAME_TOL * max(1.0, ref["actor/grad_norm"]))
        out.append(H.check("same_trl", ok, f"TRL (loss_type=dapo): loss {t['loss']:.6g} vs {ref['actor/pg_loss']:.6g}, "
                                           f"grad norm {t['grad_norm']:.6g} vs {ref['actor/grad_norm']:.6g}"))
    for name, m in metrics.items():
        if name in (base, "trl"):
            continue
        lp = float((lps[name] - lps[base]).abs().max())
        ok = (abs(m["actor/pg_loss"] - ref["actor/pg_loss"]) <= SAME_TOL * max(1.0, abs(ref["actor/pg_loss"]))
              and abs(m["actor/grad_norm"] - ref["actor/grad_norm"]) <= SAME_TOL * max(1.0, ref["actor/grad_norm"])
              and lp <= SAME_TOL and m["actor/optimizer_steps"] == ref["actor/optimizer_steps"])
        out.append(H.check(f"same_{name}", ok, f"{name}: pg_loss {m['actor/pg_loss']:.6g} vs {ref['actor/pg_loss']:.6g}, "
                                               f"grad norm {m['actor/grad_norm']:.6g} vs {ref['actor/grad_norm']:.6g}, "
                                               f"log-probs within {lp:.1e}"))
    return out


def trl_side(mdir: str, batch, console):
    """(GRPOTrainer, its micro-batches of `batch`) at the fixed side's 8 rows, or None without TRL."""
    if H.trl_missing(console):
        return None
    import _trl_update

    trainer = _trl_update.make_trainer(mdir, len(batch), N, SIDES["fixed"]["micro_batch_size"],
                                       int(batch.response_mask.sum(1).max()))
    return trainer, _trl_update.micro_batches(batch, SIDES["fixed"]["micro_batch_size"])


def trl_row(times: dict, tok_s: dict, metrics: dict, checks: list) -> dict:
    """TRL's GRPO update of the same batch against the packed token budget, or N/A without TRL."""
    common = dict(unit="tok/s", lower_is_better=False, target=None, target_text="(info)",
                  ours_label="max_tokens_per_micro_batch + remove_padding (packed)",
                  peer_label="TRL GRPOTrainer, 8-row micro-batches")
    title = "learner update at real lengths vs TRL, random Qwen3 h512 L8 (25M)"
    if "trl" not in times:
        return H.row("learner_budget_25m_trl", title, ours=tok_s["budget_packed"], peer=None, status="N/A",
                     notes="TRL is not installed here (pip install -e '.[bench]'): no TRL measurement in this run.",
                     **common)
    paired = H.summary([t / b for t, b in zip(times["trl"], times["budget_packed"])])["median"]
    fixed = H.summary([t / f for t, f in zip(times["trl"], times["fixed"])])["median"]
    return H.row("learner_budget_25m_trl", title, ours=tok_s["budget_packed"], peer=tok_s["trl"], ratio=paired,
                 checks=checks, notes=(
                     f"ratio = median of paired time ratios, TRL / packed; TRL / fixed micro-batches {fixed:.2f}×. "
                     f"TRL forwards {metrics['trl']['padded_tokens']} tokens (prompts and completions padded to the "
                     "batch's longest, as its generation batch is) in 4 micro-batches, with no pass before the "
                     "update (on-policy); stapoctl's sides also run their no-grad pass for the loss statistics."),
                 **common)


def with_mkl_shim() -> None:
    """Re-run this script under the library stapoctl preloads into its learner actors (`LD_PRELOAD` is
    read at process start), so that the in-process learners compute as the trainer's do."""
    env = _peers.mkl_shim_env()
    if env and os.environ.get("LD_PRELOAD") != env["LD_PRELOAD"]:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})


def main(argv=None) -> int:
    import torch
    from omegaconf import OmegaConf
    from rich.console import Console

    import stapoctl.losses as L

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.base_args(p, repeats=3)
    p.add_argument("--budget", type=int, default=0,
                   help="learner.max_tokens_per_micro_batch (default: 8 rows at the longest prompt + response)")
    a = p.parse_args(argv)
    with_mkl_shim()
    console = Console()
    repeats = 1 if a.quick else a.repeats
    lens = QUICK_RESPONSE_LENS if a.quick else RESPONSE_LENS
    a.budget = a.budget or 8 * (PROMPT_LENS[1] + lens[1])
    env, t_start = H.environment(), time.perf_counter()
    torch.set_num_threads(2)
    conf = _peers.compose(["loss=dapo"])
    mdir = _peers.model_dir("25m", conf)
    loss_cfg = OmegaConf.to_container(conf.loss, resolve=True)
    batch, rewards = fixed_batch(int(_peers.SIZES["25m"]["vocab_size"]), lens)
    batch = batch.with_(rewards=rewards, advantages=L.compute_advantages("dapo", rewards, batch.group_ids, **loss_cfg))
    sides = {}
    for name, over in SIDES.items():
        over = dict(over, max_tokens_per_micro_batch=a.budget if name.startswith("budget") else 0)
        sides[name] = make_learner(conf, mdir, over, loss_cfg)
    cuts = {name: cut_of(lrn, batch) for name, lrn in sides.items()}
    load = H.LoadWatch()
    try:
        lp_s, lps = log_prob_pass(sides, batch)
        batch = batch.with_(rollout_log_probs=lps["fixed"])  # on-policy: ratio 1 at lr 0
        times, metrics = measure(update_calls(sides, batch, trl_side(mdir, batch, console)), repeats, load)
    finally:
        for lrn in sides.values():
            lrn.shutdown()
    tokens = int(batch.response_mask.sum())
    tok_s = {k: [tokens / s for s in v] for k, v in times.items()}
    checks = same_work(metrics, lps) + [
        H.check("batch", True, f"one batch: {len(batch)} rows, {tokens} response tokens ({lens[0]}–{lens[1]}), "
                               f"prompts {PROMPT_LENS[0]}–{PROMPT_LENS[1]}, lr 0, loss=dapo"),
        H.check("dtype", True, f"float32 every side, {torch.get_num_threads()} threads"), load.check()]
    rows = [budget_row(name, tok_s, times, cuts, checks, a.budget, lens, lp_s)
            for name in ("budget_rows", "budget_prompts", "budget_packed")]
    rows.append(trl_row(times, tok_s, metrics, checks))
    H.print_rows(rows, console, title=f"learner_budget ({time.perf_counter() - t_start:.0f} s)")
    config = {"repeats": repeats, "max_tokens_per_micro_batch": a.budget, "sides": SIDES, "prompts": PROMPTS,
              "n": N, "prompt_lens": PROMPT_LENS, "response_lens": lens, "model": "25m", "loss": "dapo",
              "mkl_shim": os.environ.get("LD_PRELOAD", "")}
    H.publish("learner_budget", rows, a, console, config=config, seconds=time.perf_counter() - t_start, env=env,
              extra={"cuts": cuts, "update_s": {k: H.summary(v) for k, v in times.items()},
                     "log_prob_pass_s": lp_s, "load": load.seen})
    return 0


def budget_row(name: str, tok_s: dict, times: dict, cuts: dict, checks: list, budget: int, lens, lp_s: dict) -> dict:
    paired = H.summary([f / b for f, b in zip(times["fixed"], times[name])])["median"]
    med = {k: H.summary(v)["median"] for k, v in tok_s.items()}
    c, f, nf = cuts[name], cuts["fixed"], cuts["fixed_no_prefix"]
    unit = {"budget_rows": "rows", "budget_prompts": "prompts (shared prefix)",
            "budget_packed": "prompts, packed (remove_padding, shared prefix)"}[name]
    return H.row(
        f"learner_{name}_25m", f"learner update tokens/s, token budget by {unit} vs fixed micro-batches, 25M, "
                               f"{c['n_rows']} rows of {lens[0]}–{lens[1]}-token responses",
        ours=tok_s[name], peer=tok_s["fixed"], unit="tok/s", lower_is_better=False, ratio=paired, target=TARGET,
        target_text=f"≥ {TARGET}×", ours_label=f"max_tokens_per_micro_batch={budget}, {unit}",
        peer_label="micro_batch_size=8, shared prefix on", checks=checks,
        notes=(f"ratio = median of paired time ratios (medians' ratio {med[name] / med['fixed']:.2f}×). Update: "
               f"{c['update_micro_batches']} micro-batches, {c['update_padded_tokens']} "
               f"{'packed' if name == 'budget_packed' else 'padded'} tokens, against fixed "
               f"{f['update_micro_batches']} / {f['update_padded_tokens']} ({c['real_tokens']} real). Log-prob pass "
               f"(once, n=1): {c['log_prob_micro_batches']} / {c['log_prob_padded_tokens']} in {lp_s[name]:.1f} s, "
               f"fixed {f['log_prob_micro_batches']} / {f['log_prob_padded_tokens']} in {lp_s['fixed']:.1f} s. "
               f"Fixed micro-batches without the shared prefix: {H.fmt(med['fixed_no_prefix'], 'tok/s')} "
               f"({med['fixed_no_prefix'] / med['fixed']:.2f}× fixed with it; {nf['update_padded_tokens']} padded)."
               + (f" Packed without the shared prefix: {H.fmt(med['budget_packed_rows'], 'tok/s')} "
                  f"({med['budget_packed_rows'] / med['fixed']:.2f}× fixed; "
                  f"{cuts['budget_packed_rows']['update_micro_batches']} / "
                  f"{cuts['budget_packed_rows']['update_padded_tokens']} packed)." if name == "budget_packed" else "")),
    )


if __name__ == "__main__":
    sys.exit(main())
