"""Run the training loop under Ray Train's ``TorchTrainer`` and collect the final checkpoint.

``fit`` is what the Flyte train task and the benchmarks call. It needs a reachable Ray cluster
(``ray.init`` done by the caller, or done here on a local one).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.parallel.ray_settings import environment_defaults, ray_scaling_config, start_local_cluster
from training_core.records import EpochRecord, MlflowRun, WorkerArgs
from training_core.redact import install_log_redaction, redact
from training_core.runners.ray_processes import reaped_run
from training_core.train.failures import (
    DIVERGED_METRIC,
    FailFastPolicy,
    TrainingDiverged,
    find_deterministic,
    is_collective_timeout,
)

log = logging.getLogger("training_core")


@dataclass
class FitResult:
    checkpoint_dir: str
    """Local copy of the final checkpoint (see :mod:`training_core.checkpoint`)."""
    checkpoint_uri: str
    """The final checkpoint where training wrote it (local path or s3:// URI)."""
    metrics: EpochRecord
    """The final epoch's record: train/val metrics and the steady-state throughput."""
    meta: ckpt.CheckpointMeta = field(repr=False)


def checkpoint_root(storage_path: str, run_name: str) -> str:
    """Where a run's checkpoints live: stable for a given storage path and run name, so a restarted
    worker group or a retried task finds the previous attempt's checkpoints."""
    return f"{storage_path.rstrip('/')}/{run_name}/checkpoints"


def _check_slice(cfg: TrainingConfig, root: str, resume_from: str) -> None:
    """Fail before any worker starts when a slice would start at or past its stop (workers would only
    fail, and be restarted, on the same error)."""
    storage = ckpt.open_storage(root, cfg.checkpoint)
    if storage.list_steps():
        return  # a retry resumes from its own checkpoints
    epoch = ckpt.load_meta(resume_from).epoch
    stop = "loop.stop_at_epoch" if cfg.loop.stop_at_epoch else "loop.epochs"
    if (cfg.loop.stop_at_epoch or cfg.loop.epochs) <= epoch:
        raise ValueError(
            f"{stop}={cfg.loop.stop_at_epoch or cfg.loop.epochs} is not past epoch {epoch} of "
            f"resume_from={redact(resume_from)!r}: there is nothing to train; raise {stop}"
        )


def fit(
    cfg: TrainingConfig,
    *,
    data_dir: str,
    checkpoint_dir: str,
    run_name: str,
    storage_path: str,
    mlflow_run: MlflowRun | None = None,
    resume_from: str | None = None,
    warmup_steps_excluded: int | None = None,
    log_params: bool | None = None,
    job_labels: Mapping[str, str] | None = None,
) -> FitResult:
    """Train ``cfg`` on the prepared data at ``data_dir``; copy the final checkpoint to local ``checkpoint_dir``.

    Checkpoints go to :func:`checkpoint_root` of ``storage_path``/``run_name``, and training resumes from
    the newest valid one there (after a worker restart inside this call, or on a new call with the same
    names). ``resume_from`` is a checkpoint directory to continue from when there is none yet. ``log_params``
    says whether the config goes to the MLflow run as params (default: unless resuming). ``job_labels``
    (``execution``, ``node``, ``attempt``) label the workers' metrics; see
    :func:`~training_core.records.worker_job_labels`. Raises what the training function raised, wrapped by Ray
    Train, once ``checkpoint.max_worker_restarts`` is spent; a diverged run raises
    :class:`~training_core.train.failures.TrainingDiverged`, and an error of the user's code or data on any rank
    :class:`~training_core.train.failures.UserCodeError`, at once, without restarts. The project's loggers redact URL
    credentials, here and in every worker (:func:`~training_core.redact.install_log_redaction`).
    """
    import ray

    from training_core.workloads import code_paths, preflight

    install_log_redaction()
    preflight(cfg, data_dir)  # user code, the model against the data: fails here, before any worker starts
    root = checkpoint_root(storage_path, run_name)
    if resume_from:
        _check_slice(cfg, root, resume_from)
    if not ray.is_initialized():
        start_local_cluster()  # as the product's Ray task starts a local one
    args = WorkerArgs.build(
        cfg,
        data_dir=data_dir,
        checkpoint_root=root,
        run_name=run_name,
        job_labels=job_labels,
        mlflow=mlflow_run,
        resume_from=resume_from or "",
        log_params=log_params,
        warmup_steps_excluded=warmup_steps_excluded,
        code_paths=code_paths(cfg.workload),
    )
    _run_workers(cfg, args, run_name=run_name, storage_path=storage_path)
    return collect_final(cfg, root, checkpoint_dir, what=f"Ray Train run {run_name!r}")


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train entry point, run by every worker: :func:`~training_core.train.loop.run_worker` with the Ray Train
    runtime, its logs redacted (:func:`~training_core.redact.install_log_redaction`: Ray starts the process with its
    own logging).

    A divergence is reported, not raised: Ray Train restarts the worker group on any worker error, and a diverged
    run resumed from its last checkpoint diverges again, so each restart would only burn time. Every rank stops
    at the same point (the figures it rests on are reduced), so every rank reports; ``fit`` raises it.

    An error of the user's code or data (:class:`~training_core.train.failures.UserCodeError`, what a user workload's
    methods raise: :class:`~training_core.workloads.UserWorkload`) is raised, on whichever rank meets it, its peers
    perhaps still in a collective: Ray Train's controller, which sees every rank's error, ends the run without a
    restart (:class:`~training_core.train.failures.FailFastPolicy`).

    A collective that timed out (a hung or unreachable peer) kills the other ranks' workers before it is raised
    (:meth:`~training_core.parallel.distributed.RayTrainRuntime.abandon_group`): the group restarts without waiting on
    the hung one."""
    from training_core.parallel.distributed import RayTrainRuntime
    from training_core.train.loop import run_worker
    from training_core.train.network_checks import prepare_nccl_env

    install_log_redaction()
    args = WorkerArgs.from_dict(loop_config)
    runtime = RayTrainRuntime(nccl_debug_dir=prepare_nccl_env(args.config.scaling))
    for path in args.code_paths:  # the user code the driver imported (``WorkerArgs.code_paths``)
        if path not in sys.path:
            sys.path.append(path)
    try:
        run_worker(args, runtime)
    except TrainingDiverged as exc:
        runtime.report_result({DIVERGED_METRIC: str(exc)})
    except Exception as exc:
        if is_collective_timeout(exc):
            runtime.abandon_group(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise


def _run_workers(cfg: TrainingConfig, args: WorkerArgs, *, run_name: str, storage_path: str) -> None:
    """The Ray Train run of ``args``' workers to its end; raises the root cause of a deterministic failure and a
    divergence the workers reported."""
    from ray.train import FailureConfig, RunConfig
    from ray.train.torch import TorchConfig

    trainer = fail_fast_trainer(
        train_loop_per_worker,
        train_loop_config=args.to_dict(),
        torch_config=TorchConfig(backend=cfg.scaling.resolved_backend(), timeout_s=cfg.scaling.collective_timeout_s),
        scaling_config=ray_scaling_config(cfg),
        run_config=RunConfig(
            name=run_name,
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=cfg.checkpoint.max_worker_restarts),
        ),
    )
    # For an elastic run, scaling.elastic_start_timeout_s is Ray Train's worker group start timeout while ``fit`` runs
    # (Ray Train hands the driver's value to its controller), unless the environment sets one.
    start_timeout = f"{cfg.scaling.elastic_start_timeout_s:g}"
    elastic_env = {WORKER_GROUP_START_TIMEOUT_ENV: start_timeout} if cfg.scaling.elastic else {}
    with environment_defaults(elastic_env), reaped_run():  # no process of the run outlives it
        try:
            result = trainer.fit()
        except Exception as exc:
            found = find_deterministic(exc)  # the root cause, which Ray Train raised at once (FailFastPolicy)
            if found is None:
                raise
            raise found.as_raised() from exc
    diverged = (result.metrics or {}).get(DIVERGED_METRIC)
    if diverged:  # reported by the workers instead of raised, so Ray Train did not restart them (see the loop)
        raise TrainingDiverged(diverged)


def fail_fast_trainer(*args, **kwargs):
    """A Ray Train ``TorchTrainer`` (same arguments) whose controller decides failures with
    :class:`~training_core.train.failures.FailFastPolicy`: a deterministic error on any rank ends the run at once."""
    from ray.train.torch import TorchTrainer

    class FailFastTrainer(TorchTrainer):
        def _initialize_and_run_controller(self, **controller_init_kwargs):
            # Ray Train 2.60 takes no failure policy in its public config: this is where it hands the controller the
            # one it built from RunConfig.failure_config, which FailFastPolicy keeps for every other failure.
            controller_init_kwargs["failure_policy"] = FailFastPolicy(controller_init_kwargs["failure_policy"])
            if not self.datasets:
                # Our workers read their shards themselves, never a Ray Dataset. Ray Train 2.60 adds its datasets
                # callback regardless, which starts a DatasetManager actor (one more process importing Ray Data) for
                # every worker group: ~0.9 s of each 10 s run on 2 cores, for nothing.
                from ray.train.v2._internal.callbacks import DatasetsCallback

                controller_init_kwargs["callbacks"] = [
                    c for c in controller_init_kwargs["callbacks"] if not isinstance(c, DatasetsCallback)
                ]
            return super()._initialize_and_run_controller(**controller_init_kwargs)

    return FailFastTrainer(*args, **kwargs)


WORKER_GROUP_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


def collect_final(
    cfg: TrainingConfig, root: str, checkpoint_dir: str, *, what: str, metrics: EpochRecord | None = None
) -> FitResult:
    """The newest valid checkpoint under ``root``, copied to local ``checkpoint_dir``; ``metrics`` default to
    its last epoch record."""
    storage = ckpt.open_storage(root, cfg.checkpoint)
    final = ckpt.load_latest_valid(storage)
    if final is None:
        raise RuntimeError(f"{what} left no valid checkpoint under {redact(root)}; see the worker logs above")
    if os.path.exists(checkpoint_dir):
        shutil.rmtree(checkpoint_dir)
    final.release()  # a sharded checkpoint's verified download: the copy below is the one kept
    storage.download(final.name, checkpoint_dir)
    if metrics is None:
        if not final.meta.history:
            raise RuntimeError(f"{what} left {redact(final.uri)} without a finished epoch; see the worker logs above")
        metrics = final.meta.history[-1]
    return FitResult(checkpoint_dir=checkpoint_dir, checkpoint_uri=final.uri, metrics=metrics, meta=final.meta)
