"""The bounded local cache that shards on object storage go through (``image_shards.shard_bytes``): shared by a
worker's loader processes and the ranks of a node, each of which may evict what another is about to read."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import random
import time
import types

import fsspec
import pytest

from training_core.config import DataConfig
from training_core.data import image_shards


@pytest.fixture
def remote_shards():
    """Three 2 KB shards on fsspec's in-memory object store (inherited by forked processes), and their records."""
    fs = fsspec.filesystem("memory")
    payloads = {f"cache-test-{i}.parquet": os.urandom(2048) for i in range(3)}
    for name, payload in payloads.items():
        fs.pipe(f"/shard-cache-test/{name}", payload)
    manifest = types.SimpleNamespace(directory="memory://shard-cache-test")
    shards = [types.SimpleNamespace(file=n, sha256=hashlib.sha256(p).hexdigest()) for n, p in payloads.items()]
    yield manifest, shards, payloads
    fs.rm("/shard-cache-test", recursive=True)


def _read_at_random(manifest, shards, data, seed: int, results) -> None:
    rng = random.Random(seed)
    try:
        for _ in range(1_500):
            shard = rng.choice(shards)
            payload = image_shards.shard_bytes(manifest, shard, data)
            assert hashlib.sha256(payload).hexdigest() == shard.sha256
        results.put("ok")
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put(f"{type(exc).__name__}: {exc}")


def test_loader_processes_sharing_a_cache_smaller_than_the_data_never_fail_on_each_others_evictions(
    remote_shards, tmp_path
):
    manifest, shards, _ = remote_shards
    data = DataConfig(cache_dir=str(tmp_path / "cache"), cache_max_bytes=4096)  # room for 2 of the 3
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=_read_at_random, args=(manifest, shards, data, s, results)) for s in (1, 2)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join()
    # A file evicted between another process's look and its read was a crash (FileNotFoundError) within ~150 reads.
    assert outcomes == ["ok", "ok"], outcomes
    kept = [n for n in os.listdir(tmp_path / "cache") if n.endswith(image_shards.SHARD_SUFFIX)]
    assert 1 <= len(kept) <= 3


def test_eviction_deletes_the_staging_files_of_dead_writers_only(remote_shards, tmp_path):
    manifest, shards, _ = remote_shards
    cache = tmp_path / "cache"
    cache.mkdir()
    dead, live = cache / "abc.parquet.4242.tmp", cache / "def.parquet.4343.tmp"
    dead.write_bytes(b"x" * 100)
    live.write_bytes(b"x" * 100)
    old = time.time() - image_shards.STALE_STAGING_S - 60
    os.utime(dead, (old, old))
    image_shards.shard_bytes(manifest, shards[0], DataConfig(cache_dir=str(cache), cache_max_bytes=10_000))
    assert not dead.exists() and live.exists()
    assert (cache / f"{shards[0].sha256}{image_shards.SHARD_SUFFIX}").exists()


def test_a_cache_that_cannot_keep_a_shard_costs_a_download_not_the_run(remote_shards, tmp_path, caplog):
    manifest, shards, payloads = remote_shards
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the cache directory should be")
    data = DataConfig(cache_dir=str(blocked), cache_max_bytes=10_000)
    with caplog.at_level(logging.WARNING, logger="training_core"):
        for _ in range(2):
            assert image_shards.shard_bytes(manifest, shards[1], data) == payloads[shards[1].file]
    assert caplog.text.count("the shard cache could not keep") == 2
