"""Prepared data: the manifest, the ``.npz`` shard files and the per-worker shard stream (:mod:`training_core.data`
re-exports them beside ``prepare``, whose docstring describes the layout; the workloads write and read through this
module).

A manifest is data, never a path out: it is validated whole against its schema when read (every shard file a
plain name inside the directory, counts that add up, label ranges within the classes), and each shard is checked
against it when read (sha256, count, shape, dtypes, labels), so bad data fails when training starts, naming the
file, rather than thousands of steps in.

Every rank derives the same number of steps per epoch from the manifest, so DDP ranks never wait on a peer that ran
out of data (:mod:`training_core.data.loader` orders an epoch and cuts it between the ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import logging
import math
import os
import re
import zipfile
from dataclasses import asdict, dataclass, field, make_dataclass
from typing import Annotated, Any, Iterable, Iterator, Mapping, NoReturn

import numpy as np

from training_core.config import DataConfig
from training_core.data.shard_files import (
    RERUN_PREP,
    SPLIT_NAMES,
    check_sha256,
    held_out,
    plain_shard_name,
    read_verified,
    shard_error,
    shard_where,
)
from training_core.files import MissingFile, UnreadableFile, join_path, read_regular_path
from training_core.messages import clip, listed, quote
from training_core.redact import redact
from training_core.schema import UNKNOWN_KEY_KINDS, Count, Problem, Rule, SchemaError, check, is_int, is_mapping

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 256 * 2**20
"""The most bytes read of a ``manifest.json``: about 150 bytes a shard, so over a million shards."""
MANIFEST_VERSION = 4
"""4 records the shard format (``npz`` arrays or ``parquet`` encoded images) and the bad samples prep skipped.
3 names the workload and the arrays every sample has, with each shard's value bounds. 2 recorded each shard's
label range, 1 none; both still load (images and labels)."""

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass
class ArraySpec:
    """One array every sample of a prepared dataset has (images, labels, tokens, features)."""

    dtype: str
    """numpy dtype name: ``uint8``, ``uint16``, ``int32``, ``int64``, ``float32``."""
    shape: list[int]
    """One sample's shape (``[]`` for a scalar such as a label)."""
    max_value: int | None = None
    """Integer arrays whose values index something (labels, token ids): every value is in ``[0, max_value]``,
    checked per shard against the shard's recorded bounds. ``None`` for other arrays."""


@dataclass
class ShardInfo:
    file: str
    """File name relative to the data directory."""
    num_samples: int
    sha256: str
    bounds: dict[str, list[int]] = field(default_factory=dict)
    """Per bounded array (``max_value`` set): the shard's smallest and largest value. Empty only in a
    version-1 manifest."""


@dataclass
class SplitInfo:
    num_samples: int
    shards: list[ShardInfo]


@dataclass
class Manifest:
    dataset: str
    classes: list[str]
    """Class names, indexed by label; empty for a workload without classes (a language model)."""
    input_shape: list[int]
    """One model input sample's shape: channels, height, width for images; ``[seq_len]`` for text."""
    mean: list[float]
    """Per-channel mean of the training split on the 0..1 scale (images; empty where there is none)."""
    std: list[float]
    """Per-channel standard deviation of the training split on the 0..1 scale (images; empty otherwise)."""
    splits: dict[str, SplitInfo]
    workload: str = "image_classification"
    """The workload that wrote the data (``workload.name``)."""
    arrays: dict[str, ArraySpec] = field(default_factory=dict)
    """What each shard stores per sample. Empty in a version-1/2 manifest: images and labels."""
    spec: dict[str, Any] = field(default_factory=dict)
    """The workload's own description of the data (a language model's vocabulary and tokenizer), JSON."""
    format: str = "npz"
    """How shards store samples: ``npz`` (the arrays, uint8 images at their prepared size) or ``parquet`` (images
    encoded as they came, decoded and augmented by the loader; :mod:`training_core.data.image_shards`)."""
    bad_samples: dict[str, Any] = field(default_factory=lambda: {"count": 0, "examples": []})
    """Samples prep skipped because they did not decode: ``count`` and the first ``examples`` (``source: reason``)."""
    version: int = MANIFEST_VERSION
    directory: str = field(default="", compare=False)
    """Where the manifest was read from (not stored)."""

    def __post_init__(self) -> None:
        if not self.arrays:  # written before version 3: images and labels
            self.arrays = self.image_arrays()

    def image_arrays(self) -> dict[str, ArraySpec]:
        """What image classification stores: uint8 images of :attr:`input_shape` and int64 labels, one per class."""
        return {
            "images": ArraySpec("uint8", list(self.input_shape)),
            "labels": ArraySpec("int64", [], max_value=len(self.classes) - 1),
        }

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def split_counts(self) -> dict[str, int]:
        return {name: split.num_samples for name, split in self.splits.items()}

    def to_json(self) -> str:
        """The manifest as written (an older one loaded keeps its own form: the keys :data:`_TOP` gives its version)."""
        payload = {key: value for key, value in asdict(self).items() if key in _TOP and self.version in _TOP[key][0]}
        if self.version < 3:
            for split in payload["splits"].values():
                for shard in split["shards"]:
                    bounds = shard.pop("bounds")
                    if self.version == 2:
                        shard["label_min"], shard["label_max"] = bounds["labels"]
        return json.dumps(payload, indent=2, sort_keys=True)

    def description(self) -> dict[str, Any]:
        """Everything but the splits: what a model trained on this data needs to be rebuilt (kept in checkpoints)."""
        payload = json.loads(self.to_json())
        payload.pop("splits")
        return payload

    @classmethod
    def from_description(cls, raw: Mapping[str, Any]) -> "Manifest":
        """The manifest :meth:`description` returned, with no splits (for rebuilding a model)."""
        return _parse_manifest(
            {**raw, "splits": {"train": {"num_samples": 0, "shards": []}}}, where="a description", directory=""
        )

    @classmethod
    def from_json(cls, text: str, *, directory: str = "") -> "Manifest":
        """The manifest in ``text``, validated whole before anything uses it: types, required and unknown keys,
        ranges, every shard a plain file name inside ``directory``, counts that add up and label ranges within
        the classes. Anything else raises ``ValueError`` naming the manifest file and the field."""
        where = _where(directory)
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{where} is not valid JSON ({clip(str(exc))}); {RERUN_PREP}") from None
        return _parse_manifest(raw, where=where, directory=directory)

    @classmethod
    def load(cls, directory: str) -> "Manifest":
        """The manifest of a prepared data directory (see :meth:`from_json`), read as a regular file of at most
        :data:`MAX_MANIFEST_BYTES` (a FIFO or a device named ``manifest.json`` is refused, never read)."""
        try:
            payload = read_regular_path(join_path(directory, MANIFEST_NAME), max_bytes=MAX_MANIFEST_BYTES)
        except MissingFile:
            raise ValueError(
                f"{_where(directory)} is missing: the directory holds no prepared data; {RERUN_PREP}"
            ) from None
        except UnreadableFile as exc:
            raise ValueError(f"{_where(directory)} cannot be read: {exc}; {RERUN_PREP}") from None
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{_where(directory)} is not UTF-8 text ({exc.reason} at byte {exc.start}); {RERUN_PREP}"
            ) from None
        return cls.from_json(text, directory=directory)

    def steps_per_epoch(self, *, world_size: int, batch_size: int, grad_accum_steps: int) -> int:
        """Optimizer steps every rank takes in one epoch: each trains an equal share of the training split."""
        per_rank = self.splits["train"].num_samples // world_size
        steps = per_rank // (batch_size * grad_accum_steps)
        if steps == 0:
            raise ValueError(
                f"loop.batch_size={batch_size} is too large: with loop.grad_accum_steps={grad_accum_steps} and "
                f"{world_size} workers each worker has {per_rank} training samples, not enough for one "
                "step; lower loop.batch_size or scaling.num_workers"
            )
        return steps


def _where(directory: str) -> str:
    """The manifest file as an error names it, with any URL credentials redacted."""
    return clip(redact(join_path(directory, MANIFEST_NAME) if directory else MANIFEST_NAME), 500)


@dataclass
class _Schema:
    """Words the checks of one parsed manifest: ``ValueError`` with the manifest file and the field path."""

    where: str

    def fail(self, path: str, value: Any, why: str) -> NoReturn:
        raise ValueError(f"{self.where}: {clip(path)}={quote(value)} is invalid: {why}; {RERUN_PREP}")

    def keys(self, path: str, missing: list[str], unknown: list[Any], keys: Iterable[str]) -> NoReturn:
        found = f"lacks {', '.join(missing)}" if missing else f"has unknown key(s) {listed(unknown)}"
        raise ValueError(f"{self.where}: {clip(path)} {found}; its keys are {', '.join(keys)}; {RERUN_PREP}")

    def problem(self, problems: list[Problem]) -> NoReturn:
        """The schema layer's ``problems`` as the first check meets them: a mapping's missing keys, then its unknown
        keys, before anything inside it."""
        first, kinds = problems[0], ("missing", *UNKNOWN_KEY_KINDS)  # pydantic's order: depth first, keys in order
        at = first.loc[:-2] if first.loc[-1:] == ("[key]",) else first.loc  # a bad key: before its value
        keyed = [p for p in problems if p.kind in kinds and p.loc[:-1] == at[: len(p.loc) - 1]]
        if keyed:  # the outermost mapping around the first problem that lacks keys or has unknown ones
            owner = min((p.loc[:-1] for p in keyed), key=len)
            same = [p for p in keyed if p.loc[:-1] == owner]
            missing = [p.loc[-1] for p in same if p.kind == "missing"]
            self.keys(_path(owner), missing, [p.key for p in same if p.kind != "missing"], same[0].fields)
        fields = ", ".join(first.fields)
        why = {"dataclass_type": f"expected an object with the keys {fields}", "list_type": "expected a list"}
        self.fail(_path(first.loc), first.value, why.get(first.kind, first.fix))

    def integer(self, path: str, value: Any, minimum: int, maximum: int) -> int:
        if not is_int(value) or not minimum <= value <= maximum:
            self.fail(path, value, f"expected an integer {minimum}..{maximum}")
        return value

    def items(self, path: str, value: Any, length: int) -> list:
        if not isinstance(value, list) or len(value) != length:
            self.fail(path, value, f"expected a list of {length}")
        return value

    def numbers(self, path: str, value: Any, length: int, *, positive: bool) -> list[float]:
        numbers = []
        for index, item in enumerate(self.items(path, value, length)):
            # An integer beyond a float's range is as unusable as JSON's Infinity or NaN.
            number = float(item) if isinstance(item, float) or (is_int(item) and abs(item) < 2**1000) else math.nan
            if not math.isfinite(number):
                self.fail(f"{path}[{index}]", item, "expected a finite number")
            if positive and not number > 0:
                self.fail(f"{path}[{index}]", item, "expected a number > 0")
            numbers.append(number)
        return numbers


def _path(loc: tuple) -> str:
    """A location in the manifest as its messages name it: ``splits.train.shards[0].file``."""
    loc = loc[:-2] if loc[-1:] == ("[key]",) else loc  # a bad key: the mapping holds it
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)[1:] or "manifest"


SHARD_FORMATS = {"npz": ".npz", "parquet": ".parquet"}
"""Shard formats and their files' suffix."""
ARRAY_DTYPES = ("uint8", "uint16", "int32", "int64", "float32")
"""What a shard may store: nothing numpy would need pickles or object arrays for."""

# What a manifest holds, for the schema layer (strict; Any: checked after it, against other keys).
_Text = Annotated[str, Rule(lambda v: isinstance(v, str) and v != "", "a non-empty string")]
_Size = Annotated[int, Rule(lambda v: is_int(v) and v >= 1, "an integer >= 1")]  # prep never writes an empty shard
_Dtype = Annotated[str, Rule(ARRAY_DTYPES.__contains__, f"one of {', '.join(ARRAY_DTYPES)}")]
_Array = make_dataclass("_Array", [("dtype", _Dtype), ("shape", list[_Size]), ("max_value", Any)], frozen=True)
_ArrayName = Annotated[str, Rule(str.isidentifier, "", "an array is named like a Python identifier")]
_Arrays = Annotated[
    dict[_ArrayName, _Array],
    Rule(lambda v: isinstance(v, dict) and v, "an object of array name -> {dtype, shape, max_value}", keep_type=True),
]
_Format = Annotated[str, Rule(lambda v: isinstance(v, str) and v in SHARD_FORMATS, "one of npz, parquet")]
_BadSamples = make_dataclass("_BadSamples", [("count", Count), ("examples", list[_Text])], frozen=True)
_Sha256 = Annotated[str, Rule(lambda v: isinstance(v, str) and _SHA256.fullmatch(v), "64 lowercase hex digits")]
_SplitName = Annotated[str, Rule(SPLIT_NAMES.__contains__, "", f"a split is named {', '.join(SPLIT_NAMES)}")]
_WITH_TRAIN = Rule(lambda v: isinstance(v, dict) and "train" in v, "", keep_type=True,
    fix=f"expected an object of splits ({', '.join(SPLIT_NAMES)}) with train")  # fmt: skip
_LIST_OF_3 = Rule(lambda v: isinstance(v, list) and len(v) == 3, "a list of 3", keep_type=True)
_ALL = (1, 2, 3, 4)
_TOP = {  # each key of a manifest, in its order: the versions that have it, and its type (see _on_disk)
    "version": (_ALL, Any), "workload": ((3, 4), _Text), "dataset": (_ALL, _Text), "classes": (_ALL, list[_Text]),
    "input_shape": (_ALL, list[_Size]), "mean": (_ALL, Any), "std": (_ALL, Any), "arrays": ((3, 4), _Arrays),
    "spec": ((3, 4), Annotated[dict, Rule(is_mapping, "a JSON object")]), "format": ((4,), _Format),
    "bad_samples": ((4,), _BadSamples), "splits": (_ALL, Any),
}  # fmt: skip
_SHARD = {  # the same for each shard of a split
    "file": (_ALL, Any), "num_samples": (_ALL, _Size), "sha256": (_ALL, _Sha256), "label_min": ((2,), Any),
    "label_max": ((2,), Any), "bounds": ((3, 4), Any),
}  # fmt: skip


@functools.cache
def _on_disk(version: int) -> type:
    """A manifest of ``version`` as written: its keys, in order, and their types."""

    def fields(table: dict, **types: Any) -> list:
        return [(key, types.get(key, hint)) for key, (versions, hint) in table.items() if version in versions]

    shard = make_dataclass("_Shard", fields(_SHARD))
    split = make_dataclass("_Split", [("num_samples", Count), ("shards", list[shard])])
    splits = Annotated[dict[_SplitName, split], _WITH_TRAIN]
    shape = {"input_shape": Annotated[list[_Size], _LIST_OF_3]} if version < 3 else {}
    return make_dataclass(f"_ManifestV{version}", fields(_TOP, splits=splits, **shape))


def _parse_manifest(raw: Any, *, where: str, directory: str) -> Manifest:
    """The manifest in ``raw`` (parsed JSON of any of versions 1 to :data:`MANIFEST_VERSION`), checked whole."""
    schema = _Schema(where)
    version = raw.get("version") if isinstance(raw, dict) else MANIFEST_VERSION
    if not is_int(version) or version not in _ALL:
        schema.fail("version", version, f"this code reads versions 1 to {MANIFEST_VERSION}")
    try:
        disk = check(_on_disk(version), raw)
    except SchemaError as exc:
        schema.problem(exc.problems)
    manifest = _parse_header(schema, disk, directory)
    if manifest.version >= 3 and manifest.workload == "image_classification":
        _check_image_manifest(schema, manifest, raw["arrays"])
    files: set[str] = set()
    for name, split in disk.splits.items():
        manifest.splits[name] = _parse_split(schema, manifest, name, split, files)
    return manifest


def _parse_header(schema: _Schema, disk: Any, directory: str) -> Manifest:
    """Everything of the manifest ``disk`` (its types checked) but its splits."""
    version = disk.version
    if not disk.classes and version < 3:
        schema.fail("classes", disk.classes, "expected at least one class name")
    if len(set(disk.classes)) != len(disk.classes):
        schema.fail("classes", disk.classes, "class names must be unique")
    if not disk.input_shape:
        schema.fail("input_shape", disk.input_shape, "expected the shape of one input sample")
    num_stats = disk.input_shape[0] if version < 3 or disk.mean else 0
    mean = schema.numbers("mean", disk.mean, num_stats, positive=False)
    std = schema.numbers("std", disk.std, num_stats, positive=True)
    kept = {key: getattr(disk, key) for key in ("workload", "spec", "format") if hasattr(disk, key)}  # else defaults
    if version >= 3:
        kept["arrays"] = _parse_arrays(schema, disk.arrays)
    if version >= 4:
        kept["bad_samples"] = asdict(disk.bad_samples)
    manifest = Manifest(
        dataset=disk.dataset,
        classes=list(disk.classes),
        input_shape=list(disk.input_shape),
        mean=mean,
        std=std,
        splits={},
        version=version,
        directory=directory,
        **kept,
    )
    if manifest.format == "parquet" and manifest.workload != "image_classification":
        schema.fail("format", manifest.format, "parquet shards hold encoded images (workload image_classification)")
    return manifest


def _parse_split(schema: _Schema, manifest: Manifest, name: str, split: Any, files: set[str]) -> SplitInfo:
    """The split ``name`` of ``manifest``; ``files`` (the shard files of the splits before it) gains its own."""
    shards = [
        _parse_shard(schema, manifest, f"splits.{name}.shards[{index}]", shard, files)
        for index, shard in enumerate(split.shards)
    ]
    total = sum(s.num_samples for s in shards)
    if total != split.num_samples:
        schema.fail(f"splits.{name}.num_samples", split.num_samples, f"its shards hold {total} samples")
    return SplitInfo(num_samples=split.num_samples, shards=shards)


def _parse_shard(schema: _Schema, manifest: Manifest, path: str, disk: Any, files: set[str]) -> ShardInfo:
    """The shard at ``path`` of ``manifest``: a plain file name no other shard names, its hash and its bounds."""
    version, shard_format = manifest.version, manifest.format
    file = plain_shard_name(disk.file, lambda why: schema.fail(f"{path}.file", disk.file, why))
    if file in files:
        schema.fail(f"{path}.file", file, "another shard names the same file")
    if version >= 4 and not file.endswith(SHARD_FORMATS[shard_format]):
        schema.fail(f"{path}.file", file, f"a {shard_format} shard's name ends in {SHARD_FORMATS[shard_format]}")
    files.add(file)
    shard = ShardInfo(file=file, num_samples=disk.num_samples, sha256=disk.sha256)
    if version == 2:
        last = len(manifest.classes) - 1
        low = schema.integer(f"{path}.label_min", disk.label_min, 0, last)
        high = schema.integer(f"{path}.label_max", disk.label_max, low, last)
        shard.bounds = {"labels": [low, high]}
    if version >= 3:
        bounded = {name: a.max_value for name, a in manifest.arrays.items() if a.max_value is not None}
        shard.bounds = _parse_bounds(schema, f"{path}.bounds", disk.bounds, bounded)
    return shard


def _check_image_manifest(schema: _Schema, manifest: Manifest, raw_arrays: Any) -> None:
    """What image classification reads, as versions 1 and 2 always held it: class names, channels x height x width,
    a mean and std per channel, and exactly its uint8 images and int64 labels, one label per class."""
    if not manifest.classes:
        schema.fail("classes", manifest.classes, "expected at least one class name")
    shape = manifest.input_shape
    if len(shape) != 3:
        schema.fail("input_shape", shape, "expected a list of 3")
    for name in ("mean", "std"):
        if len(getattr(manifest, name)) != shape[0]:
            schema.fail(name, getattr(manifest, name), f"expected a list of {shape[0]}")
    if manifest.arrays != manifest.image_arrays():
        schema.fail(
            "arrays",
            raw_arrays,
            f"image_classification data stores images uint8 {shape} and labels int64 [] with max_value "
            f"{len(manifest.classes) - 1} (one per class)",
        )


def _parse_arrays(schema: _Schema, disk: dict[str, _Array]) -> dict[str, ArraySpec]:
    for name, spec in disk.items():
        if spec.max_value is not None and spec.dtype == "float32":
            schema.fail(f"arrays.{name}.max_value", spec.max_value, "only integer arrays are bounded; use null")
        if spec.max_value is not None:
            schema.integer(f"arrays.{name}.max_value", spec.max_value, 0, 2**62)
    return {name: ArraySpec(spec.dtype, list(spec.shape), spec.max_value) for name, spec in disk.items()}


def _parse_bounds(schema: _Schema, path: str, raw: Any, bounded: dict[str, int]) -> dict[str, list[int]]:
    if not isinstance(raw, dict):
        schema.fail(path, raw, f"expected an object with the keys {', '.join(bounded)}")
    missing, unknown = [k for k in bounded if k not in raw], [k for k in raw if k not in bounded]
    if missing or unknown:
        schema.keys(path, missing, unknown, bounded)
    bounds = {}
    for name, limit in bounded.items():
        pair = schema.items(f"{path}.{name}", raw[name], 2)
        low = schema.integer(f"{path}.{name}[0]", pair[0], 0, limit)
        high = schema.integer(f"{path}.{name}[1]", pair[1], low, limit)
        bounds[name] = [low, high]
    return bounds


def write_prepared(
    out_dir: str,
    splits: Mapping[str, Mapping[str, np.ndarray]],
    *,
    template: Manifest,
    num_shards: int,
) -> Manifest:
    """Write each split's arrays (name -> array, first axis the samples) as up to ``num_shards`` ``.npz`` shards
    of consecutive samples (see :func:`write_shards`)."""

    def shards_of(arrays: Mapping[str, np.ndarray]) -> tuple[int, Iterator[dict[str, np.ndarray]]]:
        count = len(next(iter(arrays.values())))
        parts = np.array_split(np.arange(count), min(num_shards, count))
        return len(parts), ({key: value[part] for key, value in arrays.items()} for part in parts)

    for name, arrays in splits.items():
        _check_split(template, name, arrays)
    return write_shards(out_dir, {name: shards_of(arrays) for name, arrays in splits.items()}, template=template)


def write_shards(
    out_dir: str,
    splits: Mapping[str, tuple[int, Iterable[Mapping[str, np.ndarray]]]],
    *,
    template: Manifest,
) -> Manifest:
    """Write each split's shards (``(number of shards, shards)``, each shard name -> array, first axis the
    samples) as ``.npz`` files under ``out_dir`` as they come, then the manifest: ``template``'s description with
    the shards, their sha256 and the bounds of every bounded array. Only one shard is in memory at a time. Each
    shard is checked against ``template.arrays`` first (names, dtypes, sample shapes, bounds), so a workload cannot
    write data the readers would refuse. A shard file that already holds the same bytes (a prep that stopped half
    way, run again) is left as it is."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(out_dir)
    fs.makedirs(root, exist_ok=True)
    split_infos, written, total = {}, 0, 0
    for name, (num_shards, shards) in splits.items():
        infos = []
        for index, arrays in enumerate(shards):
            bounds = _check_split(template, name, arrays)
            buffer = io.BytesIO()
            np.savez(buffer, **arrays)
            payload = buffer.getvalue()
            digest = hashlib.sha256(payload).hexdigest()
            file = f"{name}-{index:05d}-of-{num_shards:05d}.npz"
            total += 1
            if not _holds(fs, join_path(root, file), payload, digest):
                with fs.open(join_path(root, file), "wb") as f:
                    f.write(payload)
                written += 1
            infos.append(
                ShardInfo(file=file, num_samples=len(next(iter(arrays.values()))), sha256=digest, bounds=bounds)
            )
        assert len(infos) == num_shards, (name, len(infos), num_shards)
        split_infos[name] = SplitInfo(num_samples=sum(shard.num_samples for shard in infos), shards=infos)
    manifest = dataclasses.replace(template, splits=split_infos, version=MANIFEST_VERSION, directory=out_dir)
    write_manifest(manifest)
    kept = total - written
    log.info(
        "prepared %s (%s): %s; wrote %d of %d shards%s",
        manifest.dataset,
        manifest.workload,
        manifest.split_counts(),
        written,
        total,
        f"; {kept} already held the same bytes" if kept else "",
    )
    return manifest


def _holds(fs: Any, path: str, payload: bytes, digest: str) -> bool:
    """Whether ``path`` exists and holds ``payload`` (same size, same sha256)."""
    try:
        if fs.size(path) != len(payload):
            return False
        return hashlib.sha256(fs.cat_file(path)).hexdigest() == digest
    except OSError:  # not there (FileNotFoundError), or unreadable: written again
        return False


def write_manifest(manifest: Manifest) -> None:
    """Write ``manifest`` into its directory. Prep calls it after every shard is written: a directory with a
    manifest is complete."""
    import fsspec

    with fsspec.open(join_path(manifest.directory, MANIFEST_NAME), "w") as f:
        f.write(manifest.to_json())


def _check_split(template: Manifest, split: str, arrays: Mapping[str, np.ndarray]) -> dict[str, list[int]]:
    """``arrays`` checked against ``template.arrays``; the smallest and largest value of each bounded one."""
    if split not in SPLIT_NAMES:
        raise ValueError(f"data prep made a split named {quote(split)}; splits are named {', '.join(SPLIT_NAMES)}")
    if set(arrays) != set(template.arrays):
        raise ValueError(
            f"data prep made split {split!r} with arrays {sorted(arrays)}; the manifest declares "
            f"{sorted(template.arrays)}"
        )
    counts = {len(a) for a in arrays.values()}
    if len(counts) != 1 or not counts.pop():
        raise ValueError(
            f"data prep made split {split!r} with no samples or arrays of different lengths; fix the source"
        )
    bounds = {}
    for key, spec in template.arrays.items():
        value = arrays[key]
        if value.dtype != np.dtype(spec.dtype) or list(value.shape[1:]) != spec.shape:
            raise ValueError(
                f"data prep made array {key!r} of split {split!r} {value.dtype} {value.shape[1:]} per sample; the "
                f"manifest declares {spec.dtype} {tuple(spec.shape)}"
            )
        if spec.max_value is None:
            continue
        low, high = int(value.min()), int(value.max())
        if not 0 <= low <= high <= spec.max_value:
            raise ValueError(
                f"data prep made array {key!r} of split {split!r} with values {low}..{high}; "
                f"expected 0..{spec.max_value}"
            )
        bounds[key] = [low, high]
    return bounds


def split_samples(
    raw: Mapping[str, Mapping[str, np.ndarray]], cfg: DataConfig, *, source: str
) -> dict[str, dict[str, np.ndarray]]:
    """Shuffle ``raw["train"]`` (name -> array, first axis the samples) with ``data.split_seed`` and carve val (and
    test, when the source has none) out of it by ``data.val_fraction`` / ``data.test_fraction``; a source's own
    val or test split is kept as it is. Arrays of one split that differ in length raise ``ValueError`` naming
    ``source``."""
    for split, arrays in raw.items():
        lengths = {name: len(value) for name, value in arrays.items()}
        if len(set(lengths.values())) > 1:
            found = ", ".join(f"{name!r}: {length}" for name, length in lengths.items())
            raise ValueError(f"{source} gave split {split!r} arrays of different lengths ({clip(found)}); give each "
                             "array one entry per sample")  # fmt: skip
    train = raw["train"]
    n = len(next(iter(train.values())))
    for name in ("test", "val"):
        fraction = getattr(cfg, f"{name}_fraction")
        if name not in raw and not round(n * fraction):
            raise ValueError(
                f"data.{name}_fraction={fraction!r} is invalid: {source} has no {name} split of its own and this "
                f"fraction of its {n} samples rounds to 0; raise it to at least {1 / max(n, 1):.2g}"
            )
    order = np.random.default_rng(cfg.split_seed).permutation(n)
    carved = held_out(order, cfg, own=raw, source=source)
    splits = {split: {name: value[rows] for name, value in train.items()} for split, rows in carved.items()}
    return {**splits, **{name: dict(raw[name]) for name in ("val", "test") if name in raw}}


def read_shard(manifest: Manifest, shard: ShardInfo) -> dict[str, np.ndarray]:
    """One shard's arrays (name -> array, first axis the samples), checked against what the manifest records: the
    sha256, the count, each array's dtype and sample shape, and the value bounds. A mismatch raises ``ValueError``
    naming the shard file and the fix.

    A local shard is memory-mapped where it can be (:mod:`training_core.data.mapped_npz`), and checked whole once
    per process: read again unchanged (same inode, size and modification time), it is mapped without a second hash
    and scan, which each epoch would otherwise pay in the step's time."""
    where = shard_where(manifest, shard)
    path = join_path(manifest.directory, shard.file)
    identity = _local_identity(path, manifest, shard)
    if identity is None:
        payload = read_verified(path, where, shard.sha256)
        with _readable(where):
            arrays = _np_load(io.BytesIO(payload), manifest.arrays)
        return _checked_arrays(manifest, shard, where, arrays)
    local_path = identity[0]
    if identity in _VERIFIED:
        arrays = _load_local(local_path, manifest, where)
        if identity == _local_identity(path, manifest, shard):
            return arrays
    with open(local_path, "rb") as f:
        check_sha256(where, hashlib.file_digest(f, "sha256").hexdigest(), shard.sha256)
    arrays = _checked_arrays(manifest, shard, where, _load_local(local_path, manifest, where))
    if identity != _local_identity(path, manifest, shard):
        shard_error(where, "changed while it was read (another data prep writing the directory?)")
    _VERIFIED.add(identity)
    return arrays


def _load_local(local_path: str, manifest: Manifest, where: str) -> dict[str, np.ndarray]:
    from training_core.data.mapped_npz import map_arrays

    with _readable(where):
        return map_arrays(local_path, manifest.arrays) or _np_load(local_path, manifest.arrays)


def _np_load(source: Any, names: Iterable[str]) -> dict[str, np.ndarray]:
    with np.load(source, allow_pickle=False) as stored:
        return {name: stored[name] for name in names}


@contextlib.contextmanager
def _readable(where: str) -> Iterator[None]:
    """What reading a shard raises for a file that is not a readable ``.npz``, as a shard error naming it."""
    try:
        yield
    except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile) as exc:
        shard_error(where, f"is not a readable shard ({type(exc).__name__}: {clip(str(exc))})")


def _checked_arrays(
    manifest: Manifest, shard: ShardInfo, where: str, arrays: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """``arrays`` when each is there with the dtype, sample shape and bounds the manifest records."""
    for name, spec in manifest.arrays.items():
        value, expected = arrays[name], (shard.num_samples, *spec.shape)
        if value.dtype != np.dtype(spec.dtype) or value.shape != expected:
            shard_error(where, f"holds {name} {value.dtype} {value.shape}; the manifest says {spec.dtype} {expected}")
        if spec.max_value is None:
            continue
        low, high = int(value.min()), int(value.max())
        recorded = shard.bounds.get(name)
        if recorded is not None and [low, high] != recorded:
            shard_error(where, f"holds {name} {low}..{high}; the manifest says {recorded[0]}..{recorded[1]}")
        if not 0 <= low <= high <= spec.max_value:
            limit = f"{manifest.num_classes} classes" if name == "labels" else f"values 0..{spec.max_value}"
            shard_error(where, f"holds {name} {low}..{high}; the manifest has {limit}")
    return arrays


_VERIFIED: set[tuple] = set()
"""Local shard files this process read and found as the manifest records them, by :func:`_local_identity`."""


def _local_identity(path: str, manifest: Manifest, shard: ShardInfo) -> tuple | None:
    """A local shard file's identity: its path, inode, size and modification time, and what the manifest expects of
    it (None for a remote one, or one that cannot be stat'ed: those are checked at every read)."""
    if "://" in path and not path.startswith("file://"):
        return None
    try:
        stat = os.stat(path.removeprefix("file://"))
    except OSError:
        return None
    return (
        os.path.realpath(path.removeprefix("file://")), stat.st_size, stat.st_mtime_ns, stat.st_ino,
        shard.sha256, shard.num_samples, repr(shard.bounds), repr(manifest.arrays),
    )  # fmt: skip


@dataclass
class ArraySamples:
    """An ``npz`` shard's samples: rows of its arrays, as stored. A shard that stores ``sample_ids`` gives each
    training sample its ``sample_seeds`` too: the seed of its random draws (``masked_lm``'s masking) in this epoch,
    the same whichever rank, batch or resume reads it."""

    arrays: Mapping[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def sample(self, row: int, *, epoch: int, train: bool, seed: int = 0) -> dict[str, np.ndarray]:
        found = {name: value[row] for name, value in self.arrays.items()}
        if train and "sample_ids" in found:
            from training_core.data.loader import sample_seed

            found["sample_seeds"] = np.int64(sample_seed(seed, epoch, int(found["sample_ids"])))
        return found


class ShardStream:
    """Batches of one split for one rank (see :mod:`training_core.data.loader` for the order and resume).

    Training batches come from the rank's chunk of the epoch's global order, read, decoded and augmented in
    ``data.loader_num_workers`` loader processes (Parquet shards of encoded images; ``.npz`` arrays are read in this
    thread); evaluation reads the rank's shards ``rank, rank + world_size, ...`` in stored order."""

    def __init__(
        self, manifest: Manifest, split: str, *, rank: int, world_size: int, data: DataConfig | None = None
    ) -> None:
        self.manifest = manifest
        self.split = split
        self.rank, self.world_size = rank, world_size
        self.data = data or DataConfig()
        self.all_shards = manifest.splits[split].shards
        self.num_samples = manifest.splits[split].num_samples

    def read(self, index: int) -> Any:
        """Shard ``index`` of the split, verified, as indexable samples."""
        shard = self.all_shards[index]
        if self.manifest.format == "parquet":
            from training_core.data.image_shards import EncodedImages

            return EncodedImages.read(self.manifest, shard, self.data)
        return ArraySamples(read_shard(self.manifest, shard))

    def train_batches(
        self,
        *,
        epoch: int,
        seed: int,
        batch_size: int,
        num_batches: int,
        start_batch: int = 0,
        remaining: list[tuple[int, int]] | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches ``start_batch .. num_batches - 1`` of this rank's chunk of ``remaining`` (default: the whole
        epoch), all full. A resume on the same workers passes the batches consumed as ``start_batch``; one on other
        workers passes the checkpoint's ``remaining`` and ``start_batch=0``."""
        from training_core.data.loader import EpochOrder, TrainBatches, loader_iter, plan_ranks

        order = EpochOrder([s.num_samples for s in self.all_shards], seed=seed, epoch=epoch)
        chunk = plan_ranks(remaining if remaining is not None else [(0, order.num_samples)], self.world_size)
        batches = TrainBatches(self.read, order, chunk[self.rank], batch_size, num_batches, start_batch)
        return loader_iter(
            batches.batches,
            num_processes=min(self._loader_processes(), max(num_batches - start_batch, 0)),
            prefetch_batches=self.data.loader_prefetch_batches,
        )

    def _loader_processes(self) -> int:
        """Loader processes to fork, with what they import already imported here."""
        # An npz shard holds decoded arrays: a loader process would only copy them through shared memory, and
        # forking one per epoch costs more than the copy saves on small data.
        if self.manifest.format != "parquet" or not self.data.loader_num_workers:
            return 0
        from training_core.data.image_shards import import_decoders

        import_decoders()
        return self.data.loader_num_workers

    def eval_batches(self, *, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Every sample of this rank's shards once, in stored order; the last batch of each shard may be short."""
        from training_core.data.loader import loader_iter

        if len(self.all_shards) < self.world_size:
            raise ValueError(
                f"split {self.split!r} has {len(self.all_shards)} shard(s) ({self.num_samples} samples) for "
                f"{self.world_size} workers; re-run data prep with data.num_shards >= {self.world_size}, and enough "
                "samples in the split (data.val_fraction / data.test_fraction) for one shard per worker"
            )
        mine = list(range(len(self.all_shards)))[self.rank :: self.world_size]
        if self.manifest.format == "npz":
            return self._eval_arrays(mine, batch_size)

        def source(worker: int, num_workers: int) -> Iterator[list[dict[str, Any]]]:
            for index in mine[worker::num_workers]:
                samples = self.read(index)
                for start in range(0, len(samples), batch_size):
                    rows = range(start, min(start + batch_size, len(samples)))
                    yield [samples.sample(row, epoch=0, train=False) for row in rows]

        # Whole shards per process: evaluation order is not a contract, only that every sample is seen once.
        return loader_iter(
            source,
            num_processes=min(self._loader_processes(), len(mine)),
            prefetch_batches=self.data.loader_prefetch_batches,
        )

    def _eval_arrays(self, mine: list[int], batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        for index in mine:
            arrays = read_shard(self.manifest, self.all_shards[index])
            count = self.all_shards[index].num_samples
            for start in range(0, count, batch_size):
                yield {name: value[start : start + batch_size] for name, value in arrays.items()}
