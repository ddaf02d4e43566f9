"""The unit checks tests/config_matrix.py's table names for leaves a matrix run here cannot show: the embedded
model's build, SLURM and Ray jobs (their dry runs), the memory plan of a GPU, a hub dataset's local file, a
verifier model, alarms that need a trend over many steps, and the engines there are no others of. No engine.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest


def test_the_tiny_build_reads_its_fields(tmp_path, monkeypatch):
    from stapoctl.config.compose import compose_config
    from stapoctl.models.tiny import build_base_model

    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path))
    shape = {"hidden_size": 64, "intermediate_size": 96, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
             "vocab_size": 640, "max_position_embeddings": 256}
    base = [f"model.tiny.{k}={v}" for k, v in shape.items()] + ["model.tiny.warm_start_steps=2",
                                                                 "model.tiny.warm_start_batch_size=4", "data.toy.num_heldout=4"]

    def build(*extra):
        conf = compose_config(base + list(extra))
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        out.mkdir()
        return build_base_model(out, conf.model, conf.data), out

    report, out = build()
    cfg = json.loads((out / "config.json").read_text())
    names = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads"}
    assert {k: cfg[names.get(k, k)] for k in shape} == shape
    assert report["warm_start_steps"] == 2
    for extra in ("model.tiny.warm_start_lr=0.01", "model.tiny.warm_start_batch_size=3"):
        assert build(extra)[0]["weights_sha256"] != report["weights_sha256"], extra


def test_slurm_and_ray_dry_runs_carry_the_cluster_values(tmp_path, monkeypatch):
    from rich.console import Console

    from stapoctl.config.compose import compose_config
    from stapoctl.jobs import slurm
    from stapoctl.jobs.submit import submit_run

    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path))

    def dry(*args):
        console = Console(record=True, width=400)
        assert submit_run(compose_config(list(args)), list(args), dry_run=True, follow=False, console=console) == 0
        return console.export_text()

    logs = tmp_path / "slurm-logs"
    args = ["cluster=slurm", "cluster.partition=pp", "cluster.account=acc", "cluster.qos=qq", "cluster.constraint=cc",
            "cluster.nodes=2", "cluster.gpus_per_node=4", "cluster.cpus_per_task=7", "cluster.mem_gb=33",
            "cluster.timeout_min=77", "cluster.setup=[echo matrix-setup]", "cluster.ray_port=6390", f"cluster.log_dir={logs}",
            "cluster.python=/usr/bin/python3", "cluster.max_requeues=5", "cluster.array_parallelism=3"]
    script = dry(*args)
    flags = dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script, flags=re.M))
    assert {k: flags[k] for k in ("partition", "account", "qos", "constraint", "nodes", "gpus-per-node", "cpus-per-task",
                                  "mem", "time")} == {"partition": "pp", "account": "acc", "qos": "qq", "constraint": "cc",
                                                      "nodes": "2", "gpus-per-node": "4", "cpus-per-task": "7",
                                                      "mem": "33GB", "time": "77"}
    assert flags["output"].startswith(str(logs)) and "\necho matrix-setup\n" in script
    assert "--port=6390" in script and "/usr/bin/python3 -m ray.scripts.scripts start --head" in script
    conf = compose_config(args)
    p = slurm.plan(conf, [], tmp_path / "f", "sqlite:///x.db", "job", array_size=4)
    made = {}  # submitit's executor wants srun: the arguments it would get
    monkeypatch.setattr(slurm.submitit, "SlurmExecutor", lambda **kw: SimpleNamespace(
        update_parameters=made.update, **kw))
    assert slurm._executor(conf, p).max_num_timeout == 5 and made["array_parallelism"] == 3
    out = dry("cluster=ray", "cluster.address=http://10.0.0.7:8265", "cluster.ship_code=path", "cluster.python=python3")
    spec = json.loads(out[out.index("{"):])
    assert spec["metadata"]["stapoctl.ship_code"] == "path"  # a remote address would upload the checkout
    assert spec["entrypoint"].startswith("python3 -m stapoctl.cli train ")


def test_the_plan_reads_the_gpu_memory():
    from stapoctl.config.compose import compose_config
    from stapoctl.preflight.memory_plan import build_plan

    # here=False: planned for the cluster from elsewhere (where the run executes, a visible card wins)
    fits = build_plan(compose_config(["experiment=stapo_qwen3_8b"]), here=False)
    small = build_plan(compose_config(["experiment=stapo_qwen3_8b", "cluster.gpu_mem_gb=24"]), here=False)
    per_gpu = [[p for p in plan.problems if "per GPU" in p] for plan in (fits, small)]
    assert (fits.device_gib, small.device_gib) == (80.0, 24.0) and not per_gpu[0] and per_gpu[1], per_gpu


def test_data_source_and_root_are_where_rows_come_from(tmp_path):
    from stapoctl.config.compose import compose_config
    from stapoctl.data.registry import load_rows

    rows = [{"id": f"r{i}", "problem": f"What is {i}+{i}?", "answer": str(2 * i)} for i in (1, 2)]
    (tmp_path / "root").mkdir()
    for path in (tmp_path / "mine.jsonl", tmp_path / "root" / "dapo_math_17k.jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in (rows if "mine" in path.name else rows[:1])))
    plain = ["data.name=dapo-math-17k", "data.template=plain"]
    by_source = load_rows("dapo-math-17k", compose_config(plain + [f"data.source={tmp_path / 'mine.jsonl'}"]).data)
    by_root = load_rows("dapo-math-17k", compose_config(plain + [f"data.root={tmp_path / 'root'}"]).data)
    assert [r["answer"] for r in by_source] == ["2", "4"] and [r["answer"] for r in by_root] == ["2"]


def test_the_model_verifier_takes_every_field_of_its_config(monkeypatch):
    from stapoctl.config.compose import compose_config
    from stapoctl.rollout import model_verifier as mv

    seen: dict = {}
    monkeypatch.setattr("stapoctl.models.resolve.resolve_model", lambda spec, _: f"/models/{spec}")
    monkeypatch.setattr(mv.ModelVerifier, "__init__", lambda self, path, **kw: seen.update(path=path, **kw))
    fields = {"model_verifier_mode": "all", "model_verifier_prompt": "Q {question} G {gold_answer} R {llm_response}",
              "model_verifier_max_tokens": 3, "model_verifier_max_model_len": 1024, "model_verifier_dtype": "float32",
              "model_verifier_cpus": 0.5, "model_verifier_gpus": 0.25}
    conf = compose_config(["reward.model_verifier=judge"] + [f"reward.{k}='{v}'" for k, v in fields.items()])
    mv.ModelVerifier.from_config(conf.reward)
    kwarg = lambda k: {"cpus": "num_cpus", "gpus": "num_gpus"}.get(k[len("model_verifier_"):], k[len("model_verifier_"):])  # noqa: E731
    assert seen == {"path": "/models/judge", **{kwarg(k): v for k, v in fields.items()}}


FLAT = {"entropy": [0.5] * 13, "grad": [0.9, 1.1] * 6 + [1.5], "mismatch": [1e-3] * 5 + [5e-3] * 3}
ALARM_CASES = [  # field, value, the other limits, metric, stream: the value fires the alarm, the default does not
    ("entropy_drop", 0.3, {}, "actor/entropy", [0.5] * 3 + [0.3] * 10),
    ("entropy_window", 3, {}, "actor/entropy", [0.5] * 3 + [0.2] * 5),
    ("entropy_rise", 1.5, {}, "actor/entropy", [0.5] * 4 + [1.0] * 4),
    ("grad_z", 4.0, {"grad_ratio": 0.0}, "actor/grad_norm", FLAT["grad"]),
    ("grad_ratio", 1.2, {"grad_z": 1.0}, "actor/grad_norm", FLAT["grad"]),
    ("grad_window", 4, {}, "actor/grad_norm", [0.9, 1.1, 0.9, 1.1, 5.0]),
    ("reward_flat_steps", 3, {}, "reward/accuracy", [0.0] * 4),
    ("mismatch_kl", 0.004, {"mismatch_rise": 1.0}, "rollout_corr/kl_k3", FLAT["mismatch"]),
    ("mismatch_rise", 2.0, {"mismatch_kl": 0.001}, "rollout_corr/kl_k3", FLAT["mismatch"]),
    ("spurious_jump", 2.0, {}, "stapo/spurious_ratio", [0.01] * 10 + [0.03]),
    ("spurious_floor", 0.002, {}, "stapo/spurious_ratio", [0.0005] * 10 + [0.004]),
]


@pytest.mark.parametrize("field, value, others, metric, stream", ALARM_CASES, ids=[c[0] for c in ALARM_CASES])
def test_each_alarm_limit_moves_its_alarm(field, value, others, metric, stream):
    from stapoctl.config.alarms import AlarmLimits
    from stapoctl.trainer.alarms import HealthWatch

    def fired(**limits) -> set:
        watch = HealthWatch(AlarmLimits(**others, **limits))
        return {a.name for step, v in enumerate(stream, 1) for a in watch.feed(step, {metric: v})}

    alarm = {"actor/entropy": "entropy_blowup" if field == "entropy_rise" else "entropy_collapse",
             "actor/grad_norm": "grad_norm_spike", "reward/accuracy": "reward_flat",
             "rollout_corr/kl_k3": "rollout_mismatch", "stapo/spurious_ratio": "spurious_jump"}[metric]
    assert alarm not in fired() and alarm in fired(**{field: value}), (fired(), fired(**{field: value}))


@pytest.mark.parametrize("key, only", [("rollout.engine", "vllm"), ("learner.backend", "deepspeed")])
def test_an_engine_that_is_not_there_is_refused_in_one_line(key, only):
    from stapoctl.config.compose import compose_config
    from stapoctl.errors import UserError

    assert compose_config([f"{key}={only}"])
    with pytest.raises(UserError, match=rf"^{re.escape(key)}=sglang: {only} is the only"):
        compose_config([f"{key}=sglang"])
