"""The names runs are recorded under in MLflow: the contract between what writes runs
(`train`, `eval`, `sweep`) and what reads them back (`runs`, `compare`, `ui`).

A sweep is an MLflow parent run:
- tag `stapoctl.kind=sweep`, tag `stapoctl.sweep_id=<id>` (the parent's own run id, so a
  sweep is addressed like any run), tag `stapoctl.sweep_name` (tau_p | tau_h | ablation |
  baselines | …), param `sweep.key` (the swept Hydra key: `loss.tau_p`, or `loss` when the
  rows are methods), the definition as the artifact `sweep.yaml`.
- each trial is a nested child: tag `mlflow.parentRunId=<parent id>`, `stapoctl.kind=train`,
  `stapoctl.sweep_id`, `stapoctl.sweep_value=<value as typed>`, `stapoctl.seed=<seed>`; a
  full `train` run, so it carries every resolved config value as a param (`loss.name`,
  `loss.tau_p`, `trainer.seed`, …) and the per-step metrics below.

A confirmatory sweep (`sweep NAME confirm=PILOT`) adds tags `stapoctl.sweep_role=confirmatory` and
`stapoctl.confirms=<pilot sweep id>` and the artifact `confirm_sizing.json`.

A trial's final accuracy per benchmark and decoding is, first found: its own `eval/…` metric,
the newest eval run nested under it (`stapoctl eval --model <trial id>`), or its last step's
`val/…` metric. Accuracy metrics are `<val|eval>/<bench>/<decoding>/avg_at_<k>` (MLflow
refuses "@"); decodings are `train` (T=1.0, top-p 1.0) and `justrl` (T=0.7, top-p 0.9). Each
eval run and each training run's validation carries the tag `stapoctl.eval_protocol` (the sha256
of its evaluation protocol, the canonical JSON artifact `eval_protocol.json`: eval/protocol.py).
"""

from __future__ import annotations

import re

# -- tags ------------------------------------------------------------------------------------
PARENT = "mlflow.parentRunId"
KIND = "stapoctl.kind"  # train | eval | sweep
KIND_TRAIN, KIND_EVAL, KIND_SWEEP = "train", "eval", "sweep"
SWEEP_ID = "stapoctl.sweep_id"
SWEEP_NAME = "stapoctl.sweep_name"
SWEEP_VALUE = "stapoctl.sweep_value"
SEED = "stapoctl.seed"
STEP = "stapoctl.step"  # the newest logged step of a training run
LOSS = "stapoctl.loss"
RUN_DIR = "stapoctl.run_dir"
TRAIN_RUN_ID = "stapoctl.train_run_id"  # an eval run: the training run whose model it scored
ALARM_PREFIX = "stapoctl.alarm."  # stapoctl.alarm.<name>=<step>: a run-health alarm this run raised
# on a run a run-health alarm stopped (trainer.alarm_action=stop, KILLED): the alarms' names, comma-separated;
# told apart from a run a person stopped after an alarm had only warned
ALARM_STOPPED = "stapoctl.alarm_stopped"
# stapoctl.inert.<knob>=<why>: a configured term that never changed an update (trainer/inert.py)
INERT_PREFIX = "stapoctl.inert."
# sha256 of the evaluation protocol (eval/protocol.py) of an eval run, or of a training run's last
# validation; the canonical JSON itself is the artifact PROTOCOL_ARTIFACT (its sha256 is the tag)
PROTOCOL = "stapoctl.eval_protocol"
PROTOCOL_UNKNOWN = "unknown"  # what compare calls a run recorded before protocols were
# a confirmatory sweep (`sweep NAME confirm=PILOT`): its role and the pilot sweep it confirms
SWEEP_ROLE = "stapoctl.sweep_role"
ROLE_CONFIRMATORY = "confirmatory"
CONFIRMS = "stapoctl.confirms"

# the experiment tag MLflow's own UI writes for its kind: a model-training experiment opens on its runs,
# not in the GenAI mode with its assistant panel (MLflow 3.17)
EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND_TRAINING = "custom_model_development"

# -- params and artifacts --------------------------------------------------------------------
SWEEP_KEY = "sweep.key"
SWEEP_DEFINITION = "sweep.yaml"
LOSS_NAME = "loss.name"
PROTOCOL_ARTIFACT = "eval_protocol.json"
CONFIRM_SIZING = "confirm_sizing.json"  # a confirmatory sweep's seed sizing (sweep/confirm.py)
COMPARE_DIR = "compare"  # `compare SWEEP_ID` logs its table and figures here on the parent
DIAGNOSTICS_DIR = "diagnostics"  # diagnostics/step_NNNNNN/… on every training run

# -- per-step training metrics (verl-style; the loss library's names are in losses/diagnostics.py)
SCORE = "critic/score/mean"
ACCURACY = "reward/accuracy"
ENTROPY = "actor/entropy"
SPURIOUS_RATIO = "stapo/spurious_ratio"
RESPONSE_LENGTH = "response_length/mean"
CLIPFRAC = "actor/pg_clipfrac"
GRAD_NORM = {  # the LM-head gradient-norm proxy per token category (000 Fig. 2b)
    "spurious": "grad/lmhead_norm/spurious",
    "positive, not spurious": "grad/lmhead_norm/pos_normal",
    "negative": "grad/lmhead_norm/neg",
}

DECODING_LABEL = {"train": "T=1.0", "justrl": "T=0.7"}
_ACC = re.compile(r"^(val|eval)/([^/]+)/([^/]+)/avg_at_(\d+)$")


def accuracy_metric(bench: str, decoding: str, k: int, source: str = "val") -> str:
    """`val/toy/train/avg_at_4`: the held-out accuracy (avg@k) of one benchmark and decoding."""
    return f"{source}/{bench}/{decoding}/avg_at_{k}"


def parse_accuracy_metric(name: str) -> tuple[str, str, str, int] | None:
    """(source, bench, decoding, k) of an accuracy metric name, None for any other metric."""
    m = _ACC.match(name)
    return (m.group(1), m.group(2), m.group(3), int(m.group(4))) if m else None
