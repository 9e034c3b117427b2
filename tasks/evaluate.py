"""``evaluate``: the workload's test-split metrics of the trained checkpoint."""

from __future__ import annotations

from datetime import timedelta

from flytekit import Resources, task

from tasks.artifacts import artifact_location, publish_report
from tasks.types import Evaluation, PreparedData, TrainedModel


# Read-only on the checkpoint and the test split: safe to preempt and redo.
@task(
    retries=2,
    interruptible=True,
    timeout=timedelta(hours=2),
    requests=Resources(cpu="1", mem="2Gi"),
    limits=Resources(cpu="2", mem="8Gi"),
    enable_deck=True,
)
def evaluate(data: PreparedData, model: TrainedModel) -> Evaluation:
    """Evaluate the final checkpoint on the held-out test split and log the figures to its MLflow run.

    :param data: Prepared shards; the ``test`` split is used.
    :param model: The trained model from ``train``.
    :return: Test loss and the workload's metrics (top-1/top-5 accuracy and the confusion matrix for images,
        perplexity, token accuracy and greedy continuations for language models) and the evaluation report.
    """
    from tasks import reports
    from training_core import tracking
    from training_core.evaluation import evaluate_checkpoint

    # The test split's shards are read where prep stored them (s3:// on a cluster, through the bounded shard cache),
    # not downloaded with every other split.
    result = evaluate_checkpoint(model.checkpoint.download(), artifact_location(data.directory), split="test")
    tracking.log_metrics(
        model.tracking_uri,
        model.mlflow_run_id,
        {f"test_{name}": value for name, value in result.metrics.items()},
    )
    history = _validation_history(model)
    report = publish_report("Evaluation report", reports.evaluation_sections(result, history=history))
    return Evaluation(metrics=result, report=report)


def _validation_history(model: TrainedModel) -> list:
    """The run's epoch records (for the validation curve), from the checkpoint's metadata."""
    from training_core.checkpoint import load_meta

    return load_meta(model.checkpoint.download()).history
