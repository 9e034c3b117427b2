"""Checkpoint I/O for a ~500 MB model + optimizer state: local and S3, sync and async.

In one run, for the same state (ResNet-101 with AdamW moments, about 530 MB):

- ``save_seconds`` / ``load_seconds``: a synchronous save (serialise, hash, write, fsync, rename) and a
  verified load, to a local directory;
- ``raw_disk_write_mb_per_s``: the same bytes written and fsynced as plain files, for
  ``write_vs_disk_ratio`` (our save's MB/s over the raw disk's);
- ``s3_save_seconds`` / ``s3_load_seconds``: the same against an S3-compatible server (moto) on 127.0.0.1;
- ``async_stall_ratio``: the time a training step is blocked by an asynchronous save (the CPU snapshot
  and queueing) over the time of a synchronous save. Goal: <= 0.1.
- ``fsdp_async_stall_ratio``: the same for a sharded checkpoint (``scaling.strategy=fsdp``) of a GPT-2 (124 M
  layout, byte vocabulary) with AdamW sharded over 2 gloo processes, about 1 GB in all: the step's wait (a host copy
  of the shards) over a synchronous sharded save (every rank's ``torch.distributed.checkpoint`` write, hashes,
  manifest). Goal: <= 0.1.

Prints one JSON object as the last line and writes ``benchmarks/results/checkpoint_io.json``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402


def _state(model_name: str):
    import torch

    from training_core import checkpoint as ckpt
    from training_core.config import OptimizerConfig, TrainingConfig
    from training_core.models import build_model
    from training_core.train.optim import build_optimizer

    torch.manual_seed(0)
    model = build_model(model_name, num_classes=1000, input_shape=(3, 32, 32))
    optimizer = build_optimizer(OptimizerConfig(name="adamw"), model.parameters())
    # One real step so the optimizer holds its moments (two tensors per parameter).
    loss = model(torch.randn(2, 3, 32, 32)).sum()
    loss.backward()
    optimizer.step()
    meta = ckpt.CheckpointMeta(
        model_name=model_name,
        classes=[str(i) for i in range(1000)],
        input_shape=[3, 32, 32],
        mean=[0.5] * 3,
        std=[0.25] * 3,
        epoch=0,
        global_step=1,
        config=TrainingConfig().to_dict(),
    )
    return model, optimizer, meta


def _start_moto(port: int, log_path: str) -> subprocess.Popen:
    moto = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    process = subprocess.Popen(
        [moto, "-H", "127.0.0.1", "-p", str(port)],
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
            return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"moto_server did not start; see {log_path}")


SHARDED_WORLD_SIZE = 2


def _sharded_worker(rank: int, spec: dict, out: dict) -> None:
    import torch
    import torch.distributed as dist

    from training_core import checkpoint as ckpt
    from training_core.config import ModelConfig, TrainingConfig
    from training_core.parallel import sharding
    from training_core.workloads.causal_lm import build_lm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=SHARDED_WORLD_SIZE)
    torch.manual_seed(0)
    model = build_lm(ModelConfig(name=spec["model"]), vocab_size=257, eot_id=256)
    model = sharding.shard_model(
        model, sharding.find_blocks(model), device=torch.device("cpu"), param_dtype=None, cpu_offload=False
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, 257, (1, 16))).logits.mean().backward()
    optimizer.step()  # the moments exist: two tensors per parameter
    group = dist.new_group(backend="gloo")
    meta = ckpt.CheckpointMeta(
        model_name=spec["model"], classes=[], input_shape=[], mean=[], std=[], epoch=0, global_step=0,
        config=TrainingConfig().to_dict(),
    )  # fmt: skip

    def save(checkpointer: ckpt.Checkpointer, step: int) -> float:
        started = time.perf_counter()
        checkpointer.save_sharded(
            step,
            model=model,
            optimizer=optimizer,
            trainer_state={} if rank == 0 else None,
            meta=meta if rank == 0 else None,
            process_group=group,
        )
        return time.perf_counter() - started

    sync = ckpt.Checkpointer(ckpt.open_storage(f"{spec['dir']}/sync"), keep_last=1, async_save=False)
    save_s = [save(sync, repeat + 1) for repeat in range(spec["repeats"])]
    asynchronous = ckpt.Checkpointer(ckpt.open_storage(f"{spec['dir']}/async"), keep_last=1, async_save=True)
    stall_s = []
    for repeat in range(spec["repeats"] + 1):  # the first save allocates the host buffers
        stalled = save(asynchronous, repeat + 1)
        asynchronous.wait()
        dist.barrier()
        if repeat:
            stall_s.append(stalled)
    out[rank] = {
        "save_s": min(save_s),
        "stall_s": min(stall_s),
        "bytes": sum(sharding.local_tensor(p).numel() * 4 * 3 for p in model.parameters()),
    }
    dist.destroy_process_group()


def _sharded_figures(model: str, repeats: int, workdir: str) -> dict:
    """Save and stall seconds of a sharded checkpoint, the slowest rank's, in fresh processes."""
    import torch.multiprocessing as mp

    from training_core.runners.launch import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        spec = {"model": model, "repeats": repeats, "dir": workdir, "init": f"tcp://127.0.0.1:{free_port()}"}
        mp.spawn(_sharded_worker, args=(spec, out), nprocs=SHARDED_WORLD_SIZE, join=True)
        ranks = [dict(out[r]) for r in range(SHARDED_WORLD_SIZE)]
    save_s, stall_s = max(r["save_s"] for r in ranks), max(r["stall_s"] for r in ranks)
    return {
        "fsdp_model": model,
        "fsdp_checkpoint_mb": sum(r["bytes"] for r in ranks) / 1e6,
        "fsdp_save_seconds": save_s,
        "fsdp_async_stall_seconds": stall_s,
        "fsdp_async_stall_ratio": stall_s / save_s,
    }


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet101", help="registry model whose state is saved")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each measurement (best kept)")
    parser.add_argument("--sharded-model", default="gpt2", help="GPT preset of the sharded (FSDP) checkpoint")
    parser.add_argument("--sharded-only", action="store_true", help="measure only the sharded checkpoint")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="checkpoint-io-sharded-") as workdir:
        sharded = _sharded_figures(args.sharded_model, args.repeats, workdir)
    print(f"sharded: {sharded}", file=sys.stderr, flush=True)
    if args.sharded_only:
        emit("checkpoint_io_sharded", {**sharded, "goal": "fsdp_async_stall_ratio <= 0.1"})
        return

    from training_core import checkpoint as ckpt

    model, optimizer, meta = _state(args.model)
    with tempfile.TemporaryDirectory(prefix="checkpoint-io-") as workdir:
        local = ckpt.open_storage(os.path.join(workdir, "local"))
        sync = ckpt.Checkpointer(local, keep_last=1, async_save=False)
        # Raw writes of the same bytes alternate with our saves, so disk-speed drift hits both alike.
        save_s, load_s, raw_s, nbytes, raw_bytes = [], [], [], 0, 0
        for repeat in range(args.repeats):
            files = ckpt.encode(ckpt.snapshot(model=model, optimizer=optimizer, meta=meta))
            raw_bytes = sum(len(d) for d in files.values())
            directory = os.path.join(workdir, f"raw-{repeat}")
            os.makedirs(directory)
            start = time.perf_counter()
            for name, data in files.items():
                with open(os.path.join(directory, name), "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            raw_s.append(time.perf_counter() - start)
            shutil.rmtree(directory)
            del files

            state = ckpt.snapshot(model=model, optimizer=optimizer, meta=meta)
            start = time.perf_counter()
            sync.save(repeat + 1, state)
            save_s.append(time.perf_counter() - start)
            nbytes = sync.bytes_written // sync.num_saved
            start = time.perf_counter()
            ckpt.verify_and_load(local, ckpt.step_name(repeat + 1))
            load_s.append(time.perf_counter() - start)

        stall_s = []
        async_checkpointer = ckpt.Checkpointer(
            ckpt.open_storage(os.path.join(workdir, "async")), keep_last=1, async_save=True
        )
        # The first save allocates the staging buffers; the steady state is every save after it, which is
        # what a run of many checkpoints pays.
        for repeat in range(args.repeats + 1):
            start = time.perf_counter()
            async_checkpointer.save(repeat + 1, async_checkpointer.stage(model=model, optimizer=optimizer, meta=meta))
            if repeat:
                stall_s.append(time.perf_counter() - start)
            async_checkpointer.wait()  # keep the write out of the next stall measurement

        from training_core.runners.launch import free_port

        port = free_port()
        moto = _start_moto(port, os.path.join(workdir, "moto.log"))
        try:
            import boto3

            endpoint = f"http://127.0.0.1:{port}"
            boto3.client(
                "s3",
                endpoint_url=endpoint,
                aws_access_key_id="bench",
                aws_secret_access_key="bench",
                region_name="us-east-1",
            ).create_bucket(Bucket="checkpoints")
            options = {
                "key": "bench",
                "secret": "bench",
                "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            }
            s3 = ckpt.open_storage("s3://checkpoints/bench", storage_options=options)
            s3_checkpointer = ckpt.Checkpointer(s3, keep_last=1, async_save=False)
            s3_save_s, s3_load_s = [], []
            for repeat in range(args.repeats):
                state = ckpt.snapshot(model=model, optimizer=optimizer, meta=meta)
                start = time.perf_counter()
                s3_checkpointer.save(repeat + 1, state)
                s3_save_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                ckpt.verify_and_load(s3, ckpt.step_name(repeat + 1))
                s3_load_s.append(time.perf_counter() - start)
        finally:
            os.killpg(moto.pid, 15)

    mb = nbytes / 1e6
    save_seconds, load_seconds = min(save_s), min(load_s)
    raw_write_mb_per_s = raw_bytes / 1e6 / min(raw_s)
    result = {
        "benchmark": "checkpoint_io",
        "model": args.model,
        "checkpoint_mb": mb,
        "save_seconds": save_seconds,
        "save_mb_per_s": mb / save_seconds,
        "load_seconds": load_seconds,
        "load_mb_per_s": mb / load_seconds,
        "raw_disk_write_mb_per_s": raw_write_mb_per_s,
        "write_vs_disk_ratio": (mb / save_seconds) / raw_write_mb_per_s,
        "s3_save_seconds": min(s3_save_s),
        "s3_save_mb_per_s": mb / min(s3_save_s),
        "s3_load_seconds": min(s3_load_s),
        "s3_load_mb_per_s": mb / min(s3_load_s),
        "async_stall_seconds": min(stall_s),
        "async_stall_ratio": min(stall_s) / save_seconds,
        **sharded,
        "goal": "async_stall_ratio <= 0.1 and fsdp_async_stall_ratio <= 0.1",
    }
    emit("checkpoint_io", result)


if __name__ == "__main__":
    main()
