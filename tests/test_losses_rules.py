"""Token rules (`loss.token_rules`, losses/rules.py): by hand on test_losses_methods' fixture, the
presets (STAPO, its ablations, 20-Entropy) against today's code on random batches, and the grammar.

Fixture facts (test_losses_methods' docstring): DAPO token-mean, 25 response tokens; s_t = A_t
except (0,1) = 1.92, (6,1) = −0.8, (7,0) = −1.1; row sums 7.92, −1.5, −2.0, −1.0, 5, 1, −2.8, −2.1;
A > 0 rows (0, 4, 5) sum to 13.92 over 11 tokens, A < 0 rows to −9.4 over 14 tokens.
π = 1e−3 at (0,2) A=1.5, (1,1) A=−0.5, (4,3) A=1, (5,0) A=1; H ≥ 2 at (0,4) 2.0, (5,0) 2.1,
(6,0) 2.2, (4,4) 2.3, (2,3) 2.4 (h* = quantile 0.8 = 1.2).
"""

from __future__ import annotations

import pytest
import torch
import yaml

from stapoctl.config.losses import DAPOConfig, Entropy20Config, STAPOConfig
from stapoctl.config.token_rules import parse_rule, parse_rules
from stapoctl.errors import UserError
from stapoctl.losses import LOSSES, compute_policy_loss, prepare_minibatch, slice_context
from test_losses_methods import GROUPS, make_batch

STAPO_RULE = {"adv": "pos", "prob": [0, 0.002], "entropy_q": [0, 0.8], "action": "mask"}


def run(name, batch=None, **cfg):
    batch = batch or make_batch()
    loss, metrics = compute_policy_loss(name, **batch, **cfg)
    (grad,) = torch.autograd.grad(loss, batch["log_prob"])
    return loss.item(), metrics, grad


# -- by hand --------------------------------------------------------------------------------------
@pytest.mark.parametrize("rules, expected", [
    ([{"adv": "neg", "action": "scale", "scale": 0.5}], -(13.92 - 4.7) / 25),
    ([{"adv": "neg", "action": "mask"}], -13.92 / 11),  # renormalised: 11 tokens left
    ([{"adv": "neg", "action": "mask", "renorm": False}], -13.92 / 25),
    # first match wins: the mask takes A < 0, the scale the rest; reversed, the scale takes everything
    ([{"adv": "neg", "action": "mask"}, {"action": "scale", "scale": 2}], -2 * 13.92 / 11),
    ([{"action": "scale", "scale": 2}, {"adv": "neg", "action": "mask"}], -2 * 4.52 / 25),
    # the four π = 1e-3 tokens (s = 1.5 − 0.5 + 1 + 1 = 3) weighted by their π
    ([{"prob": [0, 0.01], "action": "weight", "fn": "prob"}], -(4.52 - 3 + 3e-3) / 25),
    # first token of each row: 1.5 − 0.5·3 + 1 + 1 − 1 − 1.1 = −0.1, 8 tokens
    ([{"position": [0, 1], "action": "mask"}], -4.62 / 17),
    # index/length >= 0.5: 10 tokens whose s sum to 1.0 (rows 0: 3+4, 1: 2, 2: 2+3, 3: 1, 4: 3+4, 6: 2, 7: 1)
    ([{"rel_position": [0.5, 1], "action": "mask", "renorm": False}], -3.52 / 25),
    # H >= 2.05: (5,0) 1, (6,0) −1, (4,4) 1, (2,3) −0.5
    ([{"entropy": [2.05, None], "action": "mask"}], -4.02 / 21),
    # [0.8, 1]: H >= h* = 1.2 with the top open, so the highest (2.4) is in: 1.5 + 1 − 1 + 1 − 0.5 = 2
    ([{"entropy_q": [0.8, 1], "action": "mask"}], -2.52 / 20),
])
def test_rules_by_hand(rules, expected):
    loss, _, _ = run("dapo", token_rules=rules)
    assert loss == pytest.approx(expected, abs=1e-6)


def test_scale_and_weight_gradients_by_hand():
    _, _, g = run("dapo", token_rules=[{"adv": "neg", "action": "scale", "scale": 0.5}])
    assert g[1, 0].item() == pytest.approx(0.5 * 0.5 / 25, abs=1e-8)  # −(−0.5 · 0.5)/25
    assert g[0, 0].item() == pytest.approx(-1.5 / 25, abs=1e-8)  # untouched
    _, _, g = run("dapo", token_rules=[{"prob": [0, 0.01], "action": "weight", "fn": "prob"}])
    # the weight is detached: d(w·s)/dlog π = w·ρA only, no dw/dlog π term
    assert g[0, 2].item() == pytest.approx(-1.5e-3 / 25, rel=1e-4)


def test_rule_metrics_are_each_rules_share_of_the_tokens():
    rules = [{"adv": "neg", "action": "mask", "name": "neg"}, {"action": "scale", "scale": 2}]
    _, m, _ = run("dapo", token_rules=rules)
    assert m["rules/neg/token_ratio"] == pytest.approx(14 / 25) and m["rules/r1/token_ratio"] == pytest.approx(11 / 25)
    assert m["loss/active_token_ratio"] == pytest.approx(11 / 25)
    _, m, _ = run("dapo", token_rules=rules[::-1])
    assert m["rules/r0/token_ratio"] == 1.0 and m["rules/neg/token_ratio"] == 0.0


def test_wapo_takes_rules_too():
    kw = dict(group_ids=torch.tensor(GROUPS))
    base, _, _ = run("wapo", **kw)
    doubled, _, _ = run("wapo", **kw, token_rules=[{"action": "scale", "scale": 2}])
    silenced, _, _ = run("wapo", **kw, token_rules=[{"adv": "pos", "action": "mask"}])
    assert base < 0 and doubled == pytest.approx(2 * base, abs=1e-7) and silenced == 0.0


def test_dapo_with_stapos_rule_is_stapo_by_hand():
    loss, m, _ = run("dapo", token_rules=[STAPO_RULE])
    assert loss == pytest.approx(-(4.52 - 1.5 - 1) / 23, abs=1e-6)  # (0,2), (4,3) silenced
    assert m["rules/r0/token_ratio"] == pytest.approx(2 / 25)


# -- presets equal today's code -------------------------------------------------------------------
def _today(batch, cfg, kind):
    """The STAPO family and 20-Entropy as written before the rule engine (stapo.py, entropy20.py)."""
    from stapoctl.losses.diagnostics import standard_metrics
    from stapoctl.losses.masks import entropy_threshold, high_entropy_mask, masked_quantile, s2t_mask
    from stapoctl.losses.pg import aggregate_with_context, surrogate_of

    silenced = None
    if kind == "entropy20":
        thr = batch.ctx("select_entropy_threshold", lambda: masked_quantile(
            batch.ent, batch.mask, 1.0 - cfg.top_entropy_frac, cfg.quantile_interpolation))
        keep = high_entropy_mask(batch.ent, batch.mask, thr)
    else:
        h = batch.ctx("entropy_threshold", lambda: entropy_threshold(batch.ent, batch.mask, cfg.tau_h,
                                                                     cfg.quantile_interpolation))
        silenced = s2t_mask(batch.adv, batch.prob, batch.ent, batch.mask, tau_p=cfg.tau_p, threshold=h, kind=kind)
        keep = batch.mask & ~silenced
    sur = surrogate_of(batch, cfg)
    loss = aggregate_with_context(batch, cfg, -sur.objective, loss_mask=keep,
                                  norm_mask=keep if cfg.renormalize else batch.mask)
    return loss, standard_metrics(batch, cfg, sur, loss, keep=keep, silenced=silenced)


KIND = {"stapo": "s2t", "stapo_prob_only": "prob_only", "stapo_high_entropy": "high_entropy", "entropy20": "entropy20"}
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
SPLIT = [slice(0, 5), slice(5, 9), slice(9, 16)]


def random_batch(seed):
    """16 rows × 12 tokens, random lengths; π spans 1e-4..1 so a 5% τ_p catches ~a quarter of tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (16,), generator=g)
    mask = torch.arange(12)[None, :] < lengths[:, None]
    log_prob = (torch.rand(16, 12, generator=g) * 9.2 - 9.2).requires_grad_(True)
    old = log_prob.detach() + 0.3 * torch.randn(16, 12, generator=g)
    adv = torch.randn(16, generator=g).round(decimals=1)
    ent = torch.rand(16, 12, generator=g) * 3
    return dict(log_prob=log_prob, old_log_prob=old, advantages=adv, response_mask=mask, entropy=ent)


def _via(fn_of_batch_ctx, batch, split):
    """One-shot ([None]) or micro-batched total loss and gradient; fn(PolicyBatch) → (loss, metrics)."""
    from stapoctl.losses import PolicyBatch

    def pb(rows, context=None, grad=True):
        lp = batch["log_prob"][rows] if grad else batch["log_prob"].detach()[rows]
        return PolicyBatch(log_prob=lp, old_log_prob=batch["old_log_prob"][rows], advantages=batch["advantages"][rows],
                           response_mask=batch["response_mask"][rows], entropy=batch["entropy"][rows],
                           context=context)

    if split is None:
        loss, metrics = fn_of_batch_ctx(pb(slice(None)))
        return loss, torch.autograd.grad(loss, batch["log_prob"])[0], [metrics]
    with torch.no_grad():
        whole = pb(slice(None), grad=False)
        fn_of_batch_ctx(whole)
        ctx = whole.exported_context()
    parts = [fn_of_batch_ctx(pb(rows, slice_context(ctx, rows))) for rows in split]
    total = sum(p[0] for p in parts)
    return total, torch.autograd.grad(total, batch["log_prob"])[0], [p[1] for p in parts]


@pytest.mark.parametrize("split", [None, SPLIT], ids=["one-shot", "micro"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(KIND))
def test_presets_equal_todays_code(name, mode, split):
    from stapoctl.losses.registry import split_kwargs

    spec = LOSSES[name]
    for seed, renorm in ((0, True), (1, False), (2, True)):
        cfg, _, _ = split_kwargs(spec, dict(loss_agg_mode=mode, tau_p=0.05, renormalize=renorm, tau_h=0.3))
        new = _via(lambda b: spec.fn(b, cfg), random_batch(seed), split)
        old = _via(lambda b: _today(b, cfg, KIND[name]), random_batch(seed), split)
        assert new[0].item() == pytest.approx(old[0].item(), abs=1e-7)
        torch.testing.assert_close(new[1], old[1], atol=1e-7, rtol=0)
        assert new[2] == old[2]  # every metric, each micro-batch
        # the masks bite: some token silenced (STAPO family) or left out (20-Entropy)
        key = "loss/active_token_ratio" if name == "entropy20" else "stapo/spurious_count"
        values = [m[key] for m in old[2]]
        assert (min(values) < 1.0) if name == "entropy20" else (sum(values) > 0)


@pytest.mark.parametrize("mode", MODES)
def test_dapo_with_stapos_rule_equals_stapo_in_every_mode_and_split(mode):
    """`loss=dapo 'loss.token_rules=[STAPO's rule]'` and `loss=stapo` through the public API."""
    rule = {**STAPO_RULE, "prob": [0, 0.05]}
    out = {}
    # dapo's stapo/* metrics measure S2T with its own tau_p: give it the rule's, so they compare
    for name, cfg in (("stapo", dict(tau_p=0.05)), ("dapo", dict(tau_p=0.05, token_rules=[rule]))):
        b = random_batch(3)
        one, m_one = compute_policy_loss(name, **b, loss_agg_mode=mode, **cfg)
        g_one = torch.autograd.grad(one, b["log_prob"])[0]
        b = random_batch(3)
        ctx = prepare_minibatch(name, log_prob=b["log_prob"].detach(), advantages=b["advantages"],
                                response_mask=b["response_mask"], entropy=b["entropy"], loss_agg_mode=mode, **cfg)
        total = sum(compute_policy_loss(name, **{k: v[r] for k, v in b.items()}, loss_agg_mode=mode,
                                        **slice_context(ctx, r), **cfg)[0] for r in SPLIT)
        out[name] = one, g_one, m_one, total, torch.autograd.grad(total, b["log_prob"])[0]
    (s1, sg, sm, st, stg), (d1, dg, dm, dt, dtg) = out["stapo"], out["dapo"]
    assert d1.item() == pytest.approx(s1.item(), abs=1e-7) and dt.item() == pytest.approx(st.item(), abs=1e-7)
    assert dt.item() == pytest.approx(s1.item(), abs=1e-6)  # micro-batches add up (fp32 summation order)
    torch.testing.assert_close(dg, sg, atol=1e-7, rtol=0)
    torch.testing.assert_close(dtg, stg, atol=1e-7, rtol=0)
    assert {k: v for k, v in dm.items() if not k.startswith("rules/")} == sm
    assert sm["stapo/spurious_count"] > 0


def test_the_context_holds_the_rules_quantile():
    b = make_batch()
    ctx = prepare_minibatch("dapo", log_prob=b["log_prob"].detach(), advantages=b["advantages"],
                            response_mask=b["response_mask"], entropy=b["entropy"], token_rules=[STAPO_RULE])
    assert ctx["entropy_q=0.8"] == pytest.approx(1.2, abs=1e-6) and ctx["loss_denominator"] == 23.0


# -- the grammar ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rules, message", [
    ([{"adv": "pos", "prb": [0, 0.002], "action": "mask"}],
     "token_rules[0].prb=[0, 0.002]: unknown key: did you mean 'prob'?"),
    ([{"prob": [0.5, 0.1], "action": "mask"}], "token_rules[0].prob=[0.5, 0.1]: an empty band"),
    ([{"entropy_q": [0.8, 0.8], "action": "mask"}], "token_rules[0].entropy_q=[0.8, 0.8]: an empty band"),
    ([{"action": "mask"}, {"action": "scale", "scale": -1}], "token_rules[1].scale=-1: action: scale needs scale: c"),
    ([{"action": "scale"}], "token_rules[0].scale=null: action: scale needs scale: c"),
    ([{"prob": [0, 0.1]}], "token_rules[0].action=null: must be mask, scale or weight"),
    ([{"action": "weight", "fn": "nope"}], "token_rules[0].fn=nope: action: weight needs fn: NAME"),
    ([{"action": "mask", "scale": 2}], "token_rules[0].scale=2: only action: scale takes scale"),
    ([{"adv": "positive", "action": "mask"}], "token_rules[0].adv=positive: must be pos (A > 0), neg (A < 0) or any"),
    ([{"prob": 0.1, "action": "mask"}], "token_rules[0].prob=0.1: a band is a list [low, high]"),
    ([{"entropy_q": [0, 1.5], "action": "mask"}], "token_rules[0].entropy_q=[0, 1.5]: the ends must lie in [0, 1]"),
    ([{"position": [0, 2.5], "action": "mask"}], "token_rules[0].position=[0, 2.5]: positions are whole"),
    ([{"action": "mask", "name": "a"}, {"action": "mask", "name": "a"}], "token_rules[1].name=a: another rule"),
    (["mask"], "token_rules[0]=mask: a rule is a dict"),
    ({"action": "mask"}, "a list of rules"),
])
def test_bad_rules_are_refused_in_one_line_naming_the_field(rules, message):
    with pytest.raises(UserError) as err:
        DAPOConfig(token_rules=rules)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("dapo: token_rules")
    with pytest.raises(ValueError, match="token_rules"):  # the library refuses it the same way
        compute_policy_loss("dapo", **make_batch(), token_rules=rules)


def test_open_ends_and_the_written_form():
    rule = parse_rule({"entropy_q": [0.8, 1], "prob": [0, 1], "rel_position": [0.5, 1], "action": "mask"}, 0)
    assert rule.entropy_q == (0.8, None) and rule.prob is None and rule.rel_position == (0.5, None)
    for raw in (STAPO_RULE, {"adv": "neg", "entropy": [0.5, None], "position": [3, 9], "action": "scale",
                             "scale": 0.25, "name": "x"},
                {"action": "weight", "fn": "surprisal"}, {"action": "mask", "renorm": False}):
        rule = parse_rule(raw, 0)
        assert parse_rule({**yaml.safe_load(rule.text()), "name": rule.name}, 0) == rule
    assert parse_rule(STAPO_RULE, 0).text() == "{adv: pos, prob: [0, 0.002], entropy_q: [0, 0.8], action: mask}"
    assert parse_rules(None) == () and parse_rules([]) == ()


def test_presets_are_their_rules_in_the_grammar():
    assert [r.text() for r in STAPOConfig().preset_rules()] == [parse_rule(STAPO_RULE, 0).text()]
    assert Entropy20Config().preset_rules()[0].text() == "{entropy_q: [0, 0.8], action: mask, renorm: false}"
    assert DAPOConfig().preset_rules() == ()
