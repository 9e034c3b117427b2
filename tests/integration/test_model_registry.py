"""The promotion gate against a real MLflow tracking server on 127.0.0.1 (sqlite backend, proxied artifacts)."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request

import pytest

from tests.conftest import VENV_BIN
from tests.helpers.mlflow_db import seed_mlflow_db
from training_core.config import TrackingConfig
from training_core.runners.launch import free_port
from training_core.tracking import register_and_promote

MODEL = "gate-test-model"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    process = subprocess.Popen(
        [
            str(VENV_BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            seed_mlflow_db(root / "mlflow.db"),
            "--artifacts-destination",
            str(root / "artifacts"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(root / "server.log", "w"),
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"mlflow server did not become healthy:\n{(root / 'server.log').read_text()[-3000:]}")
        time.sleep(0.5)
    yield uri
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()


def _logged_model(uri: str) -> tuple[str, str]:
    """A real (tiny) model logged with its signature in a fresh run; returns (model_uri, run_id)."""
    import mlflow
    import numpy as np
    import torch
    from mlflow.models import infer_signature

    from training_core.models import build_model

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("gate")
    model = build_model("small_cnn", num_classes=10, input_shape=(1, 8, 8)).eval()
    example = np.zeros((2, 1, 8, 8), dtype=np.float32)
    with torch.no_grad():
        output = model(torch.from_numpy(example)).numpy()
    with mlflow.start_run() as run:
        info = mlflow.pytorch.log_model(
            model,
            name="model",
            signature=infer_signature(example, output),
            input_example=example,
            pip_requirements=["torch"],
        )
    return info.model_uri, run.info.run_id


def _promote(cfg: TrackingConfig, accuracy: float):
    model_uri, run_id = _logged_model(cfg.tracking_uri)
    return register_and_promote(
        cfg, model_uri=model_uri, run_id=run_id, metric="test_accuracy", value=accuracy, mode="max"
    )


def test_champion_moves_only_for_a_version_that_clears_the_gate_and_beats_it(mlflow_server):
    import dataclasses

    import mlflow
    import torch
    from mlflow.tracking import MlflowClient

    cfg = TrackingConfig(tracking_uri=mlflow_server, registered_model_name=MODEL, promotion_threshold=0.8)
    client = MlflowClient(tracking_uri=mlflow_server)

    def champion() -> int:
        return int(client.get_model_version_by_alias(MODEL, "champion").version)

    first = _promote(cfg, 0.90)
    assert (first.version, first.promoted, first.previous_champion_version) == (1, True, 0)
    assert first.previous_champion_value is None
    assert "there was no champion yet" in first.reason

    worse = _promote(cfg, 0.85)
    assert (worse.version, worse.promoted) == (2, False)
    assert "does not beat 'champion' version 1 (0.9000)" in worse.reason
    assert champion() == 1

    tie = _promote(cfg, 0.90)
    assert not tie.promoted and champion() == 1

    below_gate = _promote(dataclasses.replace(cfg, promotion_threshold=0.99), 0.95)
    assert not below_gate.promoted and "is not at least tracking.promotion_threshold=0.99" in below_gate.reason
    assert champion() == 1

    better = _promote(cfg, 0.93)
    assert better.promoted and (better.previous_champion_version, better.previous_champion_value) == (1, 0.90)
    assert champion() == better.version == 5
    assert client.get_model_version(MODEL, "5").tags["test_accuracy"] == "0.93"

    mlflow.set_tracking_uri(mlflow_server)
    loaded = mlflow.pytorch.load_model(f"models:/{MODEL}@champion")
    assert loaded(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
