"""The training loop launched with plain ``torch.distributed``, without Ray: the scaling benchmark's baseline.

:func:`launch` starts ``cfg.scaling.num_workers`` processes on this machine (``torch.multiprocessing``
spawn), joins them into one process group over 127.0.0.1, and runs :func:`training_core.train.loop.run_worker`
in each with a :class:`TorchDistributedRuntime`. Config, data and loop are exactly what
:func:`training_core.runners.ray_train.fit` runs under Ray Train, so the two differ only in who starts the processes
and sets up the process group; the result has the same shape (:class:`~training_core.runners.ray_train.FitResult`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from training_core.config import TrainingConfig
from training_core.parallel.ray_settings import PROCESS_ENV, environment_defaults
from training_core.records import EpochRecord, WorkerArgs
from training_core.redact import install_log_redaction
from training_core.runners.ray_train import FitResult, checkpoint_root, collect_final

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger("training_core")

RECORDS_FILE = "epoch_records.jsonl"


@dataclass
class TorchDistributedRuntime:
    """One rank of a process group started by :func:`launch` (what ``RayTrainRuntime`` is under Ray Train)."""

    rank: int
    world_size: int
    local_rank: int
    """Rank on this machine; picks the GPU (``cuda:<local_rank>``)."""
    device: "torch.device"
    records_path: str
    """File rank 0 appends each reported epoch record to, one JSON object a line."""

    @classmethod
    def connect(
        cls,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        backend: str,
        init_method: str,
        timeout_s: int,
        use_gpu: bool,
        records_path: str,
    ) -> "TorchDistributedRuntime":
        """Join the process group (every rank must call this) and pick this rank's device."""
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
        if use_gpu:
            torch.cuda.set_device(device)
        # Also for one worker, as Ray Train does: the loop's metric all-reduces then run the same code path.
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, device=device, records_path=records_path)

    def prepare_model(self, model: "nn.Module", ddp_kwargs: dict | None = None) -> "nn.Module":
        """Move to the device; wrap in DDP with ``ddp_kwargs`` when there is more than one rank, as Ray's
        ``prepare_model`` does, so both launchers train the same way."""
        model = model.to(self.device)
        if self.world_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **(ddp_kwargs or {}))  # output on device_ids[0]

    @property
    def started_unix(self) -> float:
        """The worker process's start: the attempt's start-up (imports, joining the group) counts from it."""
        from training_core.parallel.distributed import process_start_unix

        return process_start_unix()

    def report(self, metrics: dict[str, float]) -> None:
        if self.rank == 0:
            with open(self.records_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(metrics) + "\n")

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_main(local_rank: int, args: WorkerArgs, connect: dict[str, Any]) -> None:
    """Entry point of each spawned process: one machine, so the global rank is the local rank. ``connect`` holds
    :meth:`TorchDistributedRuntime.connect`'s arguments that every process shares."""
    from training_core.train.loop import run_worker

    # The same variables torchrun and Ray Train set, for code that reads them.
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(connect["world_size"]))
    os.environ.update(args.config.scaling.nccl_env)  # before the process group starts
    logging.basicConfig(level=logging.INFO, format=f"[rank {local_rank}] %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    runtime = TorchDistributedRuntime.connect(rank=local_rank, local_rank=local_rank, **connect)
    try:
        run_worker(args, runtime)
    finally:
        runtime.close()
    _exit_finished_rank()


def _exit_finished_rank() -> NoReturn:
    """End a rank whose work is done (records written, process group destroyed) without the interpreter's
    finalization: torch's C++ threads can abort a finished rank there (a CI run saw rank 1 end with SIGABRT,
    "terminate called without an active exception", after its last collective, failing a run that had succeeded).
    What finalization would still do is done here: loader processes left are stopped, logs and streams flushed."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=5)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports free on every interface now, for a server (rank 0's store, a
    test's S3 or metrics server) that binds them moments later.

    The ports are drawn outside the kernel's ephemeral range: below it, or above it where it starts too low. A port
    from ``bind(port=0)`` comes from that range, which the kernel also draws outgoing connections' local ports from,
    so on a machine where Ray opens connections all the time one can be taken between the pick and the bind (a CI
    run lost a metrics-endpoint test that way). Raises ``RuntimeError`` when no window outside the range is left.
    """
    low, high = _ephemeral_port_range()
    # Below the range where it leaves room (it starts at 32768 by default), else above it.
    windows = [(_LOWEST_PICKED_PORT, low - count), (high + 1, 65536 - count)]
    window = next(((start, stop) for start, stop in windows if start < stop), None)
    if window is None:
        raise RuntimeError(
            f"no {count} consecutive TCP port(s) outside the kernel's ephemeral range {low}-{high} "
            f"(net.ipv4.ip_local_port_range): start that range at 32768, Linux's default, or end it below 65535"
        )
    start, stop = window
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(start, stop)
        if all(_port_is_free(port) for port in range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} consecutive free TCP ports in {start}-{stop + count - 1}")


_LOWEST_PICKED_PORT = 20000


def _ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections: ``(first, last)``."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(port) for port in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default; elsewhere, below IANA's 49152 too


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _child_environment(cfg: TrainingConfig) -> dict[str, str]:
    """Environment the spawned processes inherit where the environment does not set it already: as Ray's workers,
    the platform's process settings and OpenMP's thread count set before they import torch; gloo pinned to the
    loopback interface, since every rank is on this machine."""
    loopback = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return {
        **PROCESS_ENV,
        "GLOO_SOCKET_IFNAME": loopback[0] if loopback else "lo",
        "OMP_NUM_THREADS": str(cfg.scaling.torch_threads_per_worker),
    }


def launch(
    cfg: TrainingConfig,
    *,
    data_dir: str,
    checkpoint_dir: str,
    run_name: str,
    storage_path: str,
    warmup_steps_excluded: int | None = None,
    job_labels: dict[str, str] | None = None,
) -> FitResult:
    """Train ``cfg`` on ``cfg.scaling.num_workers`` local processes with plain ``torch.distributed``.

    Arguments mean what they mean for :func:`training_core.runners.ray_train.fit` (no MLflow run: the baseline only
    measures). Checkpoints go to the same :func:`~training_core.runners.ray_train.checkpoint_root`, and the final one
    is copied to local ``checkpoint_dir``. ``metrics`` of the result is the last epoch record rank 0 reported.
    Raises ``torch.multiprocessing.ProcessRaisedException`` (with the failing rank's traceback) if a rank fails.
    """
    import torch.multiprocessing as mp

    if cfg.scaling.use_gpu:
        import torch

        if torch.cuda.device_count() < cfg.scaling.num_workers:
            raise ValueError(
                f"scaling.num_workers={cfg.scaling.num_workers} is invalid for the local launcher: this machine has "
                f"{torch.cuda.device_count()} GPU(s) and each worker needs one; lower scaling.num_workers"
            )
    root = checkpoint_root(storage_path, run_name)
    args = WorkerArgs.build(
        cfg,
        data_dir=data_dir,
        checkpoint_root=root,
        run_name=run_name,
        job_labels=job_labels,
        warmup_steps_excluded=warmup_steps_excluded,
    )
    with tempfile.TemporaryDirectory(prefix="launch-") as scratch:
        records_path = os.path.join(scratch, RECORDS_FILE)
        connect = dict(
            world_size=cfg.scaling.num_workers,
            backend=cfg.scaling.resolved_backend(),
            init_method=f"tcp://127.0.0.1:{free_port()}",
            timeout_s=cfg.scaling.collective_timeout_s,
            use_gpu=cfg.scaling.use_gpu,
            records_path=records_path,
        )
        with environment_defaults(_child_environment(cfg)):
            mp.spawn(_worker_main, args=(args, connect), nprocs=cfg.scaling.num_workers, join=True)
        with open(records_path, encoding="utf-8") as f:
            records = [EpochRecord.from_dict(json.loads(line)) for line in f if line.strip()]
    return collect_final(
        cfg, root, checkpoint_dir, what=f"plain torch.distributed run {run_name!r}", metrics=records[-1]
    )
