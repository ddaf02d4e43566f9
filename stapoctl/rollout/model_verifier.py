"""Model-based verifier: a second vLLM engine that re-judges the rule verifier's rejections.

STAPO corrects the rule verifier with CompassVerifier-3B (a judge model answering A = correct,
B = incorrect, C = invalid for a question, reference and response). The engine is a regular
`RolloutWorker` actor (no second actor class) serving the verifier model with greedy decoding.

Off by default (`reward.model_verifier=null`). On this CPU machine it is exercised with the
tiny model purely as plumbing: the tiny model cannot judge anything, so only the loading,
prompting, parsing and correction paths are tested, never the quality of the verdicts.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from stapoctl.reward.pool import RewardPool

# Follows CompassVerifier's structure (question / standard answer / candidate sections, one-letter
# verdict). Set reward.model_verifier_prompt to the model card's exact prompt for best accuracy.
DEFAULT_PROMPT = (
    "You are grading a solution. Decide whether the candidate's FINAL answer is equivalent to the "
    "standard answer; the standard answer is always correct, ignore errors in the reasoning, and "
    "ignore \\boxed{{}} around answers. Reply with one letter: A (CORRECT), B (INCORRECT) or "
    "C (INVALID: cut off, repetitive, or no answer).\n"
    "<Original Question Begin>:\n{question}\n<Original Question End>\n"
    "<Standard Answer Begin>:\n{gold_answer}\n<Standard Answer End>\n"
    "<Candidate's Answer Begin>:\n{llm_response}\n<Candidate's Answer End>\n"
    "Judging the correctness of the candidate's answer:"
)

_VERDICT = re.compile(r"\b([ABC])\b|\b(CORRECT|INCORRECT|INVALID)\b")


def parse_verdict(text: str) -> bool | None:
    """True for A/CORRECT, False for B/C/INCORRECT/INVALID, None if the judge said neither."""
    m = _VERDICT.search(text.strip().upper()) if text else None
    if not m:
        return None
    token = m.group(1) or m.group(2)
    return token in ("A", "CORRECT")


class ModelVerifier:
    """Judge model behind the rule verifier: asks it only about responses the rules rejected."""

    def __init__(
        self,
        model_path: str,
        *,
        prompt: str = DEFAULT_PROMPT,
        max_tokens: int = 8,
        max_model_len: int = 4096,
        max_response_chars: int = 4000,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        dtype: str = "auto",
        mode: str = "rescue",
    ):
        from stapoctl.data.templates import load_tokenizer
        from stapoctl.launch.ray_runtime import ensure_ray
        from stapoctl.rollout.vllm_engine import EngineSpec
        from stapoctl.rollout.vllm_worker import make_rollout_worker
        from stapoctl.launch import engine_log

        if mode not in ("rescue", "all"):
            from stapoctl.errors import UserError

            raise UserError(f"reward.model_verifier_mode={mode!r} is not known: use rescue or all")
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.max_response_chars = max_response_chars
        self.mode = mode
        self.tokenizer = load_tokenizer(model_path)
        self.max_model_len = max_model_len
        t0 = time.perf_counter()
        ensure_ray(None)
        t_ray = time.perf_counter() - t0
        spec = EngineSpec(model_path=model_path, max_model_len=max_model_len, dtype=dtype)
        self.worker = make_rollout_worker(spec, num_cpus=num_cpus, num_gpus=num_gpus)
        engine_log.record_actors("judge", t0, [self.worker], t_ray=t_ray)  # tests only: the start-up table
        self.calls = 0
        self.flipped = 0

    @classmethod
    def from_config(cls, reward_cfg: Any) -> "ModelVerifier":
        """Resolve `reward.model_verifier` (HF id, dir, checkpoint or run id) and start the engine."""
        from stapoctl.models.resolve import resolve_model

        path = resolve_model(str(reward_cfg.model_verifier), None)
        return cls(
            path,
            prompt=getattr(reward_cfg, "model_verifier_prompt", None) or DEFAULT_PROMPT,
            max_tokens=int(getattr(reward_cfg, "model_verifier_max_tokens", 8)),
            max_model_len=int(getattr(reward_cfg, "model_verifier_max_model_len", 4096)),
            num_cpus=float(getattr(reward_cfg, "model_verifier_cpus", 1.0)),
            num_gpus=float(getattr(reward_cfg, "model_verifier_gpus", 0.0)),
            dtype=str(getattr(reward_cfg, "model_verifier_dtype", "auto")),
            mode=str(getattr(reward_cfg, "model_verifier_mode", "rescue")),
        )

    def render(self, question: str, reference: str, response: str) -> list[int]:
        """The judge prompt as token ids (chat template when the model has one), fitted to the context."""
        # the end of a long response holds the final answer: keep that part
        response = response[-self.max_response_chars :]
        text = self.prompt.format(question=question, gold_answer=reference, llm_response=response)
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = self.tokenizer(text)["input_ids"]
        budget = self.max_model_len - self.max_tokens
        return list(ids[-budget:]) if len(ids) > budget else list(ids)

    def judge(self, questions: Sequence[str], references: Sequence[str], responses: Sequence[str]) -> list[bool | None]:
        """Greedy verdict per (question, reference, response); None when unparseable."""
        import ray

        if not responses:
            return []
        prompts = [self.render(q, r, y) for q, r, y in zip(questions, references, responses)]
        outs = ray.get(self.worker.generate.remote(prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=self.max_tokens, seed=0))
        self.calls += len(prompts)
        return [parse_verdict(samples[0].text) for samples in outs]

    def correct(self, questions, references, responses, verdicts: list) -> list:
        """Verdicts with the judge's say: rescue mode flips rule rejections the judge calls correct."""
        ask = [i for i, v in enumerate(verdicts) if self.mode == "all" or not v.correct]
        said = self.judge([questions[i] for i in ask], [references[i] for i in ask], [responses[i] for i in ask])
        out = list(verdicts)
        for i, judged in zip(ask, said):
            if judged is None or judged == out[i].correct:
                continue
            out[i] = replace(out[i], correct=judged)
            self.flipped += 1
        return out

    def close(self) -> None:
        import ray

        worker, self.worker = getattr(self, "worker", None), None
        if worker is not None:
            try:
                ray.get(worker.shutdown.remote(), timeout=60)
            finally:
                ray.kill(worker)


def reward_pool(reward_cfg: Any) -> RewardPool:
    """The run's scorer: the rule verifier, and the judge model when `reward.model_verifier` is set
    (built here, in the engine layer, so `reward/` stays free of engines)."""
    from stapoctl.reward.pool import RewardPool

    verifier = ModelVerifier.from_config(reward_cfg) if getattr(reward_cfg, "model_verifier", None) else None
    return RewardPool(reward_cfg, model_verifier=verifier)
