"""The configuration matrix (issue #48 part 3): every leaf of the train config and how it is covered, in
one table (`TABLE`), the runs that set its values (`RUNS`), and the pairwise covering array over the knobs
that interact (`FACTORS`). tests/test_config_matrix.py reads it.

Leaves (`leaves()`): every field of the composed default train config (`compose_config([])`), recursively;
a map or list field is one leaf (`rollout.resources`, `tracking.tags`, `eval.benches`, …). The loss group's
fields are the union over the registered loss configs (`LOSS_CONFIGS`): a field the shared bases declare
(AdvantageFields … AggFields, one meaning in every loss) is `loss.FIELD`; a method's own field is
`loss.<method>.FIELD`, <method> the registry name of the class declaring it (STAPO's `renormalize` is
`loss.stapo.renormalize`, which its two ablations inherit). `loss.name` is every registered loss (`LOSS_NAME`).

Entries (values are the composed default's types; "{…}" is filled in at run time):
- `Run(value, run, observe)`: set in the matrix run `run` ("*": every run, checked in `base`), run for
  real; `observe` is how its effect shows. Where the run sees it only jointly with the knobs in `joint`,
  `unit` names the test of the knob alone. `xfail`: a defect the matrix found (its observation fails).
- `Covered(test, why)`: what needs another backend, a GPU, the network, or more than a 2-3 step run, is
  checked by the named test (which must exist and name the field).
- `NoEffect(why, run, value)`: no observable effect in a short run; with `run` the value still runs for real.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Obs:
    """differs / same: the metric `key` at `step` vs the run `vs` (same: within `rel`); cmp: the metric
    `op` `value` at `step` (None: every logged step, "any": some step); present / absent: logged at some
    step / never; steps: logged at exactly the steps `value`; tag / param: equals `value` (tag None: set);
    artifact: the MLflow artifact exists; check: the function check_<key> of tests/test_config_matrix.py."""

    kind: str
    key: str = ""
    value: Any = None
    step: Any = 1
    vs: str = "base"
    op: str = ""
    rel: float = 0.0


def differs(key, step=1, vs="base"): return Obs("differs", key, step=step, vs=vs)  # noqa: E704
def same(key, step=1, vs="base", rel=0.0): return Obs("same", key, step=step, vs=vs, rel=rel)  # noqa: E704
def cmp(key, op, value, step=None): return Obs("cmp", key, value, step=step, op=op)  # noqa: E704
def present(key): return Obs("present", key)  # noqa: E704
def absent(key): return Obs("absent", key)  # noqa: E704
def steps(key, logged): return Obs("steps", key, tuple(logged))  # noqa: E704
def tag(key, value=None): return Obs("tag", key, value)  # noqa: E704
def param(key, value): return Obs("param", key, value)  # noqa: E704
def artifact(path): return Obs("artifact", path)  # noqa: E704
def check(name): return Obs("check", name)  # noqa: E704


@dataclass(frozen=True)
class Run:
    value: Any
    run: str
    observe: tuple
    unit: str = ""
    joint: tuple = ()
    xfail: str = ""


@dataclass(frozen=True)
class Covered:
    test: str
    why: str


@dataclass(frozen=True)
class NoEffect:
    why: str
    run: str = ""
    value: Any = None
    unit: str = ""


def R(value, run, *observe, unit="", joint=(), xfail=""):
    return Run(value, run, tuple(observe), unit, tuple(joint), xfail)


# -- the runs -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSpec:
    group: str = "default"
    extra: tuple = ()  # overrides besides the table's values (a reference's knobs, an engine's settings)
    steps: int = 2
    alarms: tuple = ()  # alarms the run raises on purpose


# Engine groups, each started once, in this order: bf16 first (test_recipes_e2e, before it in POOL_ORDER,
# leaves bf16 engines of the same key), then the embedded default's, then two workers (gloo, ZeRO-3).
GROUP_ORDER = ("bf16", "default", "two_workers")
GROUPS = {
    "default": (),
    "bf16": ("model.dtype=bfloat16",),
    "two_workers": ("rollout.num_workers=2", "rollout.cpus_per_worker=0.5", "learner.cpus=0.5", "rollout.num_threads=1",
                    "rollout.weight_sync=gloo", "rollout.weight_sync_timeout_s=60", "learner.zero_stage=3"),
}
TAU = ("loss.tau_p=0.9",)  # STAPO's mask acts on a few tokens of a 2-step run (at 2e-3: ~1 in 10k tokens)
MODEL = ("model.path={model_dir}",)  # the shared model by path: the data fields then leave the tiny build alone
WAPO, STARE = ("loss=wapo",), ("loss=stare", "loss.stare_top_ratio=0.5", "loss.stare_w=1.5", "loss.stare_target_entropy=1.0")
RUNS: dict[str, RunSpec] = {
    "base": RunSpec(),
    "grpo": RunSpec(extra=("loss=grpo",)),
    "dapo": RunSpec(extra=("loss=dapo",) + TAU),
    "stapo_tau": RunSpec(),
    "stapo_norenorm": RunSpec(extra=TAU),
    "stapo_prob_only": RunSpec(extra=TAU + ("loss=stapo_prob_only",)),
    "stapo_high_entropy": RunSpec(extra=TAU + ("loss=stapo_high_entropy",)),
    "entropy20": RunSpec(extra=("loss=entropy20",)),
    "entropy20_renorm": RunSpec(extra=("loss=entropy20", "loss.adv_eps=0.5", "loss.top_entropy_frac=0.5")),
    "justrl": RunSpec(extra=("loss=justrl",)),
    "wapo": RunSpec(extra=WAPO),
    "wapo_norms": RunSpec(extra=WAPO),
    "tr_grpo": RunSpec(extra=("loss=tr_grpo",)),
    "ppl_shaping": RunSpec(extra=("loss=ppl_shaping",)),
    "position_shaping": RunSpec(extra=("loss=position_shaping",)),
    "position_shape": RunSpec(extra=("loss=position_shaping",)),
    "position_window": RunSpec(extra=("loss=position_shaping",), steps=3),
    "stare": RunSpec(extra=("loss=stare",)),
    "stare_m": RunSpec(extra=STARE),
    "advantage_reweighting": RunSpec(extra=("loss=advantage_reweighting",)),
    "kl": RunSpec(),
    "kl_abs": RunSpec(extra=("loss.kl_coef=0.05", "loss.std_mode=unbiased")),
    "kl_clamp": RunSpec(extra=("loss.kl_coef=0.05",)),
    "agg": RunSpec(),
    "microbatch": RunSpec(),
    "mb_norm": RunSpec(extra=("learner.micro_batch_size=16",)),
    "batching": RunSpec(extra=("learner.ppo_mini_batch_size=1",)),
    "clip": RunSpec(extra=("data.train_batch_size=4", "learner.ppo_mini_batch_size=1", "learner.ppo_epochs=2")),
    "optimizer": RunSpec(),
    "rollout_n": RunSpec(),
    "recompute": RunSpec(),
    "top_p": RunSpec(),
    "data_template": RunSpec(extra=MODEL),
    "data_instruction": RunSpec(extra=MODEL),
    "data_toy": RunSpec(extra=MODEL),
    "validation": RunSpec(extra=("eval.every_n_steps=1", "trainer.save_freq=1")),
    "alarms": RunSpec(alarms=("entropy_collapse", "length_at_cap", "sync_canary", "inert_knobs")),
    "alarms_off": RunSpec(extra=("trainer.alarm_limits.entropy_floor=10.0",)),
    # a mini-batch of one group: a round's few kept groups train (at 8, one round a step would make no update)
    "dapo_recipe": RunSpec(extra=("rollout.max_response_length=24", "learner.ppo_mini_batch_size=1")),
    "async": RunSpec(steps=3),
    "bf16": RunSpec(group="bf16", extra=("trainer.alarm_limits.sync_canary_action=warn",), alarms=("sync_canary",)),
    "two_workers": RunSpec(group="two_workers"),
}

# loss.name: every registered loss runs for real, and shows it trained as itself
LOSS_NAME = {
    "stapo": ("stapo_tau", (cmp("loss/active_token_ratio", "<", 1.0, "any"),)),
    "grpo": ("grpo", (differs("actor/pg_loss"),)),
    "dapo": ("dapo", (cmp("stapo/spurious_count", ">", 0, "any"), cmp("loss/active_token_ratio", "==", 1.0))),
    "stapo_prob_only": ("stapo_prob_only", (differs("actor/pg_loss", vs="stapo_tau"),)),
    "stapo_high_entropy": ("stapo_high_entropy", (differs("actor/pg_loss", vs="stapo_tau"),)),
    "entropy20": ("entropy20", (cmp("loss/active_token_ratio", "<", 0.9),)),
    # JustRL is DAPO's preset (no KL, no entropy term), and STAPO at the default τ_p masked no token here
    "justrl": ("justrl", (same("actor/pg_loss"),)),
    "wapo": ("wapo", (cmp("loss/active_token_ratio", "<", 0.5),)),
    "tr_grpo": ("tr_grpo", (present("tr_grpo/weight_mean"),)),
    "ppl_shaping": ("ppl_shaping", (present("shaping/ppl_weight_abs_mean"),)),
    "position_shaping": ("position_shaping", (cmp("shaping/position_active", "==", 1), differs("actor/pg_loss", vs="grpo"))),
    "stare": ("stare", (differs("actor/pg_loss"),)),
    "advantage_reweighting": ("advantage_reweighting", (present("rollout_corr/flips/ar"),)),
}

# the metrics a run may log as NaN by design, and why (none: shadow/<name>/grad_share is NaN inside a
# mini-batch without gradient, and the step's mean leaves those out, tests/test_losses_shadow.py)
NAN_BY_DESIGN: dict[str, str] = {}

# -- the pairwise covering array ----------------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    name: str
    overrides: tuple = ()
    observe: tuple = ()  # what must show whatever the other factors' levels are


def L(name, *overrides, observe=()):
    return Level(name, tuple(overrides), tuple(observe))


KL_ON = (cmp("actor/kl_loss", ">", 0, "any"), cmp("actor/entropy_loss", "!=", 0, "any"))
FACTORS: dict[str, tuple] = {
    # the engine knobs as one factor: each level is an engine start (~15-40 s here), dtype × ZeRO × layout
    # in full would be 12; ZeRO-1/2 and TP 2: see TABLE
    "engine": (L("fp32-zero0-1worker"),
               L("fp32-zero3-2workers-gloo", *GROUPS["two_workers"], observe=(
                   present("rollout/logprob_diff_max/worker_1"), tag("stapoctl.weight_sync", "gloo"),
                   tag("stapoctl.learner_shared_prefix", "off"))),
               L("bf16-zero0-1worker", *GROUPS["bf16"], observe=(cmp("rollout/logprob_diff_max", ">", 1e-3, "any"),))),
    "decoding": (L("T1"), L("T0.7-top_p0.9", "rollout.temperature=0.7", "rollout.top_p=0.9"),
                 L("top_p0.9", "rollout.top_p=0.9")),
    "mode": (L("sync", observe=(cmp("async/staleness", "==", 0),)),
             L("async", "trainer.mode=async", observe=(cmp("async/staleness", ">", 0, "any"),)),
             L("async-staleness2", "trainer.mode=async", "trainer.max_staleness=2",
               observe=(cmp("async/staleness", "<=", 2), cmp("async/staleness", ">", 0, "any")))),
    "loss": (L("stapo+shadow", *TAU, "loss.shadow=[entropy20]", observe=(present("shadow/entropy20/token_share"),)),
             L("grpo+rule", "loss=grpo", "loss.token_rules=[{adv: pos, prob: [0, 0.5], action: mask, name: rare}]",
               observe=(present("rules/rare/token_ratio"),)),
             L("tr_grpo+table1", "loss=tr_grpo", "loss.shadow=[table1]",
               observe=(present("tr_grpo/weight_mean"), present("shadow/pos_lowp_lowh/token_share")))),
    "correction": (L("auto/auto"),
                   L("token_tis/recompute", "loss.rollout_correction=token_tis", "rollout.old_logprob_source=recompute",
                     observe=(present("rollout_corr/weight_mean"), tag("stapoctl.old_logprob_source", "recompute"))),
                   L("seq_mask/rollout", "loss.rollout_correction=seq_mask", "rollout.old_logprob_source=rollout",
                     observe=(tag("stapoctl.old_logprob_source", "rollout"),))),
    "kl_entropy": (L("off", observe=(absent("actor/kl_loss"),)),
                   L("kl_k3+entropy", "loss.kl_coef=0.05", "loss.entropy_coef=0.01", observe=KL_ON),
                   L("kl_k2+entropy_min", "loss.kl_coef=0.05", "loss.kl_estimator=k2", "loss.entropy_coef=-0.01",
                     observe=KL_ON)),
    "dynamic_sampling": (L("off", observe=(absent("dynamic_sampling/gen_rounds"),)),
                         L("acc", "trainer.dynamic_sampling=true", observe=(present("dynamic_sampling/gen_rounds"),)),
                         L("score", "trainer.dynamic_sampling=true", "trainer.dynamic_sampling_metric=score",
                           observe=(present("dynamic_sampling/gen_rounds"),))),
    "overlong": (L("off", observe=(cmp("reward/overlong_frac", "==", 0),)),
                 L("buffer", "rollout.max_response_length=24", "reward.overlong_buffer=12",
                   observe=(cmp("reward/overlong_frac", ">", 0, "any"),)),
                 L("filter", "rollout.max_response_length=18", "reward.overlong_filter=true",
                   observe=(cmp("response_length/max", "<=", 18),))),
    "micro": (L("fixed"),
              L("token_budget", "learner.max_tokens_per_micro_batch=1024", "learner.micro_batch_size=16",
                observe=(cmp("perf/update_micro_batches", ">=", 2, "any"),)),
              L("packed", "learner.remove_padding=true", "learner.micro_batch_size=16",
                observe=(cmp("perf/update_micro_batches", ">=", 2, "any"),))),
}

# allpairspy's greedy search depends on the order: this one gives 17 rows, 4 of them on two workers (of 400
# orders tried: 17-19 rows)
FACTORS = {k: FACTORS[k] for k in ("kl_entropy", "dynamic_sampling", "micro", "decoding", "mode", "engine", "loss",
                                   "overlong", "correction")}

ENGINE_GROUP = {"fp32-zero0-1worker": "default", "fp32-zero3-2workers-gloo": "two_workers", "bf16-zero0-1worker": "bf16"}


def refused(combo: dict) -> Optional[str]:
    """Why a combination of levels (factor → level name; a part of a row) is refused by design, or None."""
    zero3 = combo.get("engine", "").startswith("fp32-zero3")
    if combo.get("mode", "sync") != "sync" and combo.get("correction") == "seq_mask/rollout":
        return "trainer.mode=async needs rollout.old_logprob_source=recompute (or auto)"
    if zero3 and combo.get("micro") in ("token_budget", "packed"):
        return "the token budget and packing need learner.zero_stage <= 2"
    return None


# -- the table: every leaf → its entry ------------------------------------------------------------------
def C(test, why):
    return Covered(test, why)


def N(why, run="", value=None, unit=""):
    return NoEffect(why, run, value, unit)


TINY = C("tests/test_config_matrix_units.py::test_the_tiny_build_reads_its_fields",
         "the embedded model's build (a new one is minutes): each value in the built model, its hash and its warm start")
FORKS = C("tests/test_toy_task.py::test_demos_take_each_fork_at_its_configured_share",
          "the warm start's demo mix: a new model build; each share counted in the demos there")
SPLIT = C("tests/test_toy_task.py::test_splits_are_disjoint_seeded_and_cover_the_space",
          "the toy task's sizes and operand ranges; data.toy.seed runs for real (data_toy)")
DRY = "tests/test_config_matrix_units.py::test_slurm_and_ray_dry_runs_carry_the_cluster_values"
SLURM = C(DRY, "a SLURM / Ray job: the dry run's sbatch script or job spec carries the value")
VERIFIER = C("tests/test_config_matrix_units.py::test_the_model_verifier_takes_every_field_of_its_config",
             "a verifier model is a vLLM engine of its own (CompassVerifier-3B from the hub): its settings reach it "
             "there, its plumbing with a random tiny model in tests/test_reward_model_verifier.py")
WATCH = ("the alarm needs a trend over more steps than a short run has (windows of 3-20): the watch is fed a stream "
         "where the value fires it and the default does not (the loop's line, tag and action: the alarms run)")
JOINT_OPT = ("learner.weight_decay", "learner.betas", "learner.adam_eps", "learner.grad_clip")
OPT_UNIT = "tests/test_learner.py::test_grpo_update_equals_plain_torch_reference"
POS = ("loss.position_shaping.direction", "loss.position_shaping.pos_scale", "loss.position_shaping.pos_shift",
       "loss.position_shaping.rel_pos_mode")
TR_W = (cmp("tr_grpo/weight_mean", "~", 2.0),)  # w = clip(α(σ(π/τ) − μ), L, U) = 4 · (0.5 − 0) = 2 at τ = 1e9
STARE_J = ("loss.stare.stare_top_ratio", "loss.stare.stare_w", "loss.stare.stare_target_entropy")
TABLE: dict[str, Any] = {
    "experiment": R("tiny_dapo", "dapo_recipe", param("loss.name", "dapo")),
    "resume": C("tests/test_train_e2e.py::test_resume_reproduces_the_next_step",
                "needs an earlier run's checkpoint: a resume on the same engines reproduces step 3 there"),
    # -- model
    "model.name": N("a label (`model=<path or id>` sets it beside model.path): eval's report and compare print it",
                    run="data_template", value="matrix-model"),
    "model.path": R("{model_dir}", "data_template", tag("stapoctl.base_model", "{model_dir}")),
    "model.dtype": R("bfloat16", "bf16", cmp("rollout/logprob_diff_max", ">", 1e-3, "any"),
                     tag("stapoctl.old_logprob_source", "recompute")),
    "model.seed": C("tests/test_tiny_model.py::test_same_seed_same_weights_other_seed_other_weights",
                    "the embedded model's initialisation: a new model build"),
    **{f"model.tiny.{f}": TINY for f in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                                         "head_dim", "vocab_size", "max_position_embeddings", "warm_start_steps",
                                         "warm_start_batch_size", "warm_start_lr")},
    **{f"model.tiny.{f}": FORKS for f in ("unboxed_fraction", "swapped_product_fraction", "swapped_sum_fraction",
                                          "semicolon_fraction", "cross_fraction", "spaced_eq_fraction")},
    # -- data
    "data.name": C("tests/test_preflight_hub.py::test_hub_dataset_offline",
                   "dapo-math-17k comes from the hub or a prepared file: offline, train refuses it in one line there"),
    "data.root": C("tests/test_reward_lists.py::test_data_prep_writes_the_kind_and_eval_judges_by_it",
                   "a folder of prepared datasets (the paper's, from the hub)"),
    "data.source": C("tests/test_config_matrix_units.py::test_data_source_and_root_are_where_rows_come_from",
                     "a local file in a hub dataset's schema, for a dataset other than the toy task"),
    "data.template": R("plain", "data_template", differs("prompt_length/mean")),
    "data.instruction": R("Compute it; box the answer.", "data_instruction", differs("prompt_length/mean")),
    "data.train_batch_size": R(4, "batching", check("batching")),
    "data.max_prompt_length": C("tests/test_session.py::test_a_refusal_after_the_engines_started_leaves_nothing_running",
                                "every toy prompt is 33 tokens: a limit above keeps all, below drops all (refused there)"),
    "data.shuffle": R(False, "tr_grpo", differs("batch/prompts_fingerprint")),
    "data.seed": R(1, "alarms", differs("batch/prompts_fingerprint")),
    # other problems behind the same indices: the sampler's order (batch/prompts_fingerprint) stays
    "data.toy.seed": R(7, "data_toy", differs("batch/fingerprint"), same("batch/prompts_fingerprint")),
    **{f"data.toy.{f}": SPLIT for f in ("num_train", "num_heldout", "operand_min", "addend_max", "factor_max")},
    # -- loss: the shared fields
    "loss.name": R("<every registered loss>", "<LOSS_NAME>"),
    "loss.modules": C("tests/test_loss_modules_e2e.py::test_a_method_of_ones_own_module_trains_and_a_reset_reloads_it",
                      "a package of one's own written by the test, trained on the shared engines, edited, reloaded"),
    "loss.adv_estimator": R("dr_grpo", "kl_clamp", differs("critic/advantages/max")),
    "loss.std_mode": R("unbiased", "kl", differs("critic/advantages/max")),
    "loss.adv_eps": R(0.5, "entropy20", differs("critic/advantages/max")),
    "loss.kl_coef": R(0.05, "kl", cmp("actor/kl_loss", "==", 0, 1), cmp("actor/kl_loss", ">", 0, 2)),
    "loss.kl_estimator": R("abs", "kl_abs", differs("actor/kl_loss", 2, vs="kl"),
                           unit="tests/test_losses_regularizers.py::test_each_estimator_by_hand"),
    "loss.kl_clamp": R(1e-6, "kl_clamp", cmp("actor/kl_loss", ">", 0, 2), cmp("actor/kl_loss", "<=", 1e-6, 2)),
    "loss.entropy_coef": R(0.01, "dapo", cmp("actor/entropy_loss", "!=", 0, 1)),
    "loss.rollout_correction": R("token_mask", "recompute", present("rollout_corr/masked_frac"),
                                 unit="tests/test_losses_regularizers.py::test_each_correction_mode_by_hand"),
    "loss.rollout_is_cap": R(1.0, "recompute", cmp("rollout_corr/masked_frac", ">", 0, "any"),
                             unit="tests/test_losses_regularizers.py::test_the_cap_moves_the_bounds"),
    "loss.tau_p": R(0.9, "stapo_tau", cmp("loss/active_token_ratio", "<", 1.0, "any"),
                    cmp("stapo/spurious_count", ">", 0, "any")),
    "loss.tau_h": R(0.5, "grpo", differs("stapo/entropy_threshold")),  # measured by every loss, used by STAPO's
    "loss.quantile_interpolation": R("higher", "justrl", differs("stapo/entropy_threshold")),
    "loss.token_rules": R([{"prob": [0, 0.5], "action": "mask", "name": "rare"}], "alarms",
                          cmp("rules/rare/token_ratio", ">", 0, "any")),
    "loss.shadow": R(["table1"], "validation", present("shadow/pos_lowp_lowh/token_share")),
    # batching's 16 updates a step at 0.01 instead of 0.2 / 0.28
    "loss.clip_ratio_low": R(0.01, "clip", differs("actor/pg_clipfrac", vs="batching"), joint=("loss.clip_ratio_high",)),
    "loss.clip_ratio_high": R(0.01, "clip", differs("actor/pg_clipfrac", vs="batching"), joint=("loss.clip_ratio_low",)),
    "loss.clip_ratio_c": N("the dual clip acts on A < 0 tokens whose ratio passes c > 1: ratios stay within a few % "
                           "of 1 in 2 steps", run="clip", value=3.0, unit="tests/test_losses_methods.py::test_dapo_dual_clip"),
    "loss.loss_agg_mode": R("seq-mean-token-sum", "agg", differs("actor/pg_loss")),
    "loss.per_microbatch_norm": R(True, "mb_norm", differs("actor/pg_loss", vs="microbatch")),
    # -- loss: the methods' own fields
    "loss.stapo.renormalize": R(False, "stapo_norenorm", differs("actor/pg_loss", vs="stapo_tau")),
    "loss.entropy20.top_entropy_frac": R(0.5, "entropy20", cmp("loss/active_token_ratio", ">", 0.4),
                                         cmp("loss/active_token_ratio", "<", 0.6)),
    "loss.entropy20.renormalize": R(True, "entropy20_renorm", differs("actor/pg_loss", vs="entropy20")),
    "loss.wapo.winner_norm": R("winners", "wapo_norms", differs("actor/pg_loss", vs="wapo"), joint=("loss.wapo.prompt_norm",),
                               unit="tests/test_losses_methods.py::test_wapo_max_response_length_and_winner_variant"),
    "loss.wapo.prompt_norm": R("all", "wapo_norms", differs("actor/pg_loss", vs="wapo"), joint=("loss.wapo.winner_norm",),
                               unit="tests/test_losses_methods.py::test_wapo_prompt_without_winner_contributes_nothing"),
    "loss.tr_grpo.alpha": R(4.0, "tr_grpo", *TR_W),
    "loss.tr_grpo.mu": R(0.0, "tr_grpo", *TR_W),
    "loss.tr_grpo.weight_low": R(0.0, "tr_grpo", *TR_W),
    "loss.tr_grpo.weight_high": R(10.0, "tr_grpo", *TR_W),
    "loss.tr_grpo.tau": R(1e9, "tr_grpo", *TR_W),
    "loss.tr_grpo.tau_mode": R("divide", "tr_grpo", *TR_W),
    "loss.ppl_shaping.alpha": R(0.0, "ppl_shaping", same("actor/pg_loss", vs="grpo")),
    "loss.position_shaping.gamma": R(0.0, "position_window", same("actor/pg_loss", 2, vs="grpo", rel=1e-5)),
    "loss.position_shaping.start_step": R(2, "position_window", cmp("shaping/position_active", "==", 0, 1),
                                          cmp("shaping/position_active", "==", 1, 2)),
    "loss.position_shaping.stop_step": R(3, "position_window", cmp("shaping/position_active", "==", 1, 2),
                                         cmp("shaping/position_active", "==", 0, 3)),
    **{k: R(v, "position_shape", differs("actor/grad_norm", vs="position_shaping"), joint=tuple(j for j in POS if j != k),
            unit="tests/test_losses_methods.py::test_relative_position_and_printed_shift" if k != POS[-1] else "")
       for k, v in zip(POS, (-1.0, 5.0, 0.2, "spec"))},
    **{k: R(v, "stare", differs("actor/pg_loss"), joint=tuple(j for j in STARE_J if j != k),
            unit="tests/test_losses_published.py::test_stare_equals_its_reference_weights")
       for k, v in zip(STARE_J, (0.5, 1.5, 1.0))},
    "loss.stare.stare_m": R(0.9, "stare_m", differs("actor/pg_loss", vs="stare")),
    "loss.advantage_reweighting.ar_alpha": R(0.0, "advantage_reweighting", same("actor/pg_loss", vs="grpo")),
    # -- rollout
    "rollout.engine": C("tests/test_config_matrix_units.py::test_an_engine_that_is_not_there_is_refused_in_one_line",
                        "vllm is the only rollout engine: another name is refused before anything starts"),
    "rollout.num_workers": R(2, "two_workers", present("rollout/logprob_diff_max/worker_1")),
    "rollout.cpus_per_worker": N("Ray's accounting: 3 actors on 2 cores", run="two_workers", value=0.5,
                                 unit="tests/test_gpu_path_units.py::test_every_actor_fits_the_bundle_it_lands_in"),
    "rollout.gpus_per_worker": C("tests/test_gpu_path_units.py::test_colocated_needs_one_shared_gpu_per_rank", "a GPU"),
    "rollout.resources": C("tests/test_ray_cluster.py::test_rollout_and_learner_run_on_different_nodes",
                           "a custom Ray resource pins a role to the nodes that advertise it: a two-node Ray there"),
    "rollout.placement_strategy": C("tests/test_weight_transport_units.py::test_tp2_bundle_layouts",
                                    "SPREAD places bundles across nodes: one node here"),
    "rollout.tensor_parallel_size": C("tests/test_weight_transport_e2e.py::test_tensor_parallel_2_with_the_object_store",
                                      "TP 2 engines start in ~70 s here: run once there, gloo and the object store, sync and async"),
    "rollout.n": R(4, "rollout_n", differs("batch/fingerprint"), check("responses")),
    "rollout.temperature": R(0.7, "recompute", differs("batch/fingerprint"), same("batch/prompts_fingerprint")),
    "rollout.top_p": R(0.9, "top_p", differs("batch/fingerprint"), same("batch/prompts_fingerprint")),
    # 18: some of the toy's 16-20-token answers cut (at 16 all: the filter then leaves the loss no token)
    "rollout.max_response_length": R(18, "alarms", cmp("response_length/max", "<=", 18),
                                     cmp("response_length/clip_ratio", ">", 0, "any")),
    "rollout.gpu_memory_utilization": C("tests/test_weight_transport_units.py::test_gpu_engine_memory_settings",
                                        "a GPU's share for vLLM; on CPU rollout.kv_cache_gb sizes the cache"),
    "rollout.kv_cache_gb": C("tests/test_tiny_model.py::test_a_kv_cache_too_small_for_one_sequence_is_a_user_error",
                             "0.25 GiB holds 260k tokens, a step needs 5k: more is only memory (and an engine start), "
                             "too little is refused there"),
    "rollout.enforce_eager": C("tests/test_startup_helpers.py::test_rollout_env_turns_dynamo_off_only_for_an_eager_cpu_engine",
                               "false compiles vLLM's graphs: minutes on vLLM-CPU, CUDA graphs on a GPU"),
    "rollout.old_logprob_source": R("recompute", "recompute", tag("stapoctl.old_logprob_source", "recompute")),
    "rollout.logprob_check_every": R(1, "*", steps("rollout/logprob_diff_max", [1, 2])),
    "rollout.num_threads": R("{sync_threads}", "async", check("rollout_threads")),
    "rollout.max_restarts": C("tests/test_gpu_path_units.py::test_ray_restarts_an_actor_only_where_the_transport_can_relink_it",
                              "a restart needs an actor killed mid-run (tests/test_fault_recovery.py kills one)"),
    "rollout.weight_sync": R("gloo", "two_workers", tag("stapoctl.weight_sync", "gloo")),
    "rollout.weight_sync_timeout_s": N("the bound on a push that takes ~0.1 s here", run="two_workers", value=60.0,
                                       unit="tests/test_weight_sync_faults.py::test_a_stopped_worker_ends_the_resumed_run_within_the_sync_timeout"),
    "rollout.stall_timeout_s": N("a worker whose progress stands still this long ends the run: none stalls in a "
                                 "healthy run", run="rollout_n", value=300.0,
                                 unit="tests/test_weight_sync_faults.py::"
                                      "test_a_worker_stopped_while_generating_ends_the_run_within_the_stall_bound"),
    # -- learner
    "learner.backend": C("tests/test_config_matrix_units.py::test_an_engine_that_is_not_there_is_refused_in_one_line",
                         "deepspeed is the only learner backend: another name is refused before anything starts"),
    "learner.zero_stage": R(3, "two_workers", tag("stapoctl.learner_shared_prefix", "off"), unit=OPT_UNIT),
    "learner.num_ranks": C("tests/test_scale_out.py::test_two_by_two_trains_and_every_worker_is_synced",
                           "two ranks and two workers: an engine start of its own there"),
    "learner.gpus_per_rank": C("tests/test_cuda.py::test_deepspeed_learner_on_cuda_equals_plain_torch_reference", "a GPU"),
    "learner.cpus": N("Ray's accounting: 3 actors on 2 cores", run="two_workers", value=0.5,
                      unit="tests/test_gpu_path_units.py::test_every_actor_fits_the_bundle_it_lands_in"),
    "learner.resources": C("tests/test_ray_cluster.py::test_rollout_and_learner_run_on_different_nodes",
                           "a custom Ray resource pins a role to the nodes that advertise it: a two-node Ray there"),
    "learner.placement_strategy": C("tests/test_weight_transport_units.py::test_tp2_bundle_layouts",
                                    "SPREAD places bundles across nodes: one node here"),
    "learner.placement": C("tests/test_gpu_path_units.py::test_the_plan_counts_the_ipc_push_buffer",
                           "colocated shares the GPUs with vLLM: GPUs"),
    "learner.lr": R(3e-4, "justrl", check("lr_schedule")),
    "learner.warmup_steps": R(4, "justrl", check("lr_schedule")),
    "learner.weight_decay": R(0.1, "optimizer", differs("actor/entropy", 2), joint=JOINT_OPT[1:], unit=OPT_UNIT),
    "learner.betas": R([0.8, 0.99], "optimizer", differs("actor/entropy", 2), joint=JOINT_OPT[::2], unit=OPT_UNIT),
    "learner.adam_eps": R(1e-6, "optimizer", differs("actor/entropy", 2), joint=JOINT_OPT[:2] + JOINT_OPT[3:], unit=OPT_UNIT),
    "learner.grad_clip": R(0.1, "optimizer", differs("actor/entropy", 2), joint=JOINT_OPT[:3], unit=OPT_UNIT),
    "learner.ppo_mini_batch_size": R(8, "*", cmp("actor/optimizer_steps", "==", 1, 1)),
    "learner.micro_batch_size": R(16, "microbatch", cmp("perf/update_micro_batches", "==", 4),
                                  same("actor/pg_loss", rel=1e-5)),
    "learner.max_tokens_per_micro_batch": R(1024, "validation", cmp("perf/update_micro_batches", ">=", 2)),
    "learner.log_prob_max_tokens_per_micro_batch": N(
        "cuts the no-grad passes (old log-probs, the reference) by tokens: the same numbers, no metric of its own",
        run="recompute", value=256, unit="tests/test_learner_token_budget.py::test_refused_combinations"),
    "learner.ppo_epochs": R(2, "batching", check("batching")),
    "learner.logits_chunk_size": N("the log-prob/entropy chunk: the same numbers in less memory", run="microbatch",
                                   value=16, unit=OPT_UNIT),
    "learner.gradient_checkpointing": R(True, "alarms_off", tag("stapoctl.learner_shared_prefix", "off")),
    "learner.shared_prefix": R(False, "rollout_n", tag("stapoctl.learner_shared_prefix", "off")),
    "learner.remove_padding": N("rows packed without padding: the same log-probs and gradients", run="alarms", value=True,
                                unit="tests/test_learner_packing.py::test_every_loss_equals_the_padded_forward"),
    "learner.offload_optimizer": C("tests/test_plan.py::test_zero_2_and_3_come_from_deepspeeds_estimators",
                                   "ZeRO-Offload: DeepSpeed's CPU Adam (a C++ op build) beside GPU ranks; the plan counts it"),
    "learner.num_threads": R(1, "rollout_n", check("learner_threads")),
    "learner.process_group_timeout_s": C("tests/test_weight_transport.py::test_the_learners_process_group_holds_the_configured_timeout",
                                         "the bound of the ranks' collectives: more than one rank"),
    # -- reward
    # group-normalised advantages do not move with an affine change of the rewards: agg's pg_loss sees its own knob
    "reward.correct": R(2.0, "agg", check("score_values")),
    "reward.incorrect": R(-0.5, "agg", check("score_values")),
    "reward.verify_timeout_s": N("the toy answers verify in milliseconds: a deadline of seconds is never reached",
                                 run="rollout_n", value=2.0, unit="tests/test_reward_pool.py::test_timeout_inside_ray_actor_and_task"),
    "reward.num_workers": N("verifier subprocesses in parallel: the same verdicts", run="rollout_n", value=1,
                            unit="tests/test_reward_pool.py::test_score_batch_values_and_stats"),
    "reward.verify_max_memory_gb": N("the toy's checks stay far below an address-space cap", run="rollout_n", value=2.0),
    "reward.model_verifier": VERIFIER,
    **{f"reward.model_verifier_{f}": VERIFIER for f in ("mode", "prompt", "max_tokens", "max_model_len", "dtype", "cpus",
                                                        "gpus")},
    "reward.overlong_buffer": R(12, "dapo_recipe", cmp("reward/overlong_frac", ">", 0, "any")),
    # the ramp's mean penalty is ~0.46 × the factor here: within 0.1, below 0
    "reward.overlong_penalty": R(0.1, "dapo_recipe", cmp("reward/overlong_penalty_mean", ">=", -0.1),
                                 cmp("reward/overlong_penalty_mean", "<", 0, "any")),
    "reward.overlong_filter": R(True, "alarms", cmp("reward/overlong_filtered", ">", 0, "any")),
    # -- eval (training's validation)
    "eval.benches": C("tests/test_eval_cli.py::test_table2_printed_for_all_benchmarks",
                      "the paper's benchmarks are hub datasets (or ../shared/data): all six there"),
    "eval.decoding": R("both", "validation", present("val/toy/justrl/avg_at_2")),
    "eval.k": R(2, "validation", present("val/toy/train/avg_at_2")),
    "eval.max_response_length": R(32, "validation", check("protocol_max_tokens")),
    "eval.every_n_steps": R(0, "*", absent("val/toy/train/avg_at_4")),
    "eval.output_dir": C("tests/test_eval_cli.py::test_resume_generates_only_new_problems",
                         "where `stapoctl eval` keeps its per-sample JSONL; training's validation writes none"),
    "eval.seed": N("training's validation draws with trainer.seed (trainer/loop.py _validate): only `stapoctl eval` "
                   "reads it", run="validation", value=3),
    # -- tracking
    "tracking.uri": R("{uri}", "*", check("in_store")),
    "tracking.experiment": R("matrix-alarms", "alarms", check("experiment")),
    "tracking.run_name": R("matrix-alarms-run", "alarms", check("run_name")),
    "tracking.log_artifacts": R(False, "alarms", check("no_artifacts")),
    "tracking.parent_run_id": R("{run:base}", "alarms", tag("mlflow.parentRunId", "{run:base}")),
    "tracking.tags": R({"team": "rl"}, "alarms", tag("team", "rl")),
    "tracking.flush_timeout_s": N("how long the end waits for an unreachable MLflow server: the store is always there",
                                  run="alarms", value=30.0),
    # -- cluster: another backend (SLURM, a Ray cluster) or an engine start of its own
    "cluster.name": SLURM,
    "cluster.address": C("tests/test_ray_cluster.py::test_rollout_and_learner_run_on_different_nodes",
                         "joins a running Ray cluster (two nodes there); a job server address: the dry run"),
    "cluster.num_cpus": C("tests/test_submit_cli.py::test_single_node_local_preset_sizes_ray_to_the_allocation",
                          "Ray's size: the pool's Ray is started once for the suite"),
    "cluster.num_gpus": C("tests/test_submit_cli.py::test_single_node_local_preset_sizes_ray_to_the_allocation", "GPUs"),
    "cluster.mkl_amd_shim": C("tests/test_mkl_shim.py::test_preload_env_follows_the_mode_and_keeps_other_preloads",
                              "a library preloaded into the engine actors when they start"),
    "cluster.placement_timeout_s": N("how long a placement waits for busy resources: a placement here never waits "
                                     "(one that cannot fit fails at once)"),
    "cluster.socket_ifname": C("tests/test_gpu_path_units.py::test_the_interface_of_a_multi_node_run_reaches_every_actor_and_job",
                               "the interface NCCL and gloo bind on a multi-node run"),
    "cluster.python": SLURM, "cluster.ship_code": SLURM,
    "cluster.preset": C("tests/test_submit_cli.py::test_command_line_wins_over_the_preset", "a SLURM site preset"),
    **{f"cluster.{f}": SLURM for f in ("partition", "account", "qos", "constraint", "nodes", "gpus_per_node", "cpus_per_task",
                                       "mem_gb", "timeout_min", "setup", "array_parallelism", "max_requeues", "ray_port",
                                       "log_dir")},
    "cluster.gpu_mem_gb": C("tests/test_config_matrix_units.py::test_the_plan_reads_the_gpu_memory",
                            "one GPU's memory for `stapoctl plan` where no GPU is visible"),
    # -- trainer
    "trainer.total_steps": R(2, "*", steps("actor/pg_loss", [1, 2])),
    "trainer.save_freq": R(0, "*", check("no_checkpoints")),
    "trainer.keep_checkpoints": C("tests/test_resume_retention_e2e.py::test_a_resume_with_retention_matches_the_uninterrupted_run",
                                  "retention needs several saves and a newer one verified: end to end there"),
    "trainer.seed": R(1, "dapo", differs("batch/fingerprint"), same("batch/prompts_fingerprint")),
    "trainer.output_dir": R("{out}", "validation", check("output_dir")),
    "trainer.log_every": R(2, "validation", steps("actor/pg_loss", [2])),
    "trainer.val_before_train": R(False, "validation", steps("val/toy/train/avg_at_2", [1, 2])),
    "trainer.log_samples": R(2, "validation", check("samples")),
    "trainer.mode": R("async", "async", cmp("async/staleness", ">", 0, "any")),
    "trainer.max_staleness": R(2, "async", cmp("async/staleness", "==", 2, 3)),
    "trainer.is_cap": R(3.0, "top_p", param("loss.rollout_is_cap", 3.0)),
    "trainer.diagnostics_every": R(1, "validation", artifact("diagnostics/step_000001/categories.json")),
    "trainer.min_free_gb": C("tests/test_fault_units.py::test_preflight_refuses_before_any_compute",
                             "refuses a start on a fuller disk: this one has room"),
    "trainer.dynamic_sampling": R(True, "dapo_recipe", present("dynamic_sampling/gen_rounds")),
    "trainer.dynamic_sampling_metric": N("score and acc agree where no shaping or penalty splits a group's rewards: "
                                         "the rule reward alone here", run="dapo_recipe", value="score",
                                         unit="tests/test_dynamic_sampling.py::test_acc_drops_uniform_verdicts_even_when_a_penalty_makes_the_scores_differ"),
    "trainer.max_gen_batches": R(1, "dapo_recipe", cmp("dynamic_sampling/gen_rounds", "==", 1)),
    "trainer.alarms": R(False, "alarms_off", check("no_alarm")),
    "trainer.alarm_action": R("checkpoint", "alarms", check("alarm_checkpoint")),
    "trainer.alarm_limits.entropy_floor": R(10.0, "alarms", tag("stapoctl.alarm.entropy_collapse")),
    "trainer.alarm_limits.length_cap_share": R(0.0, "alarms", tag("stapoctl.alarm.length_at_cap")),
    "trainer.alarm_limits.length_cap_steps": R(1, "alarms", tag("stapoctl.alarm.length_at_cap")),
    "trainer.alarm_limits.inert_steps": R(1, "alarms", tag("stapoctl.alarm.inert_knobs")),
    "trainer.alarm_limits.inert_action": C("tests/test_inert.py::test_the_loop_warns_with_its_own_action_even_when_alarms_stop",
                                           "its own action beside trainer.alarm_action: the loop fed there"),
    "trainer.alarm_limits.sync_canary_fp32": R(1e-12, "alarms", tag("stapoctl.alarm.sync_canary")),
    "trainer.alarm_limits.sync_canary_bf16": R(1e-9, "bf16", tag("stapoctl.alarm.sync_canary")),
    "trainer.alarm_limits.sync_canary_action": R("warn", "alarms", check("finished")),
    "trainer.alarm_limits.sync_canary_factor": C("tests/test_sync_canary.py::test_bf16_a_later_step_alarms_above_factor_times_the_first_steps_p99",
                                                 "the canary's step-to-step trend against its first step"),
    **{f"trainer.alarm_limits.{f}": C("tests/test_config_matrix_units.py::test_each_alarm_limit_moves_its_alarm", WATCH)
       for f in ("entropy_drop", "entropy_window", "entropy_rise", "grad_z", "grad_window", "grad_ratio", "reward_flat_steps",
                 "mismatch_kl", "mismatch_rise", "spurious_jump", "spurious_floor")},
    "plan.enforce": C("tests/test_plan.py::test_enforce_false_warns_and_goes_on", "a plan that cannot fit: a GPU preset's"),
}


# -- leaves -------------------------------------------------------------------------------------------
MAP_FIELDS = ("rollout.resources", "learner.resources", "tracking.tags")


def loss_leaves() -> dict[str, tuple]:
    """`loss.FIELD` (declared by a shared base) or `loss.<method>.FIELD` → the registered losses having it."""
    from stapoctl.config import losses as Ls

    shared = (Ls.AdvantageFields, Ls.RegularizerFields, Ls.DiagnosticFields, Ls.ClipFields, Ls.AggFields)
    out: dict[str, list] = {}
    for name, cls in Ls.LOSS_CONFIGS.items():
        for f in dataclasses.fields(cls):
            owner = next(c for c in reversed(cls.__mro__) if f.name in c.__dict__.get("__annotations__", {}))
            out.setdefault(f"loss.{f.name}" if owner in shared else f"loss.{owner().name}.{f.name}", []).append(name)
    return {k: tuple(v) for k, v in out.items()}


def leaves() -> dict[str, Any]:
    """Every leaf of the train config → its composed default (a loss leaf: its default in its method's config)."""
    from omegaconf import OmegaConf

    from stapoctl.config.compose import compose_config
    from stapoctl.config.losses import LOSS_CONFIGS

    out: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            key = prefix + str(k)
            if isinstance(v, dict) and key not in MAP_FIELDS and key != "loss":
                walk(v, key + ".")
            elif key != "loss":
                out[key] = v

    walk(OmegaConf.to_container(compose_config([]), resolve=True), "")
    for key, methods in loss_leaves().items():
        out[key] = getattr(LOSS_CONFIGS[methods[0]](), key.split(".")[-1])
    return out


def override_key(leaf: str) -> str:
    """The Hydra key of a leaf: `loss.<method>.FIELD` is set as `loss.FIELD` (beside `loss=<method>`)."""
    parts = leaf.split(".")
    return f"loss.{parts[2]}" if parts[0] == "loss" and len(parts) == 3 else leaf
