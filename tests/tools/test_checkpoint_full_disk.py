"""A checkpoint save on a full disk keeps the previous checkpoint and reports the error. Needs ``mount`` and
``umount`` (util-linux, on every Debian system) and root, to put the checkpoints on a real 512 KiB tmpfs; where the
mount fails (not root), the test runs against a storage whose writes fail with ENOSPC after the first checkpoint.
The other checkpoint tests are in ``tests/unit/test_checkpoint.py``."""

import logging
import os
import subprocess

import pytest

from tests.helpers.checkpoints import checkpoint_meta, checkpoint_state
from training_core import checkpoint as ckpt


@pytest.fixture
def small_disk(tmp_path):
    """``(root, mounted)``: a real full filesystem where ``mount`` is allowed, a 512 KiB tmpfs that one checkpoint
    (~350 KB) fits and two do not; else a plain directory (the test injects ENOSPC)."""
    root = tmp_path / "small-disk"
    root.mkdir()
    mounted = (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(root)], capture_output=True).returncode
        == 0
    )
    yield root, mounted
    if mounted:
        subprocess.run(["umount", str(root)], check=True)


def test_disk_full_keeps_the_previous_checkpoint_and_reports_the_error(small_disk, caplog):
    root, mounted = small_disk
    storage = ckpt.CheckpointStorage(str(root))
    if not mounted:  # not root: a storage whose writes hit ENOSPC after the first checkpoint
        original = storage.write

        def write_until_full(name, files, manifest):
            if storage.list_steps():
                raise ckpt.CheckpointError(
                    f"writing checkpoint {storage.uri(name)} failed: [Errno 28] No space left on device"
                )
            original(name, files, manifest)

        storage.write = write_until_full
    checkpointer = ckpt.Checkpointer(storage, keep_last=3, max_consecutive_failures=2)
    checkpointer.save(1, checkpoint_state(1))
    checkpointer.save(2, checkpoint_state(2))  # fails in the background ...
    with caplog.at_level(logging.ERROR, logger="training_core"):
        checkpointer.save(3, checkpoint_state(3))  # ... is reported, tolerated once, and this one fails too
        with pytest.raises(ckpt.CheckpointError, match="2 checkpoint saves in a row failed.*No space left on device"):
            checkpointer.save(4, checkpoint_state(4))
    assert "checkpoint save of step 2 failed" in caplog.text and "No space left on device" in caplog.text
    assert checkpointer.num_failed == 2
    assert storage.list_steps() == ["step-000000001"]
    assert not [p for p in os.listdir(root) if p.startswith(".tmp-")], "a failed write must clean up after itself"
    assert ckpt.load_latest_valid(storage).meta.global_step == 1


def test_a_sharded_save_on_a_full_disk_keeps_the_previous_checkpoint_and_cleans_up(small_disk, tmp_path, caplog):
    """The same under FSDP (``Checkpointer.save_sharded``): the shards are written by ``torch.distributed.checkpoint``
    into a staging directory on the full filesystem, in the background; the failure is reported at the next save,
    the previous checkpoint stays the latest valid one, and no staging directory or partial step is left."""
    import errno

    import torch
    import torch.distributed as dist

    from training_core.models import build_model
    from training_core.parallel import sharding

    root, mounted = small_disk
    storage = ckpt.CheckpointStorage(str(root))
    if not mounted:  # not root: moving a shard into place hits ENOSPC after the first checkpoint
        original = storage.put_file

        def put_until_full(name, relative, local_path):
            if storage.list_steps() and name != storage.list_steps()[0]:
                raise ckpt.CheckpointError(f"writing {name}/{relative} failed: {os.strerror(errno.ENOSPC)}")
            original(name, relative, local_path)

        storage.put_file = put_until_full
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = build_model("small_cnn", num_classes=10, input_shape=(1, 8, 8))
        model = sharding.shard_model(
            model, [model.features], device=torch.device("cpu"), param_dtype=None, cpu_offload=False
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(4, 1, 8, 8)).square().mean().backward()
        optimizer.step()  # AdamW's state makes a checkpoint ~350 KB: one fits in 512 KiB, two do not
        checkpointer = ckpt.Checkpointer(storage, keep_last=3, max_consecutive_failures=2)

        def save(step: int) -> None:
            checkpointer.save_sharded(
                step,
                model=model,
                optimizer=optimizer,
                trainer_state={"rng": {}},
                meta=checkpoint_meta(step),
                metric=None,
            )

        save(1)
        checkpointer.wait()
        save(2)  # fails in the background ...
        with caplog.at_level(logging.ERROR, logger="training_core"):
            save(3)  # ... is reported, tolerated once, and this one fails too
            with pytest.raises(ckpt.CheckpointError, match="2 checkpoint saves in a row failed.*No space left"):
                save(4)
        assert "checkpoint save of step 2 failed" in caplog.text
        assert checkpointer.num_failed == 2
        assert storage.list_steps() == ["step-000000001"]
        assert not [p for p in os.listdir(root) if p.startswith(".tmp-")], "a failed write must clean up after itself"
        latest = ckpt.load_latest_valid(storage)
        assert latest.meta.global_step == 1 and latest.shards_dir
        latest.release()
    finally:
        dist.destroy_process_group()
