"""Policy-loss library: pure tensor code (torch + stdlib only).

Public API::

    adv = compute_advantages(name, rewards, group_ids, **cfg)
    ctx = prepare_minibatch(name, log_prob=..., advantages=..., response_mask=..., entropy=..., **cfg)
    loss, metrics = compute_policy_loss(name, log_prob=..., old_log_prob=..., advantages=...,
                                        response_mask=..., entropy=..., **cfg, **slice_context(ctx, rows))
    entropy, log_prob = token_stats(logits_or_hidden, labels, chunk_size=..., entropy_grad=False)

Every loss takes the verl-parity terms through ``cfg`` (kl_coef/kl_estimator + ref_log_prob,
entropy_coef, rollout_correction/rollout_is_cap + behavior_log_prob): regularizers.py,
rollout_correction.py.

Importing this package registers every method in ``LOSSES``.
"""

from . import entropy20, pg, published, shaped, stapo, tr_grpo, wapo  # noqa: F401  (register the methods)
from .advantages import compute_advantages
from .api import compute_policy_loss, prepare_minibatch
from .batch import PolicyBatch, slice_context
from .registry import LOSSES, LossSpec, register_loss
from .token_stats import token_stats

# the order of the issue (and of `stapoctl losses`); methods registered later keep theirs after these
_ORDER = ("grpo", "dapo", "stapo", "stapo_prob_only", "stapo_high_entropy", "entropy20", "justrl",
          "wapo", "tr_grpo", "ppl_shaping", "position_shaping", "stare", "advantage_reweighting")
_specs = dict(LOSSES)
LOSSES.clear()
LOSSES.update({k: _specs[k] for k in _ORDER if k in _specs})
LOSSES.update({k: v for k, v in _specs.items() if k not in LOSSES})
del _specs

__all__ = [
    "LOSSES",
    "LossSpec",
    "PolicyBatch",
    "compute_advantages",
    "compute_policy_loss",
    "prepare_minibatch",
    "register_loss",
    "slice_context",
    "token_stats",
]
