"""Generated image datasets for the tests: real JPEG files in an ``image_folder`` tree, learnable by colour."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_jpegs(root: Path, *, per_class: int, classes: int = 3, side: int = 40, seed: int = 0) -> Path:
    """``classes`` folders of ``per_class`` generated JPEGs (``side`` x ``side + 8``) whose colour depends on the
    class, so a small model learns them in an epoch."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"class_{c}").mkdir(parents=True, exist_ok=True)
        base = rng.uniform(0, 255, size=3)
        for i in range(per_class):
            pixels = np.clip(base + rng.normal(0, 40, size=(side, side + 8, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / f"class_{c}" / f"{i:05d}.jpg", quality=90)
    return root


def write_cifar_tarball(path: Path, *, per_batch: int = 20, learnable: bool = False, seed: int = 0) -> Path:
    """A tarball in the official CIFAR-10 python layout (``cifar-10-batches-py/data_batch_1..5`` and ``test_batch``,
    pickled dicts of 3072-byte rows and labels). ``learnable``: each class has its own colour under noise, so a
    model learns it in a few epochs; otherwise pixels and labels are random."""
    import io
    import pickle
    import tarfile

    rng = np.random.default_rng(seed)
    colours = rng.uniform(30, 225, size=(10, 3))
    with tarfile.open(path, "w:gz") as archive:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            labels = rng.integers(0, 10, per_batch)
            if learnable:
                noise = rng.normal(0, 25, size=(per_batch, 3, 32 * 32))
                pixels = np.clip(colours[labels][:, :, None] + noise, 0, 255).astype(np.uint8).reshape(per_batch, -1)
            else:
                pixels = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
            payload = pickle.dumps({b"data": pixels, b"labels": labels.tolist()}, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    return path
