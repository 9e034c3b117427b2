"""Prep of an image folder holding what users' folders hold (a PNG libpng fails on, animations, a symlinked class
folder, nested images, notes) in Ray shard tasks, and every sample it stores decoded by real loader processes."""

from __future__ import annotations

import json

from tests.helpers.image_data import odd_image_folder, write_jpegs
from training_core.config import DataConfig
from training_core.data import Manifest, ShardStream, prepare


def test_prep_records_what_it_left_out_and_re_encoded_and_every_stored_sample_decodes_in_loader_processes(
    ray_session, tmp_path
):
    tree = odd_image_folder(tmp_path / "images")
    linked = write_jpegs(tmp_path / "elsewhere", per_class=4, classes=1, side=16)
    (tree / "linked_class").symlink_to(linked / "class_0", target_is_directory=True)
    (tree / "class_0" / "nested").mkdir()
    (tree / "class_0" / "nested" / "deep.jpg").write_bytes((tree / "class_0" / "00000.jpg").read_bytes())
    (tree / "notes.txt").write_text("about the images")
    cfg = DataConfig(dataset="image_folder", path=str(tree), image_size=16, num_shards=2, loader_num_workers=2)
    out = tmp_path / "prepared"
    manifest = prepare(cfg, str(out))

    assert manifest.classes == ["class_0", "class_1", "linked_class"]
    assert sum(manifest.split_counts().values()) == 6 + 1 + 6 + 2 + 4
    recorded = json.loads((out / "manifest.json").read_text())["spec"]
    assert Manifest.load(str(out)).spec == recorded
    assert recorded["left_out"]["count"] == 2 and sum(recorded["left_out"]["reasons"].values()) == 2
    left_out = " | ".join(recorded["left_out"]["examples"])
    assert "class_0/nested/: a folder inside a class folder" in left_out and "notes.txt: not a folder" in left_out
    assert manifest.bad_samples["count"] == 0 and recorded["reencoded"]["count"] == 3
    reencoded = " | ".join(recorded["reencoded"]["examples"])
    for source in ("class_0/crc.png", "class_1/moving.webp", "class_1/moving.gif"):
        assert source in reencoded, reencoded

    seen = []
    for split in manifest.splits:
        stream = ShardStream(manifest, split, rank=0, world_size=1, data=cfg)  # 2 forked loader processes
        for batch in stream.eval_batches(batch_size=4):
            assert batch["images"].shape[1:] == (3, 16, 16)
            seen.extend(batch["sample_ids"].tolist())
    assert sorted(seen) == list(range(19))


def test_an_image_folder_on_s3_is_listed_as_the_same_folder_on_disk_with_what_it_leaves_out(s3_server, tmp_path):
    import s3fs

    from training_core.data.image_shards import list_image_folder

    local = write_jpegs(tmp_path / "images", per_class=2, classes=2, side=16)
    (local / "class_0" / "nested").mkdir()
    (local / "class_0" / "nested" / "deep.jpg").write_bytes((local / "class_0" / "00000.jpg").read_bytes())
    (local / "class_1" / "notes.txt").write_text("not an image")
    (local / "README.md").write_text("about the images")
    s3fs.S3FileSystem(skip_instance_cache=True).put(str(local), "flyte/datasets/listed", recursive=True)
    remote = list_image_folder(DataConfig(dataset="image_folder", path="s3://flyte/datasets/listed", image_size=16))
    here = list_image_folder(DataConfig(dataset="image_folder", path=str(local), image_size=16))
    assert remote.splits == here.splits and remote.classes == here.classes == ["class_0", "class_1"]
    assert remote.left_out == here.left_out and remote.left_out.count == 3, remote.left_out
