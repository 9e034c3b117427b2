"""Data prep into sharded files, and the per-worker shard stream.

``prepare`` writes each split as ``num_shards`` ``.npz`` files (uint8 images, int64 labels; no pickles)
plus ``manifest.json``: split counts, classes, input shape, normalisation stats and every shard with its
sha256. The directory may be local or any fsspec URI (``s3://...``).

Worker ``rank`` of ``world_size`` streams only shards ``rank, rank + world_size, ...`` of a split, one shard
in memory at a time. Every rank derives the same number of steps per epoch from the manifest, so DDP
ranks never wait on a peer that ran out of data.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Iterator

import numpy as np

from training_core.config import DataConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


@dataclass
class ShardInfo:
    file: str
    """File name relative to the data directory."""
    num_samples: int
    sha256: str


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
        return json.dumps(payload, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, directory: str = "") -> "Manifest":
        raw = json.loads(text)
        if raw.get("version") != MANIFEST_VERSION:
            raise ValueError(
                f"manifest version {raw.get('version')!r} is not supported (expected {MANIFEST_VERSION}); re-run "
                "data prep"
            )
        splits = {
            name: SplitInfo(num_samples=s["num_samples"], shards=[ShardInfo(**shard) for shard in s["shards"]])
            for name, s in raw["splits"].items()
        }
        return cls(
            dataset=raw["dataset"],
            classes=raw["classes"],
            input_shape=raw["input_shape"],
            mean=raw["mean"],
            std=raw["std"],
            splits=splits,
            version=raw["version"],
            directory=directory,
        )

    @classmethod
    def load(cls, directory: str) -> "Manifest":
        import fsspec

        with fsspec.open(_join(directory, MANIFEST_NAME), "r") as f:
            return cls.from_json(f.read(), directory=directory)

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
            shards.append(ShardInfo(file=file, num_samples=len(part), sha256=hashlib.sha256(payload).hexdigest()))
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
    import fsspec

    with fsspec.open(_join(manifest.directory, shard.file), "rb") as f:
        payload = f.read()
    if verify:
        digest = hashlib.sha256(payload).hexdigest()
        if digest != shard.sha256:
            raise ValueError(
                f"shard {shard.file} in {manifest.directory} is corrupt: sha256 {digest} != manifest {shard.sha256}; "
                "re-run data prep"
            )
    with np.load(io.BytesIO(payload), allow_pickle=False) as arrays:
        return arrays["images"], arrays["labels"]


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
