"""The per-token trace page (tracking/token_page.py): decoded with offsets through the embedded
model's byte-level BPE (a character split over byte tokens reads whole), model output escaped, the
numbers in each token's data-attributes equal to the batch's, the tokens a rule acted on outlined
and named, and the page self-contained (no external reference)."""

from __future__ import annotations

import html
import re

import pytest
import torch

from stapoctl.losses.drift import drift
from stapoctl.rollout.batch import RolloutBatch
from stapoctl.trainer.inert import loss_config
from stapoctl.tracking.token_diagnostics import CATEGORIES, diagnose, write_page
from stapoctl.tracking.token_page import pick_groups, token_texts

TEXTS = ["x = 12 → done ✓ <script>alert(1)</script>", "naïve café 日本 & more", "plain 7", "ok\nnext line"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from stapoctl.models.tokenizer import train_tokenizer

    return train_tokenizer(["x = 12 plain ok next line done more alert script"] * 20, 300,
                           tmp_path_factory.mktemp("tok"))


def test_offsets_give_each_character_whole(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        parts = token_texts(ids, tok.decode)
        assert len(parts) == len(ids)
        assert "".join(parts) == tok.decode(ids) == text
        assert "\ufffd" not in "".join(parts)
    split = tok.encode("日")
    assert len(split) == 3 and token_texts(split, tok.decode) == ["", "", "日"]  # 3 UTF-8 bytes, 3 byte tokens


def test_groups_where_rules_acted_most_plus_one_seeded():
    groups = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    acted = [0, 0, 5, 0, 1, 1, 0, 0, 9, 0]
    picked = pick_groups(groups, acted, seed=7, top=2)
    assert picked[:2] == [4, 1] and picked[2] in (0, 2, 3) and len(picked) == 3
    assert pick_groups(groups, acted, seed=7, top=2) == picked  # the seed decides the drawn one


def make_batch(tok, n: int = 2):
    g = torch.Generator().manual_seed(0)
    prompts = [tok.encode("x = 12 plain")] * 2
    responses = [[tok.encode(TEXTS[0]), tok.encode(TEXTS[1])], [tok.encode(TEXTS[2]), tok.encode(TEXTS[3])]]
    lps = [[[-float(v) for v in torch.rand(len(r), generator=g) * 9] for r in rs] for rs in responses]
    b = RolloutBatch.from_token_lists(prompts, responses, lps, [[False] * n] * 2, [TEXTS[:2], TEXTS[2:]], pad_id=0)
    learner = b.rollout_log_probs + 0.4 * torch.randn(b.rollout_log_probs.shape, generator=g) * b.response_mask
    ent = torch.rand(b.rollout_log_probs.shape, generator=g) * 2
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])  # only group 1 has Â > 0: the page shows it first
    return b.with_(rewards=adv, advantages=adv), learner, ent


def test_the_page_shows_the_batch_numbers_escaped_and_outlined(tok, tmp_path):
    b, learner, ent = make_batch(tok)
    cfg = {"name": "stapo", "tau_p": 0.05, "tau_h": 0.2}
    d = drift(loss_config(cfg), learner_log_prob=learner, rollout_log_prob=b.rollout_log_probs, entropy=ent,
              advantages=b.advantages, response_mask=b.response_mask, mini_rows=4)
    diag = diagnose(b.response_ids, b.response_mask, b.advantages, learner, ent, tau_p=0.05, tau_h=0.2, mini_rows=4)
    path = write_page(tmp_path, b, learner, ent, cfg, step=3, mini_rows=4, decode=tok.decode, drift=d, seed=1,
                      counts=diag.counts)
    page = path.read_text()
    assert page.count("<script") == 1 and "alert(1)</script>" not in page  # model output is text: our script only
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)  # nothing fetched: one file
    spans = re.findall(r'<span class="t([^"]*)" ([^>]*)>([^<]*)</span>', page)
    assert len(spans) == int(b.response_mask.sum())  # both groups: every response token once
    acted = [s for s in spans if "acted" in s[0]]
    assert len(acted) == int(d.acted["s2t"].sum()) > 0
    h_star = float(diag.thresholds[0])
    for cls, attrs, _ in acted:
        a = dict(re.findall(r'data-(\w+)="([^"]*)"', attrs))
        assert a["rules"] == "s2t" and a["cat"] == html.escape(CATEGORIES["p<tau,A>0,H<h"])
        assert float(a["pi"]) < 0.05 and float(a["h"]) < float(a["hstar"]) == pytest.approx(h_star, rel=1e-5)
        assert float(a["adv"]) > 0
    blocks = re.findall(r'<div class="resp" data-row="(\d+)">(.*?)</pre></div>', page, flags=re.S)
    assert [int(r) for r, _ in blocks] == [2, 3, 0, 1]  # the group where the rule acted first, then the drawn one
    # every token's numbers are its batch row's, found through data-row and data-pos
    for row, body in blocks:
        r = int(row)
        shown_spans = re.findall(r'<span class="t([^"]*)" ([^>]*)>([^<]*)</span>', body)
        assert len(shown_spans) == int(b.response_mask[r].sum())
        for _, attrs, _ in shown_spans:
            a = dict(re.findall(r'data-(\w+)="([^"]*)"', attrs))
            t = int(a["pos"])
            assert float(a["pi"]) == pytest.approx(float(learner[r, t].exp()), rel=1e-5)
            assert float(a["h"]) == pytest.approx(float(ent[r, t]), rel=1e-5)
            assert float(a["dlogp"]) == pytest.approx(float((learner[r, t] - b.rollout_log_probs[r, t]).abs()),
                                                       rel=1e-4, abs=1e-6)
            assert float(a["ratio"]) == pytest.approx(float((learner[r, t] - b.rollout_log_probs[r, t]).exp()),
                                                       rel=1e-4)
        shown = "".join(html.unescape(s[2]) for s in shown_spans)
        assert shown.replace("⏎\n", "\n") == b.texts[r]  # reads as the response, markup and all, as text
    assert "π = π_old" in page and "only tokens a rule acted on" in page
