"""Hand-computed expectations for every registered loss on one tiny mini-batch.

The fixture: 2 groups x 4 responses x 5 tokens (rows 0-3 = prompt 0, rows 4-7 = prompt 1).

    row      0     1     2     3     4    5    6    7
    A      1.5  -0.5  -0.5  -0.5     1    1   -1   -1     (dr_grpo advantages of R = [1,-1,-1,-1 | 1,1,-1,-1])
    len      5     3     4     2     5    1    3    2     -> |M| = 25 response tokens

pi = 0.5 everywhere except pi = 1e-3 at (0,2), (1,1), (4,3), (5,0).
rho = 1 everywhere except (0,1): 1.5, (6,1): 0.5, (7,0): 1.1 (old_log_prob = log(pi / rho)).
H = 1.0 everywhere except 2.0 (0,4), 2.1 (5,0), 2.2 (6,0), 2.3 (4,4), 2.4 (2,3).

h* = quantile(H over M, 0.8): 25 values sorted, position 0.8 * 24 = 19.2 -> xs[19] = 1.0,
xs[20] = 2.0 -> h* = 1.0 + 0.2 * (2.0 - 1.0) = 1.2. "Low entropy" = H < 1.2: every 1.0 token.

S2T (A > 0, pi < 2e-3, H < 1.2): (0,2), (4,3). (1,1) has A < 0; (5,0) has H = 2.1 >= h*.

DAPO per-token surrogate s_t = min(rho A, clip(rho, 0.8, 1.28) A):
  (0,1): min(1.5*1.5, 1.28*1.5) = 1.92 (clipped, no gradient)
  (6,1): min(0.5*-1, 0.8*-1) = -0.8 (clipped, no gradient)
  (7,0): min(1.1*-1, 1.1*-1) = -1.1 (inside the range, gradient coefficient rho*A = -1.1)
  others: s_t = A.
Row sums: 7.92, -1.5, -2.0, -1.0, 5, 1, -2.8, -2.1 -> total 4.52.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import torch

from stapoctl.losses import LOSSES, compute_advantages, compute_policy_loss
from stapoctl.losses.pg import DAPOConfig
from stapoctl.losses.shaping import position_bonus, relative_position

B, T = 8, 5
LENGTHS = [5, 3, 4, 2, 5, 1, 3, 2]
ADV = [1.5, -0.5, -0.5, -0.5, 1.0, 1.0, -1.0, -1.0]
LOW_P = [(0, 2), (1, 1), (4, 3), (5, 0)]
RATIOS = {(0, 1): 1.5, (6, 1): 0.5, (7, 0): 1.1}
HIGH_H = {(0, 4): 2.0, (5, 0): 2.1, (6, 0): 2.2, (4, 4): 2.3, (2, 3): 2.4}
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]


def make_batch(dtype=torch.float32):
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
    prob = torch.full((B, T), 0.5, dtype=torch.float64)
    for ij in LOW_P:
        prob[ij] = 1e-3
    ratio = torch.ones(B, T, dtype=torch.float64)
    for ij, r in RATIOS.items():
        ratio[ij] = r
    ent = torch.ones(B, T)
    for ij, h in HIGH_H.items():
        ent[ij] = h
    log_prob = prob.log().to(dtype).requires_grad_(True)
    old = (prob / ratio).log().to(dtype)
    adv = torch.tensor(ADV)[:, None].expand(B, T).clone()
    return dict(log_prob=log_prob, old_log_prob=old, advantages=adv, response_mask=mask, entropy=ent)


def run(name, batch=None, **cfg):
    batch = batch or make_batch()
    loss, metrics = compute_policy_loss(name, **batch, **cfg)
    (grad,) = torch.autograd.grad(loss, batch["log_prob"], allow_unused=False)
    return loss, metrics, grad, batch


def grad_from_coef(coef_rows, denominators):
    """Expected d loss / d log_prob: -coef / denominator per token, 0 off the response."""
    g = torch.zeros(B, T)
    for i, row in enumerate(coef_rows):
        for t, c in enumerate(row):
            g[i, t] = -c / denominators[i]
    return g


# Gradient coefficients d s_t / d log pi_t of the DAPO surrogate (rho*A unclipped, 0 clipped)
DAPO_COEF = [
    [1.5, 0.0, 1.5, 1.5, 1.5],
    [-0.5, -0.5, -0.5],
    [-0.5, -0.5, -0.5, -0.5],
    [-0.5, -0.5],
    [1.0, 1.0, 1.0, 1.0, 1.0],
    [1.0],
    [-1.0, 0.0, -1.0],
    [-1.1, -1.0],
]


def test_fixture_advantages_are_dr_grpo_of_the_rewards():
    rewards = torch.tensor([1.0, -1, -1, -1, 1, 1, -1, -1])
    adv = compute_advantages("dr_grpo", rewards, torch.tensor(GROUPS))
    # group 0: mean -0.5 -> [1.5, -0.5, -0.5, -0.5]; group 1: mean 0 -> [1, 1, -1, -1]
    assert adv.tolist() == ADV


def test_dapo_value_gradient_and_metrics():
    loss, m, grad, _ = run("dapo")
    # total 4.52 over |M| = 25 -> loss = -0.1808
    assert loss.item() == pytest.approx(-4.52 / 25, abs=1e-6)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(grad, grad_from_coef(DAPO_COEF, [25] * B), atol=1e-6, rtol=0)
    # clipped tokens (0,1), (6,1): 2 / 25
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 25)
    # ppo_kl = mean(old - new) = (-ln 1.5 + ln 2 - ln 1.1) / 25
    assert m["actor/ppo_kl"] == pytest.approx((-math.log(1.5) + math.log(2) - math.log(1.1)) / 25, abs=1e-7)
    # entropy: (20 * 1.0 + 2.0 + 2.1 + 2.2 + 2.3 + 2.4) / 25 = 31 / 25
    assert m["actor/entropy"] == pytest.approx(31 / 25, abs=1e-6)
    # S2T is measured, not applied: 2 spurious tokens of 25; 11 positive-advantage tokens
    assert m["stapo/spurious_count"] == 2
    assert m["stapo/spurious_ratio"] == pytest.approx(2 / 25)
    assert m["stapo/masked_pos_adv_ratio"] == pytest.approx(2 / 11)
    assert m["stapo/entropy_threshold"] == pytest.approx(1.2, abs=1e-6)
    assert m["actor/pg_loss"] == pytest.approx(loss.item())
    assert m["loss/active_token_ratio"] == 1.0


def test_justrl_is_the_dapo_preset():
    l1, _, g1, _ = run("dapo")
    l2, _, g2, _ = run("justrl")
    assert l1.item() == l2.item()
    torch.testing.assert_close(g1, g2)
    assert asdict(LOSSES["justrl"].config_cls()) | {"name": "dapo"} == asdict(DAPOConfig())


def test_grpo_symmetric_clip_and_seq_mean_token_mean():
    loss, _, grad, _ = run("grpo")
    # eps = 0.2: (0,1) -> 1.2 * 1.5 = 1.8 (clipped); (6,1) -> -0.8 (clipped); (7,0): min(-1.1, -1.1) = -1.1
    # per-row token means: row0 (1.5*4 + 1.8)/5 = 1.56; rows 1-3: -0.5; rows 4-5: 1;
    # row6 (-1 - 0.8 - 1)/3 = -0.93333; row7 (-1.1 - 1)/2 = -1.05
    # sum = 1.56 - 1.5 + 2 - 0.93333 - 1.05 = 0.0766667; mean over 8 rows -> loss = -0.00958333
    assert loss.item() == pytest.approx(-(1.56 - 1.5 + 2 - 2.8 / 3 - 1.05) / 8, abs=1e-7)
    # gradient: -coef / (8 * len_i)
    torch.testing.assert_close(grad, grad_from_coef(DAPO_COEF, [8 * n for n in LENGTHS]), atol=1e-7, rtol=0)


def test_dapo_dual_clip():
    batch = make_batch()
    # push (7,0) to rho = 4 (A = -1): min(-4, -1.28) = -4 < c*A = -3 -> dual clip to -3, no gradient
    with torch.no_grad():
        batch["old_log_prob"][7, 0] = batch["log_prob"][7, 0] - math.log(4.0)
    off, _, _, _ = run("dapo", batch)
    on, m, grad, _ = run("dapo", batch, clip_ratio_c=3.0)
    # without dual clip total = 4.52 - (-1.1) + (-4) = 1.62; with it 4.52 + 1.1 - 3 = 2.62
    assert off.item() == pytest.approx(-1.62 / 25, abs=1e-6)
    assert on.item() == pytest.approx(-2.62 / 25, abs=1e-6)
    assert grad[7, 0].item() == 0.0
    assert m["actor/pg_clipfrac"] == pytest.approx(3 / 25)


def test_stapo_masks_spurious_and_renormalises_by_unmasked_count():
    loss, m, grad, _ = run("stapo")
    # silenced: (0,2) [s = 1.5] and (4,3) [s = 1]: (4.52 - 2.5) / 23 = 2.02 / 23
    assert loss.item() == pytest.approx(-2.02 / 23, abs=1e-6)
    coef = [row[:] for row in DAPO_COEF]
    coef[0][2] = 0.0
    coef[4][3] = 0.0
    torch.testing.assert_close(grad, grad_from_coef(coef, [23] * B), atol=1e-7, rtol=0)
    assert m["stapo/spurious_count"] == 2
    assert m["stapo/spurious_ratio"] == pytest.approx(2 / 25)
    assert m["stapo/masked_pos_adv_ratio"] == pytest.approx(2 / 11)
    assert m["loss/active_token_ratio"] == pytest.approx(23 / 25)


def test_stapo_without_renormalisation_divides_by_all_tokens():
    loss, _, _, _ = run("stapo", renormalize=False)
    assert loss.item() == pytest.approx(-2.02 / 25, abs=1e-6)


def test_stapo_with_tau_p_near_zero_equals_dapo():
    # tau_p must lie in (0, 1] (tau_p=0 is loss=dapo); a tiny threshold silences no token here
    l1, m1, g1, _ = run("dapo")
    l2, m2, g2, _ = run("stapo", tau_p=1e-30)
    assert l1.item() == pytest.approx(l2.item(), abs=1e-8)
    torch.testing.assert_close(g1, g2)
    assert m2["stapo/spurious_count"] == 0


def test_stapo_never_masks_non_positive_advantages():
    batch = make_batch()
    # every token low-probability and low-entropy: only A > 0 tokens may be silenced
    with torch.no_grad():
        batch["log_prob"].fill_(math.log(1e-4))
        batch["old_log_prob"].fill_(math.log(1e-4))
    # 18 zeros and 7 fives (rows 3, 6, 7): h* = xs[19] + 0.2 (xs[20] - xs[19]) = 5, so every 0 is low
    batch["entropy"] = torch.zeros(B, T)
    batch["entropy"][[3, 6, 7]] = 5.0
    _, m, grad, _ = run("stapo", batch)
    adv = batch["advantages"]
    mask = batch["response_mask"]
    assert m["stapo/entropy_threshold"] == 5.0
    assert torch.all(grad[(adv <= 0) & mask] != 0)
    # silenced = every A > 0 token: 5 + 5 + 1 = 11
    assert m["stapo/spurious_count"] == 11
    assert torch.all(grad[(adv > 0) & mask] == 0)


def test_stapo_prob_only_ablation():
    loss, m, grad, _ = run("stapo_prob_only")
    # silenced: (0,2), (4,3) and the high-entropy (5,0) [s = 1]: (4.52 - 3.5) / 22 = 1.02 / 22
    assert loss.item() == pytest.approx(-1.02 / 22, abs=1e-6)
    assert grad[5, 0].item() == 0.0 and grad[0, 2].item() == 0.0
    assert grad[0, 0].item() == pytest.approx(-1.5 / 22, abs=1e-7)
    assert m["stapo/spurious_count"] == 3


def test_stapo_high_entropy_ablation():
    loss, m, grad, _ = run("stapo_high_entropy")
    # silenced: (5,0) only (A > 0, pi < tau_p, H = 2.1 >= 1.2): (4.52 - 1) / 24 = 3.52 / 24
    assert loss.item() == pytest.approx(-3.52 / 24, abs=1e-6)
    assert grad[5, 0].item() == 0.0
    assert grad[0, 2].item() == pytest.approx(-1.5 / 24, abs=1e-7)
    assert m["stapo/spurious_count"] == 1


def test_entropy20_only_top_entropy_tokens_get_gradient():
    loss, m, grad, _ = run("entropy20")
    # threshold = quantile(H, 0.8) = 1.2: selected (0,4) 1.5, (5,0) 1, (6,0) -1, (4,4) 1, (2,3) -0.5
    # sum = 2.0, normalised by |M| = 25 (DAPO token-mean) -> -0.08
    assert loss.item() == pytest.approx(-2.0 / 25, abs=1e-6)
    expected = torch.zeros(B, T)
    for (i, t), a in {(0, 4): 1.5, (5, 0): 1.0, (6, 0): -1.0, (4, 4): 1.0, (2, 3): -0.5}.items():
        expected[i, t] = -a / 25
    torch.testing.assert_close(grad, expected, atol=1e-7, rtol=0)
    assert m["loss/active_token_ratio"] == pytest.approx(5 / 25)
    loss_r, _, _, _ = run("entropy20", renormalize=True)
    assert loss_r.item() == pytest.approx(-2.0 / 5, abs=1e-6)


def test_wapo_winners_only_with_constant_normalisation():
    loss, _, grad, _ = run("wapo", group_ids=torch.tensor(GROUPS))
    # A+ = [1.5, 0, 0, 0, 1, 1, 0, 0]; both prompts have a winner -> N = 2, G = 4, T_max = 5
    # row weight 1 / (4 * 5 * 2) = 1/40; surrogate A+ * min(rho, 1.28):
    # row0 1.5 * (1 + 1.28 + 1 + 1 + 1) = 7.92, row4 5, row5 1 -> loss = -13.92 / 40
    assert loss.item() == pytest.approx(-13.92 / 40, abs=1e-6)
    coef = [[1.5, 0.0, 1.5, 1.5, 1.5], [0] * 3, [0] * 4, [0] * 2, [1.0] * 5, [1.0], [0] * 3, [0] * 2]
    torch.testing.assert_close(grad, grad_from_coef(coef, [40] * B), atol=1e-7, rtol=0)
    # negative responses get exactly zero gradient
    assert torch.all(grad[torch.tensor(ADV) < 0] == 0)


def test_wapo_max_response_length_and_winner_variant():
    g = torch.tensor(GROUPS)
    loss, _, _, _ = run("wapo", group_ids=g, max_response_length=10)
    assert loss.item() == pytest.approx(-13.92 / 80, abs=1e-6)  # 1 / (4 * 10 * 2)
    loss, _, _, _ = run("wapo", group_ids=g, winner_norm="winners")
    # G*r_bar: prompt 0 has 1 winner -> 1/(1*5*2) = 0.1; prompt 1 has 2 -> 1/(2*5*2) = 0.05
    # loss = -(7.92 * 0.1 + 6 * 0.05) = -1.092
    assert loss.item() == pytest.approx(-1.092, abs=1e-6)


def test_wapo_prompt_without_winner_contributes_nothing():
    batch = make_batch()
    batch["advantages"][:4] = torch.tensor([0.0, 0.0, -1.0, -1.0])[:, None]  # prompt 0: no winner
    loss, _, grad, _ = run("wapo", batch, group_ids=torch.tensor(GROUPS))
    # only prompt 1 counts: N = 1 -> weight 1 / (4 * 5 * 1) = 1/20; sum 6 -> -0.3
    assert loss.item() == pytest.approx(-0.3, abs=1e-6)
    assert torch.all(grad[:4] == 0)
    loss_all, _, _, _ = run("wapo", batch, group_ids=torch.tensor(GROUPS), prompt_norm="all")
    assert loss_all.item() == pytest.approx(-6 / 40, abs=1e-6)  # divided by both prompts


def test_tr_grpo_default_weights():
    loss, m, grad, _ = run("tr_grpo")
    # w = clip(2 * (sigmoid(9 pi) - 0.25), 1, 1.4):
    #   pi = 0.5  -> sigmoid(4.5) = 0.98901 -> 1.47803 -> 1.4
    #   pi = 1e-3 -> sigmoid(0.009) = 0.50225 -> 0.50450 -> 1.0
    # s = min(w rho A, clip(w rho, 0.8, 1.28) A):
    #   A > 0, pi = 0.5, rho = 1: w rho = 1.4 > 1.28 -> 1.28 A (clipped, no gradient)
    #   A < 0, pi = 0.5, rho = 1: -1.4 |A| (unclipped, coefficient w rho A)
    # row0: 1.92 * 4 + 1.5 [(0,2): w = 1] = 9.18; row1: -0.5 [(1,1)] - 0.7 * 2 = -1.9
    # row2: -2.8; row3: -1.4; row4: 1.28 * 4 + 1 = 6.12; row5: 1 [(5,0): w = 1]
    # row6: -1.4 - 0.8 [(6,1): w rho = 0.7 -> clipped] - 1.4 = -3.6; row7: -1.54 - 1.4 = -2.94
    # total 3.66 -> loss = -3.66 / 25
    assert loss.item() == pytest.approx(-3.66 / 25, abs=1e-6)
    coef = [
        [0.0, 0.0, 1.5, 0.0, 0.0],
        [-0.7, -0.5, -0.7],
        [-0.7] * 4,
        [-0.7] * 2,
        [0.0, 0.0, 0.0, 1.0, 0.0],
        [1.0],
        [-1.4, 0.0, -1.4],
        [-1.54, -1.4],
    ]
    torch.testing.assert_close(grad, grad_from_coef(coef, [25] * B), atol=1e-6, rtol=0)
    # 21 tokens with w = 1.4, 4 with w = 1.0 -> mean (21 * 1.4 + 4) / 25
    assert m["tr_grpo/weight_mean"] == pytest.approx((21 * 1.4 + 4) / 25, abs=1e-6)


def test_tr_grpo_unit_weight_equals_dapo():
    l1, _, g1, _ = run("dapo")
    l2, _, g2, _ = run("tr_grpo", alpha=0.0, mu=-1.0, weight_low=1.0, weight_high=1.0)
    assert l1.item() == pytest.approx(l2.item(), abs=1e-8)
    torch.testing.assert_close(g1, g2)


def test_tr_grpo_printed_divide_form_is_constant_one_at_defaults():
    # sigmoid(pi / 9) in (0.5, 0.528) -> 2 * (sigmoid - 0.25) < 0.556 -> clipped up to L = 1
    l1, _, g1, _ = run("dapo")
    l2, m, g2, _ = run("tr_grpo", tau_mode="divide")
    assert l1.item() == pytest.approx(l2.item(), abs=1e-8)
    torch.testing.assert_close(g1, g2)
    assert m["tr_grpo/weight_mean"] == 1.0


def test_tr_grpo_kl_term():
    batch = make_batch()
    ref = batch["log_prob"].detach().clone()
    base, _, _, _ = run("tr_grpo", alpha=0.0, mu=-1.0, weight_high=1.0)
    # pi_ref = pi and w = 1 -> x = 1 -> D = 1 - log 1 - 1 = 0: the KL term adds nothing
    same, m, _, _ = run("tr_grpo", make_batch(), alpha=0.0, mu=-1.0, weight_high=1.0, kl_coef=0.5, ref_log_prob=ref)
    assert same.item() == pytest.approx(base.item(), abs=1e-7)
    assert m["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    # pi_ref = pi / 2 everywhere: x = 0.5 -> D = 0.5 + ln 2 - 1 = 0.193147 on each of 25 tokens
    shifted, _, _, _ = run(
        "tr_grpo", make_batch(), alpha=0.0, mu=-1.0, weight_high=1.0, kl_coef=0.5, ref_log_prob=ref - math.log(2)
    )
    assert shifted.item() == pytest.approx(base.item() + 0.5 * (0.5 + math.log(2) - 1), abs=1e-6)
    with pytest.raises(ValueError, match="ref_log_prob"):
        run("tr_grpo", make_batch(), kl_coef=0.1)


def test_ppl_shaping():
    batch = make_batch()
    # PPL source: old_log_prob constant per row; ratio 1 everywhere
    c = torch.tensor([-1.0, -2.0, -3.0, -4.0, -2.0, -2.0, -2.0, -2.0])[:, None].expand(B, T).clone()
    batch["old_log_prob"] = c
    batch["log_prob"] = c.clone().requires_grad_(True)
    loss, _, grad, _ = run("ppl_shaping", batch, group_ids=torch.tensor(GROUPS))
    # prompt 0: log PPL = [1, 2, 3, 4], mean 2.5, population std sqrt(1.25) = 1.118034
    #   w = [-1.341641, -0.447214, 0.447214, 1.341641]; prompt 1: all equal -> w = 0
    # A~ = A (1 - 0.01 w): 1.5 * 1.0134164 = 1.5201246, -0.5 * 1.0044721 = -0.5022361,
    #   -0.5 * 0.9955279 = -0.4977639, -0.5 * 0.9865836 = -0.4932918; prompt 1 unchanged
    # GRPO (seq-mean-token-mean, rho = 1): loss = -sum_i A~_i / 8 = -0.0268328 / 8
    shaped = [1.5201246, -0.5022361, -0.4977639, -0.4932918, 1.0, 1.0, -1.0, -1.0]
    assert loss.item() == pytest.approx(-sum(shaped) / 8, abs=1e-6)
    expected = grad_from_coef([[a] * n for a, n in zip(shaped, LENGTHS)], [8 * n for n in LENGTHS])
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="group_ids"):
        run("ppl_shaping", make_batch())


def test_position_shaping():
    batch = make_batch()
    batch["old_log_prob"] = batch["log_prob"].detach().clone()  # rho = 1
    loss, _, grad, _ = run("position_shaping", batch, global_step=0)
    # b_t = 0.1 * sigmoid(15 (l_t - 0.5)), l_t = t / (len - 1); sigmoid(x) + sigmoid(-x) = 1, so the
    # bonuses of a row of length >= 2 average 0.05; a one-token row has l = 1: 0.1 * sigmoid(7.5) = 0.0999447
    # per-row means of A~ = A + sign(A) b: 1.55, -0.55 x3, 1.05, 1.0999447, -1.05 x2
    # sum = 1.55 - 1.65 + 1.05 + 1.0999447 - 2.1 = -0.0500553 -> loss = 0.0500553 / 8
    assert loss.item() == pytest.approx(0.0500553 / 8, abs=1e-6)
    # row 0, last token: -(1.5 + 0.1 sigmoid(7.5)) / (8 * 5)
    assert grad[0, 4].item() == pytest.approx(-(1.5 + 0.1 / (1 + math.exp(-7.5))) / 40, abs=1e-7)
    # row 6 (A = -1), first token: b = 0.1 sigmoid(-7.5); A~ = -1 - b -> grad = (1 + b) / 24
    assert grad[6, 0].item() == pytest.approx((1 + 0.1 / (1 + math.exp(7.5))) / 24, abs=1e-7)
    # outside the step window it is plain GRPO
    off, _, _, _ = run("position_shaping", batch, global_step=5, start_step=10)
    grpo, _, _, _ = run("grpo", batch)
    assert off.item() == pytest.approx(grpo.item(), abs=1e-8)
    with pytest.raises(ValueError, match="global_step"):
        run("position_shaping", batch, start_step=10)


def test_relative_position_and_printed_shift():
    mask = torch.tensor([[True] * 5, [False, False, True, True, True]])  # right- and left-padded
    rel = relative_position(mask)
    torch.testing.assert_close(rel, torch.tensor([[0, 0.25, 0.5, 0.75, 1.0], [0, 0, 0, 0.5, 1.0]]))
    spec = relative_position(mask, "spec")  # (t + 1) / |o|
    torch.testing.assert_close(spec[0], torch.tensor([0.2, 0.4, 0.6, 0.8, 1.0]))
    # 003's printed n = -0.5: r = 15 (l + 0.5) in [7.5, 22.5] -> bonus within 6e-4 of gamma everywhere
    printed = position_bonus(mask, gamma=1.0, direction=1.0, pos_scale=15.0, pos_shift=-0.5)
    assert printed[mask].min().item() > 0.9994
    rising = position_bonus(mask, gamma=1.0, direction=1.0, pos_scale=15.0, pos_shift=0.5)
    assert rising[0, 0].item() < 1e-3 and rising[0, 4].item() > 0.999


def test_grad_norm_proxies_by_category():
    batch = make_batch()
    sum_p2 = torch.full((B, T), 0.5)
    hidden_norm = torch.full((B, T), 2.0)
    _, m, _, _ = run("dapo", batch, sum_p2=sum_p2, hidden_norm=hidden_norm)
    # ||e - pi|| = sqrt(1 - 2 pi + 0.5): pi = 0.5 -> sqrt(0.5) = 0.707107; pi = 1e-3 -> sqrt(1.498) = 1.223928
    a, b = math.sqrt(0.5), math.sqrt(1.498)
    # spurious (0,2) coef 1.5, (4,3) coef 1: (1.5 b 2 + b 2) / 2
    assert m["grad/lmhead_norm/spurious"] == pytest.approx((1.5 * b * 2 + b * 2) / 2, rel=1e-5)
    # pos_normal: row0 t0, t3, t4 (1.5 a 2 each), t1 clipped (0), row4 4 tokens (a 2), (5,0) (b 2): 9 tokens
    assert m["grad/lmhead_norm/pos_normal"] == pytest.approx((3 * 3 * a + 4 * 2 * a + 2 * b) / 9, rel=1e-5)
    # neg: (1,1) 0.5 b 2; eight A = -0.5 tokens 0.5 a 2; (6,0), (6,2), (7,1) 2 a; (6,1) 0; (7,0) 1.1 * 2 a
    neg = (b + 8 * a + 3 * 2 * a + 0 + 2.2 * a) / 14
    assert m["grad/lmhead_norm/neg"] == pytest.approx(neg, rel=1e-5)
    assert m["grad/lmhead_norm/exact"] == 1.0


def test_token_categories_partition_the_nonzero_advantage_tokens():
    from stapoctl.losses.diagnostics import token_categories

    b = make_batch()
    cats = token_categories(b["advantages"], b["log_prob"].detach().exp(), b["entropy"], b["response_mask"],
                            tau_p=2e-3, threshold=1.2)
    counts = {k: int(v.sum()) for k, v in cats.items()}
    assert sum(counts.values()) == 25  # every response token has A != 0 here, each in exactly one row
    assert counts["p<tau,A>0,H<h"] == 2  # the spurious tokens (0,2), (4,3)
    assert counts["p<tau,A>0,H>=h"] == 1  # (5,0)
    assert counts["p<tau,A<0,H<h"] == 1  # (1,1)
    assert counts["p>=tau,A>0,H>=h"] == 2  # (0,4), (4,4)
    assert counts["p>=tau,A<0,H>=h"] == 2  # (6,0), (2,3)
