"""MLflow tracking: runs, metrics, the trained model logged with its signature, and the Model Registry
promotion gate."""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from training_core.config import TrackingConfig
from training_core.redact import redact

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from training_core.records import MlflowRun


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
    uri, client, experiment_id = _experiment(cfg)
    run = client.create_run(experiment_id, run_name=run_name, tags=redact(tags or {}))
    return uri, run.info.run_id


def _client(tracking_uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def _experiment(cfg: TrackingConfig) -> tuple[str, Any, str]:
    """The resolved tracking URI, a client of it, and the id of ``cfg.experiment_name`` (created if missing)."""
    uri = resolve_tracking_uri(cfg.tracking_uri)
    client = _client(uri)
    experiment = client.get_experiment_by_name(cfg.experiment_name)
    return uri, client, experiment.experiment_id if experiment else client.create_experiment(cfg.experiment_name)


def find_or_create_run(
    cfg: TrackingConfig, *, key: str, run_name: str, params: dict[str, object], payload: dict
) -> tuple[str, str]:
    """The run tagged ``search.key=key`` in ``cfg.experiment_name`` (set RUNNING again), or a new one with
    ``params`` and ``payload`` (as ``config.json``), both recorded redacted. A re-run of the same search lands
    in the same parent run, so its cached trials (children of that run) keep their place."""
    uri, client, experiment_id = _experiment(cfg)
    found = client.search_runs([experiment_id], filter_string=f"tags.`search.key` = '{key}'", max_results=1)
    if found:
        client.update_run(found[0].info.run_id, status="RUNNING")
        return uri, found[0].info.run_id
    run = client.create_run(experiment_id, run_name=run_name, tags={"search.key": key})
    for name, value in params.items():
        client.log_param(run.info.run_id, redact(name), redact(str(value)))
    client.log_dict(run.info.run_id, redact(payload), "config.json")
    return uri, run.info.run_id


def resume_or_create_run(
    cfg: TrackingConfig, *, run_id: str, run_name: str, tags: dict[str, str] | None = None
) -> tuple[str, str]:
    """Reopen ``run_id`` when there is one (a retry, a trial's later slice), so it logs into the same run; else
    create a run named ``run_name`` with ``tags`` (they apply to a new run only). Returns ``(tracking_uri, run_id)``."""
    if not run_id:
        return create_run(cfg, run_name=run_name, tags=tags)
    uri = resolve_tracking_uri(cfg.tracking_uri)
    _client(uri).update_run(run_id, status="RUNNING")
    return uri, run_id


def finish_run(tracking_uri: str, run_id: str, *, status: str = "FINISHED") -> None:
    _client(tracking_uri).set_terminated(run_id, status=status)


def log_metrics(tracking_uri: str, run_id: str, metrics: dict[str, float], *, step: int = 0) -> None:
    from training_core.metrics import MlflowSink

    MlflowSink(tracking_uri=tracking_uri, run_id=run_id).log_metrics(metrics, step=step)


def last_metric(tracking_uri: str, run_id: str, key: str) -> float | None:
    """The value of metric ``key`` the run logged at its latest step (the last validation, for ``val_<name>``: the
    loop logs every metric the workload reports so), or ``None`` when it logged none."""
    history = _client(tracking_uri).get_metric_history(run_id, key)
    if not history:
        return None
    return float(max(history, key=lambda m: (m.step, m.timestamp)).value)


@dataclass
class Promotion:
    model_name: str
    version: int
    alias: str
    promoted: bool
    """Whether ``alias`` now points at ``version``."""
    reason: str
    metric: str
    """The workload's primary metric on the test split (``test_accuracy``, ``test_perplexity``...)."""
    mode: str
    """``max`` or ``min``: which way it improves."""
    test_value: float
    previous_champion_version: int
    """Version the alias pointed at before; 0 when there was none."""
    previous_champion_value: Optional[float]
    """Its value of ``metric``; None when there was none or it was not recorded (never NaN: Flyte's and the CLI's
    JSON cannot carry it)."""


def register_and_promote(
    cfg: TrackingConfig, *, model_uri: str, run_id: str, metric: str, value: float, mode: str
) -> Promotion:
    """Register ``model_uri`` as a new version tagged with its test ``metric`` ``value``; move
    ``cfg.champion_alias`` to it only if the value clears ``cfg.promotion_threshold`` (at least it when ``mode`` is
    ``max``, at most it when ``min``) and beats the current champion's value of the same metric."""
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = resolve_tracking_uri(cfg.tracking_uri)
    mlflow.set_tracking_uri(uri)
    client = _client(uri)
    name, alias, threshold = cfg.registered_model_name, cfg.champion_alias, cfg.promotion_threshold
    version = mlflow.register_model(model_uri, name, tags={metric: repr(value), "mlflow_run_id": run_id})
    try:
        champion = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        champion = None
    previous_version = int(champion.version) if champion else 0
    previous_value = float(champion.tags.get(metric, "nan")) if champion else math.nan
    bound = "at least" if mode == "max" else "at most"
    clears = value >= threshold if mode == "max" else value <= threshold
    beats = math.isnan(previous_value) or (value > previous_value if mode == "max" else value < previous_value)
    if not clears:
        reason = (
            f"{metric} {value:.4f} is not {bound} tracking.promotion_threshold={threshold}; {alias!r} stays on "
            + (f"version {previous_version}" if champion else "no version")
        )
    elif not beats:
        reason = (
            f"{metric} {value:.4f} does not beat {alias!r} version {previous_version} ({previous_value:.4f}); the "
            "alias stays there"
        )
    else:
        client.set_registered_model_alias(name, alias, version.version)
        if champion is None:
            against = "there was no champion yet"
        elif math.isnan(previous_value):
            against = f"version {previous_version} recorded no {metric}"
        else:
            against = f"beats version {previous_version} ({previous_value:.4f})"
        reason = f"{metric} {value:.4f} is {bound} {threshold} and " + against
    return Promotion(
        model_name=name,
        version=int(version.version),
        alias=alias,
        promoted=clears and beats,
        reason=reason,
        metric=metric,
        mode=mode,
        test_value=value,
        previous_champion_version=previous_version,
        previous_champion_value=None if math.isnan(previous_value) else previous_value,
    )


def log_model(
    model: nn.Module,
    example: np.ndarray,
    run: MlflowRun,
    *,
    dynamic_axes: tuple[int, ...] = (0,),
    extra_files: Mapping[str, bytes] | None = None,
) -> str:
    """Log the trained model with the signature of ``example`` (a small input batch) and its output; returns its
    ``models:/`` URI. MLflow saves it as a ``torch.export`` program (no pickled code); ``dynamic_axes`` of the input
    and the output are left free in the signature, and so in the exported program (the batch; a language model's
    sequence length too, so the loaded model scores and generates at any length up to its context). ``extra_files``
    (file name -> bytes: a text classifier's tokenizer and classes) are saved in the model's ``extra_files/``. A
    model with LoRA adapters is logged merged (:func:`~training_core.train.lora.merge_adapters`)."""
    import copy
    import sys
    import tempfile

    import mlflow
    import numpy as np
    import torch
    import torchvision
    from mlflow.models import infer_signature

    from training_core.train.lora import merge_adapters

    # LoRA's adapters are merged into their layers: the registered model loads and predicts without peft.
    bare = merge_adapters(copy.deepcopy(getattr(model, "module", model))).cpu().eval()
    with torch.no_grad():
        output = bare(torch.from_numpy(np.ascontiguousarray(example))).numpy()
    mlflow.set_tracking_uri(run.tracking_uri)
    # Pinned requirements: skips MLflow's slow dependency inference, which imports the model in a subprocess. A
    # Hugging Face model pickles as its transformers classes.
    pinned = (torch, torchvision, sys.modules.get("transformers"))
    requirements = [f"{module.__name__}=={module.__version__.split('+')[0]}" for module in pinned if module]
    # The driver that created the run owns its final status; re-entering it here only attaches the model.
    with mlflow.start_run(run_id=run.run_id), tempfile.TemporaryDirectory(prefix="model-files-") as files_dir:
        for name, payload in (extra_files or {}).items():
            with open(os.path.join(files_dir, name), "wb") as f:
                f.write(payload)
        info = mlflow.pytorch.log_model(
            bare,
            name="model",
            signature=_free_axes(infer_signature(example, output), dynamic_axes),
            input_example=example,
            pip_requirements=requirements,
            extra_files=[os.path.join(files_dir, name) for name in extra_files or {}] or None,
        )
    return info.model_uri


def _free_axes(signature, axes: tuple[int, ...]):
    """``signature`` with ``axes`` of every input and output tensor made variable (-1)."""
    from mlflow.types.schema import Schema, TensorSpec

    def free(spec: TensorSpec) -> TensorSpec:
        return TensorSpec(spec.type, tuple(-1 if axis in axes else n for axis, n in enumerate(spec.shape)), spec.name)

    schemas = (signature.inputs, signature.outputs)
    signature.inputs, signature.outputs = (Schema([free(spec) for spec in schema.inputs]) for schema in schemas)
    return signature
