"""GRPO with 003's advantage shaping: PPL-based (Eq. 9) and position-based (Eq. 8).

Both sit on the project's GRPO (clip 0.2, seq-mean-token-mean) because 003 compares
against a GRPO baseline; only the advantages change. S2T diagnostics use the unshaped
advantage signs (shaping keeps the sign for |alpha*w| < 1 and adds sign(A)*b).
"""

from __future__ import annotations

import torch

from stapoctl.config.losses import PPLShapingConfig, PositionShapingConfig

from .batch import PolicyBatch
from .pg import clipped_pg_loss
from .registry import register_loss
from .shaping import position_bonus, ppl_weights


@register_loss("ppl_shaping", PPLShapingConfig)
def ppl_shaping_loss(batch: PolicyBatch, cfg: PPLShapingConfig):
    """GRPO with PPL advantage shaping (003 Eq. 7, 9). Needs group_ids; PPL from old_log_prob."""
    group_ids = batch.row_tensor("group_ids", required_by="ppl_shaping", dtype=torch.long)

    def compute() -> torch.Tensor:
        if not batch.old_given:
            raise ValueError("prepare_minibatch for 'ppl_shaping' needs old_log_prob=... (the PPL source)")
        return ppl_weights(batch.old, batch.mask, group_ids, std_mode=cfg.std_mode, eps=cfg.adv_eps)

    w_ppl = batch.ctx("row_ppl_weight", compute)
    shaped = batch.adv * (1.0 - cfg.alpha * w_ppl[:, None])
    valid = batch.mask.any(dim=-1)
    extra = {"shaping/ppl_weight_abs_mean": torch.where(valid, w_ppl.abs(), 0.0).sum() / valid.sum().clamp(min=1)}
    return clipped_pg_loss(batch, cfg, advantages=shaped, extra_metrics=extra)


@register_loss("position_shaping", PositionShapingConfig)
def position_shaping_loss(batch: PolicyBatch, cfg: PositionShapingConfig):
    """GRPO with the positional bonus (003 Eq. 8), active for start_step <= global_step < stop_step."""
    step = batch.extra("global_step")
    if step is None and (cfg.start_step > 0 or cfg.stop_step is not None):
        raise ValueError("loss 'position_shaping' with a step window needs the keyword argument global_step=...")
    active = step is None or (step >= cfg.start_step and (cfg.stop_step is None or step < cfg.stop_step))
    bonus = position_bonus(
        batch.mask, gamma=cfg.gamma, direction=cfg.direction, pos_scale=cfg.pos_scale,
        pos_shift=cfg.pos_shift, rel_pos_mode=cfg.rel_pos_mode,
    )
    shaped = batch.adv + torch.sign(batch.adv) * bonus * (1.0 if active else 0.0)
    return clipped_pg_loss(batch, cfg, advantages=shaped, extra_metrics={"shaping/position_active": float(active)})
