"""Checkpoints and pipeline outputs on a real S3 HTTP endpoint (moto server on 127.0.0.1)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import threading
import time

import pytest

from tests.conftest import REPO_ROOT, VENV_BIN
from tests.helpers.checkpoints import checkpoint_meta, checkpoint_state
from tests.helpers.mlflow_db import seed_mlflow_db
from training_core import checkpoint as ckpt


class OutageProxy:
    """A TCP proxy in front of the S3 server that can go down (connections refused) and come back,
    while the server itself keeps its data."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        listener, self._listener = self._listener, None
        listener.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_a_sharded_checkpoint_on_s3_is_verified_downloaded_restored_and_a_corrupt_shard_falls_back(
    s3_server, tmp_path, caplog
):
    """The FSDP path on an object store: each rank uploads its shard, rank 0 waits for them and writes the manifest
    last; a resume downloads and verifies every shard, restores, and removes its download. A shard replaced by a
    larger object is refused from its size on storage, before a byte of it is downloaded."""
    import os

    import s3fs
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from training_core.models import build_model
    from training_core.parallel import sharding

    def sharded_model():
        torch.manual_seed(0)
        model = build_model("small_cnn", num_classes=10, input_shape=(1, 8, 8))
        model = sharding.shard_model(
            model, [model.features], device=torch.device("cpu"), param_dtype=None, cpu_offload=False
        )
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def train_step(model, optimizer) -> None:
        model(torch.randn(4, 1, 8, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def weights(model) -> dict:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model, optimizer = sharded_model()
        storage = ckpt.CheckpointStorage("s3://flyte/sharded-test")
        s3 = s3fs.S3FileSystem(skip_instance_cache=True)
        checkpointer = ckpt.Checkpointer(storage, keep_last=2)
        for step in (1, 2):
            train_step(model, optimizer)
            checkpointer.save_sharded(
                step,
                model=model,
                optimizer=optimizer,
                trainer_state={"rng": {}},
                meta=checkpoint_meta(step),
                metric=None,
            )
            checkpointer.wait()
            if step == 1:
                after_step_1 = {k: v.clone() for k, v in weights(model).items()}
        saved = {k: v.clone() for k, v in weights(model).items()}
        shard_keys = sorted(p.rsplit("/", 1)[1] for p in s3.ls("flyte/sharded-test/step-000000002/shards"))
        assert shard_keys == [".metadata", "__0_0.distcp"]

        fresh, fresh_optimizer = sharded_model()
        loaded = ckpt.load_latest_valid(storage)
        assert loaded.meta.global_step == 2 and loaded.owns_shards_dir and os.path.isdir(loaded.shards_dir)
        ckpt.restore(loaded, model=fresh, optimizer=fresh_optimizer)
        assert not os.path.exists(loaded.shards_dir), "the verified download is removed once loaded"
        for name, tensor in saved.items():
            assert torch.equal(weights(fresh)[name], tensor), name

        shard_key = "flyte/sharded-test/step-000000002/shards/__0_0.distcp"
        shard_bytes = s3.size(shard_key)
        s3.pipe_file(shard_key, b"not the shard")
        fallback = ckpt.load_latest_valid(storage)
        assert fallback.meta.global_step == 1
        ckpt.restore(fallback, model=fresh, optimizer=fresh_optimizer)
        for name, tensor in after_step_1.items():
            assert torch.equal(weights(fresh)[name], tensor), name

        # Only the size check before the download says "holds more than" (after it, a size differs as "truncated").
        s3.pipe_file(shard_key, bytes(shard_bytes + 1024 * 1024))
        with caplog.at_level(logging.WARNING):
            assert ckpt.load_latest_valid(storage).meta.global_step == 1
        assert f"step-000000002/shards/__0_0.distcp holds more than {shard_bytes:,} bytes" in caplog.text
    finally:
        dist.destroy_process_group()


def test_a_save_during_an_s3_outage_retries_and_succeeds_once_it_is_back(s3_server, caplog):
    proxy = OutageProxy(int(s3_server["endpoint"].rsplit(":", 1)[1]))
    options = {
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{proxy.port}"},
        "config_kwargs": {"retries": {"max_attempts": 1}},
        "skip_instance_cache": True,
    }
    storage = ckpt.CheckpointStorage("s3://flyte/outage-test", storage_options=options, retries=6, retry_wait_s=0.5)
    checkpointer = ckpt.Checkpointer(storage, keep_last=2)
    checkpointer.save(1, checkpoint_state(1))
    checkpointer.wait()

    proxy.down()
    checkpointer.save(2, checkpoint_state(2))  # in the background, against a dead endpoint
    time.sleep(3)
    proxy.up()
    checkpointer.wait()
    assert "retrying" in caplog.text
    assert storage.list_steps() == ["step-000000001", "step-000000002"]
    assert ckpt.load_latest_valid(storage).meta.global_step == 2


def test_a_save_during_a_long_outage_fails_clearly_and_keeps_the_last_valid_checkpoint(s3_server):
    proxy = OutageProxy(int(s3_server["endpoint"].rsplit(":", 1)[1]))
    options = {
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{proxy.port}"},
        "config_kwargs": {"retries": {"max_attempts": 1}},
        "skip_instance_cache": True,
    }
    storage = ckpt.CheckpointStorage("s3://flyte/long-outage", storage_options=options, retries=2, retry_wait_s=0.2)
    checkpointer = ckpt.Checkpointer(storage, keep_last=2, async_save=False)
    checkpointer.save(1, checkpoint_state(1))
    proxy.down()
    with pytest.raises(
        ckpt.CheckpointError, match=r"uploading s3://flyte/long-outage/step-000000002/.* failed after 3 attempt"
    ):
        checkpointer.save(2, checkpoint_state(2))
    proxy.up()
    direct = ckpt.CheckpointStorage("s3://flyte/long-outage")
    assert ckpt.load_latest_valid(direct).meta.global_step == 1


@pytest.mark.slow
def test_an_image_folder_on_s3_goes_through_pyflyte_run_with_its_shards_and_checkpoints_on_s3(
    ray_address, s3_server, tmp_path, subprocess_env
):
    """A thousand JPEGs under ``s3://`` are prepared on the session's Ray cluster (Ray shard tasks) into
    Parquet shards written straight to the run's S3 raw-output location, trained on 2 workers reading those shards,
    evaluated on the test split read from S3, and registered; the shards are listed and verified on S3."""
    import hashlib

    import pandas as pd
    import s3fs

    from tests.helpers.image_data import write_jpegs
    from training_core.data import Manifest

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    local = write_jpegs(tmp_path / "images", per_class=250, classes=4, side=16)
    fs.put(str(local), "flyte/datasets/images", recursive=True)
    assert len(fs.find("flyte/datasets/images")) == 1000
    config = {
        "data": {"dataset": "image_folder", "path": "s3://flyte/datasets/images", "image_size": 16, "num_shards": 4},
        "model": {"name": "small_cnn"},
        "loop": {"epochs": 1, "batch_size": 32},
        "checkpoint": {"interval_steps": 7},
        "tracking": {"tracking_uri": seed_mlflow_db(tmp_path / "mlflow.db"), "promotion_threshold": 0.0},
    }
    env = dict(subprocess_env, RAY_ADDRESS=ray_address)
    result = subprocess.run(
        [
            str(VENV_BIN / "pyflyte"),
            "run",
            "--raw-output-data-prefix",
            "s3://flyte/runs",
            str(REPO_ROOT / "workflows" / "training.py"),
            "training_pipeline",
            "--config",
            json.dumps(config),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "registered model : digits-classifier version 1" in output

    # The shards: on S3 beside their manifest, each one's bytes matching its recorded sha256, read by pandas.
    (data_manifest,) = [m for m in fs.glob("flyte/runs/**/manifest.json") if "/step-" not in m]
    manifest = Manifest.load("s3://" + data_manifest.rsplit("/", 1)[0])
    assert manifest.format == "parquet" and sum(manifest.split_counts().values()) == 1000
    shards = [shard for split in manifest.splits.values() for shard in split.shards]
    assert len(shards) == 3 * 4  # data.num_shards per split
    prefix = manifest.directory[len("s3://") :]
    expected = [f"{prefix}/{name}" for shard in shards for name in (shard.file, shard.file + ".done.json")]
    assert sorted(fs.ls(prefix, detail=False)) == sorted([*expected, data_manifest])
    for shard in shards:
        payload = fs.cat(f"{manifest.directory}/{shard.file}")
        assert hashlib.sha256(payload).hexdigest() == shard.sha256, shard.file
    assert len(pd.read_parquet(f"{manifest.directory}/{shards[0].file}")) == shards[0].num_samples

    # The checkpoints: on S3, mid-epoch ones and the final one at the epoch's last step on 2 workers.
    manifests = fs.glob("flyte/runs/**/checkpoints/step-*/manifest.json")
    steps = sorted({int(m.split("/step-")[1].split("/")[0]) for m in manifests})
    per_epoch = manifest.steps_per_epoch(world_size=2, batch_size=32, grad_accum_steps=1)
    assert len(steps) >= 2 and steps[-1] == per_epoch, steps
    final = ckpt.load_latest_valid(ckpt.CheckpointStorage("s3://" + manifests[-1].rsplit("/step-", 1)[0]))
    assert final.meta.global_step == per_epoch and final.meta.model_name == "small_cnn"
    assert "training report  : s3://flyte/runs/" in output
    # Evaluation read the test split from S3; the colours make the classes easy.
    metrics = dict(item.split() for item in output.split("test metrics     : ")[1].splitlines()[0].split(", "))
    assert float(metrics["accuracy"]) > 0.9, metrics


def test_checkpoint_objects_can_be_server_side_encrypted(s3_server):
    import boto3

    from training_core.config import CheckpointConfig

    config = CheckpointConfig(s3_server_side_encryption="AES256")
    storage = ckpt.open_storage("s3://flyte/encrypted", config, storage_options={"skip_instance_cache": True})
    ckpt.Checkpointer(storage, keep_last=1, async_save=False).save(1, checkpoint_state(1))
    client = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="flyte", Prefix="encrypted/")["Contents"]]
    assert {k.rsplit("/", 1)[1] for k in keys} == {
        ckpt.MODEL_FILE,
        ckpt.TRAINER_STATE_FILE,
        ckpt.META_FILE,
        ckpt.MANIFEST_FILE,
    }
    for key in keys:
        assert client.head_object(Bucket="flyte", Key=key)["ServerSideEncryption"] == "AES256", key
