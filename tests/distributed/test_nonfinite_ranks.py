"""A diverging run on 2 gloo workers through Ray Train: every rank stops at the same window with the message, the
newest checkpoint has finite weights, and the failure is classified as the user's: neither Ray Train (the workers
report the divergence instead of raising it, so no worker group is restarted) nor Flyte retries it."""

from __future__ import annotations

import re

import pytest
import torch

from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.data import prepare
from training_core.runners.ray_train import checkpoint_root, fit
from training_core.train.failures import TrainingDiverged, classify


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("synthetic")
    prepare(_config().data, str(out))
    return str(out)


def _config() -> TrainingConfig:
    # SGD at lr 20 without clipping: the loss grows by orders of magnitude each step and turns NaN within ~10.
    return TrainingConfig.from_dict(
        {
            "data": {"dataset": "synthetic", "synthetic_num_samples": 512, "synthetic_image_size": 8, "num_shards": 2},
            "model": {"name": "small_cnn"},
            "optimizer": {"name": "sgd", "lr": 20.0, "momentum": 0.9, "weight_decay": 0.0, "max_grad_norm": 0.0},
            "schedule": {"name": "constant", "warmup_steps": 0},
            "loop": {"epochs": 1, "batch_size": 16, "log_interval_steps": 2},
            "checkpoint": {"interval_steps": 2, "keep_last": 2},
            "scaling": {"num_workers": 2, "torch_threads_per_worker": 1},
            "observability": {"enabled": False},
        }
    )


def test_a_diverging_run_on_two_workers_keeps_its_finite_checkpoint_and_fails_as_a_user_error(
    ray_session, data_dir, tmp_path
):
    with pytest.raises(Exception) as raised:
        fit(_config(), data_dir=data_dir, checkpoint_dir=str(tmp_path / "final"), run_name="nan",
            storage_path=str(tmp_path / "runs"))  # fmt: skip

    error = raised.value
    # The driver raised it from the workers' report: had a worker raised, Ray Train would have restarted the group
    # (max_worker_restarts defaults to 2) and fit would raise its WorkerGroupError.
    assert type(error) is TrainingDiverged, repr(error)
    verdict = classify(error)
    assert verdict.kind == "user" and not verdict.retryable, verdict
    assert "training diverged: the loss or gradient norm is not finite at step" in str(error)
    assert "optimizer.lr (now 20" in str(error)
    step = int(re.search(r"not finite at step (\d+)", str(error))[1])

    storage = ckpt.CheckpointStorage(checkpoint_root(str(tmp_path / "runs"), "nan"))
    newest = ckpt.load_latest_valid(storage)
    assert newest is not None and 0 < newest.meta.global_step < step and newest.meta.resumed_from_steps == []
    assert step - newest.meta.global_step <= 2  # the last interval checkpoint before the divergence
    assert all(torch.isfinite(t).all() for t in newest.model.values() if t.is_floating_point())
