"""Token masks: S2T (000 Eq. 1) and its ablations (000 Fig. 5), 20-Entropy selection, h*.

Quantile semantics (SPEC reading of 000 Remark 3.5): h* = quantile(H over M, 1 - tau_h),
computed over the response tokens M of the whole mini-batch; a token is low-entropy iff
H_t < h* (strict), high-entropy iff H_t >= h*. Consequences fixed by the tests: with all
entropies equal no token is low-entropy (S2T masks nothing, 20-Entropy keeps every token);
an empty M gives h* = 0.0 (nothing to mask either way).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stapoctl.config.losses import QUANTILE_MODES

S2T_KINDS = ("s2t", "prob_only", "high_entropy")


def masked_quantile(values: Tensor, mask: Tensor, q: float, interpolation: str = "linear") -> Tensor:
    """Quantile of ``values[mask]`` (numpy/torch semantics for ``interpolation``), 0-dim fp32.

    Sort-based, so it has no input-size limit (torch.quantile refuses > 16M elements).
    """
    if interpolation not in QUANTILE_MODES:
        raise ValueError(f"interpolation={interpolation!r} is not one of {', '.join(QUANTILE_MODES)}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q={q} must lie in [0, 1]")
    x = values.detach().float()[mask.to(torch.bool)]
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=values.device)
    xs = torch.sort(x).values
    pos = q * (n - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    if interpolation == "lower":
        return xs[lo]
    if interpolation == "higher":
        return xs[hi]
    if interpolation == "midpoint":
        return (xs[lo] + xs[hi]) / 2
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def entropy_threshold(entropy: Tensor, mask: Tensor, tau_h: float, interpolation: str = "linear") -> Tensor:
    """S2T h*: the (1 - tau_h) quantile of the response-token entropies."""
    return masked_quantile(entropy, mask, 1.0 - tau_h, interpolation)


def s2t_mask(
    advantages: Tensor,
    prob: Tensor,
    entropy: Tensor,
    mask: Tensor,
    *,
    tau_p: float,
    threshold: Tensor | float,
    kind: str = "s2t",
) -> Tensor:
    """Tokens to silence (True = I_t = 0). Never a token with A <= 0 or outside the response.

    s2t: A > 0 and pi < tau_p and H < h*; prob_only: A > 0 and pi < tau_p;
    high_entropy: A > 0 and pi < tau_p and H >= h*.
    """
    if kind not in S2T_KINDS:
        raise ValueError(f"kind={kind!r} is not one of {', '.join(S2T_KINDS)}")
    silenced = mask.to(torch.bool) & (advantages > 0) & (prob < tau_p)
    if kind == "s2t":
        silenced = silenced & (entropy < threshold)
    elif kind == "high_entropy":
        silenced = silenced & (entropy >= threshold)
    return silenced


def high_entropy_mask(entropy: Tensor, mask: Tensor, threshold: Tensor | float) -> Tensor:
    """20-Entropy's selection: response tokens with H_t >= threshold."""
    return mask.to(torch.bool) & (entropy >= threshold)
