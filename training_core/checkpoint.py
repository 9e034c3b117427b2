"""Save and load a training checkpoint: a dict of stateful objects, in one directory.

Layout of a checkpoint directory:

- ``model.pt``: the bare model's ``state_dict`` (no DDP ``module.`` prefix);
- ``trainer_state.pt``: optimizer, LR scheduler and GradScaler state, epoch and global step;
- ``meta.json``: what is needed to rebuild and use the model without the training config: model name,
  classes, input shape, normalisation stats, the resolved config, metrics history, and the MLflow model.

Tensor files are read with ``torch.load(weights_only=True)``, which never executes pickled code.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

MODEL_FILE = "model.pt"
TRAINER_STATE_FILE = "trainer_state.pt"
META_FILE = "meta.json"


@dataclass
class CheckpointMeta:
    model_name: str
    classes: list[str]
    input_shape: list[int]
    mean: list[float]
    std: list[float]
    epoch: int
    """Epochs completed."""
    global_step: int
    """Optimizer steps completed."""
    config: dict[str, Any]
    history: list[dict[str, float]] = field(default_factory=list)
    """One record per epoch: train/val loss and accuracy, LR, throughput."""
    step_log: list[dict[str, float]] = field(default_factory=list)
    """One record per logged step: loss, accuracy, LR, grad norm, samples/s."""
    mlflow_model_uri: str = ""
    mlflow_run_id: str = ""


def save(directory: str, *, model, optimizer=None, scheduler=None, scaler=None, meta: CheckpointMeta) -> None:
    """Write ``model`` (unwrapped from DDP), trainer state and ``meta`` into ``directory``."""
    import torch

    os.makedirs(directory, exist_ok=True)
    bare = getattr(model, "module", model)
    torch.save(bare.state_dict(), os.path.join(directory, MODEL_FILE))
    trainer_state = {"epoch": meta.epoch, "global_step": meta.global_step}
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            trainer_state[name] = obj.state_dict()
    torch.save(trainer_state, os.path.join(directory, TRAINER_STATE_FILE))
    with open(os.path.join(directory, META_FILE), "w", encoding="utf-8") as f:
        json.dump(asdict(meta), f, indent=2)


def load_meta(directory: str) -> CheckpointMeta:
    with open(os.path.join(directory, META_FILE), encoding="utf-8") as f:
        return CheckpointMeta(**json.load(f))


def load_model(directory: str, *, map_location: str = "cpu"):
    """Rebuild the model a checkpoint describes and load its weights. Returns ``(model, meta)``."""
    import torch

    from training_core.models import build_model

    meta = load_meta(directory)
    model = build_model(meta.model_name, num_classes=len(meta.classes), input_shape=meta.input_shape)
    state = torch.load(os.path.join(directory, MODEL_FILE), map_location=map_location, weights_only=True)
    model.load_state_dict(state)
    return model, meta


def load_trainer_state(directory: str, *, model, optimizer=None, scheduler=None, scaler=None, map_location: str = "cpu") -> dict[str, int]:
    """Restore every stateful object in place; returns ``{"epoch": ..., "global_step": ...}``."""
    import torch

    bare = getattr(model, "module", model)
    bare.load_state_dict(torch.load(os.path.join(directory, MODEL_FILE), map_location=map_location, weights_only=True))
    state = torch.load(os.path.join(directory, TRAINER_STATE_FILE), map_location=map_location, weights_only=True)
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None and name in state:
            obj.load_state_dict(state[name])
    return {"epoch": state["epoch"], "global_step": state["global_step"]}
