"""`python -m stapoctl.testbed.entropy_profile MODEL_DIR [overrides]`: the token-entropy profile
(`models.entropy_profile`) of any HF model dir, a checkpoint say, on the held-out toy problems.
A testbed tool: it composes a config, so it sits above the model code it measures."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

import torch

from stapoctl.models.entropy_profile import measure


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure a model dir's profile on the held-out toy problems and print it as JSON."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapoctl.config.compose import compose_config
    from stapoctl.data import toy
    from stapoctl.data.templates import render_prompt
    from stapoctl.models.warm_start import sample_ids

    ap = argparse.ArgumentParser(prog="python -m stapoctl.testbed.entropy_profile", description=main.__doc__)
    ap.add_argument("model_dir")
    ap.add_argument("--samples", type=int, default=4, help="T=1.0 samples per held-out problem")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides selecting the toy task (data.toy.*)")
    args = ap.parse_args(argv)
    conf = compose_config(list(args.overrides))
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    probs = toy.problems(conf.data.toy, "heldout")
    prompts = [render_prompt(p.problem, template=conf.data.template, instruction=conf.data.instruction,
                             tokenizer=tok) for p in probs]
    ids = sample_ids(model, tok, prompts, n=args.samples, temperature=1.0,
                     max_new_tokens=int(conf.rollout.max_response_length), seed=args.seed)
    report = measure(model, tok, prompts, ids, [str(p.answer) for p in probs])
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
