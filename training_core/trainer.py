"""Run the training loop under Ray Train's ``TorchTrainer`` and collect the final checkpoint.

``fit`` is what the Flyte train task and the benchmarks call. It needs a reachable Ray cluster
(``ray.init`` done by the caller, or done here on a local one).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig

log = logging.getLogger("training_core")


@dataclass
class FitResult:
    checkpoint_dir: str
    """Local directory holding the final checkpoint (see :mod:`training_core.checkpoint`)."""
    metrics: dict[str, Any]
    """Rank 0's last report: final epoch's train/val metrics and the steady-state throughput."""
    meta: ckpt.CheckpointMeta = field(repr=False)


@dataclass
class MlflowRun:
    tracking_uri: str
    run_id: str


def ray_scaling_config(cfg: TrainingConfig):
    from ray.train import ScalingConfig

    resources = {"CPU": cfg.scaling.cpus_per_worker}
    if cfg.scaling.use_gpu:
        resources["GPU"] = cfg.scaling.gpus_per_worker
    return ScalingConfig(num_workers=cfg.scaling.num_workers, use_gpu=cfg.scaling.use_gpu, resources_per_worker=resources)


def fit(
    cfg: TrainingConfig,
    *,
    data_dir: str,
    checkpoint_dir: str,
    run_name: str,
    storage_path: str,
    mlflow_run: MlflowRun | None = None,
    warmup_steps_excluded: int | None = None,
) -> FitResult:
    """Train ``cfg`` on the prepared data at ``data_dir``; copy the final checkpoint to ``checkpoint_dir``.

    ``storage_path``/``run_name`` locate Ray Train's run state (``RunConfig``). Raises whatever the
    training function raised, wrapped by Ray Train, when the run fails.
    """
    import ray
    from ray.train import CheckpointConfig, RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from training_core.loop import train_loop_per_worker

    if not ray.is_initialized():
        ray.init()
    loop_config: dict[str, Any] = {"config": cfg.to_dict(), "data_dir": data_dir}
    if mlflow_run is not None:
        loop_config["mlflow"] = {"tracking_uri": mlflow_run.tracking_uri, "run_id": mlflow_run.run_id}
    if warmup_steps_excluded is not None:
        loop_config["warmup_steps_excluded"] = warmup_steps_excluded
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend=cfg.scaling.resolved_backend(), timeout_s=cfg.scaling.collective_timeout_s),
        scaling_config=ray_scaling_config(cfg),
        run_config=RunConfig(
            name=run_name,
            storage_path=storage_path,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
        ),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"Ray Train run {run_name!r} finished without a checkpoint; see the worker logs above")
    if os.path.exists(checkpoint_dir):
        shutil.rmtree(checkpoint_dir)
    result.checkpoint.to_directory(checkpoint_dir)
    return FitResult(checkpoint_dir=checkpoint_dir, metrics=dict(result.metrics or {}), meta=ckpt.load_meta(checkpoint_dir))
