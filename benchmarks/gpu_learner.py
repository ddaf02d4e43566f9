"""The learner step on a GPU: STAPO's loss overhead and the update's throughput (needs CUDA).

    stapoctl bench gpu_learner [--shape qwen3-0.6b] [--response-length 1024] [--repeats 5]
                               [--losses stapo,grpo] [--set KEY=VALUE ...] [--profile]

stapoctl's DeepSpeed `Learner` (NCCL, one GPU, bf16, the paper-scale learner defaults of
`LearnerConfig`: micro-batch 8, logits chunk 1024, `shared_prefix` auto = off on a GPU; `--set`
changes any of them) on a random-init Qwen3
of the named shape (vocab 151,936). One fixed batch of 8 prompts x 8 responses (random tokens,
prompt 128 tokens, response lengths spread over 25..100% of --response-length, ±1 rewards) goes
through `train_step` (old-log-prob pass, one PPO mini-batch of 8 micro-batches, optimizer step)
with lr 0, so every repeat does identical work. Two learners, loss=stapo and loss=grpo, take
alternating calls as in `loss_overhead` (the CPU row), target STAPO/GRPO <= 1.03.

The second row is throughput: response tokens per second of the whole learner step and the
achieved model TFLOP/s (2N per token of the no-grad pass + 6N per token of the update, N the
parameters that do matmuls: lm_head included, attention scores excluded), beside this GPU's
bf16 matmul rate measured in the same run (8192^3, median of 10).

Not in `stapoctl bench all` (that one runs on the machine at hand, usually without a GPU);
results go to benchmarks/results/gpu/ and the figures to docs/PERFORMANCE.md's GPU section.
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

from stapoctl.config.shapes import QWEN3_SHAPES, known_shape  # noqa: E402

TARGET = 1.03
# --shape name -> the hub id whose architecture fields (stapoctl/config/shapes.py) the random model takes
SHAPES = {hub_id.split("/")[-1].removesuffix("-Base").lower(): hub_id for hub_id in QWEN3_SHAPES}
VOCAB = QWEN3_SHAPES["Qwen/Qwen3-0.6B-Base"]["vocab_size"]  # 151,936, every Qwen3 size


def qwen3_config(shape: str):
    """A transformers Qwen3Config of a --shape name or hub id, from the table (random weights)."""
    from transformers import Qwen3Config

    fields = known_shape(SHAPES.get(shape, shape))
    if fields is None:
        raise ValueError(f"no Qwen3 shape {shape!r} (have: {', '.join(SHAPES)})")
    fields.pop("model_type", None)
    return Qwen3Config(**fields)


def build_model(shape: str, out: Path, seed: int = 0) -> tuple[str, int]:
    """A random-init bf16 Qwen3 of `shape` (a --shape name or hub id) saved to `out`; (dir, params)."""
    import torch
    from transformers import Qwen3ForCausalLM

    cfg = qwen3_config(shape)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return str(out), params


def fixed_batch(prompts: int, n: int, prompt_len: int, response_len: int, seed: int = 0):
    import torch

    from stapoctl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(10, VOCAB, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    rs, lps = [], []
    for _ in range(prompts):
        lens = torch.randint(response_len // 4, response_len + 1, (n,), generator=g).tolist()
        rs.append([torch.randint(10, VOCAB, (k,), generator=g).tolist() for k in lens])
        lps.append([[0.0] * k for k in lens])
    batch = RolloutBatch.from_token_lists(ps, rs, lps, [[False] * n] * prompts, [[""] * n] * prompts, pad_id=0)
    rewards = (torch.randint(0, 2, (prompts * n,), generator=g) * 2 - 1).float()
    rewards[::n] = 1.0  # every group has both outcomes: no zero-advantage group
    rewards[1::n] = -1.0
    return batch, rewards


def matmul_tflops(size: int = 8192, reps: int = 10) -> float:
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * size**3 / H.summary(times)["median"] / 1e12


def _value(text: str):
    """A --set value as Hydra would read it: true/false/null, a number, else the string."""
    special = {"true": True, "false": False, "null": None}
    if text.lower() in special:
        return special[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def profile_step(learner, batch, out: Path) -> dict:
    """One step under torch.profiler: the top CUDA ops and the step's total GPU kernel time."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        learner.train_step(batch, 99)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    # the device's own events (an aten op's self device time repeats its kernels' time)
    kernels = sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU) / 1e6
    table = events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_learner_profile.txt").write_text(f"wall {wall:.3f} s (under the profiler), GPU kernels "
                                                  f"{kernels:.3f} s\n{table}\n")
    print(table)
    return {"wall_s": wall, "kernel_s": kernels}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.base_args(p, repeats=5)
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--response-length", type=int, default=1024)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a learner config override, e.g. --set shared_prefix=false --set micro_batch_size=16")
    p.add_argument("--losses", default="stapo,grpo",
                   help="learners to build (default stapo,grpo: the overhead row); one name for a throughput-only run")
    p.add_argument("--profile", action="store_true",
                   help="also run one loss=grpo step under torch.profiler; its top CUDA ops go to gpu_learner_profile.txt")
    p.set_defaults(out=str(H.RESULTS / "gpu"))
    a = p.parse_args(argv)

    import torch
    from rich.console import Console

    console = Console()
    if not torch.cuda.is_available():
        console.print("[red]error:[/] gpu_learner needs a CUDA GPU (torch sees none here); run it on a GPU "
                      "machine, or `stapoctl bench loss_overhead` for the CPU row", highlight=False, soft_wrap=True)
        return 2
    from dataclasses import asdict

    import stapoctl.losses as L
    from stapoctl.config.schema import LearnerConfig
    from stapoctl.learner import shared_prefix
    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.learner.engine_setup import free_port

    lcfg = asdict(LearnerConfig())
    lcfg.update(gpus_per_rank=1, lr=0.0, warmup_steps=0, ppo_mini_batch_size=a.prompts)
    for item in a.set:
        key, _, value = item.partition("=")
        if key not in lcfg:
            console.print(f"[red]error:[/] --set {item}: no learner field {key!r} (have: {', '.join(lcfg)})",
                          highlight=False, soft_wrap=True)
            return 2
        lcfg[key] = _value(value)
    losses = [x.strip() for x in a.losses.split(",") if x.strip()]
    unknown = [x for x in losses if x not in L.LOSSES]
    if unknown or not losses:
        console.print(f"[red]error:[/] --losses {a.losses}: unknown {', '.join(unknown) or '(none given)'} "
                      f"(have: {', '.join(L.LOSSES)})", highlight=False, soft_wrap=True)
        return 2
    repeats = 2 if a.quick else a.repeats
    response_len = 256 if a.quick else a.response_length
    env = H.environment()
    t_start = time.perf_counter()
    gpu = torch.cuda.get_device_name(0)
    peak = matmul_tflops()
    tmp = Path(tempfile.mkdtemp(prefix="stapoctl-gpu-bench-"))  # the random model: 1.2 GB at 0.6B
    batch, rewards = fixed_batch(a.prompts, a.n, a.prompt_length, response_len)
    learners = {}
    step_s = {k: [] for k in losses}
    loss_s = {k: [] for k in losses}
    phases = {k: [] for k in losses}
    metrics = {}
    try:
        model_dir, params = build_model(a.shape, tmp / a.shape)
        for name in losses:
            loss_cfg = dict(vars(L.LOSSES[name].config_cls()))
            lrn = Learner(0, 1)
            learners[name] = (lrn, None)  # shut down below even if its setup fails
            lrn.setup(model_dir, lcfg, loss_cfg, n_per_prompt=a.n, temperature=1.0, dtype="bfloat16", seed=0,
                      max_response_length=response_len, master_port=free_port())
            adv = L.compute_advantages(name, rewards, batch.group_ids, **loss_cfg)
            learners[name] = (lrn, batch.with_(rewards=rewards, advantages=adv))
        with H.LossClock() as clock:
            for r in range(repeats + 1):  # round 0 is the warm-up
                for name in (losses if r % 2 == 0 else losses[::-1]):
                    lrn, b = learners[name]
                    clock.t = 0.0
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    m = lrn.train_step(b, r + 1).metrics
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    if r:
                        step_s[name].append(dt)
                        loss_s[name].append(clock.t)
                        phases[name].append({k: m[k] for k in ("timing_s/ref", "timing_s/update")})
                    metrics[name] = {k: v for k, v in m.items() if not k.startswith("_")}
        mem = torch.cuda.max_memory_allocated() / 2**30
        profile = profile_step(*learners[losses[-1]], Path(a.out)) if a.profile else {}
    finally:
        for lrn, _ in learners.values():
            lrn.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    resp_tokens = int(batch.response_mask.sum())
    # the work: a plain forward over every row's prompt and response, padding excluded (the same
    # numerator with or without the shared prefix, so TFLOP/s compares the settings' speed)
    tokens = resp_tokens + len(batch) * a.prompt_length
    flops = 8 * params * tokens  # 2N (no-grad pass) + 6N (forward + backward of the update)
    sharing = shared_prefix.enabled(lcfg, on_cuda=True)
    shape = f"random {a.shape} ({params / 1e9:.2f}B), bf16, {gpu}"
    common_checks = [
        H.check("batch", True, f"one fixed batch, {len(batch)} rows, {resp_tokens} response tokens, lr 0"),
        H.check("dtype", True, f"bfloat16 (DeepSpeed bf16, ZeRO-{lcfg['zero_stage']}), NCCL, 1 GPU, micro-batch "
                               f"{lcfg['micro_batch_size']}, shared prefix {'on' if sharing else 'off'}"),
    ]
    rows = []
    if "stapo" in learners and "grpo" in learners:
        med_grpo, med_stapo = H.summary(step_s["grpo"])["median"], H.summary(step_s["stapo"])["median"]
        paired = H.summary([x / y for x, y in zip(step_s["stapo"], step_s["grpo"])])["median"]
        silenced = metrics["stapo"].get("stapo/spurious_count")
        d_loss = (H.summary(loss_s["stapo"])["median"] or 0) - (H.summary(loss_s["grpo"])["median"] or 0)
        rows.append(H.row(
            "gpu_loss_overhead", f"STAPO loss inside the learner step on a GPU: {shape}",
            ours=step_s["stapo"], peer=step_s["grpo"], unit="s", lower_is_better=True, ratio=paired,
            target=TARGET, target_max=True, target_text=f"≤ {TARGET}× (+{(TARGET - 1) * 100:.0f}%)",
            ours_label="loss=stapo", peer_label="loss=grpo",
            checks=common_checks + [H.check("mask", silenced is not None, f"STAPO silenced {silenced} tokens")],
            notes=(f"time inside the loss functions (incl. their host syncs): STAPO "
                   f"{H.fmt(H.summary(loss_s['stapo'])['median'], 's')} vs GRPO "
                   f"{H.fmt(H.summary(loss_s['grpo'])['median'], 's')} = {100 * d_loss / med_grpo:+.1f}% of the step; "
                   f"ratio = median of per-pair ratios of alternating calls (medians' ratio "
                   f"{med_stapo / med_grpo:.3f})."),
            extra={"loss_fn_s": {k: H.summary(v) for k, v in loss_s.items()}, "metrics": metrics},
        ))
    base = "grpo" if "grpo" in learners else losses[-1]
    med = H.summary(step_s[base])["median"]
    rows.append(H.row(
        "gpu_learner_tflops", f"learner step throughput on a GPU (loss={base}): {shape}",
        ours=[flops / x / 1e12 for x in step_s[base]], peer=[peak], unit="TFLOP/s", lower_is_better=False,
        target=None, target_text="information (model FLOPs / bf16 matmul peak measured here)",
        ours_label="learner step, model TFLOP/s", peer_label="8192³ bf16 matmul",
        checks=common_checks,
        notes=(f"{resp_tokens / med:,.0f} response tok/s over the whole step (old-log-prob pass "
               f"{H.summary([x['timing_s/ref'] for x in phases[base]])['median']:.3f} s + update "
               f"{H.summary([x['timing_s/update'] for x in phases[base]])['median']:.3f} s); "
               f"FLOPs = 8 N x {tokens:,} tokens (every row's prompt + response), attention scores excluded; "
               f"peak GPU memory {mem:.1f} GiB ({len(learners)} learner(s))"
               + (f"; GPU kernels {profile['kernel_s']:.2f} s per step (torch.profiler) = "
                  f"{100 * profile['kernel_s'] / med:.0f}% of the unprofiled step" if profile else "") + "."),
        extra={"phases": phases, "response_tokens_per_s": resp_tokens / med, "profile": profile},
    ))
    H.print_rows(rows, console, title=f"gpu_learner ({time.perf_counter() - t_start:.0f} s, {gpu})")
    env["gpu"] = gpu
    H.publish("gpu_learner", rows, a, console, seconds=time.perf_counter() - t_start, env=env,
              config={"shape": a.shape, "params": params, "prompts": a.prompts, "n": a.n,
                      "prompt_length": a.prompt_length, "response_length": response_len, "repeats": repeats,
                      "losses": losses, "learner": lcfg})
    return 0


if __name__ == "__main__":
    sys.exit(main())
