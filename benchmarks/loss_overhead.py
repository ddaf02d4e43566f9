"""STAPO's loss (S2T mask, renormalisation, diagnostics) inside the learner step vs GRPO's.

    stapoctl bench loss_overhead [--repeats 20] [--quick]

Two learners (stapoctl's DeepSpeed `Learner`, in this process, 1 thread each as in training)
start from the same model; one is configured with loss=stapo, the other with loss=grpo. Both
take the very same fixed RolloutBatch (8 prompts x 8 sampled responses of the embedded tiny
model, rewards from the DAPO rule) through `train_step` (old-log-prob pass, mini-batch update,
optimizer step) with lr = 0, so the weights and hence the work stay identical across repeats.
The calls alternate (stapo, grpo, stapo, ...) so drift on a shared machine hits both alike.

The ratio is median STAPO step / median GRPO step (target <= 1.03). The time inside the loss
functions themselves (`prepare_minibatch` + `compute_policy_loss`, forward only) is clocked
too, by wrapping the loss library's entry points from outside, as a finer diagnostic.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import _peers  # noqa: E402

TARGET = 1.03


def fixed_batch(conf, model_dir: str, seed: int = 0):
    """8 prompts x n sampled responses of the model (transformers sampling), scored and with advantages."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapoctl.losses import compute_advantages
    from stapoctl.reward import dapo_reward
    from stapoctl.rollout.batch import RolloutBatch

    rows = _peers.train_rows(conf, model_dir)
    idx = _peers.step_batches(conf, len(rows), 1)[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n, max_new = int(conf.rollout.n), int(conf.rollout.max_response_length)
    prompts = [tok(rows[i]["prompt"], add_special_tokens=False)["input_ids"] for i in idx]
    responses, texts, trunc = [], [], []
    torch.manual_seed(seed)
    for p in prompts:
        out = model.generate(torch.tensor([p]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new, num_return_sequences=n, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[:, len(p):]
        rs = []
        for row in out.tolist():
            cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            rs.append(row[:cut])
        responses.append(rs)
        texts.append([tok.decode(r, skip_special_tokens=True) for r in rs])
        trunc.append([tok.eos_token_id not in r for r in rs])
    lps = [[[0.0] * len(r) for r in rs] for rs in responses]  # only feeds the rollout-vs-learner diff metric
    batch = RolloutBatch.from_token_lists(prompts, responses, lps, trunc, texts, pad_id=int(tok.pad_token_id),
                                          prompt_index=idx)
    answers = [str(rows[i]["answer"]) for i in idx for _ in range(n)]
    rewards = torch.tensor([dapo_reward(t, a) for t, a in zip(batch.texts, answers)], dtype=torch.float32)
    return batch, rewards


def make_learner(conf, model_dir: str, loss: str):
    from omegaconf import OmegaConf

    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.learner.engine_setup import free_port

    lrn = OmegaConf.to_container(conf.learner, resolve=True)
    lrn["lr"] = 0.0  # identical weights, identical work, every repeat
    loss_cfg = OmegaConf.to_container(_peers.compose([f"loss={loss}"]).loss, resolve=True)
    learner = Learner(0, 1)
    learner.setup(model_dir, lrn, loss_cfg, n_per_prompt=int(conf.rollout.n), temperature=float(conf.rollout.temperature),
                  dtype=str(conf.model.dtype), seed=int(conf.trainer.seed),
                  max_response_length=int(conf.rollout.max_response_length), master_port=free_port())
    return learner, loss_cfg


def main(argv=None) -> int:
    import torch
    from rich.console import Console

    import stapoctl.losses as L

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.base_args(p, repeats=20)
    a = p.parse_args(argv)
    console = Console()
    repeats = 3 if a.quick else a.repeats
    env = H.environment()
    t_start = time.perf_counter()
    conf = _peers.compose([])
    mdir = _peers.model_dir("tiny", conf)
    batch, rewards = fixed_batch(conf, mdir)
    learners = {}
    for name in ("stapo", "grpo"):
        learner, loss_cfg = make_learner(conf, mdir, name)
        adv = L.compute_advantages(name, rewards, batch.group_ids, **loss_cfg)
        learners[name] = (learner, batch.with_(rewards=rewards, advantages=adv))

    step_s = {"stapo": [], "grpo": []}
    loss_s = {"stapo": [], "grpo": []}
    metrics = {}
    try:
        with H.LossClock() as clock:
            for r in range(repeats + 1):  # round 0 is the warm-up
                for name in (("stapo", "grpo") if r % 2 == 0 else ("grpo", "stapo")):
                    learner, b = learners[name]
                    clock.t = 0.0
                    t0 = time.perf_counter()
                    m = learner.train_step(b, r + 1).metrics
                    dt = time.perf_counter() - t0
                    if r:
                        step_s[name].append(dt)
                        loss_s[name].append(clock.t)
                    metrics[name] = dict(m)
    finally:
        for learner, _ in learners.values():
            learner.shutdown()

    tokens = int(batch.response_mask.sum())
    # calls alternate, so neighbours share the machine's state: the median of per-pair ratios
    paired = H.summary([a / b for a, b in zip(step_s["stapo"], step_s["grpo"])])["median"]
    ms, mg = metrics["stapo"], metrics["grpo"]
    silenced = ms.get("stapo/spurious_count", ms.get("stapo/silenced_count"))
    d_loss = (H.summary(loss_s["stapo"])["median"] or 0) - (H.summary(loss_s["grpo"])["median"] or 0)
    row = H.row(
        "loss_overhead", "STAPO loss (mask + diagnostics) inside the learner step, embedded tiny",
        ours=step_s["stapo"], peer=step_s["grpo"], unit="s", lower_is_better=True,
        ratio=paired,
        target=TARGET, target_max=True, target_text=f"≤ {TARGET}× (+{(TARGET - 1) * 100:.0f}%)",
        ours_label="loss=stapo", peer_label="loss=grpo",
        checks=[H.check("batch", True, f"one fixed batch, {len(batch)} rows, {tokens} response tokens, lr 0"),
                H.check("dtype", True, f"{conf.model.dtype} both, {torch.get_num_threads()} thread(s)"),
                H.check("mask", silenced is not None, f"STAPO silenced {silenced} tokens; pg_loss "
                                                      f"{ms.get('actor/pg_loss', float('nan')):.4g} vs "
                                                      f"{mg.get('actor/pg_loss', float('nan')):.4g}")],
        notes=(f"time inside the loss functions (forward): STAPO {H.fmt(H.summary(loss_s['stapo'])['median'], 's')}"
               f" vs GRPO {H.fmt(H.summary(loss_s['grpo'])['median'], 's')} = "
               f"{100 * d_loss / H.summary(step_s['grpo'])['median']:+.1f}% of the step; ratio = median of the "
               f"per-pair ratios of alternating calls (medians' ratio "
               f"{H.summary(step_s['stapo'])['median'] / H.summary(step_s['grpo'])['median']:.3f})."),
        extra={"loss_fn_s": {k: H.summary(v) for k, v in loss_s.items()}, "metrics": metrics},
    )
    H.print_rows([row], console, title=f"loss_overhead ({time.perf_counter() - t_start:.0f} s)")
    H.publish("loss_overhead", [row], a, console, config={"repeats": repeats},
              seconds=time.perf_counter() - t_start, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
