"""What a trial of a search scores on a workload's own metric: the last ``val_<name>`` its validation logged to the
trial's MLflow run (a real sqlite store), read by ``tasks.tuning.trial_score``."""

from __future__ import annotations

import pytest
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from tasks.tuning import trial_score
from tasks.types import TrainedModel, TrainMetrics
from tests.helpers.mlflow_db import seed_mlflow_db
from training_core import tracking
from training_core.config import TrackingConfig
from training_core.tuning import TuningConfig

CNN = "examples.cnn_params.workload:DigitsCNN"


def _trial(tmp_path, logged: dict[str, list[tuple[int, float]]]) -> TrainedModel:
    store = TrackingConfig(tracking_uri=seed_mlflow_db(tmp_path / "mlflow.db"), experiment_name="metric")
    tracking_uri, run_id = tracking.create_run(store, run_name="trial-0")
    for name, points in logged.items():
        for step, value in points:
            tracking.log_metrics(tracking_uri, run_id, {name: value}, step=step)
    metrics = TrainMetrics(
        epochs=2, global_step=20, train_loss=0.4, train_accuracy=0.9, val_loss=0.5, val_accuracy=0.8, samples_per_s=1
    )
    return TrainedModel(
        checkpoint=FlyteDirectory(str(tmp_path)),
        model_name="digits_cnn",
        metrics=metrics,
        tracking_uri=tracking_uri,
        mlflow_run_id=run_id,
        mlflow_model_uri="",
        report=FlyteFile(str(tmp_path / "mlflow.db")),
    )


def test_a_trial_scores_its_last_validation_of_the_workloads_own_metric(tmp_path):
    model = _trial(tmp_path, {"val_f1": [(20, 0.75), (10, 0.5)]})
    assert trial_score(TuningConfig.from_dict({"metric": "val_f1", "base": {"workload": {"name": CNN}}}), model) == 0.75
    assert trial_score(TuningConfig(metric="val_loss"), model) == 0.5  # a typed figure is read from the metrics


def test_a_metric_the_workload_never_reported_names_the_metric_and_the_fix(tmp_path):
    model = _trial(tmp_path, {"val_accuracy": [(10, 0.5)]})
    cfg = TuningConfig.from_dict({"metric": "val_f1", "base": {"workload": {"name": CNN}}})
    with pytest.raises(ValueError) as caught:
        trial_score(cfg, model)
    assert str(caught.value) == (
        f"metric='val_f1' is invalid: trial run {model.mlflow_run_id} logged no val_f1, so the workload's metrics() "
        "does not report 'f1'; rank on a metric it reports (val_<name> for each name its metrics() returns)"
    )
