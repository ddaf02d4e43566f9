"""The embedded tiny model: deterministic build, cache, HF dir layout, model-spec resolution,
and the same sampled-token log-probs from vLLM and transformers."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from stapoctl.config.schema import DataConfig, ModelConfig, TinyModelConfig, ToyTaskConfig
from stapoctl.errors import UserError
from stapoctl.models import tiny
from stapoctl.models.resolve import resolve_model


def reduced(seed: int = 0, steps: int = 250, heldout: int = 64) -> tuple[ModelConfig, DataConfig]:
    """The real recipe with a short warm start and a small held-out eval; by default the suite's
    shared model (tests/conftest.py TINY_OVERRIDES), so this module builds none of its own."""
    model = ModelConfig(seed=seed, tiny=TinyModelConfig(warm_start_steps=steps))
    data = DataConfig(toy=ToyTaskConfig(num_heldout=heldout))
    return model, data


@pytest.fixture(scope="session")
def tiny_home(shared_home) -> Path:
    return shared_home.home


@pytest.fixture(scope="session")
def base_model(shared_home) -> Path:
    """The suite's reduced warm-started model (built once, `shared_home`), found again through the
    cache the way `ensure_base_model` finds it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_HOME", str(shared_home.home))
    try:
        model_cfg, data_cfg = reduced()
        found = tiny.ensure_base_model(model_cfg, data_cfg)
    finally:
        mp.undo()
    assert found == shared_home.model_dir, "reduced() is not the suite's model: a second build"
    return found


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path / "home"))
    hashes = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        out = tmp_path / name
        out.mkdir()
        model_cfg, data_cfg = reduced(seed=seed, steps=4, heldout=4)
        report = tiny.build_base_model(out, model_cfg, data_cfg)
        hashes[name] = tiny.state_dict_hash(out)
        assert report["weights_sha256"] == hashes[name]  # what was trained is what was saved
    assert hashes["a"] == hashes["b"]
    assert hashes["a"] != hashes["c"]
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_build_is_cached_and_records_its_toy_eval(base_model, tiny_home, monkeypatch):
    monkeypatch.setenv("STAPOCTL_HOME", str(tiny_home))
    model_cfg, data_cfg = reduced()
    assert base_model == tiny_home / "models" / f"tiny-{tiny.config_hash(model_cfg, data_cfg)}"
    mtime = (base_model / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert tiny.ensure_base_model(model_cfg, data_cfg) == base_model
    assert time.perf_counter() - start < 1.0
    assert (base_model / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in (tiny_home / "models").iterdir() if p.name.startswith(".")]  # no temp dirs left
    report = json.loads((base_model / tiny.BASE_EVAL).read_text())
    for key in ("accuracy_t1", "accuracy_greedy", "arithmetic_t1", "arithmetic_greedy", "boxed_rate_t1"):
        assert 0.0 <= report[key] <= 1.0, key
    assert report["accuracy_t1"] <= report["arithmetic_t1"]  # reboxing only adds credit
    assert report["heldout_problems"] == 64 and report["warm_start_steps"] == 250
    prof = report["entropy_profile"]  # measured on the T=1.0 samples: 64 problems x 4
    assert prof["tokens"] > 64 * 4 * 10 and prof["h_star"] > 0 and 0.0 <= prof["top_prob_gt_0999"] <= 1.0
    assert list(prof["by_tau_p"]) == ["0.002", "0.02", "0.2"]
    counts = [prof["by_tau_p"][k]["s2t"] for k in ("0.002", "0.02", "0.2")]
    assert counts == sorted(counts)  # a larger tau_p silences a superset
    assert all(row["s2t"] + row["high_entropy"] == row["prob_only"] for row in prof["by_tau_p"].values())
    assert report["weights_sha256"] == tiny.state_dict_hash(base_model)
    # a changed knob is a different cache entry
    other_model, other_data = reduced()
    other_model.tiny.unboxed_fraction = 0.3
    assert tiny.config_hash(other_model, other_data) != tiny.config_hash(model_cfg, data_cfg)


def test_model_dir_is_a_plain_hf_qwen3_dir(base_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_model)
    tok = AutoTokenizer.from_pretrained(base_model)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    params = sum(p.numel() for p in model.parameters())
    assert params == json.loads((base_model / tiny.BASE_EVAL).read_text())["params"]
    assert 100_000 <= params <= 5_000_000
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tok.eos_token_id and len(tok) <= model.config.vocab_size
    text = tok.apply_chat_template([{"role": "user", "content": "Compute 2 + 3 * 4."}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nCompute 2 + 3 * 4.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok("8*7=56. 27+56=83. \\boxed{83}")["input_ids"]) == "8*7=56. 27+56=83. \\boxed{83}"
    # the tokenizer in the model dir is the one data prep uses on its own
    model_cfg, data_cfg = reduced()
    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_HOME", str(base_model.parent.parent))
    try:
        tok_dir = tiny.ensure_tokenizer(model_cfg, data_cfg)
    finally:
        mp.undo()
    assert (tok_dir / "tokenizer.json").read_bytes() == (base_model / "tokenizer.json").read_bytes()


def test_warm_start_taught_the_answer_layout(base_model):
    """A short warm start already makes the model write the worked layout the reward parses
    (in its phrasings), in both endings; the full 500-step build also gets most of the
    arithmetic right."""
    import re

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapoctl.data import toy
    from stapoctl.data.templates import render_prompt
    from stapoctl.models.warm_start import sample

    model = AutoModelForCausalLM.from_pretrained(base_model)
    tok = AutoTokenizer.from_pretrained(base_model)
    data_cfg = DataConfig()
    prompts = [render_prompt(p.problem, template="chat", instruction=data_cfg.instruction, tokenizer=tok)
               for p in toy.problems(data_cfg.toy, "heldout")[:16]]
    texts = [t for group in sample(model, tok, prompts, n=4, temperature=1.0, max_new_tokens=32, seed=0)
             for t in group]
    layout = re.compile(r"^\d+[*x]\d+( = |=)\d+[.;] \d+\+\d+( = |=)\d+[.;] (\\boxed\{\d+\}|answer \d+)$")
    well_formed = [t for t in texts if layout.match(t)]
    assert len(well_formed) >= 0.5 * len(texts), texts[:8]  # 80 steps: ~60%; 250 (this model) and 500 steps: more
    assert any("\\boxed{" in t for t in well_formed) and any("answer " in t for t in well_formed)


def test_build_random_is_quick_and_loadable(tmp_path):
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    out = tiny.build_random(tmp_path / "rand", TinyModelConfig(), seed=0)
    assert time.perf_counter() - start < 30
    model = AutoModelForCausalLM.from_pretrained(out)
    assert tiny.state_dict_hash(model) == tiny.state_dict_hash(out)
    assert tiny.state_dict_hash(out) == tiny.state_dict_hash(tiny.build_random(tmp_path / "again", TinyModelConfig(), 0))


def make_run_dir(root: Path, model_src: Path, steps=(10, 20)) -> Path:
    import shutil

    from stapoctl import checkpoint

    run = root / "run"
    for step in steps:
        checkpoint.save(run, step, lambda tmp: shutil.copytree(model_src, tmp / "model",
                                                               ignore=shutil.ignore_patterns("*.safetensors")),
                        {"step": step})
    (run / "checkpoints" / "latest").write_text(f"step_{steps[0]:06d}\n")  # latest need not be the max
    return run


def test_resolve_model_specs(base_model, tiny_home, tmp_path, monkeypatch):
    monkeypatch.setenv("STAPOCTL_HOME", str(tiny_home))
    model_cfg, data_cfg = reduced()

    class Cfg:
        model, data = model_cfg, data_cfg

    assert resolve_model("", Cfg) == str(base_model)
    assert resolve_model(str(base_model), Cfg) == str(base_model)
    run = make_run_dir(tmp_path, base_model)
    step10, step20 = run / "checkpoints" / "step_000010", run / "checkpoints" / "step_000020"
    # the newest complete step, whatever `latest` says (a hint only, as for resume=)
    assert resolve_model(str(run), Cfg) == str(step20 / "model")
    assert resolve_model(str(run / "checkpoints"), Cfg) == str(step20 / "model")
    assert resolve_model(str(step10), Cfg) == str(step10 / "model")
    (run / "checkpoints" / "latest").unlink()
    assert resolve_model(str(run), Cfg) == str(step20 / "model")
    assert resolve_model("Qwen/Qwen3-8B-Base", Cfg) == "Qwen/Qwen3-8B-Base"
    with pytest.raises(UserError, match="no such directory"):
        resolve_model(str(tmp_path / "nope"), Cfg)
    with pytest.raises(UserError, match="no config.json and no checkpoints"):
        resolve_model(str(tmp_path), Cfg)


def test_resolve_model_from_an_mlflow_run_id(base_model, tmp_path, monkeypatch):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_dir = make_run_dir(tmp_path, base_model, steps=(5,))
    # explicit URI: an earlier test in this process may have called mlflow.set_tracking_uri
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("resolve")
    run = client.create_run(exp, tags={"stapoctl.run_dir": str(run_dir)})
    untagged = client.create_run(exp)

    class Cfg:
        class tracking:
            uri = None

    assert resolve_model(run.info.run_id, Cfg) == str(run_dir / "checkpoints" / "step_000005" / "model")
    with pytest.raises(UserError, match="has no 'stapoctl.run_dir' tag"):
        resolve_model(untagged.info.run_id, Cfg)
    with pytest.raises(UserError, match="no such MLflow run"):
        resolve_model("0" * 32, Cfg)


@pytest.mark.engine
def test_vllm_and_transformers_give_the_same_sampled_token_logprobs(base_model):
    """Sample with vLLM (in-process CPU engine), re-score the same tokens with a transformers
    forward: the learner's log-probs and the rollout's must agree for the ratio to mean anything."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapoctl.data import toy
    from stapoctl.data.templates import render_prompt
    from stapoctl.rollout import vllm_engine

    tok = AutoTokenizer.from_pretrained(base_model)
    data_cfg = DataConfig()
    prompts = [render_prompt(p.problem, template="chat", instruction=data_cfg.instruction, tokenizer=tok)
               for p in toy.problems(data_cfg.toy, "heldout")[:6]]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    llm = vllm_engine.make_llm(vllm_engine.EngineSpec(model_path=str(base_model), seed=0, max_model_len=256))
    try:
        by_text = vllm_engine.generate(llm, prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=32, seed=7)
        by_ids = vllm_engine.generate(llm, prompt_ids, n=4, temperature=1.0, top_p=1.0, max_tokens=32, seed=7)
    finally:
        vllm_engine.shutdown(llm)
    # vLLM tokenizes the prompt text exactly as we do: same seed, same samples
    assert [[s.token_ids for s in g] for g in by_text] == [[s.token_ids for s in g] for g in by_ids]

    model = AutoModelForCausalLM.from_pretrained(base_model, torch_dtype=torch.float32).eval()
    worst, count = 0.0, 0
    for ids, group in zip(prompt_ids, by_ids):
        for sample in group:
            assert sample.token_ids and len(sample.logprobs) == len(sample.token_ids)
            full = torch.tensor([ids + sample.token_ids])
            with torch.no_grad():
                logits = model(full).logits[0, len(ids) - 1 : -1].float()
            hf = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            worst = max(worst, (hf - torch.tensor(sample.logprobs)).abs().max().item())
            count += len(sample.token_ids)
    print(f"max |logprob(vLLM) - logprob(HF)| = {worst:.2e} over {count} sampled tokens")
    assert count > 100
    assert worst <= 1e-4, f"max |logprob(vLLM) - logprob(HF)| = {worst:.2e} over {count} tokens"


def test_entropy_profile_counts_by_hand():
    """Six response tokens, h* = the 80th percentile of their entropies, counts per tau_p."""
    from stapoctl.models.entropy_profile import profile

    # two responses x 3 tokens; response 0 has A > 0, response 1 A < 0
    prob = torch.tensor([[0.5, 0.01, 0.1], [0.001, 0.9, 0.5]])
    ent = torch.tensor([[0.9, 0.05, 0.3], [0.02, 0.4, 1.0]])
    top = torch.tensor([[0.5, 0.9995, 0.9], [0.9999, 0.9, 0.5]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    out = profile(prob, ent, top, mask, torch.tensor([1.0, -1.0]))
    # sorted H: .02 .05 .3 .4 .9 1.0; q = 0.8 -> position 4.0 -> h* = 0.9
    assert out["h_star"] == pytest.approx(0.9)
    assert out["tokens"] == 6 and out["pos_adv_tokens"] == 3 and out["pos_adv_low_entropy_tokens"] == 2
    assert out["top_prob_gt_0999"] == pytest.approx(2 / 6, abs=1e-4)
    rows = out["by_tau_p"]
    # A > 0 tokens: (pi .5, H .9 = h*: high), (pi .01, H .05: low), (pi .1, H .3: low)
    assert [rows[k]["s2t"] for k in ("0.002", "0.02", "0.2")] == [0, 1, 2]
    assert [rows[k]["prob_only"] for k in ("0.002", "0.02", "0.2")] == [0, 1, 2]
    assert rows["0.02"]["spurious_ratio"] == pytest.approx(1 / 6, abs=1e-6)
    out = profile(prob, ent, top, mask, torch.tensor([1.0, -1.0]), tau_ps=(0.6,), tau_h=0.5)
    # h* = quantile 0.5 = (.3 + .4) / 2 = .35: the pi .5 token (H .9) is high-entropy
    assert out["by_tau_p"]["0.6"] == {"s2t": 2, "prob_only": 3, "high_entropy": 1, "spurious_ratio": pytest.approx(2 / 6, abs=1e-6)}


def test_entropy_profile_token_stats_ignore_padding(base_model):
    """Left-padded batched scoring gives each response the stats of its own unpadded forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapoctl.models.entropy_profile import token_stats

    model = AutoModelForCausalLM.from_pretrained(base_model).eval()
    tok = AutoTokenizer.from_pretrained(base_model)
    prompts = ["Compute 2 + 3 * 4.\n", "Compute 27 + 8 * 7.\nPlease reason step by step.\n"]
    responses = [tok("3*4=12. 2+12=14. \\boxed{14}")["input_ids"] + [tok.eos_token_id], tok("8*7=56.")["input_ids"]]
    prob, ent, top, mask = token_stats(model, tok, prompts, responses)
    assert mask.sum(1).tolist() == [len(r) for r in responses]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.tensor([tok(p)["input_ids"] + r])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, -len(r) - 1 : -1].float(), -1)
        assert torch.allclose(prob[i, : len(r)], logp.exp().gather(1, torch.tensor(r)[:, None])[:, 0], atol=1e-5)
        assert torch.allclose(ent[i, : len(r)], -(logp.exp() * logp).sum(-1), atol=1e-5)
        assert torch.allclose(top[i, : len(r)], logp.exp().max(-1).values, atol=1e-5)


@pytest.mark.engine
def test_rollout_texts_and_logprobs_equal_the_engines_own_detokenizer(tmp_path):
    """The rollout decodes texts in one batch call and reads flat log-prob lists; both must give
    what vLLM's own incremental detokenizer and per-token dicts give for the same samples. A
    random model emits arbitrary bytes, so responses cut mid-character by the token limit occur
    (vLLM never emits the dangling bytes)."""
    from vllm import SamplingParams

    from stapoctl.rollout import vllm_engine

    from transformers import AutoTokenizer

    model = tiny.build_random(tmp_path / "rand", TinyModelConfig(), seed=0)
    tok = AutoTokenizer.from_pretrained(model)
    # whole-character prompts, as a chat template renders them (vLLM decodes a response's first
    # bytes together with the prompt's last ones)
    prompts = [tok(f"Compute {i} + {3 * i}.", add_special_tokens=False)["input_ids"] for i in range(8)]
    llm = vllm_engine.make_llm(vllm_engine.EngineSpec(model_path=str(model), seed=0, max_model_len=128))
    try:
        ours = vllm_engine.generate(llm, prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=24, seed=11)
        llm.reset_prefix_cache()
        params = [SamplingParams(n=4, temperature=1.0, top_p=1.0, max_tokens=24, logprobs=0, seed=s)
                  for s in vllm_engine.request_seeds(11, len(prompts), 4)]
        engine = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        vllm_engine.shutdown(llm)
    compared = replaced = 0
    for group, out in zip(ours, engine):
        for sample, comp in zip(group, sorted(out.outputs, key=lambda c: c.index)):
            assert sample.token_ids == list(comp.token_ids)
            assert sample.logprobs == [step[tok].logprob for tok, step in zip(comp.token_ids, comp.logprobs)]
            assert sample.text == comp.text
            compared += 1
            replaced += "\ufffd" in comp.text
    assert compared == 32
    assert replaced > 0, "no sample had undecodable bytes: the test no longer covers cut characters"


def test_sampled_logprobs_read_flat_lists_and_dicts():
    from vllm.logprobs import FlatLogprobs, Logprob

    from stapoctl.rollout.vllm_engine import sampled_logprobs

    flat = FlatLogprobs()
    flat.append({7: Logprob(-0.5, 1, None)})
    flat.append({3: Logprob(-1.25, 2, None), 9: Logprob(-0.1, 1, None)})  # sampled token not ranked first
    flat.append(None)
    out = sampled_logprobs([7, 3, 4], flat)
    assert out[:2] == [-0.5, -1.25] and math.isnan(out[2])
    assert sampled_logprobs([7], [{7: Logprob(-0.5, 1, None)}]) == [-0.5]
    assert all(math.isnan(v) for v in sampled_logprobs([1, 2], None))


@pytest.mark.engine
def test_a_kv_cache_too_small_for_one_sequence_is_a_user_error(tmp_path):
    from stapoctl.rollout import vllm_engine

    model = tiny.build_random(tmp_path / "rand", TinyModelConfig(), seed=0)
    with pytest.raises(UserError, match=r"rollout\.kv_cache_gb=1e-05 GiB cannot hold one sequence of max_model_len 128"):
        vllm_engine.make_llm(vllm_engine.EngineSpec(model_path=str(model), max_model_len=128, kv_cache_gb=1e-5))
