"""Which runs may share running engines (`trainer/session.py engine_key`): the model's architecture
and tokenizer count, not its path, so a resume (or a sweep's next trial resumed from a checkpoint)
gets the engines as they run and its weights are pushed; another architecture or tokenizer, or a
setting vLLM fixed when it started, still starts new ones."""

from __future__ import annotations

import json
import shutil

import pytest


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from stapoctl.config.schema import TinyModelConfig
    from stapoctl.models.tiny import build_random

    return build_random(tmp_path_factory.mktemp("base"), TinyModelConfig(), seed=0)


@pytest.fixture(scope="module")
def saved(base, tmp_path_factory):
    """`base` written again as a checkpoint's model/ is (transformers' save_pretrained of the model
    and the tokenizer, after training set use_cache off), other weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("ckpt") / "model"
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    model.config.use_cache = False
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    return out


def _conf(*extra):
    from stapoctl.config.compose import compose_config

    return compose_config(list(extra))


def test_a_checkpoint_of_the_model_shares_its_engines(base, saved):
    from stapoctl.models.identity import model_identity
    from stapoctl.trainer.session import engine_key

    assert (saved / "config.json").read_text() != (base / "config.json").read_text()  # the save's own fields
    assert model_identity(str(saved)) == model_identity(str(base))
    assert engine_key(_conf(), str(saved)) == engine_key(_conf(), str(base))


def test_another_architecture_or_tokenizer_starts_new_engines(base, tmp_path):
    from stapoctl.models.identity import model_identity
    from stapoctl.trainer.session import engine_key

    deeper = tmp_path / "deeper"
    shutil.copytree(base, deeper)
    cfg = json.loads((deeper / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (deeper / "config.json").write_text(json.dumps(cfg))
    assert engine_key(_conf(), str(deeper)) != engine_key(_conf(), str(base))

    retokenized = tmp_path / "retokenized"
    shutil.copytree(base, retokenized)
    tok = json.loads((retokenized / "tokenizer.json").read_text())
    tok["added_tokens"] = [*tok.get("added_tokens", []), {"id": 99999, "content": "<x>", "single_word": False,
                                                          "lstrip": False, "rstrip": False, "normalized": False,
                                                          "special": True}]
    (retokenized / "tokenizer.json").write_text(json.dumps(tok))
    assert model_identity(str(retokenized)) != model_identity(str(base))


def test_a_run_is_keyed_by_its_base_model(base, saved, tmp_path):
    """A resumed run's policy is its checkpoint, its base the run's initial model: keyed by the base,
    it matches fresh runs of that base even where a save rewrote the config's fields."""
    from stapoctl.trainer.session import engine_key

    rewritten = tmp_path / "rewritten"
    shutil.copytree(saved, rewritten)
    cfg = json.loads((rewritten / "config.json").read_text())
    # as transformers 5 re-saves a Qwen3-8B config: rope_theta moved, layer_types added
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta", 10000.0), "rescaled": 1}
    cfg["layer_types"] = ["full_attention"] * int(cfg["num_hidden_layers"]) + ["rewritten"]
    (rewritten / "config.json").write_text(json.dumps(cfg))
    fresh = engine_key(_conf(), str(base), str(base))
    assert engine_key(_conf(), str(rewritten), str(base)) == fresh
    assert engine_key(_conf(), str(rewritten)) != fresh  # by its own path it would not have matched


def test_a_hub_id_not_on_disk_matches_only_itself():
    from stapoctl.models.identity import model_identity

    assert model_identity("Qwen/Qwen3-8B-Base") == "Qwen/Qwen3-8B-Base"
    assert model_identity("Qwen/Qwen3-8B-Base") != model_identity("Qwen/Qwen3-8B")


def test_settings_vllm_fixed_at_start_still_start_new_engines(base):
    from stapoctl.trainer.session import engine_key

    same = engine_key(_conf(), str(base))
    assert engine_key(_conf("loss=stapo", "trainer.seed=3", "learner.lr=1e-5"), str(base)) == same  # a reset
    for change in ("model.dtype=bfloat16", "rollout.num_workers=2", "rollout.max_response_length=64",
                   "rollout.num_threads=1", "rollout.weight_sync=gloo", "rollout.max_restarts=0"):
        assert engine_key(_conf(change), str(base)) != same, change


def test_a_resumed_config_in_another_key_order_is_the_same_key(base):
    """A resumed run's config is read back from its checkpoint's JSON, mappings sorted: the same
    engines fit it (this once started new engines for every resume)."""
    from omegaconf import OmegaConf

    from stapoctl.trainer.session import engine_key, engine_parts, why_restart

    conf = _conf()
    back = OmegaConf.create(OmegaConf.to_container(conf, resolve=True))
    back.cluster = OmegaConf.create(dict(sorted(OmegaConf.to_container(conf.cluster).items())))
    assert list(back.cluster) != list(conf.cluster)
    assert engine_key(back, str(base)) == engine_key(conf, str(base))
    assert why_restart(engine_parts(conf, str(base)), engine_parts(_conf("model.dtype=bfloat16"), str(base))) == \
        "model.dtype: 'float32' → 'bfloat16'"


class _Launch:
    """What `launch_engines` returns, without Ray or actors: `ready()` gives engines whose info
    holds the reason the session set (as `EngineLaunch.ready` puts it there), or raises."""

    def __init__(self, fail: bool = False):
        self.fail, self.reason = fail, None

    def ready(self):
        from types import SimpleNamespace

        if self.fail:
            raise RuntimeError("the engines did not come up")
        return SimpleNamespace(info={"reason": self.reason}, shutdown=lambda: None)

    def abort(self):
        pass


def test_every_start_says_why(base, monkeypatch):
    """The reason a start records (`engines.info["reason"]`, the suite's start table): the first,
    the settings that changed, a discard, a failed start, a prepared start that did not fit."""
    from types import SimpleNamespace

    import stapoctl.rollout.model_verifier as verifier
    import stapoctl.trainer.engines as launching
    from stapoctl.trainer.session import EngineSession

    outcomes: list[bool] = []  # fail the next launch's ready()?
    monkeypatch.setattr(launching, "launch_engines", lambda *a, **k: _Launch(outcomes.pop(0) if outcomes else False))
    monkeypatch.setattr(verifier, "reward_pool", lambda *a, **k: SimpleNamespace(close=lambda: None))
    session = EngineSession()
    fp32, bf16, two = _conf(), _conf("model.dtype=bfloat16"), _conf("rollout.num_workers=2")

    def start(conf) -> str:
        engines, _ = session.acquire(conf, str(base))
        return engines.info["reason"]

    assert start(fp32) == "first start"
    assert start(bf16) == "model.dtype: 'float32' → 'bfloat16'"
    session.discard()
    assert start(bf16) == "previous engines discarded"
    outcomes.append(True)
    with pytest.raises(RuntimeError):
        start(fp32)
    assert start(fp32) == "previous start failed"
    session.prepare(two, str(base))  # prepared for two workers, then a run of one comes
    assert start(fp32) == "a start prepared for other settings was cancelled"
    session.close()
    assert start(fp32) == "first start"
