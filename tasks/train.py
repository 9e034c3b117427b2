"""``train``: a Ray task that runs the training loop on Ray Train workers (PyTorch DDP)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from datetime import timedelta
from typing import Optional

from flytekit import Resources, current_context, task
from flytekit.types.directory import FlyteDirectory

from tasks.artifacts import (
    DECK_FIELDS,
    artifact_location,
    checkpoint_storage_path,
    publish_report,
    read_attempt_record,
    tracked_directory,
    write_attempt_record,
)
from tasks.logs import show_task_logs
from tasks.ray_config import ray_job_config
from tasks.types import PreparedData, TrainedModel, TrainGoodput, TrainMetrics
from training_core.config import ScalingConfig, TrainingConfig
from training_core.redact import redact

# The RayJob's shape is fixed when the task is declared; it follows the default ScalingConfig. A run
# with other worker counts or sizes gets a matching RayJob via ``train.with_overrides(task_config=
# ray_job_config(scaling))`` (the scaling benchmark and tuning workflows do this per node).
DEFAULT_RAY_JOB = ray_job_config(ScalingConfig())


# The timeout bounds a hung collective or a stuck pod.
TRAIN_TIMEOUT = timedelta(hours=12)

# What every task that drives Ray Train from its pod shares (``train``, ``train_trial``, ``tune_with_ray``):
# the timeout, the driver pod's size (the workers are the RayJob's) and the Deck with the report.
RAY_DRIVER_TASK_ARGS = {
    "timeout": TRAIN_TIMEOUT,
    "requests": Resources(cpu="1", mem="2Gi"),
    "limits": Resources(cpu="2", mem="4Gi"),
    "enable_deck": True,
    "deck_fields": DECK_FIELDS,
}

# A train node can run on preemptible (spot) nodes: a preemption costs at most one checkpoint interval,
# since the retry resumes from the latest checkpoint. ``train`` and the tuning's ``train_trial`` share these.
TRAIN_TASK_ARGS = {**RAY_DRIVER_TASK_ARGS, "retries": 2, "interruptible": True}


@task(task_config=DEFAULT_RAY_JOB, **TRAIN_TASK_ARGS)
def train(config: TrainingConfig, data: PreparedData, resume_from: Optional[FlyteDirectory] = None) -> TrainedModel:
    """Train ``config.model`` with PyTorch DDP on ``config.scaling.num_workers`` Ray Train workers.

    Rank 0 logs params, per-step metrics, the config and the model (with its signature) to MLflow.

    :param config: The whole run's config: model, optimizer and schedule, loop, scaling, precision,
        checkpoint storage and tracking.
    :param data: Prepared shards from ``prepare_data``; each worker streams only its own shards.
    :param resume_from: A checkpoint directory of any earlier run (a ``TrainedModel.checkpoint``) to continue
        or fine-tune from: model, optimizer and position are restored, and ``config.loop.epochs`` sets
        where training ends. Ignored when this run already has checkpoints of its own (a retry).
    :return: The final checkpoint directory, last-epoch metrics, the MLflow run and model URIs, and the
        training report.
    """
    return run_training(config, data, resume_from)


def run_training(config: TrainingConfig, data: PreparedData, resume_from: Optional[FlyteDirectory]) -> TrainedModel:
    """The body of ``train``, shared with the tuning pipeline's cached ``train_trial`` task."""
    from flytekit.exceptions.user import FlyteRecoverableException

    from training_core import tracking
    from training_core.records import MlflowRun
    from training_core.runners.ray_train import fit
    from training_core.train.failures import classify

    show_task_logs()
    ctx = current_context()
    # Workers read shards from where Flyte stored them (a local path here, s3:// on a cluster).
    data_dir = artifact_location(data.directory)
    _require_prepared_data(data_dir)
    location = _run_location(config, data_dir)
    tags = {"flyte.execution_id": ctx.execution_id.name}
    if config.tracking.parent_run_id:
        tags["mlflow.parentRunId"] = config.tracking.parent_run_id
    # A retry continues the run its earlier attempt created, a trial's later slice the run of its first slice.
    tracking_uri, run_id = tracking.resume_or_create_run(
        config.tracking,
        run_id=location.mlflow_run_id or config.tracking.run_id,
        run_name=location.run_name,
        tags=tags,
    )
    # Params go to an MLflow run once, when it is created (True): a trial's later slice logs into a run that has
    # them (False), and a retry leaves it to the loop (None), which logs them unless it resumes a checkpoint.
    log_params = None if location.mlflow_run_id else not config.tracking.run_id
    _write_pointer(dataclasses.replace(location, mlflow_run_id=run_id))
    storage_path, run_name = location.storage_path, location.run_name
    try:
        result = fit(
            config,
            data_dir=data_dir,
            checkpoint_dir=os.path.join(ctx.working_directory, "final_checkpoint"),
            run_name=run_name,
            storage_path=storage_path,
            mlflow_run=MlflowRun(tracking_uri=tracking_uri, run_id=run_id),
            resume_from=artifact_location(resume_from) if resume_from is not None else None,
            log_params=log_params,
            job_labels=_job_labels(),
        )
    except Exception as exc:
        tracking.finish_run(tracking_uri, run_id, status="FAILED")
        verdict = classify(exc)
        if verdict.retryable:
            # Only this exception type makes Flyte retry; the new attempt resumes from the latest checkpoint.
            raise FlyteRecoverableException(
                f"training hit an infrastructure failure ({redact(verdict.reason)}); retrying"
            ) from exc
        raise
    tracking.finish_run(tracking_uri, run_id)
    return trained_model(config, result, tracking_uri=tracking_uri, run_id=run_id, data=data)


def trained_model(
    config: TrainingConfig, result, *, tracking_uri: str, run_id: str, data: PreparedData | None = None
) -> TrainedModel:
    """The typed output of a finished run (a ``FitResult``), with its training report as a Deck; the report says
    which prepared ``data`` the run trained on, when given."""
    from tasks import reports

    meta = result.meta
    metrics = TrainMetrics.from_record(epochs=meta.epoch, global_step=meta.global_step, record=result.metrics)
    summary = [
        ("model", meta.model_name),
        ("epochs", meta.epoch),
        ("optimizer steps", meta.global_step),
        ("workers", config.scaling.num_workers),
        ("final train loss", metrics.train_loss),
        ("final val loss", metrics.val_loss),
        ("final val accuracy", metrics.val_accuracy),
        *([("final val perplexity", metrics.val_perplexity)] if metrics.val_perplexity > 0 else []),
        ("throughput (samples/s)", metrics.samples_per_s),
        *([("throughput (tokens/s)", metrics.tokens_per_s)] if metrics.tokens_per_s else []),
        ("step time p50 / p95 (s)", f"{metrics.step_time_p50_s:.4f} / {metrics.step_time_p95_s:.4f}"),
        ("all-reduce share of step time", metrics.allreduce_fraction),
        ("MLflow run", run_id),
        *_data_rows(data),
    ]
    # Checkpoints older than the telemetry field load with it empty: their report says "not recorded".
    sections = reports.training_sections(
        summary=summary, history=meta.history, step_log=meta.step_log, telemetry=meta.telemetry
    )
    report = publish_report("Training report", sections)
    # A checkpoint already on object storage is returned where it lives; a local one is uploaded.
    remote = "://" in result.checkpoint_uri and not result.checkpoint_uri.startswith("file://")
    return TrainedModel(
        checkpoint=FlyteDirectory(result.checkpoint_uri) if remote else tracked_directory(result.checkpoint_dir),
        model_name=meta.model_name,
        metrics=metrics,
        tracking_uri=tracking_uri,
        mlflow_run_id=run_id,
        mlflow_model_uri=meta.mlflow_model_uri,
        report=report,
        goodput=TrainGoodput.from_summary(meta.telemetry.get("goodput")),
    )


def _data_rows(data: PreparedData | None) -> list[tuple[str, object]]:
    """The training report's rows on the prepared data: its samples per split, where it is, and its provenance."""
    if data is None:
        return []
    return [
        ("training samples", data.split_counts.get("train", 0)),
        ("samples per split", ", ".join(f"{name} {count}" for name, count in data.split_counts.items())),
        ("prepared data", redact(artifact_location(data.directory))),
        ("data provenance", data.provenance.describe()),
    ]


def _job_labels() -> dict[str, str]:
    """Which Flyte execution, node and attempt this is, for the workers' metric labels.

    On a cluster the task pod is named ``<execution>-<node id>-<attempt>`` and gets ``FLYTE_ATTEMPT_NUMBER``;
    where those are missing (a local run) the node falls back to the task's name and the attempt to 0.
    """
    ctx = current_context()
    execution = ctx.execution_id.name or "local"
    attempt = os.environ.get("FLYTE_ATTEMPT_NUMBER", "0")
    node = ""
    pod = os.environ.get("HOSTNAME", "")
    prefix, suffix = f"{execution}-", f"-{attempt}"
    if pod.startswith(prefix) and pod.endswith(suffix) and len(pod) > len(prefix) + len(suffix):
        node = pod[len(prefix) : -len(suffix)]
    if not node:
        task_name = ctx.task_id.name if ctx.task_id is not None else ""
        node = task_name.rsplit(".", 1)[-1] or "local"
    return {"execution": execution, "node": node, "attempt": attempt}


def _require_prepared_data(data_dir: str) -> None:
    import fsspec

    from training_core.data import MANIFEST_NAME

    fs, root = fsspec.core.url_to_fs(data_dir)
    if not fs.exists(f"{root.rstrip('/')}/{MANIFEST_NAME}"):
        raise ValueError(
            f"data.directory={redact(data_dir)!r} has no {MANIFEST_NAME}: the prepared data is gone (a cached "
            "prepare_data output whose files were deleted, e.g. a cleaned /tmp). Run `pyflyte local-cache clear` and "
            "re-run."
        )


@dataclasses.dataclass
class RunLocation:
    """Where one train node keeps its checkpoints, the same for every attempt of that node."""

    storage_path: str
    run_name: str
    mlflow_run_id: str = ""


def _run_location(config: TrainingConfig, data_dir: str) -> RunLocation:
    """The previous attempt's location if Flyte hands us one, else a fresh stable one.

    The run name is the execution id plus a digest of the config and data: every attempt of a node gets
    the same name, while fan-out siblings (other configs) get their own.
    """
    previous = _read_pointer()
    if previous is not None:
        logging.getLogger("training_core").warning(
            "retry: resuming in %s/%s", redact(previous.storage_path), previous.run_name
        )
        return previous
    ctx = current_context()
    digest = hashlib.sha256(json.dumps([config.to_dict(), data_dir], sort_keys=True).encode()).hexdigest()[:12]
    return RunLocation(
        storage_path=checkpoint_storage_path(config.checkpoint), run_name=f"train-{ctx.execution_id.name}-{digest}"
    )


def _read_pointer() -> RunLocation | None:
    record = read_attempt_record()
    return RunLocation(**record) if record else None


def _write_pointer(location: RunLocation) -> None:
    write_attempt_record(dataclasses.asdict(location))
