"""The generated toy task: worked answers by hand, disjoint splits, the designed unboxed share,
and how the rule reward scores each answer form (the headroom RL is meant to close)."""

from __future__ import annotations

import pytest

from stapoctl.config.schema import DataConfig, ToyTaskConfig
from stapoctl.data import toy
from stapoctl.data.registry import load_rows
from stapoctl.errors import UserError
from stapoctl.reward import dapo_reward


def test_worked_answer_is_right_by_hand():
    p = toy.ToyProblem(27, 8, 7)
    assert p.problem == "Compute 27 + 8 * 7."
    assert p.answer == 83  # 8*7 = 56, 27 + 56 = 83
    assert p.solution(boxed=True) == "8*7=56. 27+56=83. \\boxed{83}"
    assert p.solution(boxed=False) == "8*7=56. 27+56=83. answer 83"


def test_reward_credits_only_the_boxed_form_and_rebox_recovers_the_arithmetic():
    p = toy.ToyProblem(27, 8, 7)
    boxed, unboxed = p.solution(True), p.solution(False)
    assert dapo_reward(boxed, "83") == 1.0
    assert dapo_reward(unboxed, "83") == -1.0  # right arithmetic, no box: the RL headroom
    assert toy.rebox(unboxed) == boxed
    assert dapo_reward(toy.rebox("8*7=56. 27+56=84. answer 84"), "83") == -1.0
    assert toy.rebox(boxed) == boxed


def test_splits_are_disjoint_seeded_and_cover_the_space():
    cfg = ToyTaskConfig()
    train, heldout = toy.split_problems(cfg)
    space = (cfg.addend_max - cfg.operand_min + 1) * (cfg.factor_max - cfg.operand_min + 1) ** 2
    assert space == 29 * 8 * 8 == 1856
    assert len(heldout) == cfg.num_heldout == 256
    assert len(train) == min(cfg.num_train, space - 256) == 1600
    assert not set(train) & set(heldout)
    assert toy.split_problems(cfg) == (train, heldout)
    other_train, other_heldout = toy.split_problems(ToyTaskConfig(seed=cfg.seed + 1))
    assert other_heldout != heldout


def test_demos_mix_boxed_and_unboxed_at_the_configured_fraction():
    pool, _ = toy.split_problems(ToyTaskConfig())
    demos = list(toy.demos(pool, 20000, unboxed_fraction=0.6, seed=0))
    share = sum("\\boxed" not in text for _, text in demos) / len(demos)
    assert share == pytest.approx(0.6, abs=0.015)
    assert all(text == p.solution("\\boxed" in text) for p, text in demos[:200])
    assert demos[:50] == list(toy.demos(pool, 50, unboxed_fraction=0.6, seed=0))
    assert all("\\boxed" in t for _, t in toy.demos(pool, 200, unboxed_fraction=0.0, seed=1))


def test_toy_rows_go_through_the_same_template_machinery():
    data = DataConfig(template="plain")
    rows = load_rows("toy", data)
    train = load_rows("toy-train", data)
    assert len(rows) == 256 and len(train) == 1600
    row = rows[0]
    a, b, c = row["a"], row["b"], row["c"]
    assert row["answer"] == str(a + b * c)
    assert row["prompt"] == (
        f"Compute {a} + {b} * {c}.\n"
        "Please reason step by step, and put your final answer within \\boxed{}.\n"
    )
    assert {r["id"] for r in rows}.isdisjoint(r["id"] for r in train)


def test_bad_toy_config_is_a_user_error_naming_the_field():
    with pytest.raises(UserError, match="data.toy.num_heldout=5000"):
        toy.split_problems(ToyTaskConfig(num_heldout=5000))
    with pytest.raises(UserError, match="data.toy.operand_min"):
        toy.split_problems(ToyTaskConfig(operand_min=50))
