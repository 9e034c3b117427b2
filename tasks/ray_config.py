"""RayJob shape (head and worker groups, requests and limits) derived from ``ScalingConfig``."""

from __future__ import annotations

from flytekit import Resources
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig

from training_core.config import ScalingConfig

WORKER_GROUP = "train-workers"
RAYJOB_TTL_S = 3600


def _gib(value: float) -> str:
    return f"{int(value * 1024)}Mi"


def _cpus(value: float) -> str:
    return f"{value:g}"


def worker_resources(scaling: ScalingConfig) -> Resources:
    gpu = str(scaling.gpus_per_worker) if scaling.use_gpu else None
    return Resources(cpu=_cpus(scaling.cpus_per_worker), mem=_gib(scaling.memory_per_worker_gib), gpu=gpu)


def ray_job_config(scaling: ScalingConfig) -> RayJobConfig:
    """One worker pod per Ray Train worker; the head runs the task driver and takes no training work
    (``num-cpus: 0``), so every worker lands on a sized worker pod."""
    head = Resources(cpu=_cpus(scaling.head_cpus), mem=_gib(scaling.head_memory_gib))
    workers = worker_resources(scaling)
    return RayJobConfig(
        head_node_config=HeadNodeConfig(ray_start_params={"num-cpus": "0"}, requests=head, limits=head),
        worker_node_config=[
            WorkerNodeConfig(group_name=WORKER_GROUP, replicas=scaling.num_workers, requests=workers, limits=workers)
        ],
        shutdown_after_job_finishes=True,
        ttl_seconds_after_finished=RAYJOB_TTL_S,
    )
