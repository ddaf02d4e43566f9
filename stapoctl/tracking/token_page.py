"""The per-token trace page of a diagnostics step (`diagnostics/step_N/tokens.html`): a handful of
prompt groups, every response token by token, coloured by a channel the reader picks (π, H, Â,
|Δ log p| learner vs vLLM, the IS ratio π_old / π_vLLM), each token a rule or shadow rule acted on
outlined and named, its numbers in data-attributes, on hover and on click.

One self-contained file (MLflow shows HTML artifacts in a sandboxed iframe: no fetch, no storage;
it must also open from disk): styles and the small script are inline, every text from the model or
the user goes through `html.escape`. Pure: a hand-made batch renders it.
"""

from __future__ import annotations

import html
import json
import math
import random
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

FILE = "tokens.html"
CHANNELS = {"pi": "π (learner, π_old)", "h": "H (nats)", "adv": "Â", "dlogp": "|Δ log p| learner − vLLM",
            "ratio": "IS ratio π_old / π_vLLM"}
MAX_TOKENS = 20_000  # tokens on one page: a long-response run shows the start of each response
PENDING = "\ufffd"  # what a decoder returns for the bytes of a character not yet complete


def token_texts(ids: Sequence[int], decode: Callable[[list[int]], str], window: int = 8) -> list[str]:
    """Each token's share of the decoded text: the characters decoding it added (its offsets in
    the response). A character split over byte-level tokens is given, whole, to the token that
    completes it; the ones before it get "". Decodes a short window, not every prefix."""
    out: list[str] = []
    start, prefix, pending = 0, "", 0
    ids = list(ids)
    for k in range(len(ids)):
        cur = decode(ids[start:k + 1])
        if cur.endswith(PENDING) and pending < 4:
            out.append("")
            pending += 1
            continue
        out.append(cur[len(prefix):] if cur.startswith(prefix) else cur)
        pending = 0
        if k + 1 - start > window:
            start = k + 1 - window // 2
            prefix = decode(ids[start:k + 1])
        else:
            prefix = cur
    return out


def pick_groups(group_ids: Sequence[int], acted_per_row: Sequence[int], seed: int, top: int = 3) -> list[int]:
    """The groups where rules acted on the most tokens (up to `top`), plus one drawn with `seed`."""
    counts: dict[int, int] = {}
    for g, n in zip(group_ids, acted_per_row):
        counts[int(g)] = counts.get(int(g), 0) + int(n)
    ranked = sorted((g for g, n in counts.items() if n > 0), key=lambda g: (-counts[g], g))[:top]
    rest = sorted(set(counts) - set(ranked))
    if rest:
        ranked.append(random.Random(seed).choice(rest))
    return ranked


@dataclass
class PageRows:
    """Per-row lists (response tokens only) of everything the page shows."""

    prompts: list[str]
    texts: list[list[str]]
    rewards: list[float]
    group: list[int]
    values: list[dict[str, list[float]]]  # channel → per token
    h_star: list[float]
    category: list[list[str]]
    acted: list[list[list[str]]]  # per token: the rules / shadows that acted on it
    flipped: list[list[list[str]]]  # per token: those whose decision vLLM's π flips
    row: list[int] = dataclasses.field(default_factory=list)  # each one's row in the step's batch


def _num(x: float) -> str:
    return "nan" if x is None or not math.isfinite(x) else f"{x:.6g}"


def _token(r: PageRows, i: int, t: int) -> str:
    v = {c: r.values[i][c][t] for c in CHANNELS}
    acted, flipped = r.acted[i][t], r.flipped[i][t]
    attrs = {"data-pi": _num(v["pi"]), "data-h": _num(v["h"]), "data-adv": _num(v["adv"]),
             "data-dlogp": _num(v["dlogp"]), "data-ratio": _num(v["ratio"]), "data-hstar": _num(r.h_star[i]),
             "data-cat": r.category[i][t], "data-rules": " ".join(acted), "data-flips": " ".join(flipped),
             "data-pos": str(t)}
    title = (f"π {v['pi']:.4g} · H {v['h']:.4g} · h* {r.h_star[i]:.4g} · Â {v['adv']:+.3g} · |Δlogp| "
             f"{v['dlogp']:.3g} · ratio {v['ratio']:.4g} · {r.category[i][t] or 'Â = 0'}"
             + (f" · rule {', '.join(acted)} (action applied)" if acted else "")
             + (f" · flips under vLLM π: {', '.join(flipped)}" if flipped else ""))
    live = [a for a in acted if not a.startswith("shadow-")]  # applied; a shadow only measured
    cls = "t" + (" acted" if live else " shadow" if acted else "") + (" flip" if flipped else "")
    text = r.texts[i][t]
    shown = html.escape(text.replace("\n", "⏎\n"), quote=False)
    label = f'<sup class="rule">{html.escape(",".join(live))}</sup>' if live else ""
    attr_text = " ".join(f'{k}="{html.escape(val)}"' for k, val in attrs.items())
    return f'<span class="{cls}" {attr_text} title="{html.escape(title)}">{shown}</span>{label}'


def _response(r: PageRows, i: int) -> str:
    n = len(r.texts[i])
    head = (f'<div class="resp" data-row="{r.row[i]}"><div class="meta">row {r.row[i]} · '
            f"reward {r.rewards[i]:+.3g} · {n} tokens · h* {r.h_star[i]:.4g}</div><pre>")
    return head + "".join(_token(r, i, t) for t in range(n)) + "</pre></div>"


STYLE = """
body{font-family:system-ui,sans-serif;margin:1em;color:#222}
pre{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:13px;line-height:1.9;margin:.3em 0}
.t{border-radius:2px;cursor:pointer}
.t.acted{outline:2px solid #c00;outline-offset:1px}
.t.shadow{outline:1px dashed #c00;outline-offset:1px}
.t.flip{box-shadow:0 0 0 3px #f90}
sup.rule{color:#c00;font-size:9px;margin-right:2px}
.group{border-top:1px solid #ccc;margin-top:1em;padding-top:.5em}
.prompt{color:#555;white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:12px}
.meta{color:#777;font-size:12px}
body.only .t:not(.acted):not(.shadow){background:none!important;opacity:.35}
#detail{position:sticky;top:0;background:#fffbe6;border:1px solid #e6d9a8;padding:.4em;font-size:13px;min-height:1.2em}
table.counts td,table.counts th{padding:0 .6em;font-size:12px;text-align:right}
"""

SCRIPT = """
(function(){
var ch=document.getElementById('channel'),only=document.getElementById('only'),det=document.getElementById('detail');
function colour(){var c=ch.value,ts=document.querySelectorAll('.t');for(var i=0;i<ts.length;i++){
var v=parseFloat(ts[i].getAttribute('data-'+c)),x;if(isNaN(v)){ts[i].style.background='';continue;}
if(c==='pi'){x=1-Math.min(1,Math.max(0,(Math.log10(Math.max(v,1e-8))+8)/8));}
else if(c==='h'){x=Math.min(1,v/3);}else if(c==='dlogp'){x=Math.min(1,v/0.5);}
else if(c==='ratio'){x=Math.min(1,Math.abs(Math.log(Math.max(v,1e-8)))/0.5);}
else{ts[i].style.background=v>0?'rgba(0,150,0,'+Math.min(1,Math.abs(v))*0.35+')':(v<0?'rgba(200,0,0,'+Math.min(1,Math.abs(v))*0.35+')':'');continue;}
ts[i].style.background='rgba(0,90,255,'+(x*0.6).toFixed(3)+')';}}
ch.addEventListener('change',colour);only.addEventListener('change',function(){document.body.classList.toggle('only',only.checked);});
document.addEventListener('click',function(e){var t=e.target.closest('.t');if(!t)return;var a=t.dataset;
det.textContent='token '+JSON.stringify(t.textContent)+' · π '+a.pi+' · H '+a.h+' · h* '+a.hstar+' · Â '+a.adv+' · |Δlogp| '+a.dlogp+' · ratio '+a.ratio+' · '+(a.cat||'Â = 0')+(a.rules?' · rule '+a.rules+' (action applied)':'')+(a.flips?' · flips under vLLM π: '+a.flips:'');});
colour();})();
"""


def render(rows: PageRows, groups: list[int], *, step: int, loss: str, counts: dict[str, int], response_tokens: int,
           rule_actions: dict[str, str], drift_note: str, labels: Optional[dict[str, str]] = None) -> str:
    """The page: header (step, loss, counts, which π decides), controls, then each group's responses."""
    labels = labels or {}
    options = "".join(f'<option value="{k}">{html.escape(v)}</option>' for k, v in CHANNELS.items())
    count_rows = "".join(f"<tr><th>{html.escape(labels.get(k, k))}</th><td>{v}</td>"
                         f"<td>{v / max(response_tokens, 1):.3%}</td></tr>" for k, v in counts.items())
    rules = "; ".join(f"{html.escape(k)}: {html.escape(v)}" for k, v in rule_actions.items()) or "none configured"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>tokens · step {step}</title>"
             f"<style>{STYLE}</style></head><body>",
             f"<h2>Token trace · step {step} · loss {html.escape(loss)}</h2>",
             "<p>Outlined: tokens a rule acted on (solid, its name above; dashed: a shadow rule only, measured, "
             "never applied), decided with <b>π = π_old</b>, the learner's "
             "π before this step's update — what the rules read in the first mini-batch; later mini-batches read "
             "π after the earlier updates. Orange ring: the decision flips when π comes from vLLM instead "
             f"(H and h* stay the learner's). {html.escape(drift_note)}</p>",
             f"<p>Rules: {rules}</p>",
             f"<table class='counts'><tr><th>category (000 Table 1)</th><th>tokens</th><th>share</th></tr>{count_rows}"
             f"<tr><th>response tokens</th><td>{response_tokens}</td><td></td></tr></table>",
             f"<p>colour by <select id='channel'>{options}</select> <label><input type='checkbox' id='only'> only "
             "tokens a rule acted on</label></p><div id='detail'>click a token for its numbers</div>"]
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(rows.group):
        by_group.setdefault(g, []).append(i)
    for g in groups:
        members = by_group.get(g, [])
        if not members:
            continue
        acted = sum(1 for i in members for a in rows.acted[i] if a)
        parts.append(f'<div class="group" data-group="{g}"><h3>group {g} · {acted} tokens acted on</h3>'
                     f'<div class="prompt">{html.escape(rows.prompts[members[0]])}</div>')
        parts += [_response(rows, i) for i in members]
        parts.append("</div>")
    parts.append(f"<script>{SCRIPT}</script></body></html>")
    return "".join(parts)


def rows_of(batch: Any, log_probs: Any, entropy: Any, h_star: Any, cats: dict[str, Any], drift: Any,
            decode: Callable[[list[int]], str], rows: list[int], labels: dict[str, str]) -> PageRows:
    """The page's lists for `rows` of a scored batch (tensors [N, R]; h_star [N, 1])."""
    import torch

    mask = batch.response_mask.bool()
    adv = batch.advantages.float()
    adv = adv[:, None].expand_as(mask) if adv.dim() == 1 else adv
    old, behav = log_probs.float(), batch.rollout_log_probs.float()
    acted = drift.acted if drift is not None else {}
    flipped = drift.flipped if drift is not None else {}
    out = PageRows([], [], [], [], [], [], [], [], [])
    budget = MAX_TOKENS
    for i in rows:
        n = min(int(mask[i].sum()), max(budget, 0))
        budget -= n
        ids = batch.response_ids[i, :n].tolist()
        out.prompts.append(decode([t for t, m in zip(batch.prompt_ids[i].tolist(),
                                                     batch.prompt_mask[i].tolist()) if m]))
        out.texts.append(token_texts(ids, decode))
        out.rewards.append(float(batch.rewards[i]))
        out.group.append(int(batch.group_ids[i]))
        ratio = torch.exp((old[i, :n] - behav[i, :n]).clamp(-20, 20))
        out.values.append({"pi": old[i, :n].exp().tolist(), "h": entropy[i, :n].float().tolist(),
                           "adv": adv[i, :n].tolist(), "dlogp": (old[i, :n] - behav[i, :n]).abs().tolist(),
                           "ratio": ratio.tolist()})
        out.h_star.append(float(h_star[i, 0]))
        out.row.append(int(i))
        out.category.append([next((labels[k] for k, m in cats.items() if bool(m[i, t])), "") for t in range(n)])
        out.acted.append([[_name(k) for k, m in acted.items() if bool(m[i, t])] for t in range(n)])
        out.flipped.append([[_name(k) for k, m in flipped.items() if bool(m[i, t])] for t in range(n)])
    return out


def _name(key: str) -> str:
    return key.replace("shadow:", "shadow-")


def write_page(path: Any, batch: Any, log_probs: Any, entropy: Any, h_star: Any, cats: dict[str, Any], *,
               drift: Any, decode: Callable[[list[int]], str], step: int, seed: int, loss: str,
               labels: dict[str, str], counts: dict[str, int]) -> Optional[str]:
    """Pick the groups, render, write `path`; returns the page's text."""
    from pathlib import Path

    mask = batch.response_mask.bool()
    acted_any = mask & False
    for m in (drift.acted.values() if drift is not None else []):
        acted_any = acted_any | m
    per_row = (acted_any & mask).sum(1).tolist()
    groups = pick_groups(batch.group_ids.tolist(), per_row, seed * 100_003 + step)
    rows = [i for i, g in enumerate(batch.group_ids.tolist()) if int(g) in groups]
    page_rows = rows_of(batch, log_probs, entropy, h_star, cats, drift, decode, rows, labels)
    actions = {_name(k): v for k, v in drift.rules.items()} if drift is not None else {}
    note = (f"Flips this step: {json.dumps({_name(k): int(v.sum()) for k, v in drift.flipped.items()})}."
            if drift is not None else "No vLLM log-probs this step: no rule outline, no flips.")
    text = render(page_rows, groups, step=step, loss=loss, counts=counts,
                  response_tokens=int(mask.sum()), rule_actions=actions, drift_note=note, labels=labels)
    Path(path).write_text(text, encoding="utf-8")
    return text
