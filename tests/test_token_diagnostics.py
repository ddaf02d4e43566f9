"""Token diagnostics (000 §3) on a hand-made batch: categories, histograms and the listed
tokens equal what is computed by hand below."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from stapoctl.tracking import token_diagnostics as td

# 3 responses: Â = +1, −1, 0; π and H per token; '.' marks padding
PROB = [[0.5, 0.002, 0.0005, 1.0], [0.9, 0.002, 0.5, 0.0002], [0.002, 0.9, 1.0, 1.0]]
ENT = [[0.1, 0.5, 0.05, 9.0], [0.2, 0.6, 1.0, 0.3], [0.4, 0.8, 9.0, 9.0]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
ADV = [1.0, -1.0, 0.0]
TEXT = ["abc.", "defg", "hi.."]
P_EDGES = [-4.0, -3.0, -2.0, -1.0, 0.0]  # log10 π
H_EDGES = [0.0, 0.5, 1.0]


def decode(ids):
    return "".join(chr(ord("a") + i) for i in ids)


def diagnose(**kw):
    ids = torch.tensor([[ord(c) - ord("a") if c != "." else 0 for c in t] for t in TEXT])
    return td.diagnose(ids, torch.tensor(MASK, dtype=torch.bool), torch.tensor(ADV), torch.tensor(PROB).log(),
                       torch.tensor(ENT), tau_p=0.01, tau_h=0.5, prob_edges=P_EDGES, entropy_edges=H_EDGES,
                       decode=decode, **kw)


def hist(*cells):
    out = np.zeros((4, 2))
    for c in cells:
        out[c] += 1
    return out


def test_one_minibatch_counts_and_histograms():
    d = diagnose(context=1)
    # h* = median of the 9 response entropies 0.05 0.1 0.2 0.3 0.4 | 0.5 0.6 0.8 1.0 → 0.4
    assert d.thresholds == [pytest.approx(0.4)]
    assert d.response_tokens == 9 and d.zero_advantage == 2  # the Â = 0 response is in no category
    assert d.counts == {
        "p>=tau,A>0,H>=h": 0,
        "p>=tau,A>0,H<h": 1,   # π .5,  H .1
        "p<tau,A>0,H>=h": 1,   # π .002, H .5
        "p<tau,A>0,H<h": 1,    # π .0005, H .05: the spurious token
        "p>=tau,A<0,H>=h": 1,  # π .5, H 1.0
        "p>=tau,A<0,H<h": 1,   # π .9, H .2
        "p<tau,A<0,H>=h": 1,   # π .002, H .6
        "p<tau,A<0,H<h": 1,    # π .0002, H .3
    }
    # log10 π bins [-4,-3) [-3,-2) [-2,-1) [-1,0]; H bins [0,.5) [.5,1.0]
    assert np.array_equal(d.hist["p>=tau,A>0,H<h"], hist((3, 0)))
    assert np.array_equal(d.hist["p<tau,A>0,H>=h"], hist((1, 1)))
    assert np.array_equal(d.hist[td.SPURIOUS], hist((0, 0)))
    assert np.array_equal(d.hist["p>=tau,A<0,H>=h"], hist((3, 1)))  # H = 1.0 sits on the last edge: counted
    assert np.array_equal(d.hist["p<tau,A<0,H<h"], hist((0, 0)))
    assert np.array_equal(d.hist["p>=tau,A>0,H>=h"], np.zeros((4, 2)))
    assert sum(h.sum() for h in d.hist.values()) == 7
    # the listed (silenced) token, decoded with ±1 token of context
    assert d.total_listed == 1 and d.applied
    (tok,) = d.tokens
    assert (tok["row"], tok["position"], tok["token"], tok["left"], tok["right"]) == (0, 2, "c", "b", "")
    assert tok["prob"] == pytest.approx(0.0005) and tok["advantage"] == 1.0 and tok["cut_left"]
    assert "…b⟦c⟧" in td.markdown_table(d, "stapo")


def test_minibatch_thresholds_are_per_minibatch():
    d = diagnose(mini_rows=1)
    # one row per mini-batch: h* = median of each row's own tokens: .1 | (.3+.6)/2 | (.4+.8)/2
    assert d.thresholds == [pytest.approx(0.1), pytest.approx(0.45), pytest.approx(0.6)]
    assert d.counts["p>=tau,A>0,H>=h"] == 1 and d.counts["p>=tau,A>0,H<h"] == 0  # H .1 >= h* .1
    assert d.counts[td.SPURIOUS] == 1 and d.counts["p<tau,A<0,H<h"] == 1


def test_ablation_and_measured_only_listing():
    d = diagnose(silencing="prob_only")  # Â > 0 and π < τ_p, rarest first
    assert [(t["row"], t["position"]) for t in d.tokens] == [(0, 2), (0, 1)]
    measured = diagnose(silencing=None)
    assert not measured.applied and measured.total_listed == 1
    assert "does not silence" in td.markdown_table(measured, "grpo")


def test_artifacts_are_written(tmp_path):
    d = diagnose(step=20)
    paths = td.write(d, tmp_path / "step_000020", loss_name="stapo")
    assert [p.name for p in paths] == list(td.FILES)
    data = json.loads(paths[0].read_text())
    assert data["counts"][td.SPURIOUS] == 1 and data["step"] == 20
    assert data["histogram"]["counts"]["p>=tau,A<0,H>=h"][3] == [0, 1]
    assert math.isclose(data["fractions"][td.SPURIOUS], 1 / 9)
    assert paths[1].read_bytes()[:4] == b"\x89PNG" and paths[1].stat().st_size > 20_000
    assert "| 1 | 0:2 | `c` |" in paths[2].read_text()
