"""Raw dataset sources, each read into uint8 NCHW arrays per split.

A source returns :class:`RawDataset`: ``splits`` maps ``train`` (and ``test`` when the source has its own
test split) to ``(images, labels)``. Splitting off validation/test and sharding happen in
:mod:`training_core.data`.

Remote sources (``s3://...``) are read through fsspec, so s3fs picks up the usual AWS environment
variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import io
import lzma
import math
import pickle
import pickletools
import posixpath
import struct
import tarfile
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from training_core.config import DataConfig
from training_core.files import UnreadableFile, open_regular
from training_core.messages import clip, invalid, listed, quote
from training_core.redact import redact
from training_core.registry import DATASET_SOURCES, load

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


@dataclass
class RawDataset:
    splits: dict[str, tuple[np.ndarray, np.ndarray]]
    """Split name -> (uint8 images N x C x H x W, int64 labels N)."""

    classes: list[str]
    """Class names, indexed by label."""

    def check(self, source: str, *, one_shape: bool = True) -> None:
        """Raise ``ValueError`` naming ``source`` unless the classes are unique strings and every split holds uint8
        images N x C x H x W (of one shape across splits, unless not ``one_shape``: before a resize), with N int64
        labels in ``[0, len(classes))``.

        Each reader checks its own format; this is the contract data prep relies on, whichever reader ran."""
        if not self.classes or not all(isinstance(c, str) for c in self.classes):
            raise ValueError(f"{source} gave classes {quote(self.classes)}; expected a non-empty list of names")
        if len(set(self.classes)) != len(self.classes):
            raise ValueError(f"{source} gave classes {quote(self.classes)}; class names must be unique")
        shapes = set()
        for name, (images, labels) in self.splits.items():
            where = f"{source} gave split {name!r}"
            if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4:
                raise ValueError(f"{where} images {_describe(images)}; expected uint8 N x C x H x W")
            if not isinstance(labels, np.ndarray) or labels.dtype != np.int64 or labels.shape != images.shape[:1]:
                raise ValueError(
                    f"{where} labels {_describe(labels)} for {len(images)} images; expected one int64 label each"
                )
            if len(labels) and (labels.min() < 0 or labels.max() >= len(self.classes)):
                raise ValueError(
                    f"{where} labels {labels.min()}..{labels.max()}; expected 0..{len(self.classes) - 1}, one per "
                    f"class of {len(self.classes)}"
                )
            shapes.add(images.shape[1:])
        if one_shape and len(shapes) > 1:
            raise ValueError(f"{source} gave splits of different image shapes {sorted(shapes)}; expected one shape")


def load_raw(cfg: DataConfig) -> RawDataset:
    """Read the dataset ``cfg`` names, through its registered reader
    (:data:`training_core.registry.DATASET_SOURCES`). Raises ``ValueError`` naming ``data.path`` when it is missing or
    is not what the dataset expects."""
    source = DATASET_SOURCES.get(cfg.dataset)
    if source is None or source.workload != "image_classification" or not source.read:
        raise ValueError(
            f"data.dataset={cfg.dataset!r} is not read into memory: training_core.data.prepare writes it as Parquet "
            "shards of encoded images (training_core.data.image_shards)"
        )
    raw = load(source.read)(cfg)
    if cfg.image_size:
        raw.splits = {name: (resize_images(x, cfg.image_size), y) for name, (x, y) in raw.splits.items()}
    source = f"data.dataset={cfg.dataset!r}" + (f" at data.path={quote(cfg.path)}" if cfg.path else "")
    raw.check(source)
    return raw


def read_digits(cfg: DataConfig) -> RawDataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # Pixel values are 0..16; scale to the full uint8 range so every source shares one storage format.
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None, :, :]
    return RawDataset(
        splits={"train": (images, bunch.target.astype(np.int64))}, classes=[str(c) for c in bunch.target_names]
    )


def read_synthetic(cfg: DataConfig) -> RawDataset:
    """Class templates plus noise: learnable, so benchmarks train a real signal, and sized at will."""
    rng = np.random.default_rng(cfg.split_seed)
    side, k, n = cfg.synthetic_image_size, cfg.synthetic_num_classes, cfg.synthetic_num_samples
    templates = rng.uniform(0, 255, size=(k, 3, side, side))
    labels = rng.integers(0, k, size=n)
    noise = rng.normal(0, 48, size=(n, 3, side, side))
    images = np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)
    return RawDataset(splits={"train": (images, labels.astype(np.int64))}, classes=[f"class_{i}" for i in range(k)])


def existing_location(path: str) -> tuple[Any, str]:
    """``(filesystem, path)`` of ``path``, which must exist; else a ``ValueError`` naming ``data.path``."""
    import fsspec

    try:
        fs, fs_path = fsspec.core.url_to_fs(path)
        exists = fs.exists(fs_path)
    except Exception as exc:  # noqa: BLE001 - whatever a filesystem raises for a location it cannot use
        # Not chained: a library's own message may quote the URL's credentials without its scheme.
        found = redact(clip(f"{type(exc).__name__}: {exc}"))
        raise ValueError(f"data.path={quote(path)} is invalid: {found}; point it at the dataset's location") from None
    if not exists:
        invalid("data.path", path, "nothing exists there; point it at the dataset's location")
    return fs, fs_path


CIFAR10_BATCHES = (*(f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)), "cifar-10-batches-py/test_batch")
"""The archive members the CIFAR-10 python format reads, by their exact names."""

CIFAR10_MAX_MEMBER_BYTES = 64 * 2**20
"""A batch member larger than this is refused unread: the format's are 31 MB (10,000 rows of 3,072 pixels)."""

_CIFAR10_PIXELS = 3 * 32 * 32
_CIFAR10_KEYS = (b"data", b"labels")
_CIFAR10_OPTIONAL_KEYS = (b"batch_label", b"filenames")
# A batch pickle is some 90,000 opcodes (10,000 labels and file names); this bounds the pure-Python scan below.
_CIFAR10_MAX_PICKLE_OPS = 1_000_000
_REDOWNLOAD = "download cifar-10-python.tar.gz again"
# What a damaged or hostile archive can raise from tarfile and the decompressors under it.
_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError)
# What a damaged or hostile pickle can raise from the scan, the unpickler and the numpy calls it may make.
_PICKLE_ERRORS = (
    pickle.UnpicklingError,
    ValueError,
    TypeError,
    EOFError,
    OverflowError,
    MemoryError,
    KeyError,
    IndexError,
    AttributeError,
    RecursionError,
    struct.error,
)


def read_cifar10(cfg: DataConfig) -> RawDataset:
    batches = dict(cifar10_members(cfg.path))
    train = [batches[name] for name in CIFAR10_BATCHES[:5]]
    splits = {
        "train": (np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train])),
        "test": batches[CIFAR10_BATCHES[5]],
    }
    return RawDataset(splits=splits, classes=list(CIFAR10_CLASSES))


def cifar10_members(path: str, wanted: set[str] | None = None) -> Iterator[tuple[str, tuple[np.ndarray, np.ndarray]]]:
    """``(member name, (uint8 images N x 3 x 32 x 32, int64 labels N))`` of each batch of the CIFAR-10 tarball at
    ``path`` (of ``wanted`` only, when given), streamed one member at a time, once the archive's members are checked
    (each batch exactly once). Raises ``ValueError`` naming ``data.path`` and the fix."""
    with cifar10_archive(path) as archive:
        try:
            members = _cifar10_checked_members(archive, path)
            for name in CIFAR10_BATCHES:
                if wanted is None or name in wanted:
                    yield name, _cifar10_batch(archive, members[name], path)
        except _ARCHIVE_ERRORS as exc:
            raise ValueError(
                f"data.path={quote(path)} is invalid: the tarball is truncated or damaged "
                f"({type(exc).__name__}: {clip(str(exc))}); {_REDOWNLOAD}"
            ) from None


@contextlib.contextmanager
def cifar10_archive(path: str) -> Iterator[tarfile.TarFile]:
    """The tar archive at ``path``, open for streaming (only its first block is read here). Raises ``ValueError``
    naming ``data.path`` when nothing is there, it is a directory or no regular file (a FIFO, which would block the
    read, or a device), or it is not a tar archive."""
    fs, fs_path = existing_location(path)
    if fs.isdir(fs_path):
        invalid("data.path", path, "it is a directory; point it at the cifar-10-python.tar.gz tarball itself")
    try:
        opened = open_regular(fs, fs_path, path)
    except UnreadableFile as exc:
        raise ValueError(
            f"data.path={quote(path)} is invalid: {exc}; point it at the cifar-10-python.tar.gz tarball itself"
        ) from None
    with opened as f:
        try:
            archive = tarfile.open(fileobj=f, mode="r:*")
        except _ARCHIVE_ERRORS:
            raise ValueError(
                f"data.path={quote(path)} is invalid: not a tar archive (neither gzip, bz2, xz nor plain tar); "
                "expected the CIFAR-10 python-version tarball cifar-10-python.tar.gz"
            ) from None
        with archive:
            yield archive


def _cifar10_checked_members(archive: tarfile.TarFile, path: str) -> dict[str, tarfile.TarInfo]:
    """The batch members of an open CIFAR-10 python tarball by name, once each is known to be there exactly once."""
    wanted = {posixpath.basename(name): name for name in CIFAR10_BATCHES}
    found: dict[str, list[tarfile.TarInfo]] = {name: [] for name in CIFAR10_BATCHES}
    for member in archive.getmembers():
        name = wanted.get(posixpath.basename(member.name.rstrip("/")))
        if name is not None:
            found[name].append(member)
    missing = [name for name, members in found.items() if not members]
    if missing:
        raise ValueError(
            f"data.path={quote(path)} is invalid: the tarball lacks {', '.join(missing)}; expected the CIFAR-10 "
            "python-version tarball cifar-10-python.tar.gz"
        )
    for name, members in found.items():
        # Matching by base name alone would let a second data_batch_1 anywhere in the archive replace the real one.
        if (names := [m.name for m in members]) != [name]:
            raise ValueError(
                f"data.path={quote(path)} is invalid: the tarball has {len(members)} member(s) named "
                f"{posixpath.basename(name)}: {listed(names, 5)}; the format has exactly one, {name!r}. Remove the "
                f"others, or {_REDOWNLOAD}"
            )
    return {name: members[0] for name, members in found.items()}


def _cifar10_batch(archive: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch member as (uint8 images N x 3 x 32 x 32, int64 labels N), or a ``ValueError`` naming the member,
    what it holds and the fix."""

    def refuse(found: str) -> ValueError:
        return ValueError(f"data.path={quote(path)} is invalid: member {member.name!r} {found}; {_REDOWNLOAD}")

    if not member.isfile():
        raise refuse("is not a regular file (a link, directory or device)")
    if member.size > CIFAR10_MAX_MEMBER_BYTES:
        raise refuse(f"declares {member.size} bytes, more than a batch's {CIFAR10_MAX_MEMBER_BYTES}")
    extracted = archive.extractfile(member)
    assert extracted is not None, "a regular file member always extracts"
    data = extracted.read()
    try:
        _check_pickle_sizes(data)
        record = _SafeNumpyUnpickler(io.BytesIO(data), max_items=len(data)).load()
    except _PICKLE_ERRORS as exc:
        raise refuse(f"is not a readable batch pickle ({type(exc).__name__}: {clip(str(exc))})") from None

    if not isinstance(record, dict):
        raise refuse(f"holds a {type(record).__name__}; the format's batch is a dict with keys b'data' and b'labels'")
    missing = [key for key in _CIFAR10_KEYS if key not in record]
    unknown = [key for key in record if key not in _CIFAR10_KEYS + _CIFAR10_OPTIONAL_KEYS]
    if missing or unknown:
        keys = ", ".join(quote(k) for k in list(record)[:10])
        raise refuse(
            f"has the keys {clip(keys)}; the format's batch is a dict with b'data' and b'labels' (and optionally "
            "b'batch_label', b'filenames'), nothing else"
        )

    pixels = record[b"data"]
    if not isinstance(pixels, np.ndarray) or pixels.dtype.kind not in "ui" or pixels.shape[1:] != (_CIFAR10_PIXELS,):
        raise refuse(
            f"has b'data' {_describe(pixels)}; the format's is a uint8 array of N rows x {_CIFAR10_PIXELS} pixels "
            "(3 x 32 x 32)"
        )
    if len(pixels) == 0:
        raise refuse("has no rows in b'data'; a batch holds images")
    # A cast to uint8 would wrap 300 to 44 and -1 to 255: integers outside the byte range are refused instead.
    if pixels.dtype != np.uint8 and (pixels.min() < 0 or pixels.max() > 255):
        raise refuse(f"has b'data' pixels {pixels.min()}..{pixels.max()}; the format's pixels are 0..255")

    labels = _cifar10_labels(record[b"labels"], refuse)
    if len(labels) != len(pixels):
        raise refuse(
            f"has {len(pixels)} rows in b'data' but {len(labels)} entries in b'labels'; every image needs its label"
        )
    return pixels.astype(np.uint8).reshape(-1, 3, 32, 32), labels


def _cifar10_labels(value: object, refuse) -> np.ndarray:
    """The labels of a batch as int64, each in 0..9, or ``refuse(found)`` raised."""
    num_classes = len(CIFAR10_CLASSES)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "ui" or value.ndim != 1:
            raise refuse(f"has b'labels' {_describe(value)}; the format's is a list of integers 0..{num_classes - 1}")
        bad = np.flatnonzero((value < 0) | (value >= num_classes))
        if len(bad):
            raise refuse(f"has b'labels'[{bad[0]}]={value[bad[0]]}; labels are 0..{num_classes - 1}")
        return value.astype(np.int64)
    if not isinstance(value, list):
        raise refuse(f"has b'labels' {_describe(value)}; the format's is a list of integers 0..{num_classes - 1}")
    for index, label in enumerate(value):
        # bool is an int subclass, and a float label 2.9 would truncate to 2: only true integers are labels.
        if not isinstance(label, (int, np.integer)) or isinstance(label, bool):
            raise refuse(
                f"has b'labels'[{index}]={quote(label)} ({type(label).__name__}); labels are integers "
                f"0..{num_classes - 1}"
            )
        if not 0 <= label < num_classes:
            raise refuse(f"has b'labels'[{index}]={quote(label)}; labels are 0..{num_classes - 1}")
    return np.asarray(value, dtype=np.int64)


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"of dtype {value.dtype} and shape {value.shape}"
    return f"of type {type(value).__name__}"


_MEMO_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")


def _check_pickle_sizes(data: bytes) -> None:
    """Raise ``ValueError`` when the pickle declares more than it holds.

    The C unpickler allocates a declared length (``BINBYTES8``, ``LONG_BINUNICODE``, a frame) and grows its memo
    table to a declared index before reading, so a 20-byte pickle can ask for a terabyte. ``pickletools.genops``
    refuses lengths beyond the bytes that remain; the memo indices and the opcode count are bounded here."""
    for count, (opcode, arg, position) in enumerate(pickletools.genops(data)):
        if count > _CIFAR10_MAX_PICKLE_OPS:
            raise ValueError(f"more than {_CIFAR10_MAX_PICKLE_OPS} pickle opcodes, far more than a batch has")
        if opcode.name == "FRAME" and arg > len(data) - position:
            raise ValueError(f"a frame of {arg} bytes at offset {position}, beyond the {len(data)} bytes there are")
        # Picklers number memo slots 0, 1, 2, ... as they go: a larger index only inflates the table.
        if opcode.name in _MEMO_PUTS and arg > count:
            raise ValueError(f"memo index {arg} at offset {position}, beyond the {count} objects before it")


class _SafeNumpyUnpickler(pickle.Unpickler):
    """Rebuilds builtins and plain numpy integer arrays only: never arbitrary classes, object arrays, or arrays
    larger than the pickle."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        # Protocol-2 pickles written by Python 3 rebuild bytes through these (b"" as bytes()).
        ("_codecs", "encode"),
        ("__builtin__", "bytes"),
        ("builtins", "bytes"),
    }

    def __init__(self, file, *, max_items: int) -> None:
        super().__init__(file, encoding="bytes")
        self._max_items = max_items

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {clip(module)}.{clip(name)} from a dataset file")
        found = super().find_class(module, name)
        if name == "_reconstruct":
            return functools.partial(self._reconstruct, found)
        return {"dtype": self._dtype, "encode": self._latin1, "bytes": self._empty_bytes}.get(name, found)

    def _reconstruct(self, reconstruct, subtype, shape, dtype):
        if subtype is not np.ndarray:
            raise pickle.UnpicklingError(f"refusing to rebuild {quote(subtype)}: only plain numpy arrays")
        if (
            not isinstance(shape, tuple)
            or not all(isinstance(n, int) and n >= 0 for n in shape)
            or math.prod(shape) > self._max_items
        ):
            raise pickle.UnpicklingError(f"refusing an array of shape {quote(shape)}: larger than the file")
        return reconstruct(subtype, shape, dtype)

    @staticmethod
    def _dtype(*args):
        built = np.dtype(*args)
        if built.hasobject:
            raise pickle.UnpicklingError(f"refusing a numpy object array (dtype {built}): the format holds integers")
        return built

    @staticmethod
    def _empty_bytes(*args):
        # bytes(10**12) would allocate a terabyte of zeros: only the pickler's bytes() of b"" is rebuilt.
        if args:
            raise pickle.UnpicklingError(f"refusing bytes{clip(quote(args), 60)}: only bytes() of b'' is rebuilt")
        return b""

    @staticmethod
    def _latin1(text, encoding="utf-8", errors="strict"):
        if encoding not in ("latin1", "latin-1"):
            raise pickle.UnpicklingError(f"refusing _codecs.encode with encoding {quote(encoding)}")
        return codecs.encode(text, encoding, errors)


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
    import torch
    import torch.nn.functional as F

    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    resized = F.interpolate(torch.from_numpy(images).float(), size=(size, size), mode="bilinear", align_corners=False)
    return resized.round().clamp(0, 255).to(torch.uint8).numpy()
