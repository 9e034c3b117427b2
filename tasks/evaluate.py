"""``evaluate``: test-split loss, top-1/top-5 and confusion matrix of the trained checkpoint."""

from __future__ import annotations

from datetime import timedelta

from flytekit import Resources, task

from tasks.artifacts import publish_report
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
    :return: Test loss, top-1 and top-5 accuracy, the confusion matrix and the evaluation report.
    """
    from tasks import reports
    from training_core import tracking
    from training_core.evaluation import evaluate_checkpoint

    result = evaluate_checkpoint(model.checkpoint.download(), data.directory.download(), split="test")
    tracking.log_metrics(
        model.tracking_uri,
        model.mlflow_run_id,
        {"test_loss": result.loss, "test_accuracy": result.accuracy, "test_top5_accuracy": result.top5_accuracy},
    )
    report = publish_report("Evaluation report", reports.evaluation_sections(result))
    return Evaluation(metrics=result, report=report)
