import io
import pickle
import tarfile

import numpy as np
import pytest

from tests.helpers.image_data import write_cifar_tarball
from training_core.config import DataConfig
from training_core.data import Manifest, ShardStream, prepare, read_shard


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    prepare(DataConfig(num_shards=4), str(out))
    return Manifest.load(str(out))


def test_digits_manifest_describes_every_split_and_shard(digits):
    counts = digits.split_counts()
    assert sum(counts.values()) == 1797
    assert counts["test"] == 359 and counts["val"] == 180 and counts["train"] == 1258
    assert digits.classes == [str(i) for i in range(10)]
    assert digits.input_shape == [1, 8, 8]
    assert len(digits.mean) == 1 and 0 < digits.mean[0] < 1 and digits.std[0] > 0
    for split in digits.splits.values():
        assert len(split.shards) == 4
        assert sum(s.num_samples for s in split.shards) == split.num_samples
        assert all(len(s.sha256) == 64 for s in split.shards)
        assert all(0 <= s.bounds["labels"][0] <= s.bounds["labels"][1] <= 9 for s in split.shards)
    assert digits.version == 4 and digits.format == "npz" and digits.workload == "image_classification"
    assert {name: (a.dtype, a.shape, a.max_value) for name, a in digits.arrays.items()} == {
        "images": ("uint8", [1, 8, 8], None),
        "labels": ("int64", [], 9),
    }


def test_each_worker_trains_an_equal_disjoint_share_of_the_epoch(digits):
    world_size = 2
    seen = []
    steps = digits.steps_per_epoch(world_size=world_size, batch_size=32, grad_accum_steps=1)
    assert steps == (digits.splits["train"].num_samples // world_size) // 32
    for rank in range(world_size):
        stream = ShardStream(digits, "train", rank=rank, world_size=world_size)
        batches = list(stream.train_batches(epoch=0, seed=0, batch_size=32, num_batches=steps))
        assert len(batches) == steps and all(len(b["labels"]) == 32 and len(b["images"]) == 32 for b in batches)
        seen.append({x.tobytes() for b in batches for x in b["images"]})
    assert not seen[0] & seen[1]


def test_epochs_reshuffle_deterministically(digits):
    stream = ShardStream(digits, "train", rank=0, world_size=2)
    first = next(stream.train_batches(epoch=0, seed=0, batch_size=16, num_batches=1))["labels"]
    again = next(stream.train_batches(epoch=0, seed=0, batch_size=16, num_batches=1))["labels"]
    other = next(stream.train_batches(epoch=1, seed=0, batch_size=16, num_batches=1))["labels"]
    assert np.array_equal(first, again) and not np.array_equal(first, other)


def test_a_corrupt_shard_is_refused(digits, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(digits.directory, copy)
    manifest = Manifest.load(str(copy))
    shard = manifest.splits["train"].shards[0]
    data = bytearray((copy / shard.file).read_bytes())
    data[100] ^= 0xFF
    (copy / shard.file).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is corrupt: sha256"):
        read_shard(manifest, shard)


def test_a_shard_is_checked_once_per_process_until_its_file_changes(digits, tmp_path, monkeypatch):
    import hashlib
    import shutil
    import time

    from training_core.data import prepared

    copy = tmp_path / "copy"
    shutil.copytree(digits.directory, copy)
    manifest = Manifest.load(str(copy))
    shard = manifest.splits["train"].shards[0]
    hashed, file_digest = [], hashlib.file_digest
    monkeypatch.setattr(prepared.hashlib, "file_digest", lambda f, name: hashed.append(name) or file_digest(f, name))
    first = read_shard(manifest, shard)
    again = read_shard(manifest, shard)  # the next epoch's read: no second hash and scan
    assert len(hashed) == 1 and all(np.array_equal(first[k], again[k]) for k in first)
    # A file rewritten since (another prep, a partial copy) is checked again, and refused when corrupt.
    data = bytearray((copy / shard.file).read_bytes())
    data[100] ^= 0xFF
    time.sleep(0.01)
    (copy / shard.file).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is corrupt: sha256"):
        read_shard(manifest, shard)
    assert len(hashed) == 2


def test_batch_too_large_for_a_worker_names_the_setting(digits):
    with pytest.raises(ValueError, match="loop.batch_size=1000 is too large"):
        digits.steps_per_epoch(world_size=2, batch_size=1000, grad_accum_steps=1)


def test_missing_data_path_fails_naming_the_field(tmp_path):
    cfg = DataConfig(dataset="cifar10", path=str(tmp_path / "nope.tar.gz"))
    with pytest.raises(ValueError, match=r"data.path='.*nope.tar.gz' is invalid: nothing exists there"):
        prepare(cfg, str(tmp_path / "out"))


def test_a_file_that_is_not_a_tarball_is_rejected(tmp_path):
    bogus = tmp_path / "cifar-10-python.tar.gz"
    bogus.write_bytes(b"definitely not a tar archive" * 100)
    with pytest.raises(ValueError, match=r"data.path=.* is invalid: not a tar archive.*cifar-10-python.tar.gz"):
        prepare(DataConfig(dataset="cifar10", path=str(bogus)), str(tmp_path / "out"))


def test_a_tarball_without_cifar_batches_is_rejected(tmp_path):
    path = tmp_path / "other.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        info = tarfile.TarInfo("readme.txt")
        archive.addfile(info, io.BytesIO(b""))
    with pytest.raises(ValueError, match="the tarball lacks cifar-10-batches-py/data_batch_1, "):
        prepare(DataConfig(dataset="cifar10", path=str(path)), str(tmp_path / "out"))


def _cifar_tarball(path, per_batch=20):
    write_cifar_tarball(path, per_batch=per_batch)


def test_cifar10_loader_refuses_pickles_that_build_other_objects(tmp_path):
    path = tmp_path / "evil.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            payload = pickle.dumps({b"data": __import__("collections").OrderedDict()})
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    refused = (
        r"data.path=.* is invalid: member 'cifar-10-batches-py/data_batch_1' is not a readable batch pickle "
        r"\(UnpicklingError: refusing to load collections.OrderedDict"
    )
    with pytest.raises(ValueError, match=refused):
        prepare(DataConfig(dataset="cifar10", path=str(path)), str(tmp_path / "out"))


def test_synthetic_dataset_has_the_requested_shape(tmp_path):
    cfg = DataConfig(
        dataset="synthetic", synthetic_num_samples=200, synthetic_image_size=16, synthetic_num_classes=5, num_shards=2
    )
    manifest = prepare(cfg, str(tmp_path / "out"))
    assert manifest.input_shape == [3, 16, 16] and manifest.num_classes == 5
    assert sum(manifest.split_counts().values()) == 200


def test_a_truncated_cifar_tarball_names_the_field(tmp_path):
    whole = tmp_path / "whole.tar.gz"
    _cifar_tarball(whole)
    truncated = tmp_path / "cifar-10-python.tar.gz"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"data.path='.*cifar-10-python.tar.gz' is invalid: the tarball is truncated"):
        prepare(DataConfig(dataset="cifar10", path=str(truncated)), str(tmp_path / "out"))


def test_a_fraction_that_rounds_to_zero_says_how_large_it_must_be(tmp_path):
    with pytest.raises(
        ValueError, match=r"data.val_fraction=0.0001 is invalid: .* rounds to 0; raise it to at least 0.00056"
    ):
        prepare(DataConfig(val_fraction=0.0001), str(tmp_path / "out"))
