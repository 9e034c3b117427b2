"""The ``ray_tune`` strategy: one Ray Tune ``Tuner`` on one RayCluster runs the whole search.

Each Tune trial is a driver function that trains its config with :func:`training_core.runners.ray_train.fit` (Ray
Train, DDP) in slices, reporting the metric after each slice together with a small Tune checkpoint that
points at the training checkpoint. That is all ASHA (stop after any slice), PBT (restore a trial from
another's pointer, with perturbed hyperparameters) and OptunaSearch need, and it reuses the same exact
slice-resume as the Flyte strategy. Slices are one epoch for ASHA, ``pbt.interval_epochs`` for PBT, and
the whole budget otherwise; each slice costs one Ray Train start (seconds).
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

from training_core.parallel.ray_settings import start_local_cluster
from training_core.redact import install_log_redaction, redact
from training_core.tuning import ParamSpec, TuningConfig, apply_params, format_param

POINTER_FILE = "pointer.json"


@dataclass
class TrialOutcome:
    """One Tune trial, in the shape the Flyte strategy records."""

    trial_id: int
    params: dict[str, str]
    scores: list[float]
    score_epochs: list[int]
    epochs_trained: int
    epochs_used: int
    checkpoint_uri: str
    """The trial's last training checkpoint (a ``step-...`` directory)."""
    mlflow_run_id: str
    status: str
    """``done`` (trained to the full budget) or ``stopped`` (stopped early by the scheduler)."""
    error: str = ""


def _key(path: str) -> str:
    # Tune flattens nested config keys with "/"; dotted paths become flat keys without separators.
    return path.replace(".", "__")


def _sampler(spec: ParamSpec) -> Any:
    """Ray Tune's sampler of ``spec``'s values."""
    from ray import tune

    if spec.kind == "choice":
        return tune.choice(list(spec.choices))
    if spec.kind == "log_uniform":
        return tune.loguniform(spec.low, spec.high)
    if spec.kind == "uniform":
        return tune.uniform(spec.low, spec.high)
    return tune.randint(int(spec.low), int(spec.high) + 1)


def _params(space: list[ParamSpec], tune_config: dict[str, Any]) -> dict[str, str]:
    return {spec.path: format_param(tune_config[_key(spec.path)], spec) for spec in space}


def _trial_driver(tune_config: dict[str, Any]) -> None:
    """A Tune trial: train in slices, report the metric and a pointer checkpoint after each."""
    from ray import tune

    install_log_redaction()  # the trial runs in a Ray worker process, with Ray's logging

    from training_core import tracking
    from training_core.records import MlflowRun
    from training_core.runners.ray_train import fit

    cfg = TuningConfig.from_dict(tune_config["tuning"])
    trial_cfg = apply_params(cfg.base, _params(cfg.search_space, tune_config))
    trial_id = tune.get_context().get_trial_id()
    resume_from, epoch, run_id = _restored_pointer(tune.get_checkpoint(), trial_id)
    log_params = not run_id
    tracking_uri, run_id = tracking.resume_or_create_run(
        trial_cfg.tracking,
        run_id=run_id,
        run_name=f"tune-{trial_id}",
        tags={"mlflow.parentRunId": tune_config["parent_run_id"], "tune.trial_id": trial_id},
    )
    step = {"asha": 1, "pbt": cfg.pbt.interval_epochs}.get(cfg.algorithm, cfg.base.loop.epochs)
    # Unique per driver start: a PBT copy may retrain epochs this trial already trained before the copy.
    attempt = uuid.uuid4().hex[:8]
    while epoch < trial_cfg.loop.epochs:
        stop = min(trial_cfg.loop.epochs, epoch + step)
        slice_cfg = apply_params(trial_cfg, {"loop.stop_at_epoch": str(stop)})
        with tempfile.TemporaryDirectory() as local:
            result = fit(
                slice_cfg,
                data_dir=tune_config["data_dir"],
                checkpoint_dir=os.path.join(local, "final"),
                run_name=f"{tune_config['run_name']}-{trial_id}-{attempt}-e{stop}",
                storage_path=tune_config["storage_path"],
                mlflow_run=MlflowRun(tracking_uri=tracking_uri, run_id=run_id),
                resume_from=resume_from,
                log_params=log_params,
            )
        log_params, resume_from, trained, epoch = False, result.checkpoint_uri, stop - epoch, stop
        metrics = {
            cfg.metric: result.metrics.metric(cfg.metric),
            "epoch": epoch,
            "slice_epochs": trained,
            "checkpoint_uri": result.checkpoint_uri,
            "mlflow_run_id": run_id,
        }
        pointer = {"uri": result.checkpoint_uri, "epoch": epoch, "mlflow_run_id": run_id, "tune_trial_id": trial_id}
        _report_slice(metrics, pointer)
    tracking.finish_run(tracking_uri, run_id)


def _restored_pointer(restored: Any, trial_id: str) -> tuple[str | None, int, str]:
    """``(resume_from, epoch, mlflow run id)`` of the Tune checkpoint a trial starts from; ``(None, 0, "")`` without
    one."""
    if restored is None:
        return None, 0, ""
    with restored.as_directory() as directory, open(os.path.join(directory, POINTER_FILE), encoding="utf-8") as f:
        pointer = json.load(f)
    # Tune restores a trial from its own checkpoint after a failure, or from another's (PBT exploit):
    # only the former continues the trial's MLflow run; a copy with new hyperparameters gets a new one.
    return pointer["uri"], pointer["epoch"], pointer["mlflow_run_id"] if pointer["tune_trial_id"] == trial_id else ""


def _report_slice(metrics: dict[str, Any], pointer: dict[str, Any]) -> None:
    """A slice's metrics to Tune, with a Tune checkpoint holding ``pointer`` (its training checkpoint)."""
    from ray import tune

    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, POINTER_FILE), "w", encoding="utf-8") as f:
            json.dump(pointer, f)
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))


def run_search(
    cfg: TuningConfig, *, data_dir: str, storage_path: str, run_name: str, parent_run_id: str
) -> list[TrialOutcome]:
    """Run the whole search with Ray Tune on the connected Ray cluster; one outcome per trial. A trial's error is
    its exception's repr with URL credentials redacted: the outcome is a record, shown, never used to connect."""
    import ray
    from ray import tune

    install_log_redaction()

    if not ray.is_initialized():
        start_local_cluster()  # as the product's Ray task starts a local one
    param_space = {
        **{_key(spec.path): _sampler(spec) for spec in cfg.search_space},
        "tuning": cfg.to_dict(),
        "data_dir": data_dir,
        "storage_path": storage_path,
        "run_name": run_name,
        "parent_run_id": parent_run_id,
    }
    tuner = tune.Tuner(
        # The driver only coordinates: its Ray Train workers hold the CPUs (and GPUs) of the trial.
        tune.with_resources(_trial_driver, {"CPU": 0.001}),
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=cfg.metric,
            mode=cfg.mode,
            num_samples=cfg.num_trials,
            scheduler=_scheduler(cfg),
            search_alg=_search_algorithm(cfg),
            max_concurrent_trials=cfg.max_concurrency,
        ),
        run_config=tune.RunConfig(
            name=run_name, storage_path=storage_path, failure_config=tune.FailureConfig(max_failures=1)
        ),
    )
    return [_outcome(index, result, cfg) for index, result in enumerate(tuner.fit())]


def _scheduler(cfg: TuningConfig) -> Any:
    """Ray Tune's trial scheduler for ``cfg.algorithm``: ASHA, PBT, or None (FIFO)."""
    if cfg.algorithm == "asha":
        from ray.tune.schedulers import ASHAScheduler

        return ASHAScheduler(
            time_attr="epoch",
            max_t=cfg.base.loop.epochs,
            grace_period=cfg.asha.min_epochs,
            reduction_factor=cfg.asha.eta,
        )
    if cfg.algorithm == "pbt":
        from ray.tune.schedulers import PopulationBasedTraining

        factors = sorted(cfg.pbt.perturbation_factors)
        return PopulationBasedTraining(
            time_attr="epoch",
            perturbation_interval=cfg.pbt.interval_epochs,
            hyperparam_mutations={_key(s.path): _sampler(s) for s in cfg.search_space if s.numeric},
            quantile_fraction=cfg.pbt.quantile,
            resample_probability=cfg.pbt.resample_probability,
            perturbation_factors=(factors[-1], factors[0]),
        )
    return None


def _search_algorithm(cfg: TuningConfig) -> Any:
    """Ray Tune's search algorithm: OptunaSearch (``bayesian``), else random sampling; at most
    ``max_concurrency`` trials at once."""
    if cfg.algorithm == "bayesian":
        from ray.tune.search import ConcurrencyLimiter
        from ray.tune.search.optuna import OptunaSearch

        return ConcurrencyLimiter(OptunaSearch(seed=cfg.seed), max_concurrent=cfg.max_concurrency)
    from ray.tune.search import BasicVariantGenerator

    return BasicVariantGenerator(random_state=cfg.seed, max_concurrent=cfg.max_concurrency)


def _outcome(index: int, result: Any, cfg: TuningConfig) -> TrialOutcome:
    """Trial ``index``'s outcome from its Ray Tune result: the metric after each slice, the last slice's pointer."""
    frame = result.metrics_dataframe
    rows = [] if frame is None or frame.empty else frame.to_dict("records")
    last = rows[-1] if rows else {}
    epochs_trained = int(last.get("epoch", 0))
    return TrialOutcome(
        trial_id=index,
        params=_params(cfg.search_space, result.config),
        scores=[float(r[cfg.metric]) for r in rows],
        score_epochs=[int(r["epoch"]) for r in rows],
        epochs_trained=epochs_trained,
        epochs_used=int(sum(r["slice_epochs"] for r in rows)),
        checkpoint_uri=str(last.get("checkpoint_uri", "")),
        mlflow_run_id=str(last.get("mlflow_run_id", "")),
        status="done" if epochs_trained >= cfg.base.loop.epochs else "stopped",
        error=redact(repr(result.error)) if result.error else "",
    )
