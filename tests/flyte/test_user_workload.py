"""A user package that no built-in knows about, through ``pyflyte run`` of the training pipeline in a subprocess:
``examples/tabular_mlp.yaml`` prepares its CSV, trains on 2 Ray Train CPU workers (the session's Ray cluster),
evaluates and registers a champion that loads where the package is not installed; a package that breaks the
protocol, one that does not import, or one that exits the process at import, fails in the first task, before any Ray
worker starts, naming the fix."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT
from tests.helpers.mlflow_db import seed_mlflow_db
from tests.helpers.pyflyte import flat, pyflyte_run, squashed

EXAMPLE_CONFIG = REPO_ROOT / "examples" / "tabular_mlp.yaml"
BROKEN_CONFIG = REPO_ROOT / "examples" / "broken_workload.yaml"
EXAMPLE = "examples.tabular_mlp.workload:TabularMLP"
MODEL_NAME = "breast-cancer-mlp"
CSV = REPO_ROOT / "examples" / "tabular_mlp" / "breast_cancer.csv"
SIGNS_OF_RAY = ("RayTrainWorker", "TrainController", "Started a local Ray instance", "Connecting to existing Ray")


def _example_config(workdir: Path) -> Path:
    """A copy of the example's config whose MLflow store is a sqlite file in ``workdir``."""
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    raw["tracking"]["tracking_uri"] = f"sqlite:///{workdir / 'mlflow.db'}"
    path = workdir / "tabular_mlp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def example_run(ray_address, tmp_path_factory):
    """``pyflyte run ... --config examples/tabular_mlp.yaml`` (with the tracking URI in the work directory), as the
    config's comment says: ``PYTHONPATH`` names the repository, where the ``examples`` package is."""
    workdir = tmp_path_factory.mktemp("user-workload")
    for name in ("home", "tmp"):
        (workdir / name).mkdir()
    seed_mlflow_db(workdir / "mlflow.db")
    env = dict(
        os.environ,
        HOME=str(workdir / "home"),
        TMPDIR=str(workdir / "tmp"),  # flytekit's sandbox, with the run's checkpoints (Ray keeps RAY_TMPDIR)
        PYTHONUNBUFFERED="1",
        RAY_ADDRESS=ray_address,
        PYTHONPATH=str(REPO_ROOT),
    )
    started = time.monotonic()
    result = pyflyte_run("--config", str(_example_config(workdir)), cwd=workdir, env=env, timeout_s=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return workdir, output, time.monotonic() - started


@pytest.mark.slow
def test_the_example_trains_on_two_ray_workers_evaluates_and_registers_a_champion(example_run):
    from mlflow.tracking import MlflowClient

    workdir, output, _ = example_run
    assert "Started training worker group of size 2" in output
    test_metrics = dict(re.findall(r"(\w+) ([0-9.]+)", re.search(r"test metrics\s*: (.+)", output).group(1)))
    assert float(test_metrics["accuracy"]) >= 0.9 and float(test_metrics["loss"]) < 0.3
    assert re.search(rf"registered model : {MODEL_NAME} version 1 \(alias 'champion' -> v1\)", output)
    assert "promotion        : test_accuracy " in output and "is at least 0.9 and there was no champion yet" in output

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tabular-mlp").experiment_id])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["workload.name"] == EXAMPLE and params["model.name"] == "mlp" and params["world_size"] == "2"
    assert run.data.metrics["test_accuracy"] == pytest.approx(float(test_metrics["accuracy"]), abs=5e-5)
    assert run.data.metrics["val_accuracy"] >= 0.9
    losses = client.get_metric_history(run.info.run_id, "train_loss")
    assert losses[-1].value < losses[0].value
    champion = client.get_model_version_by_alias(MODEL_NAME, "champion")
    assert int(champion.version) == 1 and champion.run_id == run.info.run_id
    assert float(champion.tags["test_accuracy"]) == pytest.approx(run.data.metrics["test_accuracy"])

    # The evaluation report shows the example's classes from its CSV.
    report = Path(re.search(r"^evaluation report\s*: (\S+)", output, re.MULTILINE).group(1)).read_text()
    assert "id='confusion'" in report and "malignant" in report and "benign" in report


LOAD_CHAMPION = """
import importlib.util, json, sys
import mlflow, numpy as np, pandas as pd, torch
assert importlib.util.find_spec("examples") is None, "the user package is importable here"
mlflow.set_tracking_uri(sys.argv[1])
model = mlflow.pytorch.load_model("models:/{name}@champion")
table = pd.read_csv(sys.argv[2])
with torch.no_grad():
    logits = model(torch.from_numpy(table.iloc[:, :-1].to_numpy(np.float32)))
truth = (table["diagnosis"] == "malignant").to_numpy()
print(json.dumps({{"rows": len(table), "shape": list(logits.shape),
                  "accuracy": float((logits.argmax(dim=1).numpy() == truth).mean())}}))
"""


@pytest.mark.slow
def test_the_champion_loads_with_mlflow_where_the_user_package_is_not_installed_and_predicts_raw_rows(example_run):
    workdir, _, _ = example_run
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HOME"] = str(workdir / "home")
    result = subprocess.run(
        [sys.executable, "-c", LOAD_CHAMPION.format(name=MODEL_NAME), f"sqlite:///{workdir / 'mlflow.db'}", str(CSV)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    # Raw rows of the table in, two logits out: the model standardises its input with the training statistics.
    assert found["rows"] == 569 and found["shape"] == [569, 2]
    assert found["accuracy"] > 0.95


@pytest.mark.slow
def test_the_example_trains_in_well_under_a_minute_of_training(example_run):
    from training_core import checkpoint as ckpt

    workdir, _, duration_s = example_run
    (final,) = [p for p in workdir.rglob("final_checkpoint") if (p / ckpt.MANIFEST_FILE).exists()]
    meta = ckpt.load_meta(str(final))
    assert [r.epoch for r in meta.history] == list(range(1, 11))
    assert meta.elapsed_s < 30, meta.elapsed_s
    assert duration_s < 240, duration_s


@pytest.mark.parametrize(
    ("pythonpath", "config", "expected"),
    [
        (
            True,
            BROKEN_CONFIG,
            "workload.name='examples.broken_workload.workload:Broken' is invalid: it returned a "
            "Broken, which is not a workload: it lacks eval_sums(), metrics(); implement the "
            "training_core.workloads.Workload protocol",
        ),
        (
            False,
            EXAMPLE_CONFIG,
            f"workload.name='{EXAMPLE}' is invalid: module 'examples.tabular_mlp.workload' does not import "
            "(ModuleNotFoundError: No module named 'examples'); make the package importable where the task runs "
            "(installed in the image, in the fast-registration tarball, or on PYTHONPATH;",
        ),
        (
            True,
            None,  # a package in the work directory whose module calls sys.exit(0) at import (pyflyte would exit 0)
            "workload.name='exits_at_import.workload:Workload' is invalid: module 'exits_at_import.workload' raised "
            "SystemExit(0): it exits the process (sys.exit(), or an argparse parser's error) at import; exit the "
            "process and parse the command line (argparse) only under `if __name__ == '__main__':`",
        ),
    ],
    ids=["breaks-the-protocol", "not-importable", "exits-at-import"],
)
def test_user_code_that_cannot_train_fails_in_seconds_before_any_ray_worker_starts(
    tmp_path, subprocess_env, pythonpath, config, expected
):
    subprocess_env.pop("RAY_ADDRESS", None)
    subprocess_env.pop("PYTHONPATH", None)
    if config is None:
        (tmp_path / "exits_at_import").mkdir()
        (tmp_path / "exits_at_import" / "__init__.py").write_text("")
        (tmp_path / "exits_at_import" / "workload.py").write_text("import sys\n\nsys.exit(0)\n")
        config = tmp_path / "exits.yaml"
        config.write_text("workload:\n  name: exits_at_import.workload:Workload\nscaling:\n  num_workers: 2\n")
    if pythonpath:
        subprocess_env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(tmp_path)])
    subprocess_env["COLUMNS"] = "400"
    started = time.monotonic()
    result = pyflyte_run("--config", str(config), cwd=tmp_path, env=subprocess_env, timeout_s=300)
    elapsed_s = time.monotonic() - started
    output = flat(result.stdout + result.stderr)
    assert result.returncode != 0
    assert "Error encountered while executing 'tasks.data.prepare_data'" in output
    assert squashed(expected) in squashed(output)
    for sign_of_ray in SIGNS_OF_RAY:
        assert sign_of_ray not in output
    assert elapsed_s < 90, elapsed_s
