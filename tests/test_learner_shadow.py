"""Shadow rules inside the real DeepSpeed learner (CPU, in-process): `loss=grpo
'loss.shadow=[stapo,entropy20]'` trains exactly as plain GRPO (same per-step loss, gradient norm and
weights), and logs STAPO's token share as computed by hand from the learner's own measuring pass."""

from __future__ import annotations

import pytest
import torch

from test_learner_recipes import batch_for, make_learner, tiny_dir  # noqa: F401,F811 (the fixture)

pytestmark = pytest.mark.engine


def test_shadows_train_exactly_as_plain_grpo(tiny_dir):  # noqa: F811
    batch = batch_for(tiny_dir)
    plain = make_learner(tiny_dir, mini_prompts=2)  # two mini-batches: the second takes the no-grad pass
    shadowed = make_learner(tiny_dir, mini_prompts=2, shadow=["stapo", "entropy20"])
    for step in (1, 2):
        a = plain.train_step(batch, global_step=step).metrics
        b = shadowed.train_step(batch, global_step=step).metrics
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "stapo/spurious_ratio"):
            assert b[key] == a[key], key
        assert not any(k.startswith("shadow/") for k in a)
        for name in ("stapo", "entropy20"):
            assert 0.0 <= b[f"shadow/{name}/token_share"] <= 1.0 and 0.0 <= b[f"shadow/{name}/grad_share"] <= 1.0
        assert b["shadow/entropy20/token_share"] == pytest.approx(0.8, abs=0.05)  # H below its 0.8 quantile
    for p, q in zip(plain.module.parameters(), shadowed.module.parameters()):
        assert torch.equal(p, q)


def test_the_learners_shadow_share_by_hand(tiny_dir):  # noqa: F811
    """One mini-batch: the share is that of S2T over the measuring pass's π and H (h* its 0.8 quantile)."""
    batch = batch_for(tiny_dir)
    learner = make_learner(tiny_dir, mini_prompts=4, shadow=["stapo"], tau_p=0.05)
    step = learner.train_step(batch, global_step=1)
    mask = batch.response_mask
    prob, ent = step.old_log_probs.exp(), step.entropy
    h = torch.quantile(ent[mask], 0.8)
    adv = batch.advantages[:, None].expand_as(mask)
    s2t = mask & (adv > 0) & (prob < 0.05) & (ent < h)
    assert s2t.sum() > 0
    assert step.metrics["shadow/stapo/token_share"] == pytest.approx(float(s2t.sum() / mask.sum()), abs=1e-6)
    assert step.metrics["shadow/stapo/pos_adv_share"] == pytest.approx(float(s2t.sum() / (mask & (adv > 0)).sum()),
                                                                       abs=1e-6)
