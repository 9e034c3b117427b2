"""Typed inputs and outputs passed between the pipeline's tasks.

Every artifact is a ``FlyteDirectory`` or ``FlyteFile`` so Flyte tracks it in the execution's raw-output
location; scalar results are plain typed fields so FlyteConsole shows them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile


@dataclass
class PreparedData:
    """Output of ``prepare_data``: sharded splits plus their manifest."""

    directory: FlyteDirectory
    """Shards (``<split>-NNNNN-of-NNNNN.npz``) and ``manifest.json``."""
    dataset: str
    num_classes: int
    input_shape: list[int]
    """Channels, height, width."""
    split_counts: dict[str, int]
    """Samples per split (train, val, test)."""


@dataclass
class TrainMetrics:
    """Last-epoch figures of a training run."""

    epochs: int
    global_step: int
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float
    samples_per_s: float
    """Steady-state training throughput over all workers, warm-up steps excluded."""


@dataclass
class TrainedModel:
    """Output of ``train``: the final checkpoint and where MLflow tracked it."""

    checkpoint: FlyteDirectory
    """Final checkpoint directory (model.pt, trainer_state.pt, meta.json)."""
    model_name: str
    metrics: TrainMetrics
    tracking_uri: str
    mlflow_run_id: str
    mlflow_model_uri: str
    """``models:/m-...`` URI of the model logged with its signature."""
    report: FlyteFile
    """The training Deck as a standalone HTML page."""


@dataclass
class Evaluation:
    """Output of ``evaluate``: test-split metrics."""

    num_samples: int
    loss: float
    accuracy: float
    top5_accuracy: float
    confusion: list[list[int]]
    """``confusion[true][predicted]`` counts."""
    classes: list[str]
    report: FlyteFile
    """The evaluation Deck as a standalone HTML page."""


@dataclass
class Registration:
    """Output of ``register_model``: what happened in the Model Registry, and why."""

    model_name: str
    version: int
    alias: str
    promoted: bool
    """Whether ``alias`` now points at ``version``."""
    reason: str
    test_accuracy: float
    previous_champion_version: int = 0
    """0 when there was no champion."""
    previous_champion_accuracy: float = -1.0
    tracking_uri: str = ""
    reports: list[str] = field(default_factory=list)
    """Where the training and evaluation reports (the Decks) are."""
