"""A sweep's trials: one per (value, seed), each a complete `train` command line.

Pure planning (no engines, no MLflow writes), so the local runner and the SLURM array
submitter run exactly the same trials: `plan_trials(definition, sweep_id)` gives each trial's
Hydra overrides — the experiment, the sweep's overrides, the swept value and the overrides that
value carries, the seed, and the nesting (`tracking.parent_run_id`) and tags that `stapoctl
compare` reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig

from stapoctl.errors import UserError
from stapoctl.sweep import layout
from stapoctl.sweep.definition import SEED_KEY, SweepDefinition, override_key


@dataclass(frozen=True)
class Trial:
    """One child run: `compose_config(list(trial.overrides))` is its config."""

    index: int
    value: str
    seed: int
    run_name: str
    tags: dict = field(hash=False)
    overrides: tuple[str, ...] = ()


def quote(text: str) -> str:
    """A Hydra-quoted string value: survives '=', ',', spaces and brackets."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def value_override(definition: SweepDefinition, value: str) -> str:
    """`loss=grpo` for a method sweep, `loss.tau_p=2e-3` for a value sweep (the value as written)."""
    return f"{definition.key}={value}"


def trial_settings(definition: SweepDefinition, value: str) -> tuple[list[str], list[str]]:
    """(the sweep's overrides, the value's) for a value's trials: `key=value` and the overrides the
    value carries (`{value: …, set: […]}`). The value's own win: a key they set is dropped from the
    sweep's overrides, and when they set the swept key itself the value is only a label
    (`dapo_full` with `set: [loss=dapo, …]`)."""
    own = definition.overrides_of(value)
    own_keys = {override_key(o) for o in own}
    common = [o for o in definition.overrides if override_key(o) not in own_keys]
    swept = [] if definition.key in own_keys else [value_override(definition, value)]
    return common, [*swept, *own]


def grid(definition: SweepDefinition) -> list[tuple[str, int]]:
    """(value, seed) in trial order: value-major, so each value's seeds run back to back."""
    return [(v, s) for v in definition.values for s in definition.seeds]


def plan_trials(definition: SweepDefinition, sweep_id: str, extra: tuple[str, ...] = ()) -> list[Trial]:
    """Every trial of the sweep nested under parent run `sweep_id`; `extra` overrides go last
    (where it runs: e.g. a resume's tracking/cluster settings)."""
    trials = []
    for index, (value, seed) in enumerate(grid(definition)):
        common, own = trial_settings(definition, value)
        name = layout.run_name(definition.key, value, seed)
        tags = {
            layout.SWEEP_ID: sweep_id,
            layout.SWEEP_NAME: definition.name,
            layout.SWEEP_VALUE: value,
            layout.SEED: str(seed),
            layout.TRIAL: str(index),
        }
        tag_dict = ",".join(f"{k}:{quote(v)}" for k, v in tags.items())
        overrides = (
            f"experiment={definition.experiment}",
            *common,
            *extra,
            *own,
            f"{SEED_KEY}={seed}",
            f"tracking.parent_run_id={sweep_id}" if sweep_id else "tracking.parent_run_id=null",
            f"tracking.run_name={quote(name)}",
            "++tracking.tags={" + tag_dict + "}",
        )
        trials.append(Trial(index, value, seed, name, tags, overrides))
    return trials


def compose_trial(trial: Trial, resume: Optional[str] = None) -> DictConfig:
    """The trial's config (`resume`: a checkpoint dir the trial continues from)."""
    from stapoctl.config.compose import compose_config

    return compose_config(list(trial.overrides) + ([f"resume={resume}"] if resume else []))


def check_plan(definition: SweepDefinition, extra: tuple[str, ...] = ()) -> dict[str, DictConfig]:
    """Compose every value's config before anything starts: a typo in the key, a value or an
    override gives compose's one-line error (naming the key) instead of a failed trial later.
    Returns value → its config (with the first seed)."""
    from stapoctl.trainer.setup import check_config

    confs: dict[str, DictConfig] = {}
    for trial in plan_trials(definition, "", extra):
        if trial.value in confs:
            continue
        conf = compose_trial(trial)
        check_config(conf, here=conf.cluster.name == "local" and not conf.cluster.address)
        if int(conf.eval.every_n_steps or 0) <= 0:
            raise UserError(
                f"eval.every_n_steps={conf.eval.every_n_steps}: a sweep's trials must validate (at least at "
                "their last step) to count as finished; set eval.every_n_steps > 0 (e.g. the run's total steps)"
            )
        confs[trial.value] = conf
    return confs
