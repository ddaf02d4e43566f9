"""The embedded default model: a tiny Qwen3ForCausalLM built here from a seed, no download.

`ensure_base_model` trains the tokenizer, initialises the weights, warm-starts them on the
toy task, measures the toy accuracy and caches the directory under
`paths.home()/models/tiny-<confighash>/`; later calls return it in well under a second.
The directory is a plain HF model dir, loadable by transformers and vLLM alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterator

from stapoctl import paths
from stapoctl.errors import UserError

# Bump when the build recipe changes in a way the config does not capture: old caches are
# then rebuilt instead of silently reused.
BUILDER_VERSION = 2  # 2: phrasing forks in the demos and the tokenizer corpus
# The build runs with a fixed thread count: float reductions, hence the weights, depend on it.
# One thread: ops on a model this small are overhead-bound, and on a shared 2-core machine a
# second thread contending with other processes made steps 3-5x slower, not faster.
BUILD_THREADS = 1
EVAL_SAMPLES_PER_PROBLEM = 4
BASE_EVAL = "base_eval.json"


def _plain(cfg: Any) -> dict:
    if is_dataclass(cfg):
        return asdict(cfg)
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except Exception:
        return dict(cfg)


def config_hash(model_cfg, data_cfg) -> str:
    """Cache key: everything that changes the built weights, plus the builder version."""
    key = {
        "builder": BUILDER_VERSION,
        "threads": BUILD_THREADS,
        "seed": model_cfg.seed,
        "tiny": _plain(model_cfg.tiny),
        "toy": _plain(data_cfg.toy),
        "template": data_cfg.template,
        "instruction": data_cfg.instruction,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def state_dict_hash(model_or_dir) -> str:
    """sha256 over every saved tensor's name, dtype, shape and bytes; a dir and the model it
    was saved from give the same hash."""
    import torch

    if isinstance(model_or_dir, (str, Path)):
        from safetensors.torch import load_file

        state = load_file(str(Path(model_or_dir) / "model.safetensors"))
    else:
        state = dict(model_or_dir.state_dict())
        if getattr(model_or_dir.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # the embedding itself; not a separate tensor on disk
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@contextlib.contextmanager
def _fixed_threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def qwen3_config(tiny_cfg, tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=tiny_cfg.vocab_size,
        hidden_size=tiny_cfg.hidden_size,
        intermediate_size=tiny_cfg.intermediate_size,
        num_hidden_layers=tiny_cfg.num_layers,
        num_attention_heads=tiny_cfg.num_heads,
        num_key_value_heads=tiny_cfg.num_kv_heads,
        head_dim=tiny_cfg.head_dim,
        max_position_embeddings=tiny_cfg.max_position_embeddings,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def check_tiny_config(tiny_cfg) -> None:
    """Shape and warm-start knobs a Qwen3 build or the warm start would reject late and obscurely."""
    positive = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "warm_start_batch_size")
    for name in positive:
        if getattr(tiny_cfg, name) < 1:
            raise UserError(f"model.tiny.{name}={getattr(tiny_cfg, name)}: must be >= 1")
    if tiny_cfg.num_heads % tiny_cfg.num_kv_heads:
        raise UserError(
            f"model.tiny.num_heads={tiny_cfg.num_heads} is not a multiple of "
            f"model.tiny.num_kv_heads={tiny_cfg.num_kv_heads}: pick kv heads that divide it"
        )
    from stapoctl.data.toy import FORK_FIELDS

    for name in FORK_FIELDS:
        if not 0.0 <= getattr(tiny_cfg, name) <= 1.0:
            raise UserError(f"model.tiny.{name}={getattr(tiny_cfg, name)}: use a value in [0, 1]")
    if tiny_cfg.warm_start_steps < 0 or tiny_cfg.warm_start_lr <= 0:
        raise UserError("model.tiny.warm_start_steps must be >= 0 and model.tiny.warm_start_lr > 0")


def _new_model(tiny_cfg, tokenizer, seed: int):
    import torch
    from transformers import Qwen3ForCausalLM

    check_tiny_config(tiny_cfg)
    if len(tokenizer) > tiny_cfg.vocab_size:
        raise UserError(
            f"model.tiny.vocab_size={tiny_cfg.vocab_size} is smaller than the tokenizer "
            f"({len(tokenizer)} tokens): raise it"
        )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_config(tiny_cfg, tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def _tokenizer(tiny_cfg, toy_cfg, instruction: str, out_dir: Path):
    from stapoctl.data import toy
    from stapoctl.models.tokenizer import train_tokenizer

    return train_tokenizer(toy.tokenizer_corpus(toy_cfg, instruction), tiny_cfg.vocab_size, out_dir)


def tokenizer_hash(model_cfg, data_cfg) -> str:
    """What the tokenizer depends on: vocab size, the toy task's number ranges, the instruction."""
    toy_cfg = data_cfg.toy
    key = {
        "builder": BUILDER_VERSION,
        "vocab_size": model_cfg.tiny.vocab_size,
        "ranges": [toy_cfg.operand_min, toy_cfg.addend_max, toy_cfg.factor_max],
        "instruction": data_cfg.instruction,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def ensure_tokenizer(model_cfg, data_cfg) -> Path:
    """The tiny model's tokenizer alone (seconds), cached: data prep needs its chat template,
    not the weights. `ensure_base_model` copies this very tokenizer into the model dir."""
    root = paths.home() / "tokenizers"
    final = root / f"tiny-{tokenizer_hash(model_cfg, data_cfg)}"
    if (final / "tokenizer.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        _tokenizer(model_cfg.tiny, data_cfg.toy, data_cfg.instruction, tmp)
        _publish(tmp, final, "tokenizer.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _publish(tmp: Path, final: Path, marker: str) -> None:
    """Atomic rename into the cache; losing a race to a twin build is fine."""
    if final.exists() and not (final / marker).is_file():
        shutil.rmtree(final, ignore_errors=True)  # a half-deleted cache entry
    try:
        os.rename(tmp, final)  # readers see no dir or a complete one
    except OSError:
        if not (final / marker).is_file():
            raise


def _save(model, tokenizer_dir: Path, out_dir: Path) -> None:
    """Weights plus the tokenizer files copied byte for byte (a used tokenizer would save its
    padding state too, and the model dir's tokenizer must be the cached one exactly)."""
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if tokenizer_dir.resolve() != out_dir.resolve():
        for f in tokenizer_dir.iterdir():
            if f.is_file():
                shutil.copy2(f, out_dir / f.name)


def build_random(out_dir: str | Path, tiny_cfg, seed: int) -> Path:
    """A random-init model + tokenizer dir in seconds, for engine plumbing tests."""
    from stapoctl.config.schema import STAPO_INSTRUCTION, ToyTaskConfig

    out = Path(out_dir)
    with _fixed_threads(BUILD_THREADS):
        tokenizer = _tokenizer(tiny_cfg, ToyTaskConfig(), STAPO_INSTRUCTION, out)
        _save(_new_model(tiny_cfg, tokenizer, seed), out, out)
    return out


def _progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
    )


def toy_scores(responses: list[list[str]], answers: list[str]) -> dict[str, float]:
    """Accuracy (the RL reward's notion), the arithmetic-only rate and the boxed rate."""
    from stapoctl.data import toy
    from stapoctl.reward import dapo_reward

    flat = [(r, a) for rs, a in zip(responses, answers) for r in rs]
    n = max(1, len(flat))
    return {
        "accuracy": sum(dapo_reward(r, a) > 0 for r, a in flat) / n,
        "arithmetic": sum(dapo_reward(toy.rebox(r), a) > 0 for r, a in flat) / n,
        "boxed_rate": sum("\\boxed{" in r for r, _ in flat) / n,
    }


def evaluate_toy(model, tokenizer, rows: list[dict], *, seed: int, max_new_tokens: int = 48) -> dict[str, Any]:
    """Held-out toy accuracy at T=1.0 (avg over a few samples per problem) and greedy, and the
    entropy profile of the T=1.0 samples (what STAPO's mask would act on)."""
    from stapoctl.models import entropy_profile
    from stapoctl.models.warm_start import decode, sample_ids

    prompts = [r["prompt"] for r in rows]
    answers = [r["answer"] for r in rows]
    t1_ids = sample_ids(model, tokenizer, prompts, n=EVAL_SAMPLES_PER_PROBLEM, temperature=1.0,
                        max_new_tokens=max_new_tokens, seed=seed)
    greedy = decode(tokenizer, sample_ids(model, tokenizer, prompts, n=1, temperature=0.0,
                                          max_new_tokens=max_new_tokens, seed=seed))
    t1 = decode(tokenizer, t1_ids)
    s1, sg = toy_scores(t1, answers), toy_scores(greedy, answers)
    return {
        "heldout_problems": len(rows),
        "samples_per_problem_t1": EVAL_SAMPLES_PER_PROBLEM,
        "accuracy_t1": s1["accuracy"],
        "accuracy_greedy": sg["accuracy"],
        "arithmetic_t1": s1["arithmetic"],
        "arithmetic_greedy": sg["arithmetic"],
        "boxed_rate_t1": s1["boxed_rate"],
        "boxed_rate_greedy": sg["boxed_rate"],
        "example_t1": t1[0][0] if t1 and t1[0] else "",
        "entropy_profile": entropy_profile.measure(model, tokenizer, prompts, t1_ids, answers),
    }


def build_base_model(out_dir: Path, model_cfg, data_cfg, console=None) -> dict[str, Any]:
    """Tokenizer → random init → warm start → held-out eval → save; returns base_eval."""
    import torch

    from stapoctl.data import toy
    from stapoctl.data.templates import render_prompt
    from stapoctl.models.warm_start import Example, warm_start

    tiny, toy_cfg = model_cfg.tiny, data_cfg.toy
    start = time.perf_counter()
    with _fixed_threads(BUILD_THREADS), _progress(console) as progress:
        task = progress.add_task("tiny model: tokenizer", total=1, info="")
        from transformers import AutoTokenizer

        tokenizer_dir = ensure_tokenizer(model_cfg, data_cfg)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        progress.update(task, advance=1, info=f"{len(tokenizer)} tokens")
        model = _new_model(tiny, tokenizer, model_cfg.seed)

        def prompt(p) -> str:
            return render_prompt(p.problem, template=data_cfg.template,
                                 instruction=data_cfg.instruction, tokenizer=tokenizer)

        pool, heldout = toy.split_problems(toy_cfg)
        prompts = {p: prompt(p) for p in pool}
        steps, bs = tiny.warm_start_steps, tiny.warm_start_batch_size
        examples = [
            Example(prompts[p], text)
            for p, text in toy.demos(pool, steps * bs, tiny, seed=model_cfg.seed)
        ]
        task = progress.add_task("tiny model: warm start", total=steps, info="")
        torch.manual_seed(model_cfg.seed)
        t0 = time.perf_counter()
        losses = warm_start(
            model, tokenizer, examples, batch_size=bs, lr=tiny.warm_start_lr,
            on_step=lambda step, loss: progress.update(task, advance=1, info=f"loss {loss:.3f}"),
        )
        warm_s = time.perf_counter() - t0
        task = progress.add_task("tiny model: toy eval", total=1, info=f"{len(heldout)} held-out")
        rows = [{"prompt": prompt(p), "answer": str(p.answer)} for p in heldout]
        report = evaluate_toy(model, tokenizer, rows, seed=model_cfg.seed)
        progress.update(task, advance=1)
        _save(model, tokenizer_dir, out_dir)
    report.update(
        params=sum(p.numel() for p in model.parameters()),
        warm_start_steps=steps,
        warm_start_final_loss=losses[-1] if losses else None,
        warm_start_seconds=round(warm_s, 1),
        build_seconds=round(time.perf_counter() - start, 1),
        build_threads=BUILD_THREADS,
        builder_version=BUILDER_VERSION,
        config_hash=config_hash(model_cfg, data_cfg),
        weights_sha256=state_dict_hash(model),
        config={"seed": model_cfg.seed, "tiny": _plain(tiny), "toy": _plain(toy_cfg),
                "template": data_cfg.template, "instruction": data_cfg.instruction},
    )
    (out_dir / BASE_EVAL).write_text(json.dumps(report, indent=2) + "\n")
    return report


def ensure_base_model(model_cfg, data_cfg, console=None) -> Path:
    """The cached warm-started tiny model dir, building it (minutes, with progress) if absent."""
    root = paths.home() / "models"
    final = root / f"tiny-{config_hash(model_cfg, data_cfg)}"
    if (final / BASE_EVAL).is_file():
        return final
    from rich.console import Console

    console = console or Console(stderr=True)
    console.print(f"building the embedded tiny model into {final} (once; cached afterwards)", markup=False)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        report = build_base_model(tmp, model_cfg, data_cfg, console)
        _publish(tmp, final, BASE_EVAL)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prof = report["entropy_profile"]
    console.print(
        f"tiny model {final.name}: {report['params']:,} params, held-out toy accuracy "
        f"T=1.0 {report['accuracy_t1']:.1%}, greedy {report['accuracy_greedy']:.1%} "
        f"(arithmetic right regardless of the box: {report['arithmetic_t1']:.1%} at T=1.0); "
        f"token entropy h* (80th pct) {prof['h_star']:.3f} nats, top prob > 0.999 on "
        f"{prof['top_prob_gt_0999']:.0%} of tokens; built in {report['build_seconds']:.0f} s",
        highlight=False,
    )
    return final


def base_eval(model_dir: str | Path) -> dict[str, Any]:
    """The build's recorded toy accuracy, size and time (empty for other models)."""
    path = Path(model_dir) / BASE_EVAL
    return json.loads(path.read_text()) if path.is_file() else {}
