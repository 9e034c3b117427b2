"""A workload in a few lines, end to end: ``examples/signal_cnn`` (a 1D-CNN on a float32 ``.npz``, an
:class:`~training_core.workloads.simple.ArrayClassification` with ``build_model`` only) through one ``pyflyte run``
of the training pipeline on the session's Ray cluster: prep writes the shards, the model trains, is evaluated on
the test split (accuracy and macro-F1) and registered; the champion loads where the user package is not
installed."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

from examples.signal_cnn.make_data import signals
from tests.conftest import REPO_ROOT
from tests.helpers.pyflyte import pyflyte_run

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
def test_a_1d_cnn_on_a_float32_npz_trains_evaluates_and_registers_through_pyflyte_run(ray_address, tmp_path):
    from mlflow.tracking import MlflowClient

    for name in ("home", "tmp"):
        (tmp_path / name).mkdir()
    np.savez(tmp_path / "signals.npz", **signals(600, seed=0))
    raw = yaml.safe_load((REPO_ROOT / "examples" / "signal_cnn.yaml").read_text())
    raw["data"]["path"] = str(tmp_path / "signals.npz")
    raw["tracking"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "signal_cnn.yaml").write_text(yaml.safe_dump(raw))
    env = dict(
        os.environ,
        HOME=str(tmp_path / "home"),
        TMPDIR=str(tmp_path / "tmp"),
        PYTHONUNBUFFERED="1",
        RAY_ADDRESS=ray_address,
        PYTHONPATH=str(REPO_ROOT),
    )
    result = pyflyte_run("--config", str(tmp_path / "signal_cnn.yaml"), cwd=tmp_path, env=env, timeout_s=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    test_metrics = dict(re.findall(r"(\w+) ([0-9.]+)", re.search(r"test metrics\s*: (.+)", output).group(1)))
    assert float(test_metrics["accuracy"]) >= 0.8 and float(test_metrics["f1"]) >= 0.8, test_metrics
    assert re.search(rf"registered model : {MODEL_NAME} version 1 \(alias 'champion' -> v1\)", output)

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("signal-cnn").experiment_id])
    assert run.data.params["workload.params.kernel_size"] == "5"
    assert run.data.metrics["val_f1"] >= 0.8

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
