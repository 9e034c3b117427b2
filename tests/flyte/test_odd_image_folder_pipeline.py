"""``pyflyte run`` of the training pipeline over an image folder holding a PNG with a flipped IDAT CRC byte (libpng's
failure on it ended a loader process: "DataLoader worker exited unexpectedly", then three group restarts), an
animated WebP (refused by the loader's decoder mid-training) and an animated GIF (2 frames, which broke a batch)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.conftest import REPO_ROOT, VENV_BIN
from tests.helpers.image_data import odd_image_folder
from tests.helpers.mlflow_db import seed_mlflow_db
from training_core.data import Manifest


@pytest.mark.slow
def test_an_image_folder_with_a_corrupt_png_and_animations_trains_to_the_end_without_a_restart(
    ray_address, tmp_path, subprocess_env
):
    tree = odd_image_folder(tmp_path / "images")
    config = {
        "data": {"dataset": "image_folder", "path": str(tree), "image_size": 16, "num_shards": 2},
        "model": {"name": "small_cnn"},
        "loop": {"epochs": 1, "batch_size": 4},
        "scaling": {"num_workers": 1},
        "tracking": {"tracking_uri": seed_mlflow_db(tmp_path / "mlflow.db"), "promotion_threshold": 0.0},
    }
    result = subprocess.run(
        [
            str(VENV_BIN / "pyflyte"),
            "run",
            str(REPO_ROOT / "workflows" / "training.py"),
            "training_pipeline",
            "--config",
            json.dumps(config),
        ],
        cwd=tmp_path,
        env=dict(subprocess_env, RAY_ADDRESS=ray_address),
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "registered model : digits-classifier version 1" in output
    for sign_of_a_crash in ("libpng error", "exited unexpectedly", "WorkerGroupError", "re-run data prep"):
        assert sign_of_a_crash not in output, output[-5000:]
    assert output.count("Started training worker group of size 1") == 1, output[-5000:]  # never restarted
    (directory,) = set(re.findall(r"prepared data +: .* samples \(image_classification\) at (\S+);", output))
    manifest = Manifest.load(directory)
    assert sum(manifest.split_counts().values()) == 15 and manifest.bad_samples["count"] == 0
    assert manifest.spec["reencoded"]["count"] == 3, manifest.spec
