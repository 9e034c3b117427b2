"""Data prep into sharded files, and the per-worker shard stream.

``prepare`` writes each split as ``num_shards`` ``.npz`` files (uint8 images, int64 labels; no pickles)
plus ``manifest.json``: split counts, classes, input shape, normalisation stats and every shard with its
sha256, sample count and label range. The directory may be local or any fsspec URI (``s3://...``).

A manifest is data, never a path out: it is validated whole against its schema when read (every shard file a
plain name inside the directory, counts that add up, label ranges within the classes), and each shard is checked
against it when read (sha256, count, shape, dtypes, labels), so bad data fails when training starts, naming the
file, rather than thousands of steps in.

Worker ``rank`` of ``world_size`` streams only shards ``rank, rank + world_size, ...`` of a split, one shard
in memory at a time. Every rank derives the same number of steps per epoch from the manifest, so DDP
ranks never wait on a peer that ran out of data.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import re
import zipfile
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, NoReturn

import numpy as np

from training_core.config import DataConfig, clip, is_plain_file_name, quote
from training_core.redact import redact

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 2
"""2 records each shard's label range. A version-1 manifest still loads; its shards' labels are checked against
the classes only."""

SPLIT_NAMES = ("train", "val", "test")

_SHA256 = re.compile(r"[0-9a-f]{64}")
_RERUN = "re-run data prep (prepare_data) to rewrite the directory"


@dataclass
class ShardInfo:
    file: str
    """File name relative to the data directory."""
    num_samples: int
    sha256: str
    label_min: int | None = None
    """Smallest label in the shard; ``None`` only in a version-1 manifest."""
    label_max: int | None = None
    """Largest label in the shard; ``None`` only in a version-1 manifest."""


@dataclass
class SplitInfo:
    num_samples: int
    shards: list[ShardInfo]


@dataclass
class Manifest:
    dataset: str
    classes: list[str]
    input_shape: list[int]
    """Channels, height, width of one sample."""
    mean: list[float]
    """Per-channel mean of the training split, on the 0..1 scale."""
    std: list[float]
    """Per-channel standard deviation of the training split, on the 0..1 scale."""
    splits: dict[str, SplitInfo]
    version: int = MANIFEST_VERSION
    directory: str = field(default="", compare=False)
    """Where the manifest was read from (not stored)."""

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def split_counts(self) -> dict[str, int]:
        return {name: split.num_samples for name, split in self.splits.items()}

    def to_json(self) -> str:
        payload = asdict(self)
        payload.pop("directory")
        if self.version == 1:
            for split in payload["splits"].values():
                for shard in split["shards"]:
                    del shard["label_min"], shard["label_max"]
        return json.dumps(payload, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, directory: str = "") -> "Manifest":
        """The manifest in ``text``, validated whole before anything uses it: types, required and unknown keys,
        ranges, every shard a plain file name inside ``directory``, counts that add up and label ranges within
        the classes. Anything else raises ``ValueError`` naming the manifest file and the field."""
        where = _where(directory)
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{where} is not valid JSON ({clip(str(exc))}); {_RERUN}") from None
        return _parse_manifest(raw, where=where, directory=directory)

    @classmethod
    def load(cls, directory: str) -> "Manifest":
        """The manifest of a prepared data directory (see :meth:`from_json`)."""
        import fsspec

        try:
            with fsspec.open(_join(directory, MANIFEST_NAME), "rb") as f:
                payload = f.read()
        except (FileNotFoundError, IsADirectoryError):
            raise ValueError(
                f"{_where(directory)} is missing: the directory holds no prepared data; {_RERUN}"
            ) from None
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{_where(directory)} is not UTF-8 text ({exc.reason} at byte {exc.start}); {_RERUN}"
            ) from None
        return cls.from_json(text, directory=directory)

    def shards_for_rank(self, split: str, rank: int, world_size: int) -> list[ShardInfo]:
        shards = self.splits[split].shards
        if len(shards) < world_size:
            raise ValueError(
                f"split {split!r} has {len(shards)} shard(s) ({self.splits[split].num_samples} samples) for "
                f"{world_size} "
                f"workers; re-run data prep with data.num_shards >= {world_size}, and enough samples in the split "
                "(data.val_fraction / data.test_fraction) for one shard per worker"
            )
        return shards[rank::world_size]

    def steps_per_epoch(self, *, world_size: int, batch_size: int, grad_accum_steps: int) -> int:
        """Optimizer steps every rank can take in one epoch: the least-loaded rank decides."""
        per_rank = [sum(s.num_samples for s in self.shards_for_rank("train", r, world_size)) for r in range(world_size)]
        steps = min(per_rank) // (batch_size * grad_accum_steps)
        if steps == 0:
            raise ValueError(
                f"loop.batch_size={batch_size} is too large: with loop.grad_accum_steps={grad_accum_steps} and "
                f"{world_size} workers the smallest worker has {min(per_rank)} training samples, not enough for one "
                "step; lower loop.batch_size or scaling.num_workers"
            )
        return steps


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}"


def _where(directory: str) -> str:
    """The manifest file as an error names it, with any URL credentials redacted."""
    return clip(redact(_join(directory, MANIFEST_NAME) if directory else MANIFEST_NAME), 500)


class _Schema:
    """Checks one parsed manifest, raising ``ValueError`` with the manifest file and the field path."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, value: Any, why: str) -> NoReturn:
        raise ValueError(f"{self.where}: {clip(path)}={quote(value)} is invalid: {why}; {_RERUN}")

    def mapping(self, path: str, value: Any, required: tuple[str, ...]) -> dict:
        if not isinstance(value, dict):
            self.fail(path, value, f"expected an object with the keys {', '.join(required)}")
        missing = [k for k in required if k not in value]
        unknown = [k for k in value if k not in required]
        if missing or unknown:
            listed = ", ".join(quote(k) for k in unknown[:10]) + (
                f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            )
            found = f"lacks {', '.join(missing)}" if missing else f"has unknown key(s) {listed}"
            raise ValueError(f"{self.where}: {clip(path)} {found}; its keys are {', '.join(required)}; {_RERUN}")
        return value

    def integer(self, path: str, value: Any, minimum: int, maximum: float = math.inf) -> int:
        # bool is an int in Python and JSON's true would pass as 1.
        if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
            bound = f"{minimum}..{maximum}" if maximum != math.inf else f">= {minimum}"
            self.fail(path, value, f"expected an integer {bound}")
        return value

    def text(self, path: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            self.fail(path, value, "expected a non-empty string")
        return value

    def items(self, path: str, value: Any, length: int | None = None) -> list:
        if not isinstance(value, list) or (length is not None and len(value) != length):
            self.fail(path, value, "expected a list" + (f" of {length}" if length is not None else ""))
        return value

    def numbers(self, path: str, value: Any, length: int, *, positive: bool) -> list[float]:
        numbers = []
        for index, item in enumerate(self.items(path, value, length)):
            # An integer beyond a float's range is as unusable as JSON's Infinity or NaN.
            number = float(item) if isinstance(item, float) or _small_int(item) else math.nan
            if not math.isfinite(number):
                self.fail(f"{path}[{index}]", item, "expected a finite number")
            if positive and not number > 0:
                self.fail(f"{path}[{index}]", item, "expected a number > 0")
            numbers.append(number)
        return numbers


def _small_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**1000


_TOP_KEYS = ("version", "dataset", "classes", "input_shape", "mean", "std", "splits")
_SHARD_KEYS = {1: ("file", "num_samples", "sha256"), 2: ("file", "num_samples", "sha256", "label_min", "label_max")}


def _parse_manifest(raw: Any, *, where: str, directory: str) -> Manifest:
    schema = _Schema(where)
    if isinstance(raw, dict):
        version = raw.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version not in _SHARD_KEYS:
            schema.fail("version", version, f"this code reads versions 1 and {MANIFEST_VERSION}")
    raw = schema.mapping("manifest", raw, _TOP_KEYS)
    version = raw["version"]
    classes = schema.items("classes", raw["classes"])
    if not classes:
        schema.fail("classes", classes, "expected at least one class name")
    for index, name in enumerate(classes):
        schema.text(f"classes[{index}]", name)
    if len(set(classes)) != len(classes):
        schema.fail("classes", classes, "class names must be unique")
    shape = schema.items("input_shape", raw["input_shape"], 3)
    for index, size in enumerate(shape):
        schema.integer(f"input_shape[{index}]", size, 1)
    splits_raw = raw["splits"]
    if not isinstance(splits_raw, dict) or "train" not in splits_raw:
        schema.fail("splits", splits_raw, f"expected an object of splits ({', '.join(SPLIT_NAMES)}) with train")
    splits = {}
    files: set[str] = set()
    for name, split_raw in splits_raw.items():
        if name not in SPLIT_NAMES:
            schema.fail("splits", name, f"a split is named {', '.join(SPLIT_NAMES)}")
        split_raw = schema.mapping(f"splits.{name}", split_raw, ("num_samples", "shards"))
        num_samples = schema.integer(f"splits.{name}.num_samples", split_raw["num_samples"], 0)
        shards = []
        for index, shard_raw in enumerate(schema.items(f"splits.{name}.shards", split_raw["shards"])):
            path = f"splits.{name}.shards[{index}]"
            shard_raw = schema.mapping(path, shard_raw, _SHARD_KEYS[version])
            file = _plain_name(
                shard_raw["file"], lambda why, p=path, v=shard_raw["file"]: schema.fail(f"{p}.file", v, why)
            )
            if file in files:
                schema.fail(f"{path}.file", file, "another shard names the same file")
            files.add(file)
            sha256 = shard_raw["sha256"]
            if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
                schema.fail(f"{path}.sha256", sha256, "expected 64 lowercase hex digits")
            shard = ShardInfo(
                file=file,
                # Prep never writes an empty shard.
                num_samples=schema.integer(f"{path}.num_samples", shard_raw["num_samples"], 1),
                sha256=sha256,
            )
            if version >= 2:
                shard.label_min = schema.integer(f"{path}.label_min", shard_raw["label_min"], 0, len(classes) - 1)
                shard.label_max = schema.integer(
                    f"{path}.label_max", shard_raw["label_max"], shard.label_min, len(classes) - 1
                )
            shards.append(shard)
        total = sum(s.num_samples for s in shards)
        if total != num_samples:
            schema.fail(f"splits.{name}.num_samples", num_samples, f"its shards hold {total} samples")
        splits[name] = SplitInfo(num_samples=num_samples, shards=shards)
    return Manifest(
        dataset=schema.text("dataset", raw["dataset"]),
        classes=list(classes),
        input_shape=list(shape),
        mean=schema.numbers("mean", raw["mean"], shape[0], positive=False),
        std=schema.numbers("std", raw["std"], shape[0], positive=True),
        splits=splits,
        version=version,
        directory=directory,
    )


def _plain_name(value: Any, fail) -> str:
    """``value`` when it is a plain file name inside its directory, else ``fail(why)``."""
    if not is_plain_file_name(value):
        fail(
            "a shard file is a plain name inside the data directory (letters, digits, '_', '-', '.', not starting "
            "with '.'; no '/', '\\', '..', ':' or absolute path)"
        )
    return value


def prepare(cfg: DataConfig, out_dir: str) -> Manifest:
    """Read the raw dataset, split it, and write shards and the manifest under ``out_dir``."""
    import fsspec

    from training_core.datasets import load_raw

    raw = load_raw(cfg)
    splits = _split(raw.splits, cfg)
    train_x = splits["train"][0]
    scaled = train_x.astype(np.float64) / 255.0
    mean = scaled.mean(axis=(0, 2, 3)).tolist()
    std = np.maximum(scaled.std(axis=(0, 2, 3)), 1e-6).tolist()

    fs, root = fsspec.core.url_to_fs(out_dir)
    fs.makedirs(root, exist_ok=True)
    split_infos = {}
    for name, (images, labels) in splits.items():
        shards = []
        num_shards = min(cfg.num_shards, len(labels))
        for index, part in enumerate(np.array_split(np.arange(len(labels)), num_shards)):
            buffer = io.BytesIO()
            np.savez(buffer, images=images[part], labels=labels[part])
            payload = buffer.getvalue()
            file = f"{name}-{index:05d}-of-{num_shards:05d}.npz"
            with fs.open(_join(root, file), "wb") as f:
                f.write(payload)
            shards.append(
                ShardInfo(
                    file=file,
                    num_samples=len(part),
                    sha256=hashlib.sha256(payload).hexdigest(),
                    label_min=int(labels[part].min()),
                    label_max=int(labels[part].max()),
                )
            )
        split_infos[name] = SplitInfo(num_samples=len(labels), shards=shards)

    manifest = Manifest(
        dataset=cfg.dataset,
        classes=raw.classes,
        input_shape=list(train_x.shape[1:]),
        mean=mean,
        std=std,
        splits=split_infos,
        directory=out_dir,
    )
    # The manifest goes last: a directory with a manifest is complete.
    with fs.open(_join(root, MANIFEST_NAME), "w") as f:
        f.write(manifest.to_json())
    log.info("prepared %s: %s", cfg.dataset, manifest.split_counts())
    return manifest


def _split(raw: dict[str, tuple[np.ndarray, np.ndarray]], cfg: DataConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Shuffle and carve val (and test, when the source has none) out of train."""
    rng = np.random.default_rng(cfg.split_seed)
    x, y = raw["train"]
    order = rng.permutation(len(y))
    x, y = x[order], y[order]
    splits = {}
    n = len(y)
    n_test = 0 if "test" in raw else int(round(n * cfg.test_fraction))
    n_val = 0 if "val" in raw else int(round(n * cfg.val_fraction))
    if n_test:
        splits["test"] = (x[:n_test], y[:n_test])
    if n_val:
        splits["val"] = (x[n_test : n_test + n_val], y[n_test : n_test + n_val])
    splits["train"] = (x[n_test + n_val :], y[n_test + n_val :])
    for name in ("val", "test"):
        if name in raw:
            splits[name] = raw[name]
    for name, field_name, value in (
        ("test", "test_fraction", cfg.test_fraction),
        ("val", "val_fraction", cfg.val_fraction),
    ):
        if name not in splits:
            raise ValueError(
                f"data.{field_name}={value!r} is invalid: {cfg.dataset} has no {name} split of its own and this "
                "fraction "
                f"of its {n} samples rounds to 0; raise it to at least {1 / n:.2g}"
            )
    return splits


def read_shard(manifest: Manifest, shard: ShardInfo, *, verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One shard's (uint8 images N x C x H x W, int64 labels N), checked against what the manifest records: the
    sha256 (when ``verify``), the count, the image shape and the label range. A mismatch raises ``ValueError``
    naming the shard file and the fix."""
    import fsspec

    where = f"shard {quote(shard.file)} in {clip(redact(manifest.directory), 500)}"
    _plain_name(shard.file, lambda why: _shard_error(where, why))
    with fsspec.open(_join(manifest.directory, shard.file), "rb") as f:
        payload = f.read()
    if verify:
        digest = hashlib.sha256(payload).hexdigest()
        if digest != shard.sha256:
            _shard_error(where, f"is corrupt: sha256 {digest} != manifest {shard.sha256}")
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as arrays:
            images, labels = arrays["images"], arrays["labels"]
    except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile) as exc:
        _shard_error(where, f"is not a readable shard ({type(exc).__name__}: {clip(str(exc))})")
    expected = (shard.num_samples, *manifest.input_shape)
    if images.dtype != np.uint8 or images.shape != expected:
        _shard_error(where, f"holds images {images.dtype} {images.shape}; the manifest says uint8 {expected}")
    if labels.dtype != np.int64 or labels.shape != (shard.num_samples,):
        _shard_error(
            where, f"holds labels {labels.dtype} {labels.shape}; the manifest says int64 ({shard.num_samples},)"
        )
    low, high = int(labels.min()), int(labels.max())
    if shard.label_min is not None and (low, high) != (shard.label_min, shard.label_max):
        _shard_error(where, f"holds labels {low}..{high}; the manifest says {shard.label_min}..{shard.label_max}")
    if not 0 <= low <= high < manifest.num_classes:
        _shard_error(where, f"holds labels {low}..{high}; the manifest has {manifest.num_classes} classes")
    return images, labels


def _shard_error(where: str, found: str) -> NoReturn:
    raise ValueError(f"{where} {found}; {_RERUN}")


class ShardStream:
    """Batches of one split for one rank, read shard by shard.

    Training order is a deterministic function of (seed, epoch, rank): shard order and the samples within a
    shard are shuffled, and a small carry-over buffer keeps batches full across shard boundaries.
    """

    def __init__(self, manifest: Manifest, split: str, *, rank: int, world_size: int) -> None:
        self.manifest = manifest
        self.split = split
        self.shards = manifest.shards_for_rank(split, rank, world_size)
        self.rank = rank
        self.num_samples = sum(s.num_samples for s in self.shards)

    def train_batches(
        self, *, epoch: int, seed: int, batch_size: int, num_batches: int, start_batch: int = 0
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Batches ``start_batch .. num_batches - 1`` of the epoch's fixed order, all full (the manifest
        guarantees there are enough). A resume passes the batches already consumed as ``start_batch``."""
        rng = np.random.default_rng([seed, epoch, self.rank])
        pending_x: list[np.ndarray] = []
        pending_y: list[np.ndarray] = []
        pending = 0
        emitted = 0
        for index in rng.permutation(len(self.shards)):
            images, labels = read_shard(self.manifest, self.shards[index])
            order = rng.permutation(len(labels))
            pending_x.append(images[order])
            pending_y.append(labels[order])
            pending += len(labels)
            if pending < batch_size:
                continue
            x, y = np.concatenate(pending_x), np.concatenate(pending_y)
            full = len(y) // batch_size
            for b in range(full):
                if emitted == num_batches:
                    return
                if emitted >= start_batch:
                    yield x[b * batch_size : (b + 1) * batch_size], y[b * batch_size : (b + 1) * batch_size]
                emitted += 1
            pending_x, pending_y = [x[full * batch_size :]], [y[full * batch_size :]]
            pending = len(pending_y[0])
        assert emitted == num_batches, f"rank {self.rank} produced {emitted} of {num_batches} batches"

    def eval_batches(self, *, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every sample of this rank's shards once, in stored order; the last batch may be short."""
        for shard in self.shards:
            images, labels = read_shard(self.manifest, shard)
            for start in range(0, len(labels), batch_size):
                yield images[start : start + batch_size], labels[start : start + batch_size]


class Normalizer:
    """uint8 numpy batches -> normalised float tensors on the device."""

    def __init__(self, manifest: Manifest, device: torch.device) -> None:
        import torch

        self.device = device
        self.mean = torch.tensor(manifest.mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(manifest.std, device=device).view(1, -1, 1, 1)

    def __call__(self, images: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        x = torch.from_numpy(images).to(self.device, non_blocking=True).float().div_(255.0)
        y = torch.from_numpy(labels).to(self.device, non_blocking=True)
        return (x - self.mean) / self.std, y
