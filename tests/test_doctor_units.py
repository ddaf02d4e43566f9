"""The doctor's multi-node and multi-rank paths through stand-ins (issue #49): the SLURM job body
joins its allocation's Ray (BUG-2, through `DoctorJob` itself), the weight-sync canary's batch is
covered by any learner rank count (BUG-3, through the learner's own row split and `canary`), and
the KV row reads vLLM's TP-summed figure in the plan's per-GPU unit (R6, through `kv_cache_gib`).
Covered elsewhere: `gpu_row` on a 16-GPU Ray layout (tests/test_doctor.py::
test_on_a_ray_cluster_the_gpus_row_counts_every_node), the sbatch node wait and head address
(tests/test_submit_cli.py::test_two_node_script_waits_for_every_node_and_never_announces_loopback)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stapoctl.config.compose import compose_config
from stapoctl.doctor import engine
from stapoctl.doctor.rows import FAIL, PASS


def test_the_slurm_doctor_job_composes_the_allocations_ray_address(monkeypatch, capsys):
    """BUG-2: `DoctorJob` of a 2-node layout runs its checks with cluster.address = the address the
    sbatch script exported, as `TrainJob` does (else launch_engines started a one-node Ray)."""
    from stapoctl.doctor import job, runner
    from stapoctl.jobs import sbatch

    seen = []
    monkeypatch.setattr(runner, "run_checks", lambda conf, *a, **k: seen.append(conf) or [])
    overrides = ["cluster=slurm", "cluster.nodes=2", "rollout.gpus_per_worker=2", "rollout.tensor_parallel_size=2",
                 "rollout.num_workers=4", "learner.gpus_per_rank=1", "learner.num_ranks=8"]
    monkeypatch.setenv(sbatch.RAY_ADDRESS_ENV, "10.1.2.3:6379")
    result = job.DoctorJob(overrides)()
    assert seen[-1].cluster.address == "10.1.2.3:6379" and seen[-1].cluster.nodes == 2
    assert result["rows"] == [] and isinstance(result["host"], str)
    monkeypatch.delenv(sbatch.RAY_ADDRESS_ENV)
    job.DoctorJob(overrides)()
    assert seen[-1].cluster.address is None  # one node: the job starts its own Ray, as before
    assert job.DoctorJob(overrides).overrides == overrides  # the submitted overrides are not changed


class _Rank:
    """A learner rank's row split (the learner's own `_my_rows`) and gather, without torch.distributed."""

    def __init__(self, rank: int, world: int):
        from stapoctl.learner.data_parallel import DataParallel

        self.rank, self.world_size = rank, world
        self.rows = DataParallel._my_rows.__get__(self)


@pytest.mark.parametrize("ranks", range(1, 9))
def test_the_canary_rows_split_over_every_rank_count(ranks, tmp_path, monkeypatch):
    """BUG-3: over 1–8 ranks the learner's slices cover the canary batch exactly once, and `canary`
    with stand-in ranks returning their gathered slices compares equal shapes (8 ranks raised
    `size of tensor a (4) must match … (0)` before)."""
    import ray
    import torch

    from stapoctl.learner.group import LearnerGroup

    batch = engine.fixed_batch(str(tmp_path), pad_id=0, ranks=ranks)
    n = len(batch)
    covered = [i for k in range(ranks) for i in range(n)[_Rank(k, ranks).rows(n)]]
    assert covered == list(range(n))

    def gathered(b, raw=False):  # every rank returns all ranks' slices (`_all_gather_rows`)
        rows = [i for k in range(ranks) for i in range(len(b))[_Rank(k, ranks).rows(len(b))]]
        return {"log_prob": torch.zeros(len(rows), b.response_mask.shape[1])}

    call = lambda f: SimpleNamespace(remote=f)  # noqa: E731
    learners = LearnerGroup([SimpleNamespace(perturb_weights=call(lambda *a, **k: None),
                                             compute_log_probs=call(gathered)) for _ in range(ranks)])
    scores = iter([torch.full(batch.response_mask.shape, 0.5), torch.zeros(batch.response_mask.shape)])
    worker = SimpleNamespace(score_batch=call(lambda b: next(scores)))
    engines = SimpleNamespace(info={"pad_token_id": 0}, learners=learners, workers=[worker],
                              push_weights=lambda: None)
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    before, after, _ = engine.canary(engines, str(tmp_path))
    assert (before, after) == (0.5, 0.0)


def _tp_engine(blocks: int, tp: int):
    """A stand-in `LLM` whose config is read as vLLM 0.32 fills it: KV heads per GPU
    (`ModelConfig.get_num_kv_heads` divides by TP), blocks per worker."""
    import torch

    model = SimpleNamespace(dtype=torch.bfloat16, get_num_layers=lambda p: 36, get_head_size=lambda: 128,
                            get_num_kv_heads=lambda p: max(1, 8 // p.tensor_parallel_size))
    cfg = SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype="auto", block_size=16,
                                                                           num_gpu_blocks=blocks),
                          parallel_config=SimpleNamespace(tensor_parallel_size=tp))
    return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=cfg))


def test_the_kv_row_at_tp2_reads_per_gpu_against_the_plans_per_gpu(monkeypatch):
    """R6: `kv_cache_gib` sums the TP ranks; the row divides by TP, so a TP-2 engine holding the plan's
    per-GPU KV passes with equal figures, and one holding 60 % of it fails (its sum, 120 %, would not)."""
    import ray

    from stapoctl.preflight.memory_plan import build_plan
    from stapoctl.rollout.vllm_engine import kv_cache_gib

    conf = compose_config(["model=Qwen/Qwen3-8B-Base", "rollout.gpus_per_worker=2", "rollout.tensor_parallel_size=2",
                           "rollout.num_workers=1", "learner.gpus_per_rank=1", "learner.num_ranks=2"])
    expected = build_plan(conf).role("rollout").kv_cache_gib  # GiB per GPU
    per_token_gpu = 2 * 36 * 4 * 128 * 2  # K and V × layers × KV heads per GPU × head dim × bf16
    full = int(expected * 2**30 / (16 * per_token_gpu))
    monkeypatch.setattr(ray, "get", lambda ref: ref)

    def row(blocks: int):
        llm = _tp_engine(blocks, tp=2)
        engines = SimpleNamespace(workers=[SimpleNamespace(kv_cache_gib=SimpleNamespace(
            remote=lambda: kv_cache_gib(llm)))])
        return engine._kv(conf, engines), kv_cache_gib(llm)

    ok, summed = row(full)
    assert summed == pytest.approx(2 * expected, rel=1e-3)  # vLLM's figure: both ranks
    assert ok.status == PASS, ok.detail
    assert f"vLLM allocated {expected:.3g} GiB of KV cache per rank (TP 2" in ok.detail
    assert f"expected {expected:.3g} GiB (the memory plan)" in ok.detail
    short, summed = row(int(full * 0.6))
    assert summed > 0.9 * expected and short.status == FAIL, short.detail
