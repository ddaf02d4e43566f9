"""vLLM's own bound on a model step at TP > 1 (`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`, 300 s by
default, read in its multiprocess and Ray executors) is set past the driver's stall bound, so a step
stuck in a kernel or a TP collective ends the run with the stall line that names the worker (issue
#49), not with vLLM's `EngineDeadError` 300 s into a 600 s bound."""

from __future__ import annotations

import os

from stapoctl.config.compose import compose_config
from stapoctl.rollout import vllm_engine
from stapoctl.trainer.engine_settings import EXECUTE_MODEL_MARGIN_S, engine_spec


def test_the_spec_puts_vllms_step_bound_past_the_stall_bound(tmp_path):
    conf = compose_config(["rollout.stall_timeout_s=420"])
    spec = engine_spec(conf, str(tmp_path), "gloo", on_gpu=False)
    assert spec.execute_model_timeout_s == 420 + EXECUTE_MODEL_MARGIN_S
    assert spec.execute_model_timeout_s > conf.rollout.stall_timeout_s


def test_configure_env_exports_it_and_a_users_value_wins(monkeypatch):
    monkeypatch.delenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", raising=False)
    spec = vllm_engine.EngineSpec(model_path="m", execute_model_timeout_s=660.5)
    vllm_engine.configure_env(spec)
    assert os.environ["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "661"
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "90")
    vllm_engine.configure_env(spec)
    assert os.environ["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "90"


def test_an_engine_without_a_stall_bound_keeps_vllms_default(monkeypatch):
    monkeypatch.delenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", raising=False)
    vllm_engine.configure_env(vllm_engine.EngineSpec(model_path="m"))  # evaluation, the verifier
    assert "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" not in os.environ


def test_at_tp_above_1_the_stall_bound_is_part_of_the_engine_key(tmp_path):
    """vLLM reads its step bound when its executor starts: warm engines built for another stall bound
    would keep the old one, so at TP > 1 (the only executors that have the bound) it is a restart key."""
    from stapoctl.trainer.session import engine_parts

    def parts(*over):
        return engine_parts(compose_config(list(over)), str(tmp_path), base_model="Qwen/Qwen3-0.6B")

    assert "rollout.stall_timeout_s" not in parts("rollout.stall_timeout_s=30")
    tp2 = parts("rollout.tensor_parallel_size=2", "rollout.stall_timeout_s=30")
    assert tp2["rollout.stall_timeout_s"] == 30
    assert tp2 != parts("rollout.tensor_parallel_size=2", "rollout.stall_timeout_s=40")
