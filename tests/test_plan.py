"""`stapoctl plan`: the memory arithmetic against hand-computed numbers and DeepSpeed's own
estimators, and the refusals of train/submit/sweep (and their dry runs) when a plan cannot fit."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

import pytest

from stapoctl.config.shapes import QWEN3_SHAPES, decoder_params, known_shape
from stapoctl.preflight import memory as M
from stapoctl.preflight.memory_plan import checkpoint_bytes_per_param

TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True)
QWEN3_8B = QWEN3_SHAPES["Qwen/Qwen3-8B-Base"]
P_8B = 8_190_735_360  # the model card's 8.2B
GIB = 2**30


# `python -m stapoctl.cli ARGS` as a process of its own (argv, environment, exit code, stdout, stderr),
# forked from one interpreter that has already imported what `plan` imports (torch and DeepSpeed's
# estimators: ~5 s of each of this module's 13 CLI runs). Nothing of stapoctl, transformers or the
# hub's settings is imported before the fork, so STAPOCTL_HOME and HF_HOME are read per run as in a
# fresh process (the server refuses to start otherwise).
FORK_SERVER = r'''
import atexit, json, os, runpy, sys
proto = os.fdopen(os.dup(1), "w", buffering=1)  # the replies' pipe, before any import can print
os.dup2(2, 1)  # what the imports print (DeepSpeed's accelerator warning) goes to stderr
import deepspeed.runtime.zero.stage3, deepspeed.runtime.zero.stage_1_and_2, hydra, omegaconf, torch  # noqa: F401
early = sorted(m for m in sys.modules if m.split(".")[0] in ("stapoctl", "transformers") or m == "huggingface_hub.constants")
assert not early, f"imported before the fork: {early}"
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            for fd, path in ((0, os.devnull), (1, req["out"]), (2, req["err"])):
                f = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(f, fd)
                os.close(f)
            sys.argv = ["stapoctl", *req["args"]]  # run_module sets [0] to the module's file, as `python -m`
            runpy.run_module("stapoctl.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:  # as the interpreter ends on one
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    proto.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
'''


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("fork_server")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(home / "hf"), "STAPOCTL_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


@pytest.fixture()
def run_cli(cli_server, tmp_path_factory):
    """run_cli(*args, home=DIR): a CompletedProcess as `subprocess.run` of `python -m stapoctl.cli` gives it."""
    outputs = tmp_path_factory.mktemp("cli")
    calls = iter(range(1_000))

    def run(*args: str, home) -> subprocess.CompletedProcess:
        env = {**os.environ, "COLUMNS": "200", "STAPOCTL_HOME": str(home), "HF_HUB_OFFLINE": "1",
               "HF_HOME": str(home / "hf")}
        n = next(calls)
        out, err = outputs / f"cli-{n}.out", outputs / f"cli-{n}.err"
        argv = [sys.executable, "-m", "stapoctl.cli", *args]
        cli_server.stdin.write(json.dumps({"args": list(args), "env": env, "cwd": os.getcwd(), "out": str(out),
                                           "err": str(err)}) + "\n")
        cli_server.stdin.flush()
        ready, _, _ = select.select([cli_server.stdout], [], [], 180)
        if not ready:
            cli_server.kill()
            raise subprocess.TimeoutExpired(argv, 180)
        reply = cli_server.stdout.readline()
        assert reply, f"the fork server died (exit {cli_server.poll()})"
        return subprocess.CompletedProcess(argv, json.loads(reply)["code"], out.read_text(), err.read_text())

    return run


def test_parameter_count_of_the_tiny_shape_matches_a_real_qwen3_model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**{k: v for k, v in TINY.items()}, max_position_embeddings=64)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    real = sum(dict((id(p), p.numel()) for p in model.parameters()).values())
    # per layer: q,k,v,o 128*32*(2*4 + 2*2) = 49,152; MLP 3*128*384 = 147,456; 2 norms of 128; q/k norms 2*32
    # = 196,928; x2 layers + embedding 512*128 = 65,536 (tied head) + final norm 128
    assert decoder_params(TINY) == 2 * 196_928 + 65_536 + 128 == 459_520 == real


def test_qwen3_8b_by_hand():
    # per layer 4096*128*(64+16) + 3*4096*12288 + 2*4096 + 2*128 = 192,946,432; x36; + embedding and
    # untied head 2 * 151,936*4096; + final norm
    assert decoder_params(QWEN3_8B) == 36 * 192_946_432 + 2 * 151_936 * 4096 + 4096 == P_8B
    # ZeRO-2 on 4 GPUs, bf16: 2 + 18/4 bytes per parameter = 49.6 GiB (the figure)
    parts = M.learner_memory(QWEN3_8B, zero_stage=2, num_ranks=4, dtype="bfloat16", micro_tokens=16384,
                             gradient_checkpointing=True, logits_chunk=1024)
    assert parts["model_states"] * GIB == pytest.approx(6.5 * P_8B, abs=1)
    assert round(parts["model_states"], 1) == 49.6
    # checkpointing: 36 layer inputs of 4096 + one layer's 76,800 elements (3h + 3q + 3kv + 4I) per token, bf16
    assert M.activation_elems_per_token_layer(QWEN3_8B) == 3 * 4096 + 3 * 4096 + 3 * 1024 + 4 * 12288 == 76_800
    assert parts["activations"] * GIB == (36 * 4096 + 76_800) * 16384 * 2
    assert parts["activations_if_checkpointing_flipped"] * GIB == 36 * 76_800 * 16384 * 2
    # KV: 2 x 36 layers x 8 KV heads x 128 x 2 bytes
    assert M.kv_bytes_per_token(QWEN3_8B, "bfloat16") == 147_456
    # a checkpoint: HF weights + DeepSpeed module (bf16) + fp32 master + Adam = 16 bytes/param, ~131 GB
    assert checkpoint_bytes_per_param("bfloat16", 2) * P_8B == 131_051_765_760


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_zero_2_and_3_come_from_deepspeeds_estimators(ranks):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for stage, offload in ((2, False), (2, True), (3, False)):
        got = M.learner_memory(QWEN3_8B, zero_stage=stage, num_ranks=ranks, dtype="bfloat16", micro_tokens=1,
                               gradient_checkpointing=True, logits_chunk=1, offload_optimizer=offload)
        if stage == 2:
            want = estimate_zero2_model_states_mem_needs(P_8B, num_gpus_per_node=ranks, cpu_offload=offload)[1]
        else:
            want = estimate_zero3_model_states_mem_needs(P_8B, 151_936 * 4096, num_gpus_per_node=ranks,
                                                         cpu_offload=False, cpu_offload_params=False)[1]
        assert got["model_states"] * GIB == pytest.approx(want, abs=1)
        # our own per-parameter table says the same (ZeRO-3 adds the gathered largest layer, 4 bytes each)
        table = M.bytes_per_param(stage, ranks, bf16=True, offload=offload) * P_8B
        assert table + (4 * 151_936 * 4096 if stage == 3 else 0) == pytest.approx(want, rel=1e-6)


def test_zero_0_and_fp32_use_the_per_parameter_accounting():
    assert M.bytes_per_param(0, 4, bf16=True) == 20  # 2 bf16 w + 2 bf16 g + 4 master + 4 fp32 g + 8 Adam
    assert M.bytes_per_param(1, 4, bf16=True) == 4 + 16 / 4
    assert M.bytes_per_param(0, 1, bf16=False) == 16  # 4 w + 4 g + 8 Adam
    assert M.bytes_per_param(2, 2, bf16=False) == 4 + 16 / 2


def test_tiny_learner_by_hand():
    # fp32 ZeRO-0, one micro-batch of 8 x (64 + 48) = 896 tokens, chunk 1024 -> 896
    parts = M.learner_memory(TINY, zero_stage=0, num_ranks=1, dtype="float32", micro_tokens=896,
                             gradient_checkpointing=False, logits_chunk=1024, on_gpu=False)
    assert parts["model_states"] * GIB == 16 * 459_520
    # 3*128 + 3*128 + 3*64 + 4*384 = 2,496 elements per token per layer
    assert parts["activations"] * GIB == 2 * 2_496 * 896 * 4
    assert parts["activations_if_checkpointing_flipped"] * GIB == (2 * 128 + 2_496) * 896 * 4
    # a [896, 512] logits slice (fp32) + two fp32 buffers, and the hidden states with their fp32 copy
    assert parts["logits_chunk"] * GIB == 896 * 512 * (4 + 8) + 896 * 128 * (4 + 4)
    assert parts["deepspeed_buffers"] == 0
    assert parts["total"] == pytest.approx(sum(parts[k] for k in ("model_states", "activations", "logits_chunk",
                                                                  "deepspeed_buffers", "runtime")))


def test_rollout_kv_budget_for_qwen3_8b_by_hand():
    parts = M.rollout_memory(QWEN3_8B, dtype="bfloat16", tp=1, device_gib=80.0, utilization=0.6, kv_cache_gb=1.0,
                             max_model_len=21504, enforce_eager=True)
    weights = P_8B * 2 / GIB
    profile = (16384 * (3 * 4096 + 2 * 12288) * 2 + 256 * 151_936 * 4 * 2) / GIB
    kv = 0.6 * 80 - weights - profile - 1.0
    assert parts["kv_cache"] == pytest.approx(kv)
    assert parts["kv_tokens"] == pytest.approx(kv * GIB / 147_456)
    assert round(parts["kv_tokens"]) == 220_847
    assert parts["kv_sequences"] == pytest.approx(parts["kv_tokens"] / 21504)
    half = M.rollout_memory(QWEN3_8B, dtype="bfloat16", tp=2, device_gib=80.0, utilization=0.6, kv_cache_gb=1.0,
                            max_model_len=21504, enforce_eager=True)
    assert half["weights"] == pytest.approx(weights / 2)


def test_shapes_table_answers_with_or_without_the_base_suffix():
    assert known_shape("Qwen/Qwen3-8B") == known_shape("Qwen/Qwen3-8B-Base") == QWEN3_8B
    assert known_shape("Qwen/Qwen3-8B-Base") is not QWEN3_SHAPES["Qwen/Qwen3-8B-Base"]  # a copy
    assert known_shape("meta/unknown") is None


def test_plan_of_the_8b_experiment_fits_and_the_14b_on_one_gpu_is_refused(run_cli, tmp_path):
    ok = run_cli("plan", "experiment=stapo_qwen3_8b", home=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "plan fits" in ok.stdout and "49.58 GiB" in ok.stdout and "KV cache" in ok.stdout
    bad = run_cli("plan", "experiment=stapo_qwen3_14b", "learner.num_ranks=1", "learner.zero_stage=0", home=tmp_path)
    assert bad.returncode == 2
    err = bad.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: plan: the learner needs 287.4 GiB per GPU"), bad.stderr
    assert "learner.zero_stage=" in err[0] and "Traceback" not in bad.stdout + bad.stderr
    js = run_cli("plan", "--json", "experiment=stapo_qwen3_14b", "learner.num_ranks=1", "learner.zero_stage=0",
                 home=tmp_path)
    data = json.loads(js.stdout)
    assert js.returncode == 2 and data["fits"] is False and data["params"] == 14_768_307_200
    assert {r["role"] for r in data["roles"]} == {"learner", "rollout"}


@pytest.mark.parametrize("verb", [("train", "--cfg", "job"), ("submit", "--dry-run"), ("sweep", "tau_p", "--dry-run")])
def test_train_submit_and_sweep_refuse_a_plan_that_cannot_fit(run_cli, tmp_path, verb):
    res = run_cli(*verb, "experiment=stapo_qwen3_14b", "learner.num_ranks=1", "learner.zero_stage=0", home=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: plan: the learner needs 287.4 GiB per GPU")


def test_enforce_false_warns_and_goes_on(run_cli, tmp_path):
    res = run_cli("train", "--cfg", "job", "experiment=stapo_qwen3_14b", "learner.num_ranks=1",
                  "learner.zero_stage=0", "plan.enforce=false", home=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "does not fit: the learner needs 287.4 GiB" in res.stdout


def test_disk_and_host_memory_are_planned_here(run_cli, tmp_path):
    disk = run_cli("plan", "trainer.total_steps=10000000", "trainer.save_freq=1", home=tmp_path)
    assert disk.returncode == 2 and "trainer.keep_checkpoints" in disk.stderr, disk.stderr
    kept = run_cli("plan", "trainer.total_steps=10000000", "trainer.save_freq=1", "trainer.keep_checkpoints=2",
                   home=tmp_path)
    assert kept.returncode == 0, kept.stderr
    assert "checkpoints: 3 ×" in kept.stdout  # the K kept and the newer one being verified
    host = run_cli("plan", "rollout.kv_cache_gb=100000", home=tmp_path)
    assert host.returncode == 2 and "rollout.kv_cache_gb" in host.stderr


def test_a_model_whose_shape_is_nowhere_is_one_line(run_cli, tmp_path):
    res = run_cli("plan", "model.path=SomeOrg/NotAModel-7B", home=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "cannot size model.path=SomeOrg/NotAModel-7B" in res.stderr


def test_the_token_budget_bounds_the_planned_micro_batch():
    from stapoctl.config.compose import compose_config
    from stapoctl.preflight.memory_plan import _micro_tokens

    rows = compose_config(["learner.micro_batch_size=8"])  # 8 rows x (64 + 48)
    assert _micro_tokens(rows) == 8 * 112
    budget = compose_config(["learner.micro_batch_size=8", "learner.max_tokens_per_micro_batch=300"])
    assert _micro_tokens(budget) == 300
    # a row longer than the budget still runs, alone
    alone = compose_config(["learner.micro_batch_size=8", "learner.max_tokens_per_micro_batch=50"])
    assert _micro_tokens(alone) == 112


def _tiny_llama():
    """A Llama shape the Qwen3 formula gets wrong: attention and MLP biases, no q/k norms, an
    untied head, head_dim = hidden / heads."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=300, max_position_embeddings=128,
                       tie_word_embeddings=False, attention_bias=True, mlp_bias=True)


def _materialised_count(cfg) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)  # real tensors on the CPU
    assert next(model.parameters()).device.type == "cpu"
    return sum(p.numel() for p in model.parameters())


def test_a_llama_is_counted_exactly_and_a_qwen3_by_the_formula_without_torch():
    from stapoctl.preflight.model_shape import parameter_count

    cfg = _tiny_llama()
    real = _materialised_count(cfg)
    # by hand: per layer q,o 64*64 + k,v 64*32 and their biases 64+32+32+64 = 12,480; MLP 3*64*176 and
    # its biases 176+176+64 = 34,208; 2 norms of 64: 46,816; x3 + embedding and head 2 * 300*64 + final norm 64
    assert real == 3 * 46_816 + 2 * 300 * 64 + 64 == 178_912
    assert parameter_count(cfg.to_dict()) == real
    assert decoder_params(cfg.to_dict()) != real  # the Qwen3 formula alone was wrong for it
    code = ("import sys; from stapoctl.config.shapes import QWEN3_SHAPES; "
            "from stapoctl.preflight.model_shape import parameter_count; "
            "print(parameter_count(QWEN3_SHAPES['Qwen/Qwen3-8B-Base'])); assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and int(out.stdout) == P_8B, out.stderr[-2000:]


def test_plan_of_a_local_llama_config_counts_its_parameters_exactly(run_cli, tmp_path):
    cfg = _tiny_llama()
    model_dir = tmp_path / "llama"
    cfg.save_pretrained(model_dir)  # config.json only, as a download of the config alone leaves it
    res = run_cli("plan", "--json", f"model={model_dir}", home=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    plan = json.loads(res.stdout)
    assert plan["params"] == _materialised_count(cfg) == 178_912
    assert plan["shape_source"] == str(model_dir / "config.json")
    weights = next(r for r in plan["roles"] if r["role"] == "rollout")["parts"]["weights"]
    assert weights * GIB == pytest.approx(178_912 * 4)  # fp32 weights of that count


def test_an_architecture_transformers_cannot_build_is_one_line(run_cli, tmp_path):
    model_dir = tmp_path / "odd"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**TINY, "model_type": "no_such_arch"}))
    res = run_cli("plan", f"model.path={model_dir}", home=tmp_path)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "cannot build model_type='no_such_arch'" in err[0] and "model.path=" in err[0]


def test_a_zero3_plan_counts_the_logits_of_the_response_positions_only():
    from stapoctl.config.compose import compose_config
    from stapoctl.preflight.memory_plan import build_plan

    def logits_part(stage: int) -> float:
        conf = compose_config([f"learner.zero_stage={stage}", "learner.micro_batch_size=8"])  # 8 x (64 + 48)
        assert conf.model.dtype == "float32" and conf.model.tiny.vocab_size == 512
        return build_plan(conf).role("learner").parts["logits_chunk"] * GIB

    # ZeRO-3's forward adds the module's logits and their gradient (fp32, V = 512) of the 48 + 1 positions
    # `logits_to_keep` leaves per row, not of all 112 (learner/forward.py)
    assert logits_part(3) - logits_part(2) == pytest.approx(2 * 8 * 49 * 512 * 4)
