"""Tuning tasks: the cached trial task and the bookkeeping between rounds of a search.

A search is a chain of rounds (``workflows/tuning.py``). Each round trains some trials, each a cached
``train_trial`` node, and ``record_round`` turns their results into the next round's plan with the
decisions of :mod:`training_core.tuning` (successive halving, PBT's exploit/explore, TPE suggestions).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import pandas as pd
from flytekit import Resources, task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from tasks import reports
from tasks.artifacts import DECK_FIELDS, artifact_location, checkpoint_storage_path, publish_report
from tasks.ray_config import ray_job_config
from tasks.train import RAY_DRIVER_TASK_ARGS, TRAIN_TASK_ARGS, run_training, trained_model
from tasks.types import PreparedData, TrainedModel
from training_core import tuning
from training_core.config import TrainingConfig
from training_core.redact import redact
from training_core.tuning import TuningConfig

# Bump when a change to training makes earlier trial results wrong to reuse.
TRIAL_CACHE_VERSION = "1"


@task(
    task_config=ray_job_config(tuning.default_base().scaling),
    cache=True,
    cache_version=TRIAL_CACHE_VERSION,
    **TRAIN_TASK_ARGS,
)
def train_trial(
    config: TrainingConfig, data: PreparedData, resume_from: Optional[FlyteDirectory] = None
) -> TrainedModel:
    """One slice of one trial: ``train`` with caching, so a re-run of a search reuses finished slices.

    The RayJob shape is set per node by the search (``with_overrides(task_config=...)``) from the trial's
    ``config.scaling``.
    """
    return run_training(config, data, resume_from)


@dataclass
class Trial:
    """One trial of a search and where it stands."""

    trial_id: int
    params: dict[str, str]
    """The searched fields' values (dotted path -> text)."""
    status: str = "pending"
    """``pending`` (trains in the next round), ``stopped`` (pruned by successive halving) or ``done``."""
    epochs_trained: int = 0
    """Epochs the trial's checkpoint holds (for a PBT copy: including those of the trial it copied)."""
    epochs_used: int = 0
    """Epochs this trial itself trained: its compute."""
    scores: list[float] = field(default_factory=list)
    """The search metric after each of the trial's slices."""
    score_epochs: list[int] = field(default_factory=list)
    """``epochs_trained`` at each score."""
    checkpoint: Optional[FlyteDirectory] = None
    """Checkpoint the next slice resumes from."""
    model: Optional[TrainedModel] = None
    """The last slice's output."""
    mlflow_run_id: str = ""
    """The trial's MLflow child run, continued by its later slices; empty after a PBT copy (a new run)."""
    lineage: list[int] = field(default_factory=list)
    """PBT: the trials whose checkpoints this one copied, in order."""


@dataclass
class SearchState:
    """Everything a search knows between two rounds."""

    round_index: int
    trials: list[Trial]
    tracking_uri: str
    parent_run_id: str
    """The search's MLflow run; every trial's run is its child."""
    pretrained_sha256: str = ""
    """The sha256 of ``base.model.pretrained``'s weights, computed by ``start_search`` (uncached): the trials'
    configs carry it, so the cached ``train_trial``'s key names the weights' content, not only their path."""


@dataclass
class TuningResult:
    """What a search found."""

    best_trial: int
    best_params: dict[str, str]
    best_config: TrainingConfig
    """``base`` with the best trial's params: train it again with ``training_pipeline``."""
    best_metric: float
    best_checkpoint: FlyteDirectory
    best_model: TrainedModel
    """The best trial's last slice: its checkpoint, metrics and MLflow model."""
    epochs_used: int
    """Epochs trained by all trials together (the search's compute)."""
    table: FlyteFile
    """The trial table as CSV."""
    report: FlyteFile
    """The tuning Deck as a standalone HTML page."""
    mlflow_parent_run_id: str


class TuningOutputs(NamedTuple):
    result: TuningResult
    trials: pd.DataFrame


@dataclass
class TrialSlice:
    """What one ``train_trial`` node of a round gets."""

    trial_id: int
    config: TrainingConfig
    resume_from: Optional[FlyteDirectory]


def plan_round(config: TuningConfig, state: SearchState) -> list[TrialSlice]:
    """The pending trials' configs for this round: the trial's params on ``base``, trained to the round's
    stop epoch, as a child run of the search (continuing the trial's own run after its first slice)."""
    stop = tuning.round_stop_epoch(config, state.round_index)
    slices = []
    for trial in state.trials:
        if trial.status != "pending":
            continue
        trial_config = tuning.apply_params(config.base, trial.params)
        model = trial_config.model
        if state.pretrained_sha256 and model.pretrained == config.base.model.pretrained:  # not a searched path
            model = dataclasses.replace(model, pretrained_sha256=state.pretrained_sha256)
        trial_config = dataclasses.replace(
            trial_config,
            model=model,
            loop=dataclasses.replace(trial_config.loop, stop_at_epoch=stop if stop < trial_config.loop.epochs else 0),
            tracking=dataclasses.replace(
                trial_config.tracking, parent_run_id=state.parent_run_id, run_id=trial.mlflow_run_id
            ),
        )
        slices.append(TrialSlice(trial.trial_id, trial_config, trial.checkpoint))
    return slices


@task(retries=2, requests=Resources(cpu="500m", mem="1Gi"))
def start_search(config: TuningConfig) -> SearchState:
    """Open (or, for a re-run of the same search, reopen) the search's MLflow parent run and draw the first
    round's trials."""
    from training_core import tracking
    from training_core.pretrained import pinned_sha256

    # Before the MLflow run opens: weights that cannot be read fail the search here, naming model.pretrained.
    pretrained_sha256 = pinned_sha256(config.base.model.pretrained, config.base.model.pretrained_sha256)
    key = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
    tracking_uri, parent_run_id = tracking.find_or_create_run(
        config.base.tracking,
        key=key,
        run_name=f"tuning-{config.algorithm}-{key[:8]}",
        params={
            "algorithm": config.algorithm,
            "strategy": config.strategy,
            "num_trials": config.num_trials,
            "metric": config.metric,
            "max_concurrency": config.max_concurrency,
            "seed": config.seed,
        },
        payload=config.to_dict(),
    )
    trials = [Trial(trial_id=i, params=params) for i, params in enumerate(tuning.initial_params(config))]
    return SearchState(
        round_index=0,
        trials=trials,
        tracking_uri=tracking_uri,
        parent_run_id=parent_run_id,
        pretrained_sha256=pretrained_sha256,
    )


@task(retries=2, requests=Resources(cpu="500m", mem="1Gi"))
def record_round(
    config: TuningConfig, state: SearchState, trial_ids: list[int], models: list[TrainedModel]
) -> SearchState:
    """Record a round's results and apply :func:`training_core.tuning.decide_round`'s decision for the next
    round: who continues (successive halving), who copies whom (PBT), which new points to try (Bayesian)."""
    by_id = {t.trial_id: t for t in state.trials}
    for trial_id, model in zip(trial_ids, models, strict=True):
        trial = by_id[trial_id]
        trial.epochs_used += model.metrics.epochs - trial.epochs_trained
        trial.epochs_trained = model.metrics.epochs
        trial.scores.append(trial_score(config, model))
        trial.score_epochs.append(model.metrics.epochs)
        trial.checkpoint, trial.model, trial.mlflow_run_id = model.checkpoint, model, model.mlflow_run_id
        trial.status = "done"
    decision = tuning.decide_round(
        config,
        round_index=state.round_index,
        trained=[_scored(by_id[i]) for i in trial_ids],
        finished=[_scored(t) for t in state.trials if t.scores],
    )
    for copy in decision.copies:
        _copy_trial(by_id[copy.trial_id], by_id[copy.source_trial_id], copy.params)
    for trial_id in decision.continuing:
        by_id[trial_id].status = "pending"
    for trial_id in decision.stopped:
        by_id[trial_id].status = "stopped"
    for params in decision.new_params:
        state.trials.append(Trial(trial_id=len(state.trials), params=params))
    return dataclasses.replace(state, round_index=state.round_index + 1)


def trial_score(config: TuningConfig, model: TrainedModel) -> float:
    """The search metric of a trial's slice: the figure of its typed metrics, or for a workload's own metric
    (``val_f1``) the value its last validation logged to the trial's MLflow run, where the loop logs every metric
    the workload reports as ``val_<name>``."""
    if hasattr(model.metrics, config.metric):
        return float(getattr(model.metrics, config.metric))
    from training_core import tracking

    value = tracking.last_metric(model.tracking_uri, model.mlflow_run_id, config.metric)
    if value is None:
        raise ValueError(
            f"metric={config.metric!r} is invalid: trial run {model.mlflow_run_id} logged no {config.metric}, so "
            f"the workload's metrics() does not report {config.metric.removeprefix('val_')!r}; rank on a metric it "
            "reports (val_<name> for each name its metrics() returns)"
        )
    return value


def _scored(trial: Trial) -> tuning.ScoredTrial:
    return tuning.ScoredTrial(trial_id=trial.trial_id, params=trial.params, score=trial.scores[-1])


def _copy_trial(loser: Trial, winner: Trial, params: tuning.Params) -> None:
    """PBT: ``loser`` continues from ``winner``'s checkpoint with ``params`` (the winner's, perturbed)."""
    loser.params = params
    loser.checkpoint, loser.epochs_trained = winner.checkpoint, winner.epochs_trained
    loser.lineage.append(winner.trial_id)
    loser.mlflow_run_id = ""  # new hyperparameters: a new child run, so each run's params stay true


def trial_table(config: TuningConfig, trials: list[Trial]) -> pd.DataFrame:
    """One row per trial: params (redacted: a searched field may hold a URL), the metric at each epoch it was
    scored, epochs used, status."""
    rows = []
    for t in trials:
        row: dict[str, object] = {
            "trial": t.trial_id,
            **{p.path: redact(t.params.get(p.path)) for p in config.search_space},
        }
        for epoch, score in zip(t.score_epochs, t.scores):
            row[f"{config.metric}@{epoch}"] = score
        row.update(
            {
                "final_" + config.metric: t.scores[-1] if t.scores else None,
                "epochs_trained": t.epochs_trained,
                "epochs_used": t.epochs_used,
                "status": t.status,
                "copied_from": ",".join(map(str, t.lineage)),
                "mlflow_run_id": t.mlflow_run_id or (t.model.mlflow_run_id if t.model else ""),
            }
        )
        rows.append(row)
    frame = pd.DataFrame(rows)
    scored = sorted(c for c in frame.columns if c.startswith(f"{config.metric}@"))
    ordered = ["trial", *(p.path for p in config.search_space), *sorted(scored, key=lambda c: int(c.split("@")[1]))]
    return frame[ordered + [c for c in frame.columns if c not in ordered]]


def best_trial(config: TuningConfig, trials: list[Trial]) -> Trial:
    """The best trial among those trained to the full budget (every trial, if none was)."""
    full = [t for t in trials if t.scores and t.epochs_trained >= config.base.loop.epochs] or [
        t for t in trials if t.scores
    ]
    if not full:
        raise RuntimeError("no trial finished: see the failed train_trial nodes")
    order = tuning.rank([t.scores[-1] for t in full], config.mode)
    return full[order[0]]


@task(retries=2, requests=Resources(cpu="500m", mem="1Gi"), enable_deck=True, deck_fields=DECK_FIELDS)
def finish_search(config: TuningConfig, state: SearchState) -> TuningOutputs:
    """Pick the best trial, close the MLflow parent run with its figures, and render the trial table and
    the metric-vs-epochs plot as a Deck."""
    return _finish(config, state)


@task(task_config=ray_job_config(tuning.ray_tune_scaling(TuningConfig())), retries=1, **RAY_DRIVER_TASK_ARGS)
def tune_with_ray(config: TuningConfig, data: PreparedData, state: SearchState) -> TuningOutputs:
    """The ``ray_tune`` strategy: Ray Tune's ``Tuner`` (ASHA, PBT, OptunaSearch or random) runs every trial
    on this task's RayCluster; the result has the same shape as the Flyte strategy's.

    The RayJob is sized per search by the workflow: ``max_concurrency`` trials of ``base.scaling`` workers.
    """
    from flytekit import current_context

    from training_core import checkpoint as ckpt
    from training_core.runners.ray_train import FitResult
    from training_core.runners.ray_tune import run_search

    # Tune runs each trial driver in its own working directory: a relative sqlite URI must be made absolute.
    config = dataclasses.replace(
        config,
        base=dataclasses.replace(
            config.base, tracking=dataclasses.replace(config.base.tracking, tracking_uri=state.tracking_uri)
        ),
    )
    outcomes = run_search(
        config,
        data_dir=artifact_location(data.directory),
        storage_path=checkpoint_storage_path(config.base.checkpoint),
        run_name=f"tune-{current_context().execution_id.name}",
        parent_run_id=state.parent_run_id,
    )
    trials = [
        Trial(
            trial_id=o.trial_id,
            params=o.params,
            status=o.status,
            epochs_trained=o.epochs_trained,
            epochs_used=o.epochs_used,
            scores=o.scores,
            score_epochs=o.score_epochs,
            mlflow_run_id=o.mlflow_run_id,
        )
        for o in outcomes
    ]
    best = best_trial(config, trials)
    uri = next(o.checkpoint_uri for o in outcomes if o.trial_id == best.trial_id)
    local = os.path.join(current_context().working_directory, "best_checkpoint")
    parent, name = uri.rstrip("/").rsplit("/", 1)
    ckpt.open_storage(parent).download(name, local)
    meta = ckpt.load_meta(local)
    result = FitResult(checkpoint_dir=local, checkpoint_uri=uri, metrics=meta.history[-1], meta=meta)
    best.model = trained_model(
        tuning.apply_params(config.base, best.params),
        result,
        tracking_uri=state.tracking_uri,
        run_id=best.mlflow_run_id,
    )
    best.checkpoint = best.model.checkpoint
    return _finish(config, dataclasses.replace(state, trials=trials))


def _finish(config: TuningConfig, state: SearchState) -> TuningOutputs:
    from training_core import tracking

    best = best_trial(config, state.trials)
    frame = trial_table(config, state.trials)
    epochs_used = int(frame["epochs_used"].sum())
    tracking.log_metrics(
        state.tracking_uri,
        state.parent_run_id,
        {
            f"best_{config.metric}": best.scores[-1],
            "best_trial": float(best.trial_id),
            "epochs_used": float(epochs_used),
        },
    )
    tracking.finish_run(state.tracking_uri, state.parent_run_id)

    csv_path = _working_path("trials.csv")
    frame.to_csv(csv_path, index=False)
    report = publish_report(
        "Tuning report",
        reports.tuning_sections(config, state.trials, best=best, frame=frame, parent_run_id=state.parent_run_id),
    )
    from flytekit import FlyteContextManager

    table = FlyteFile(
        csv_path, remote_path=FlyteContextManager.current_context().file_access.get_random_remote_path("trials.csv")
    )
    assert best.model is not None and best.checkpoint is not None
    result = TuningResult(
        best_trial=best.trial_id,
        best_params=best.params,
        best_config=tuning.apply_params(config.base, best.params),
        best_metric=best.scores[-1],
        best_checkpoint=best.checkpoint,
        best_model=best.model,
        epochs_used=epochs_used,
        table=table,
        report=report,
        mlflow_parent_run_id=state.parent_run_id,
    )
    return TuningOutputs(result=result, trials=frame)


def _working_path(name: str) -> str:
    from flytekit import current_context

    return os.path.join(current_context().working_directory, name)
