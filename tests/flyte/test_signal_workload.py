"""A workload in a few lines, end to end: ``examples/signal_cnn`` (a 1D-CNN on a float32 ``.npz``, an
:class:`~training_core.workloads.simple.ArrayClassification` with ``build_model`` only) through one ``pyflyte run``
of the tuning pipeline with ``examples/signal_cnn_tuning.yaml`` on the session's Ray cluster: prep writes the shards,
the trials are the search's draws of the CNN's own ``workload.params.kernel_size`` and ``optimizer.lr``, each scored
by its validation macro-F1; the trial of the highest is evaluated on the test split (accuracy and macro-F1) and
registered, and the champion loads where the user package is not installed. The training pipeline runs the same
train, evaluate and register tasks (``examples/signal_cnn.yaml`` is checked as far as preflight in
tests/unit/test_simple_workloads.py)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import yaml

from examples.signal_cnn.make_data import signals
from tests.conftest import REPO_ROOT
from tests.helpers.mlflow_db import seed_mlflow_db
from tests.helpers.pyflyte import pyflyte_run_entity, squashed

EXAMPLE_DIR = REPO_ROOT / "examples" / "signal_cnn"
MODEL_NAME = "signal-cnn"
MAX_GLUE_LINES = 25


def test_the_signal_workload_is_at_most_25_lines_of_code_besides_its_docstring():
    source = (EXAMPLE_DIR / "workload.py").read_text()
    docstring = ast.get_docstring(ast.parse(source), clean=False)
    code = source.replace(f'"""{docstring}"""', "", 1)
    lines = [line for line in code.splitlines() if line.strip()]
    assert len(lines) <= MAX_GLUE_LINES, "\n".join(lines)


LOAD_CHAMPION = """
import importlib.util, json, sys
import mlflow, numpy as np, torch
assert importlib.util.find_spec("examples") is None, "the user package is importable here"
mlflow.set_tracking_uri(sys.argv[1])
model = mlflow.pytorch.load_model("models:/{name}@champion")
data = np.load(sys.argv[2])
with torch.no_grad():
    logits = model(torch.from_numpy(data["inputs"]))
print(json.dumps({{"shape": list(logits.shape), "predicted": logits.argmax(dim=1).tolist()}}))
"""


@pytest.mark.slow
def test_a_1d_cnn_is_tuned_on_its_kernel_size_and_lr_by_val_f1_then_evaluated_and_registered_through_pyflyte_run(
    ray_address, tmp_path
):
    from mlflow.tracking import MlflowClient

    from training_core.tuning import initial_params, load_tuning_config

    for name in ("home", "tmp"):
        (tmp_path / name).mkdir()
    np.savez(tmp_path / "signals.npz", **signals(600, seed=0))
    raw = yaml.safe_load((REPO_ROOT / "examples" / "signal_cnn_tuning.yaml").read_text())
    raw["num_trials"] = 2  # cheap: a trial's cost is mostly its Ray Train start, so 2 trials of 4 short epochs
    raw["base"]["loop"]["epochs"] = 4
    raw["base"]["schedule"]["warmup_steps"] = 0
    raw["base"]["data"]["path"] = str(tmp_path / "signals.npz")
    raw["base"]["tracking"]["tracking_uri"] = seed_mlflow_db(tmp_path / "mlflow.db")
    (tmp_path / "tuning.yaml").write_text(yaml.safe_dump(raw))
    tuning = load_tuning_config(str(tmp_path / "tuning.yaml"), environ={})
    assert tuning.metric == "val_f1" and tuning.metric_mode == "max"  # the workload's direction for macro-F1
    searched = initial_params(tuning)
    env = dict(
        os.environ,
        HOME=str(tmp_path / "home"),
        TMPDIR=str(tmp_path / "tmp"),
        PYTHONUNBUFFERED="1",
        RAY_ADDRESS=ray_address,
        PYTHONPATH=str(REPO_ROOT),
        COLUMNS="400",
    )
    tuning_workflow = str(REPO_ROOT / "workflows" / "tuning.py")
    result = pyflyte_run_entity(
        tuning_workflow, "tuning_pipeline", "--config", str(tmp_path / "tuning.yaml"), cwd=tmp_path, env=env
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    table = pd.read_csv(re.search(r"table=(/[^,)]+?trials\.csv)", squashed(output)).group(1))

    # The trials are the search's draws, of other kernel sizes and learning rates, each trained as drawn.
    kernel, lr = "workload.params.kernel_size", "optimizer.lr"
    assert table[kernel].tolist() == [int(p[kernel]) for p in searched]
    assert table[lr].tolist() == pytest.approx([float(p[lr]) for p in searched])
    assert len(set(table[kernel])) == len(set(table[lr])) == len(table) == 2
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = [client.get_run(run_id) for run_id in table["mlflow_run_id"]]
    assert [int(run.data.params[kernel]) for run in runs] == table[kernel].tolist()
    assert [float(run.data.params[lr]) for run in runs] == pytest.approx(table[lr].tolist())
    # Each trial is scored by its own validation macro-F1, and the highest one wins.
    assert [run.data.metrics["val_f1"] for run in runs] == pytest.approx(table["final_val_f1"].tolist())
    assert len(set(table["final_val_f1"])) == 2, "the trials tied: nothing was ranked"
    best = table.loc[table["final_val_f1"].idxmax()]
    (parent_id,) = {run.data.tags["mlflow.parentRunId"] for run in runs}
    parent = client.get_run(parent_id)
    assert parent.data.metrics["best_val_f1"] == pytest.approx(best["final_val_f1"])
    assert int(parent.data.metrics["best_trial"]) == int(best["trial"])

    # The best trial is evaluated on the test split and registered as the champion.
    test_metrics = dict(re.findall(r"(\w+) ([0-9.]+)", re.search(r"test metrics\s*: (.+)", output).group(1)))
    assert float(test_metrics["accuracy"]) >= 0.8 and float(test_metrics["f1"]) >= 0.8, test_metrics
    assert re.search(rf"registered model : {MODEL_NAME} version 1 \(alias 'champion' -> v1\)", output)
    fresh = signals(90, seed=1)  # samples it never saw, in the order make_data gives them
    np.savez(tmp_path / "fresh.npz", **fresh)
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_CHAMPION.format(name=MODEL_NAME),
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            str(tmp_path / "fresh.npz"),
        ],
        cwd=tmp_path,
        env={**{k: v for k, v in env.items() if k != "PYTHONPATH"}},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert loaded.returncode == 0, loaded.stdout[-3000:] + loaded.stderr[-3000:]
    found = json.loads(loaded.stdout.strip().splitlines()[-1])
    classes = sorted(set(fresh["targets"].tolist()))  # the manifest's classes: the labels in sorted order
    truth = [classes.index(label) for label in fresh["targets"].tolist()]
    assert found["shape"] == [90, 3]
    assert np.mean(np.asarray(found["predicted"]) == np.asarray(truth)) >= 0.8
