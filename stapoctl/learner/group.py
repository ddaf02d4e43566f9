"""The learner ranks as the driver sees them: one `LearnerGroup`, one typed method per call of
the actor API (`deepspeed_learner.Learner`), each fanned out to every rank.

Every rank must receive every call (their collectives pair up: a call sent to rank 0 alone waits
for the others forever), so the driver never calls one rank's handle itself. A method waits and
returns rank 0's answer (the ranks gather theirs); a `*_async` method returns the ranks' Ray refs
where the caller overlaps other work or bounds the wait itself (`trainer/engines.py`: the set-up
under `StallWatch`, the shutdown's grace). The group is also the sequence of its rank handles:
the weight sync (`sync/transfer.py`, a layer below this one) pairs each of its refs with the rank
that made it, and a failure line names a rank by its actor id (`rank_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:
    from ray import ObjectRef

    from stapoctl.learner.step_result import StepResult


class LearnerGroup(Sequence):
    """The rank handles, rank 0 first; a plain sequence of them (`len`, indexing, iteration)."""

    def __init__(self, handles: Sequence[Any] = (), asked: tuple[float, float] = (0.0, 0.0)):
        self.handles = list(handles)
        self.asked = asked  # (CPUs, GPUs) each rank asked Ray for: what an unscheduled rank's line names

    def __getitem__(self, i):
        return self.handles[i]

    def __len__(self) -> int:
        return len(self.handles)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.handles)

    def __repr__(self) -> str:
        return f"LearnerGroup({len(self.handles)} rank(s))"

    # -- start ------------------------------------------------------------------------------
    @classmethod
    def start(cls, model_path: str, learner: dict, loss: dict, *, placement: Any = None, wait: bool = True,
              start_timeout_s: float = 600.0, **run: Any) -> tuple["LearnerGroup", list["ObjectRef"]]:
        """Start learner.num_ranks actors, wire their rendezvous, start DeepSpeed on each.

        Returns (group, set-up refs); with wait=False the caller overlaps the DeepSpeed start-up
        with other work (vLLM's) and waits on the refs itself. The rendezvous address is waited
        for at most `start_timeout_s`. `run`: the rest of `Learner.setup`'s keywords
        (`trainer/engine_settings.learner_args`)."""
        import ray

        from stapoctl.learner.engine_setup import process_group_timeout_s

        group = cls.spawn(learner, placement)
        addr, port = group.rendezvous(process_group_timeout_s(learner), start_timeout_s)
        refs = group.setup_async(model_path, learner, loss, master_addr=addr, master_port=port, **run)
        if wait:
            ray.get(refs)
        return group, refs

    @classmethod
    def spawn(cls, learner: dict, placement: Any = None) -> "LearnerGroup":
        """The rank actors, created (one GPU each on GPU, gloo on CPU) and not yet set up."""
        import ray

        from stapoctl.learner.deepspeed_learner import Learner, learner_env, num_ranks

        use_cuda = float(learner.get("gpus_per_rank") or 0) > 0
        world = num_ranks(learner)
        actor_cls = ray.remote(Learner)
        handles = []
        for rank in range(world):
            opts: dict[str, Any] = dict(
                num_cpus=float(learner.get("cpus") or 1),
                num_gpus=float(learner.get("gpus_per_rank") or 0) if use_cuda else 0.0,
                runtime_env={"env_vars": learner_env(use_cuda)},
            )
            if placement is not None:
                opts.update(placement.learner_options(rank))
            handles.append(actor_cls.options(**opts).remote(rank, world))
        return cls(handles, asked=(float(opts.get("num_cpus", 0)), float(opts.get("num_gpus", 0))))

    def rendezvous(self, pg_timeout_s: float, start_timeout_s: float) -> tuple[str, int]:
        """Rank 0's address and the port of a store it already listens on (no window for another
        process), waited for at most `start_timeout_s`: a rank Ray cannot schedule would otherwise
        hold the run (and `doctor`) forever. Then the ranks are killed and the line names the ask."""
        import ray

        try:
            addr, port = ray.get(self.handles[0].rendezvous.remote(pg_timeout_s), timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            from stapoctl.errors import EngineFault

            self.kill()
            cpus, gpus = self.asked
            raise EngineFault(f"learner rank 0 did not start within {start_timeout_s:.0f} s (Ray did not schedule "
                              f"it: asked {cpus:g} CPU, {gpus:g} GPU): see `ray status` for what holds the "
                              "resources") from None
        return addr, int(port)

    def setup_async(self, model_path: str, learner: dict, loss: dict, *, master_addr: str, master_port: int,
                    **run: Any) -> list["ObjectRef"]:
        """`Learner.setup` on every rank (imports, process group, DeepSpeed); each rank's refs,
        whose values are its set-up info (`setup_s`, `pid`, `node_id`, `params`, `mkl`)."""
        return [h.setup.remote(model_path, learner, loss, master_addr=master_addr, master_port=master_port, **run)
                for h in self.handles]

    # -- a run --------------------------------------------------------------------------------
    def reset(self, model_path: str, learner: dict, loss: dict, **run: Any) -> dict:
        """A fresh model, optimizer and schedule on every rank (a new sweep trial on warm engines);
        rank 0's answer. `run`: the rest of `Learner.reset`'s keywords."""
        import ray

        return ray.get([h.reset.remote(model_path, learner, loss, **run) for h in self.handles])[0]

    def train_step(self, batch: Any, global_step: int, old_logprob_source: str = "recompute", *,
                   measure: bool = True, behavior: bool = False) -> "StepResult":
        """One PPO update of the batch (`Learner.train_step`); rank 0's `StepResult`."""
        import ray

        return ray.get([h.train_step.remote(batch, global_step, old_logprob_source, measure=measure,
                                            behavior=behavior) for h in self.handles])[0]

    def compute_log_probs(self, batch: Any, raw: bool = False) -> dict:
        """The policy's log-probs of the batch's responses, gathered over ranks (rank 0's copy)."""
        import ray

        return ray.get([h.compute_log_probs.remote(batch, raw=raw) for h in self.handles])[0]

    def perturb_weights(self, scale: float, seed: int = 0, relative: bool = False) -> None:
        """Noise on every rank's weights alike (the doctor's weight-sync canary)."""
        import ray

        ray.get([h.perturb_weights.remote(scale, seed=seed, relative=relative) for h in self.handles])

    def save(self, step_dir: str, tokenizer_dir: str) -> dict:
        """A checkpoint's model and DeepSpeed state into `step_dir` (every rank writes its shard);
        a full disk raises the `OSError` the driver recognises. Rank 0's answer (`save_s`)."""
        import ray

        return ray.get([h.save.remote(step_dir, tokenizer_dir) for h in self.handles])[0]

    def load(self, step_dir: str) -> dict:
        """A checkpoint's DeepSpeed state back on every rank (`resume=`); rank 0's answer."""
        import ray

        return ray.get([h.load.remote(step_dir) for h in self.handles])[0]

    # -- faults and the end -------------------------------------------------------------------
    def rank_of(self, actor_id: Optional[str]) -> Optional[int]:
        """Which rank an actor id (an actor error's) is; None: not one of these ranks."""
        if actor_id is None:
            return None
        for rank, h in enumerate(self.handles):
            if h._actor_id.hex() == actor_id:
                return rank
        return None

    def shutdown_async(self) -> list["ObjectRef"]:
        """`Learner.shutdown` (the process group) sent to every rank; the refs of those it could be
        sent to, for the caller's bounded wait (a dead rank's send is skipped)."""
        refs = []
        for h in self.handles:
            try:
                refs.append(h.shutdown.remote())
            except Exception:
                pass
        return refs

    def kill(self) -> None:
        """Every rank's process ended now (what is already dead is skipped)."""
        import ray

        for h in self.handles:
            try:
                ray.kill(h)
            except Exception:
                pass


__all__ = ["LearnerGroup"]
