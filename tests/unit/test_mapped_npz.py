import zipfile

import numpy as np
import pytest

from training_core.data.mapped_npz import map_arrays


def test_a_stored_npz_is_mapped_in_place_with_the_values_numpy_reads(tmp_path):
    path = tmp_path / "shard.npz"
    images = np.arange(4 * 3 * 5 * 5, dtype=np.uint8).reshape(4, 3, 5, 5)
    features = np.asfortranarray(np.random.default_rng(0).standard_normal((6, 7)).astype(np.float32))
    np.savez(path, images=images, labels=np.array([3, 1, 2, 0], dtype=np.int64), features=features)
    before = path.read_bytes()

    mapped = map_arrays(str(path), ["images", "labels", "features"])

    with np.load(path) as stored:
        for name in ("images", "labels", "features"):
            assert isinstance(mapped[name], np.memmap)
            assert mapped[name].dtype == stored[name].dtype and np.array_equal(mapped[name], stored[name])
    # Copy-on-write: a consumer may write into a batch without touching the shard on disk.
    mapped["images"][0, 0, 0, 0] = 200
    assert path.read_bytes() == before


def test_a_compressed_npz_or_a_missing_member_is_left_to_numpy_load(tmp_path):
    compressed = tmp_path / "compressed.npz"
    np.savez_compressed(compressed, images=np.zeros((2, 3), dtype=np.uint8))
    assert map_arrays(str(compressed), ["images"]) is None
    stored = tmp_path / "stored.npz"
    np.savez(stored, images=np.zeros((2, 3), dtype=np.uint8))
    assert map_arrays(str(stored), ["images", "labels"]) is None


def test_an_object_array_is_never_mapped_or_unpickled(tmp_path):
    path = tmp_path / "objects.npz"
    np.savez(path, labels=np.array([{"a": 1}, None], dtype=object))
    assert map_arrays(str(path), ["labels"]) is None


def test_a_truncated_npz_raises_a_read_error(tmp_path):
    path = tmp_path / "shard.npz"
    np.savez(path, images=np.zeros((64, 64), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises((zipfile.BadZipFile, OSError, ValueError)):
        map_arrays(str(path), ["images"])
