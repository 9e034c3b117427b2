"""Training that diverges: the whole loop (``run_worker``) in this process on one rank, with a learning rate that
trains to NaN or with batches made non-finite on chosen steps. What is checked: the run stops as a user error
naming the step and the settings to change, no checkpoint or logged figure is non-finite, the newest checkpoint is
the last one before the divergence, and ``skip_step`` skips, counts and stops after its budget."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers.runtime import InProcessRuntime
from training_core import checkpoint as ckpt
from training_core.config import LoopConfig, TrainingConfig
from training_core.data import prepare
from training_core.evaluation import evaluate_checkpoint, require_finite
from training_core.records import MlflowRun, WorkerArgs
from training_core.train import loop
from training_core.train.failures import TrainingDiverged, classify

# SGD at lr 20 without clipping on this data: the loss grows by orders of magnitude each step and is NaN at step 6.
DIVERGING = {"name": "sgd", "lr": 20.0, "momentum": 0.9, "weight_decay": 0.0, "max_grad_norm": 0.0}
FIRST_NAN_STEP = 6


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("synthetic")
    prepare(_config().data, str(out))
    return str(out)


def _config(optimizer: dict | None = None, **loop_fields) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "data": {"dataset": "synthetic", "synthetic_num_samples": 512, "synthetic_image_size": 8, "num_shards": 1},
            "model": {"name": "small_cnn"},
            "optimizer": optimizer or {"name": "adamw", "lr": 0.01},
            "schedule": {"name": "constant", "warmup_steps": 0},
            "loop": {"epochs": 1, "batch_size": 16, "log_interval_steps": 2, **loop_fields},
            "checkpoint": {"interval_steps": 2, "keep_last": 2, "async_save": True},
            "scaling": {"num_workers": 1, "torch_threads_per_worker": 1},
            "observability": {"enabled": True, "nvml": False, "host": False, "mlflow_system_metrics": False},
        }
    )


class RecordingSink:
    """The metric sink, kept in memory."""

    def __init__(self) -> None:
        self.metrics: list[tuple[int, str, float]] = []

    def log_params(self, params) -> None:
        pass

    def log_dict(self, payload, name: str) -> None:
        pass

    def log_metrics(self, metrics, *, step: int) -> None:
        self.metrics += [(step, name, value) for name, value in metrics.items()]

    def close(self) -> None:
        pass


@pytest.fixture
def outputs(monkeypatch):
    """What the run sends out: the metric sink, the exporter, and the models it logs to (a stand-in) MLflow."""
    seen: dict = {"sink": RecordingSink(), "models": []}

    def telemetry(*args, **kwargs):
        seen["telemetry"] = real_build_telemetry(*args, **kwargs)
        return seen["telemetry"]

    def log_model(model, example, run, *, dynamic_axes=(0,)) -> str:
        assert dynamic_axes == (0,)  # an image model: only the batch axis is free
        seen["models"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return "models:/m-test"

    real_build_telemetry = loop.build_telemetry
    monkeypatch.setattr(loop, "build_telemetry", telemetry)
    monkeypatch.setattr(loop, "build_sink", lambda **kwargs: seen["sink"])
    monkeypatch.setattr(loop, "MlflowSink", lambda **kwargs: None)
    monkeypatch.setattr("training_core.tracking.log_model", log_model)
    return seen


def _run(cfg: TrainingConfig, data_dir: str, root: Path) -> InProcessRuntime:
    runtime = InProcessRuntime()
    args = WorkerArgs.build(
        cfg, data_dir=data_dir, checkpoint_root=str(root), run_name="unit", mlflow=MlflowRun("file:///unused", "run")
    )
    loop.run_worker(args, runtime)
    return runtime


def _nonfinite_count(telemetry) -> float:
    return telemetry.registry.get_sample_value("training_nonfinite_steps_total", telemetry.labels.as_dict())


def _finite(state: dict[str, torch.Tensor]) -> bool:
    return all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def _poison_steps(monkeypatch, steps: set[int]) -> None:
    """Make the input of these (1-based) global steps infinite, as a corrupt batch would be."""
    real = loop.Trainer.optimizer_step

    def optimizer_step(self, micro_batches):
        if self.state.global_step + 1 in steps:
            micro_batches = [(torch.full_like(x, math.inf), y) for x, y in micro_batches]
        return real(self, micro_batches)

    monkeypatch.setattr(loop.Trainer, "optimizer_step", optimizer_step)


def test_a_diverging_run_stops_as_a_user_error_naming_the_step_and_keeps_its_last_finite_checkpoint(
    data_dir, tmp_path, outputs
):
    with pytest.raises(TrainingDiverged) as raised:
        _run(_config(DIVERGING), data_dir, tmp_path / "ckpt")

    message = str(raised.value)
    assert f"at step {FIRST_NAN_STEP} (loss nan" in message
    for setting in ("optimizer.lr (now 20", "optimizer.max_grad_norm", "loop.nonfinite_policy=skip_step"):
        assert setting in message
    assert classify(raised.value).kind == "user" and not classify(raised.value).retryable
    # Checkpoints every 2 steps, keep_last=2: step 4 is the last before the NaN, and step 6's was never written,
    # so retention kept it (before, step 6's NaN checkpoint and one more would have pushed out every finite one).
    storage = ckpt.CheckpointStorage(str(tmp_path / "ckpt"))
    assert storage.list_steps() == [ckpt.step_name(2), ckpt.step_name(4)]
    newest = ckpt.load_latest_valid(storage)
    assert newest is not None and newest.meta.global_step == 4 and _finite(newest.model)
    logged = outputs["sink"].metrics
    assert logged and all(math.isfinite(value) for _, _, value in logged)
    assert max(step for step, _, _ in logged) == 4
    assert outputs["models"] == []
    assert _nonfinite_count(outputs["telemetry"]) == 1


def test_skip_step_skips_and_counts_steps_then_stops_after_max_nonfinite_steps(data_dir, tmp_path, outputs):
    cfg = _config(DIVERGING, nonfinite_policy="skip_step", max_nonfinite_steps=3)
    with pytest.raises(TrainingDiverged, match=r"5 steps had a non-finite loss or gradient norm and were skipped, "
                       r"more than loop.max_nonfinite_steps=3"):  # fmt: skip
        _run(cfg, data_dir, tmp_path / "ckpt")

    # Steps 6, 7 and 8 are skipped (3 of 3 allowed; the checkpoint at step 8 holds step 5's weights), and the
    # window of steps 9-10 goes past the budget.
    assert _nonfinite_count(outputs["telemetry"]) == 5
    newest = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(tmp_path / "ckpt")))
    assert newest is not None and newest.meta.global_step == 8 and _finite(newest.model)
    logged = outputs["sink"].metrics
    assert logged and all(math.isfinite(value) for _, _, value in logged)
    assert outputs["models"] == []


def test_skip_step_rides_over_a_few_corrupt_batches_and_finishes_with_finite_weights(
    data_dir, tmp_path, outputs, monkeypatch
):
    _poison_steps(monkeypatch, {5, 6, 13})
    cfg = _config(nonfinite_policy="skip_step", max_nonfinite_steps=3, max_steps=16)
    runtime = _run(cfg, data_dir, tmp_path / "ckpt")

    assert _nonfinite_count(outputs["telemetry"]) == 3
    final = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(tmp_path / "ckpt")))
    assert final is not None and final.meta.global_step == 16 and _finite(final.model)
    assert math.isfinite(runtime.reports[-1]["train_loss"]) and math.isfinite(runtime.reports[-1]["val_loss"])
    # The window of steps 5-6 had no finite step and is not logged; every logged figure is finite.
    logged = outputs["sink"].metrics
    assert {step for step, name, _ in logged if name == "train_loss"} == {2, 4, 8, 10, 12, 14, 16}
    assert all(math.isfinite(value) for _, _, value in logged)
    (model,) = outputs["models"]
    assert _finite(model)


def test_the_same_corrupt_batch_stops_a_run_under_the_default_policy(data_dir, tmp_path, outputs, monkeypatch):
    _poison_steps(monkeypatch, {5})
    with pytest.raises(TrainingDiverged, match="not finite at step 5 "):
        _run(_config(max_steps=16), data_dir, tmp_path / "ckpt")
    storage = ckpt.CheckpointStorage(str(tmp_path / "ckpt"))
    assert storage.list_steps() == [ckpt.step_name(2), ckpt.step_name(4)]


def test_a_non_finite_validation_loss_stops_the_run_before_the_epoch_is_recorded_or_checkpointed(
    data_dir, tmp_path, outputs, monkeypatch
):
    real_evaluate = loop.evaluate

    def evaluate(*args, **kwargs):
        result = real_evaluate(*args, **kwargs)
        result.sums["loss_sum"] = result.sums["loss_sum"] * math.nan
        result.metrics["loss"] = math.nan
        return result

    monkeypatch.setattr(loop, "evaluate", evaluate)
    with pytest.raises(TrainingDiverged, match="validation loss after step 4 is nan"):
        _run(_config(max_steps=4), data_dir, tmp_path / "ckpt")
    newest = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(tmp_path / "ckpt")))
    assert newest is not None and newest.meta.history == [] and newest.meta.best_metric is None
    assert not [name for _, name, _ in outputs["sink"].metrics if name.startswith("val_")]
    assert outputs["models"] == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nonfinite_policy": "ignore"}, "loop.nonfinite_policy='ignore' is invalid: choose one of stop, skip_step"),
        ({"max_nonfinite_steps": 0}, "loop.max_nonfinite_steps=0 is invalid: it must be in [1, 1_000_000]"),
        ({"max_nonfinite_steps": 10**7}, "loop.max_nonfinite_steps=10000000 is invalid: it must be in [1, 1_000_000]"),
    ],
)
def test_the_nonfinite_settings_are_validated_with_the_field_the_value_and_the_range(fields, message):
    with pytest.raises(ValueError) as raised:
        LoopConfig(**fields)
    assert str(raised.value).startswith(message)


def test_a_divergence_is_a_user_error_even_when_wrapped_by_the_worker_group():
    class WorkerGroupError(RuntimeError):
        def __init__(self, failures):
            super().__init__("training failed")
            self.worker_failures = failures

    peer = RuntimeError("Connection closed by peer")
    verdict = classify(WorkerGroupError({0: TrainingDiverged("training diverged: step 7"), 1: peer}))
    assert verdict.kind == "user" and "rank 0: TrainingDiverged: training diverged: step 7" == verdict.reason


def test_a_checkpoint_with_non_finite_weights_is_refused_by_evaluation_and_figures_by_registration(data_dir, tmp_path):
    # The loop never writes such a checkpoint; one from elsewhere (an older run, a copy) is still refused.
    from training_core.models import build_model

    model = build_model("small_cnn", num_classes=10, input_shape=(1, 8, 8))
    first = next(name for name, t in model.state_dict().items() if t.is_floating_point())
    with torch.no_grad():
        model.state_dict()[first].view(-1)[0] = math.nan
    meta = ckpt.CheckpointMeta(
        model_name="small_cnn",
        classes=[str(i) for i in range(10)],
        input_shape=[1, 8, 8],
        mean=[0.5],
        std=[0.2],
        epoch=1,
        global_step=1,
        config=_config().to_dict(),
    )
    checkpointer = ckpt.Checkpointer(ckpt.CheckpointStorage(str(tmp_path)), keep_last=1, async_save=False)
    checkpointer.save(1, checkpointer.stage(model=model, meta=meta))
    with pytest.raises(ValueError, match=rf"weights\) has non-finite {first}=nan: a diverged model is neither"):
        evaluate_checkpoint(str(tmp_path / ckpt.step_name(1)), data_dir, split="val")

    with pytest.raises(ValueError, match=r"model m has non-finite test_loss=nan, val_loss=inf: a diverged model"):
        require_finite({"test_loss": math.nan, "val_loss": math.inf, "test_accuracy": 0.1}, what="model m",
                       fix="a diverged model is not registered")  # fmt: skip
