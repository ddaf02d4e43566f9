"""The sync canary at step 1 of a first run on fresh engines, over several starts.

    python benchmarks/_first_step_canary.py [--starts 6] [--uri sqlite:////tmp/canary.db]

Each start opens a fresh EngineSession (new Ray, two vLLM workers with the gloo weight path, one
learner), trains one step of the embedded default (`rollout.old_logprob_source=recompute`, so the
learner measures every row) and prints `rollout/logprob_diff_max` (max |learner − vLLM| over the
response tokens) and `actor/grad_norm`. A clean start reads ~3e-6; a start hit by the learner's
first-forward effect (docs/PERFORMANCE.md, "One finding") reads 6e-4 to 8e-4 and a grad norm
~1e-6 off. Measured here on 2026-11-26 (Intel CPU, no MKL shim), this script on the embedded
default: 1 of 8 starts off (3.2e-4) before the learner ran its discarded forward on every CPU
(commit 1fefb8e), 0 of 6 after; the same probe on the test suite's smaller warm start (the
weight-transport e2e's runs): 8 of 16 off before, 0 of 6 after. A diagnostic (no peer, no
target): not part of `stapoctl bench all`.
"""

from __future__ import annotations

import argparse
import sys

OVERRIDES = ["trainer.total_steps=1", "trainer.save_freq=0", "eval.every_n_steps=0", "trainer.val_before_train=false",
             "rollout.old_logprob_source=recompute", "rollout.weight_sync=gloo", "rollout.num_workers=2",
             "rollout.cpus_per_worker=0.5", "learner.cpus=0.5"]
OFF = 1e-4  # above this the step-1 canary is off (clean: ~3e-6)


def main(argv: list[str]) -> int:
    import mlflow
    from rich.console import Console

    from stapoctl.config.compose import compose_config
    from stapoctl.trainer.driver import train
    from stapoctl.trainer.session import EngineSession

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=6)
    parser.add_argument("--uri", default="sqlite:////tmp/stapoctl-first-step-canary.db")
    args = parser.parse_args(argv)
    console = Console()
    conf = compose_config(OVERRIDES + [f"tracking.uri={args.uri}"])
    off = 0
    for start in range(args.starts):
        with EngineSession(Console(quiet=True)) as session:
            run_id = train(conf, console=Console(quiet=True), session=session)["run_id"]
        metrics = mlflow.MlflowClient(args.uri).get_run(run_id).data.metrics
        diff, grad = metrics["rollout/logprob_diff_max"], metrics["actor/grad_norm"]
        off += diff > OFF
        verdict = "[red]off[/]" if diff > OFF else "clean"
        console.print(f"start {start + 1}/{args.starts}: rollout/logprob_diff_max {diff:.3g}  "
                      f"actor/grad_norm {grad:.10f}  {verdict}", soft_wrap=True)
    console.print(f"{off} of {args.starts} starts off (step-1 canary > {OFF:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
