"""A vLLM engine as a Ray actor: sampling for rollouts and evaluation, and the receiving end
of the learner's weight sync.

The engine lives for the whole run (its start-up and first-shape warm-up cost ~10-90 s on
CPU), and a training step costs one call per stage: `rollout` returns a padded
`RolloutBatch` (tensors through the object store), `update_weights` takes the learner's
named tensors and loads them in place.

A training run's actors restart when their process dies (`rollout.max_restarts`). A restarted
actor holds the model it was built from, not the learner's current weights, so until the
driver pushes them it refuses to sample (`StaleWeightsError`) instead of silently generating
with the wrong policy; the driver then waits for it, pushes, and re-sends the call.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterable, Iterator, Optional, Sequence

from stapoctl.launch.ray_runtime import actor_env, in_ray_actor, process_start, runtime_context
from stapoctl.rollout.progress import RECEIVING
from stapoctl.rollout.vllm_engine import EngineSpec, Sample
from stapoctl.sync.worker_extension import EXTENSION_CLS


class StaleWeightsError(RuntimeError):
    """This actor was restarted and has not received the learner's weights yet."""


class RolloutWorker:
    """Owns one `vllm.LLM`. Methods run one at a time (a Ray actor), so no locking.

    `synced`: the driver keeps this engine on the learner's weights (training); a restart of
    such an actor needs them again before it may sample.
    """

    def __init__(self, spec: EngineSpec, synced: bool = False, progress: Optional[tuple] = None):
        from stapoctl.launch.import_gc import skip_unused_imports
        from stapoctl.rollout import vllm_engine
        from stapoctl.rollout.progress import Heartbeat

        # (board, index): this worker's phases and engine steps, for the driver's stall bound (rollout/progress.py)
        self.heartbeat = Heartbeat(*progress) if progress is not None else None
        self._phase("starting: importing vLLM")

        t0 = time.perf_counter()
        marks = {"spawned": process_start(), "constructor": time.time()}
        if in_ray_actor():
            skip_unused_imports()
        if spec.worker_extension_cls is None:
            spec.worker_extension_cls = EXTENSION_CLS
        if spec.num_threads > 0:
            # the in-process CPU engine computes with this process's torch threads; vLLM disables
            # torch.set_num_threads once it is up, so set them before
            import torch

            torch.set_num_threads(int(spec.num_threads))
        self.spec = spec
        self.restarted = _was_restarted()
        self.needs_weights = bool(synced and self.restarted)
        vllm_engine.import_vllm(spec)
        marks["vllm_imported"] = time.time()
        self._phase("starting: building the vLLM engine")
        self.llm = vllm_engine.make_llm(spec)
        self.tokenizer = self.llm.get_tokenizer()
        marks["engine_built"] = time.time()
        if self.heartbeat is not None:
            self.heartbeat.watch(self.llm)
        self._phase("idle")
        self.init_seconds = time.perf_counter() - t0
        self.startup = marks  # epoch seconds of each start-up phase's end (`info`, the driver's phase table)
        self.weight_version = 0

    def info(self) -> dict[str, Any]:
        """Start-up facts the driver logs (and a cheap call to wait on the actor being up)."""
        return {
            "model_path": self.spec.model_path,
            "init_s": self.init_seconds,
            "pid": os.getpid(),
            "node_id": _node_id(),
            "weight_version": self.weight_version,
            "restarted": self.restarted,
            "needs_weights": self.needs_weights,
            "eos_token_id": self.tokenizer.eos_token_id,
            "pad_token_id": self.tokenizer.pad_token_id,
            "startup": dict(self.startup),
        }

    def kv_cache_gib(self) -> float:
        """The KV cache this engine allocated, GiB (`stapoctl doctor` holds it against the run's figure)."""
        from stapoctl.rollout import vllm_engine

        return vllm_engine.kv_cache_gib(self.llm)

    def _phase(self, name: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.phase(name)

    @contextlib.contextmanager
    def _doing(self, name: str) -> Iterator[None]:
        self._phase(name)
        try:
            yield
        finally:
            self._phase("idle")

    def _check_weights(self) -> None:
        if self.needs_weights:
            raise StaleWeightsError(f"rollout actor (pid {os.getpid()}) restarted and holds the base model, "
                                    "not the learner's weights: push them before sampling")

    # -- sampling ---------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 64,
        seed: Optional[int | Sequence[int]] = None,
    ) -> list[list[Sample]]:
        """Per prompt, its n samples (token ids, sampled-token log-probs, text, finish reason)."""
        from stapoctl.rollout import vllm_engine

        self._check_weights()
        with self._doing("generating"):
            return vllm_engine.generate(
                self.llm, prompts, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed
            )

    def rollout(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: Optional[int | Sequence[int]],
        pad_id: int,
        group_offset: int = 0,
        prompt_index: Optional[Sequence[int]] = None,
    ):
        """Sample and pack into a `RolloutBatch` here, so only tensors and texts travel back."""
        from stapoctl.rollout.batch import RolloutBatch

        t0 = time.perf_counter()
        per_prompt = self.generate(
            prompt_token_ids, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed
        )
        gen_s = time.perf_counter() - t0
        batch = RolloutBatch.from_token_lists(
            prompt_token_ids,
            [[s.token_ids for s in samples] for samples in per_prompt],
            [[s.logprobs for s in samples] for samples in per_prompt],
            [[s.finish_reason == "length" for s in samples] for samples in per_prompt],
            [[s.text for s in samples] for samples in per_prompt],
            pad_id=pad_id,
            group_offset=group_offset,
            prompt_index=prompt_index,
        )
        return batch, {"gen_s": gen_s, "tokens": float(batch.num_response_tokens())}

    def score_logprobs(self, token_ids_list: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """vLLM's log-probs of given (prompt, response) token sequences (no sampling)."""
        from stapoctl.rollout import vllm_engine

        self._check_weights()
        with self._doing("scoring"):
            return vllm_engine.score_logprobs(self.llm, token_ids_list)

    def score_batch(self, batch) -> "Any":
        """`score_logprobs` for a RolloutBatch's rows, as a [N, R] tensor aligned with it (0 on padding)."""
        import torch

        pairs = []
        for k in range(len(batch)):
            prompt = batch.prompt_ids[k][batch.prompt_mask[k]].tolist()
            response = batch.response_ids[k][batch.response_mask[k]].tolist()
            pairs.append((prompt, response))
        scored = self.score_logprobs(pairs)
        out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
        for k, lps in enumerate(scored):
            if lps:
                out[k, : len(lps)] = torch.as_tensor(lps, dtype=torch.float32)
        return out

    # -- weight sync --------------------------------------------------------------------
    def update_weights(self, named_tensors: Any) -> dict[str, float]:
        """The object-store transport: load the learner's weights in place, then drop cached KV
        computed with the old ones. `named_tensors`: a dict or iterable of (name, tensor) or of
        (name, raw bytes, dtype, shape), read in place from Ray's object store."""
        with self._doing(RECEIVING):
            from stapoctl.sync.worker_extension import pack_for_rpc, unpack

            t0 = time.perf_counter()
            items: Iterable = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
            payload = [unpack(item) for item in items]
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0" or self.spec.tensor_parallel_size > 1:
                payload = pack_for_rpc(payload)  # the engine core or its workers are other processes
            count = self.llm.collective_rpc("stapo_load_weights", args=(payload,))[0]
            self._after_update()
            return {"sync_load_s": time.perf_counter() - t0, "tensors": float(count)}

    def receive_weights(self, update_info: dict) -> dict[str, float]:
        """A linked transport's whole update in one actor call: vLLM's start (the layerwise reload
        begins: the model is half-loaded until finish), the receive (every worker process joins
        the learner's broadcast), finish. As one call it cannot be interleaved with a rollout."""
        with self._doing(RECEIVING):
            t0 = time.perf_counter()
            self.llm.collective_rpc("start_weight_update")
            delay = float(os.environ.get("STAPOCTL_TEST_SYNC_DELAY_S") or 0)
            if delay > 0:
                time.sleep(delay)
            self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})
            self.llm.collective_rpc("finish_weight_update")
            self._after_update()
            return {"sync_load_s": time.perf_counter() - t0, "tensors": float(len(update_info.get("names", [])))}

    def _after_update(self) -> None:
        self.llm.reset_prefix_cache()
        self.weight_version += 1
        self.needs_weights = False
        if os.environ.get("STAPOCTL_TEST_CORRUPT_PUSH"):
            self._test_corruption(os.environ["STAPOCTL_TEST_CORRUPT_PUSH"])

    def _test_corruption(self, path: str) -> None:
        """Test hook (tests/test_weight_sync_faults.py): once `PATH.arm` exists, the first actor to
        load a push claims PATH (its pid written there) and adds noise of 1e-2 × the std of the
        embedding (tied with the head: every token passes through it) to what it just loaded."""
        if not os.path.exists(path + ".arm"):
            return
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        self.llm.collective_rpc("stapo_test_perturb_embedding", args=(1e-2,))

    def transfer_ranks(self) -> list[int]:
        """Each of this engine's worker processes' rank in the linked transport's group."""
        return [int(r) for r in self.llm.collective_rpc("stapo_transfer_rank")]

    def weight_checksum(self) -> float:
        return float(self.llm.collective_rpc("stapo_weight_checksum")[0])

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Join a linked transport's group (this actor's rank offset is in `init_info`)."""
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    # CUDA IPC (untested here): the learner drives these itself, in a push the driver waits for.
    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weight_chunk(self, update_info: Any) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self) -> None:
        self.llm.collective_rpc("finish_weight_update")
        self._after_update()

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")

    def update_weight_version(self, version: str) -> None:
        self.weight_version = int(version) if str(version).isdigit() else self.weight_version

    def shutdown(self) -> None:
        """Stop the engine before the actor dies (a multiprocess engine's /dev/shm segments would
        otherwise outlive Ray); every caller kills the actor right after.

        vLLM's shutdown unfreezes the heap and runs two full `gc.collect()`s over the ~1.2M
        objects of torch, transformers and vLLM: 1.2 s of a run's exit here, to free memory the
        process hands back by exiting a moment later. They are skipped for that one call.
        """
        from stapoctl.rollout import vllm_engine

        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            with _without_full_collections():
                vllm_engine.shutdown(llm)
            del llm


@contextlib.contextmanager
def _without_full_collections() -> Iterator[None]:
    import gc

    collect, unfreeze = gc.collect, gc.unfreeze
    gc.collect, gc.unfreeze = (lambda *args, **kwargs: 0), (lambda: None)
    try:
        yield
    finally:
        gc.collect, gc.unfreeze = collect, unfreeze


def _node_id() -> str:
    ctx = runtime_context()  # None: not inside Ray (a test constructing the worker directly)
    return ctx.get_node_id() if ctx is not None else ""


def _was_restarted() -> bool:
    """True in an actor Ray brought back after its process died (False outside Ray)."""
    ctx = runtime_context()
    return bool(ctx is not None and ctx.was_current_actor_reconstructed)


def rollout_env(spec: EngineSpec, on_gpu: bool = False, cores: Optional[Sequence[int]] = None) -> dict[str, str]:
    """Per-actor environment: vLLM in-process on CPU (4 s start, tensors passed directly).

    `on_gpu`: the actor is given GPUs. That, not the driver's own torch.cuda, decides: the actor
    may run on another node, and asking torch here cost the driver ~1 s of `import torch`
    between `ray.init` and the actors' creation. On a GPU the CUDA IPC transport's handles must
    cross vLLM's msgpack hop from `LLM` to its workers, which needs insecure serialisation (as
    vLLM's own examples/rl/rlhf_ipc.py sets it). `cores`: the CPU cores vLLM-CPU's tensor-parallel
    workers split (default: this process's)."""
    extra = {"VLLM_LOGGING_LEVEL": "WARNING"}
    if on_gpu and spec.weight_transfer_backend == "ipc":
        extra["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if not on_gpu and int(spec.tensor_parallel_size) > 1:
        extra["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(int(spec.tensor_parallel_size), cores)
    if not on_gpu:
        extra["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if spec.enforce_eager:
            # Even in eager mode vLLM torch.compiles one helper (the sampled tokens' ranks, which
            # the rollout never reads) at the first call that asks for log-probs: 1.5-1.9 s of the
            # first rollout here, for an op that runs as fast eagerly. Same samples bit for bit
            # (`python benchmarks/_vllm_modes.py --modes eager,eager-dynamo`: 0.09 vs 1.96 s).
            extra["TORCHDYNAMO_DISABLE"] = "1"
        if spec.num_threads > 0:
            extra["OMP_NUM_THREADS"] = str(int(spec.num_threads))
    return actor_env(extra)


def cpu_thread_binding(tp_size: int, cores: Optional[Sequence[int]] = None) -> str:
    """vLLM-CPU's `VLLM_CPU_OMP_THREADS_BIND` for TP ranks: the cores split into tp_size contiguous
    groups ("0|1" on 2 cores). Without it vLLM-CPU refuses TP > 1 on one NUMA node ("Not enough
    allowed NUMA nodes"). A value set in the environment wins."""
    from stapoctl.errors import UserError

    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    per = len(cores) // tp_size
    if per < 1:
        raise UserError(f"rollout.tensor_parallel_size={tp_size} needs a CPU core per tensor-parallel rank and "
                        f"this machine has {len(cores)}: lower rollout.tensor_parallel_size to {len(cores)} or less")
    groups = [cores[k * per:(k + 1) * per] for k in range(tp_size)]
    return "|".join(f"{g[0]}-{g[-1]}" if g == list(range(g[0], g[-1] + 1)) and len(g) > 1 else ",".join(map(str, g))
                    for g in groups)


def make_rollout_worker(
    engine_spec: EngineSpec,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    *,
    options: Optional[dict[str, Any]] = None,
    name: Optional[str] = None,
    synced: bool = False,
    max_restarts: int = 0,
    env_extra: Optional[dict[str, str]] = None,
    on_gpu: Optional[bool] = None,
    progress: Optional[tuple] = None,
):
    """Start a RolloutWorker actor with these resources; returns its handle (engine still loading).

    `options`: extra Ray actor options, e.g. the placement-group scheduling strategy of its bundle.
    `synced` / `max_restarts`: a training actor, restarted by Ray up to max_restarts times
    (-1: always) after its process dies. `on_gpu`: whether vLLM runs on GPUs (default: the actor
    asks for some; a colocated TP > 1 actor asks none itself, its vLLM Ray workers do). Calls are not retried by Ray (`max_task_retries=0`):
    the driver re-sends them once the actor has the current weights again.
    """
    import ray

    env = rollout_env(engine_spec, on_gpu=float(num_gpus or 0) > 0 if on_gpu is None else bool(on_gpu))
    env.update(env_extra or {})
    opts: dict[str, Any] = dict(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        runtime_env={"env_vars": env},
        max_concurrency=1,
        max_restarts=int(max_restarts),
        max_task_retries=0,
    )
    if name:
        opts["name"] = name
    opts.update(options or {})
    actor_cls = ray.remote(RolloutWorker)
    return actor_cls.options(**opts).remote(engine_spec, synced, progress)
