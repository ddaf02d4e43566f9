"""The generated toy task: worked answers by hand in every phrasing, disjoint splits, the
designed fork shares of the demos, and how the rule reward scores each answer form (the
headroom RL is meant to close)."""

from __future__ import annotations

import itertools
import re

import pytest

from stapoctl.config.schema import DataConfig, TinyModelConfig, ToyTaskConfig
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
    every_variant = toy.Phrasing(boxed=False, swap_product=True, swap_sum=True, semicolons=(True, False),
                                 cross=True, spaced_eq=(False, True))
    assert p.write(every_variant) == "7x8=56; 56+27 = 83. answer 83"
    assert p.write(toy.Phrasing(semicolons=(False, True), spaced_eq=(True, False))) == "8*7 = 56. 27+56=83; \\boxed{83}"


def all_phrasings():
    for boxed, sp, ss, s1, s2, cross, e1, e2 in itertools.product([True, False], repeat=8):
        yield toy.Phrasing(boxed, sp, ss, (s1, s2), cross, (e1, e2))


def test_reward_credits_every_boxed_phrasing_and_rebox_recovers_the_arithmetic():
    """The forks other than the ending are reward-neutral: every phrasing of a right answer
    scores +1 boxed and -1 unboxed (right arithmetic, no box: the RL headroom)."""
    p = toy.ToyProblem(27, 8, 7)
    phrasings = list(all_phrasings())
    assert len({p.write(ph) for ph in phrasings}) == 256
    for ph in phrasings:
        text = p.write(ph)
        assert dapo_reward(text, "83") == (1.0 if ph.boxed else -1.0), text
        assert dapo_reward(toy.rebox(text), "83") == 1.0, text
        assert toy.rebox(text) == p.write(toy.Phrasing(**{**ph.__dict__, "boxed": True}))
    assert dapo_reward(toy.rebox("8*7=56. 27+56=84. answer 84"), "83") == -1.0


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


def test_demos_take_each_fork_at_its_configured_share():
    pool, _ = toy.split_problems(ToyTaskConfig())
    mix = TinyModelConfig()
    demos = list(toy.demos(pool, 40000, mix, seed=0))
    texts = [t for _, t in demos]

    def share(pattern: str, per_demo: int = 1) -> float:
        return sum(len(re.findall(pattern, t)) for t in texts) / (per_demo * len(texts))

    assert share(r"answer \d+$") == pytest.approx(mix.unboxed_fraction, abs=0.01)
    assert share(r";", per_demo=2) == pytest.approx(mix.semicolon_fraction, abs=0.01)  # per step
    assert share(r"\dx\d") == pytest.approx(mix.cross_fraction, abs=0.004)
    assert share(r" = ", per_demo=2) == pytest.approx(mix.spaced_eq_fraction, abs=0.002)
    swapped = [(p, t) for p, t in demos if p.b != p.c and re.match(rf"{p.c}[*x]{p.b}\b", t)]
    plain = [(p, t) for p, t in demos if p.b != p.c]
    assert len(swapped) / len(plain) == pytest.approx(mix.swapped_product_fraction, abs=0.01)
    # every demo is a right worked answer in one of the phrasings
    assert all(t in {p.write(ph) for ph in all_phrasings()} for p, t in demos[:100])
    assert demos[:50] == list(toy.demos(pool, 50, mix, seed=0))
    canonical = TinyModelConfig(unboxed_fraction=0.0, swapped_product_fraction=0.0, swapped_sum_fraction=0.0,
                                semicolon_fraction=0.0, cross_fraction=0.0, spaced_eq_fraction=0.0)
    assert all(t == p.solution() for p, t in toy.demos(pool, 200, canonical, seed=1))


def test_tokenizer_corpus_has_every_phrasing():
    corpus = toy.tokenizer_corpus(ToyTaskConfig(), "Please reason.", count=200)
    joined = "\n".join(corpus)
    for piece in ("\\boxed{", "answer ", ";", "x", " = ", "Please reason."):
        assert piece in joined, piece


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
