"""RayJob shape (head and worker groups, requests and limits, ``/dev/shm``, GPU placement) derived from
``ScalingConfig``, and the Ray task that applies the platform's Ray settings
(:mod:`training_core.parallel.ray_settings`)
wherever it runs: in every RayJob pod's environment, and before a local run's ``ray.init``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flytekit import PodTemplate, Resources
from flytekit.core.resources import pod_spec_from_resources
from flytekit.extend import TaskPlugins
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig
from flytekitplugins.ray.task import RayFunctionTask

from training_core.config import SHM_SHARE, DataConfig, ScalingConfig
from training_core.parallel.ray_settings import (
    POD_HOOK_COMMAND,
    PROCESS_ENV,
    apply_process_env,
    daemons_idle_enabled,
    idle_ray_daemons,
    start_local_cluster,
)

if TYPE_CHECKING:
    from kubernetes.client import V1PodSpec

WORKER_GROUP = "train-workers"
PREP_GROUP = "prep-workers"
# The prep driver lists the source (paths and labels: about 200 MB for ImageNet's 1.28 M files) and totals the shard
# tasks' small results; the images themselves stay on the prep workers.
PREP_HEAD_MEMORY_GIB = 4.0
PREP_HEAD = Resources(cpu="1", mem=f"{int(PREP_HEAD_MEMORY_GIB * 1024)}Mi")
RAYJOB_TTL_S = 3600
# The container names the Ray plugin gives the head and worker containers: a pod template's primary container must
# carry them for its resources and mounts to apply.
HEAD_CONTAINER = "ray-head"
WORKER_CONTAINER = "ray-worker"
SHM_VOLUME = "dshm"


def _gib(value: float) -> str:
    return f"{int(value * 1024)}Mi"


def _cpus(value: float) -> str:
    return f"{value:g}"


def worker_resources(scaling: ScalingConfig) -> Resources:
    gpu = str(scaling.gpus_per_worker) if scaling.use_gpu else None
    return Resources(cpu=_cpus(scaling.cpus_per_worker), mem=_gib(scaling.memory_per_worker_gib), gpu=gpu)


def _pod_spec(container: str, resources: Resources, shm_gib: float) -> V1PodSpec:
    """Requests equal to limits (a Guaranteed pod: the scheduler never overcommits a training worker), and a
    memory-backed ``/dev/shm`` of ``shm_gib``: the container runtime's 64 MiB starves Ray's object store, loader
    processes and NCCL. Every container gets :data:`~training_core.parallel.ray_settings.PROCESS_ENV`, and
    :data:`~training_core.parallel.ray_settings.POD_HOOK_COMMAND` as its ``postStart`` hook."""

    from kubernetes.client import (
        V1EmptyDirVolumeSource,
        V1EnvVar,
        V1ExecAction,
        V1Lifecycle,
        V1LifecycleHandler,
        V1Volume,
        V1VolumeMount,
    )

    spec = pod_spec_from_resources(primary_container_name=container, requests=resources, limits=resources)
    spec.volumes = [
        V1Volume(name=SHM_VOLUME, empty_dir=V1EmptyDirVolumeSource(medium="Memory", size_limit=_gib(shm_gib)))
    ]
    spec.containers[0].volume_mounts = [V1VolumeMount(name=SHM_VOLUME, mount_path="/dev/shm")]
    # ``ray start`` and every process it starts (daemons, workers, loader processes) inherit the container's
    # environment: the platform's Ray settings reach the whole cluster from here.
    spec.containers[0].env = [V1EnvVar(name=name, value=value) for name, value in PROCESS_ENV.items()]
    # Once ``ray start`` has started the pod's daemons, they run under SCHED_IDLE (idle_pod_daemons; set
    # TRAINING_RAY_DAEMONS_IDLE=0 in the container's environment to keep them at the default policy).
    hook = V1LifecycleHandler(_exec=V1ExecAction(command=POD_HOOK_COMMAND))
    spec.containers[0].lifecycle = V1Lifecycle(post_start=hook)
    return spec


def worker_pod_spec(scaling: ScalingConfig) -> V1PodSpec:
    """A Ray Train worker's pod: its resources, ``/dev/shm``, ``scaling.nccl_env``, and on GPUs the node selector
    and tolerations."""
    from kubernetes.client import V1Toleration

    spec = _pod_spec(WORKER_CONTAINER, worker_resources(scaling), scaling.worker_shm_gib())
    if scaling.nccl_env:  # read by NCCL when a worker's communicator starts: in the environment from the pod's start
        from kubernetes.client import V1EnvVar

        spec.containers[0].env += [V1EnvVar(name=name, value=value) for name, value in sorted(scaling.nccl_env.items())]
    if scaling.use_gpu:
        spec.node_selector = dict(scaling.gpu_node_selector) or None
        spec.tolerations = [
            V1Toleration(key=t.key or None, operator=t.operator, value=t.value or None, effect=t.effect or None)
            for t in scaling.gpu_tolerations
        ] or None
    return spec


def gpu_task_pod_template(scaling: ScalingConfig) -> PodTemplate:
    """The pod of a plain (non-Ray) task that runs on one of the run's GPU nodes: ``scaling.gpu_node_selector`` and
    ``scaling.gpu_tolerations`` on its primary container's pod (its resources are the task's)."""
    from kubernetes.client import V1Container, V1PodSpec

    gpu_spec = worker_pod_spec(scaling)
    spec = V1PodSpec(
        containers=[V1Container(name="primary")], node_selector=gpu_spec.node_selector, tolerations=gpu_spec.tolerations
    )
    return PodTemplate(pod_spec=spec, primary_container_name="primary")


@dataclass
class TrainingRayJobConfig(RayJobConfig):
    """flytekit's ``RayJobConfig``, run by :class:`TrainingRayTask` (the plugin is chosen by the config's type)."""


class TrainingRayTask(RayFunctionTask):
    """flytekit's Ray task, with the platform's Ray settings in the environment before its ``ray.init``: a local
    run (``pyflyte run`` without ``RAY_ADDRESS``) starts its Ray cluster with them
    (:func:`~training_core.parallel.ray_settings.start_local_cluster`). On a cluster the RayJob's pods carry them
    already
    (:func:`ray_job_config`)."""

    def pre_execute(self, user_params):
        import ray
        from flytekit import FlyteContextManager

        apply_process_env()
        local = FlyteContextManager.current_context().execution_state.is_local_execution()
        if local and not self._task_config.address and not os.environ.get("RAY_ADDRESS") and not ray.is_initialized():
            # flytekit's own ray.init below then finds this cluster (it passes ignore_reinit_error locally).
            start_local_cluster()
        user_params = super().pre_execute(user_params)
        if local and daemons_idle_enabled():
            # Whichever ray.init started this process's local cluster (ours above, or flytekit's): its daemons.
            idle_ray_daemons(parent_pid=os.getpid())
        return user_params


TaskPlugins.register_pythontask_plugin(TrainingRayJobConfig, TrainingRayTask)


def ray_job_config(scaling: ScalingConfig) -> TrainingRayJobConfig:
    """One worker pod per Ray Train worker; the head runs the task driver and takes no training work
    (``num-cpus: 0`` and ``num-gpus: 0``, and no GPU placement), so every worker lands on a sized worker pod."""
    head = Resources(cpu=_cpus(scaling.head_cpus), mem=_gib(scaling.head_memory_gib))
    head_spec = _pod_spec(HEAD_CONTAINER, head, SHM_SHARE * scaling.head_memory_gib)
    return _ray_job(
        head_spec, WORKER_GROUP, scaling.num_workers, worker_pod_spec(scaling), min_replicas=scaling.worker_counts()[0]
    )


def text_prep_resources(data: DataConfig) -> Resources:
    """The pod of a prep of a user's text (``prepare_data`` for ``causal_lm`` with ``workload.dataset_source``):
    ``data.prep_num_workers`` CPUs, on which the tokenizer encodes in parallel threads, and
    ``data.prep_memory_per_worker_gib``; requests equal limits."""
    return Resources(cpu=str(data.prep_num_workers), mem=_gib(data.prep_memory_per_worker_gib))


def prep_ray_job_config(data: DataConfig) -> TrainingRayJobConfig:
    """The prep task's RayJob: one 1-CPU pod of ``data.prep_memory_per_worker_gib`` per ``data.prep_num_workers``
    (each runs one shard or tokenising task at a time), and a head that runs the driver (images: listing the source,
    small results; text: reading it, spilling the ids to its local disk and writing the packed shards)."""
    worker = Resources(cpu="1", mem=_gib(data.prep_memory_per_worker_gib))
    spec = _pod_spec(WORKER_CONTAINER, worker, SHM_SHARE * data.prep_memory_per_worker_gib)
    head_spec = _pod_spec(HEAD_CONTAINER, PREP_HEAD, SHM_SHARE * PREP_HEAD_MEMORY_GIB)
    return _ray_job(head_spec, PREP_GROUP, data.prep_num_workers, spec)


def _ray_job(
    head_spec: V1PodSpec, group: str, replicas: int, worker_spec: V1PodSpec, *, min_replicas: int | None = None
) -> TrainingRayJobConfig:
    """A RayJob of one head and one worker group of ``replicas`` pods (at least ``min_replicas`` of them: elastic
    training goes on when KubeRay cannot replace lost pods at once)."""
    return TrainingRayJobConfig(
        head_node_config=HeadNodeConfig(
            ray_start_params={"num-cpus": "0", "num-gpus": "0"}, pod_template=PodTemplate(pod_spec=head_spec)
        ),
        worker_node_config=[
            WorkerNodeConfig(
                group_name=group,
                replicas=replicas,
                min_replicas=replicas if min_replicas is None else min_replicas,
                max_replicas=replicas,
                pod_template=PodTemplate(pod_spec=worker_spec),
            )
        ],
        shutdown_after_job_finishes=True,
        ttl_seconds_after_finished=RAYJOB_TTL_S,
    )
