"""Raw dataset sources, each read into uint8 NCHW arrays per split.

A source returns :class:`RawDataset`: ``splits`` maps ``train`` (and ``test`` when the source has its own
test split) to ``(images, labels)``. Splitting off validation/test and sharding happen in
:mod:`training_core.data`.

Remote sources (``s3://...``) are read through fsspec, so s3fs picks up the usual AWS environment
variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile
from dataclasses import dataclass

import numpy as np

from training_core.config import DataConfig

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


@dataclass
class RawDataset:
    splits: dict[str, tuple[np.ndarray, np.ndarray]]
    """Split name -> (uint8 images N x C x H x W, int64 labels N)."""

    classes: list[str]
    """Class names, indexed by label."""


def load_raw(cfg: DataConfig) -> RawDataset:
    """Read the dataset ``cfg`` names. Raises ``ValueError`` naming ``data.path`` when it is missing or
    is not what the dataset expects."""
    loaders = {
        "digits": _digits,
        "synthetic": _synthetic,
        "cifar10": _cifar10,
        "image_folder": _image_folder,
    }
    raw = loaders[cfg.dataset](cfg)
    if cfg.image_size and cfg.dataset != "image_folder":
        raw.splits = {name: (_resize(x, cfg.image_size), y) for name, (x, y) in raw.splits.items()}
    return raw


def _digits(cfg: DataConfig) -> RawDataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # Pixel values are 0..16; scale to the full uint8 range so every source shares one storage format.
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None, :, :]
    return RawDataset(
        splits={"train": (images, bunch.target.astype(np.int64))}, classes=[str(c) for c in bunch.target_names]
    )


def _synthetic(cfg: DataConfig) -> RawDataset:
    """Class templates plus noise: learnable, so benchmarks train a real signal, and sized at will."""
    rng = np.random.default_rng(cfg.split_seed)
    side, k, n = cfg.synthetic_image_size, cfg.synthetic_num_classes, cfg.synthetic_num_samples
    templates = rng.uniform(0, 255, size=(k, 3, side, side))
    labels = rng.integers(0, k, size=n)
    noise = rng.normal(0, 48, size=(n, 3, side, side))
    images = np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)
    return RawDataset(splits={"train": (images, labels.astype(np.int64))}, classes=[f"class_{i}" for i in range(k)])


def _existing(path: str, field: str = "data.path"):
    import fsspec

    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        raise ValueError(f"{field}={path!r} is invalid: nothing exists there; point it at the dataset's location")
    return fs, fs_path


def _cifar10(cfg: DataConfig) -> RawDataset:
    fs, fs_path = _existing(cfg.path)
    if fs.isdir(fs_path):
        raise ValueError(
            f"data.path={cfg.path!r} is invalid: it is a directory; point it at the cifar-10-python.tar.gz tarball "
            "itself"
        )
    with fs.open(fs_path, "rb") as f:
        payload = f.read()
    try:
        archive = tarfile.open(fileobj=io.BytesIO(payload), mode="r:*")
    except tarfile.TarError:
        raise ValueError(
            f"data.path={cfg.path!r} is invalid: not a tar archive (neither gzip, bz2, xz nor plain tar); expected "
            "the CIFAR-10 python-version tarball cifar-10-python.tar.gz"
        ) from None
    try:
        with archive:
            return _cifar10_batches(archive, cfg.path)
    except (tarfile.TarError, EOFError, OSError, pickle.UnpicklingError, KeyError, ValueError) as exc:
        if isinstance(exc, ValueError) and str(exc).startswith("data.path="):
            raise
        raise ValueError(
            f"data.path={cfg.path!r} is invalid: the tarball is truncated or not in the CIFAR-10 python format "
            f"({type(exc).__name__}: {exc}); download cifar-10-python.tar.gz again"
        ) from None


def _cifar10_batches(archive: tarfile.TarFile, path: str) -> RawDataset:
    """The five training batches and the test batch of an open CIFAR-10 python tarball."""
    members = {os.path.basename(m.name): m for m in archive.getmembers() if m.isfile()}
    wanted = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [name for name in wanted if name not in members]
    if missing:
        raise ValueError(
            f"data.path={path!r} is invalid: the tarball lacks {', '.join(missing)}; expected the CIFAR-10 "
            "python-version tarball cifar-10-python.tar.gz"
        )

    def batch(name: str) -> tuple[np.ndarray, np.ndarray]:
        extracted = archive.extractfile(members[name])
        assert extracted is not None
        # The official batches are pickled dicts of arrays and lists: unpickle with a loader that only
        # rebuilds builtins and numpy arrays, never arbitrary classes.
        record = _SafeNumpyUnpickler(extracted).load()
        images = np.asarray(record[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        return images, np.asarray(record[b"labels"], dtype=np.int64)

    train = [batch(f"data_batch_{i}") for i in range(1, 6)]
    test = batch("test_batch")
    splits = {"train": (np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train])), "test": test}
    return RawDataset(splits=splits, classes=list(CIFAR10_CLASSES))


class _SafeNumpyUnpickler(pickle.Unpickler):
    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        # Protocol-2 pickles written by Python 3 rebuild bytes through this.
        ("_codecs", "encode"),
    }

    def __init__(self, file) -> None:
        super().__init__(file, encoding="bytes")

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset file")


def _image_folder(cfg: DataConfig) -> RawDataset:
    fs, root = _existing(cfg.path)
    if not fs.isdir(root):
        raise ValueError(
            f"data.path={cfg.path!r} is invalid: not a directory; point it at the root of <class>/<image> folders"
        )
    top = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if fs.isdir(p))
    split_dirs = [s for s in ("train", "val", "test") if s in top]
    if "train" in split_dirs:
        classes = _class_names(fs, f"{root}/train", cfg.path)
        splits = {}
        for split in split_dirs:
            images, labels = _read_class_tree(fs, f"{root}/{split}", classes, cfg.image_size)
            splits["test" if split == "test" else ("val" if split == "val" else "train")] = (images, labels)
        return RawDataset(splits=splits, classes=classes)
    classes = _class_names(fs, root, cfg.path)
    return RawDataset(splits={"train": _read_class_tree(fs, root, classes, cfg.image_size)}, classes=classes)


def _class_names(fs, root: str, user_path: str) -> list[str]:
    classes = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if fs.isdir(p))
    if len(classes) < 2:
        raise ValueError(
            f"data.path={user_path!r} is invalid: found {len(classes)} class folder(s) under {root!r}; an image folder "
            "needs at least two <class>/ subfolders of images"
        )
    return classes


def _read_class_tree(fs, root: str, classes: list[str], size: int) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image

    images, labels = [], []
    for label, name in enumerate(classes):
        for path in sorted(fs.ls(f"{root}/{name}", detail=False)):
            if not path.lower().endswith(IMAGE_SUFFIXES):
                continue
            with fs.open(path, "rb") as f:
                image = Image.open(f).convert("RGB").resize((size, size), Image.BILINEAR)
            images.append(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))
            labels.append(label)
    if not images:
        raise ValueError(
            f"data.path={root!r} is invalid: no images ({', '.join(IMAGE_SUFFIXES)}) in its class folders; add "
            "images or point data.path elsewhere"
        )
    return np.stack(images), np.asarray(labels, dtype=np.int64)


def _resize(images: np.ndarray, size: int) -> np.ndarray:
    import torch
    import torch.nn.functional as F

    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    resized = F.interpolate(torch.from_numpy(images).float(), size=(size, size), mode="bilinear", align_corners=False)
    return resized.round().clamp(0, 255).to(torch.uint8).numpy()
