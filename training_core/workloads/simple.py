"""Workloads from arrays: the user writes the data (named arrays) and the model, the platform everything else.

Two ways: name the built-in ``array_classification`` or ``array_regression`` (these classes) with a
``workload.model_factory`` and, unless ``data.path`` is a ``.npz`` file holding ``inputs`` and ``targets``, a
``workload.dataset_source``; or subclass :class:`ArrayClassification` or :class:`ArrayRegression`, set ``name``, and
implement ``build_model(config, manifest)`` (and ``load_arrays(data)`` for data that is not the ``.npz``). The data
is a mapping of array name to array (first axis the samples; other arrays than ``inputs`` and ``targets`` are left
out), a mapping of split name (``train``, ``val`` or ``validation``, ``test``) to such mappings, a PyTorch map-style
``Dataset`` whose items are ``(input, target)`` pairs or mappings, or a Hugging Face ``datasets.Dataset`` (with
``column_names`` and ``with_format``) with ``inputs`` and ``targets`` columns. A Dataset is read a sample (a block of
rows) at a time into one array per column, never as a list of every sample. Prep splits it with
:func:`training_core.data.split_samples` and writes it with :func:`training_core.data.write_prepared`: the same
shards, manifest, checks and fingerprints as any workload. Losses, additive sums (``loss_sum``, ``samples``,
``correct``, ``confusion``; ``abs_error_sum``), metrics, ``check``, ``to_device`` and ``example_input`` come from
the base class; override any of them.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, NoReturn

import numpy as np

from training_core.config import DataConfig, TrainingConfig, WorkloadConfig, invalid, quote
from training_core.data import ARRAY_DTYPES, SPLIT_NAMES, ArraySpec, Manifest, split_samples, write_prepared
from training_core.messages import clip
from training_core.redact import redact
from training_core.workloads.image import example_output, user_model
from training_core.workloads.protocol import (
    Classifier,
    LossOutput,
    mean_of,
    sample_count,
    to_device_async,
)
from training_core.workloads.user_code import call_configured, load_optional, raised

if TYPE_CHECKING:
    import torch
    from torch import nn

MAX_NPZ_BYTES = 4 * 2**30
"""Most bytes the default :meth:`ArrayWorkload.load_arrays` reads from ``data.path``, and most its arrays unpack to."""
INPUTS, TARGETS = "inputs", "targets"
"""The names of the two arrays a sample of an array workload has."""
BLOCK_ROWS = 1024
"""Rows of a Hugging Face ``datasets.Dataset`` read as numpy at a time."""
SHAPE_FIX = (
    "give every sample of a column the same shape and numbers only (pad or crop them; drop or fill missing ones)"
)


class ArrayWorkload:
    """What :class:`ArrayClassification` and :class:`ArrayRegression` share: prep from arrays, ``check``,
    ``to_device`` and ``example_input``. A subclass sets ``name`` and implements ``build_model``."""

    name = "array_workload"
    primary_metric = "loss"
    primary_mode = "min"
    params: Any = None
    """``workload.params``: set by the platform."""
    selected: WorkloadConfig | None = None
    dataset_source: Callable[..., Any] | None = None
    model_factory: Callable[..., Any] | None = None

    def __init__(self, selected: WorkloadConfig | None = None) -> None:
        """A user's subclass is built with no arguments; the built-ins ``array_classification`` and
        ``array_regression`` with the config's ``workload`` section, whose ``dataset_source`` (when set) gives the
        data and whose ``model_factory`` builds the model (both imported here)."""
        if selected is not None:
            self.selected, self.params = selected, dict(selected.params)
            self.dataset_source = load_optional("workload.dataset_source", selected.dataset_source)
            self.model_factory = load_optional("workload.model_factory", selected.model_factory)

    def load_arrays(self, data: DataConfig) -> Any:
        """The samples: what ``workload.dataset_source`` returns (given ``data`` and, when it has that parameter,
        ``params=``), else the arrays of the ``.npz`` file ``data.path`` (read as a regular file)."""
        from training_core.files import read_regular_path

        if self.dataset_source is not None:
            assert self.selected is not None, "a dataset source comes with the workload section that names it"
            return call_configured(self.selected, "dataset_source", self.dataset_source, data)
        if not data.path:
            invalid(
                "data.path",
                data.path,
                f"name a .npz file holding {INPUTS!r} and {TARGETS!r}, or set workload.dataset_source (or override "
                "load_arrays)",
            )
        payload = read_regular_path(data.path, max_bytes=MAX_NPZ_BYTES, name=f"data.path={quote(data.path)}")
        try:
            with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
                # Compressed, a few MB can unpack to any size: the cap holds for what the arrays unpack to as well.
                unpacked = sum(info.file_size for info in npz.zip.infolist())
                arrays = {key: npz[key] for key in npz.files} if unpacked <= MAX_NPZ_BYTES else None
        except (ValueError, OSError) as exc:
            invalid("data.path", data.path, f"it is not a readable .npz file ({exc}); write it with numpy.savez")
        if arrays is None:
            fix = f"keep only {INPUTS!r} and {TARGETS!r} in it, or override load_arrays"
            invalid("data.path", data.path, f"its arrays unpack to {unpacked:,} bytes, over {MAX_NPZ_BYTES:,}; {fix}")
        return arrays

    def build_model(self, config: TrainingConfig, manifest: Manifest) -> nn.Module:
        """The model ``workload.model_factory`` builds (the built-ins); a subclass writes its own."""
        if self.model_factory is None:
            raise NotImplementedError(f"{type(self).__name__} must implement build_model(config, manifest)")
        return user_model(config, manifest, self.model_factory)

    output_reshaped = False
    """Whether the loss reshapes the model's output to the targets' shape (so any output of as many values fits)."""

    def expected_output(self, manifest: Manifest, batch: int) -> tuple[int, ...]:
        """The shape of the model's output on ``batch`` samples."""
        raise NotImplementedError

    def output_meaning(self, manifest: Manifest) -> str:
        """What the model's output is, in words."""
        raise NotImplementedError

    def source_name(self, data: DataConfig) -> str:
        """Where the samples come from, as the messages about them name it."""
        if self.dataset_source is not None:
            assert self.selected is not None, "a dataset source comes with the workload section that names it"
            return f"workload.dataset_source={quote(self.selected.dataset_source)}"
        return f"{type(self).__name__}.load_arrays (data.path={quote(data.path)})"

    def target_spec(self, targets: np.ndarray, source: str) -> tuple[np.ndarray, ArraySpec, list[str]]:
        """The stored targets, their spec and the class names (none for regression)."""
        raise NotImplementedError

    def prepare_data(self, data: DataConfig, out_dir: str) -> Manifest:
        source = self.source_name(data)
        raw = as_splits(self.load_arrays(data), source)
        by_split = {name: arrays[TARGETS] for name, arrays in raw.items()}
        if len({(t.shape[1:], t.dtype.kind in "US") for t in by_split.values()}) > 1:  # numpy would make numbers text
            found = {name: f"{t.dtype} {list(t.shape[1:])}" for name, t in by_split.items()}
            refuse(source, f"column {TARGETS!r} whose samples differ by split ({found})", SHAPE_FIX)
        targets, target_spec, classes = self.target_spec(np.concatenate(list(by_split.values())), source)
        ends = np.cumsum([len(arrays[TARGETS]) for arrays in raw.values()])
        for arrays, split_targets in zip(raw.values(), np.split(targets, ends[:-1])):
            arrays[TARGETS] = split_targets
        splits = split_samples(raw, data, source=source)
        inputs = splits["train"][INPUTS]
        template = Manifest(
            dataset=(self.selected.dataset_source if self.selected else "")
            or (redact(data.path) if data.path else type(self).__name__),
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
        if self.model_factory is not None:
            self.check_factory_model(config, manifest)

    def check_factory_model(self, config: TrainingConfig, manifest: Manifest) -> None:
        """Build the ``workload.model_factory`` model once and run :meth:`example_input` through it, so a factory
        that fails or a model that does not fit the data fails in the driver, before any worker starts."""
        model = user_model(config, manifest, self.model_factory)
        example = self.example_input(manifest)
        expected = self.expected_output(manifest, len(example))
        found = example_output(model, example)
        reshaped = self.output_reshaped and isinstance(found, tuple) and math.prod(found) == math.prod(expected)
        if found == expected or reshaped:
            return
        if isinstance(found, Exception):
            problem = f"fails ({raised(found)})"
        else:
            problem = f"returns {found or 'Tensor'}"  # a 0-dim output () is named by its type
        invalid(
            "workload.model_factory",
            config.workload.model_factory,
            f"its {type(model).__name__} {problem} on a batch of inputs {example.shape}; build a model for "
            f"inputs of shape {manifest.input_shape} returning {expected} ({self.output_meaning(manifest)})",
        )

    def to_device(self, manifest: Manifest, device: torch.device) -> Callable[[Mapping[str, np.ndarray]], Any]:
        def convert(batch: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
            inputs = to_device_async(batch[INPUTS], device)
            return (inputs if inputs.is_floating_point() else inputs.float()), to_device_async(batch[TARGETS], device)

        return convert

    def example_input(self, manifest: Manifest) -> np.ndarray:
        return np.zeros((2, *manifest.input_shape), dtype=np.float32)


class ArrayClassification(ArrayWorkload, Classifier):
    """``targets`` are class labels (any values: each distinct one is a class, in sorted order); the model returns
    logits ``[N, classes]``; cross-entropy; ``accuracy`` ranks (or set ``primary_metric = "f1"``: macro-F1)."""

    name = "array_classification"
    primary_metric = "accuracy"
    primary_mode = "max"
    metric_modes = {"accuracy": "max", "f1": "max", "loss": "min"}
    """Which way each metric improves: tuning ranks by any of them (``val_f1``)."""
    f1_name = "f1"

    def expected_output(self, manifest: Manifest, batch: int) -> tuple[int, ...]:
        return (batch, manifest.num_classes)

    def output_meaning(self, manifest: Manifest) -> str:
        return f"logits: the batch, the data's {manifest.num_classes} classes"

    def target_spec(self, targets: np.ndarray, source: str) -> tuple[np.ndarray, ArraySpec, list[str]]:
        if targets.ndim != 1:
            refuse(
                source,
                f"column {TARGETS!r} of shape {targets.shape}",
                "a classifier's targets are one label per sample",
            )
        if targets.dtype.kind not in "biufUS":
            refuse(
                source, f"column {TARGETS!r} of dtype {targets.dtype}", "give labels as numbers, strings or booleans"
            )
        if targets.dtype.kind == "f" and not np.isfinite(targets).all():
            where = int(np.flatnonzero(~np.isfinite(targets))[0])
            refuse(
                source,
                f"column {TARGETS!r} with a NaN or infinite label (sample {where}: a missing label)",
                "drop those samples or give them their label",
            )
        classes, labels = np.unique(targets, return_inverse=True)
        if len(classes) < 2:
            refuse(
                source,
                f"column {TARGETS!r} of labels {clip(str(classes.tolist()))}",
                "a classifier needs at least 2 distinct labels",
            )
        names = [str(c) for c in classes.tolist()]
        return labels.astype(np.int64), ArraySpec("int64", [], max_value=len(names) - 1), names


class ArrayRegression(ArrayWorkload):
    """``targets`` are numbers (one or a vector per sample, stored float32); the model returns the same shape;
    mean squared error is the loss and ranks (``min``); ``mae`` too."""

    name = "array_regression"
    metric_modes = {"loss": "min", "mae": "min"}
    output_reshaped = True

    def expected_output(self, manifest: Manifest, batch: int) -> tuple[int, ...]:
        return (batch, *manifest.arrays[TARGETS].shape)

    def output_meaning(self, manifest: Manifest) -> str:
        return "predictions: the batch, then the shape of a sample's targets"

    def target_spec(self, targets: np.ndarray, source: str) -> tuple[np.ndarray, ArraySpec, list[str]]:
        values = numeric(targets, source, TARGETS).astype(np.float32)
        return values, ArraySpec("float32", list(values.shape[1:])), []

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossOutput:
        import torch.nn.functional as F

        inputs, targets = batch
        predicted = model(inputs).reshape(targets.shape)
        return LossOutput(F.mse_loss(predicted, targets), {"samples": sample_count(targets)}, len(targets))

    def eval_sums(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        error = (model(inputs).float().reshape(targets.shape) - targets).reshape(len(targets), -1)
        return {
            "loss_sum": error.square().mean(dim=1).sum().double(),
            "abs_error_sum": error.abs().mean(dim=1).sum().double(),
            "samples": sample_count(targets),
        }

    def metrics(self, sums: Mapping[str, Any]) -> dict[str, float]:
        found = {"loss": mean_of(sums, "loss_sum", "samples")}
        if "abs_error_sum" in sums:
            found["mae"] = mean_of(sums, "abs_error_sum", "samples")
        return found


SPLIT_ALIASES = {"validation": "val"}
"""Split names of other libraries (a Hugging Face ``DatasetDict``'s) -> ours."""


def as_splits(source_data: Any, source: str) -> dict[str, dict[str, np.ndarray]]:
    """What ``load_arrays`` returned as split name -> {``inputs``, ``targets``}, inputs of a dtype a shard stores."""
    if isinstance(source_data, Mapping) and source_data:
        named = {SPLIT_ALIASES.get(name, name): part for name, part in source_data.items()}
        if set(named) <= set(SPLIT_NAMES) and len(named) == len(source_data):
            if "train" not in named:
                refuse(
                    source,
                    f"splits {sorted(source_data)}",
                    "return a 'train' split (val and test are carved out of it if absent)",
                )
            return {name: named_arrays(part, f"{source} split {name!r}") for name, part in named.items()}
    return {"train": named_arrays(source_data, source)}


def named_arrays(found: Any, source: str) -> dict[str, np.ndarray]:
    """``inputs`` and ``targets`` of a mapping of arrays, a Hugging Face ``datasets.Dataset`` or a map-style
    PyTorch ``Dataset``; ``ValueError`` naming ``source``, the column and the fix for what a shard cannot store."""
    if hasattr(found, "column_names") and hasattr(found, "with_format") and hasattr(found, "__len__"):
        found = stacked(table_blocks(found, source), len(found), source)
    elif not isinstance(found, Mapping) and hasattr(found, "__getitem__") and hasattr(found, "__len__"):
        found = stacked(item_blocks(found, source), len(found), source)
    if not isinstance(found, Mapping):
        refuse(
            source,
            f"a {type(found).__name__}",
            "return a mapping of array names to arrays, or a Dataset: a map-style torch Dataset (__len__ and "
            "__getitem__) or a Hugging Face datasets.Dataset (not an iterable or streaming one)",
        )
    missing = [name for name in (INPUTS, TARGETS) if name not in found]
    if missing:
        refuse(
            source,
            f"columns {clip(str(sorted(map(str, found))))}",
            f"it lacks {missing}: name the model's input {INPUTS!r}, the labels {TARGETS!r}",
        )
    inputs, targets = numeric(found[INPUTS], source, INPUTS), as_array(found[TARGETS], source, TARGETS)
    if len(inputs) != len(targets) or not len(inputs):
        refuse(source, f"{len(inputs)} inputs, {len(targets)} targets", "give one target per input, and samples")
    return {INPUTS: inputs, TARGETS: targets}


def table_blocks(dataset: Any, source: str) -> Iterator[dict[str, Any]]:
    """The ``inputs`` and ``targets`` columns of a Hugging Face ``datasets.Dataset``, :data:`BLOCK_ROWS` rows at a
    time as numpy arrays (other columns, of any type, are not read)."""
    missing = [name for name in (INPUTS, TARGETS) if name not in dataset.column_names]
    if missing:
        refuse(
            source,
            f"a datasets.Dataset of columns {clip(str(dataset.column_names))}",
            f"it lacks {missing}: name the model's input column {INPUTS!r} and the labels {TARGETS!r} "
            "(dataset.rename_column)",
        )
    table = dataset.select_columns([INPUTS, TARGETS]).with_format("numpy")
    for start in range(0, len(table), BLOCK_ROWS):
        yield table[start : start + BLOCK_ROWS]


def item_blocks(dataset: Any, source: str) -> Iterator[dict[str, Any]]:
    """The samples of a map-style ``Dataset``, each ``(input, target)`` or a mapping with both, one at a time as
    blocks of one row."""
    for index in range(len(dataset)):
        item = dataset[index]
        if isinstance(item, Mapping) and INPUTS in item and TARGETS in item:
            pair = item[INPUTS], item[TARGETS]
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            pair = item[0], item[1]
        else:
            kind = f"a {type(item).__name__}" + (f" of {len(item)}" if isinstance(item, (tuple, list)) else "")
            refuse(
                source,
                f"a {type(dataset).__name__} whose item {index} is {clip(kind)}",
                f"its items must be (input, target) pairs or mappings with {INPUTS!r} and {TARGETS!r}",
            )
        yield {name: as_array(value, source, name, samples=False)[None] for name, value in zip((INPUTS, TARGETS), pair)}


def stacked(blocks: Iterator[Mapping[str, Any]], count: int, source: str) -> dict[str, np.ndarray]:
    """``count`` samples, given as blocks (column name -> the block's samples), written into one array per column
    allocated at the first block: the memory of the result and of one block, not of a list of every sample. Inputs
    are stored numbers as they come (:func:`numeric`)."""
    if not count:
        refuse(source, "a Dataset of no samples", "give it samples")
    columns: dict[str, np.ndarray] = {}
    start = 0
    for block in blocks:
        size = 0
        for name, values in block.items():
            array = numeric(values, source, name) if name == INPUTS else as_array(values, source, name)
            column = columns.get(name)
            if column is None:
                column = columns[name] = np.empty((count, *array.shape[1:]), dtype=array.dtype)
            elif array.shape[1:] != column.shape[1:]:
                refuse(
                    source,
                    f"column {name!r} of samples of shape {list(column.shape[1:])} and, from sample {start}, "
                    f"{list(array.shape[1:])}",
                    SHAPE_FIX,
                )
            elif array.dtype != column.dtype:
                if (column.dtype.kind in "US") != (array.dtype.kind in "US"):  # numpy would make the numbers strings
                    refuse(source, f"column {name!r} mixing {column.dtype} and {array.dtype} values", SHAPE_FIX)
                column = columns[name] = column.astype(np.result_type(column.dtype, array.dtype))
            column[start : start + len(array)], size = array, len(array)
        start += size
    if start != count:
        refuse(source, f"{start} samples from a Dataset of length {count}", "make __len__ the number of samples")
    return columns


def as_array(values: Any, source: str, name: str, *, samples: bool = True) -> np.ndarray:
    """``values`` (an array, a tensor, a list: of samples, or one sample when not ``samples``) as a numpy array of
    numbers or strings, or ``ValueError`` naming ``source`` and the column: samples of different shapes, missing ones
    or Python objects cannot be stored."""
    try:
        array = np.asarray(values)
    except (ValueError, TypeError, RuntimeError) as exc:  # numpy 2 refuses ragged lists; a tensor that needs grad
        refuse(source, f"column {name!r} that is no array ({raised(exc)})", SHAPE_FIX)
    if array.dtype.hasobject:
        refuse(
            source, f"column {name!r} of dtype object (samples of different shapes, None or Python objects)", SHAPE_FIX
        )
    if samples and array.ndim == 0:
        refuse(
            source, f"column {name!r} holding one value, not samples", "give an array whose first axis is the samples"
        )
    return array


def numeric(values: Any, source: str, name: str) -> np.ndarray:
    """``values`` as an array a shard stores: floats as float32, booleans and other integers as int64."""
    array = as_array(values, source, name)
    if array.dtype.kind == "f":
        array = array.astype(np.float32, copy=False)
        if not np.isfinite(array).all():
            refuse(source, f"column {name!r} with NaN or infinite values", "fill or drop those samples")
        return array
    if array.dtype.kind not in "biu":
        refuse(
            source,
            f"column {name!r} of dtype {array.dtype}",
            "give numeric arrays (floats, integers or booleans): encode text or categories as numbers first",
        )
    return array if array.dtype.name in ARRAY_DTYPES else array.astype(np.int64)


def refuse(source: str, found: str, fix: str) -> NoReturn:
    """Raise the error of data a shard cannot store: where it came from, what it is and the fix."""
    raise ValueError(f"{source} gave {clip(found)}; {clip(fix, 2000)}")
