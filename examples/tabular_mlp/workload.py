"""``TabularMLP``: a user workload, unknown to the platform's built-ins, that trains an MLP classifier on a CSV table.

Select it with ``workload.name: examples.tabular_mlp.workload:TabularMLP`` (see ``examples/tabular_mlp.yaml``).
It implements the whole :class:`training_core.workloads.Workload` protocol itself; the platform brings the rest
(Ray Train DDP, checkpoints and resume, MLflow, the Flyte tasks, evaluation and registration).

The table is ``data.path`` (a local path or an ``s3://`` URI; read with pandas) or, when that is empty, the
``breast_cancer.csv`` shipped in this package. Its last column is the label (any values: each distinct one is a
class, in sorted order); every other column is a numeric feature. Data prep splits the rows with the
``data.*_fraction`` fields and stores the raw features as float32 and the label index as int64; the training
split's per-feature mean and standard deviation go into the manifest (``mean``/``std``), and the model
standardises its input with them, so the registered model takes raw rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from training_core.config import DataConfig, TrainingConfig, invalid, quote
from training_core.data import ArraySpec, Manifest, split_samples, write_prepared
from training_core.redact import redact
from training_core.workloads import LossOutput

DEFAULT_CSV = Path(__file__).with_name("breast_cancer.csv")
"""The table used when ``data.path`` is empty (written by ``make_csv.py``)."""

DEFAULT_HIDDEN_SIZE = 64
"""Width of the hidden layers when ``model.hidden_size`` is 0."""
DEFAULT_NUM_LAYERS = 2
"""Hidden layers when ``model.num_layers`` is 0."""


class TabularMLP:
    """Rows of numeric features in, class logits out; cross-entropy; accuracy is the primary metric."""

    name = "tabular_mlp"
    primary_metric = "accuracy"
    primary_mode = "max"

    def prepare_data(self, data: DataConfig, out_dir: str) -> Manifest:
        path = data.path or str(DEFAULT_CSV)
        features, labels, classes, columns = read_table(path)
        source = f"data.path={quote(path)}"
        splits = split_samples({"train": {"features": features, "labels": labels}}, data, source=source)
        train = splits["train"]["features"].astype(np.float64)
        num_features = features.shape[1]
        template = Manifest(
            dataset=redact(path) if data.path else f"{DEFAULT_CSV.name} (examples.tabular_mlp)",
            classes=classes,
            input_shape=[num_features],
            mean=train.mean(axis=0).tolist(),
            std=np.maximum(train.std(axis=0), 1e-6).tolist(),
            splits={},
            workload=self.name,
            arrays={
                "features": ArraySpec("float32", [num_features]),
                "labels": ArraySpec("int64", [], max_value=len(classes) - 1),
            },
            spec={"feature_names": columns[:-1], "label_column": columns[-1]},
        )
        return write_prepared(out_dir, splits, template=template, num_shards=data.num_shards)

    def check(self, config: TrainingConfig, manifest: Manifest) -> None:
        arrays = manifest.arrays
        features = arrays.get("features")
        if (
            manifest.workload != self.name
            or set(arrays) != {"features", "labels"}
            or features is None
            or features.dtype != "float32"
            or features.shape != list(manifest.input_shape)
            or len(manifest.mean) != manifest.input_shape[0]
        ):
            raise ValueError(
                f"workload.name={quote(config.workload.name)} trains an MLP on tables, but the prepared data at "
                f"{quote(manifest.directory)} was written by workload {manifest.workload!r} with arrays "
                f"{sorted(arrays)}; prepare the data with the same workload"
            )
        if manifest.num_classes < 2:
            raise ValueError(
                f"data.path: the prepared data at {quote(manifest.directory)} has {manifest.num_classes} class(es); "
                "a classifier needs a label column with at least 2 distinct values"
            )
        # Raises naming loop.batch_size or data.num_shards when a worker would get no shard or no full step: here,
        # in the driver, rather than in every worker.
        manifest.steps_per_epoch(
            world_size=config.scaling.num_workers,
            batch_size=config.loop.batch_size,
            grad_accum_steps=config.loop.grad_accum_steps,
        )

    def build_model(self, config: TrainingConfig, manifest: Manifest) -> nn.Module:
        from examples.tabular_mlp.model import MLPClassifier

        return MLPClassifier(
            mean=manifest.mean,
            std=manifest.std,
            num_classes=manifest.num_classes,
            hidden_size=config.model.hidden_size or DEFAULT_HIDDEN_SIZE,
            num_layers=config.model.num_layers or DEFAULT_NUM_LAYERS,
        )

    def to_device(self, manifest: Manifest, device: torch.device) -> Callable[[Mapping[str, np.ndarray]], Any]:
        return ToDevice(device)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossOutput:
        features, labels = batch
        logits = model(features)
        correct = (logits.detach().argmax(dim=1) == labels).sum()
        return LossOutput(
            loss=F.cross_entropy(logits, labels),
            sums={"correct": correct, "samples": count(labels)},
            num_samples=len(labels),
        )

    def eval_sums(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        features, labels = batch
        logits = model(features).float()
        predicted = logits.argmax(dim=1)
        num_classes = logits.shape[1]
        return {
            "loss_sum": F.cross_entropy(logits, labels, reduction="sum").double(),
            "correct": (predicted == labels).sum(),
            "samples": count(labels),
            "confusion": torch.bincount(labels * num_classes + predicted, minlength=num_classes**2).view(
                num_classes, num_classes
            ),
        }

    def metrics(self, sums: Mapping[str, Any]) -> dict[str, float]:
        found = {"accuracy": ratio(sums, "correct", "samples")}
        if "loss_sum" in sums:
            found["loss"] = ratio(sums, "loss_sum", "samples")
        return found

    def example_input(self, manifest: Manifest) -> np.ndarray:
        # Two rows at the training mean: raw features, what the registered model takes.
        return np.asarray([manifest.mean, manifest.mean], dtype=np.float32)


def read_table(path: str) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    """Features (float32, rows x columns), label indices (int64), the class names and the column names of the
    CSV at ``path``; ``ValueError`` naming ``data.path`` for a table this workload cannot train on."""
    import pandas as pd

    problem = ""
    try:
        table = pd.read_csv(path)
    except FileNotFoundError:
        problem = "no CSV file there; give a local path or s3:// URI of a CSV table"
    except (ValueError, UnicodeDecodeError, OSError) as exc:  # pandas' ParserError and EmptyDataError are ValueErrors
        problem = f"it is not a readable CSV table ({type(exc).__name__}: {exc}); give a CSV file with a header row"
    if problem:
        invalid("data.path", path, problem)
    columns = [str(c) for c in table.columns]
    if len(columns) < 2 or len(table) < 2:
        invalid("data.path", path, "the table needs feature columns, a label column (the last) and rows")
    label = table.iloc[:, -1].astype(str)
    features = table.iloc[:, :-1]
    not_numeric = [str(c) for c in features.columns if not pd.api.types.is_numeric_dtype(features[c])]
    if not_numeric:
        invalid("data.path", path, f"feature columns {not_numeric} are not numeric; every column but the last must be")
    values = features.to_numpy(dtype=np.float32)
    if not np.isfinite(values).all():
        bad = [columns[i] for i in np.flatnonzero(~np.isfinite(values).all(axis=0))]
        invalid("data.path", path, f"feature columns {bad} have missing or infinite values; fill or drop those rows")
    classes = sorted(label.unique())
    if len(classes) < 2:
        invalid("data.path", path, f"the label column {columns[-1]!r} has one value {classes}; a classifier needs two")
    labels = np.searchsorted(np.asarray(classes), label.to_numpy()).astype(np.int64)
    return values, labels, classes, columns


class ToDevice:
    """A batch of stored arrays -> ``(features, labels)`` tensors on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, batch: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.from_numpy(batch["features"]).to(self.device, non_blocking=True)
        labels = torch.from_numpy(batch["labels"]).to(self.device, non_blocking=True)
        return features, labels


def count(values: torch.Tensor) -> torch.Tensor:
    """How many ``values`` there are, as a 0-dim tensor on their device (summed by the loop without a sync)."""
    return torch.tensor(values.shape[0], device=values.device)


def ratio(sums: Mapping[str, Any], numerator: str, denominator: str) -> float:
    """``sums[numerator] / sums[denominator]``; NaN when either is missing or the count is 0."""
    if numerator not in sums or denominator not in sums or not float(sums[denominator]):
        return math.nan
    return float(sums[numerator]) / float(sums[denominator])
