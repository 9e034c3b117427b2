"""``register_model``: register the model in MLflow and move the champion alias behind a gate."""

from __future__ import annotations

from datetime import timedelta

from flytekit import Resources, task

from tasks.artifacts import artifact_location, local_deck_path
from tasks.logs import show_task_logs
from tasks.types import Evaluation, Registration, TrainedModel
from training_core.config import TrackingConfig
from training_core.redact import redact


# Not interruptible: it writes to the Model Registry (a new version, maybe an alias move), and a preemption
# between the two would leave a version registered twice on the retry.
@task(
    retries=3,
    interruptible=False,
    timeout=timedelta(minutes=30),
    requests=Resources(cpu="500m", mem="1Gi"),
    limits=Resources(cpu="1", mem="2Gi"),
)
def register_model(tracking: TrackingConfig, model: TrainedModel, evaluation: Evaluation) -> Registration:
    """Register the trained model as a new version; move the champion alias to it only if the workload's primary
    test metric (accuracy, perplexity...) clears ``tracking.promotion_threshold`` in the metric's direction and
    beats the current champion's.

    :param tracking: Registry name, alias and the promotion threshold.
    :param model: The trained model; its MLflow model URI is registered.
    :param evaluation: Test metrics; the workload's primary metric decides the promotion.
    :return: The new version, whether the alias moved, and why.
    """
    from training_core.evaluation import require_finite
    from training_core.tracking import register_and_promote, ui_command

    show_task_logs()
    test, train = evaluation.metrics, model.metrics
    require_finite(
        {
            **{f"test_{name}": value for name, value in test.metrics.items()},
            "train_loss": train.train_loss,
            "val_loss": train.val_loss,
        },
        what=f"model {model.mlflow_model_uri} of MLflow run {model.mlflow_run_id}",
        fix="a diverged model is not registered; retrain with a lower optimizer.lr or with optimizer.max_grad_norm set",
    )
    promotion = register_and_promote(
        tracking,
        model_uri=model.mlflow_model_uri,
        run_id=model.mlflow_run_id,
        metric=f"test_{test.primary_metric}",
        value=test.primary,
        mode=test.primary_mode,
    )
    reports = [artifact_location(model.report), artifact_location(evaluation.report)]
    # Only Decks that exist are listed: on a cluster (each task in its own pod) FlyteConsole shows them.
    decks = [
        (label, local_deck_path(report))
        for label, report in (("training", model.report), ("evaluation", evaluation.report))
    ]
    # pyflyte prints outputs as literals, and no Deck path at all; a person wants these facts in plain words.
    print(
        "\n".join(
            [
                "",
                "=== training pipeline finished ===",
                f"registered model : {promotion.model_name} version {promotion.version}"
                + (
                    f" (alias '{promotion.alias}' -> v{promotion.version})"
                    if promotion.promoted
                    else f" (alias '{promotion.alias}' unchanged)"
                ),
                f"promotion        : {promotion.reason}",
                "test metrics     : " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(test.metrics.items())),
                f"goodput          : {model.goodput.goodput:.1%} of the worker-seconds productive over "
                f"{model.goodput.attempts} attempt(s) ({model.goodput.startup_s:.0f} s start-up, "
                f"{model.goodput.recomputed_s:.0f} s recomputed)",
                f"mlflow tracking  : {redact(model.tracking_uri)}",
                f"browse with      : {ui_command(model.tracking_uri)}",
                f"training report  : {reports[0]}",
                f"evaluation report: {reports[1]}",
                *[f"{label + ' deck':<17}: {path}" for label, path in decks if path],
                "",
            ]
        ),
        flush=True,
    )
    return Registration(promotion=promotion, tracking_uri=model.tracking_uri, reports=[str(r) for r in reports])
