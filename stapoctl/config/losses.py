"""The loss configs: one typed dataclass per registered method, and the fields they share.

They are the `loss` group's nodes in Hydra's ConfigStore, so they live apart from the tensor
code of `stapoctl.losses`: composing and checking a config (`stapoctl train --cfg job`, bad
input refused before anything starts, a sweep's plan) imports neither torch nor the methods, and
`stapoctl train` imports torch on a thread while Ray starts. `LOSS_CONFIGS` names the built-ins;
`stapoctl.losses.register_loss` adds a method registered at run time.

Every field is Hydra/OmegaConf-friendly (int/float/bool/str/Optional of those, and three lists:
``token_rules``, a list of dicts in YAML and on the command line, checked by `config.token_rules`,
``shadow``, presets or rules only measured, `config.shadow_rules`, and ``modules``, `config.loss_modules`) and carries
its help text in ``metadata["help"]`` so `stapoctl losses` and docs/LOSSES.md can show it, and
its valid values (``range="(0, 1]"`` or ``choices=...``, see `stapoctl.config.fields`): checked
when a config is built and by `stapoctl train` before anything starts. A subclass redeclaring a
field only to change its default keeps the range declared here. Each registered config redeclares
``name`` so that it stays the first field with the registry key as default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, List, Optional

from stapoctl.config.fields import problems, spec
from stapoctl.config.shadow_rules import parse_shadows
from stapoctl.config.token_rules import TokenRule, parse_rules
from stapoctl.errors import UserError

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
AGG_HELP = "token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (Dr. GRPO: / T_max)"
STD_MODES = ("population", "unbiased")
ADV_ESTIMATORS = ("grpo", "dr_grpo")
QUANTILE_MODES = ("linear", "lower", "higher", "midpoint")
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "tr_weighted")  # tr_weighted: TR-GRPO's own 004 Eq. 11 form
ROLLOUT_CORRECTIONS = ("auto", "off", "token_tis", "seq_tis", "token_mask", "seq_mask")

# value sets of method-specific fields (the tensor code checks them again where it branches)
REL_POS_MODES = ("closed", "spec")  # position_shaping: l_t = t/(|o|-1) or (t+1)/|o|
TAU_MODES = ("multiply", "divide")  # tr_grpo: z = tau*pi or pi/tau
WINNER_NORMS = ("group", "winners")  # wapo: per-prompt divisor G or G*r_bar
PROMPT_NORMS = ("winners", "all")  # wapo: average over prompts with a winner, or over all


def _f(default: Any, help: str, *, range: Optional[str] = None, choices: Optional[tuple] = None,
       why: Optional[str] = None) -> Any:
    return spec(default, help, range=range, choices=choices, why=why)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_fields(cfg: Any) -> None:
    """Every declared range and choice of the config's fields (the first violation raises)."""
    for name, value, why in problems(type(cfg), cfg):
        raise ValueError(f"{cfg.name}: {name}={value!r} {why}")


@dataclass
class AdvantageFields:
    """The loss's name, the modules registering it, how rewards become advantages (already scored)."""

    name: str = _f("", "registry key of the loss (loss=NAME)")
    modules: List[str] = spec(help="dotted modules the driver and each learner rank import (a rank reloads them at "
                              "every reset) before the loss is resolved: your own methods (docs/LOSSES.md)",
                              default_factory=list)
    adv_estimator: str = _f("grpo", "grpo: (R-mean_G)/(std_G+eps); dr_grpo: R-mean_G (no std division)",
                            choices=ADV_ESTIMATORS)
    std_mode: str = _f(
        "population",
        "group std: population (SPEC default) or unbiased (verl's torch.std); record it",
        choices=STD_MODES,
    )
    adv_eps: float = _f(1e-6, "epsilon added to the group std (advantages and PPL standardisation)",
                        range="[0, inf)")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Declared ranges and choices; subclasses add cross-field checks after calling this."""
        check_fields(self)


@dataclass
class RegularizerFields(AdvantageFields):
    """verl/OpenRLHF-parity terms every loss takes: KL to a reference, entropy bonus, and the
    rollout-training mismatch correction (losses/kl.py, losses/regularizers.py,
    losses/rollout_correction.py)."""

    # the kl_estimator only this config may use (TR-GRPO sets its 004 weighted form)
    OWN_KL_ESTIMATOR: ClassVar[Optional[str]] = None
    # aggregation of the KL and entropy terms; None = the loss's own loss_agg_mode
    REGULARIZER_AGG: ClassVar[Optional[str]] = None

    kl_coef: float = _f(0.0, "beta of + beta*agg(KL(pi || pi_ref)) (verl kl_loss_coef); > 0 needs ref_log_prob",
                        range="[0, inf)")
    kl_estimator: str = _f("k3", "per-token KL estimate: k1 | k2 | k3 (verl low_var_kl) | abs",
                           choices=KL_ESTIMATORS)
    kl_clamp: float = _f(10.0, "k3's value clamped to [-c, c] (verl 0.9.1: 10), which zeroes its gradient "
                         "beyond; 0 = off", range="[0, inf)")
    entropy_coef: float = _f(0.0, "c of - c*agg(H) (verl entropy_coeff): > 0 a bonus, < 0 entropy minimisation; "
                             "its gradient needs token_stats(entropy_grad=True)", range="(-inf, inf)")
    rollout_correction: str = _f(
        "auto",
        "weight for behaviour (rollout engine) != old policy, given behavior_log_prob: auto (token_tis) | off | "
        "token_tis | seq_tis | token_mask (1 inside [1/C, C], 0 outside) | seq_mask",
        choices=ROLLOUT_CORRECTIONS,
    )
    rollout_is_cap: float = _f(2.0, "C: TIS truncation min(ratio, C); masks keep ratios in [1/C, C]",
                               range="[1, inf)", why="C < 1 would cut every ratio below 1")

    def validate(self) -> None:
        super().validate()
        if self.kl_estimator == "tr_weighted" and self.OWN_KL_ESTIMATOR != "tr_weighted":
            raise ValueError(f"{self.name}: kl_estimator=tr_weighted is TR-GRPO's own weighted form (004 Eq. 11): "
                             "use k1, k2, k3 or abs")


@dataclass
class DiagnosticFields(RegularizerFields):
    """S2T thresholds (applied by the STAPO family, only measured by the others) and the token rules
    every loss applies on top of its method (``token_rules``; presets add theirs in ``preset_rules``)."""

    tau_p: float = _f(2e-3, "S2T absolute probability threshold: candidate iff pi(y_t) < tau_p (000 Remark 3.5)",
                      range="(0, 1]", why="a probability; 0 silences nothing, which is loss=dapo")
    tau_h: float = _f(
        0.2,
        "fraction of high-entropy tokens exempt from S2T: h* = quantile(H over M, 1 - tau_h) (SPEC reading)",
        range="[0, 1]",
    )
    quantile_interpolation: str = _f("linear", "interpolation of entropy quantiles: linear | lower | higher | midpoint",
                                     choices=QUANTILE_MODES)
    # the one list field (a deliberate exception to scalar fields): ordered token rules on top of the method
    token_rules: List[Any] = spec(
        help="ordered token rules on top of the method, e.g. [{adv: pos, prob: [0, 0.002], entropy_q: [0, 0.8], "
             "action: mask}] (docs/LOSSES.md 'Token rules')", default_factory=list)
    # the second list field: rules only measured (token, positive-advantage and gradient shares)
    shadow: List[Any] = spec(
        help="presets or rules measured on every batch, never applied, e.g. [stapo, entropy20] or [table1] "
             "(000 Table 1's eight cells); logs shadow/<name>/{token,pos_adv,grad}_share (docs/LOSSES.md "
             "'Shadow rules')", default_factory=list)

    # a preset's silenced tokens are its S2T mask (stapo/* metrics report what it applied)
    PRESET_SILENCES: ClassVar[bool] = False

    def validate(self) -> None:
        super().validate()
        try:
            parse_rules(self.token_rules)
            self.shadows()
        except UserError as exc:
            raise UserError(f"{self.name}: {exc}") from None

    def preset_rules(self) -> tuple[TokenRule, ...]:
        """The rules a preset method is made of (STAPO, its ablations, 20-Entropy); none for the others."""
        return ()

    def rules(self) -> tuple[TokenRule, ...]:
        """Every rule the loss applies, in order: the preset's, then ``token_rules``."""
        return self.preset_rules() + parse_rules(self.token_rules)

    def shadows(self) -> tuple[tuple[str, tuple[TokenRule, ...]], ...]:
        """(name, rules) of each shadow: measured on every batch, never applied (``shadow``)."""
        if not self.shadow:  # also while LOSS_CONFIGS below is being built
            return ()
        return parse_shadows(self.shadow, self, LOSS_CONFIGS)


@dataclass
class ClipFields(DiagnosticFields):
    """PPO-style ratio clipping."""

    clip_ratio_low: float = _f(0.2, "epsilon_low: ratio floor 1 - clip_ratio_low", range="[0, 1]")
    clip_ratio_high: float = _f(0.28, "epsilon_high: ratio ceiling 1 + clip_ratio_high (clip-higher)",
                                range="[0, inf)")
    clip_ratio_c: Optional[float] = _f(None, "dual-clip constant c > 1 for negative advantages; None = off",
                                       range="(1, inf)")

    def validate(self) -> None:
        super().validate()
        # clip-higher widens the ceiling; a floor wider than the ceiling is a swapped pair
        _check(
            self.clip_ratio_low <= self.clip_ratio_high,
            f"{self.name}: clip_ratio_low={self.clip_ratio_low} > clip_ratio_high={self.clip_ratio_high} "
            "(swapped? DAPO uses 0.2 and 0.28)",
        )


@dataclass
class AggFields(ClipFields):
    """How token terms become one scalar."""

    loss_agg_mode: str = _f("token-mean", AGG_HELP, choices=AGG_MODES)
    per_microbatch_norm: bool = _f(
        False,
        "normalise by the micro-batch's own count (biased; the learner then scales by 1/n_micro) "
        "instead of the mini-batch count from prepare_minibatch (as verl 0.9.1 does)",
    )


# -- one config per registered method (the loss group's nodes) ----------------------------


@dataclass
class GRPOConfig(AggFields):
    """GRPO (000 §2.2): symmetric clip, mean over responses of the mean over their tokens."""

    name: str = _f("grpo", "registry key of the loss (loss=NAME)")
    clip_ratio_low: float = _f(0.2, "epsilon_low: ratio floor 1 - clip_ratio_low")
    clip_ratio_high: float = _f(0.2, "epsilon_high: ratio ceiling 1 + clip_ratio_high")
    loss_agg_mode: str = _f("seq-mean-token-mean", AGG_HELP)


@dataclass
class DAPOConfig(AggFields):
    """DAPO (000 §2.3): clip-higher [0.8, 1.28], token-mean over the mini-batch, dual clip off."""

    name: str = _f("dapo", "registry key of the loss (loss=NAME)")


@dataclass
class JustRLConfig(DAPOConfig):
    """JustRL (000 baseline [3]): DAPO clip-higher + token-mean, no KL, no entropy bonus."""

    name: str = _f("justrl", "registry key of the loss (loss=NAME)")


@dataclass
class STAPOConfig(AggFields):
    """STAPO: DAPO + S2T mask, loss renormalised by the count of unmasked tokens."""

    # the KL and entropy terms are never silenced: token-mean over every response token
    REGULARIZER_AGG: ClassVar[Optional[str]] = "token-mean"

    PRESET_SILENCES: ClassVar[bool] = True

    name: str = _f("stapo", "registry key of the loss (loss=NAME)")
    renormalize: bool = _f(True, "divide by sum_t I_t (000 Eq. 1) rather than by |M|")

    def preset_rules(self) -> tuple[TokenRule, ...]:
        """000 Eq. 1: silence A > 0, pi < tau_p, H < h* = quantile(H, 1 - tau_h)."""
        return (self._s2t(entropy_q=(None, 1.0 - self.tau_h)),)

    def _s2t(self, **entropy: Any) -> TokenRule:
        return TokenRule(name="s2t", adv="pos", prob=(None, self.tau_p), action="mask", renorm=self.renormalize,
                         **entropy)


@dataclass
class STAPOProbOnlyConfig(STAPOConfig):
    """Ablation: silence A > 0 and pi < tau_p (no entropy condition)."""

    name: str = _f("stapo_prob_only", "registry key of the loss (loss=NAME)")

    def preset_rules(self) -> tuple[TokenRule, ...]:
        return (self._s2t(),)


@dataclass
class STAPOHighEntropyConfig(STAPOConfig):
    """Ablation: silence A > 0 and pi < tau_p and H >= h*."""

    name: str = _f("stapo_high_entropy", "registry key of the loss (loss=NAME)")

    def preset_rules(self) -> tuple[TokenRule, ...]:
        return (self._s2t(entropy_q=(1.0 - self.tau_h, None)),)


@dataclass
class Entropy20Config(AggFields):
    """DAPO surrogate on tokens with H_t >= quantile(H over M, 1 - top_entropy_frac)."""

    name: str = _f("entropy20", "registry key of the loss (loss=NAME)")
    top_entropy_frac: float = _f(0.2, "fraction of highest-entropy response tokens that get gradient",
                                 range="(0, 1]")
    renormalize: bool = _f(
        False,
        "divide by the selected-token count instead of |M| (the 80/20 paper keeps 1/sum|o_i|)",
    )

    def preset_rules(self) -> tuple[TokenRule, ...]:
        """Keep H >= quantile(H, 1 - top_entropy_frac): mask the tokens below it."""
        return (TokenRule(name="entropy20", entropy_q=(None, 1.0 - self.top_entropy_frac), action="mask",
                          renorm=self.renormalize),)


@dataclass
class STAREConfig(AggFields):
    """STARE (arXiv 2606.19236, O1 with static weights): DAPO's clip-higher and token-mean, dual clip
    c = 10 (its script), the 10% least likely Â > 0 tokens' terms × W while the batch's H̄ < H_tgt."""

    name: str = _f("stare", "registry key of the loss (loss=NAME)")
    clip_ratio_c: Optional[float] = _f(10.0, "dual-clip constant (STARE's run script: 10.0)")
    stare_top_ratio: float = _f(0.1, "P: the top-P surprisal share of each advantage sign's tokens (L+, L-)",
                                range="(0, 1]")
    stare_w: float = _f(1.1, "W: factor of the L+ terms (Â > 0, high surprisal)", range="[0, inf)")
    stare_m: float = _f(1.0, "M: factor of the L- terms (Â < 0); 1 = variant O1, < 1 = C2 (paper: 0.9)",
                        range="[0, inf)")
    stare_target_entropy: float = _f(0.3, "H_tgt: the reweighting is on while the batch's mean H < H_tgt",
                                     range="(0, inf)")

    def preset_rules(self) -> tuple[TokenRule, ...]:
        """L+ = {Â > 0, π in the bottom P of the Â > 0 tokens} × W (and L- × M for C2), gated by H̄ < H_tgt."""
        band = dict(prob_q=(None, self.stare_top_ratio), mean_entropy=(None, self.stare_target_entropy))
        rules = (TokenRule(name="l_plus", adv="pos", action="scale", scale=self.stare_w, **band),)
        if self.stare_m != 1.0:
            rules += (TokenRule(name="l_minus", adv="neg", action="scale", scale=self.stare_m, **band),)
        return rules


@dataclass
class AdvantageReweightingConfig(GRPOConfig):
    """Advantage Reweighting (arXiv 2505.12929) on GRPO: Â_t ← (α·π_old(y_t) + 1 − α)·Â_t."""

    name: str = _f("advantage_reweighting", "registry key of the loss (loss=NAME)")
    ar_alpha: float = _f(0.3, "alpha of (alpha*pi_old + 1 - alpha); 0 = GRPO (AR-Lopti scripts: 0.3 with Lopti, "
                         "0.2 alone)", range="[0, 1]")

    def preset_rules(self) -> tuple[TokenRule, ...]:
        return (TokenRule(name="ar", action="weight", fn="old_prob", alpha=self.ar_alpha),)


@dataclass
class WAPOConfig(ClipFields):
    """WAPO: only A+ terms, 1/(G*T_max) per prompt, prompts without a winner contribute nothing."""

    REGULARIZER_AGG: ClassVar[Optional[str]] = "token-mean"  # WAPO has no loss_agg_mode

    name: str = _f("wapo", "registry key of the loss (loss=NAME)")
    winner_norm: str = _f("group", "per-prompt divisor: group (G, 002 default) | winners (G*r_bar variant)",
                          choices=WINNER_NORMS)
    prompt_norm: str = _f("winners", "average over prompts with a winner (conditional E_x) | all prompts",
                          choices=PROMPT_NORMS)


@dataclass
class TRGRPOConfig(AggFields):
    """TR-GRPO on the project's DAPO base (clip 0.2/0.28, token-mean); KL off like STAPO."""

    name: str = _f("tr_grpo", "registry key of the loss (loss=NAME)")
    alpha: float = _f(2.0, "alpha of w = clip(alpha*(sigmoid(z) - mu), L, U) (004 App. B)")
    mu: float = _f(0.25, "mu of the token weight")
    weight_low: float = _f(1.0, "L: lower clip of the token weight", range="[0, inf)")
    weight_high: float = _f(1.4, "U: upper clip of the token weight", range="[0, inf)")
    tau: float = _f(9.0, "tau of the sigmoid argument (004 sweep: 0.5, 2, 7, 9, 10, 20)", range="(0, inf)")
    tau_mode: str = _f("multiply", "z = tau*pi (multiply, SPEC reading) | pi/tau (divide, as printed: w = 1)",
                       choices=TAU_MODES)
    OWN_KL_ESTIMATOR: ClassVar[Optional[str]] = "tr_weighted"

    kl_coef: float = _f(0.0, "beta of the KL term to pi_ref (004 used 0.001); needs ref_log_prob")
    kl_estimator: str = _f("tr_weighted", "tr_weighted (004 Eq. 11: x - log x - 1, x = w*pi_ref/pi, added to "
                           "the token loss) | k1 | k2 | k3 | abs")

    def validate(self) -> None:
        super().validate()
        if self.weight_low > self.weight_high:
            raise ValueError(f"{self.name}: weight_low={self.weight_low} > weight_high={self.weight_high}")


@dataclass
class PPLShapingConfig(GRPOConfig):
    """A~ = A * (1 - alpha * w_ppl), w_ppl the standardised log-PPL within the prompt's group."""

    name: str = _f("ppl_shaping", "registry key of the loss (loss=NAME)")
    alpha: float = _f(0.01, "alpha of (1 - alpha * w_ppl) (003 §5: 0.01, favours low-PPL responses)")


@dataclass
class PositionShapingConfig(GRPOConfig):
    """A~_t = A_t + sign(A_t) * gamma * sigmoid(d * m * (l_t - n)) inside a step window."""

    name: str = _f("position_shaping", "registry key of the loss (loss=NAME)")
    gamma: float = _f(0.1, "bonus scale gamma (003 method: 0.1; 003 analysis: 1.0)")
    direction: float = _f(1.0, "d: +1 favours later tokens, -1 earlier ones")
    pos_scale: float = _f(15.0, "m in r = m * (l - n) (003 §5)")
    pos_shift: float = _f(0.5, "n in r = m * (l - n); 003 prints -0.5, which makes the bonus constant (READING)")
    rel_pos_mode: str = _f("closed", "l_t: closed = t/(|o|-1) in [0, 1] (003) | spec = (t+1)/|o| in (0, 1]",
                           choices=REL_POS_MODES)
    start_step: int = _f(0, "first global_step with the bonus (003 used 200, the plateau stage)", range="[0, inf)")
    stop_step: Optional[int] = _f(None, "first global_step without it again (003: start + 100); None = never",
                                  range="[0, inf)")

    def validate(self) -> None:
        super().validate()
        if self.stop_step is not None and self.stop_step <= self.start_step:
            raise ValueError(f"{self.name}: stop_step={self.stop_step} <= start_step={self.start_step} (the bonus "
                             "window would be empty)")


# the built-in methods' configs, in the order of the issue (and of `stapoctl losses`), known
# without importing the tensor code; `register_loss` adds any method registered at run time
LOSS_CONFIGS: dict[str, type] = {
    cls().name: cls
    for cls in (GRPOConfig, DAPOConfig, STAPOConfig, STAPOProbOnlyConfig, STAPOHighEntropyConfig, Entropy20Config,
                JustRLConfig, WAPOConfig, TRGRPOConfig, PPLShapingConfig, PositionShapingConfig, STAREConfig,
                AdvantageReweightingConfig)
}
