"""Launch plans run locally with ``pyflyte run workflows/launch_plans.py <launch plan>``."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, VENV_BIN
from tests.helpers.mlflow_db import seed_mlflow_db
from tests.helpers.pyflyte import pyflyte_run_entity, squashed

LAUNCH_PLANS = str(REPO_ROOT / "workflows" / "launch_plans.py")
# One worker, three steps of the smallest model: the whole pipeline in well under a minute.
TINY_CONFIG = {
    "model": {"name": "small_cnn"},
    "loop": {"epochs": 1, "max_steps": 3},
    "scaling": {"num_workers": 1},
    "tracking": {"promotion_threshold": 0.0},
}


def pyflyte_run_launch_plan(
    name: str, *args: str, cwd: Path, env: dict[str, str], timeout_s: int = 600
) -> subprocess.CompletedProcess:
    return pyflyte_run_entity(LAUNCH_PLANS, name, *args, cwd=cwd, env=env, timeout_s=timeout_s)


def test_nightly_training_runs_locally_through_pyflyte_with_a_tiny_config(ray_address, tmp_path, subprocess_env):
    subprocess_env["RAY_ADDRESS"] = ray_address
    seed_mlflow_db(tmp_path / "mlflow.db")  # the launch plan's relative tracking URI, in the run's directory
    result = pyflyte_run_launch_plan(
        "nightly_training", "--config", json.dumps(TINY_CONFIG), cwd=tmp_path, env=subprocess_env
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "Running Execution on local." in output
    assert re.search(r"registered model : digits-classifier version 1 \(alias 'champion' -> v1\)", output)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("training-pipeline").experiment_id])
    assert run.data.params["model.name"] == "small_cnn" and run.data.params["loop.max_steps"] == "3"


def test_nightly_training_does_not_accept_its_fixed_resume_from_input(tmp_path, subprocess_env):
    subprocess_env["COLUMNS"] = "400"
    result = pyflyte_run_launch_plan(
        "nightly_training", "--resume_from", str(tmp_path), cwd=tmp_path, env=subprocess_env, timeout_s=120
    )
    assert result.returncode != 0
    assert squashed("No such option '--resume_from'") in squashed(result.stdout + result.stderr)


def test_alert_recipients_come_from_the_environment_with_a_documented_default():
    from workflows.launch_plans import ALERT_EMAILS_ENV, DEFAULT_ALERT_EMAILS, alert_recipients

    assert alert_recipients({}) == list(DEFAULT_ALERT_EMAILS)
    assert alert_recipients({ALERT_EMAILS_ENV: " a@corp.com, b@corp.com ,"}) == ["a@corp.com", "b@corp.com"]
    for bad in ("", " , ", "oncall", "a@corp.com, b corp.com"):
        with pytest.raises(
            ValueError, match=rf"{ALERT_EMAILS_ENV}=.* is invalid: set it to comma-separated email addresses"
        ):
            alert_recipients({ALERT_EMAILS_ENV: bad})


def test_every_launch_plan_is_addressed_by_its_variable_name(tmp_path, subprocess_env):
    # weekly_tuning and scaling_benchmark also run end to end this way (a one-trial search, one worker count),
    # but take minutes each; their workflows' owners test them, and test_packaging checks their launch plans.
    subprocess_env["COLUMNS"] = "400"
    result = subprocess.run(
        [str(VENV_BIN / "pyflyte"), "run", LAUNCH_PLANS, "--help"],
        cwd=tmp_path,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    listed = squashed(result.stdout)
    for name in ("nightly_training", "weekly_tuning", "scaling_benchmark"):
        assert squashed(f"{name} launch plan (workflows.launch_plans.{name}) (LP Name: {name})") in listed, name
