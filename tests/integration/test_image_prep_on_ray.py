"""Image prep that runs its shard tasks on the session's Ray cluster: a CIFAR-10 tarball and an image folder tree
(moved out of tests/unit/test_data.py, whose tests run in one process without a cluster)."""

import numpy as np

from tests.helpers.image_data import write_cifar_tarball
from training_core.config import DataConfig
from training_core.data import ShardStream, prepare


def test_cifar10_tarball_is_read_with_its_own_test_split(tmp_path, ray_session):
    path = tmp_path / "cifar-10-python.tar.gz"
    write_cifar_tarball(path, per_batch=20)
    manifest = prepare(DataConfig(dataset="cifar10", path=str(path), num_shards=2), str(tmp_path / "out"))
    assert manifest.input_shape == [3, 32, 32]
    assert manifest.split_counts() == {"test": 20, "val": 10, "train": 90}
    assert manifest.classes[0] == "airplane"


def test_image_folder_tree_is_resized_and_labelled_by_folder(tmp_path, ray_session):
    from PIL import Image

    root = tmp_path / "images"
    for label, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (root / label).mkdir(parents=True)
        for i in range(10):
            Image.new("RGB", (40 + i, 30), color).save(root / label / f"{i}.png")
    manifest = prepare(
        DataConfig(dataset="image_folder", path=str(root), image_size=16, num_shards=2), str(tmp_path / "out")
    )
    assert manifest.classes == ["cat", "dog"]
    assert manifest.input_shape == [3, 16, 16]
    assert sum(manifest.split_counts().values()) == 20
    assert manifest.format == "parquet"
    batches = list(ShardStream(manifest, "train", rank=0, world_size=1).eval_batches(batch_size=64))
    images, labels = np.concatenate([b["images"] for b in batches]), np.concatenate([b["labels"] for b in batches])
    red = images[labels == 0]
    assert red.shape[1:] == (3, 16, 16) and (red[:, 0] == 255).all() and (red[:, 2] == 0).all()
