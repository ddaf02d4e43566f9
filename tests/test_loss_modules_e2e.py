"""`loss.modules` on the suite's shared engines (#50 item 3): a method in a package of the researcher's
own — written under tmp_path, on the driver's path (PYTHONPATH) but never on the learner actors' (the
local Ray started before it existed) — trains two steps on the embedded default's engines; then the
method is edited and two more steps train on the same engines: the ranks reloaded it at the reset.

What docs/LOSSES.md "Adding a method in your own module" walks through: `write_package` writes the
function, its typed config and the registry line (tests/test_loss_modules.py `method_source`).
"""

from __future__ import annotations

import sys

import pytest
from test_loss_modules import method_source, restored, write_package

pytestmark = pytest.mark.e2e

STEPS = 2
OVERRIDES = [f"trainer.total_steps={STEPS}", "eval.every_n_steps=0", "trainer.val_before_train=false",
             "trainer.save_freq=0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, training_store, engine_pool):
    """Two runs of `loss=my_clip` on the pool: the method as written, then as edited (its metric 1.0 → 22.0)."""
    from stapoctl.trainer.driver import train

    src = tmp_path_factory.mktemp("own_module")
    out = {}
    with restored(), training_store("loss_modules_store", OVERRIDES) as t:
        module = write_package(src, version="1.0")
        sys.path.insert(0, str(src))  # the driver's PYTHONPATH
        extra = ["loss=my_clip", f"loss.modules=[{module}]"]
        for label, version in (("first", None), ("edited", "22.0")):
            if version is not None:  # the researcher edits the method between two runs
                (src / module.split(".")[0] / "losses.py").write_text(method_source("my_clip", version))
            warm = engine_pool.engines is not None
            summary = train(t.conf(extra), console=t.console, session=engine_pool)
            out[label] = {"run_id": summary["run_id"], "warm": warm, "info": dict(engine_pool.engines.info)}
        out.update(uri=t.uri, module=module)
    return out


def test_a_method_of_ones_own_module_trains_and_a_reset_reloads_it(runs):
    from mlflow import MlflowClient

    client = MlflowClient(runs["uri"])
    for label, version in (("first", 1.0), ("edited", 22.0)):
        run = client.get_run(runs[label]["run_id"])
        assert run.info.status == "FINISHED", (label, run.info.status)
        assert run.data.params["loss.name"] == "my_clip"
        assert runs["module"] in run.data.params["loss.modules"]  # recorded like every value
        history = client.get_metric_history(run.info.run_id, "my_clip/version")
        assert [m.step for m in history] == list(range(1, STEPS + 1)), label
        assert {m.value for m in history} == {version}, (label, [m.value for m in history])
        assert run.data.metrics["actor/grad_norm"] == run.data.metrics["actor/grad_norm"]  # trained (not NaN)
    # no engine start for the edit: the learner reset reloaded the module on the same ranks
    assert runs["edited"]["warm"] and runs["edited"]["info"]["reused"], runs["edited"]["info"].get("reason")
    if runs["first"]["warm"]:  # in the suite it follows a module on the embedded default's engines
        assert runs["first"]["info"]["reused"], f"started engines: {runs['first']['info'].get('reason')}"
