"""Workloads from arrays: the user writes the data (named arrays) and the model, the platform everything else.

Subclass :class:`ArrayClassification` or :class:`ArrayRegression`, set ``name``, and implement
``build_model(config, manifest)``; the data is ``data.path`` (a ``.npz`` file holding ``inputs`` and ``targets``)
or what your ``load_arrays(data)`` returns: a mapping of array name to array (first axis the samples; other arrays
than ``inputs`` and ``targets`` are left out), a mapping of split name (``train``, ``val``, ``test``) to such
mappings, a PyTorch map-style ``Dataset`` whose items are ``(input, target)`` pairs or mappings, or a Hugging Face
``datasets.Dataset`` (anything with ``to_dict()`` and ``column_names``). Prep splits it with
:func:`training_core.data.split_samples` and writes it with :func:`training_core.data.write_prepared`: the same
shards, manifest, checks and fingerprints as any workload. Losses, additive sums (``loss_sum``, ``samples``,
``correct``, ``confusion``; ``squared_error_sum``, ``abs_error_sum``), metrics, ``check``, ``to_device`` and
``example_input`` come from the base class; override any of them.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from training_core.config import DataConfig, TrainingConfig, invalid, quote
from training_core.data import ARRAY_DTYPES, SPLIT_NAMES, ArraySpec, Manifest, split_samples, write_prepared
from training_core.redact import redact
from training_core.workloads.protocol import LossOutput, mean_of, to_device_async

if TYPE_CHECKING:
    import torch
    from torch import nn

MAX_NPZ_BYTES = 4 * 2**30
"""Most bytes the default :meth:`ArrayWorkload.load_arrays` reads from ``data.path``."""
INPUTS, TARGETS = "inputs", "targets"
"""The names of the two arrays a sample of an array workload has."""


class ArrayWorkload:
    """What :class:`ArrayClassification` and :class:`ArrayRegression` share: prep from arrays, ``check``,
    ``to_device`` and ``example_input``. A subclass sets ``name`` and implements ``build_model``."""

    name = "array_workload"
    primary_metric = "loss"
    primary_mode = "min"
    params: Any = None
    """``workload.params``: set by the platform."""

    def load_arrays(self, data: DataConfig) -> Any:
        """The samples: by default the arrays of the ``.npz`` file ``data.path`` (read as a regular file)."""
        from training_core.files import read_regular_path

        if not data.path:
            invalid(
                "data.path", data.path, f"name a .npz file holding {INPUTS!r} and {TARGETS!r}, or override load_arrays"
            )
        payload = read_regular_path(data.path, max_bytes=MAX_NPZ_BYTES, name=f"data.path={quote(data.path)}")
        try:
            with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
                return {key: npz[key] for key in npz.files}
        except (ValueError, OSError) as exc:
            invalid("data.path", data.path, f"it is not a readable .npz file ({exc}); write it with numpy.savez")

    def build_model(self, config: TrainingConfig, manifest: Manifest) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must implement build_model(config, manifest)")

    def target_spec(self, targets: np.ndarray, source: str) -> tuple[np.ndarray, ArraySpec, list[str]]:
        """The stored targets, their spec and the class names (none for regression)."""
        raise NotImplementedError

    def prepare_data(self, data: DataConfig, out_dir: str) -> Manifest:
        source = f"{type(self).__name__}.load_arrays (data.path={quote(data.path)})"
        raw = as_splits(self.load_arrays(data), source)
        targets, target_spec, classes = self.target_spec(np.concatenate([s[TARGETS] for s in raw.values()]), source)
        offset = 0
        for arrays in raw.values():
            count = len(arrays[TARGETS])
            arrays[TARGETS], offset = targets[offset : offset + count], offset + count
        splits = split_samples(raw, data, source=source)
        inputs = splits["train"][INPUTS]
        template = Manifest(
            dataset=redact(data.path) if data.path else type(self).__name__,
            classes=classes,
            input_shape=list(inputs.shape[1:]),
            mean=[],  # the model normalises its own input: the registered model takes raw samples
            std=[],
            splits={},
            workload=self.name,
            arrays={INPUTS: ArraySpec(str(inputs.dtype), list(inputs.shape[1:])), TARGETS: target_spec},
        )
        return write_prepared(out_dir, splits, template=template, num_shards=data.num_shards)

    def check(self, config: TrainingConfig, manifest: Manifest) -> None:
        if manifest.workload != self.name or set(manifest.arrays) != {INPUTS, TARGETS}:
            raise ValueError(
                f"workload.name={quote(config.workload.name)} trains {self.name!r} on arrays {INPUTS!r} and "
                f"{TARGETS!r}, but the data at {quote(manifest.directory)} was written by {manifest.workload!r} with "
                f"arrays {sorted(manifest.arrays)}; prepare the data with the same workload"
            )
        manifest.steps_per_epoch(  # names loop.batch_size or data.num_shards when a worker would get no full step
            world_size=config.scaling.num_workers,
            batch_size=config.loop.batch_size,
            grad_accum_steps=config.loop.grad_accum_steps,
        )

    def to_device(self, manifest: Manifest, device: torch.device) -> Callable[[Mapping[str, np.ndarray]], Any]:
        def convert(batch: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
            inputs = to_device_async(batch[INPUTS], device)
            return (inputs if inputs.is_floating_point() else inputs.float()), to_device_async(batch[TARGETS], device)

        return convert

    def example_input(self, manifest: Manifest) -> np.ndarray:
        return np.zeros((2, *manifest.input_shape), dtype=np.float32)


class ArrayClassification(ArrayWorkload):
    """``targets`` are class labels (any values: each distinct one is a class, in sorted order); the model returns
    logits ``[N, classes]``; cross-entropy; ``accuracy`` ranks (or set ``primary_metric = "f1"``: macro-F1)."""

    primary_metric = "accuracy"
    primary_mode = "max"
    metric_modes = {"accuracy": "max", "f1": "max", "loss": "min"}
    """Which way each metric improves: tuning ranks by any of them (``val_f1``)."""

    def target_spec(self, targets: np.ndarray, source: str) -> tuple[np.ndarray, ArraySpec, list[str]]:
        if targets.ndim != 1:
            invalid(source, f"targets of shape {targets.shape}", "a classifier's targets are one label per sample")
        classes, labels = np.unique(targets, return_inverse=True)
        if len(classes) < 2:
            invalid(source, f"targets {classes.tolist()}", "a classifier needs at least 2 distinct labels")
        names = [str(c) for c in classes.tolist()]
        return labels.astype(np.int64), ArraySpec("int64", [], max_value=len(names) - 1), names

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossOutput:
        import torch.nn.functional as F

        inputs, labels = batch
        logits = model(inputs)
        correct = (logits.detach().argmax(dim=1) == labels).sum()
        return LossOutput(F.cross_entropy(logits, labels), {"correct": correct, "samples": count(labels)}, len(labels))

    def eval_sums(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        import torch
        import torch.nn.functional as F

        inputs, labels = batch
        logits = model(inputs).float()
        predicted, num_classes = logits.argmax(dim=1), logits.shape[1]
        pairs = torch.bincount(labels * num_classes + predicted, minlength=num_classes**2)
        return {
            "loss_sum": F.cross_entropy(logits, labels, reduction="sum").double(),
            "correct": (predicted == labels).sum(),
            "samples": count(labels),
            "confusion": pairs.view(num_classes, num_classes),
        }

    def metrics(self, sums: Mapping[str, Any]) -> dict[str, float]:
        found = {"accuracy": mean_of(sums, "correct", "samples")}
        if "loss_sum" in sums:
            found["loss"] = mean_of(sums, "loss_sum", "samples")
        if "confusion" in sums:
            found["f1"] = macro_f1(sums["confusion"])
        return found


class ArrayRegression(ArrayWorkload):
    """``targets`` are numbers (one or a vector per sample, stored float32); the model returns the same shape;
    mean squared error is the loss and ranks (``min``); ``mae`` too."""

    metric_modes = {"loss": "min", "mae": "min"}

    def target_spec(self, targets: np.ndarray, source: str) -> tuple[np.ndarray, ArraySpec, list[str]]:
        values = numeric(targets, source, TARGETS).astype(np.float32)
        return values, ArraySpec("float32", list(values.shape[1:])), []

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossOutput:
        import torch.nn.functional as F

        inputs, targets = batch
        predicted = model(inputs).reshape(targets.shape)
        return LossOutput(F.mse_loss(predicted, targets), {"samples": count(targets)}, len(targets))

    def eval_sums(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        error = (model(inputs).float().reshape(targets.shape) - targets).reshape(len(targets), -1)
        return {
            "loss_sum": error.square().mean(dim=1).sum().double(),
            "abs_error_sum": error.abs().mean(dim=1).sum().double(),
            "samples": count(targets),
        }

    def metrics(self, sums: Mapping[str, Any]) -> dict[str, float]:
        found = {"loss": mean_of(sums, "loss_sum", "samples")}
        if "abs_error_sum" in sums:
            found["mae"] = mean_of(sums, "abs_error_sum", "samples")
        return found


def as_splits(source_data: Any, source: str) -> dict[str, dict[str, np.ndarray]]:
    """What ``load_arrays`` returned as split name -> {``inputs``, ``targets``}, inputs of a dtype a shard stores."""
    if isinstance(source_data, Mapping) and source_data and set(source_data) <= set(SPLIT_NAMES):
        if "train" not in source_data:
            invalid(source, sorted(source_data), "return a 'train' split (val and test are carved out of it if absent)")
        return {name: named_arrays(part, f"{source} split {name!r}") for name, part in source_data.items()}
    return {"train": named_arrays(source_data, source)}


def named_arrays(found: Any, source: str) -> dict[str, np.ndarray]:
    """``inputs`` and ``targets`` of a mapping of arrays, a Hugging Face ``datasets.Dataset`` or a map-style
    PyTorch ``Dataset``."""
    if hasattr(found, "column_names") and hasattr(found, "to_dict"):  # a datasets.Dataset: columns by name
        found = {name: np.asarray(column) for name, column in found.to_dict().items()}
    elif not isinstance(found, Mapping) and hasattr(found, "__getitem__") and hasattr(found, "__len__"):
        found = from_items(found, source)
    if not isinstance(found, Mapping):
        invalid(source, type(found).__name__, "return a mapping of array names to arrays, or a Dataset")
    missing = [name for name in (INPUTS, TARGETS) if name not in found]
    if missing:
        invalid(source, sorted(found), f"it lacks {missing}: name the model's input {INPUTS!r}, the labels {TARGETS!r}")
    inputs, targets = numeric(found[INPUTS], source, INPUTS), np.asarray(found[TARGETS])
    if len(inputs) != len(targets) or not len(inputs):
        invalid(source, f"{len(inputs)} inputs, {len(targets)} targets", "give one target per input, and samples")
    return {INPUTS: inputs, TARGETS: targets}


def from_items(dataset: Any, source: str) -> dict[str, np.ndarray]:
    """The samples of a map-style ``Dataset``, each ``(input, target)`` or a mapping with both, stacked."""
    items = [dataset[index] for index in range(len(dataset))]
    if items and isinstance(items[0], Mapping):
        return {name: np.stack([np.asarray(item[name]) for item in items]) for name in items[0]}
    if not items or not all(isinstance(item, (tuple, list)) and len(item) == 2 for item in items):
        invalid(source, type(dataset).__name__, "its items must be (input, target) pairs or mappings with both")
    return {name: np.stack([np.asarray(item[i]) for item in items]) for i, name in enumerate((INPUTS, TARGETS))}


def numeric(values: Any, source: str, name: str) -> np.ndarray:
    """``values`` as an array a shard stores: floats as float32, booleans and other integers as int64."""
    array = np.asarray(values)
    if array.dtype.kind == "f":
        array = array.astype(np.float32)
        if not np.isfinite(array).all():
            invalid(source, f"{name} with NaN or infinite values", "fill or drop those samples")
        return array
    if array.dtype.kind not in "biu":
        invalid(source, f"{name} of dtype {array.dtype}", "give numeric arrays (floats, integers or booleans)")
    return array if array.dtype.name in ARRAY_DTYPES else array.astype(np.int64)


def count(values: torch.Tensor) -> torch.Tensor:
    """How many ``values`` there are, as a 0-dim tensor on their device (summed by the loop without a sync)."""
    import torch

    return torch.tensor(values.shape[0], device=values.device)


def macro_f1(confusion: Any) -> float:
    """The mean over classes of ``2 * tp / (2 * tp + fp + fn)`` of a confusion matrix (rows true, columns
    predicted); a class neither true nor predicted counts as 1."""
    counts = np.asarray(confusion, dtype=np.float64)
    denominators = counts.sum(axis=0) + counts.sum(axis=1)
    scores = np.where(denominators > 0, 2 * counts.diagonal() / np.maximum(denominators, 1), 1.0)
    return float(scores.mean()) if scores.size else math.nan
