"""No process of a Ray Train run outlives ``fit``: a controller that cannot exit (as one caught in Ray 2.60's exit
deadlock) is killed and named. That a healthy run's processes exit by themselves once the driver lets go of them is
checked on the 2-worker fit of tests/distributed/test_ddp.py."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from tests.conftest import kills_not_in_rays_exit, new_run_processes, session_ray_processes
from tests.helpers import exit_blocker
from training_core.config import TrainingConfig
from training_core.data import prepare
from training_core.runners.ray_processes import start_ticks
from training_core.runners.ray_train import fit


def _config() -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "data": {"dataset": "synthetic", "synthetic_num_samples": 64, "synthetic_image_size": 8, "num_shards": 1},
            "model": {"name": "small_cnn"},
            "loop": {"epochs": 1, "batch_size": 16, "max_steps": 2},
            "scaling": {"num_workers": 1, "torch_threads_per_worker": 1},
            "observability": {"enabled": False},
        }
    )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("synthetic")
    prepare(_config().data, str(out))
    return str(out)


def test_a_controller_that_cannot_exit_is_killed_and_named_when_fit_returns(
    ray_session, session_root, data_dir, tmp_path, monkeypatch, caplog
):
    record_dir = tmp_path / "blocked"
    monkeypatch.setenv("RAY_TRAIN_CALLBACKS", "tests.helpers.exit_blocker.BlockedExit")
    monkeypatch.setenv(exit_blocker.RECORD_DIR_ENV, str(record_dir))
    before = session_ray_processes(session_root)
    try:
        with caplog.at_level(logging.WARNING, logger="training_core.runners.ray_processes"):
            result = fit(_config(), data_dir=data_dir, checkpoint_dir=str(tmp_path / "final"), run_name="blocked",
                         storage_path=str(tmp_path / "runs"))  # fmt: skip
        assert result.meta.global_step == 2
        [pid] = exit_blocker.blocked_pids(record_dir)
        assert start_ticks(pid) is None  # gone (a zombie until the raylet collects it)
        assert f"Ray process {pid} (ray::TrainController) of the finished run did not exit" in caplog.text
        # The blocked controller never began its core worker's exit; any other kill is of a process that had (Ray's
        # exit deadlock): none was held alive.
        assert kills_not_in_rays_exit(caplog.text, session_root) == [f"{pid} (ray::TrainController)"]
        assert new_run_processes(session_root, before) == {}
    finally:
        for pid in exit_blocker.blocked_pids(record_dir):  # the code before the change left it running
            if start_ticks(pid) is not None:
                os.kill(pid, signal.SIGKILL)
