"""One evaluation protocol per table (issue #33 item 2): each validation and `stapoctl eval`
records its protocol (canonical JSON artifact, its sha256 as the tag `keys.PROTOCOL`), and
`compare` refuses rows evaluated under different ones in one line naming the fields that
differ, unless --mixed-protocols (the table then says so); untagged (older) runs are "unknown".

Stores are built without training, as test_compare_merge does; the protocols are the real
`eval/protocol.build` of the tiny experiment's toy held-out set. The protocol a real training
run's validation writes is checked in test_train_e2e.py.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from mlflow.entities import Metric, Param
from test_compare_merge import BENCH_METRIC, STEPS, Store

from stapoctl.data.benches import DECODINGS, Decoding
from stapoctl.errors import UserError
from stapoctl.tracking import keys

GRPO = [0.40, 0.42, 0.44]
WAPO = [0.50, 0.52, 0.54]
# "train" sampled at T=0.6, top-p 0.95 instead of T=1.0, top-p 1.0: the same metric name, another protocol
OTHER_TRAIN = Decoding("train", 0.6, 0.95)


@pytest.fixture(scope="module")
def protocols():
    """(conf, the tiny experiment's validation protocol, the same under OTHER_TRAIN)."""
    from stapoctl.config.compose import compose_config
    from stapoctl.data.toy import rows
    from stapoctl.eval.protocol import build
    from stapoctl.eval.runner import Problem

    conf = compose_config(["data.toy.num_heldout=16"])
    problems = [Problem(r["id"], [], r["answer"], r["problem"]) for r in rows(conf.data.toy, "heldout")]
    assert len(problems) == 16
    return conf, build(conf, {"toy": (problems, 4)}, [DECODINGS["train"]]), \
        build(conf, {"toy": (problems, 4)}, [OTHER_TRAIN])


def test_the_protocol_names_what_moves_accuracy(protocols):
    from stapoctl.eval.protocol import canonical, differing_fields, digest

    conf, p, other = protocols
    assert p["decodings"] == {"train": {"temperature": 1.0, "top_p": 1.0}}
    assert p["benches"]["toy"]["problems"] == 16 and p["benches"]["toy"]["k"] == 4
    assert p["benches"]["toy"]["generator"]["num_heldout"] == 16 and p["benches"]["toy"]["generator"]["seed"] == 1234
    assert p["max_tokens"] == conf.eval.max_response_length
    assert p["prompt"] == {"template": "chat", "instruction": conf.data.instruction}
    assert p["verifier"]["name"] == "dapo_rule_verifier" and p["verifier"]["version"] == 2  # 2: list golds
    assert p["answer_extraction"]["version"] == 1
    # the problems' sha256 is over [id, problem, answer] lines, recomputed here
    from stapoctl.data.toy import rows

    lines = "".join(json.dumps([r["id"], r["problem"], r["answer"]]) + "\n" for r in rows(conf.data.toy, "heldout"))
    assert p["benches"]["toy"]["sha256"] == hashlib.sha256(lines.encode()).hexdigest()
    # canonical: key order does not matter, the digest is the sha256 of that text
    shuffled = dict(reversed(list(p.items())))
    assert canonical(shuffled) == canonical(p)
    assert digest(p) == hashlib.sha256(canonical(p).encode()).hexdigest() != digest(other)
    assert differing_fields([p, other]) == ["decodings.train.temperature", "decodings.train.top_p"]
    assert differing_fields([p, dict(p, prompt={"template": "chat", "instruction": "Answer."})]) == [
        "prompt.instruction"]


def test_an_eval_run_records_its_protocol(protocols, tmp_path, monkeypatch):
    """log_mlflow (what `stapoctl eval` calls) writes the artifact and the tag; sha256 of the
    artifact's bytes is the tag."""
    import mlflow

    from stapoctl.eval.mlflow_log import eval_run, log_mlflow
    from stapoctl.eval.protocol import digest
    from test_eval_parts import _summary

    conf, p, _ = protocols
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    conf = conf.copy()
    conf.tracking.uri, conf.tracking.experiment = uri, "e"
    summary = dict(_summary(), limit=None)
    with eval_run(conf, "", summary["model_path"]) as opened:
        log_mlflow(conf, summary, [], p)
    client = mlflow.MlflowClient(tracking_uri=uri)
    tag = client.get_run(opened.info.run_id).data.tags[keys.PROTOCOL]
    path = client.download_artifacts(opened.info.run_id, keys.PROTOCOL_ARTIFACT, str(tmp_path))
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == tag == digest(p)


def _trial(s: Store, sweep: str, value: str, seed: int, acc: float, protocol) -> str:
    """A FINISHED trial with its last validation; protocol None: recorded before protocols."""
    from stapoctl.eval.protocol import canonical, digest

    run = s.client.create_run(s.exp, run_name=f"{value}-seed{seed}", start_time=s.tick(),
                              tags={keys.PARENT: sweep, keys.KIND: keys.KIND_TRAIN, keys.SWEEP_ID: sweep,
                                    keys.SWEEP_VALUE: value, keys.SEED: str(seed),
                                    **({keys.PROTOCOL: digest(protocol)} if protocol else {})})
    rid = run.info.run_id
    s.client.log_batch(rid, params=[Param("trainer.seed", str(seed))], metrics=[Metric(BENCH_METRIC, acc, s.clock, STEPS)])
    if protocol:
        s.client.log_text(rid, canonical(protocol), keys.PROTOCOL_ARTIFACT)
    s.client.set_terminated(rid, "FINISHED", end_time=s.tick())
    return rid


@pytest.fixture(scope="module")
def sweeps(protocols, tmp_path_factory):
    """same: grpo and wapo under one protocol; decodings: wapo under OTHER_TRAIN; old: grpo
    untagged (recorded before protocols), wapo tagged; untagged: nothing tagged."""
    _, p, other = protocols
    root = tmp_path_factory.mktemp("protocol_store")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        s = Store(root)
        out = {}
        for name, (pg, pw) in {"same": (p, p), "decodings": (p, other), "old": (None, p),
                               "untagged": (None, None)}.items():
            sid = out[name] = s.sweep(name, "loss")
            for seed in range(3):
                _trial(s, sid, "grpo", seed, GRPO[seed], pg)
                _trial(s, sid, "wapo", seed, WAPO[seed], pw)
    finally:
        os.chdir(cwd)
    return {"uri": s.uri, **out}


def _compare(sweeps, name, tmp_path, **kw):
    from rich.console import Console

    from stapoctl.analysis.compare import compare

    console = Console(width=250, record=True)
    compare(sweeps["uri"], [sweeps[name]], console, out=str(tmp_path / name), **kw)
    return console.export_text(), json.loads((tmp_path / name / "table.json").read_text())


def test_one_protocol_is_shown_and_recorded(sweeps, protocols, tmp_path):
    from stapoctl.eval.protocol import digest

    text, table = _compare(sweeps, "same", tmp_path)
    sha = digest(protocols[1])
    assert f"evaluation protocol {sha[:12]} (6 runs)" in text
    assert table["protocol"]["mixed"] is False and list(table["protocol"]["runs"]) == [sha]
    assert len(table["protocol"]["runs"][sha]) == 6
    assert all(r["protocols"] == {"val": sha} for r in table["runs"])


def test_two_decodings_are_refused_in_one_line_naming_the_fields(sweeps, protocols, tmp_path):
    from stapoctl.eval.protocol import digest

    with pytest.raises(UserError) as err:
        _compare(sweeps, "decodings", tmp_path)
    msg = str(err.value)
    p, other = digest(protocols[1]), digest(protocols[2])
    assert "\n" not in msg
    assert msg.startswith("compare: these runs were evaluated under 2 different protocols: fields that differ: "
                          "decodings.train.temperature, decodings.train.top_p "
                          f"({p[:12]}: grpo ×3; {other[:12]}: wapo ×3)")
    assert "--mixed-protocols" in msg
    assert not (tmp_path / "decodings").exists()  # refused before anything is written


def test_mixed_protocols_on_request_and_the_table_says_so(sweeps, tmp_path):
    text, table = _compare(sweeps, "decodings", tmp_path, mixed_protocols=True)
    assert "MIXED evaluation protocols (--mixed-protocols): 2 protocols, fields that differ: " \
           "decodings.train.temperature, decodings.train.top_p" in text
    assert table["protocol"]["mixed"] is True
    assert table["protocol"]["fields"] == ["decodings.train.temperature", "decodings.train.top_p"]
    assert (tmp_path / "decodings" / "table.md").read_text().startswith("**MIXED evaluation protocols")
    # the statistics are still computed: wapo − grpo = 0.10
    (wapo,) = [r for r in table["rows"] if r["table"] == "statistics" and r["group"] == "wapo"]
    assert wapo["diff"] == pytest.approx(0.10)


def test_unknown_beside_tagged_is_refused_and_unknown_alone_is_shown(sweeps, protocols, tmp_path):
    from stapoctl.eval.protocol import digest

    with pytest.raises(UserError) as err:
        _compare(sweeps, "old", tmp_path)
    assert str(err.value).startswith(
        "compare: these runs were evaluated under 2 different protocols: 3 run(s) recorded before protocols were "
        f"(unknown) (unknown: grpo ×3; {digest(protocols[1])[:12]}: wapo ×3)")
    text, table = _compare(sweeps, "untagged", tmp_path)
    assert "evaluation protocol unknown (6 runs)" in text
    assert list(table["protocol"]["runs"]) == ["unknown"]
