"""Goodput, stragglers and progress on 2 real gloo processes (the plain launcher: no Ray, seconds)."""

from __future__ import annotations

import time

from tests.helpers.slow_rank import SLOW_RANK_ENV
from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.runners.launch import launch
from training_core.telemetry.goodput import ExecutionGoodput

LOG_INTERVAL_STEPS, STRAGGLER_WINDOWS = 2, 3


def _config(**loop: int) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "model": {"name": "small_cnn"},
            "workload": {"model_factory": "tests.helpers.slow_rank:build"},
            "loop": {"epochs": 1, "batch_size": 16, "max_steps": 16, "log_interval_steps": LOG_INTERVAL_STEPS, **loop},
            "checkpoint": {"interval_steps": 8},
            "scaling": {"num_workers": 2, "torch_threads_per_worker": 1},
            "observability": {"straggler_threshold": 0.2, "straggler_windows": STRAGGLER_WINDOWS},
        }
    )


def _run(tmp_path, digits_dir, **loop: int) -> tuple[ckpt.CheckpointMeta, float]:
    started = time.time()
    result = launch(
        _config(**loop),
        data_dir=digits_dir,
        checkpoint_dir=str(tmp_path / "final"),
        run_name="stragglers",
        storage_path=str(tmp_path / "runs"),
    )
    return result.meta, time.time() - started


def test_a_rank_slowed_in_its_forward_is_flagged_as_compute_bound_within_the_configured_windows(
    digits_dir, tmp_path, monkeypatch, capfd
):
    monkeypatch.setenv(SLOW_RANK_ENV, "1")
    meta, wall_s = _run(tmp_path, digits_dir)

    ranks = {r["rank"]: r for r in meta.telemetry["ranks"]}
    num_windows = len(meta.step_log)
    assert num_windows >= 6, meta.step_log
    # Flagged from the window that completes the configured streak on (one window of slack for the first step's
    # start-up), never the healthy rank, and for its compute: it sleeps in its forward.
    assert ranks[1]["flagged_windows"] >= num_windows - STRAGGLER_WINDOWS, ranks
    assert ranks[1]["cause"] == "compute" and ranks[0]["flagged_windows"] == 0, ranks
    # The healthy rank waits for the slow one in the gradient all-reduce; the slow one computes longer.
    assert ranks[1]["compute_s"] > 1.5 * ranks[0]["compute_s"] and ranks[0]["comm_wait_s"] > ranks[1]["comm_wait_s"]
    assert "rank 1 on node" in capfd.readouterr().err

    # Every worker-second from the workers' start to the final checkpoint is attributed, as workers x wall.
    execution = ExecutionGoodput.from_summary(meta.telemetry["goodput"])
    (attempt,) = execution.attempts
    assert attempt.num_workers == 2 and attempt.outcome == "finished"
    assert 0.98 <= execution.attributed_fraction <= 1.02
    # Against the caller's clock too: the workers' processes start and end within the launch, so they never hold
    # more than 2 x its wall time; what the launcher does alone (checks before spawning the workers, the final
    # checkpoint's copy after they exit) is the margin below.
    assert 0.8 <= attempt.seconds.total_s / (2 * wall_s) <= 1.02
    assert attempt.seconds.productive > 0 and attempt.seconds.communication > 0 and attempt.seconds.checkpoint > 0
    assert attempt.seconds.evaluation > 0 and attempt.seconds.startup > 0


def test_a_healthy_run_flags_no_rank_over_200_windows(digits_dir, tmp_path, monkeypatch, capfd):
    monkeypatch.delenv(SLOW_RANK_ENV, raising=False)
    # One window a step, over epochs of 39 steps (validation and checkpoints between them): 200 windows in seconds.
    meta, _ = _run(tmp_path, digits_dir, epochs=6, max_steps=200, log_interval_steps=1)

    assert meta.global_step == 200
    ranks = {r["rank"]: r for r in meta.telemetry["ranks"]}
    assert [ranks[rank]["flagged_windows"] for rank in (0, 1)] == [0, 0], ranks
    assert "is a straggler" not in capfd.readouterr().err
