"""The step meter across a resume: a run stopped mid-epoch saves the epoch's sums in its checkpoint
(``epoch_partial``), and the resumed run's epoch record equals the uninterrupted run's, the workload's figures
(accuracy, a language model's token counts) included; a checkpoint written before workloads (``correct``) too."""

from __future__ import annotations

import json
import math

import pytest
import torch

from training_core.train.meter import EPOCH_FIGURE_PREFIX, StepMeter
from training_core.train.step import StepResult
from training_core.workloads import mean_of
from training_core.workloads.image import ImageClassification

VAL = {"loss": 1.1, "accuracy": 0.6}
STEPS_IN_EPOCH = 6
WINDOW = 2
STOP_AFTER = 4
"""The interrupted run checkpoints after this many steps (a window boundary, where checkpoints are written)."""


def _image_step(index: int) -> StepResult:
    return StepResult(
        loss=torch.tensor(2.0 / index, dtype=torch.float64),
        sums={"correct": torch.tensor(index + 2), "samples": torch.tensor(8)},
        num_samples=8,
        num_tokens=0,
        grad_norm=torch.tensor(1.0),
        nonfinite=torch.tensor(index == 3),  # one skipped step: the epoch's loss is over the finite ones
    )


def _token_step(index: int) -> StepResult:
    return StepResult(
        loss=torch.tensor(5.0 - index / 2, dtype=torch.float64),
        sums={"hits": torch.tensor(10 * index), "tokens": torch.tensor(4 * 64)},
        num_samples=4,
        num_tokens=4 * 64,
        grad_norm=torch.tensor(1.0),
        nonfinite=torch.tensor(False),
    )


def _token_metrics(sums):
    return {"accuracy": mean_of(sums, "hits", "tokens")}


WORKLOADS = {
    "image": (_image_step, ImageClassification().metrics),
    "tokens": (_token_step, _token_metrics),
}


def _meter(metrics) -> StepMeter:
    return StepMeter(world_size=1, device=torch.device("cpu"), global_batch=8, warmup_steps_excluded=0, metrics=metrics)


def _train(meter: StepMeter, make_step, steps: range) -> None:
    for index in steps:
        meter.step(make_step(index), global_step=index, step_time_s=0.1 * index, data_wait_s=0.01, comm_s=0.0)
        if index % WINDOW == 0:
            meter.close_window(global_step=index, epoch=0, lr=0.1, elapsed_s=float(index))


def _close(meter: StepMeter):
    return meter.close_epoch(epoch=0, global_step=STEPS_IN_EPOCH, steps_in_epoch=STEPS_IN_EPOCH, val=VAL, lr=0.1)


EPOCH_FIGURES = ("epoch", "global_step", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "lr")
RATES = ("samples_per_s", "tokens_per_s")


def _uninterrupted(make_step, metrics):
    whole = _meter(metrics)
    _train(whole, make_step, range(1, STEPS_IN_EPOCH + 1))
    return _close(whole)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_a_resume_mid_epoch_reports_the_epoch_the_uninterrupted_run_reports(workload):
    make_step, metrics = WORKLOADS[workload]
    expected = _uninterrupted(make_step, metrics)

    stopped = _meter(metrics)
    _train(stopped, make_step, range(1, STOP_AFTER + 1))
    # The sums travel in the checkpoint's JSON meta.
    saved = json.loads(json.dumps(stopped.epoch_sums()))
    figures = {k for k in saved if k.startswith(EPOCH_FIGURE_PREFIX)}
    assert figures == {EPOCH_FIGURE_PREFIX + name for name in make_step(1).sums}
    resumed = _meter(metrics)
    resumed.restore_epoch_sums(saved)
    assert resumed.epoch_sums() == saved
    _train(resumed, make_step, range(STOP_AFTER + 1, STEPS_IN_EPOCH + 1))
    record = _close(resumed)

    for name in EPOCH_FIGURES:
        assert getattr(record, name) == pytest.approx(getattr(expected, name), rel=1e-12), name
    for name in RATES:
        assert getattr(record, name) == pytest.approx(getattr(expected, name), rel=1e-12), name
    assert math.isfinite(record.train_accuracy) and 0 < record.train_accuracy < 1
    if workload == "tokens":
        assert record.tokens_per_s == pytest.approx(6 * 256 / sum(0.1 * i for i in range(1, 7)), rel=1e-12)
    else:
        assert record.tokens_per_s == 0.0
        # 5 finite steps of 6, and (3 + ... + 8) correct of 48.
        assert record.train_loss == pytest.approx(sum(2.0 / i for i in (1, 2, 4, 5, 6)) / 5, rel=1e-12)
        assert record.train_accuracy == pytest.approx(33 / 48, rel=1e-12)


def test_a_resume_from_a_checkpoint_written_before_workloads_restores_the_image_accuracy():
    """Those checkpoints saved ``loss``, ``correct``, ``samples`` and ``time_s``, and had no non-finite steps."""

    def make_step(index: int) -> StepResult:
        result = _image_step(index)
        result.nonfinite = torch.tensor(False)
        return result

    metrics = ImageClassification().metrics
    expected = _uninterrupted(make_step, metrics)
    stopped = _meter(metrics)
    _train(stopped, make_step, range(1, STOP_AFTER + 1))
    current = stopped.epoch_sums()
    legacy = {
        "loss": current["step_loss"],  # the sum over every rank's steps: one rank here
        "correct": current[EPOCH_FIGURE_PREFIX + "correct"],
        "samples": current["samples"],
        "time_s": current["time_s"],
    }
    assert legacy["correct"] == sum(i + 2 for i in range(1, STOP_AFTER + 1)) and legacy["samples"] == 32

    resumed = _meter(metrics)
    resumed.restore_epoch_sums(legacy)
    assert resumed.epoch_sums()[EPOCH_FIGURE_PREFIX + "correct"] == legacy["correct"]
    assert resumed.epoch_sums()[EPOCH_FIGURE_PREFIX + "samples"] == legacy["samples"]
    _train(resumed, make_step, range(STOP_AFTER + 1, STEPS_IN_EPOCH + 1))
    record = _close(resumed)
    for name in (*EPOCH_FIGURES, "samples_per_s"):
        assert getattr(record, name) == pytest.approx(getattr(expected, name), rel=1e-12), name
    assert record.train_accuracy == pytest.approx(33 / 48, rel=1e-12)


def test_a_resume_without_saved_figures_does_not_invent_an_accuracy():
    """A checkpoint with no epoch sums (one written at an epoch boundary) restores an empty epoch."""
    metrics = ImageClassification().metrics
    meter = _meter(metrics)
    meter.restore_epoch_sums({})
    _train(meter, _image_step, range(1, WINDOW + 1))
    record = _close(meter)
    assert record.train_accuracy == pytest.approx((3 + 4) / 16, rel=1e-12)


def test_an_epoch_whose_every_step_was_skipped_reports_no_train_loss():
    """No finite step means no training loss (NaN, as a window's record says), not a loss of 0."""
    meter = _meter(ImageClassification().metrics)
    for index in (1, 2):
        step = _image_step(index)
        step.nonfinite = torch.tensor(True)
        meter.step(step, global_step=index, step_time_s=0.1, data_wait_s=0.0, comm_s=0.0)
    meter.close_window(global_step=2, epoch=0, lr=0.1, elapsed_s=1.0)

    record = meter.close_epoch(epoch=0, global_step=2, steps_in_epoch=2, val=VAL, lr=0.1)

    assert math.isnan(record.train_loss)
