"""``train``: a Ray task that runs the training loop on Ray Train workers (PyTorch DDP)."""

from __future__ import annotations

import os
import uuid

from flytekit import Resources, current_context, task

from tasks.artifacts import publish_report, tracked_directory
from tasks.ray_config import ray_job_config
from tasks.types import PreparedData, TrainedModel, TrainMetrics
from training_core.config import ScalingConfig, TrainingConfig

# The RayJob's shape is fixed when the task is declared; it follows the default ScalingConfig. A run
# with other worker counts or sizes gets a matching RayJob via ``train.with_overrides(task_config=
# ray_job_config(scaling))`` (the scaling and tuning workflows do this per node).
DEFAULT_RAY_JOB = ray_job_config(ScalingConfig())


@task(
    task_config=DEFAULT_RAY_JOB,
    retries=2,
    requests=Resources(cpu="1", mem="2Gi"),
    limits=Resources(cpu="2", mem="4Gi"),
    enable_deck=True,
)
def train(config: TrainingConfig, data: PreparedData) -> TrainedModel:
    """Train ``config.model`` with PyTorch DDP on ``config.scaling.num_workers`` Ray Train workers.

    Rank 0 logs params, per-step metrics, the config and the model (with its signature) to MLflow.

    :param config: The whole run's config: model, optimizer and schedule, loop, scaling, precision,
        checkpoint storage and tracking.
    :param data: Prepared shards from ``prepare_data``; each worker streams only its own shards.
    :return: The final checkpoint directory, last-epoch metrics, the MLflow run and model URIs, and the
        training report.
    """
    from flytekit.exceptions.user import FlyteRecoverableException

    from tasks import reports
    from training_core import tracking
    from training_core.failures import classify
    from training_core.trainer import MlflowRun, fit

    ctx = current_context()
    run_name = f"train-{ctx.execution_id.name}-{uuid.uuid4().hex[:8]}"
    storage_path = config.checkpoint.storage_path or os.path.join(ctx.working_directory, "ray_results")
    # Workers read shards from where Flyte stored them (a local path here, s3:// on a cluster).
    data_dir = data.directory.remote_source or data.directory.path
    _require_prepared_data(data_dir)
    tracking_uri, run_id = tracking.create_run(
        config.tracking, run_name=run_name, tags={"flyte.execution_id": ctx.execution_id.name}
    )
    try:
        result = fit(
            config,
            data_dir=data_dir,
            checkpoint_dir=os.path.join(ctx.working_directory, "final_checkpoint"),
            run_name=run_name,
            storage_path=storage_path,
            mlflow_run=MlflowRun(tracking_uri=tracking_uri, run_id=run_id),
        )
    except Exception as exc:
        tracking.finish_run(tracking_uri, run_id, status="FAILED")
        verdict = classify(exc)
        if verdict.retryable:
            # Only this exception type makes Flyte retry; the new attempt resumes from the latest checkpoint.
            raise FlyteRecoverableException(f"training hit an infrastructure failure ({verdict.reason}); retrying") from exc
        raise
    tracking.finish_run(tracking_uri, run_id)

    meta, last = result.meta, result.meta.history[-1]
    metrics = TrainMetrics(
        epochs=meta.epoch,
        global_step=meta.global_step,
        train_loss=last["train_loss"],
        train_accuracy=last["train_accuracy"],
        val_loss=last["val_loss"],
        val_accuracy=last["val_accuracy"],
        samples_per_s=float(result.metrics.get("steady_samples_per_s", last["samples_per_s"])),
    )
    summary = reports.table([
        ("model", meta.model_name), ("epochs", meta.epoch), ("optimizer steps", meta.global_step),
        ("workers", config.scaling.num_workers), ("final train loss", metrics.train_loss),
        ("final val loss", metrics.val_loss), ("final val accuracy", metrics.val_accuracy),
        ("throughput (samples/s)", metrics.samples_per_s), ("MLflow run", run_id),
    ])
    body = [
        reports.section("Summary", summary, section_id="summary"),
        reports.section("Curves", reports.training_curves(meta.history, meta.step_log), section_id="curves"),
    ]
    report = publish_report("Training report", reports.page("Training report", body), "".join(body))
    return TrainedModel(
        checkpoint=tracked_directory(result.checkpoint_dir),
        model_name=meta.model_name,
        metrics=metrics,
        tracking_uri=tracking_uri,
        mlflow_run_id=run_id,
        mlflow_model_uri=meta.mlflow_model_uri,
        report=report,
    )


def _require_prepared_data(data_dir: str) -> None:
    import fsspec

    from training_core.data import MANIFEST_NAME

    fs, root = fsspec.core.url_to_fs(data_dir)
    if not fs.exists(f"{root.rstrip('/')}/{MANIFEST_NAME}"):
        raise ValueError(
            f"data.directory={data_dir!r} has no {MANIFEST_NAME}: the prepared data is gone (a cached prepare_data "
            "output whose files were deleted, e.g. a cleaned /tmp). Run `pyflyte local-cache clear` and re-run."
        )
