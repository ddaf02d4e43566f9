"""Token-budget micro-batches (`learner.max_tokens_per_micro_batch`) against fixed ones.

The cut (learner/micro_batches.py) must change how the rows are forwarded and nothing else: for
every registered loss, two optimizer steps with the budget (one mini-batch of 16 rows, two PPO epochs:
the second at moved weights) give the loss, the accumulated gradient at each step and the weights
that fixed micro-batches give (to 1e-5), with a
row longer than the budget, with the shared-prefix forward on (a prompt's responses stay together)
and off, and with 2 data-parallel ranks whose micro-batch counts differ (ZeRO-0 and ZeRO-2: the
rank with fewer runs zero-weight micro-batches, or the gradient reduction hangs). The optimizer
steps once per mini-batch whatever the number of micro-batches, and the cut is deterministic.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from test_learner import EPS, LR, WD

pytestmark = pytest.mark.engine

N, MICRO, BUDGET = 4, 4, 48
# with the shared-prefix forward a unit is a prompt's 4 rows: a budget and row cap that pack two of them
SHARED_BUDGET, SHARED_CAP = 160, 8
PROMPT_LENS = (5, 7, 6, 9)
# per prompt, its 4 responses: prompts 0 and 1 short (2 ranks: rank 0 packs its rows into 2 micro-batches,
# rank 1 needs 4); prompt 3 holds a 9 + 41 = 50-token row, over the 48-token budget on its own
RESPONSE_LENS = ((2, 3, 2, 4), (5, 3, 4, 2), (3, 12, 7, 2), (41, 2, 6, 10))


# -- the cut alone ---------------------------------------------------------------------------------
def test_token_budget_cut():
    from stapoctl.learner.micro_batches import padded_tokens, token_budget, units_of

    p = [5, 5, 5, 5, 9, 9, 9, 9]
    r = [2, 30, 3, 4, 60, 5, 6, 2]
    units = units_of([0] * 4 + [1] * 4, together=False)
    cut = token_budget(p, r, units, budget=80, max_rows=3)
    assert sorted(i for mb in cut for i in mb) == list(range(8))  # every row exactly once
    assert cut[0] == [4]  # 69 tokens: longest first; with any other row it is over 80
    for mb in cut:
        assert len(mb) <= 3
        assert padded_tokens(p, r, [mb]) <= 80 or len(mb) == 1
    assert padded_tokens(p, r, cut) < padded_tokens(p, r, [slice(0, 3), slice(3, 6), slice(6, 8)])
    assert token_budget(p, r, units, budget=80, max_rows=3) == cut  # deterministic
    assert token_budget(p, r, units, budget=10, max_rows=0) == [[4], [1], [6], [5], [7], [3], [2], [0]]


def test_shared_prefix_units_stay_together():
    from stapoctl.learner.micro_batches import token_budget, units_of

    groups = [7, 7, 7, 3, 3, 3, 3, 5]
    assert units_of(groups, together=True) == [[0, 1, 2], [3, 4, 5, 6], [7]]
    assert units_of(groups, together=True, max_rows=2) == [[0, 1], [2], [3, 4], [5, 6], [7]]
    p, r = [4] * 8, [2, 40, 2, 3, 3, 3, 3, 9]
    cut = token_budget(p, r, units_of(groups, together=True), budget=65, max_rows=0)
    assert cut == [[0, 1, 2], [3, 4, 5, 6, 7]]  # 3 × 44 over the budget: alone; then 5 rows × 13 = 65


# -- the learner -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from stapoctl.config.schema import TinyModelConfig
    from stapoctl.models.tiny import build_random

    return str(build_random(tmp_path_factory.mktemp("tiny_random"), TinyModelConfig(), seed=0))


def spread_batch():
    """4 prompts × 4 responses of widely spread lengths, ±1 rewards, GRPO advantages."""
    from stapoctl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (k,), generator=g).tolist() for k in PROMPT_LENS]
    resps = [[torch.randint(3, 500, (k,), generator=g).tolist() for k in lens] for lens in RESPONSE_LENS]
    lps = [[[0.0] * len(x) for x in rs] for rs in resps]
    batch = RolloutBatch.from_token_lists(prompts, resps, lps, [[False] * N] * 4, [[""] * N] * 4, pad_id=0)
    rewards = torch.tensor([1, -1, -1, 1, 1, 1, -1, -1, -1, -1, -1, 1, 1, -1, 1, -1], dtype=torch.float32)
    r = rewards.view(4, N)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)
    return batch.with_(rewards=rewards, advantages=adv)


def learner_cfg(budget: int = 0, zero_stage: int = 0, ranks: int = 1, **extra) -> dict:
    """One mini-batch of all 16 rows, 2 PPO epochs: 2 optimizer steps, the second at moved weights."""
    cfg = dict(zero_stage=zero_stage, lr=LR, betas=[0.9, 0.999], weight_decay=WD, adam_eps=EPS, warmup_steps=0,
               grad_clip=1.0, ppo_mini_batch_size=4, micro_batch_size=MICRO, ppo_epochs=2, logits_chunk_size=7,
               cpus=1, num_ranks=ranks, gpus_per_rank=0, max_tokens_per_micro_batch=budget)
    return {**cfg, **extra}


def loss_cfg(name: str) -> dict:
    from stapoctl.losses import LOSSES

    cfg = {"name": name, **vars(LOSSES[name].config_cls())}
    if name.startswith("stapo"):
        cfg.update(tau_p=0.01)  # a random 512-token model: most probabilities are ~1/512, the mask fires
    return cfg


def capture_steps(learner) -> list[dict]:
    """The accumulated gradients each time the engine takes an optimizer step (filled in place)."""
    seen: list[dict] = []
    step = learner.engine.step

    def wrapped(*a, **kw):
        if learner.engine.is_gradient_accumulation_boundary():
            seen.append({n: p.grad.detach().clone() for n, p in learner.module.named_parameters()
                         if p.grad is not None})
        return step(*a, **kw)

    learner.engine.step = wrapped
    return seen


def run(learner, model_dir, lcfg: dict, loss: str, batch) -> dict:
    learner.reset(model_dir, lcfg, loss_cfg(loss), n_per_prompt=N, seed=0, max_response_length=48)
    grads = capture_steps(learner)
    result = learner.train_step(batch, global_step=1)
    return {"metrics": result.metrics, "old_log_probs": result.old_log_probs, "grads": grads, "weights": learner.full_state_dict(),
            "ds_steps": learner.engine.global_steps}


def assert_same_update(got: dict, want: dict) -> None:
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "loss/response_tokens"):
        if key in want["metrics"]:
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(got["old_log_probs"], want["old_log_probs"],
                               atol=1e-5, rtol=0)
    assert len(got["grads"]) == len(want["grads"]) == 2  # one optimizer step per mini-batch and epoch
    for g_got, g_want in zip(got["grads"], want["grads"]):
        for name, g in g_want.items():
            scale = float(g.abs().max()) or 1.0
            assert float((g_got[name] - g).abs().max()) <= 1e-5 * scale, name
    worst = max(float((got["weights"][k] - want["weights"][k]).abs().max()) for k in want["weights"])
    assert worst < 1e-5, f"weights differ by {worst:.3g}"


@pytest.fixture(scope="module")
def learner(tiny_dir):
    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.learner.engine_setup import free_port

    torch.set_num_threads(1)
    lrn = Learner(rank=0, world_size=1)
    lrn.setup(tiny_dir, learner_cfg(), loss_cfg("grpo"), n_per_prompt=N, seed=0, master_port=free_port())
    yield lrn
    lrn.shutdown()


@pytest.fixture(scope="module")
def fixed_runs():
    return {}


def fixed_run(cache, learner, tiny_dir, loss, batch):
    if loss not in cache:
        cache[loss] = run(learner, tiny_dir, learner_cfg(), loss, batch)
    return cache[loss]


def _losses():
    from stapoctl.losses import LOSSES

    return list(LOSSES)


@pytest.mark.parametrize("loss", _losses())
def test_every_loss_equals_fixed_micro_batches(learner, tiny_dir, fixed_runs, loss):
    """Rows as units (shared prefix off): the 50-token row alone, the others sorted and packed."""
    batch = spread_batch()
    want = fixed_run(fixed_runs, learner, tiny_dir, loss, batch)
    got = run(learner, tiny_dir, learner_cfg(BUDGET, shared_prefix=False), loss, batch)
    assert_same_update(got, want)
    # the cut really differs: more micro-batches than the fixed 4 per mini-batch, yet 2 optimizer steps
    assert got["metrics"]["perf/update_micro_batches"] > want["metrics"]["perf/update_micro_batches"] == 8
    assert got["ds_steps"] == want["ds_steps"] == got["metrics"]["actor/optimizer_steps"] == 2
    if loss == "stapo":
        assert want["metrics"]["stapo/spurious_ratio"] > 0.05  # h* and the renormaliser matter


@pytest.mark.parametrize("loss", ["grpo", "stapo", "wapo"])
def test_prompts_as_units_with_the_shared_prefix(learner, tiny_dir, fixed_runs, loss):
    """A prompt's 4 rows stay together: the 200-token group alone (over the budget), prompts 1 and 2
    packed into one micro-batch, 3 micro-batches per mini-batch against the fixed 4."""
    batch = spread_batch()
    want = fixed_run(fixed_runs, learner, tiny_dir, loss, batch)
    got = run(learner, tiny_dir, learner_cfg(SHARED_BUDGET, shared_prefix=True, micro_batch_size=SHARED_CAP),
              loss, batch)
    assert_same_update(got, want)
    assert got["metrics"]["perf/update_micro_batches"] == 6


def test_the_cut_is_deterministic_and_respects_the_budget(learner, tiny_dir):
    from stapoctl.learner.micro_batches import padded_tokens

    batch = spread_batch()
    learner.reset(tiny_dir, learner_cfg(BUDGET, shared_prefix=False), loss_cfg("grpo"), n_per_prompt=N, seed=0)
    mini = batch.select(slice(8, 16))
    first, count = learner._update_micro_batches(mini, slice(0, 8))
    again, _ = learner._update_micro_batches(spread_batch().select(slice(8, 16)), slice(0, 8))
    assert [t.tolist() for t in first] == [t.tolist() for t in again] and count == len(first)
    p, r = mini.prompt_mask.sum(1).tolist(), mini.response_mask.sum(1).tolist()
    for mb in first:
        assert len(mb) <= MICRO and (padded_tokens(p, r, [mb.tolist()]) <= BUDGET or len(mb) == 1)
    assert [4] in [t.tolist() for t in first]  # the 9 + 41-token row, alone


def test_refused_combinations(learner, tiny_dir):
    from stapoctl.config.compose import compose_config
    from stapoctl.errors import UserError

    with pytest.raises(UserError, match=r"learner.zero_stage <= 2"):
        compose_config(["learner.max_tokens_per_micro_batch=512", "learner.zero_stage=3"])
    with pytest.raises(UserError, match=r"per_microbatch_norm=true"):
        compose_config(["learner.max_tokens_per_micro_batch=512", "loss=dapo", "loss.per_microbatch_norm=true"])
    with pytest.raises(UserError, match="per_microbatch_norm"):  # the learner asks too
        learner.reset(tiny_dir, learner_cfg(BUDGET), {**loss_cfg("dapo"), "per_microbatch_norm": True},
                      n_per_prompt=N, seed=0)
    # under a budget the micro-batch is a cap on rows: it need not divide the mini-batch
    with pytest.raises(UserError, match="divide the mini-batch"):
        compose_config(["learner.micro_batch_size=3"])
    conf = compose_config(["learner.micro_batch_size=3", "learner.max_tokens_per_micro_batch=256"])
    assert conf.learner.log_prob_max_tokens_per_micro_batch == 0


# -- two ranks ---------------------------------------------------------------------------------------
def _rank_worker(rank: int, port: int, model_dir: str, queue) -> None:
    torch.set_num_threads(1)
    from stapoctl.learner.deepspeed_learner import Learner

    lrn = Learner(rank=rank, world_size=2)
    zero_weight: list = []
    lrn._zero_weight_loss = lambda mb: (zero_weight.append(1), Learner._zero_weight_loss(lrn, mb))[1]
    try:
        for i, zero in enumerate((0, 2)):
            cfg = learner_cfg(BUDGET, zero_stage=zero, ranks=2, shared_prefix=False)
            if i == 0:
                lrn.setup(model_dir, cfg, loss_cfg("stapo"), n_per_prompt=N, seed=0, max_response_length=48,
                          master_port=port)
            else:
                lrn.reset(model_dir, cfg, loss_cfg("stapo"), n_per_prompt=N, seed=0, max_response_length=48)
            zero_weight.clear()
            metrics = lrn.train_step(spread_batch(), global_step=1)
            # numpy, not tensors: a tensor crosses a Queue as a shared-memory handle that dies with this process
            weights = {k: v.numpy() for k, v in lrn.full_state_dict().items()}
            queue.put((rank, zero, dict(metrics.metrics),
                       len(zero_weight), weights if rank == 0 else None, lrn.engine.global_steps))
    except BaseException as exc:  # reported to the parent, which fails the test
        queue.put((rank, -1, repr(exc), 0, None, 0))
    finally:
        lrn.shutdown()


def test_two_ranks_with_unequal_micro_batch_counts(learner, tiny_dir, fixed_runs):
    """Rank 0 holds the short prompts (2 micro-batches), rank 1 the long ones (4): their counts differ."""
    from stapoctl.learner.engine_setup import free_port

    want = fixed_run(fixed_runs, learner, tiny_dir, "stapo", spread_batch())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_worker, args=(r, port, tiny_dir, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:  # a rank left waiting in a gradient reduction shows up here as a timeout
        results = [queue.get(timeout=180) for _ in range(4)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [r[2] for r in results if r[1] == -1]
    assert not errors, errors
    for zero in (0, 2):
        ranks = {r[0]: r for r in results if r[1] == zero}
        metrics, weights = ranks[0][2], ranks[0][4]
        assert ranks[0][3] > 0 and ranks[1][3] == 0, "rank 0 (short rows) must pad with zero-weight micro-batches"
        assert ranks[0][5] == ranks[1][5] == metrics["actor/optimizer_steps"] == 2
        for key in ("actor/pg_loss", "actor/grad_norm", "stapo/spurious_ratio", "loss/response_tokens"):
            assert metrics[key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), (zero, key)
        worst = max(float((torch.from_numpy(weights[k]) - want["weights"][k]).abs().max()) for k in weights)
        assert worst < 1e-5, f"ZeRO-{zero}: 2-rank token-budget weights differ by {worst:.3g}"
