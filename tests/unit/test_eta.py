"""Progress and ETA on a synthetic run with noisy steps, a validation every epoch and periodic checkpoints: after
the first epoch the ETA meets the run's real end within 20 %, which step time alone would not."""

from __future__ import annotations

import random

import pytest

from training_core.telemetry.eta import EtaEstimator
from training_core.telemetry.goodput import ExecutionGoodput

TOTAL_STEPS, STEPS_PER_EPOCH, WINDOW_STEPS, CHECKPOINT_EVERY = 1000, 100, 10, 250
STEP_S, VALIDATION_S, CHECKPOINT_S = 0.1, 4.0, 2.0


def _run(estimator: EtaEstimator, seed: int = 0) -> tuple[list[tuple[float, int, float | None]], float]:
    """Simulated wall clock of the run: (time, global step, ETA) at each window's close, and the real end."""
    rng, now, window_s, seen = random.Random(seed), 0.0, 0.0, []
    for step in range(1, TOTAL_STEPS + 1):
        step_s = STEP_S * rng.uniform(0.8, 1.2)
        now, window_s = now + step_s, window_s + step_s
        if step % WINDOW_STEPS == 0:
            estimator.window(num_steps=WINDOW_STEPS, step_time_s=window_s)
            window_s = 0.0
            seen.append((now, step, estimator.estimate(global_step=step).eta_s))
        stalls = []
        if step % STEPS_PER_EPOCH == 0:
            stalls.append(VALIDATION_S * rng.uniform(0.9, 1.1))
        if step % CHECKPOINT_EVERY == 0 or step == TOTAL_STEPS:
            stalls.append(CHECKPOINT_S * rng.uniform(0.9, 1.1))
        for stall_s in stalls:
            now += stall_s
            estimator.overhead(stall_s)
    return seen, now


def test_after_the_first_epoch_the_eta_meets_the_real_end_within_twenty_percent():
    seen, end = _run(EtaEstimator(total_steps=TOTAL_STEPS))
    after_first_epoch = [(now, step, eta) for now, step, eta in seen if step > STEPS_PER_EPOCH]
    checked = [(now, step, eta) for now, step, eta in after_first_epoch if step <= TOTAL_STEPS - 2 * STEPS_PER_EPOCH]
    assert len(checked) >= 70
    for now, step, eta in checked:
        remaining = end - now
        assert eta == pytest.approx(remaining, rel=0.2), f"step {step}: ETA {eta:.1f} s, real {remaining:.1f} s"
    # In the last two epochs an amortised estimate cannot place the last validation and checkpoint: it is off by at
    # most those.
    for now, step, eta in after_first_epoch[len(checked) :]:
        assert abs(now + eta - end) <= VALIDATION_S + CHECKPOINT_S, f"step {step}"
    # Step time alone misses by more: the validations and checkpoints are a third of the time per step.
    now, step, _ = checked[0]
    assert (TOTAL_STEPS - step) * STEP_S < 0.8 * (end - now)


def test_before_any_window_there_is_no_estimate_and_after_the_last_step_nothing_is_left():
    estimator = EtaEstimator(total_steps=100)
    progress = estimator.estimate(global_step=0, next_checkpoint_step=50)
    assert progress.eta_s is None and progress.eta_checkpoint_s is None and progress.steps_per_s == 0.0
    estimator.window(num_steps=100, step_time_s=10.0)
    done = estimator.estimate(global_step=100)
    assert done.eta_s == 0.0 and done.fraction_done == 1.0 and done.next_checkpoint_step is None


def test_the_next_checkpoints_eta_and_the_amortised_overhead_use_the_recent_rate():
    estimator = EtaEstimator(total_steps=1000, recent_windows=2)
    estimator.window(num_steps=10, step_time_s=10.0)  # slow start-up steps, out of the recent windows below
    estimator.window(num_steps=10, step_time_s=1.0)
    estimator.window(num_steps=10, step_time_s=1.0)
    estimator.overhead(6.0)  # 6 s over the 30 steps taken: 0.2 s per step
    progress = estimator.estimate(global_step=30, next_checkpoint_step=50)
    assert progress.steps_per_s == pytest.approx(10.0)
    assert progress.overhead_per_step_s == pytest.approx(0.2)
    assert progress.eta_checkpoint_s == pytest.approx(20 * 0.3)
    assert progress.eta_s == pytest.approx(970 * 0.3)
    assert (progress.global_step, progress.total_steps, progress.fraction_done) == (30, 1000, pytest.approx(0.03))


def test_a_real_runs_eta_read_after_its_first_epoch_is_within_20_percent_of_the_time_it_really_took_to_end(
    digits_dir, tmp_path
):
    """The loop in this process, 3 epochs of a model whose forward lasts a set time (so a loaded machine does not blur
    the figures) with a validation after each epoch and a checkpoint every 4 steps: the ETA at the first window after
    epoch 1's validation, as the checkpoint keeps it, against the time left to the final checkpoint."""
    from tests.helpers.runtime import InProcessRuntime
    from training_core import checkpoint as ckpt
    from training_core.config import TrainingConfig
    from training_core.records import WorkerArgs
    from training_core.telemetry.eta import EtaReading
    from training_core.train.loop import run_worker

    cfg = TrainingConfig.from_dict(
        {
            "workload": {"model_factory": "tests.helpers.steady_model:build"},
            "loop": {"epochs": 3, "batch_size": 128, "log_interval_steps": 2},
            "checkpoint": {"interval_steps": 4, "keep_last": 2},
            "scaling": {"num_workers": 1, "torch_threads_per_worker": 1},
            "observability": {"enabled": False},
        }
    )
    run_worker(
        WorkerArgs.build(cfg, data_dir=digits_dir, checkpoint_root=str(tmp_path), run_name="eta"), InProcessRuntime()
    )
    meta = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(tmp_path))).meta
    steps_per_epoch = meta.history[0].global_step
    readings = [EtaReading.from_dict(saved) for saved in meta.telemetry["eta"]]
    # One per validation before the last: at the next window (every 2 steps).
    assert [(r.global_step - 1) // steps_per_epoch for r in readings] == [1, 2]
    assert all(r.global_step <= epoch * steps_per_epoch + 2 for epoch, r in enumerate(readings, start=1))
    first, end_unix = readings[0], meta.saved_unix
    seconds = ExecutionGoodput.from_summary(meta.telemetry["goodput"]).seconds
    print(
        f"ETA after epoch 1: {first.eta_s:.2f} s, real {end_unix - first.unix:.2f} s, error "
        f"{first.error(end_unix):.1%}; validation {seconds.evaluation:.2f} s of {seconds.total_s:.2f} s"
    )
    assert first.error(end_unix) <= 0.2
