"""MLflow tracking: runs, metrics, the trained model logged with its signature, and the Model Registry
promotion gate."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING

from training_core.config import TrackingConfig
from training_core.redact import redact

if TYPE_CHECKING:
    from torch import nn

    from training_core.data import Manifest
    from training_core.records import MlflowRun

TEST_ACCURACY_TAG = "test_accuracy"


def resolve_tracking_uri(uri: str) -> str:
    """Make a relative sqlite or file-store URI absolute, so Ray workers (other cwd) reach the same store."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///") :])
    if "://" not in uri:
        return os.path.abspath(uri)
    return uri


def ui_command(tracking_uri: str) -> str:
    """The command that browses ``tracking_uri``, for a person to read in a log: credentials in the URI are
    redacted (the reader supplies their own)."""
    return f"mlflow ui --backend-store-uri {shlex.quote(redact(tracking_uri))} --host 127.0.0.1 --port 5000"


def create_run(cfg: TrackingConfig, *, run_name: str, tags: dict[str, str] | None = None) -> tuple[str, str]:
    """Create a run in ``cfg.experiment_name`` (created if missing); returns ``(tracking_uri, run_id)``. The tags
    are recorded redacted."""
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(cfg.tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(cfg.experiment_name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(cfg.experiment_name)
    run = client.create_run(experiment_id, run_name=run_name, tags=redact(tags or {}))
    return uri, run.info.run_id


def find_or_create_run(
    cfg: TrackingConfig, *, key: str, run_name: str, params: dict[str, object], payload: dict
) -> tuple[str, str]:
    """The run tagged ``search.key=key`` in ``cfg.experiment_name`` (set RUNNING again), or a new one with
    ``params`` and ``payload`` (as ``config.json``), both recorded redacted. A re-run of the same search lands
    in the same parent run, so its cached trials (children of that run) keep their place."""
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(cfg.tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(cfg.experiment_name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(cfg.experiment_name)
    found = client.search_runs([experiment_id], filter_string=f"tags.`search.key` = '{key}'", max_results=1)
    if found:
        client.update_run(found[0].info.run_id, status="RUNNING")
        return uri, found[0].info.run_id
    run = client.create_run(experiment_id, run_name=run_name, tags={"search.key": key})
    for name, value in params.items():
        client.log_param(run.info.run_id, redact(name), redact(str(value)))
    client.log_dict(run.info.run_id, redact(payload), "config.json")
    return uri, run.info.run_id


def resume_run(cfg: TrackingConfig, run_id: str) -> tuple[str, str]:
    """Reopen a run a failed attempt left behind, so a retry logs into the same run."""
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(cfg.tracking_uri)
    MlflowClient(tracking_uri=uri).update_run(run_id, status="RUNNING")
    return uri, run_id


def resume_or_create_run(
    cfg: TrackingConfig, *, run_id: str, run_name: str, tags: dict[str, str] | None = None
) -> tuple[str, str]:
    """Reopen ``run_id`` when there is one (a retry, a trial's later slice), else create a run named
    ``run_name`` with ``tags`` (they apply to a new run only); returns ``(tracking_uri, run_id)``."""
    if run_id:
        return resume_run(cfg, run_id)
    return create_run(cfg, run_name=run_name, tags=tags)


def finish_run(tracking_uri: str, run_id: str, *, status: str = "FINISHED") -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=tracking_uri).set_terminated(run_id, status=status)


def log_metrics(tracking_uri: str, run_id: str, metrics: dict[str, float], *, step: int = 0) -> None:
    from training_core.metrics import MlflowSink

    MlflowSink(tracking_uri=tracking_uri, run_id=run_id).log_metrics(metrics, step=step)


@dataclass
class Promotion:
    model_name: str
    version: int
    alias: str
    promoted: bool
    """Whether ``alias`` now points at ``version``."""
    reason: str
    test_accuracy: float
    previous_champion_version: int
    """Version the alias pointed at before; 0 when there was none."""
    previous_champion_accuracy: float
    """Its test accuracy; -1 when there was none."""


def register_and_promote(cfg: TrackingConfig, *, model_uri: str, run_id: str, test_accuracy: float) -> Promotion:
    """Register ``model_uri`` as a new version; move ``cfg.champion_alias`` to it only if its test accuracy
    clears ``cfg.promotion_min_accuracy`` and beats the current champion's."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(cfg.tracking_uri)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    name, alias = cfg.registered_model_name, cfg.champion_alias
    version = mlflow.register_model(
        model_uri, name, tags={TEST_ACCURACY_TAG: repr(test_accuracy), "mlflow_run_id": run_id}
    )
    try:
        champion = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        champion = None
    previous_version = int(champion.version) if champion else 0
    previous_accuracy = float(champion.tags.get(TEST_ACCURACY_TAG, "-1")) if champion else -1.0

    if test_accuracy < cfg.promotion_min_accuracy:
        promoted = False
        reason = (
            f"test accuracy {test_accuracy:.4f} is below tracking.promotion_min_accuracy={cfg.promotion_min_accuracy}; "
            f"{alias!r} stays on " + (f"version {previous_version}" if champion else "no version")
        )
    elif champion is not None and not test_accuracy > previous_accuracy:
        promoted = False
        reason = (
            f"test accuracy {test_accuracy:.4f} does not beat {alias!r} version {previous_version} "
            f"({previous_accuracy:.4f}); the alias stays there"
        )
    else:
        promoted = True
        client.set_registered_model_alias(name, alias, version.version)
        reason = f"test accuracy {test_accuracy:.4f} clears {cfg.promotion_min_accuracy} and " + (
            f"beats version {previous_version} ({previous_accuracy:.4f})" if champion else "there was no champion yet"
        )
    return Promotion(
        model_name=name,
        version=int(version.version),
        alias=alias,
        promoted=promoted,
        reason=reason,
        test_accuracy=test_accuracy,
        previous_champion_version=previous_version,
        previous_champion_accuracy=previous_accuracy,
    )


def log_model(model: nn.Module, manifest: Manifest, run: MlflowRun) -> str:
    """Log the trained model with its input/output signature; returns its ``models:/`` URI."""
    import copy

    import mlflow
    import numpy as np
    import torch
    import torchvision
    from mlflow.models import infer_signature

    bare = copy.deepcopy(getattr(model, "module", model)).cpu().eval()
    example = np.zeros((2, *manifest.input_shape), dtype=np.float32)
    with torch.no_grad():
        output = bare(torch.from_numpy(example)).numpy()
    mlflow.set_tracking_uri(run.tracking_uri)
    # Pinned requirements: skips MLflow's slow dependency inference, which imports the model in a subprocess.
    requirements = [
        f"torch=={torch.__version__.split('+')[0]}",
        f"torchvision=={torchvision.__version__.split('+')[0]}",
    ]
    # The driver that created the run owns its final status; re-entering it here only attaches the model.
    with mlflow.start_run(run_id=run.run_id):
        info = mlflow.pytorch.log_model(
            bare,
            name="model",
            signature=infer_signature(example, output),
            input_example=example,
            pip_requirements=requirements,
        )
    return info.model_uri
