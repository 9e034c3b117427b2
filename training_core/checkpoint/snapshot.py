"""The state a checkpoint saves, detached from the live objects (tensors copied to CPU) and encoded to bytes."""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from typing import Any

from training_core.checkpoint.layout import META_FILE, MODEL_FILE, TRAINER_STATE_FILE
from training_core.checkpoint.meta import CheckpointMeta
from training_core.checkpoint.partial import frozen_names


def detached(obj: Any, staging: dict[str, Any] | None = None, path: str = "") -> Any:
    """Deep copy of a state tree with every tensor copied to CPU, so later steps cannot change it.

    With ``staging`` (a dict kept between saves) each tensor is copied into the buffer of the same path,
    shape and dtype from the previous save: no fresh allocation and page faults on the step's time.
    """
    import torch

    if isinstance(obj, torch.Tensor) and hasattr(obj, "device_mesh"):  # a DTensor: copy its shard, keep its layout
        from torch.distributed.tensor import DTensor

        local = detached(obj.to_local(), staging, path)
        return DTensor.from_local(
            local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
        )
    if isinstance(obj, torch.Tensor):
        if staging is None:
            return obj.detach().to("cpu", copy=True)
        buffer = staging.get(path)
        if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
            buffer = staging[path] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=obj.is_cuda)
        buffer.copy_(obj.detach(), non_blocking=obj.is_cuda)
        return buffer
    if isinstance(obj, dict):
        return {k: detached(v, staging, f"{path}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(detached(v, staging, f"{path}/{i}") for i, v in enumerate(obj))
    return obj


def torch_bytes(obj: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def snapshot(
    *,
    model,
    optimizer=None,
    scheduler=None,
    scaler=None,
    meta: CheckpointMeta,
    torch_rng: dict | None = None,
    replicas: dict[str, dict[str, Any]] | None = None,
    staging: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The state to save, detached from the live objects (tensors copied to CPU, into ``staging`` buffers
    when given: see :meth:`Checkpointer.stage`). ``replicas`` (local SGD) are every rank's own model and optimizer
    state by rank, already on CPU."""
    import torch

    bare = getattr(model, "module", model)
    stateful = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    trainer = {name: obj.state_dict() for name, obj in stateful.items() if obj is not None}
    trainer |= {name: value for name, value in (("rng", torch_rng), ("replicas", replicas)) if value}
    model_state = bare.state_dict()
    if meta.frozen_base_sha256:  # the frozen base comes back from its source: only what trains is saved
        frozen = frozen_names(bare)
        model_state = {name: value for name, value in model_state.items() if name not in frozen}
    state = {
        "model": detached(model_state, staging, "model"),
        "trainer": detached(trainer, staging, "trainer"),
        "meta": asdict(meta),
    }
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking device-to-host copies must land before the writer reads them
    return state


def encode(state: dict[str, Any]) -> dict[str, bytes]:
    """Files of a checkpoint (without the manifest) from a :func:`snapshot`; without ``model.pt`` for a state without
    ``model`` (a sharded checkpoint's, whose weights are in its shards)."""
    tensor_files = {"model": MODEL_FILE, "trainer": TRAINER_STATE_FILE}
    files = {tensor_files[key]: torch_bytes(value) for key, value in state.items() if key in tensor_files}
    return files | {META_FILE: json.dumps(state["meta"], indent=1).encode()}
