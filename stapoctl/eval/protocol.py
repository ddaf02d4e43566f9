"""The evaluation protocol of a validation or an `eval`: what its accuracies mean, as one canonical
JSON whose sha256 is tagged on the run (`keys.PROTOCOL`, the JSON itself the artifact
`keys.PROTOCOL_ARTIFACT`, so `sha256sum` of the artifact is the tag).

A system prompt or a decoding change moves reported numbers by whole points, more than any
method difference a few seeds can show; `compare` therefore refuses rows recorded under
different protocols. Fields:
- benches: per benchmark its problems' sha256 (over id, problem text and reference answer as
  scored, so a prepped copy and the hub's agree and `--limit` differs), their count and k; the
  generated toy set adds its generator's settings;
- decodings (name → temperature, top-p), max_tokens, prompt (template, instruction);
- verifier (name, version, the sympy it runs on, a model verifier's settings) and
  answer_extraction (`reward/extract.py`).
The sampling seed is no part of it: it is the run's randomness, not its protocol.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Sequence

SCHEMA = 1  # of the JSON below: a new field is a new schema, never a silent change


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def problems_sha256(problems: Sequence[Any]) -> str:
    """The problems as scored: one JSON line [id, problem, answer] each, in order."""
    return _sha256("".join(json.dumps([str(p.id), str(p.question), str(p.answer)], ensure_ascii=False) + "\n"
                           for p in problems))


def _plain(cfg: Any) -> dict:
    """A config group (DictConfig, dataclass or namespace) as a plain dict."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return dict(OmegaConf.to_container(cfg, resolve=True))
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return dict(vars(cfg))


def bench_entry(bench: str, problems: Sequence[Any], k: int, data_cfg: Any) -> dict:
    """One benchmark's part: problems' sha256, count, k (+ the generator's settings for toy)."""
    from stapoctl.data.sources import SOURCES

    entry: dict[str, Any] = {"problems": len(problems), "sha256": problems_sha256(problems), "k": int(k)}
    if SOURCES[bench].kind == "toy":
        entry["generator"] = _plain(data_cfg.toy)
    return entry


def _verifier(reward_cfg: Any) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    from stapoctl.reward.pool import VERIFIER

    try:
        sympy = version("sympy")
    except PackageNotFoundError:  # pragma: no cover - sympy is a dependency
        sympy = None
    judge = None
    if reward_cfg.get("model_verifier"):
        prompt = reward_cfg.get("model_verifier_prompt")
        judge = {"model": str(reward_cfg.model_verifier), "mode": str(reward_cfg.model_verifier_mode),
                 "prompt_sha256": _sha256(str(prompt)) if prompt else "built-in",
                 "max_tokens": int(reward_cfg.model_verifier_max_tokens)}
    return {**VERIFIER, "sympy": sympy, "model_verifier": judge}


def build(conf: Any, benches: Mapping[str, tuple[Sequence[Any], int]], decodings: Sequence[Any]) -> dict:
    """The protocol of evaluating `benches` (name → (problems, k)) under `decodings` with conf's
    eval, data and reward settings."""
    from stapoctl.reward.extract import EXTRACTION

    return {
        "schema": SCHEMA,
        "benches": {b: bench_entry(b, problems, k, conf.data) for b, (problems, k) in benches.items()},
        "decodings": {d.name: {"temperature": float(d.temperature), "top_p": float(d.top_p)} for d in decodings},
        "max_tokens": int(conf.eval.max_response_length),
        "prompt": {"template": str(conf.data.template), "instruction": str(conf.data.instruction)},
        "verifier": _verifier(conf.reward),
        "answer_extraction": dict(EXTRACTION),
    }


def canonical(protocol: Mapping) -> str:
    """Sorted keys, no spaces, UTF-8: one text per protocol, whatever built it."""
    return json.dumps(protocol, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(protocol: Mapping) -> str:
    return _sha256(canonical(protocol))


def record(protocol: Mapping, log_text, set_tags) -> str:
    """Log the canonical JSON as the artifact and its sha256 as the tag; returns the sha256."""
    from stapoctl.tracking import keys

    text = canonical(protocol)
    log_text(text, keys.PROTOCOL_ARTIFACT)
    sha = _sha256(text)
    set_tags({keys.PROTOCOL: sha})
    return sha


def flatten(protocol: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted path → leaf value (`decodings.train.temperature` → 1.0)."""
    if not isinstance(protocol, Mapping):
        return {prefix: protocol}
    out: dict[str, Any] = {}
    for key, value in protocol.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out.update(flatten(value, path) if isinstance(value, Mapping) and value else {path: value})
    return out


def differing_fields(protocols: Sequence[Mapping]) -> list[str]:
    """The dotted fields whose values are not the same in every protocol (absent counts as a value)."""
    flat = [flatten(p) for p in protocols]
    paths = sorted({k for f in flat for k in f})
    absent = "<absent>"
    return [k for k in paths if len({json.dumps(f.get(k, absent), sort_keys=True) for f in flat}) > 1]
