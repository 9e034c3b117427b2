import dataclasses
import json
import logging
import math
import threading
import time

import pytest
import torch

from tests.helpers.checkpoints import checkpoint_meta, checkpoint_state, trained_objects
from training_core import checkpoint as ckpt
from training_core.config import CheckpointConfig, TrainingConfig


def _fields(meta: ckpt.CheckpointMeta) -> str:
    return json.dumps(dataclasses.asdict(meta), sort_keys=True)


def test_save_then_load_restores_every_stateful_object_exactly(tmp_path):
    model, optimizer, scheduler, scaler = trained_objects(seed=0)
    meta = checkpoint_meta(3)
    checkpointer = ckpt.Checkpointer(ckpt.CheckpointStorage(str(tmp_path)), keep_last=2)
    checkpointer.save(3, ckpt.snapshot(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, meta=meta))
    checkpointer.wait()

    other_model, other_optimizer, other_scheduler, other_scaler = trained_objects(seed=1)
    loaded = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(tmp_path)))
    # JSON of the fields, so that NaN (an image model's val_perplexity) compares equal to itself.
    assert loaded.name == "step-000000003" and _fields(loaded.meta) == _fields(meta)
    ckpt.restore(loaded, model=other_model, optimizer=other_optimizer, scheduler=other_scheduler, scaler=other_scaler)
    for a, b in zip(model.state_dict().values(), other_model.state_dict().values()):
        assert torch.equal(a, b)
    for state_a, state_b in zip(
        optimizer.state_dict()["state"].values(), other_optimizer.state_dict()["state"].values()
    ):
        for key in state_a:
            assert torch.equal(torch.as_tensor(state_a[key]), torch.as_tensor(state_b[key]))
    assert other_scheduler.state_dict() == scheduler.state_dict()

    rebuilt, loaded_meta, workload = ckpt.load_model(str(tmp_path / "step-000000003"))
    assert workload.name == "image_classification" and _fields(loaded_meta) == _fields(meta)
    x = torch.randn(4, 1, 8, 8)
    assert torch.equal(rebuilt.eval()(x), model.eval()(x))


def test_a_model_trained_by_one_worker_on_one_shard_loads(tmp_path):
    """The saved config's data section is read back (a workload's checks read it) without the run's layout: one
    shard is fine for the one worker that trained it."""
    model, optimizer, scheduler, scaler = trained_objects(seed=0)
    meta = checkpoint_meta(3)
    meta.config = TrainingConfig.from_dict(
        {"model": {"name": "small_cnn"}, "data": {"num_shards": 1}, "scaling": {"num_workers": 1}}
    ).to_dict()
    checkpointer = ckpt.Checkpointer(ckpt.CheckpointStorage(str(tmp_path)), keep_last=1, async_save=False)
    checkpointer.save(3, ckpt.snapshot(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, meta=meta))
    rebuilt, _, workload = ckpt.load_model(str(tmp_path / "step-000000003"))
    x = torch.randn(4, 1, 8, 8)
    assert workload.name == "image_classification" and torch.equal(rebuilt.eval()(x), model.eval()(x))


def test_the_snapshot_is_immune_to_training_after_save(tmp_path):
    model, optimizer, scheduler, scaler = trained_objects(seed=0)
    state = ckpt.snapshot(model=model, optimizer=optimizer, meta=checkpoint_meta(1))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(torch.equal(state["model"][k], v) for k, v in expected.items())


def test_an_async_save_returns_before_the_write_finishes_and_one_waits_for_the_other(tmp_path):
    storage = ckpt.CheckpointStorage(str(tmp_path))
    started, release = threading.Event(), threading.Event()
    original_write = storage.write
    in_flight, overlaps, written = [], [], []

    def gated_write(name, files, manifest):
        in_flight.append(name)
        if len(in_flight) > 1:
            overlaps.append(list(in_flight))
        started.set()
        release.wait(timeout=60)  # only this test sets it; the timeout keeps a broken save from hanging the run
        original_write(name, files, manifest)
        in_flight.remove(name)
        written.append(name)

    storage.write = gated_write
    checkpointer = ckpt.Checkpointer(storage, keep_last=5)
    checkpointer.save(1, checkpoint_state(1))
    # save() came back while the write it queued is held at the gate: the step goes on during the write.
    assert started.wait(timeout=60), "the queued write never started"
    assert in_flight == ["step-000000001"] and written == [] and storage.list_steps() == []

    state_2, seen_by_second = checkpoint_state(2), []

    def second_save():
        checkpointer.save(2, state_2)
        seen_by_second.append(list(written))

    second = threading.Thread(target=second_save)
    second.start()
    release.set()
    second.join(timeout=60)
    checkpointer.wait()
    # A second save waits for the one in flight instead of piling up: when it returned, the first write had
    # landed, and the two writes never ran at the same time.
    assert seen_by_second == [["step-000000001"]]
    assert overlaps == []
    assert written == ["step-000000001", "step-000000002"]
    assert storage.list_steps() == ["step-000000001", "step-000000002"]
    assert ckpt.load_latest_valid(storage).meta.global_step == 2


@pytest.mark.parametrize("damage", ["truncate", "flip-byte", "no-manifest"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one_with_a_warning(tmp_path, caplog, damage):
    checkpointer = ckpt.Checkpointer(ckpt.CheckpointStorage(str(tmp_path)), keep_last=5, async_save=False)
    for step in (10, 20):
        checkpointer.save(step, checkpoint_state(step, seed=step))
    latest = tmp_path / "step-000000020"
    if damage == "truncate":
        data = (latest / ckpt.MODEL_FILE).read_bytes()
        (latest / ckpt.MODEL_FILE).write_bytes(data[: len(data) // 2])
    elif damage == "flip-byte":
        data = bytearray((latest / ckpt.TRAINER_STATE_FILE).read_bytes())
        data[len(data) // 2] ^= 0x01
        (latest / ckpt.TRAINER_STATE_FILE).write_bytes(bytes(data))
    else:
        (latest / ckpt.MANIFEST_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="training_core"):
        loaded = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(tmp_path)))
    assert loaded.name == "step-000000010"
    reason = {
        "truncate": "is truncated",
        "flip-byte": "is corrupt: sha256",
        "no-manifest": "no readable manifest.json",
    }[damage]
    assert f"skipping checkpoint {latest}" in caplog.text and reason in caplog.text
    assert "instead of the newer step-000000020" in caplog.text


def test_retention_keeps_the_last_k_and_the_best_and_never_a_half_written_one(tmp_path):
    storage = ckpt.CheckpointStorage(str(tmp_path))
    checkpointer = ckpt.Checkpointer(storage, keep_last=2, keep_best=True, best_mode="max", async_save=False)
    for step, metric in ((1, 0.5), (2, 0.9), (3, 0.6), (4, 0.7), (5, 0.4)):
        checkpointer.save(step, checkpoint_state(step, metric=metric), metric=metric)
    assert storage.list_steps() == ["step-000000002", "step-000000004", "step-000000005"]
    (tmp_path / ".tmp-step-000000006-abcd").mkdir()  # what a crash mid-write leaves behind
    assert storage.list_steps()[-1] == "step-000000005"
    assert ckpt.load_latest_valid(storage).name == "step-000000005"


def test_a_nan_metric_is_never_kept_as_the_best_checkpoint(tmp_path):
    storage = ckpt.CheckpointStorage(str(tmp_path))
    checkpointer = ckpt.Checkpointer(storage, keep_last=1, keep_best=True, best_mode="max", async_save=False)
    for step, metric in ((1, math.nan), (2, 0.9), (3, 0.5)):
        checkpointer.save(step, checkpoint_state(step, metric=metric), metric=metric)
    assert storage.list_steps() == ["step-000000002", "step-000000003"]


def test_a_synchronous_save_tolerates_failures_up_to_the_limit_like_an_asynchronous_one(tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    storage = ckpt.CheckpointStorage(str(tmp_path / "file" / "root"))
    checkpointer = ckpt.Checkpointer(storage, keep_last=1, async_save=False, max_consecutive_failures=2)
    with caplog.at_level(logging.ERROR, logger="training_core"):
        checkpointer.save(1, checkpoint_state(1))
    assert checkpointer.num_failed == 1 and "checkpoint save of step 1 failed" in caplog.text
    with pytest.raises(ckpt.CheckpointError, match="writing checkpoint .*step-000000002 failed"):
        checkpointer.save(2, checkpoint_state(2))
    assert checkpointer.num_failed == 2


def test_storage_retries_a_transient_error_then_succeeds(tmp_path, caplog):
    storage = ckpt.CheckpointStorage(str(tmp_path), retries=3, retry_wait_s=0.01)
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] < 3:
            raise ConnectionError("endpoint unreachable")
        return "ok"

    with caplog.at_level(logging.WARNING, logger="training_core"):
        assert storage._retry("uploading x", flaky) == "ok"
    assert calls["n"] == 3 and "retrying" in caplog.text
    with pytest.raises(ckpt.CheckpointError, match="uploading y failed after 4 attempt"):
        storage._retry("uploading y", lambda: (_ for _ in ()).throw(ConnectionError("down")))


def test_checkpoint_settings_are_validated():
    with pytest.raises(
        ValueError,
        match="checkpoint.at_epoch_end=False is invalid: with checkpoint.interval_steps=0 nothing would be saved",
    ):
        CheckpointConfig(interval_steps=0, at_epoch_end=False)
    with pytest.raises(ValueError, match="checkpoint.s3_server_side_encryption='DES'.* one of '', AES256, aws:kms$"):
        CheckpointConfig(s3_server_side_encryption="DES")
    assert CheckpointConfig(s3_server_side_encryption="aws:kms", s3_kms_key_id="k").storage_options() == {
        "s3_additional_kwargs": {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "k"}
    }


def test_manifest_lists_every_file_with_its_hash(tmp_path):
    checkpointer = ckpt.Checkpointer(ckpt.CheckpointStorage(str(tmp_path)), keep_last=1, async_save=False)
    checkpointer.save(7, checkpoint_state(7), metric=0.25)
    manifest = json.loads((tmp_path / "step-000000007" / ckpt.MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {ckpt.MODEL_FILE, ckpt.TRAINER_STATE_FILE, ckpt.META_FILE}
    assert manifest["global_step"] == 7 and manifest["metric"] == 0.25


def test_a_checkpoint_downloaded_through_the_storage_seam_verifies_where_it_lands(tmp_path):
    import fsspec

    root = f"memory://seam-{time.time_ns()}/checkpoints"
    storage = ckpt.open_storage(root, CheckpointConfig())
    try:
        ckpt.Checkpointer(storage, keep_last=1, async_save=False).save(3, checkpoint_state(3), metric=0.5)
        storage.download(ckpt.step_name(3), str(tmp_path / ckpt.step_name(3)))
    finally:
        fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)
    assert ckpt.load_directory(str(tmp_path / ckpt.step_name(3))).meta.global_step == 3
    assert not hasattr(storage, "fs"), "callers go through the Storage methods, not the filesystem"


def test_staging_buffers_are_reused_but_never_refilled_while_a_write_reads_them(tmp_path):
    storage = ckpt.CheckpointStorage(str(tmp_path))
    release = threading.Event()
    original_write = storage.write

    def slow_write(name, files, manifest):
        release.wait(timeout=30)
        original_write(name, files, manifest)

    storage.write = slow_write
    checkpointer = ckpt.Checkpointer(storage, keep_last=3)
    model, _, _, _ = trained_objects(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = checkpointer.stage(model=model, meta=checkpoint_meta(1))
    checkpointer.save(1, first)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    staged = []
    second_stage = threading.Thread(
        target=lambda: staged.append(checkpointer.stage(model=model, meta=checkpoint_meta(2)))
    )
    second_stage.start()
    time.sleep(0.3)
    assert second_stage.is_alive(), "staging must wait while the previous write still reads the buffers"
    release.set()
    second_stage.join(timeout=30)
    assert all(staged[0]["model"][k] is first["model"][k] for k in before), "buffers should be reused"
    checkpointer.save(2, staged[0])
    checkpointer.wait()
    step1 = ckpt.verify_and_load(storage, "step-000000001").model
    step2 = ckpt.verify_and_load(storage, "step-000000002").model
    assert all(torch.equal(step1[k], v) for k, v in before.items())
    assert all(torch.equal(step2[k], v + 1.0) for k, v in before.items() if v.is_floating_point())
