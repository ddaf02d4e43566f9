"""Golden values of every registered loss, recorded before #50's refactor ("one loss contract and one
learner", behaviour unchanged) and checked bit for bit after it.

For every loss in the registry (whatever ``stapoctl.losses`` registers on import; a loss registered
later without an entry in tests/golden/losses.json fails by name) and every case below (its registered
default config with every extra input it accepts, the default as the synchronous learner calls it, and
for most losses one or two non-default configs), the mini-batch of 4 rows x 7 tokens stored in the JSON
goes through the learner's public path: ``prepare_minibatch`` on the whole mini-batch, then
``compute_policy_loss`` on two micro-batches of 2 rows with ``slice_context``, each micro-batch's loss
differentiated w.r.t. its own log-prob leaf (and its entropy's, when ``entropy_coef != 0``: the learner
then passes an entropy with a gradient). Recorded: each micro-batch's loss and every metric it returns,
and the gradients. Inputs are fp32, as the learner's (the losses compute in fp32 whatever they get).
The comparison is exact (``==``, NaN equal to NaN, -0.0 equal to 0.0): the same bits came out under
ATEN_CPU_CAPABILITY=default, avx2 and avx512 (2026-12-07, torch 2.13), so no op here needs a tolerance.

Only ``_call`` knows the loss API: a refactor that changes how a loss is called edits that function,
never the JSON.

Regenerate (only on the commit whose behaviour is the reference, and say so in its message)::

    STAPOCTL_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden_losses.py -q -p no:cacheprovider

which draws the inputs again from ``SEED`` and rewrites tests/golden/losses.json; without the variable
the test only reads it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import stapoctl.losses  # noqa: F401  (registers every method)
from stapoctl.losses import LOSSES, compute_policy_loss, prepare_minibatch, slice_context

# dapo/per_microbatch_norm_is_cap_alias passes the old name on purpose
pytestmark = pytest.mark.filterwarnings("ignore:is_cap is renamed:FutureWarning")
GOLDEN = Path(__file__).parent / "golden" / "losses.json"
REGEN = os.environ.get("STAPOCTL_REGEN_GOLDEN") == "1"
SEED = 83  # a draw where STAPO silences tokens in both micro-batches (all of row 2) and STARE's gate is on
B, T = 4, 7
LENGTHS = [7, 5, 2, 6]  # right padding in rows 1-3
MICRO_ROWS = [(0, 2), (2, 4)]  # two micro-batches of 2 rows; prompt 1 (rows 1, 2) spans both
GROUP_IDS = [0, 1, 1, 2]  # prompt 2 has no winner (WAPO)
ADVANTAGES = [0.9, -0.6, 1.3, -1.1]  # [B], as the learner passes them
GLOBAL_STEP, MAX_RESPONSE_LENGTH = 3, 8
# padding values no loss may read (the learner's are finite too)
PAD = {"log_prob": -30.0, "old_log_prob": 5.0, "behavior_log_prob": -40.0, "ref_log_prob": 3.0,
       "entropy": 9.0, "sum_p2": 7.0, "hidden_norm": 100.0}
TOKEN_KEYS = tuple(PAD)
# the extras of a call: "all" = every extra input a loss accepts (is_cap aside, the old name of a
# config field, see dapo's case); "sync" = what the synchronous learner passes (no behaviour
# log-probs, no reference without a KL term, no hidden norm)
ALL_EXTRAS = ("group_ids", "global_step", "max_response_length", "sum_p2", "hidden_norm", "ref_log_prob",
              "behavior_log_prob")
SYNC_EXTRAS = ("group_ids", "global_step", "max_response_length", "sum_p2")

# name -> [(case, config overrides, extras, extra scalar extras)] beyond the two default cases
NON_DEFAULT: dict[str, list[tuple[str, dict, tuple, dict]]] = {
    "grpo": [("kl_entropy_shadow", dict(kl_coef=0.05, entropy_coef=0.01, rollout_correction="token_mask",
                                        shadow=["stapo", "entropy20"]), ALL_EXTRAS, {})],
    "dapo": [("rules_dual_clip_seq_tis", dict(
        loss_agg_mode="seq-mean-token-sum-norm", clip_ratio_c=3.0, rollout_correction="seq_tis",
        token_rules=[{"adv": "neg", "rel_position": [0.5, 1], "action": "scale", "scale": 0.5, "name": "late_neg"},
                     {"prob": [0, 0.1], "action": "weight", "fn": "surprisal"}],
        shadow=["table1"]), ALL_EXTRAS, {}),
             ("per_microbatch_norm_is_cap_alias", dict(loss_agg_mode="seq-mean-token-sum", per_microbatch_norm=True),
              ALL_EXTRAS, {"is_cap": 3.0})],
    "justrl": [("seq_mask_k2", dict(rollout_correction="seq_mask", rollout_is_cap=1.5, kl_coef=0.02,
                                    kl_estimator="k2"), ALL_EXTRAS, {})],
    "stapo": [("seq_mean_no_renorm_kl_abs_entropy_min", dict(
        loss_agg_mode="seq-mean-token-mean", renormalize=False, tau_p=0.05, tau_h=0.4, kl_coef=0.1,
        kl_estimator="abs", entropy_coef=-0.02, quantile_interpolation="midpoint"), ALL_EXTRAS, {})],
    "stapo_prob_only": [("tau_p_0.3_correction_off", dict(tau_p=0.3, rollout_correction="off"), ALL_EXTRAS, {})],
    "stapo_high_entropy": [("tau_h_0.5_lower", dict(tau_h=0.5, tau_p=0.1, quantile_interpolation="lower"),
                            ALL_EXTRAS, {})],
    "entropy20": [("half_renorm_seq_sum", dict(top_entropy_frac=0.5, renormalize=True,
                                               loss_agg_mode="seq-mean-token-sum"), ALL_EXTRAS, {})],
    "wapo": [("winners_all_kl_rule", dict(winner_norm="winners", prompt_norm="all", clip_ratio_high=0.22,
                                          kl_coef=0.05, token_rules=[{"adv": "pos", "prob": [0, 0.01],
                                                                      "action": "mask"}]), ALL_EXTRAS, {})],
    "tr_grpo": [("tr_weighted_kl", dict(kl_coef=0.001, tau=2.0), ALL_EXTRAS, {}),
                ("k1_divide", dict(kl_coef=0.05, kl_estimator="k1", tau_mode="divide"), ALL_EXTRAS, {})],
    "ppl_shaping": [("alpha_0.5_unbiased", dict(alpha=0.5, std_mode="unbiased", adv_eps=0.01), ALL_EXTRAS, {})],
    "position_shaping": [("window_on_spec", dict(start_step=2, stop_step=10, direction=-1.0, rel_pos_mode="spec",
                                                 gamma=0.5), ALL_EXTRAS, {}),
                         ("window_off", dict(start_step=5), ALL_EXTRAS, {})],
    "stare": [("c2_gate_on", dict(stare_m=0.9, stare_target_entropy=2.0, stare_top_ratio=0.3, stare_w=1.5),
               ALL_EXTRAS, {})],
    "advantage_reweighting": [("alpha_0.2_per_microbatch", dict(ar_alpha=0.2, per_microbatch_norm=True),
                               ALL_EXTRAS, {})],
}


def cases_of(name: str) -> list[tuple[str, dict, tuple, dict]]:
    return [("default", {}, ALL_EXTRAS, {}), ("default_sync", {}, SYNC_EXTRAS, {})] + NON_DEFAULT.get(name, [])


def all_cases() -> list[tuple[str, str, dict, tuple, dict]]:
    return [(name, *case) for name in LOSSES for case in cases_of(name)]


# -- inputs -----------------------------------------------------------------------------------


def draw_inputs() -> dict[str, Any]:
    """The mini-batch, drawn from SEED (only when regenerating; the test reads the stored copy).
    About 45% of the tokens have π < 2e-3 (STAPO's τ_p); ratios leave the clip range both ways,
    one by e^2.5 on a negative row (dual clip); π_old/π_behav leave [1/2, 2]; one token has
    log(π_ref/π) = 4 (k3's clamp); H ~ Exp(mean 0.25) (STARE's gate at 0.3 decides on the batch)."""
    g = torch.Generator().manual_seed(SEED)

    def u(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    def n(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    low = u(B, T) < 0.45
    lp = torch.where(low, -(6.5 + 2.5 * u(B, T)), -(0.01 + 2.5 * u(B, T)))
    old = (lp + 0.25 * n(B, T)).clamp(max=-1e-4)
    old[1, 2] = lp[1, 2] - 2.5
    behav = old + 0.4 * n(B, T)
    ref = lp + 1.2 * n(B, T)
    ref[0, 3] = lp[0, 3] + 4.0
    ent = -0.25 * u(B, T).clamp(min=1e-12).log()
    prob = lp.exp()
    sum_p2 = prob ** 2 + u(B, T) * (1.0 - prob) ** 2
    hidden = 0.5 + 2.5 * u(B, T)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    tokens = {"log_prob": lp, "old_log_prob": old, "behavior_log_prob": behav, "ref_log_prob": ref,
              "entropy": ent, "sum_p2": sum_p2, "hidden_norm": hidden}
    out: dict[str, Any] = {k: torch.where(mask, v, PAD[k]).float().tolist() for k, v in tokens.items()}
    out.update(response_mask=mask.tolist(), advantages=torch.tensor(ADVANTAGES).tolist(), group_ids=GROUP_IDS,
               global_step=GLOBAL_STEP, max_response_length=MAX_RESPONSE_LENGTH, micro_rows=MICRO_ROWS)
    return out


def tensors(stored: dict[str, Any]) -> dict[str, Any]:
    """The stored inputs as the learner holds them: fp32 [B, T] tokens, bool mask, fp32 [B] advantages,
    long [B] group ids, ints."""
    out: dict[str, Any] = {k: torch.tensor(stored[k], dtype=torch.float32) for k in TOKEN_KEYS}
    out["response_mask"] = torch.tensor(stored["response_mask"], dtype=torch.bool)
    out["advantages"] = torch.tensor(stored["advantages"], dtype=torch.float32)
    out["group_ids"] = torch.tensor(stored["group_ids"], dtype=torch.long)
    out.update(global_step=int(stored["global_step"]), max_response_length=int(stored["max_response_length"]),
               micro_rows=[slice(a, b) for a, b in stored["micro_rows"]])
    return out


# -- the one place that knows the loss API ------------------------------------------------------


def _call(name: str, cfg_overrides: dict, inputs: dict[str, Any]) -> dict[str, Any]:
    """The learner's path (learner/ppo_step.py `_minibatch_context`, `_micro_loss`) on ``inputs``:
    returns {"micro_batches": [{"loss", "loss_dtype", "metrics"}], "grad_log_prob": [B][T],
    "grad_entropy": [B][T] or None}. ``inputs["extras"]`` names the extra inputs passed, and
    ``inputs["scalar_extras"]`` adds more (is_cap). The config object is built once, as the learner
    builds it at set-up (`config.loss_settings.build_loss_config`), and passed as it is."""
    conf = LOSSES[name].config_cls(**cfg_overrides)  # the learner's loss_config
    extras_on = set(inputs["extras"])
    rows_keys = [k for k in ("group_ids", "sum_p2", "hidden_norm", "ref_log_prob", "behavior_log_prob")
                 if k in extras_on]
    scalars = {k: inputs[k] for k in ("global_step", "max_response_length") if k in extras_on}
    scalars.update(inputs.get("scalar_extras") or {})
    bonus = float(conf.entropy_coef or 0.0) != 0
    context = prepare_minibatch(
        conf, log_prob=inputs["log_prob"].detach(), advantages=inputs["advantages"],
        response_mask=inputs["response_mask"], entropy=inputs["entropy"].detach(),
        old_log_prob=inputs["old_log_prob"], **{k: inputs[k] for k in rows_keys}, **scalars)
    micro, grad_lp, grad_ent = [], [], []
    for rows in inputs["micro_rows"]:
        lp = inputs["log_prob"][rows].clone().requires_grad_(True)
        ent = inputs["entropy"][rows].clone().requires_grad_(bonus)
        loss, metrics = compute_policy_loss(
            conf, log_prob=lp, old_log_prob=inputs["old_log_prob"][rows], advantages=inputs["advantages"][rows],
            response_mask=inputs["response_mask"][rows], entropy=ent,
            **{k: inputs[k][rows] for k in rows_keys}, **scalars, **slice_context(context, rows))
        leaves = [lp, ent] if bonus else [lp]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        grad_lp.append(torch.zeros_like(lp) if grads[0] is None else grads[0])
        if bonus:
            grad_ent.append(torch.zeros_like(ent) if grads[1] is None else grads[1])
        micro.append({"loss": float(loss.detach()), "loss_dtype": str(loss.dtype),
                      "metrics": dict(metrics)})
    return {"micro_batches": micro, "grad_log_prob": torch.cat(grad_lp).tolist(),
            "grad_entropy": torch.cat(grad_ent).tolist() if bonus else None}


# -- recording and comparing ------------------------------------------------------------------


def compute(name: str, overrides: dict, extras: tuple, scalar_extras: dict, stored_inputs: dict) -> dict:
    inputs = dict(tensors(stored_inputs), extras=extras, scalar_extras=scalar_extras)
    out = _call(name, overrides, inputs)
    return {"config": overrides, "extras": list(extras), "scalar_extras": scalar_extras, **out}


def _regenerate() -> dict:
    stored = draw_inputs()
    golden = {"_doc": "tests/test_golden_losses.py: regenerate with STAPOCTL_REGEN_GOLDEN=1, never by hand",
              "torch": torch.__version__, "inputs": stored, "cases": {}}
    for name, case, overrides, extras, scalar_extras in all_cases():
        golden["cases"][f"{name}/{case}"] = compute(name, overrides, extras, scalar_extras, stored)
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True, allow_nan=True) + "\n")
    return golden


@pytest.fixture(scope="module")
def golden() -> dict:
    if REGEN:
        return _regenerate()
    assert GOLDEN.exists(), f"{GOLDEN} is missing: STAPOCTL_REGEN_GOLDEN=1 writes it (on the reference commit)"
    return json.loads(GOLDEN.read_text())


def same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of two JSON values (floats by ==, NaN equal to NaN, -0.0 equal to 0.0)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def differences(got: dict, want: dict, where: str = "") -> list[str]:
    """Where two results differ, as `path: got != want` lines (the first few), for the failure message."""
    out: list[str] = []
    if isinstance(got, dict) and isinstance(want, dict):
        for k in sorted(set(got) | set(want)):
            if k not in got or k not in want:
                out.append(f"{where}/{k}: {'missing' if k not in got else 'new'} (golden has it: {k in want})")
            else:
                out += differences(got[k], want[k], f"{where}/{k}")
    elif isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        for i, (x, y) in enumerate(zip(got, want)):
            out += differences(x, y, f"{where}[{i}]")
    elif not same(got, want):
        out.append(f"{where}: {got!r} != {want!r}")
    return out


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_registered_loss_has_golden_values(golden, name):
    recorded = {key.split("/")[0] for key in golden["cases"]}
    assert name in recorded, (f"loss {name!r} has no golden values in {GOLDEN.name}: record them with "
                              "STAPOCTL_REGEN_GOLDEN=1 (tests/test_golden_losses.py)")


def test_no_golden_case_is_left_without_its_loss(golden):
    """A loss renamed or removed leaves entries that nothing checks any more."""
    wanted = {f"{name}/{case}" for name, case, *_ in all_cases()}
    assert set(golden["cases"]) == wanted, sorted(set(golden["cases"]) ^ wanted)
    assert set(NON_DEFAULT) <= set(LOSSES), sorted(set(NON_DEFAULT) - set(LOSSES))


def test_the_inputs_exercise_what_they_should(golden):
    """The stored batch has what the cases rely on (else a loss's branch would go unrecorded)."""
    x = tensors(golden["inputs"])
    m = x["response_mask"]
    assert not m.all() and m.any(dim=1).all()
    pos = m & (x["advantages"][:, None] > 0)
    h_star = torch.quantile(x["entropy"][m], 0.8)
    silenced = pos & (x["log_prob"].exp() < 2e-3) & (x["entropy"] < h_star)  # STAPO's S2T
    assert [int(silenced[a:b].sum()) for a, b in golden["inputs"]["micro_rows"]] == [3, 2]
    assert (pos & (x["log_prob"].exp() < 2e-3) & (x["entropy"] >= h_star)).any()  # stapo_high_entropy's
    assert x["entropy"][m].mean() < 0.3  # STARE's default gate is on
    assert (m & ((x["log_prob"] - x["old_log_prob"]).exp() > 10)).any()  # dual clip at c = 3 and 10
    assert (m & ((x["old_log_prob"] - x["behavior_log_prob"]).abs() > math.log(2))).any()  # TIS cap 2
    assert (m & (x["ref_log_prob"] - x["log_prob"] > 3)).any()  # k3 clamp at 10


@pytest.mark.parametrize(("name", "case", "overrides", "extras", "scalar_extras"), all_cases(),
                         ids=[f"{n}/{c}" for n, c, *_ in all_cases()])
def test_golden(golden, name, case, overrides, extras, scalar_extras):
    key = f"{name}/{case}"
    want = golden["cases"].get(key)
    assert want is not None, f"no golden entry {key!r}: record it with STAPOCTL_REGEN_GOLDEN=1"
    got = compute(name, overrides, extras, scalar_extras, golden["inputs"])
    assert same(json.loads(json.dumps(got)), want), f"{key} changed:\n" + "\n".join(differences(
        json.loads(json.dumps(got)), want)[:20])
