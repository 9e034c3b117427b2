"""Image datasets prepared at scale: encoded images in Parquet shards, written by Ray tasks.

Prep of an ``image_folder`` tree (``<split>/<class>/<image>`` or ``<class>/<image>``) or the CIFAR-10 tarball, local
or ``s3://``, never holds a split in memory:

- The driver lists the source (paths and labels only; the CIFAR tarball's batches are read one member at a time),
  assigns each sample to a split by a hash of its name and ``data.split_seed`` (so adding images moves no other
  image between splits), and groups each split into ``data.num_shards`` shards in a hashed order (classes mixed).
- Each shard is one Ray task (``data.prep_num_workers`` at a time on the job's Ray cluster). It reads its
  images, decodes each one to check it (a corrupt or undecodable file is skipped and reported), adds its pixels to
  per-channel sums at ``data.image_size`` (the normalisation statistics, exact and streaming), and writes the
  images' bytes as they came (JPEG, PNG...; CIFAR's arrays as PNG) into a Parquet file with the columns
  ``sample_id``, ``label``, ``image`` and ``source``. Parquet because every tool of the field reads it (pyarrow,
  pandas, Spark, Ray Data, DuckDB) with the label beside the bytes, and one file is one shard to hash and stream.
- After its shard, a task writes ``<shard>.done.json`` (the shard's record). A prep that died half way and runs
  again keeps every shard whose file still matches its record's sha256 and rewrites only the others.
- The manifest goes last, with the statistics, the bad samples' count and first paths, and every shard's sha256.

Training workers decode and augment these shards in loader processes (:mod:`training_core.loader`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import numpy as np

from training_core.config import DataConfig, clip, no_training_samples_error, quote
from training_core.redact import redact

log = logging.getLogger(__name__)

PARQUET_COLUMNS = ("sample_id", "label", "image", "source")
DONE_SUFFIX = ".done.json"
MAX_BAD_EXAMPLES = 10
"""Bad samples named in the manifest and the prep log (the count covers them all)."""


@dataclass
class ImageItem:
    source: str
    """Where the image is: a path under ``data.path`` (image folder) or ``<batch member>#<row>`` (CIFAR-10)."""
    label: int
    sample_id: int
    """The sample's number in the whole dataset, stable across preps of the same source."""


@dataclass
class ShardTask:
    split: str
    file: str
    kind: str
    """``image_folder`` or ``cifar10``."""
    root: str
    """``data.path``."""
    out_dir: str
    stats_size: int
    items: list[ImageItem]


@dataclass
class ShardResult:
    split: str
    file: str
    num_samples: int
    sha256: str
    label_range: list[int]
    pixel_sum: list[float]
    """Per channel: the sum of pixel values on the 0..1 scale at ``stats_size``."""
    pixel_sq_sum: list[float]
    num_pixels: int
    """Pixels per channel the sums cover."""
    num_bad: int = 0
    bad_examples: list[str] = field(default_factory=list)
    """``source: reason`` of the first bad samples."""
    written: bool = True
    """False when a previous prep's valid shard was kept."""
    peak_rss_bytes: int = 0
    """The task process's peak resident memory while it made this shard."""
    inputs_sha256: str = ""
    """:func:`task_fingerprint` of the task that wrote it: a re-run keeps the shard only for the same inputs."""


# ---------------------------------------------------------------------------------------------- the driver's side


def _unit(key: str, seed: int, salt: str) -> float:
    digest = hashlib.sha256(f"{seed}/{salt}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_splits(items: list[ImageItem], cfg: DataConfig, *, own: tuple[str, ...]) -> dict[str, list[ImageItem]]:
    """The source's train split cut into train, val and test: the items ordered by a hash of their source name
    and ``data.split_seed``, the first ``data.test_fraction`` to test and the next ``data.val_fraction`` to val
    (rounded); ``own`` names the splits the source has itself, which are not carved out of train."""
    ordered = sorted(items, key=lambda item: _unit(item.source, cfg.split_seed, "split"))
    n_test = 0 if "test" in own else int(round(len(ordered) * cfg.test_fraction))
    n_val = 0 if "val" in own else int(round(len(ordered) * cfg.val_fraction))
    if n_test + n_val >= len(ordered):
        raise no_training_samples_error(cfg, len(ordered), source=f"data.path={quote(cfg.path)}")
    splits = {"train": ordered[n_test + n_val :]}
    if n_test:
        splits["test"] = ordered[:n_test]
    if n_val:
        splits["val"] = ordered[n_test : n_test + n_val]
    return splits


def shard_tasks(splits: dict[str, list[ImageItem]], cfg: DataConfig, *, kind: str, out_dir: str) -> list[ShardTask]:
    """Each split in a hashed order (classes mixed), cut into up to ``data.num_shards`` shards."""
    tasks = []
    for split, items in splits.items():
        ordered = sorted(items, key=lambda item: _unit(item.source, cfg.split_seed, "order"))
        parts = np.array_split(np.arange(len(ordered)), min(cfg.num_shards, len(ordered)))
        for index, part in enumerate(parts):
            tasks.append(
                ShardTask(
                    split=split,
                    file=f"{split}-{index:05d}-of-{len(parts):05d}.parquet",
                    kind=kind,
                    root=cfg.path,
                    out_dir=out_dir,
                    stats_size=cfg.image_size or 32,
                    items=[ordered[i] for i in part],
                )
            )
    return tasks


def list_image_folder(cfg: DataConfig) -> tuple[dict[str, list[ImageItem]], list[str], tuple[str, ...]]:
    """The tree's images by split (``train`` and any ``val``/``test`` folders, else all of it as ``train``), the
    class names, and the splits the tree has itself. Raises ``ValueError`` naming ``data.path`` for a tree with
    fewer than two classes, a split without images, or a class folder a split lacks."""
    from training_core.datasets import IMAGE_SUFFIXES

    fs, root = _folder_root(cfg)
    root = root.rstrip("/")
    found: dict[str, dict[str, list[str]]] = {}
    for path in sorted(fs.find(root)):
        relative = path[len(root) :].lstrip("/")
        if not relative.lower().endswith(IMAGE_SUFFIXES):
            continue
        parts = relative.split("/")
        if parts[0] in ("train", "val", "test") and len(parts) == 3:
            split, cls = parts[0], parts[1]
        elif len(parts) == 2:
            split, cls = "", parts[0]
        else:
            continue
        found.setdefault(split, {}).setdefault(cls, []).append(relative)
    for split in ("val", "test"):
        if fs.isdir(f"{root}/{split}") and split not in found:
            raise ValueError(
                f"data.path={quote(cfg.path)} is invalid: {split}/ has no images; every split holds images of the "
                f"classes of train/ ({', '.join(IMAGE_SUFFIXES)}); add images or remove {split}/"
            )
    trees = {name: value for name, value in found.items() if name}
    if trees and "" in found:
        raise ValueError(
            f"data.path={quote(cfg.path)} is invalid: it mixes split folders ({', '.join(sorted(trees))}/) with "
            f"class folders ({', '.join(sorted(found[''])[:5])}/) at its top; use <split>/<class>/<image> or "
            "<class>/<image>"
        )
    trees = trees or {"train": found.get("", {})}
    if "train" not in trees:
        raise ValueError(
            f"data.path={quote(cfg.path)} is invalid: it has {', '.join(sorted(trees))}/ but no train/ folder of "
            "<class>/<image>; add train/ or use <class>/<image> at the top"
        )
    under = "train/" if "train" in found else "./"
    classes = sorted(trees["train"])
    if len(classes) < 2:
        raise ValueError(
            f"data.path={quote(cfg.path)} is invalid: found {len(classes)} class folder(s) with images under "
            f"{quote(under)}; an image folder needs at least two <class>/ subfolders of images "
            f"({', '.join(IMAGE_SUFFIXES)})"
        )
    for split in ("val", "test"):
        if split in found and (not trees[split] or set(trees[split]) - set(classes)):
            extra = sorted(set(trees[split]) - set(classes))
            why = f"class folder(s) {', '.join(extra[:5])} that train/ lacks" if extra else "no images"
            raise ValueError(
                f"data.path={quote(cfg.path)} is invalid: {split}/ has {why}; every split holds images of the "
                "classes of train/"
            )
    splits: dict[str, list[ImageItem]] = {}
    next_id = 0
    for split, tree in trees.items():
        items = []
        for cls, paths in sorted(tree.items()):
            for path in paths:
                items.append(ImageItem(source=path, label=classes.index(cls), sample_id=next_id))
                next_id += 1
        splits[split] = items
    return splits, classes, tuple(name for name in trees if name != "train")


def _folder_root(cfg: DataConfig):
    from training_core.datasets import _existing

    fs, root = _existing(cfg.path)
    if not fs.isdir(root):
        raise ValueError(
            f"data.path={quote(cfg.path)} is invalid: not a directory; point it at the root of <class>/<image> folders"
        )
    return fs, root


def check_source(cfg: DataConfig) -> None:
    """The checks of an image source that need no listing and no Ray cluster: ``data.path`` exists, an image folder
    is a directory, a CIFAR-10 tarball opens as a tar archive. Raises ``ValueError`` naming ``data.path``; the
    prep driver checks the rest (classes, splits, members) before any shard task."""
    if cfg.dataset == "cifar10":
        from training_core.datasets import cifar10_archive

        with cifar10_archive(cfg.path):
            return
    _folder_root(cfg)


def list_cifar10(cfg: DataConfig) -> tuple[dict[str, list[ImageItem]], list[str], tuple[str, ...]]:
    """The CIFAR-10 tarball's rows by split (its test batch is the test split), reading and checking one batch
    member at a time."""
    from training_core.datasets import CIFAR10_BATCHES, CIFAR10_CLASSES, cifar10_members

    splits: dict[str, list[ImageItem]] = {"train": [], "test": []}
    next_id = 0
    for name, (_, labels) in cifar10_members(cfg.path):
        split = "test" if name == CIFAR10_BATCHES[5] else "train"
        for row, label in enumerate(labels.tolist()):
            splits[split].append(ImageItem(source=f"{name}#{row}", label=int(label), sample_id=next_id))
            next_id += 1
    return splits, list(CIFAR10_CLASSES), ("test",)


def run_tasks(tasks: list[ShardTask], *, num_workers: int) -> list[ShardResult]:
    """Every shard task as a Ray task of one CPU, ``num_workers`` at a time (:func:`training_core.ray_tasks.map_tasks`),
    on the running Ray cluster (or a local one started as the platform starts it). Only the small results come back
    to the driver."""
    import ray

    from training_core.ray_tasks import map_tasks

    if not ray.is_initialized():
        from training_core.ray_settings import start_local_cluster

        start_local_cluster()
    results = map_tasks(write_shard, ((task,) for task in tasks), num_workers=num_workers, ordered=False)
    return sorted(results, key=lambda r: (r.split, r.file))


# ---------------------------------------------------------------------------------------------- one shard's task


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set, to the current one
    except OSError:
        pass


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}"


SHARD_FORMAT = 2
"""What a shard task writes from given inputs; part of :func:`task_fingerprint`. 2: images the loader's decoder does
not read as 8-bit stored as 8-bit PNGs."""


def task_fingerprint(task: ShardTask) -> str:
    """The sha256 of what decides a shard's bytes: the format, the source, the split, the statistics' size and every
    item (source, label, sample id) in order. Not the output directory: a shard is the same wherever it is."""
    inputs = [SHARD_FORMAT, task.kind, task.root, task.split, task.file, task.stats_size]
    inputs.append([(item.source, item.label, item.sample_id) for item in task.items])
    return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()


def kept_shard(fs, task: ShardTask) -> ShardResult | None:
    """A previous prep's shard of ``task`` when its record exists, was written from the same inputs (another image
    size, split seed or source changes them) and the file still has the recorded sha256."""
    done = _join(task.out_dir, task.file + DONE_SUFFIX)
    try:
        with fs.open(done, "rb") as f:
            result = ShardResult(**json.loads(f.read()))
        if result.inputs_sha256 != task_fingerprint(task):
            return None
        with fs.open(_join(task.out_dir, task.file), "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()  # in blocks: not the whole shard in memory
    except (FileNotFoundError, ValueError, TypeError):
        return None
    if digest != result.sha256 or result.split != task.split:
        return None
    result.written = False
    return result


ROW_GROUP_SAMPLES = 256
"""Samples per Parquet row group: a shard task holds one row group of images at a time, whatever the shard's size."""


def write_shard(task: ShardTask) -> ShardResult:
    """Read, check and write one shard (or keep a previous prep's valid one). Rows are written a row group at a time
    and hashed on the way, so the task holds one row group of images, not the shard (held whole, with the file
    built in memory, a task peaked at ~4.5x the shard's encoded images)."""
    import fsspec

    _reset_peak_rss()
    fs, _ = fsspec.core.url_to_fs(task.out_dir)
    kept = kept_shard(fs, task)
    if kept is not None:
        return kept
    sums, sq_sums, num_pixels = np.zeros(3), np.zeros(3), 0
    bad: list[str] = []
    with _ShardWriter(fs, _join(task.out_dir, task.file)) as writer:
        for item, payload in _read_items(task):
            try:
                pixels = _decoded(payload, task.stats_size)
                payload = _stored(payload)
            except Exception as exc:  # noqa: BLE001 - any decoder failure marks the sample bad, never the prep
                bad.append(f"{item.source}: {type(exc).__name__}: {clip(str(exc).split(' <_io.')[0], 120)}")
                continue
            sums += pixels.sum(axis=(0, 1))
            sq_sums += np.square(pixels).sum(axis=(0, 1))
            num_pixels += pixels.shape[0] * pixels.shape[1]
            writer.add(item, payload)
    result = ShardResult(
        split=task.split,
        file=task.file,
        num_samples=writer.num_rows,
        sha256=writer.digest.hexdigest(),
        label_range=writer.label_range,
        pixel_sum=sums.tolist(),
        pixel_sq_sum=sq_sums.tolist(),
        num_pixels=num_pixels,
        num_bad=len(bad),
        bad_examples=bad[:MAX_BAD_EXAMPLES],
        inputs_sha256=task_fingerprint(task),
    )
    result.peak_rss_bytes = _peak_rss_bytes()
    with fs.open(_join(task.out_dir, task.file + DONE_SUFFIX), "w") as f:
        f.write(json.dumps(asdict(result)))
    return result


class _ShardWriter:
    """A Parquet shard written :data:`ROW_GROUP_SAMPLES` rows at a time and hashed as it is written (``digest``).
    The file is created with its first row group: a shard whose every image is bad leaves no file. The images are
    compressed already; Parquet's own compression would only spend CPU."""

    def __init__(self, fs: Any, path: str) -> None:
        import pyarrow as pa

        self.fs, self.path = fs, path
        self.schema = pa.schema(
            [("sample_id", pa.int64()), ("label", pa.int64()), ("image", pa.binary()), ("source", pa.string())]
        )
        self.rows: dict[str, list] = {name: [] for name in PARQUET_COLUMNS}
        self.digest = hashlib.sha256()
        self.num_rows, self.label_range = 0, [0, 0]
        self._stack: Any = None
        self._writer: Any = None

    def __enter__(self) -> "_ShardWriter":
        import contextlib

        self._stack = contextlib.ExitStack()
        return self

    def add(self, item: ImageItem, payload: bytes) -> None:
        for name, value in zip(PARQUET_COLUMNS, (item.sample_id, item.label, payload, item.source)):
            self.rows[name].append(value)
        low, high = self.label_range
        self.label_range = [min(low, item.label), max(high, item.label)] if self.num_rows else [item.label] * 2
        self.num_rows += 1
        if len(self.rows["image"]) == ROW_GROUP_SAMPLES:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._writer is None:  # closed in reverse: the writer (the footer), the hashing file, then the file
            sink = self._stack.enter_context(self.fs.open(self.path, "wb"))
            hashed = self._stack.enter_context(_Sha256Writer(sink, self.digest))
            self._writer = self._stack.enter_context(pq.ParquetWriter(hashed, self.schema, compression="none"))
        self._writer.write_table(pa.table(self.rows, schema=self.schema))
        for values in self.rows.values():
            values.clear()

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        with self._stack:
            if exc_type is None and self.rows["image"]:
                self._flush()


class _Sha256Writer(io.RawIOBase):
    """A writable file that passes every write on to ``sink`` and adds it to ``digest``; closing it leaves ``sink``
    open."""

    def __init__(self, sink: Any, digest: Any) -> None:
        super().__init__()
        self.sink, self.digest, self.position = sink, digest, 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sink.write(view)
        self.digest.update(view)
        self.position += len(view)
        return len(view)

    def tell(self) -> int:
        return self.position


def _decoded(payload: bytes, size: int) -> np.ndarray:
    """The image as float RGB pixels on the 0..1 scale at ``size`` x ``size``; raises when it does not decode."""
    from PIL import Image

    with Image.open(io.BytesIO(payload)) as image:
        image.draft("RGB", (size, size))  # JPEG decodes at a reduced scale when that is enough
        image = _rgb8(image).resize((size, size), Image.BILINEAR)
        return np.asarray(image, dtype=np.float64) / 255.0


def _rgb8(image: Any) -> Any:
    """A PIL image as 8-bit RGB. 16-bit greys (a 16-bit grey PNG opens as ``I;16`` or ``I``) are scaled to 8 bits,
    as the loader's decoder scales them; PIL's own ``convert`` would clip them at 255."""
    from PIL import Image

    if image.mode.startswith("I"):
        values = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
        return Image.fromarray((values >> 8).astype(np.uint8), "L").convert("RGB")  # the high byte, as torchvision
    return image.convert("RGB")


def _loader_reads(payload: bytes) -> bool:
    """Whether the loader's decoder (``torchvision.io.decode_image``) reads these bytes as 8-bit images: JPEG, PNG of
    up to 8 bits a channel (its IHDR's bit depth), GIF and WebP. It refuses BMP, TIFF and PPM, and gives 16-bit PNGs
    as 16-bit tensors."""
    if payload.startswith(b"\x89PNG\r\n\x1a\n"):
        return len(payload) > 24 and payload[24] <= 8
    return payload.startswith((b"\xff\xd8\xff", b"GIF87a", b"GIF89a")) or (
        payload[:4] == b"RIFF" and payload[8:12] == b"WEBP"
    )


def _stored(payload: bytes) -> bytes:
    """An image's bytes as its shard keeps them: as they came when the loader's decoder reads them; otherwise (BMP, a
    16-bit PNG...) re-encoded as an 8-bit RGB PNG, lossless for 8-bit sources."""
    if _loader_reads(payload):
        return payload
    from PIL import Image

    with Image.open(io.BytesIO(payload)) as image:
        buffer = io.BytesIO()
        _rgb8(image).save(buffer, format="PNG")
        return buffer.getvalue()


def _read_items(task: ShardTask) -> Iterator[tuple[ImageItem, bytes]]:
    if task.kind == "image_folder":
        import fsspec

        fs, root = fsspec.core.url_to_fs(task.root)
        for item in task.items:
            with fs.open(_join(root, item.source), "rb") as f:
                yield item, f.read()
        return
    by_member: dict[str, list[tuple[int, ImageItem]]] = {}
    for item in task.items:
        member, row = item.source.rsplit("#", 1)
        by_member.setdefault(member, []).append((int(row), item))
    from training_core.datasets import cifar10_members

    encoded: dict[int, bytes] = {}
    # Rows are encoded as PNG member by member, then yielded in the task's order.
    for member, (images, _) in cifar10_members(task.root, set(by_member)):
        for row, item in by_member[member]:
            encoded[item.sample_id] = _png(images[row])
    for item in task.items:
        yield item, encoded[item.sample_id]


def _png(chw: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(chw.transpose(1, 2, 0))).save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------- the prep


@dataclass
class ImagePrep:
    """What an encoded-image prep made: the shard records by split, the classes and the statistics."""

    results: list[ShardResult]
    classes: list[str]
    mean: list[float]
    std: list[float]
    num_bad: int
    bad_examples: list[str]

    @property
    def num_written(self) -> int:
        return sum(r.written for r in self.results)


def prepare_images(cfg: DataConfig, out_dir: str) -> ImagePrep:
    """List, split and shard the image source of ``cfg``, run the shard tasks, and total their statistics and bad
    samples. Raises ``ValueError`` naming ``data.max_bad_samples`` when more samples than it allows are bad."""
    import fsspec

    lister = list_cifar10 if cfg.dataset == "cifar10" else list_image_folder
    splits, classes, own = lister(cfg)
    splits = {**assign_splits(splits.pop("train"), cfg, own=own), **splits}
    for name in ("val", "test"):
        if name not in splits:
            field_name = f"data.{name}_fraction"
            raise ValueError(
                f"{field_name}={getattr(cfg, f'{name}_fraction')!r} is invalid: data.path={quote(cfg.path)} has no "
                f"{name} split of its own and this fraction of its {len(splits['train'])} training images holds none; "
                "raise it or add more images"
            )
    fs, root = fsspec.core.url_to_fs(out_dir)
    fs.makedirs(root, exist_ok=True)
    tasks = shard_tasks(splits, cfg, kind=cfg.dataset, out_dir=out_dir)
    results = run_tasks(tasks, num_workers=cfg.prep_num_workers)
    num_bad = sum(r.num_bad for r in results)
    examples = [e for r in results for e in r.bad_examples][:MAX_BAD_EXAMPLES]
    if num_bad:
        log.warning("data prep skipped %d bad sample(s) of %s, first: %s", num_bad, redact(cfg.path), examples)
    if num_bad > cfg.max_bad_samples:
        raise ValueError(
            f"data prep found {num_bad} bad (undecodable) sample(s) in data.path={quote(cfg.path)}, more than "
            f"data.max_bad_samples={cfg.max_bad_samples}; the first: {clip('; '.join(examples[:3]), 600)}. Remove or "
            "replace those files, or raise data.max_bad_samples to skip them"
        )
    empty = sorted({r.split for r in results} - {r.split for r in results if r.num_samples})
    if empty:
        raise ValueError(
            f"data.path={quote(cfg.path)} is invalid: every image of split(s) {', '.join(empty)} is bad; fix the source"
        )
    train = [r for r in results if r.split == "train"]
    count = sum(r.num_pixels for r in train)
    mean = np.sum([r.pixel_sum for r in train], axis=0) / count
    var = np.sum([r.pixel_sq_sum for r in train], axis=0) / count - mean**2
    std = np.sqrt(np.maximum(var, 0.0))
    log.info(
        "image prep of %s: %d shard(s), %d written, %d kept from an earlier prep",
        redact(cfg.path),
        len(results),
        sum(r.written for r in results),
        sum(not r.written for r in results),
    )
    return ImagePrep(
        results=[r for r in results if r.num_samples],
        classes=classes,
        mean=mean.tolist(),
        std=np.maximum(std, 1e-6).tolist(),
        num_bad=num_bad,
        bad_examples=examples,
    )


# ---------------------------------------------------------------------------------------------- the loader's side


def shard_bytes(manifest: Any, shard: Any, data: DataConfig) -> bytes:
    """A shard file's bytes, verified against its sha256; a remote shard goes through the bounded local cache
    (``data.cache_dir``, ``data.cache_max_bytes``), so an epoch after the first reads it from local disk."""
    import fsspec

    from training_core.data import _join as join
    from training_core.data import _plain_name, _shard_error

    where = f"shard {quote(shard.file)} in {clip(redact(manifest.directory), 500)}"
    _plain_name(shard.file, lambda why: _shard_error(where, why))
    url = join(manifest.directory, shard.file)
    remote = "://" in manifest.directory and not manifest.directory.startswith("file://")
    cache = data.cache_dir or os.path.join(tempfile.gettempdir(), "training-shard-cache")
    cached = os.path.join(cache, shard.sha256 + SHARD_SUFFIX) if remote else ""
    if cached:
        payload = _from_cache(cached, shard.sha256)
        if payload is not None:
            return payload
    with fsspec.open(url, "rb") as f:
        payload = f.read()
    digest = hashlib.sha256(payload).hexdigest()
    if digest != shard.sha256:
        _shard_error(where, f"is corrupt: sha256 {digest} != manifest {shard.sha256}")
    if cached:
        _to_cache(cached, payload, max_bytes=data.cache_max_bytes)
    return payload


def _from_cache(cached: str, sha256: str) -> bytes | None:
    """The cached shard's bytes when the file is there and has ``sha256``. Loader processes, and the ranks of a node,
    share the cache: another one may evict the file at any moment, which is a miss, not an error."""
    try:
        with open(cached, "rb") as f:
            payload = f.read()
    except OSError:  # not there (evicted), or a cache directory that cannot be used: a miss
        return None
    if hashlib.sha256(payload).hexdigest() != sha256:
        return None
    try:
        os.utime(cached)  # recently used
    except FileNotFoundError:
        pass
    return payload


def _to_cache(cached: str, payload: bytes, *, max_bytes: int) -> None:
    """Keep a verified shard in the cache (written aside, then renamed into place) and evict down to ``max_bytes``.
    A cache that cannot take it (a full disk) costs a download the next time, not the run: logged."""
    staging = f"{cached}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        with open(staging, "wb") as f:
            f.write(payload)
        os.replace(staging, cached)
    except OSError as exc:
        log.warning(
            "the shard cache could not keep %s (%s); it is read from its source again when next needed", cached, exc
        )
        try:
            os.remove(staging)
        except OSError:  # never written, or no directory to write it in
            pass
        return
    evict(os.path.dirname(cached), max_bytes)


SHARD_SUFFIX = ".parquet"


def evict(cache: str, max_bytes: int) -> None:
    """Delete the least recently used shards of ``cache`` until it holds at most ``max_bytes`` (the newest shard
    stays even when it alone is larger)."""
    entries = []
    for name in os.listdir(cache):
        if name.endswith(".tmp"):
            _remove_stale(os.path.join(cache, name))
        elif name.endswith(SHARD_SUFFIX):
            try:
                stat = os.stat(os.path.join(cache, name))
            except FileNotFoundError:  # another loader process evicted it
                continue
            entries.append((stat.st_mtime, stat.st_size, name))
    entries.sort()
    used = sum(size for _, size, _ in entries)
    for _, size, name in entries[:-1]:
        if used <= max_bytes:
            break
        try:
            os.remove(os.path.join(cache, name))
        except FileNotFoundError:
            pass
        used -= size


STALE_STAGING_S = 600
"""A staging file (``<shard>.<pid>.tmp``) untouched this long belongs to a writer that died: eviction deletes it."""


def _remove_stale(path: str) -> None:
    try:
        if time.time() - os.stat(path).st_mtime > STALE_STAGING_S:
            os.remove(path)
    except FileNotFoundError:
        pass


def import_decoders() -> None:
    """Import what reading and decoding a shard imports. Called before loader processes are forked, so each starts
    with them: imported in each process, every epoch, they cost ~2 s of CPU before its first batch (pyarrow's
    dataset module alone was 20% of the loader processes' time under py-spy, epochs of 1,400 images)."""
    import pyarrow.dataset  # noqa: F401  (pq.read_table imports it on first use)
    import pyarrow.parquet  # noqa: F401
    import torchvision.io  # noqa: F401
    from torchvision.transforms import v2  # noqa: F401


class EncodedImages:
    """A Parquet shard's images, decoded (and for training augmented) one sample at a time."""

    def __init__(
        self,
        sample_ids: list[int],
        labels: list[int],
        images: list[bytes],
        *,
        size: int,
        data: DataConfig,
        where: str = "a shard",
    ):
        self.sample_ids, self.labels, self.images = sample_ids, labels, images
        self.size, self.data, self.where = size, data, where
        self._transforms: tuple[Any, Any] | None = None

    @classmethod
    def read(cls, manifest: Any, shard: Any, data: DataConfig) -> "EncodedImages":
        """Shard ``shard``, checked against the manifest: sha256, columns and their types, count and labels."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        from training_core.data import _shard_error

        where = f"shard {quote(shard.file)} in {clip(redact(manifest.directory), 500)}"
        payload = shard_bytes(manifest, shard, data)
        try:
            # ParquetFile.read, one thread: 0.6 ms a 2 MB shard where pq.read_table, which goes through
            # pyarrow.dataset and its thread pool, takes 2.9 ms; every loader process reads every shard it takes from.
            table = pq.ParquetFile(pa.BufferReader(payload)).read(
                columns=["sample_id", "label", "image"], use_threads=False
            )
        except (pa.ArrowException, OSError, ValueError) as exc:
            _shard_error(where, f"is not a readable Parquet shard ({type(exc).__name__}: {clip(str(exc))})")
        types = {"sample_id": pa.int64(), "label": pa.int64(), "image": pa.binary()}
        for name, expected in types.items():
            if name not in table.column_names:  # ParquetFile.read leaves out a column it does not find
                _shard_error(where, f"lacks column {name} ({expected}); it has {', '.join(table.column_names)}")
            if table.schema.field(name).type != expected:
                _shard_error(where, f"has column {name} of type {table.schema.field(name).type}; expected {expected}")
        if table.num_rows != shard.num_samples:
            _shard_error(where, f"holds {table.num_rows} samples; the manifest says {shard.num_samples}")
        labels = table.column("label").to_pylist()
        low, high = min(labels), max(labels)
        if [low, high] != shard.bounds.get("labels", [low, high]) or not 0 <= low <= high < manifest.num_classes:
            _shard_error(where, f"holds labels {low}..{high}; the manifest has {manifest.num_classes} classes")
        return cls(
            table.column("sample_id").to_pylist(),
            labels,
            table.column("image").to_pylist(),
            size=manifest.input_shape[-1],
            data=data,
            where=where,
        )

    def __len__(self) -> int:
        return len(self.labels)

    def transforms(self) -> tuple[Any, Any]:
        """(training, evaluation) transforms of a uint8 image tensor."""
        if self._transforms is None:
            from torchvision.transforms import v2

            train = v2.Compose(
                [
                    v2.RandomResizedCrop(self.size, scale=(self.data.augment_min_crop_scale, 1.0), antialias=True),
                    v2.RandomHorizontalFlip(),
                ]
            )
            evaluation = v2.Compose([v2.Resize(self.size, antialias=True), v2.CenterCrop(self.size)])
            self._transforms = (train if self.data.augment else evaluation, evaluation)
        return self._transforms

    def sample(self, row: int, *, epoch: int, train: bool, seed: int = 0) -> dict[str, np.ndarray]:
        import torch
        from torchvision.io import ImageReadMode, decode_image

        from training_core.loader import sample_seed

        encoded = torch.frombuffer(bytearray(self.images[row]), dtype=torch.uint8)
        try:
            image = decode_image(encoded, mode=ImageReadMode.RGB)
        except RuntimeError as exc:  # prep checked every image: the shard is not one this prep wrote
            from training_core.data import _shard_error

            _shard_error(self.where, f"holds sample {self.sample_ids[row]}, which does not decode ({clip(str(exc))})")
        if image.dtype != torch.uint8:  # a 16-bit PNG in a shard prepared before prep re-encoded them
            from torchvision.transforms.v2.functional import to_dtype

            image = to_dtype(image, torch.uint8, scale=True)
        train_transform, eval_transform = self.transforms()
        if train:
            with torch.random.fork_rng(devices=[]):
                # The CPU generator only: torch.manual_seed also seeds every CUDA generator, and before CUDA is
                # initialised it queues that call with a formatted stack trace (15% of a loader process's time).
                torch.default_generator.manual_seed(sample_seed(seed, epoch, self.sample_ids[row]))
                image = train_transform(image)
        else:
            image = eval_transform(image)
        return {
            "images": image.numpy(),
            "labels": np.int64(self.labels[row]),
            "sample_ids": np.int64(self.sample_ids[row]),
        }
