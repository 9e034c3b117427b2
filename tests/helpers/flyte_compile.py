"""Compiling dynamic workflows the way propeller does, and reading the RayJob a compiled node carries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flytekit import FlyteContextManager
from flytekit.configuration import ImageConfig, SerializationSettings
from flytekit.core.context_manager import ExecutionState
from flytekit.core.type_engine import TypeEngine


def compile_dynamic(dynamic_task, inputs: dict[str, Any], type_hints: dict[str, type] | None = None):
    """What a dynamic task's pod hands the backend: the DynamicJobSpec its body compiles to (``dispatch_execute``
    in TASK_EXECUTION mode, with serialization settings, as in a task pod)."""
    settings = SerializationSettings(
        project="p", domain="d", version="v1", image_config=ImageConfig.auto_default_image()
    )
    # flytekit compiles a dynamic task's body once per process (its workflow is kept, nodes and input values with it),
    # as fits a task pod, which runs it once; every call here stands for a pod of its own.
    dynamic_task._wf = None
    ctx = FlyteContextManager.current_context().with_serialization_settings(settings)
    with FlyteContextManager.with_context(ctx) as ctx:
        state = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
        with FlyteContextManager.with_context(ctx.with_execution_state(state)) as ctx:
            hints = type_hints or dynamic_task.python_interface.inputs
            literals = TypeEngine.dict_to_literal_map(ctx, inputs, type_hints=hints)
            return dynamic_task.dispatch_execute(ctx, literals)


@dataclass
class PodShape:
    container: str
    requests: dict[str, str]
    limits: dict[str, str]
    shm_size: str | None
    """``sizeLimit`` of the memory-backed volume mounted at ``/dev/shm``; None without one."""
    node_selector: dict[str, str]
    tolerations: list[dict[str, str]]
    env: dict[str, str]
    """The primary container's environment variables (name to value)."""
    post_start: list[str] | None
    """The primary container's ``postStart`` hook command; None without one."""


@dataclass
class RayJobShape:
    head_start_params: dict[str, str]
    head: PodShape
    group_name: str
    replicas: tuple[int, int, int]
    """Worker group replicas, min replicas, max replicas."""
    worker: PodShape


def _pod(pod_spec: dict) -> PodShape:
    (container,) = pod_spec["containers"]
    shm_mounts = [m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    shm_size = None
    if shm_mounts:
        empty_dir = volumes[shm_mounts[0]]["emptyDir"]
        assert empty_dir["medium"] == "Memory", "a /dev/shm that is not memory-backed is a disk"
        shm_size = empty_dir["sizeLimit"]
    return PodShape(
        container=container["name"],
        requests=container["resources"]["requests"],
        limits=container["resources"]["limits"],
        shm_size=shm_size,
        node_selector=pod_spec.get("nodeSelector", {}),
        tolerations=pod_spec.get("tolerations", []),
        env={e["name"]: e["value"] for e in container.get("env", [])},
        post_start=container.get("lifecycle", {}).get("postStart", {}).get("exec", {}).get("command"),
    )


def rayjob_shape(custom: dict) -> RayJobShape:
    """A Ray task template's ``custom`` decoded through flyteidl's RayJob message (unknown fields fail)."""
    from flyteidl.plugins import ray_pb2
    from google.protobuf import json_format

    job = json_format.ParseDict(custom, ray_pb2.RayJob())
    cluster = job.ray_cluster
    (group,) = cluster.worker_group_spec
    return RayJobShape(
        head_start_params=dict(cluster.head_group_spec.ray_start_params),
        head=_pod(json_format.MessageToDict(cluster.head_group_spec.k8s_pod.pod_spec)),
        group_name=group.group_name,
        replicas=(group.replicas, group.min_replicas, group.max_replicas),
        worker=_pod(json_format.MessageToDict(group.k8s_pod.pod_spec)),
    )
