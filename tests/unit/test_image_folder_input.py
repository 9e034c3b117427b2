"""An image folder as prep lists and reads it, and as the loader decodes it, on real files: FIFOs, symlinks (to
folders, to ``/dev/zero``, dangling), names that are not UTF-8, a PNG libpng fails on, animated GIFs and WebPs."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.image_data import (
    animated,
    png_with_a_flipped_idat_crc,
    png_with_too_little_image_data,
    write_jpegs,
)
from training_core.config import DataConfig
from training_core.data.image_shards import EncodedImages, ShardTask, list_image_folder, write_shard

ROOT = Path(__file__).resolve().parents[2]


def _config(tree: Path) -> DataConfig:
    return DataConfig(dataset="image_folder", path=str(tree), image_size=16)


def _tree(tmp_path: Path, classes: int = 2) -> Path:
    return write_jpegs(tmp_path / "images", per_class=2, classes=classes, side=16)


def _sources(listing) -> list[str]:
    return sorted(item.source for items in listing.splits.values() for item in items)


def test_a_symlinked_class_folder_is_read_as_a_class(tmp_path):
    tree = _tree(tmp_path)
    elsewhere = write_jpegs(tmp_path / "elsewhere", per_class=3, classes=1, side=16)
    (tree / "linked").symlink_to(elsewhere / "class_0", target_is_directory=True)
    listing = list_image_folder(_config(tree))
    assert listing.classes == ["class_0", "class_1", "linked"]
    assert [s for s in _sources(listing) if s.startswith("linked/")] == [f"linked/0000{i}.jpg" for i in range(3)]


def test_gif_and_tiff_images_make_classes_of_their_own(tmp_path):
    from PIL import Image

    tree = _tree(tmp_path)
    for name, suffix in (("gifs", "gif"), ("tiffs", "tif"), ("more_tiffs", "TIFF")):
        (tree / name).mkdir()
        Image.new("RGB", (20, 16), (200, 10, 10)).save(tree / name / f"a.{suffix}")
    listing = list_image_folder(_config(tree))
    assert listing.classes == ["class_0", "class_1", "gifs", "more_tiffs", "tiffs"]
    assert listing.left_out.count == 0


def test_what_an_image_folder_holds_besides_its_images_is_counted_named_and_logged(tmp_path, caplog):
    tree = _tree(tmp_path)
    (tree / "class_0" / "nested").mkdir()
    (tree / "class_0" / "nested" / "deep.jpg").write_bytes((tree / "class_0" / "00000.jpg").read_bytes())
    (tree / "class_1" / "notes.txt").write_text("not an image")
    (tree / "class_1" / ".DS_Store").write_bytes(b"\0")
    (tree / "README.md").write_text("a file beside the class folders")
    with caplog.at_level(logging.WARNING, logger="training_core.data.image_shards"):
        listing = list_image_folder(_config(tree))
    assert listing.classes == ["class_0", "class_1"] and len(_sources(listing)) == 4
    left_out = listing.left_out
    assert left_out.count == 4 and sum(left_out.reasons.values()) == 4
    named = " | ".join(left_out.examples)
    for path in ("class_0/nested/", "class_1/notes.txt", "class_1/.DS_Store", "README.md"):
        assert path in named, named
    assert "nested images are not read" in named and "not an image suffix" in named
    (record,) = [r for r in caplog.records if "left out" in r.getMessage()]
    assert "left out 4 entries" in record.getMessage() and "class_0/nested/" in record.getMessage()


def test_a_tree_with_nothing_left_out_logs_no_left_out_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="training_core.data.image_shards"):
        listing = list_image_folder(_config(_tree(tmp_path)))
    assert listing.left_out.count == 0 and not [r for r in caplog.records if "left out" in r.getMessage()]


@pytest.mark.parametrize("split", ["", "train/"])
def test_an_empty_class_folder_is_refused_naming_it_and_the_fix(tmp_path, split):
    tree = tmp_path / "images"
    write_jpegs(tree / split if split else tree, per_class=2, classes=2, side=16)
    (tree / split / "empty_class").mkdir()
    (tree / split / "empty_class" / "labels.csv").write_text("no images here")
    with pytest.raises(ValueError, match=r"data.path=.* is invalid: class folder\(s\) (train/)?empty_class/ hold no "):
        list_image_folder(_config(tree))


def test_an_image_name_that_is_not_utf8_is_a_value_error_naming_data_path_and_the_file(tmp_path):
    tree = _tree(tmp_path)
    name = os.fsdecode(b"caf\xe9.jpg")  # Latin-1 bytes: no UTF-8 name
    (tree / "class_0" / name).write_bytes((tree / "class_0" / "00000.jpg").read_bytes())
    with pytest.raises(ValueError) as error:
        list_image_folder(_config(tree))
    message = str(error.value)
    assert message.startswith(f"data.path={str(tree)!r} is invalid: the name ") and "is not UTF-8" in message
    assert r"caf\xe9.jpg" in message and "rename it" in message
    message.encode("utf-8")  # the message itself is printable


def test_a_class_folder_name_that_is_not_utf8_is_a_value_error_naming_it(tmp_path):
    tree = _tree(tmp_path)
    os.rename(tree / "class_1", tree / os.fsdecode(b"cl\xe4ss"))
    with pytest.raises(
        ValueError, match=r"is invalid: the name 'cl\\udce4ss' is not UTF-8 \(its bytes: b'cl\\xe4ss'\)"
    ):
        list_image_folder(_config(tree))


def _special(tree: Path, kind: str) -> Path:
    path = tree / "class_0" / "x.png"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.symlink_to(tree / "removed.png")
    return path


@pytest.mark.parametrize(
    ("kind", "found"),
    [("fifo", "a FIFO"), ("dev-zero", "a character device"), ("dangling", "a dangling symlink")],
)
def test_an_image_name_that_is_no_regular_file_is_refused_at_the_listing_naming_it(tmp_path, kind, found):
    tree = _tree(tmp_path)
    _special(tree, kind)
    with pytest.raises(ValueError) as error:
        list_image_folder(_config(tree))
    assert str(error.value) == (
        f"data.path={str(tree)!r} is invalid: 'class_0/x.png' is {found}, not a regular file; only regular files are "
        "read as images: replace it with the image file or remove it"
    )


def _task(tree: Path, out: Path, sources: list[str]) -> ShardTask:
    from training_core.data.image_shards import ImageItem

    out.mkdir(exist_ok=True)
    items = [ImageItem(source=s, label=i % 2, sample_id=i) for i, s in enumerate(sources)]
    return ShardTask("train", "train-00000-of-00001.parquet", "image_folder", str(tree), str(out), 16, items)


def _in_thread(function, timeout_s: float):
    """``function()``'s result, or a failure when it has not returned within ``timeout_s`` (it hangs)."""
    outcome: dict[str, object] = {}
    thread = threading.Thread(target=lambda: outcome.update(result=function()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"still running after {timeout_s} s"
    return outcome["result"]


@pytest.mark.parametrize(
    ("kind", "found"),
    [
        ("fifo", "is a FIFO, not a regular file"),
        ("dev-zero", "is a character device, not a regular file"),
        ("dangling", "does not exist"),
    ],
)
def test_a_file_that_became_no_regular_file_after_the_listing_is_a_bad_sample_not_a_hang(tmp_path, kind, found):
    tree = _tree(tmp_path)
    path = _special(tree, kind)
    task = _task(tree, tmp_path / "out", ["class_0/00000.jpg", "class_0/x.png", "class_1/00000.jpg"])
    try:
        result = _in_thread(lambda: write_shard(task), timeout_s=60)
    finally:
        if kind == "fifo":  # a reader blocked in open() (the code before this check) is let go
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK) if _has_reader(path) else None
            if fd is not None:
                os.close(fd)
    assert result.num_samples == 2 and result.num_bad == 1
    (bad,) = result.bad_examples
    kind_of_error = "MissingFile" if kind == "dangling" else "UnreadableFile"  # files.MissingFile: an UnreadableFile
    assert bad.startswith(f"class_0/x.png: {kind_of_error}: 'class_0/x.png' ") and found in bad


def _has_reader(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: no process has it open for reading
        return False
    return True


def test_an_image_file_larger_than_the_cap_is_a_bad_sample_read_no_further(tmp_path, monkeypatch):
    from training_core.data import image_shards

    tree = _tree(tmp_path)
    monkeypatch.setattr(image_shards, "MAX_IMAGE_BYTES", 300)  # the JPEGs are ~700 bytes
    result = write_shard(_task(tree, tmp_path / "out", ["class_0/00000.jpg"]))
    assert result.num_bad == 1 and "holds more than 300 bytes, the most read" in result.bad_examples[0]


_DECODE_IN_THE_LOADERS_WAY = """
import json, sys
import pyarrow.parquet as pq
import torch
from torchvision.io import ImageReadMode, decode_image

table = pq.read_table(sys.argv[1]).to_pydict()
for source, image in zip(table["source"], table["image"]):
    print(source, flush=True)  # the last line names the image whose decoding ended the process
    decoded = decode_image(torch.frombuffer(bytearray(image), dtype=torch.uint8), mode=ImageReadMode.RGB)
    print(json.dumps([source, list(decoded.shape), str(decoded.dtype)]), flush=True)
"""


def test_every_image_prep_stores_decodes_with_the_loaders_decoder_in_a_process_of_its_own(tmp_path):
    """A PNG with a flipped IDAT CRC byte, one with too little image data (both read by PIL; libpng's failure on
    them ends the decoding process), an animated WebP (refused by the loader's decoder) and an animated GIF (decoded
    to 2 frames, which breaks a batch) are stored re-encoded from PIL's first frame; a JPEG as it came."""
    tree = _tree(tmp_path)
    odd = {
        "class_0/crc.png": png_with_a_flipped_idat_crc(),
        "class_0/short.png": png_with_too_little_image_data(),
        "class_1/moving.webp": animated("WEBP"),
        "class_1/moving.gif": animated("GIF"),
    }
    for source, payload in odd.items():
        (tree / source).write_bytes(payload)
    task = _task(tree, tmp_path / "out", ["class_0/00000.jpg", *odd])
    result = write_shard(task)
    assert result.num_bad == 0 and result.num_samples == 5
    shard = tmp_path / "out" / task.file
    decoded = subprocess.run(
        [sys.executable, "-c", _DECODE_IN_THE_LOADERS_WAY, str(shard)], capture_output=True, text=True, cwd=ROOT
    )
    assert decoded.returncode == 0, (decoded.returncode, decoded.stdout.splitlines()[-1:], decoded.stderr[-2000:])
    shapes = {source: (shape, dtype) for source, shape, dtype in map(json.loads, decoded.stdout.splitlines()[1::2])}
    assert shapes == {
        "class_0/00000.jpg": ([3, 16, 24], "torch.uint8"),
        "class_0/crc.png": ([3, 16, 20], "torch.uint8"),
        "class_0/short.png": ([3, 8, 8], "torch.uint8"),
        "class_1/moving.webp": ([3, 16, 20], "torch.uint8"),
        "class_1/moving.gif": ([3, 16, 20], "torch.uint8"),
    }
    import pyarrow.parquet as pq

    stored = dict(zip(*pq.read_table(shard, columns=["source", "image"]).to_pydict().values()))
    assert stored["class_0/00000.jpg"] == (tree / "class_0" / "00000.jpg").read_bytes()  # as it came
    assert result.num_reencoded == 4
    why = dict(example.split(": ", 1) for example in result.reencoded_examples)
    assert "CRC mismatch in chunk 'IDAT'" in why["class_0/crc.png"]
    assert "IDAT data of" in why["class_0/short.png"]
    assert "Animated webp files are not supported" in why["class_1/moving.webp"]
    assert why["class_1/moving.gif"] == "an animation of 2 frames (the first is kept)"


def test_a_plain_png_is_stored_as_it_came():
    import io

    from PIL import Image

    from training_core.data.image_shards import _stored

    for mode in ("RGB", "RGBA", "L", "P"):
        buffer = io.BytesIO()
        Image.fromarray(np.arange(16 * 20 * 3, dtype=np.uint8).reshape(16, 20, 3)).convert(mode).save(buffer, "PNG")
        assert _stored(buffer.getvalue()) == (buffer.getvalue(), ""), mode


def _samples(images: list[bytes]) -> EncodedImages:
    return EncodedImages(
        list(range(40, 40 + len(images))),
        [0] * len(images),
        images,
        size=16,
        data=DataConfig(),
        where="shard 'train-00003-of-00004.parquet' in '/data/prepared'",
        sources=[f"class_0/{i}.img" for i in range(len(images))],
    )


def _jpeg() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (20, 16), (10, 200, 30)).save(buffer, format="JPEG")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (animated("WEBP"), r"does not decode \(Animated webp files are not supported.\)"),
        (animated("GIF"), "decodes to 2 frames, not one image"),
        (b"not an image at all", r"does not decode \("),
    ],
    ids=["animated-webp", "animated-gif", "not-an-image"],
)
def test_a_sample_that_fails_in_a_loader_process_is_a_user_code_error_naming_shard_sample_and_file(payload, why):
    """From a shard an older prep wrote: in a real ``DataLoader`` process, the sample's failure reaches the training
    worker as a ``UserCodeError`` (never retried) naming the shard, the sample id, the source file and the fix, not
    a ``collate`` error or a "re-run data prep" that would not help."""
    from training_core.data.loader import loader_iter
    from training_core.train.failures import UserCodeError

    samples = _samples([_jpeg(), _jpeg(), payload])

    def batches(worker: int, num_workers: int):
        yield [samples.sample(row, epoch=0, train=True) for row in range(3)]

    with pytest.raises(UserCodeError) as error:
        next(loader_iter(batches, num_processes=1, prefetch_batches=1))
    message = str(error.value)
    expected = (
        r"shard 'train-00003-of-00004.parquet' in '/data/prepared' holds sample 42 from 'class_0/2.img' under "
        rf"data.path, which {why}.*; remove or replace that file and prepare the data again"
    )
    assert re.search(expected, message), message
