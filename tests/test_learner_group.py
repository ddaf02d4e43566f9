"""`LearnerGroup` (stapoctl/learner/group.py): the driver's only way to call the learner ranks.

Every call reaches every rank (a rank left out would hold the others in a collective) and the
caller gets rank 0's answer; no module outside the group (and the weight sync, a layer below)
calls a rank's handle itself."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from stapoctl.learner.group import LearnerGroup


class _Rank:
    """A stand-in rank handle: `h.method.remote(...)` records the call and returns (rank, method)."""

    def __init__(self, rank: int, dead: bool = False):
        self.rank, self.dead, self.calls = rank, dead, []
        self._actor_id = SimpleNamespace(hex=lambda: f"id{rank}")

    def __getattr__(self, method):
        def remote(*args, **kwargs):
            if self.dead:
                raise RuntimeError("actor is dead")
            self.calls.append((method, args, kwargs))
            return {"rank": self.rank, "method": method}

        return SimpleNamespace(remote=remote)


@pytest.fixture
def ranks(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs, **kw: refs)  # a ref is its value here
    return [_Rank(0), _Rank(1), _Rank(2)]


def test_every_call_reaches_every_rank_and_returns_rank_0s_answer(ranks):
    group = LearnerGroup(ranks)
    assert group.train_step("batch", 3, "rollout", measure=False, behavior=True) == {"rank": 0, "method": "train_step"}
    assert group.load("/ckpt") == {"rank": 0, "method": "load"}
    assert group.save("/tmp/step", "/tok")["method"] == "save"
    assert group.reset("/model", {"lr": 1}, {"name": "grpo"}, seed=4)["method"] == "reset"
    assert group.compute_log_probs("batch", raw=True)["method"] == "compute_log_probs"
    assert group.perturb_weights(0.1, seed=7, relative=True) is None
    for r in ranks:
        assert [c[0] for c in r.calls] == ["train_step", "load", "save", "reset", "compute_log_probs",
                                           "perturb_weights"]
        assert r.calls[0] == ("train_step", ("batch", 3, "rollout"), {"measure": False, "behavior": True})
        assert r.calls[3] == ("reset", ("/model", {"lr": 1}, {"name": "grpo"}), {"seed": 4})
        assert r.calls[5] == ("perturb_weights", (0.1,), {"seed": 7, "relative": True})


def test_the_async_calls_return_one_ref_per_rank_and_skip_a_dead_ranks_send(ranks):
    refs = LearnerGroup(ranks).setup_async("/model", {}, {}, master_addr="10.0.0.1", master_port=29500, seed=1)
    assert [ref["rank"] for ref in refs] == [0, 1, 2]
    assert ranks[2].calls[0][2] == {"master_addr": "10.0.0.1", "master_port": 29500, "seed": 1}
    ranks[1].dead = True
    assert [ref["rank"] for ref in LearnerGroup(ranks).shutdown_async()] == [0, 2]


def test_rank_of_names_a_rank_by_its_actor_id_and_the_group_is_its_handles(ranks):
    group = LearnerGroup(ranks)
    assert group.rank_of("id2") == 2 and group.rank_of("other") is None and group.rank_of(None) is None
    assert len(group) == 3 and list(group) == ranks and group[0] is ranks[0]


def test_a_rank_0_ray_never_schedules_is_one_line_naming_the_ask_and_the_ranks_are_killed(monkeypatch):
    import ray

    from stapoctl.errors import EngineFault

    def get(ref, timeout=None):
        raise ray.exceptions.GetTimeoutError("timed out")

    killed = []
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", killed.append)
    ranks = [_Rank(0), _Rank(1)]
    with pytest.raises(EngineFault) as exc:
        LearnerGroup(ranks, asked=(2.0, 1.0)).rendezvous(600.0, start_timeout_s=45.0)
    assert str(exc.value) == ("learner rank 0 did not start within 45 s (Ray did not schedule it: asked 2 CPU, "
                              "1 GPU): see `ray status` for what holds the resources")
    assert killed == ranks


def test_engines_hold_the_ranks_as_a_group():
    from stapoctl.trainer.engines import Engines

    engines = Engines(workers=[], learners=[_Rank(0)], sync=None, placement=None)
    assert isinstance(engines.learners, LearnerGroup)
    err = SimpleNamespace(actor_id="id0")
    assert engines.learner_rank_of(err) == 0 and engines.learner_rank_of(SimpleNamespace()) is None


def test_no_module_but_the_group_calls_a_learner_rank_itself():
    """sync/transfer.py is the documented exception: it lies below learner/ (it cannot import the group)."""
    root = Path(__file__).resolve().parents[1] / "stapoctl"
    methods = ("setup|reset|train_step|load|save|compute_log_probs|perturb_weights|send_weights|weights|"
               "init_weight_transfer|transfer_update_info|rendezvous|full_state_dict|pg_timeout_s")
    pattern = re.compile(rf"\.({methods})\.remote\(|call_learners")
    found = {str(p.relative_to(root)) for p in root.rglob("*.py") if pattern.search(p.read_text())}
    assert found == {"learner/group.py", "sync/transfer.py"}
