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


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    import struct
    import zlib

    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_with_a_flipped_idat_crc(side: int = 16, seed: int = 0) -> bytes:
    """A PNG whose pixels are intact but whose IDAT chunk's CRC has one byte flipped: PIL reads it; libpng (the
    loader's decoder) fails on it, and its failure ends the decoding process (SIGSEGV)."""
    import io

    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(side, side + 4, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    png = bytearray(buffer.getvalue())
    at = png.index(b"IDAT")
    length = int.from_bytes(png[at - 4 : at], "big")
    png[at + 4 + length] ^= 0xFF  # the first byte of its CRC
    return bytes(png)


def png_with_too_little_image_data(side: int = 8) -> bytes:
    """A PNG with every chunk's CRC right whose IDAT stream holds two rows fewer than its IHDR declares: PIL reads it
    (the missing rows black); libpng fails on it ("Not enough image data"), ending the decoding process."""
    import struct
    import zlib

    rows = b"".join(b"\x00" + bytes([40 * (y % 5)] * (3 * side)) for y in range(side - 2))
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
        + _png_chunk(b"IDAT", zlib.compress(rows))
        + _png_chunk(b"IEND", b"")
    )


def animated(image_format: str, frames: int = 2, side: int = 16) -> bytes:
    """An animated GIF or WebP of ``frames`` frames of different colours (PIL reads its first frame)."""
    import io

    from PIL import Image

    colours = [(255, 0, 0), (0, 0, 255), (0, 255, 0), (255, 255, 0)]
    images = [Image.new("RGB", (side + 4, side), colours[i % len(colours)]) for i in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, format=image_format, save_all=True, append_images=images[1:], duration=100, loop=0)
    return buffer.getvalue()


def odd_image_folder(root: Path) -> Path:
    """Two classes of 6 JPEGs, plus among them a PNG with a flipped IDAT CRC byte, an animated WebP and an animated
    GIF: 15 images prep reads with PIL, which the loader's decoder cannot all read as they came."""
    tree = write_jpegs(root, per_class=6, classes=2, side=16)
    (tree / "class_0" / "crc.png").write_bytes(png_with_a_flipped_idat_crc())
    (tree / "class_1" / "moving.webp").write_bytes(animated("WEBP"))
    (tree / "class_1" / "moving.gif").write_bytes(animated("GIF"))
    return tree
