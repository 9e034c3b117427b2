"""``evaluate``: the workload's test-split metrics of the trained checkpoint, where the model fits: in the task's own
process (``evaluate``, on a GPU when the run asked for one), or on a RayJob whose workers hold the model as training
did (``evaluate_on_ray``: FSDP shards stay shards). ``workflows/training.py`` picks one from the config."""

from __future__ import annotations

from datetime import timedelta

from flytekit import Resources, current_context, task

from tasks.artifacts import DECK_FIELDS, artifact_location, checkpoint_storage_path, publish_report
from tasks.logs import show_task_logs
from tasks.ray_config import ray_job_config
from tasks.train import RAY_DRIVER_TASK_ARGS
from tasks.types import Evaluation, PreparedData, TrainedModel
from training_core.config import ScalingConfig, TrainingConfig

EVALUATE_TASK_ARGS = {
    "retries": 2,
    "interruptible": True,  # read-only on the checkpoint and the test split: safe to preempt and redo
    "timeout": timedelta(hours=2),
    "enable_deck": True,
    "deck_fields": DECK_FIELDS,
}


@task(requests=Resources(cpu="1", mem="2Gi"), limits=Resources(cpu="2", mem="8Gi"), **EVALUATE_TASK_ARGS)
def evaluate(data: PreparedData, model: TrainedModel) -> Evaluation:
    """Evaluate the final checkpoint on the held-out test split, in this task's process (on its GPU when it has
    one), and log the figures to its MLflow run.

    :param data: Prepared shards; the ``test`` split is used.
    :param model: The trained model from ``train``.
    :return: Test loss and the workload's metrics (top-1/top-5 accuracy and the confusion matrix for images,
        perplexity, token accuracy and greedy continuations for language models) and the evaluation report.
    """
    from training_core.evaluation import evaluate_checkpoint

    show_task_logs()
    # The test split's shards are read where prep stored them (s3:// on a cluster, through the bounded shard cache),
    # not downloaded with every other split.
    result = evaluate_checkpoint(model.checkpoint.download(), artifact_location(data.directory), split="test")
    return publish_evaluation(model, result)


@task(task_config=ray_job_config(ScalingConfig()), **{**RAY_DRIVER_TASK_ARGS, **EVALUATE_TASK_ARGS})
def evaluate_on_ray(config: TrainingConfig, data: PreparedData, model: TrainedModel) -> Evaluation:
    """Evaluate the final checkpoint on the held-out test split on ``config.scaling.num_workers`` Ray Train workers
    holding the model as training did (under FSDP each loads only its shards: no process gathers the model), and
    log the figures to its MLflow run. The RayJob follows ``config.scaling`` (``with_overrides`` in the workflow).

    :param config: The run's config: ``scaling`` places and sizes the workers.
    :param data: Prepared shards; the ``test`` split is used, each worker reading its own shards.
    :param model: The trained model from ``train``; its checkpoint is read where it is stored.
    :return: The same metrics and report as ``evaluate``.
    """
    from training_core.evaluation import evaluate_on_cluster

    show_task_logs()
    ctx = current_context()
    result = evaluate_on_cluster(
        artifact_location(model.checkpoint),
        artifact_location(data.directory),
        config,
        storage_path=checkpoint_storage_path(config.checkpoint),
        run_name=f"evaluate-{ctx.execution_id.name or 'local'}-{model.mlflow_run_id[:12]}",
    )
    return publish_evaluation(model, result)


def publish_evaluation(model: TrainedModel, result) -> Evaluation:
    """Log an ``EvalReport``'s figures to the model's MLflow run and publish the evaluation report (a Deck)."""
    from tasks import reports
    from training_core import tracking
    from training_core.checkpoint import load_meta

    tracking.log_metrics(
        model.tracking_uri,
        model.mlflow_run_id,
        {f"test_{name}": value for name, value in result.metrics.items()},
    )
    # The run's epoch records (for the validation curve), from the checkpoint's metadata alone.
    history = load_meta(artifact_location(model.checkpoint)).history
    report = publish_report("Evaluation report", reports.evaluation_sections(result, history=history))
    return Evaluation(metrics=result, report=report)
