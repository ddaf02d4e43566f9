"""The weight path's contracts with vLLM, on CPU, against vLLM's own classes.

CI runs the gloo transport end to end; NCCL and CUDA IPC need GPUs. What each of them sends at link
time and at each push is still built here by stapoctl's own code path (`Transport.trainer`'s
`build`, the client's per-actor payloads, `CollectiveTrainer.update_info` over a real model's
weight source) and parsed by the worker engine class vLLM registers under the transport's
`vllm_backend` (`WeightTransferEngineFactory._registry`), through vLLM's own `parse_init_info` /
`parse_update_info`. What is replaced, and only that: Ray's delivery of a call (a recording actor
handle), the data-plane endpoint a GPU would open (PyNccl / the TCPStore the workers would join), and
the two CUDA device queries vLLM's IPC trainer makes in its constructor. CUDA IPC's update payload is
built by vLLM's CUDA-only trainer from IPC handles: `stapoctl bench gpu_kit` checks it on a GPU.

A transport registered with a `vllm_backend` and no entry in `BUILDERS` fails here: a new transport
must show its payloads to vLLM before it lands.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from stapoctl.sync.transports import TRANSPORTS

LINKED = sorted(n for n, t in TRANSPORTS.items() if t.vllm_backend)


class RecordingHandle:
    """A rollout actor handle whose `.remote` calls are recorded (Ray's delivery replaced)."""

    def __init__(self):
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, method):
        calls = self.calls

        class _M:
            @staticmethod
            def remote(*args, **kwargs):
                calls.append((method, args, kwargs))
                return None

        return _M()


@pytest.fixture(scope="module")
def tiny_module():
    """A real tiny Qwen3 (tied embeddings, so the state dict holds `lm_head.weight` as an alias)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, max_position_embeddings=64)
    return Qwen3ForCausalLM(cfg).eval()


def _link(module, workers: int, tp: int):
    from stapoctl.sync.trainer_engines import TrainerLink

    handles = [RecordingHandle() for _ in range(workers)]
    return handles, TrainerLink(module_of=lambda: module, zero_stage=0, rollout_handles=handles, rank=0,
                                master_address="10.0.0.7", master_port=29511, tp_size=tp, timeout_s=45.0)


LISTENED = 29600  # the port the link's store would have been given by the OS (`listen`)


def _no_endpoint(monkeypatch, cls):
    from stapoctl.sync.trainer_engines import CollectiveTrainer

    monkeypatch.setattr(cls, "open_endpoint", lambda self, info: None)  # the GPU's / TCPStore's side
    if issubclass(cls, CollectiveTrainer):  # its store binds first: the workers get its port
        monkeypatch.setattr(cls, "listen", lambda self, info: dataclasses.replace(info, master_port=LISTENED))


def _cuda_queries(monkeypatch):
    """vLLM's IPC trainer asks for the current device and its UUID in its constructor."""
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="GPU-test-uuid"))


def _build(name, monkeypatch, module, workers, tp):
    import ray

    from stapoctl.sync import trainer_engines as te

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    if name in ("gloo", "nccl"):
        _no_endpoint(monkeypatch, te.GlooTrainer if name == "gloo" else te.NCCLTrainer)
    if name == "ipc":
        _cuda_queries(monkeypatch)
    handles, link = _link(module, workers, tp)
    engine = te.build_trainer_engine(name, link)
    return handles, engine


BUILDERS = {"gloo": _build, "nccl": _build, "ipc": _build}


def vllm_engine_class(backend: str):
    """The worker engine vLLM's factory builds for `backend` (its registry has no public getter)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from stapoctl.sync.worker_extension import register_transports

    register_transports()  # stapo_gloo, as every vLLM worker process registers it

    assert backend in WeightTransferEngineFactory._registry, f"vLLM has no weight-transfer engine {backend!r}"
    return WeightTransferEngineFactory._registry[backend]()


def vllm_parses(cls, kind: str, payload: dict):
    """vLLM's own `parse_init_info` / `parse_update_info` on a bare instance (no engine needed)."""
    bare = object.__new__(cls)
    return getattr(bare, f"parse_{kind}_info")(payload)


@pytest.mark.parametrize("name", LINKED)
@pytest.mark.parametrize("workers,tp", [(1, 1), (2, 2), (4, 1)])
def test_every_init_payload_is_accepted_by_vllms_worker_engine(name, workers, tp, monkeypatch, tiny_module):
    assert name in BUILDERS, f"transport {name!r} has a vllm_backend but no contract builder here"
    handles, _ = BUILDERS[name](name, monkeypatch, tiny_module, workers, tp)
    cls = vllm_engine_class(TRANSPORTS[name].vllm_backend)
    payloads = [args[0] for h in handles for (m, args, _) in h.calls if m == "init_weight_transfer_engine"]
    assert len(payloads) == workers  # one init call per rollout actor
    parsed = [vllm_parses(cls, "init", p) for p in payloads]
    if TRANSPORTS[name].rendezvous:
        assert [p.rank_offset for p in parsed] == [1 + i * tp for i in range(workers)]
        assert {p.world_size for p in parsed} == {1 + workers * tp}
        # gloo and NCCL: the port their store listens on (bound before the workers are told, #49 R4)
        assert {(p.master_address, p.master_port) for p in parsed} == {("10.0.0.7", LISTENED)}
    else:
        assert all("rank_offset" not in p for p in payloads)


def test_vllms_classes_refuse_what_the_old_payloads_sent():
    """The two failures the contract guards: IPC given a rank offset, NCCL given a timeout."""
    ipc, nccl = vllm_engine_class("ipc"), vllm_engine_class("nccl")
    with pytest.raises(ValueError, match="unexpected keyword argument 'rank_offset'"):
        vllm_parses(ipc, "init", {"packed": False, "rank_offset": 1})
    with pytest.raises(ValueError, match="unexpected keyword argument 'timeout_s'"):
        vllm_parses(nccl, "init", {"master_address": "h", "master_port": 1, "world_size": 2, "rank_offset": 1,
                                   "packed": False, "timeout_s": 60.0})


def test_ipc_is_packed_with_a_buffer_that_holds_the_largest_tensor(monkeypatch, tiny_module):
    """Unpacked, vLLM's IPC trainer keeps every tensor it yielded until the push ends (the whole
    gathered model under ZeRO-3); packed, one buffer, which vLLM refuses to fill with a tensor larger
    than itself (its default 1 GiB < Qwen3-8B's 1.24 GB embedding)."""
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

    from stapoctl.sync.trainer_engines import ipc_buffer_bytes

    handles, engine = _build("ipc", monkeypatch, tiny_module, 2, 1)
    assert engine.packed is True and engine.packed_buffer_size_bytes == DEFAULT_PACKED_BUFFER_SIZE_BYTES
    [(_, (payload,), _)] = handles[0].calls
    assert vllm_parses(vllm_engine_class("ipc"), "init", payload).packed is True  # the worker decodes packed
    embedding_8b = 151936 * 4096 * 2
    assert ipc_buffer_bytes([10, embedding_8b, 20]) == embedding_8b
    assert ipc_buffer_bytes([10]) == DEFAULT_PACKED_BUFFER_SIZE_BYTES


@pytest.mark.parametrize("name", [n for n in LINKED if TRANSPORTS[n].push == "engine"])
def test_the_update_info_is_vllms_and_names_the_hf_state_dict(name, monkeypatch, tiny_module):
    """The per-push metadata every worker receives parses with vLLM's update class, and its names are
    the model's HF state dict in order (tied `lm_head.weight` kept), which vLLM's Qwen3 loader maps."""
    _, engine = BUILDERS[name](name, monkeypatch, tiny_module, 2, 1)
    info = engine.update_info()
    parsed = vllm_parses(vllm_engine_class(TRANSPORTS[name].vllm_backend), "update", info)
    state = tiny_module.state_dict()
    assert parsed.names == list(state) and "lm_head.weight" in parsed.names
    assert parsed.shapes == [list(t.shape) for t in state.values()]
    assert parsed.dtype_names == ["float32"] * len(state)
    with pytest.raises(ValueError, match="same size|one entry per tensor"):  # and the class checks it
        vllm_parses(vllm_engine_class(TRANSPORTS[name].vllm_backend), "update",
                    dict(info, shapes=info["shapes"][:-1]))


def test_the_transfer_rank_each_worker_engine_reports():
    """The doctor's 'transfer ranks' row reads this: gloo's engine holds `rank`, vLLM's NCCL engine
    its PyNcclCommunicator's (`model_update_group.rank`, vllm/distributed/device_communicators/
    pynccl.py), IPC none."""
    from stapoctl.sync.worker_extension import transfer_rank

    nccl = object.__new__(vllm_engine_class("nccl"))
    nccl.model_update_group = types.SimpleNamespace(rank=3)  # the communicator's field, as PyNccl sets it
    gloo = object.__new__(vllm_engine_class("stapo_gloo"))
    gloo.rank = 2
    ipc = object.__new__(vllm_engine_class("ipc"))
    assert [transfer_rank(e) for e in (nccl, gloo, ipc, None)] == [3, 2, -1, -1]
    nccl.model_update_group = None  # not linked yet
    assert transfer_rank(nccl) == -1


@pytest.mark.parametrize("method,ranks,status", [
    ("nccl", [1, 2, 3, 4], "PASS"), ("gloo", [1, 2, 3, 4], "PASS"), ("nccl", [1, 1, 3, 4], "FAIL"),
    ("nccl", [-1, -1, -1, -1], "FAIL"), ("ipc", [], "N/A"), ("object_store", [], "N/A")])
def test_the_doctors_transfer_ranks_row(method, ranks, status):
    """2 engines × TP 2: NCCL passes on its real ranks (it used to FAIL every run reading -1), IPC and
    the object store have no group."""
    from stapoctl.doctor.engine import ranks_verdict

    row = ranks_verdict(method, ranks, 2, 2)
    assert row.status == status, row
