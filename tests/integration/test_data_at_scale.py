"""Image data at scale on real parts: prep on Ray into Parquet shards (bounded memory, idempotent, bad images
counted), loader processes, and a resume on another number of workers that sees each sample once."""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.image_data import write_jpegs
from training_core.config import DataConfig
from training_core.data import Manifest, ShardStream, prepare
from training_core.data.image_shards import prepare_images

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory) -> Path:
    return write_jpegs(tmp_path_factory.mktemp("tree") / "images", per_class=60)


def _train_ids(manifest: Manifest) -> list[int]:
    ids = []
    for batch in ShardStream(manifest, "train", rank=0, world_size=1).eval_batches(batch_size=64):
        ids.extend(batch["sample_ids"].tolist())
    return ids


def test_prep_writes_parquet_shards_other_tools_read_and_a_rerun_writes_only_missing_or_invalid_ones(
    ray_session, image_tree, tmp_path
):
    import pandas as pd

    cfg = DataConfig(dataset="image_folder", path=str(image_tree), image_size=32, num_shards=4)
    out = tmp_path / "prepared"
    manifest = prepare(cfg, str(out))
    assert manifest.format == "parquet" and manifest.version == 4 and manifest.bad_samples["count"] == 0
    assert sum(manifest.split_counts().values()) == 180 and manifest.classes == ["class_0", "class_1", "class_2"]
    shard = manifest.splits["train"].shards[0]
    table = pd.read_parquet(out / shard.file)  # a standard file: pandas reads it with no code of ours
    assert list(table.columns) == ["sample_id", "label", "image", "source"] and len(table) == shard.num_samples
    assert table["image"].iloc[0][:2] == b"\xff\xd8"  # the JPEG's own bytes, as they came
    assert table["source"].iloc[0].startswith("class_")

    files = sorted(p for p in out.iterdir() if p.suffix == ".parquet")
    before = {p.name: p.stat().st_mtime_ns for p in files}
    (out / files[0].name).unlink()
    (out / "manifest.json").unlink()
    (out / files[1].name).write_bytes(files[1].read_bytes()[:-10])  # truncated: its sha256 no longer matches
    time.sleep(0.01)
    again = prepare_images(cfg, str(out))
    assert again.num_written == 2 and len(again.results) == len(files)
    after = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.suffix == ".parquet"}
    assert sorted(n for n in after if after[n] != before[n]) == [files[0].name, files[1].name]
    assert Manifest.load(str(prepare(cfg, str(out)).directory)).splits == manifest.splits
    # Another image size and split seed into the same directory: no shard of the first config is kept.
    other = dataclasses.replace(cfg, image_size=16, split_seed=1)
    changed = prepare_images(other, str(out))
    assert changed.num_written == len(changed.results) and changed.mean != prepare_images(cfg, str(tmp_path / "x")).mean
    assert prepare_images(other, str(out)).num_written == 0


@pytest.mark.parametrize(
    ("columns", "expected"),
    [
        ({"sample_id": [1], "label": [0]}, "lacks column image (binary); it has sample_id, label"),
        ({"sample_id": [1], "label": [0], "image": ["text"]}, "has column image of type string; expected binary"),
    ],
)
def test_a_shard_whose_columns_are_wrong_is_refused_naming_the_shard_and_the_column(
    ray_session, image_tree, tmp_path, columns, expected
):
    import hashlib
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from training_core.data.image_shards import EncodedImages

    out = tmp_path / "prepared"
    prepare(DataConfig(dataset="image_folder", path=str(image_tree), image_size=32, num_shards=4), str(out))
    raw = json.loads((out / "manifest.json").read_text())
    shard = raw["splits"]["train"]["shards"][0]
    pq.write_table(pa.table(columns), out / shard["file"])  # its sha256 recorded: only the columns are wrong
    shard["sha256"] = hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(raw))
    manifest = Manifest.load(str(out))
    with pytest.raises(ValueError, match=f"shard {re.escape(repr(shard['file']))} in .* {re.escape(expected)}; "):
        EncodedImages.read(manifest, manifest.splits["train"].shards[0], DataConfig())


def test_images_the_loaders_decoder_cannot_read_are_stored_as_8_bit_pngs_and_load_as_prep_saw_them(
    ray_session, tmp_path
):
    """torchvision's decoder, which the loader uses, refuses BMP and gives a 16-bit PNG as 16-bit values, where prep
    checks images with PIL: such an image is stored re-encoded as an 8-bit RGB PNG (a JPEG as it came), so every
    sample prep accepted loads, with the values prep counted in the statistics."""
    import io

    import pyarrow.parquet as pq
    from PIL import Image

    from training_core.data.image_shards import EncodedImages

    tree = write_jpegs(tmp_path / "images", per_class=4, classes=2, side=16)  # JPEGs .../class_<c>/<i>.jpg
    grey16 = np.full((16, 24), 51_400, dtype=np.uint16)  # high byte 200
    Image.fromarray(grey16).save(tree / "class_0" / "grey16.png")
    Image.fromarray(np.full((16, 24, 3), (10, 20, 30), dtype=np.uint8)).save(tree / "class_1" / "flat.bmp")
    cfg = DataConfig(dataset="image_folder", path=str(tree), image_size=16, num_shards=1)
    cfg = dataclasses.replace(cfg, val_fraction=0.25, test_fraction=0.25)
    out = tmp_path / "prepared"
    manifest = prepare(cfg, str(out))
    assert manifest.bad_samples["count"] == 0
    stored = {}
    for split in manifest.splits.values():
        for shard in split.shards:
            table = pq.read_table(out / shard.file).to_pydict()
            stored.update(zip(table["source"], table["image"]))
    assert stored["class_0/grey16.png"][:8] == b"\x89PNG\r\n\x1a\n" and stored["class_1/flat.bmp"][:4] == b"\x89PNG"
    assert Image.open(io.BytesIO(stored["class_0/grey16.png"])).mode == "RGB"
    assert stored["class_0/00000.jpg"] == (tree / "class_0" / "00000.jpg").read_bytes()  # as it came
    pixels = {}
    for split in manifest.splits.values():
        for shard in split.shards:
            samples = EncodedImages.read(manifest, shard, cfg)
            for row in range(len(samples)):
                pixels[samples.sample_ids[row]] = samples.sample(row, epoch=0, train=False)["images"]
    assert len(pixels) == 10 and all(p.dtype == np.uint8 and p.shape == (3, 16, 16) for p in pixels.values())
    values = {tuple(np.unique(p)) for p in pixels.values()}
    assert (200,) in values and (10, 20, 30) in values


def test_a_sample_the_loader_cannot_decode_names_its_shard_and_sample():
    from training_core.data.image_shards import EncodedImages
    from training_core.train.failures import UserCodeError

    samples = EncodedImages([7], [0], [b"not an image"], size=16, data=DataConfig(), where="shard 'train-3.parquet'")
    with pytest.raises(UserCodeError, match=r"shard 'train-3.parquet' holds sample 7 .*, which does not decode \("):
        samples.sample(0, epoch=0, train=True)


def test_a_shard_task_whose_worker_process_dies_is_retried_and_the_prep_completes(ray_session, tmp_path):
    """A Ray worker process SIGKILLed while it writes a shard (what a lost node does to its tasks): Ray runs the
    task again and the prep completes with every shard, as a prep that never lost one."""
    import threading

    tree = write_jpegs(tmp_path / "images", per_class=80, side=96)
    cfg = DataConfig(dataset="image_folder", path=str(tree), image_size=64, num_shards=6, prep_num_workers=1)
    outcome: dict[str, object] = {}
    prep = threading.Thread(target=lambda: outcome.update(manifest=prepare(cfg, str(tmp_path / "out"))))
    prep.start()
    killed = 0
    while prep.is_alive() and not killed:
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"ray::write_shard"):
                    os.kill(int(proc.name), signal.SIGKILL)
                    killed += 1
            except (OSError, ProcessLookupError):
                continue
        time.sleep(0.005)
    prep.join(timeout=300)
    assert killed == 1, "no shard task was caught running"
    manifest = outcome["manifest"]
    assert sum(manifest.split_counts().values()) == 240
    assert prepare(cfg, str(tmp_path / "undisturbed")).splits == manifest.splits  # the same shards, byte for byte


def test_bad_images_are_counted_and_skipped_or_fail_the_prep_past_the_threshold(ray_session, tmp_path):
    tree = write_jpegs(tmp_path / "images", per_class=20)
    (tree / "class_0" / "zz-truncated.jpg").write_bytes((tree / "class_0" / "00000.jpg").read_bytes()[:200])
    (tree / "class_1" / "zz-not-an-image.jpg").write_bytes(b"these are not pixels" * 10)
    cfg = DataConfig(dataset="image_folder", path=str(tree), image_size=32, num_shards=2, max_bad_samples=2)
    manifest = prepare(cfg, str(tmp_path / "ok"))
    assert manifest.bad_samples["count"] == 2 and sum(manifest.split_counts().values()) == 60
    named = " ".join(manifest.bad_samples["examples"])
    assert "class_0/zz-truncated.jpg" in named and "class_1/zz-not-an-image.jpg" in named
    strict = DataConfig(dataset="image_folder", path=str(tree), image_size=32, num_shards=2, max_bad_samples=1)
    with pytest.raises(ValueError, match=r"found 2 bad .*more than data.max_bad_samples=1.*zz-"):
        prepare(strict, str(tmp_path / "strict"))


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ({"train/only_class": 3}, "found 1 class folder(s) with images under 'train/'"),
        ({"train/a": 3, "train/b": 3, "val/a": 0}, "val/ has no images"),
        ({"a": 3, "b": 3, "missing": None}, "nothing exists there"),
    ],
    ids=["one-class", "empty-split", "missing-path"],
)
def test_a_bad_tree_fails_before_any_shard_task_naming_the_field_and_the_fix(layout, expected, tmp_path):
    root = tmp_path / "images"
    path = root
    for folder, count in layout.items():
        if count is None:
            path = root / folder
            continue
        (root / folder).mkdir(parents=True)
        for i in range(count):
            write_jpegs(tmp_path / "src", per_class=1, classes=1)
            (root / folder / f"{i}.jpg").write_bytes((tmp_path / "src" / "class_0" / "00000.jpg").read_bytes())
    with pytest.raises(ValueError, match=r"data.path=.* is invalid: ") as error:
        prepare(DataConfig(dataset="image_folder", path=str(path), image_size=16), str(tmp_path / "out"))
    assert expected in str(error.value)


@pytest.mark.parametrize("dataset", ["image_folder", "synthetic"])
def test_split_fractions_that_leave_no_training_sample_fail_naming_them(dataset, tmp_path):
    tree = write_jpegs(tmp_path / "images", per_class=2, classes=2, side=16)
    cfg = DataConfig(dataset=dataset, path=str(tree), image_size=16, val_fraction=0.4, test_fraction=0.5)
    cfg = dataclasses.replace(cfg, synthetic_num_samples=4, synthetic_image_size=4)
    with pytest.raises(ValueError, match=r"data.val_fraction=0.4 and data.test_fraction=0.5 are invalid: rounded, "):
        prepare(cfg, str(tmp_path / "out"))


def test_prep_memory_is_bounded_by_a_shard_not_by_the_dataset(ray_session, tmp_path):
    peaks = []
    for per_class, shards in ((40, 2), (400, 20)):  # ten times the images, the same images per shard
        tree = write_jpegs(tmp_path / f"images-{per_class}", per_class=per_class, side=64)
        cfg = DataConfig(dataset="image_folder", path=str(tree), image_size=64, num_shards=shards)
        prep = prepare_images(cfg, str(tmp_path / f"out-{per_class}"))
        assert sum(r.num_samples for r in prep.results) == 3 * per_class
        peaks.append(max(r.peak_rss_bytes for r in prep.results))
    assert peaks[0] > 0 and peaks[1] / peaks[0] <= 1.2, peaks


_SHARD_TASK_MEMORY = """
import json, os, sys
import fsspec, numpy, PIL.Image, pyarrow.parquet, torchvision.io  # what the task imports, before the baseline
from training_core.config import DataConfig
from training_core.data import image_shards as im

tree, out, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
splits = im.list_image_folder(DataConfig(dataset="image_folder", path=tree, image_size=32)).splits
items = [item for split in splits.values() for item in split][:count]
task = im.ShardTask(split="train", file="all.parquet", kind="image_folder", root=tree, out_dir=out, stats_size=32,
                    items=items)
im._reset_peak_rss()
base = im._peak_rss_bytes()
result = im.write_shard(task)
import pyarrow
print(json.dumps({"grown": result.peak_rss_bytes - base, "bytes": os.path.getsize(os.path.join(out, task.file)),
                  "samples": result.num_samples, "arrow": pyarrow.default_memory_pool().max_memory()}))
"""


def test_a_shard_task_holds_a_row_group_of_images_not_its_whole_shard(tmp_path):
    import json
    import subprocess
    import sys

    tree = write_jpegs(tmp_path / "images", per_class=400, side=256)  # ~50 MB of JPEGs
    grown = {}
    for count in (300, 1200):  # a shard of each: 4x the images
        out = tmp_path / f"out-{count}"
        out.mkdir()
        found = subprocess.run(  # a fresh process: its peak is the task's alone
            [sys.executable, "-c", _SHARD_TASK_MEMORY, str(tree), str(out), str(count)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert found.returncode == 0, found.stderr[-3000:]
        grown[count] = json.loads(found.stdout.strip().splitlines()[-1])
    assert grown[1200]["samples"] == 1200 and grown[1200]["bytes"] > 30e6, grown
    # Built whole in memory, a shard cost ~4.5x its bytes; written a row group at a time, the same whatever its size.
    more_bytes = grown[1200]["bytes"] - grown[300]["bytes"]
    assert grown[1200]["grown"] - grown[300]["grown"] < 0.5 * more_bytes, grown


def test_a_resume_on_another_number_of_workers_trains_each_sample_of_the_epoch_once(ray_session, image_tree, tmp_path):
    from training_core.data.loader import remaining_after, steps_left

    manifest = prepare(
        DataConfig(dataset="image_folder", path=str(image_tree), image_size=16, num_shards=3), str(tmp_path / "p")
    )
    everything = _train_ids(manifest)
    batch_size, seed, epoch = 4, 7, 1
    loading = DataConfig(loader_num_workers=2)

    def ids(rank: int, world_size: int, num_batches: int, remaining=None, data=loading) -> list[int]:
        stream = ShardStream(manifest, "train", rank=rank, world_size=world_size, data=data)
        batches = stream.train_batches(
            epoch=epoch, seed=seed, batch_size=batch_size, num_batches=num_batches, remaining=remaining
        )
        return [i for b in batches for i in b["sample_ids"].tolist()]

    # Two workers train 5 steps each, then the job continues on one worker from the checkpoint's position.
    first = ids(0, 2, 5) + ids(1, 2, 5)
    whole = [(0, len(everything))]
    left = remaining_after(whole, world_size=2, consumed_per_rank=5 * batch_size)
    rest_steps = steps_left(left, world_size=1, samples_per_step=batch_size)
    rest = ids(0, 1, rest_steps, left)
    seen = collections.Counter(first + rest)
    assert max(seen.values()) == 1, "a sample was trained twice in the epoch"
    assert len(seen) >= len(everything) - batch_size + 1 and set(seen) <= set(everything)
    # On the same number of workers the position continues the same chunks: bit-exact.
    assert ids(0, 2, 5 + 3)[5 * batch_size :] == ids(0, 2, 3, left)
    # What a batch holds does not depend on the loader processes, augmentation included.
    in_thread = ShardStream(manifest, "train", rank=0, world_size=2, data=DataConfig(loader_num_workers=0))
    processes = ShardStream(manifest, "train", rank=0, world_size=2, data=loading)
    for a, b in zip(
        in_thread.train_batches(epoch=epoch, seed=seed, batch_size=batch_size, num_batches=3),
        processes.train_batches(epoch=epoch, seed=seed, batch_size=batch_size, num_batches=3),
    ):
        assert np.array_equal(a["images"], b["images"]) and np.array_equal(a["sample_ids"], b["sample_ids"])


def test_a_cifar10_format_tarball_is_prepared_and_a_resnet18_with_augmentation_learns_it(ray_session, tmp_path):
    from tests.helpers.image_data import write_cifar_tarball
    from training_core.config import TrainingConfig
    from training_core.evaluation import evaluate_checkpoint
    from training_core.runners.ray_train import fit

    tarball = write_cifar_tarball(tmp_path / "cifar-10-python.tar.gz", per_batch=60, learnable=True)
    # At 16x16 (prep resizes the statistics' view; the loader decodes and resizes), to keep a CPU run short.
    data = {"dataset": "cifar10", "path": str(tarball), "num_shards": 2, "image_size": 16}
    manifest = prepare(DataConfig(**data), str(tmp_path / "prepared"))
    assert manifest.format == "parquet" and manifest.split_counts()["test"] == 60
    assert manifest.input_shape == [3, 16, 16]
    cfg = TrainingConfig.from_dict(
        {
            "data": data,
            "model": {"name": "resnet18"},
            "optimizer": {"name": "adamw", "lr": 0.001},
            "loop": {"epochs": 2, "batch_size": 16},
            "scaling": {"num_workers": 1},  # ResNet-18's 11 M parameters: the all-reduce would be most of a step
        }
    )
    assert cfg.data.augment and cfg.data.loader_num_workers == 2  # random-resized-crop and flip, in 2 processes
    result = fit(
        cfg,
        data_dir=str(tmp_path / "prepared"),
        checkpoint_dir=str(tmp_path / "final"),
        run_name="cifar-resnet18",
        storage_path=str(tmp_path / "ray"),
    )
    report = evaluate_checkpoint(result.checkpoint_dir, str(tmp_path / "prepared"))
    assert report.num_samples == 60 and report.metrics["accuracy"] > 0.6, report.metrics  # 10 classes: chance 0.1
    assert result.meta.history[-1].train_loss < result.meta.history[0].train_loss


def test_a_run_killed_on_two_workers_resumes_on_one_and_trains_each_sample_of_the_epoch_once(ray_session, tmp_path):
    """Under Ray Train, with 2 loader processes per worker: a 2-worker run loses a worker mid-epoch with no restarts
    left; the same run continues on 1 worker from its latest checkpoint's position. Every sample id of the epoch is
    trained once (at most a batch's worth short), counting the first run's steps up to that checkpoint."""
    import shutil
    import threading

    from tests.conftest import session_train_workers
    from tests.helpers.sample_recorder import recorded, records_dir
    from training_core import checkpoint as ckpt
    from training_core.config import TrainingConfig
    from training_core.runners.ray_train import checkpoint_root, fit

    tree = write_jpegs(tmp_path / "images", per_class=120, side=16)
    data_dir = str(tmp_path / "prepared")
    manifest = prepare(DataConfig(dataset="image_folder", path=str(tree), image_size=16, num_shards=4), data_dir)
    everything = set(_train_ids(manifest))
    shutil.rmtree(records_dir(), ignore_errors=True)

    def config(num_workers: int) -> TrainingConfig:
        return TrainingConfig.from_dict(
            {
                "workload": {"name": "tests.helpers.sample_recorder:SampleRecorder"},
                "data": {"dataset": "image_folder", "path": str(tree), "image_size": 16, "num_shards": 4},
                "model": {"name": "small_cnn"},
                "loop": {"epochs": 1, "batch_size": 8},
                "scaling": {"num_workers": num_workers},
                "checkpoint": {"interval_steps": 4, "max_worker_restarts": 0},
            }
        )

    names = {"run_name": "shrunk", "storage_path": str(tmp_path / "ray"), "data_dir": data_dir}
    storage = ckpt.CheckpointStorage(checkpoint_root(names["storage_path"], "shrunk"))
    outcome: dict[str, object] = {}

    def first_run() -> None:
        try:
            fit(config(2), checkpoint_dir=str(tmp_path / "first"), **names)
        except BaseException as exc:  # the worker's loss ends it: no restarts are left
            outcome["error"] = exc

    thread = threading.Thread(target=first_run)
    thread.start()
    deadline = time.monotonic() + 300
    while not storage.list_steps():
        assert thread.is_alive() and time.monotonic() < deadline, f"ended before a checkpoint: {outcome}"
        time.sleep(0.02)
    os.kill(max(session_train_workers()), signal.SIGKILL)
    thread.join(timeout=300)
    assert "error" in outcome, "the first run should fail once a worker is lost"
    latest = int(storage.list_steps()[-1].split("-")[1])
    per_epoch = manifest.steps_per_epoch(world_size=2, batch_size=8, grad_accum_steps=1)
    assert 0 < latest < per_epoch, "the checkpoint must be mid-epoch"
    first = recorded()
    assert len(first) == 2, "one record per worker of the first run"
    trained_first = [i for batches in first for batch in batches[:latest] for i in batch]

    shutil.rmtree(records_dir())
    result = fit(config(1), checkpoint_dir=str(tmp_path / "second"), **names)
    assert result.meta.resumed_from_steps == [latest]
    (second,) = recorded()
    trained_second = [i for batch in second for i in batch if i in everything]  # not the validation batches
    seen = collections.Counter(trained_first + trained_second)
    assert max(seen.values()) == 1, "a sample was trained twice in the epoch"
    assert set(seen) <= everything and len(seen) >= len(everything) - 2 * 8


def test_text_tokenised_in_ray_tasks_prepares_the_same_shards_as_the_tokenizers_threads(
    ray_session, tmp_path, monkeypatch, caplog
):
    """A text prep connected to Ray tokenises in Ray tasks, ``data.prep_num_workers`` at a time: batches finish out
    of order on the workers and are spilled in order, so the shards are byte for byte those of the in-process prep.
    600 JSON lines of the standard library's text (a BPE tokenizer) in batches of 4,000 characters: ~80 tasks."""
    import json

    from benchmarks.common import train_bpe_tokenizer
    from training_core.data import text
    from training_core.workloads import causal_lm

    stdlib = "".join((Path(text.stdlib_root()) / name).read_text() for name in ("abc.py", "bisect.py", "copy.py"))
    stdlib += "".join((Path(text.stdlib_root()) / name).read_text() for name in ("argparse.py", "ast.py"))
    tokenizer = train_bpe_tokenizer(tmp_path / "tokenizer.json", [stdlib[:20_000]], vocab_size=400)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(stdlib) - 2_000, 600)
    lines = [json.dumps({"text": stdlib[a : a + int(n)]}) for a, n in zip(starts, rng.integers(50, 1_000, 600))]
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines))
    data = DataConfig(
        dataset="text",
        path=str(tmp_path / "corpus.jsonl"),
        seq_len=32,
        num_shards=3,
        tokenizer=str(tokenizer),
        prep_num_workers=2,
    )
    monkeypatch.setattr(text, "_RAY_BATCH_CHARS", 4_000)
    caplog.set_level("INFO", logger="training_core")
    manifests = {}
    for where, connected in (("threads", False), ("ray", True)):
        monkeypatch.setattr(causal_lm, "ray_connected", lambda connected=connected: connected)
        manifests[where] = causal_lm.CausalLM().prepare_data(data, str(tmp_path / where))
    assert "corpus.jsonl' in Ray tasks, 2 at a time" in caplog.text
    assert "corpus.jsonl' in this process's tokenizer threads" in caplog.text
    assert text._task_tokenizer is None, "the driver must not tokenise on the Ray path"
    threads, ray = manifests["threads"], manifests["ray"]
    assert ray.spec == threads.spec and ray.spec["documents"]["train"] > 400
    shards = {
        where: [(s.file, s.sha256) for split in m.splits.values() for s in split.shards]
        for where, m in manifests.items()
    }
    assert shards["ray"] == shards["threads"] and len(shards["ray"]) == 9


def test_tokenising_in_ray_tasks_stops_cleanly_when_the_reader_stops(ray_session):
    from training_core.data import text

    batches = ([f"document {i} " * 50] for i in range(1_000))
    encoded = text.encode_batches(batches, text.byte_tokenizer(), ray_workers=2)
    first = [next(encoded) for _ in range(3)]
    encoded.close()  # cancels the tasks still running
    assert [lengths.tolist() for _, lengths in first] == [[len(f"document {i} " * 50)] for i in range(3)]
    assert bytes(np.concatenate(first[2][0]).astype(np.uint8)) == (b"document 2 " * 50)
    # What the caller keeps of a batch, its lengths, is its own memory: a view would keep the task's whole result
    # (every id of the batch) pinned in the object store until the prep ends.
    assert all(lengths.flags.owndata for _, lengths in first)


def _slow_first(index: int) -> int:
    time.sleep(2.0 if index == 0 else 0.01)
    return index


def test_ordered_tasks_start_no_more_than_num_workers_results_ahead_of_a_slow_one(ray_session):
    from training_core.runners.ray_tasks import map_tasks

    drawn = []

    def arguments():
        for index in range(20):
            drawn.append(index)
            yield (index,)

    results = map_tasks(_slow_first, arguments(), num_workers=2, ordered=True)
    assert next(results) == 0
    # Tasks 0 and 1 start; 1 finishes and 2 starts; 2 finishes: two results wait, so none starts until 0 is done
    # (fewer were drawn if 0 ended sooner).
    assert len(drawn) <= 3, drawn
    assert list(results) == list(range(1, 20))
