"""The typed records: the bounded step log keeps the run's figures when it merges windows."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from training_core.config import TrainingConfig
from training_core.records import EpochRecord, StepLog, StepRecord, WorkerArgs


def _window(step: int, num_steps: int, rng: random.Random) -> StepRecord:
    step_time_s = rng.uniform(0.01, 0.1)
    return StepRecord(
        step=step,
        epoch=step // 100,
        train_loss=rng.uniform(0.1, 2.0),
        train_accuracy=rng.uniform(0, 1),
        lr=rng.uniform(0, 0.1),
        grad_norm=rng.uniform(0, 5),
        samples_per_s=64 / step_time_s,
        tokens_per_s=64 * 128 / step_time_s,
        step_time_s=step_time_s,
        data_wait_s=rng.uniform(0, 0.001),
        allreduce_fraction=rng.uniform(0, 0.5),
        elapsed_s=step * 0.05,
        num_steps=num_steps,
    )


def test_a_full_step_log_merges_windows_keeping_step_weighted_means_and_the_newest_record():
    rng = random.Random(0)
    windows, log = [], StepLog(capacity=16)
    for i in range(1, 501):
        windows.append(_window(i * 3, 3, rng))
        log.append(windows[-1])
    assert len(log.records) == 16
    assert log.records[-1] == windows[-1]  # the run's last figures stay as logged
    steps = [r.step for r in log.records]
    assert steps == sorted(steps) and steps[-1] == 1500
    # Every step is in exactly one record, and the step-weighted loss of the whole run is unchanged.
    assert sum(r.num_steps for r in log.records) == 1500
    whole = sum(w.train_loss * w.num_steps for w in windows) / 1500
    assert sum(r.train_loss * r.num_steps for r in log.records) / 1500 == pytest.approx(whole, rel=1e-12)
    # Samples (and tokens) over time, as a window's rate times its step time, is still the global batch of 64
    # (of 128 tokens each): a merged window keeps a language model's tokens/s.
    for record in log.records:
        assert record.samples_per_s * record.step_time_s == pytest.approx(64, rel=1e-9)
        assert record.tokens_per_s * record.step_time_s == pytest.approx(64 * 128, rel=1e-9)
    # Merging keeps the points spread over the run: no record covers more than a few times its share.
    assert max(r.num_steps for r in log.records) <= 4 * 1500 / 16


def test_records_round_trip_and_records_of_older_checkpoints_load():
    record = EpochRecord(2, 40, 0.5, 0.9, 0.6, 0.88, 0.001, 1000.0, 990.0, 30, 0.01, 0.02, 0.1)
    assert EpochRecord.from_dict(record.to_dict()) == record
    assert record.metric("val_accuracy") == 0.88
    # An older record: floats for counts, no steady-state figures.
    old = EpochRecord.from_dict(
        {
            "epoch": 1.0,
            "global_step": 20.0,
            "train_loss": 1.0,
            "train_accuracy": 0.5,
            "val_loss": 1.1,
            "val_accuracy": 0.4,
            "lr": 0.01,
            "samples_per_s": 800.0,
        }
    )
    assert old.epoch == 1 and isinstance(old.global_step, int) and old.steady_samples_per_s == 0.0
    # Nor workload figures: an image model's record has no perplexity and no tokens.
    assert math.isnan(old.val_perplexity) and old.tokens_per_s == 0.0
    lm = EpochRecord.from_dict(old.to_dict() | {"val_perplexity": 12.5, "tokens_per_s": 4096.0})
    assert lm.metric("val_perplexity") == 12.5 and lm.tokens_per_s == 4096.0
    step = StepRecord.from_dict(
        {
            "step": 4.0,
            "epoch": 0.0,
            "train_loss": 2.0,
            "train_accuracy": 0.1,
            "lr": 0.1,
            "grad_norm": 1.0,
            "samples_per_s": 10.0,
            "step_time_s": 0.1,
            "data_wait_s": 0.0,
            "allreduce_fraction": 0.0,
        }
    )
    assert step.step == 4 and step.elapsed_s == 0.0 and not math.isnan(step.metrics()["train_loss"])
    # tokens/s is logged only where there are tokens.
    assert step.tokens_per_s == 0.0 and "tokens_per_s" not in step.metrics()
    with_tokens = StepRecord.from_dict(dataclasses.asdict(step) | {"tokens_per_s": 2560.0})
    assert with_tokens.metrics()["tokens_per_s"] == 2560.0
    assert with_tokens.metrics().keys() - {"tokens_per_s"} == step.metrics().keys()


def test_worker_args_are_built_in_one_place_and_survive_ray_trains_config_dict(monkeypatch):
    monkeypatch.setenv("TRAINING_PUSHGATEWAY_URL", "http://gateway:9091")
    args = WorkerArgs.build(TrainingConfig(), data_dir="d", checkpoint_root="r", run_name="run-7", resume_from="x")
    assert args.config.observability.pushgateway_url == "http://gateway:9091"
    assert args.job_labels == {"execution": "run-7", "node": "local", "attempt": "0"}
    assert WorkerArgs.from_dict(args.to_dict()) == args
