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

Training workers decode and augment these shards in loader processes (:mod:`training_core.data.loader`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import itertools
import json
import logging
import os
import stat
import tempfile
import time
import zlib
from dataclasses import KW_ONLY, asdict, dataclass, field
from typing import Any, Iterator, NoReturn

import numpy as np

from training_core.config import DataConfig
from training_core.data.shard_files import SPLIT_NAMES, held_out, read_verified, shard_error, shard_where
from training_core.files import UnreadableFile, file_kind, join_path, read_regular
from training_core.messages import clip, invalid, quote
from training_core.redact import redact
from training_core.registry import DATASET_SOURCES, DatasetSource, load

log = logging.getLogger(__name__)

PARQUET_COLUMNS = ("sample_id", "label", "image", "source")
DONE_SUFFIX = ".done.json"
MAX_EXAMPLES = 10
"""Bad, re-encoded and left-out samples named in the manifest and the prep log (the counts cover them all)."""


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
    """``data.dataset``: an encoded source of :data:`training_core.registry.DATASET_SOURCES` (``image_folder``,
    ``cifar10``)."""
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
    num_reencoded: int = 0
    """Samples stored re-encoded as 8-bit PNGs: images the loader's decoder does not read as they came."""
    reencoded_examples: list[str] = field(default_factory=list)
    """``source: why`` of the first re-encoded samples."""
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


def shard_tasks(splits: dict[str, list[ImageItem]], cfg: DataConfig, *, out_dir: str) -> list[ShardTask]:
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
                    kind=cfg.dataset,
                    root=cfg.path,
                    out_dir=out_dir,
                    stats_size=cfg.image_size or 32,
                    items=[ordered[i] for i in part],
                )
            )
    return tasks


FOLDER_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
"""The files of a class folder prep reads (case-insensitive). Each is decoded with PIL; what the loader's decoder
does not read as one 8-bit image (BMP, TIFF, an animated GIF or WebP...) is stored re-encoded as an 8-bit PNG."""


@dataclass
class LeftOut:
    """What an image folder holds that prep does not read, and why: logged by the prep and recorded in the manifest
    (``spec.left_out``), so a class or images that went missing are never a silent change."""

    count: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    """Entries left out, by reason."""
    examples: list[str] = field(default_factory=list)
    """``path: reason`` of the first ones, paths relative to ``data.path``."""

    def add(self, path: str, reason: str) -> None:
        self.count += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{path}: {reason}")


@dataclass
class ImageListing:
    """A source's samples by split (``train`` and the splits it has itself, which are not carved out of train), before
    the train split is cut."""

    splits: dict[str, list[ImageItem]]
    classes: list[str]
    left_out: LeftOut = field(default_factory=LeftOut)


@dataclass
class _Entry:
    name: str
    kind: str
    """``directory``, ``file`` (regular), or what else it is (``a FIFO``, ``a dangling symlink``...)."""


def list_image_folder(cfg: DataConfig) -> ImageListing:
    """The tree's images by split (``train`` and any ``val``/``test`` folders, else all of it as ``train``), the
    class names, the splits the tree has itself, and what was left out.

    The layout is ``[<split>/]<class>/<image>``; symlinked folders and images are followed. Left out, counted and
    named: files beside the class folders, folders inside a class folder (nested images), hidden entries (``.``
    names) and files without an image suffix (:data:`FOLDER_IMAGE_SUFFIXES`). Raises ``ValueError`` naming
    ``data.path`` for a tree with fewer than two classes, a split without images, a class folder a split lacks or
    without images, a name that is not UTF-8, and an image name that is not a regular file (a FIFO, a device, a
    dangling symlink), before any shard task."""
    fs, root = _folder_root(cfg)
    root = root.rstrip("/")
    left_out = LeftOut()
    top = _listed(fs, root, "", cfg, left_out)
    tree_names = [name for name in top if name in SPLIT_NAMES]
    others = sorted(set(top) - set(tree_names))
    if tree_names and others:
        raise ValueError(
            f"data.path={quote(cfg.path)} is invalid: it mixes split folders ({', '.join(sorted(tree_names))}/) with "
            f"class folders ({', '.join(others[:5])}/) at its top; use "
            "<split>/<class>/<image> or <class>/<image>"
        )
    if tree_names and "train" not in tree_names:
        raise ValueError(
            f"data.path={quote(cfg.path)} is invalid: it has {', '.join(sorted(tree_names))}/ but no train/ folder of "
            "<class>/<image>; add train/ or use <class>/<image> at the top"
        )
    split_dirs = {name: f"{name}/" for name in sorted(tree_names)} or {"train": ""}
    trees: dict[str, dict[str, list[str]]] = {}
    for split, prefix in split_dirs.items():
        class_dirs = _listed(fs, root, prefix, cfg, left_out) if prefix else top
        trees[split] = {cls: _listed(fs, root, f"{prefix}{cls}/", cfg, left_out, images=True) for cls in class_dirs}
    _check_classes(cfg, trees, under="train/" if tree_names else "./")
    classes = sorted(trees["train"])
    ids = itertools.count()
    splits = {
        split: [ImageItem(path, classes.index(cls), next(ids)) for cls, paths in sorted(tree.items()) for path in paths]
        for split, tree in trees.items()
    }
    if left_out.count:
        log.warning(
            "image folder %s: left out %d entr%s (%s); first: %s",
            redact(cfg.path),
            left_out.count,
            "y" if left_out.count == 1 else "ies",
            "; ".join(f"{count} {reason}" for reason, count in sorted(left_out.reasons.items())),
            left_out.examples,
        )
    return ImageListing(splits, classes, left_out)


def _check_classes(cfg: DataConfig, trees: dict[str, dict[str, list[str]]], *, under: str) -> None:
    """Every split holds images, every class folder images, train at least two classes, val and test only classes
    of train."""
    for split in ("val", "test"):
        if split in trees and not any(trees[split].values()):
            raise ValueError(
                f"data.path={quote(cfg.path)} is invalid: {split}/ has no images; every split holds images of the "
                f"classes of train/ ({', '.join(FOLDER_IMAGE_SUFFIXES)}); add images or remove {split}/"
            )
    for split, tree in trees.items():
        prefix = "" if under == "./" else f"{split}/"
        empty = [f"{prefix}{cls}/" for cls, paths in sorted(tree.items()) if not paths]
        if empty:
            raise ValueError(
                f"data.path={quote(cfg.path)} is invalid: class folder(s) {', '.join(empty[:5])} hold no images "
                f"({', '.join(FOLDER_IMAGE_SUFFIXES)}); a class folder is a class with images: add images to it or "
                "remove it (what a folder holds besides images is listed in the prep log)"
            )
    if len(trees["train"]) < 2:
        raise ValueError(
            f"data.path={quote(cfg.path)} is invalid: found {len(trees['train'])} class folder(s) with images under "
            f"{quote(under)}; an image folder needs at least two <class>/ subfolders of images "
            f"({', '.join(FOLDER_IMAGE_SUFFIXES)})"
        )
    for split in ("val", "test"):
        extra = sorted(set(trees.get(split, {})) - set(trees["train"]))
        if extra:
            raise ValueError(
                f"data.path={quote(cfg.path)} is invalid: {split}/ has class folder(s) {', '.join(extra[:5])} that "
                "train/ lacks; every split holds images of the classes of train/"
            )


def _listed(fs: Any, root: str, prefix: str, cfg: DataConfig, left_out: LeftOut, *, images: bool = False) -> list[str]:
    """The names of the folders in folder ``prefix`` of ``data.path`` (``root``), or with ``images`` (a class folder)
    its images as paths under ``data.path``; anything else is left out."""
    found = []
    for entry in _entries(fs, join_path(root, prefix), prefix, cfg):
        name = prefix + entry.name
        if entry.name.startswith("."):
            left_out.add(name, "hidden (its name starts with '.')")
        elif not images and entry.kind == "directory":
            found.append(entry.name)
        elif not images:
            where = "the top of data.path" if not prefix else prefix
            left_out.add(name, f"not a folder, at {where}: images go in <class>/ folders")
        elif entry.kind == "directory":
            left_out.add(name + "/", "a folder inside a class folder: nested images are not read")
        elif not entry.name.lower().endswith(FOLDER_IMAGE_SUFFIXES):
            left_out.add(name, f"not an image suffix ({', '.join(FOLDER_IMAGE_SUFFIXES)})")
        elif entry.kind != "file":
            raise ValueError(
                f"data.path={quote(cfg.path)} is invalid: {quote(name)} is {entry.kind}, not a regular file; only "
                "regular files are read as images: replace it with the image file or remove it"
            )
        else:
            found.append(name)
    return found


def _entries(fs: Any, path: str, prefix: str, cfg: DataConfig) -> list[_Entry]:
    """The entries of folder ``path``, by name. On a local disk symlinks are followed and every entry is stat'ed
    (never opened): a FIFO, a device or a dangling symlink is named as what it is. Raises ``ValueError`` naming
    ``data.path`` for a name that is not UTF-8 (it could not be stored in a shard, nor named in a manifest)."""
    from fsspec.implementations.local import LocalFileSystem

    try:
        if isinstance(fs, LocalFileSystem):
            with os.scandir(path) as found:
                entries = [_local_entry(entry) for entry in found]
        else:
            entries = [
                _Entry(info["name"].rstrip("/").rsplit("/", 1)[-1], info["type"])
                for info in fs.ls(path, detail=True)
                if info["name"].rstrip("/") != path.rstrip("/")
            ]
    except OSError as exc:
        raise ValueError(
            f"data.path={quote(cfg.path)} is invalid: folder {quote(prefix or './')} cannot be listed "
            f"({type(exc).__name__}: {clip(exc.strerror or str(exc))}); make it readable"
        ) from None
    for entry in entries:
        try:
            entry.name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"data.path={quote(cfg.path)} is invalid: the name {quote(prefix + entry.name)} is not UTF-8 (its "
                f"bytes: {clip(repr(os.fsencode(prefix + entry.name)))}); rename it with a UTF-8 name"
            ) from None
    return sorted(entries, key=lambda entry: entry.name)


def _local_entry(entry: os.DirEntry) -> _Entry:
    try:
        mode = os.stat(entry.path).st_mode  # follows symlinks: a symlinked class folder or image is read
    except FileNotFoundError:
        return _Entry(entry.name, "a dangling symlink")
    except OSError as exc:  # a symlink loop, a permission denied on the way
        return _Entry(entry.name, f"not readable ({exc.strerror})")
    if stat.S_ISDIR(mode):
        return _Entry(entry.name, "directory")
    return _Entry(entry.name, "file" if stat.S_ISREG(mode) else file_kind(mode))


def _folder_root(cfg: DataConfig) -> tuple[Any, str]:
    from training_core.data.sources import existing_location

    fs, root = existing_location(cfg.path)
    if not fs.isdir(root):
        invalid("data.path", cfg.path, "not a directory; point it at the root of <class>/<image> folders")
    return fs, root


def check_source(cfg: DataConfig) -> None:
    """The checks of an image source that need no listing and no Ray cluster: ``data.path`` exists, an image folder
    is a directory, a CIFAR-10 tarball opens as a tar archive. Raises ``ValueError`` naming ``data.path``; the
    prep driver checks the rest (classes, splits, members) before any shard task."""
    load(encoded_source(cfg.dataset).check_images)(cfg)


def encoded_source(dataset: str) -> DatasetSource:
    """The registered encoded image source ``dataset`` names, else a ``ValueError`` naming ``data.dataset``."""
    source = DATASET_SOURCES.get(dataset)
    if source is None or not source.list_images:
        encoded = ", ".join(name for name, known in DATASET_SOURCES.items() if known.list_images)
        invalid("data.dataset", dataset, f"it is not an encoded image source; choose one of {encoded}")
    return source


def check_cifar10(cfg: DataConfig) -> None:
    """``data.path`` opens as a tar archive."""
    from training_core.data.sources import cifar10_archive

    with cifar10_archive(cfg.path):
        return


def check_image_folder(cfg: DataConfig) -> None:
    """``data.path`` is a directory."""
    _folder_root(cfg)


def list_cifar10(cfg: DataConfig) -> ImageListing:
    """The CIFAR-10 tarball's rows by split (its test batch is the test split), reading and checking one batch
    member at a time."""
    from training_core.data.sources import CIFAR10_BATCHES, CIFAR10_CLASSES, cifar10_members

    splits: dict[str, list[ImageItem]] = {"train": [], "test": []}
    ids = itertools.count()
    for name, (_, labels) in cifar10_members(cfg.path):
        split = "test" if name == CIFAR10_BATCHES[5] else "train"
        splits[split] += [ImageItem(f"{name}#{row}", label, next(ids)) for row, label in enumerate(labels.tolist())]
    return ImageListing(splits, list(CIFAR10_CLASSES))


def run_tasks(tasks: list[ShardTask], *, num_workers: int) -> list[ShardResult]:
    """Every shard task as a Ray task of one CPU, ``num_workers`` at a time
    (:func:`training_core.runners.ray_tasks.map_tasks`), on the running Ray cluster (or a local one started as the
    platform starts it). Only the small results come back to the driver."""
    import ray

    from training_core.runners.ray_tasks import map_tasks

    if not ray.is_initialized():
        from training_core.parallel.ray_settings import start_local_cluster

        start_local_cluster()
    results = map_tasks(write_shard, ((task,) for task in tasks), num_workers=num_workers, ordered=False)
    return sorted(results, key=lambda r: (r.split, r.file))


# ---------------------------------------------------------------------------------------------- one shard's task


def _reset_peak_rss() -> None:
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set, to the current one


def _peak_rss_bytes() -> int:
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


SHARD_FORMAT = 3
"""What a shard task writes from given inputs; part of :func:`task_fingerprint`. 2: images the loader's decoder does
not read as 8-bit stored as 8-bit PNGs. 3: also animated images (their first frame), PNGs libpng might refuse, and
any JPEG, GIF or WebP that the loader's decoder does not read as one 8-bit RGB image."""

MAX_IMAGE_BYTES = 64 * 2**20
"""The most bytes read from one image file (counted as read, whatever size the file reports): a larger file is a
bad sample, counted and named like an undecodable one."""


def task_fingerprint(task: ShardTask) -> str:
    """The sha256 of what decides a shard's bytes: the format, the source, the split, the statistics' size and every
    item (source, label, sample id) in order. Not the output directory: a shard is the same wherever it is."""
    inputs = [SHARD_FORMAT, task.kind, task.root, task.split, task.file, task.stats_size]
    inputs.append([(item.source, item.label, item.sample_id) for item in task.items])
    return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()


def kept_shard(fs, task: ShardTask) -> ShardResult | None:
    """A previous prep's shard of ``task`` when its record exists, was written from the same inputs (another image
    size, split seed or source changes them) and the file still has the recorded sha256."""
    try:
        result = ShardResult(**json.loads(fs.cat_file(join_path(task.out_dir, task.file + DONE_SUFFIX))))
        if result.inputs_sha256 != task_fingerprint(task):
            return None
        with fs.open(join_path(task.out_dir, task.file), "rb") as f:
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
    """Read, check and write one shard (or keep a previous prep's valid one) a row group at a time
    (:class:`_ShardWriter`): a shard held whole, with its file built in memory, peaked at ~4.5x its encoded images."""
    import fsspec

    _reset_peak_rss()
    fs, _ = fsspec.core.url_to_fs(task.out_dir)
    kept = kept_shard(fs, task)
    if kept is not None:
        return kept
    sums, sq_sums, num_pixels = np.zeros(3), np.zeros(3), 0
    bad: list[str] = []
    reencoded: list[str] = []
    with _ShardWriter(fs, join_path(task.out_dir, task.file)) as writer:
        for item, payload in _read_items(task):
            try:
                if isinstance(payload, UnreadableFile):
                    raise payload
                pixels = _decoded(payload, task.stats_size)
                payload, why = _stored(payload)
            except Exception as exc:  # noqa: BLE001 - any decoder failure marks the sample bad, never the prep
                bad.append(f"{item.source}: {type(exc).__name__}: {clip(str(exc).split(' <_io.')[0], 120)}")
                continue
            if why:
                reencoded.append(f"{item.source}: {why}")
            sums += pixels.sum(axis=(0, 1))
            sq_sums += np.square(pixels).sum(axis=(0, 1))
            num_pixels += pixels.shape[0] * pixels.shape[1]
            writer.add(item, payload)
    result = ShardResult(
        split=task.split,
        file=task.file,
        num_samples=len(writer.labels),
        sha256=writer.digest.hexdigest(),
        label_range=[min(writer.labels, default=0), max(writer.labels, default=0)],
        pixel_sum=sums.tolist(),
        pixel_sq_sum=sq_sums.tolist(),
        num_pixels=num_pixels,
        num_bad=len(bad),
        bad_examples=bad[:MAX_EXAMPLES],
        num_reencoded=len(reencoded),
        reencoded_examples=reencoded[:MAX_EXAMPLES],
        peak_rss_bytes=_peak_rss_bytes(),
        inputs_sha256=task_fingerprint(task),
    )
    fs.pipe_file(join_path(task.out_dir, task.file + DONE_SUFFIX), json.dumps(asdict(result)).encode())
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
        self.labels: list[int] = []
        """Every row's label, the row groups written included."""
        self.digest = hashlib.sha256()
        self._stack = contextlib.ExitStack()
        self._writer: Any = None

    def __enter__(self) -> "_ShardWriter":
        return self

    def add(self, item: ImageItem, payload: bytes) -> None:
        for name, value in zip(PARQUET_COLUMNS, (item.sample_id, item.label, payload, item.source)):
            self.rows[name].append(value)
        self.labels.append(item.label)
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


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
"""Bit depths allowed for each PNG colour type."""
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
"""Each interlace pass's first column and row, and its steps."""
PNG_MAX_SIDE = 1_000_000
"""libpng's default limit on a PNG's width and height."""
PNG_MAX_ANCILLARY_BYTES = 8_000_000
"""libpng's default limit on the memory of one ancillary chunk."""


def _png_problem(payload: bytes) -> str:
    """Why libpng, the loader's PNG decoder, might refuse ``payload`` or read it as more than 8 bits a channel; ""
    when it is a plain PNG: every chunk whole with its CRC, IHDR first and IEND last, no unknown critical chunk, valid
    PLTE and tRNS, the IDAT chunks consecutive and one zlib stream that inflates to exactly the image's rows, each
    with a valid filter type. Checked, not tried: libpng's errors end the process of torchvision's decoder (SIGSEGV;
    a flipped IDAT CRC byte, too little image data), and PIL reads such files. Of 8,000 randomly mutated PNGs (CRCs
    mostly recomputed), PIL read 1,899: torchvision crashed on 24, all flagged here, and decoded all 1,731 it passes."""
    chunks: list[tuple[bytes, int, int]] = []  # type, where its data starts, its length
    pos = len(PNG_SIGNATURE)
    while pos < len(payload) and (not chunks or chunks[-1][0] != b"IEND"):
        length = int.from_bytes(payload[pos : pos + 4], "big")
        end = pos + 12 + length
        if end > len(payload):
            return "a truncated chunk"
        kind = payload[pos + 4 : pos + 8]
        if not (kind.isalpha() and kind.isascii() and kind[2:3].isupper()):  # the third's case bit is reserved
            return f"a chunk type {kind!r} that is not four letters, the third upper case"
        if zlib.crc32(payload[pos + 4 : end - 4]) != int.from_bytes(payload[end - 4 : end], "big"):
            return f"a CRC mismatch in chunk {kind.decode('latin-1')!r}"
        chunks.append((kind, pos + 8, length))
        pos = end
    names = [kind for kind, _, _ in chunks]
    if not names or names[0] != b"IHDR" or chunks[0][2] != 13 or names[-1] != b"IEND" or pos != len(payload):
        return "not IHDR first and IEND last"
    width, height = int.from_bytes(payload[16:20], "big"), int.from_bytes(payload[20:24], "big")
    depth, colour, compression, filtering, interlace = payload[24:29]
    if not (0 < width <= PNG_MAX_SIDE and 0 < height <= PNG_MAX_SIDE):
        return f"a size of {width}x{height}"
    if depth not in _PNG_DEPTHS.get(colour, ()) or compression or filtering or interlace > 1:
        return "an invalid IHDR"
    if depth > 8:
        return f"{depth} bits a channel"
    problem = _png_chunk_problem(chunks, colour, depth)
    if problem:
        return problem
    bits = _PNG_CHANNELS[colour] * depth
    passes = (
        [(width, height)]
        if not interlace
        else [((width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy) for x0, y0, dx, dy in _ADAM7]
    )
    strides = [(1 + (w * bits + 7) // 8, h) for w, h in passes if w and h]
    expected = sum(stride * rows for stride, rows in strides)
    inflater = zlib.decompressobj()
    try:
        rows = inflater.decompress(
            b"".join(payload[at : at + n] for kind, at, n in chunks if kind == b"IDAT"), expected + 1
        )
    except zlib.error:
        return "IDAT data that does not inflate"
    if len(rows) != expected or not inflater.eof or inflater.unused_data:
        return f"IDAT data of {len(rows):,} bytes (or more) for {expected:,}"
    offset = 0
    for stride, count in strides:
        if max(rows[offset : offset + stride * count : stride]) > 4:
            return "a row with an invalid filter type"
        offset += stride * count
    return ""


def _png_chunk_problem(chunks: list[tuple[bytes, int, int]], colour: int, depth: int) -> str:
    """What libpng refuses among a PNG's chunks (their order, PLTE and tRNS); "" when nothing."""
    names = [kind for kind, _, _ in chunks]
    first_idat = names.index(b"IDAT") if b"IDAT" in names else -1
    if first_idat < 0 or names[first_idat : first_idat + names.count(b"IDAT")] != [b"IDAT"] * names.count(b"IDAT"):
        return "IDAT chunks missing or apart"
    for kind, _, length in chunks:
        critical = kind[:1].isupper()
        if critical and kind not in (b"IHDR", b"PLTE", b"IDAT", b"IEND"):
            return f"an unknown critical chunk {kind.decode('latin-1')!r}"
        if not critical and length > PNG_MAX_ANCILLARY_BYTES:
            return f"an ancillary chunk of {length:,} bytes"
    if names.count(b"IHDR") != 1 or names.count(b"IEND") != 1 or names.count(b"PLTE") > 1 or names.count(b"tRNS") > 1:
        return "a repeated chunk"
    sizes = dict((kind, length) for kind, _, length in chunks)
    where = {kind: names.index(kind) for kind in (b"PLTE", b"tRNS") if kind in names}
    entries = sizes.get(b"PLTE", 0) // 3
    if b"PLTE" in where and (
        colour in (0, 4)
        or where[b"PLTE"] > first_idat
        or sizes[b"PLTE"] % 3
        or not 0 < entries <= (2**depth if colour == 3 else 256)
    ):
        return "an invalid PLTE"
    if colour == 3 and b"PLTE" not in where:
        return "a palette image without PLTE"
    if b"tRNS" in where:
        fits = {0: sizes[b"tRNS"] == 2, 2: sizes[b"tRNS"] == 6, 3: sizes[b"tRNS"] <= entries}.get(colour, False)
        if not fits or where[b"tRNS"] > first_idat or where[b"tRNS"] < where.get(b"PLTE", 0):
            return "an invalid tRNS"
    return ""


def _loader_problem(payload: bytes) -> str:
    """Why the loader's decoder (``torchvision.io.decode_image``) would not read ``payload`` as one 8-bit RGB image;
    "" when it does. A PNG is checked (:func:`_png_problem`); a JPEG, GIF or WebP is decoded with that decoder
    itself, whose errors are exceptions (no crash in ~520 corrupted files PIL reads); any other format (BMP, TIFF...)
    is not read by it."""
    if payload.startswith(PNG_SIGNATURE):
        problem = _png_problem(payload)
        return f"a PNG with {problem}" if problem else ""
    if not payload.startswith((b"\xff\xd8\xff", b"GIF87a", b"GIF89a")) and not (
        payload[:4] == b"RIFF" and payload[8:12] == b"WEBP"
    ):
        return "not a JPEG, PNG, GIF or WebP"
    import torch
    from torchvision.io import ImageReadMode, decode_image

    try:
        image = decode_image(torch.frombuffer(bytearray(payload), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError as exc:
        return f"the loader's decoder refuses it ({clip(_decoder_message(exc), 120)})"
    if image.ndim != 3:
        return f"an animation of {image.shape[0]} frames (the first is kept)"
    return "" if image.dtype == torch.uint8 else f"the loader's decoder gives {image.dtype}"


def _decoder_message(exc: BaseException) -> str:
    """torchvision's error without its source location (``decode_webp, /.../decode_webp.cpp:58, Animated...``)."""
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return text.rsplit(".cpp:", 1)[-1].split(", ", 1)[-1]


def _stored(payload: bytes) -> tuple[bytes, str]:
    """An image's bytes as its shard keeps them, and why they were re-encoded ("" when kept): as they came when the
    loader's decoder reads them as one 8-bit RGB image (:func:`_loader_problem`); otherwise PIL's decode (the first
    frame of an animation) re-encoded as an 8-bit RGB PNG, lossless for 8-bit sources. So a shard holds only bytes
    the loader decodes."""
    problem = _loader_problem(payload)
    if not problem:
        return payload, ""
    from PIL import Image

    with Image.open(io.BytesIO(payload)) as image:
        return _png(_rgb8(image)), problem


def _read_items(task: ShardTask) -> Iterator[tuple[ImageItem, bytes | UnreadableFile]]:
    """Each item with its encoded bytes, or what made its file unreadable (a file that became a FIFO or a dangling
    symlink after the listing, refused by :func:`~training_core.files.read_regular` without a blocking read; one
    larger than :data:`MAX_IMAGE_BYTES`; an error while reading): that item is a bad sample."""
    layout = encoded_source(task.kind).layout
    if layout == "files":
        import fsspec

        fs, root = fsspec.core.url_to_fs(task.root)
        for item in task.items:
            try:
                yield item, read_regular(fs, join_path(root, item.source), max_bytes=MAX_IMAGE_BYTES, name=item.source)
            except UnreadableFile as exc:
                yield item, exc
            except Exception as exc:  # noqa: BLE001 - whatever a filesystem raises for a file it cannot read
                why = f"{type(exc).__name__}: {clip(redact(str(exc)))}"
                yield item, UnreadableFile(f"{quote(item.source)} cannot be read ({why})")
        return
    assert layout == "cifar_batches", f"data.dataset={task.kind!r} has an unknown layout {layout!r}"
    by_member: dict[str, list[tuple[int, ImageItem]]] = {}
    for item in task.items:
        member, row = item.source.rsplit("#", 1)
        by_member.setdefault(member, []).append((int(row), item))
    from PIL import Image

    from training_core.data.sources import cifar10_members

    encoded: dict[int, bytes] = {}
    # Rows are encoded as PNG member by member, then yielded in the task's order.
    for member, (images, _) in cifar10_members(task.root, set(by_member)):
        for row, item in by_member[member]:
            encoded[item.sample_id] = _png(Image.fromarray(np.ascontiguousarray(images[row].transpose(1, 2, 0))))
    for item in task.items:
        yield item, encoded[item.sample_id]


def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
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
    left_out: LeftOut = field(default_factory=LeftOut)
    """What the image folder holds that prep did not read, and why."""
    num_reencoded: int = 0
    """Images stored re-encoded as 8-bit PNGs (see :func:`_stored`)."""
    reencoded_examples: list[str] = field(default_factory=list)

    @property
    def num_written(self) -> int:
        return sum(r.written for r in self.results)


def prepare_images(cfg: DataConfig, out_dir: str) -> ImagePrep:
    """List, split and shard the image source of ``cfg``, run the shard tasks, and total their statistics and bad
    samples. Raises ``ValueError`` naming ``data.max_bad_samples`` when more samples than it allows are bad."""
    import fsspec

    listing = load(encoded_source(cfg.dataset).list_images)(cfg)
    splits = _checked_splits(listing, cfg)
    fs, root = fsspec.core.url_to_fs(out_dir)
    fs.makedirs(root, exist_ok=True)
    tasks = shard_tasks(splits, cfg, out_dir=out_dir)
    results = run_tasks(tasks, num_workers=cfg.prep_num_workers)
    num_bad, examples = _check_bad_samples(results, cfg)
    mean, std = _pixel_moments([r for r in results if r.split == "train"])
    num_reencoded = sum(r.num_reencoded for r in results)
    reencoded = [e for r in results for e in r.reencoded_examples][:MAX_EXAMPLES]
    if num_reencoded:
        log.info(
            "data prep stored %d image(s) of %s re-encoded as 8-bit PNGs (the loader's decoder does not read them as "
            "they came), first: %s",
            num_reencoded,
            redact(cfg.path),
            reencoded,
        )
    log.info(
        "image prep of %s: %d shard(s), %d written, %d kept from an earlier prep",
        redact(cfg.path),
        len(results),
        sum(r.written for r in results),
        sum(not r.written for r in results),
    )
    return ImagePrep(
        results=[r for r in results if r.num_samples],
        classes=listing.classes,
        mean=mean.tolist(),
        std=np.maximum(std, 1e-6).tolist(),
        num_bad=num_bad,
        bad_examples=examples,
        left_out=listing.left_out,
        num_reencoded=num_reencoded,
        reencoded_examples=reencoded,
    )


def _checked_splits(listing: ImageListing, cfg: DataConfig) -> dict[str, list[ImageItem]]:
    """The listing's splits, ``train`` cut into train/val/test (:func:`held_out`) in an order hashed from each item's
    source name and ``data.split_seed`` where the source has no val or test of its own; raises ``ValueError`` naming
    the fraction when one of them holds no image."""
    splits = dict(listing.splits)
    ordered = sorted(splits.pop("train"), key=lambda item: _unit(item.source, cfg.split_seed, "split"))
    splits = {**held_out(ordered, cfg, own=tuple(splits), source=f"data.path={quote(cfg.path)}"), **splits}
    for name in ("val", "test"):
        if name not in splits:
            raise ValueError(
                f"data.{name}_fraction={getattr(cfg, f'{name}_fraction')!r} is invalid: data.path={quote(cfg.path)} "
                f"has no {name} split of its own and this fraction of its {len(splits['train'])} training images holds "
                "none; raise it or add more images"
            )
    return splits


def _check_bad_samples(results: list[ShardResult], cfg: DataConfig) -> tuple[int, list[str]]:
    """The shards' bad samples (their number, the first few), logged; raises ``ValueError`` when more than
    ``data.max_bad_samples`` are bad or a split is left without a sample."""
    num_bad = sum(r.num_bad for r in results)
    examples = [e for r in results for e in r.bad_examples][:MAX_EXAMPLES]
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
        invalid("data.path", cfg.path, f"every image of split(s) {', '.join(empty)} is bad; fix the source")
    return num_bad, examples


def _pixel_moments(train: list[ShardResult]) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and standard deviation of the training shards' pixels."""
    count = sum(r.num_pixels for r in train)
    mean = np.sum([r.pixel_sum for r in train], axis=0) / count
    var = np.sum([r.pixel_sq_sum for r in train], axis=0) / count - mean**2
    return mean, np.sqrt(np.maximum(var, 0.0))


# ---------------------------------------------------------------------------------------------- the loader's side


def shard_bytes(manifest: Any, shard: Any, data: DataConfig) -> bytes:
    """A shard file's bytes, verified against its sha256; a remote shard goes through the bounded local cache
    (``data.cache_dir``, ``data.cache_max_bytes``), so an epoch after the first reads it from local disk."""
    where = shard_where(manifest, shard)
    remote = "://" in manifest.directory and not manifest.directory.startswith("file://")
    cache = data.cache_dir or os.path.join(tempfile.gettempdir(), "training-shard-cache")
    cached = os.path.join(cache, shard.sha256 + SHARD_SUFFIX) if remote else ""
    payload = _from_cache(cached, shard.sha256) if cached else None
    if payload is not None:
        return payload
    payload = read_verified(join_path(manifest.directory, shard.file), where, shard.sha256)
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
    with contextlib.suppress(FileNotFoundError):
        os.utime(cached)  # recently used
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
        with contextlib.suppress(OSError):  # never written, or no directory to write it in
            os.remove(staging)
        return
    evict(os.path.dirname(cached), max_bytes)


SHARD_SUFFIX = ".parquet"


def evict(cache: str, max_bytes: int) -> None:
    """Delete the least recently used shards of ``cache`` until it holds at most ``max_bytes`` (the newest shard
    stays even when it alone is larger)."""
    entries = []
    for name in os.listdir(cache):
        if name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - os.stat(os.path.join(cache, name)).st_mtime > STALE_STAGING_S:
                    os.remove(os.path.join(cache, name))
        elif name.endswith(SHARD_SUFFIX):
            with contextlib.suppress(FileNotFoundError):  # another loader process evicted it
                found = os.stat(os.path.join(cache, name))
                entries.append((found.st_mtime, found.st_size, name))
    entries.sort()
    used = sum(size for _, size, _ in entries)
    for _, size, name in entries[:-1]:
        if used <= max_bytes:
            break
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(cache, name))
        used -= size


STALE_STAGING_S = 600
"""A staging file (``<shard>.<pid>.tmp``) untouched this long belongs to a writer that died: eviction deletes it."""


def import_decoders() -> None:
    """Import what reading and decoding a shard imports. Called before loader processes are forked, so each starts
    with them: imported in each process, every epoch, they cost ~2 s of CPU before its first batch (pyarrow's
    dataset module alone was 20% of the loader processes' time under py-spy, epochs of 1,400 images)."""
    import pyarrow.dataset  # noqa: F401  (pq.read_table imports it on first use)
    import pyarrow.parquet  # noqa: F401
    import torchvision.io  # noqa: F401
    from torchvision.transforms import v2  # noqa: F401


@dataclass(repr=False)
class EncodedImages:
    """A Parquet shard's images, decoded (and for training augmented) one sample at a time."""

    sample_ids: list[int]
    labels: list[int]
    images: list[bytes]
    _: KW_ONLY
    size: int
    data: DataConfig
    where: str = "a shard"
    sources: list[str] | None = None
    """Each sample's source (its file under ``data.path``), named when it fails to decode."""

    @classmethod
    def read(cls, manifest: Any, shard: Any, data: DataConfig) -> "EncodedImages":
        """Shard ``shard``, checked against the manifest: sha256, columns and their types, count and labels."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        where = shard_where(manifest, shard)
        payload = shard_bytes(manifest, shard, data)
        try:
            # ParquetFile.read, one thread: 0.6 ms a 2 MB shard where pq.read_table, which goes through
            # pyarrow.dataset and its thread pool, takes 2.9 ms; every loader process reads every shard it takes from.
            table = pq.ParquetFile(pa.BufferReader(payload)).read(columns=list(PARQUET_COLUMNS), use_threads=False)
        except (pa.ArrowException, OSError, ValueError) as exc:
            shard_error(where, f"is not a readable Parquet shard ({type(exc).__name__}: {clip(str(exc))})")
        types = {"sample_id": pa.int64(), "label": pa.int64(), "image": pa.binary()}
        for name, expected in types.items():
            if name not in table.column_names:  # ParquetFile.read leaves out a column it does not find
                shard_error(where, f"lacks column {name} ({expected}); it has {', '.join(table.column_names)}")
            if table.schema.field(name).type != expected:
                shard_error(where, f"has column {name} of type {table.schema.field(name).type}; expected {expected}")
        if table.num_rows != shard.num_samples:
            shard_error(where, f"holds {table.num_rows} samples; the manifest says {shard.num_samples}")
        labels = table.column("label").to_pylist()
        low, high = min(labels), max(labels)
        if [low, high] != shard.bounds.get("labels", [low, high]) or not 0 <= low <= high < manifest.num_classes:
            shard_error(where, f"holds labels {low}..{high}; the manifest has {manifest.num_classes} classes")
        sources = table.column("source") if "source" in table.column_names else None
        return cls(
            table.column("sample_id").to_pylist(),
            labels,
            table.column("image").to_pylist(),
            size=manifest.input_shape[-1],
            data=data,
            where=where,
            sources=sources.to_pylist() if sources is not None and sources.type == pa.string() else None,
        )

    def __len__(self) -> int:
        return len(self.labels)

    def undecodable(self, row: int, why: str) -> NoReturn:
        """Raise :class:`~training_core.train.failures.UserCodeError` for sample ``row``: its shard, its id, its
        source file and the fix. A deterministic error of the data, which a restart would meet again: not retried."""
        from training_core.train.failures import UserCodeError

        source = self.sources[row] if self.sources is not None else "(not recorded in the shard)"
        raise UserCodeError(
            f"{self.where} holds sample {self.sample_ids[row]} from {quote(source)} under data.path, which {why}; "
            "remove or replace that file and prepare the data again (a prep of this version stores every image "
            "re-encoded where the loader's decoder would not read it)"
        )

    @functools.cached_property
    def transforms(self) -> tuple[Any, Any]:
        """(training, evaluation) transforms of a uint8 image tensor."""
        from torchvision.transforms import v2

        train = v2.Compose(
            [
                v2.RandomResizedCrop(self.size, scale=(self.data.augment_min_crop_scale, 1.0), antialias=True),
                v2.RandomHorizontalFlip(),
            ]
        )
        evaluation = v2.Compose([v2.Resize(self.size, antialias=True), v2.CenterCrop(self.size)])
        return (train if self.data.augment else evaluation, evaluation)

    def sample(self, row: int, *, epoch: int, train: bool, seed: int = 0) -> dict[str, np.ndarray]:
        import torch
        from torchvision.io import ImageReadMode, decode_image

        from training_core.data.loader import sample_seed

        encoded = torch.frombuffer(bytearray(self.images[row]), dtype=torch.uint8)
        try:
            image = decode_image(encoded, mode=ImageReadMode.RGB)
        except RuntimeError as exc:  # prep decoded every image as this does: a shard an older prep wrote
            self.undecodable(row, f"does not decode ({clip(_decoder_message(exc), 200)})")
        if image.ndim != 3:  # an animation, in a shard an older prep wrote
            self.undecodable(row, f"decodes to {image.shape[0]} frames, not one image")
        if image.dtype != torch.uint8:  # a 16-bit PNG in a shard prepared before prep re-encoded them
            from torchvision.transforms.v2.functional import to_dtype

            image = to_dtype(image, torch.uint8, scale=True)
        train_transform, eval_transform = self.transforms
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
