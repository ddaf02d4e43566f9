"""The model-verifier hook (off by default).

On CPU it is exercised with a random-init tiny model for PLUMBING ONLY: loading the verifier
engine (a RolloutWorker actor), rendering the judge prompt within the context, greedy decoding,
parsing, and wiring into RewardPool. A 0.5M-param random model cannot judge maths, so no test
here says anything about verdict quality; CompassVerifier-3B on a GPU is the real use.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from stapoctl.rollout.model_verifier import ModelVerifier, parse_verdict
from stapoctl.reward.pool import Verdict


@pytest.mark.parametrize(
    "text,expected",
    [
        ("A", True),  # CompassVerifier's letter for CORRECT
        (" B\n", False),  # INCORRECT
        ("C", False),  # INVALID counts as incorrect
        ("correct", True),  # the word forms
        ("INCORRECT.", False),  # must not be read as "CORRECT"
        ("The answer is INVALID", False),
        ("", None),  # said nothing: keep the rule verdict
        ("Dunno", None),
    ],
)
def test_parse_verdict(text, expected):
    assert parse_verdict(text) is expected


def _offline_verifier(mode: str, judged: list):
    """The correction logic alone: judge() answers from a list instead of an engine (no model)."""
    mv = object.__new__(ModelVerifier)
    mv.mode, mv.flipped, mv.calls = mode, 0, 0
    asked = []

    def judge(questions, references, responses):
        asked.extend(responses)
        return judged[: len(responses)]

    mv.judge = judge
    return mv, asked


def test_rescue_mode_only_asks_about_rejections_and_flips_on_a():
    rule = [Verdict("1", True), Verdict("2", False), Verdict(None, False)]
    mv, asked = _offline_verifier("rescue", [True, None])
    out = mv.correct(["q"] * 3, ["1", "1", "1"], ["r0", "r1", "r2"], rule)
    assert asked == ["r1", "r2"]  # the accepted response is never re-judged
    assert [v.correct for v in out] == [True, True, False]  # r1 rescued; r2 unparseable → rule kept
    assert mv.flipped == 1
    assert out[1] == replace(rule[1], correct=True)


def test_all_mode_can_also_reject():
    rule = [Verdict("1", True)]
    mv, asked = _offline_verifier("all", [False])
    assert [v.correct for v in mv.correct(["q"], ["1"], ["r0"], rule)] == [False]


@pytest.mark.engine
def test_verifier_engine_plumbing_with_random_tiny_model(tmp_path, ray_runtime):
    """Real loading through reward_pool(reward.model_verifier=<dir>) and a real vLLM actor."""
    import ray

    from stapoctl.config.schema import RewardConfig, TinyModelConfig
    from stapoctl.launch.ray_runtime import ensure_ray, shutdown_ray
    from stapoctl.models.tiny import build_random
    from stapoctl.rollout.model_verifier import reward_pool

    model_dir = build_random(tmp_path / "judge", TinyModelConfig(), seed=0)
    started = not ray.is_initialized()
    ensure_ray(None)
    cfg = RewardConfig(num_workers=1, model_verifier=str(model_dir), model_verifier_mode="all",
                       model_verifier_max_model_len=512, model_verifier_max_tokens=4)
    pool = reward_pool(cfg)
    try:
        mv = pool.model_verifier
        long_response = "step " * 2000 + "\\boxed{5}"
        ids = mv.render("What is 2+3?", "5", long_response)
        assert len(ids) <= 512 - 4  # fitted to the judge's context, answer end kept
        engine, mv.worker = mv.worker, _Recording(mv.worker)
        questions, refs, responses = ["What is 2+3?"] * 2, ["5", "5"], ["\\boxed{5}", "\\boxed{6}"]
        raw = mv.judge(questions, refs, responses)
        # the engine was asked the rendered prompts, greedily, for at most max_tokens; the verdicts are its answers
        (prompts, kw), texts = mv.worker.asked[0], mv.worker.texts[0]
        assert prompts == [mv.render(q, r, y) for q, r, y in zip(questions, refs, responses)]
        assert kw["temperature"] == 0.0 and kw["max_tokens"] == 4 and kw["n"] == 1
        assert raw == [parse_verdict(t) for t in texts]
        rewards, stats = pool.score(responses, refs, questions=["q", "q"])
        (asked, _), judged = mv.worker.asked[1], [parse_verdict(t) for t in mv.worker.texts[1]]
        assert len(asked) == 2  # mode=all: the rule's acceptance is judged too
        rule = [True, False]  # \\boxed{5} is 5, \\boxed{6} is not
        assert rewards == [1.0 if (rule[i] if j is None else j) else -1.0 for i, j in enumerate(judged)], (texts, judged)
        assert stats["reward/accuracy"] == rewards.count(1.0) / 2
        assert mv.calls == 4
    finally:
        if isinstance(pool.model_verifier.worker, _Recording):
            pool.model_verifier.worker = engine
        pool.close()
        if started:
            shutdown_ray()


class _Recording:
    """The judge's vLLM actor, recording the prompts and arguments of each `generate` and its texts."""

    def __init__(self, worker):
        self.worker, self.asked, self.texts = worker, [], []
        self.generate = SimpleNamespace(remote=self._generate)

    def _generate(self, prompts, **kw):
        import ray

        out = ray.get(self.worker.generate.remote(prompts, **kw))
        self.asked.append(([list(p) for p in prompts], kw))
        self.texts.append([samples[0].text for samples in out])
        return ray.put(out)
