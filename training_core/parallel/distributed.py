"""What the loop needs from the process group: the runtime that started it, metric all-reduces, buffer
broadcasts, and the timing of DDP's gradient all-reduces."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from training_core.config import DDP_DEFAULT_BUCKET_CAP_MB, ScalingConfig

log = logging.getLogger(__name__)


def broadcast_buffers_from_rank0(model: nn.Module) -> None:
    """Give every rank rank 0's BatchNorm running stats, so validation describes the checkpointed model.

    DDP broadcasts buffers only at the start of a forward pass; after the last step each rank still holds
    the statistics of its own batches."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        for buffer in getattr(model, "module", model).buffers():
            torch.distributed.broadcast(buffer, src=0)


def ddp_options(scaling: ScalingConfig) -> dict[str, Any]:
    """DDP's keyword arguments for ``scaling.ddp_*``. The bucket size is passed only when it is not PyTorch's
    default: passing any size, the default included, makes DDP's first bucket that size instead of 1 MiB, so the
    first all-reduce (of the last layers' gradients, ready first) would wait for 25 MiB of gradients."""
    options: dict[str, Any] = {
        "gradient_as_bucket_view": scaling.ddp_gradient_as_bucket_view,
        "static_graph": scaling.ddp_static_graph,
    }
    if scaling.ddp_bucket_cap_mb != DDP_DEFAULT_BUCKET_CAP_MB:
        options["bucket_cap_mb"] = scaling.ddp_bucket_cap_mb
    return options


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def all_gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj`` (picklable), by rank, on every rank: a collective when a process group is up; else
    ``obj`` for each rank."""
    if world_size < 2 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj] * world_size
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


def process_start_unix() -> float:
    """This process's start on the wall clock, to a clock tick (10 ms). psutil's ``create_time`` adds the kernel's
    boot time, which ``/proc/stat`` gives in whole seconds: up to a second off, which a start-up of a few seconds
    cannot afford. Here the process's age comes from the boot-time clock instead (Linux); elsewhere psutil's."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(after_name[19])  # field 22, ``starttime``: the fields after the name start at field 3
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age_s
    except (OSError, ValueError, IndexError, AttributeError):
        import psutil

        return psutil.Process().create_time()


@dataclass(frozen=True)
class AllReduceProbe:
    """What a fixed all-reduce cost on this job's process group at start (the slowest rank's figures)."""

    bus_bandwidth_bytes_per_s: float
    """NCCL-tests' bus bandwidth: ``2 (n - 1) / n`` times the buffer over the time, comparable across world sizes."""
    latency_s: float
    """Time of a one-element all-reduce."""
    size_bytes: int
    """Buffer the bandwidth was measured with."""


def probe_allreduce(device: torch.device, world_size: int, *, iterations: int = 5) -> AllReduceProbe | None:
    """Time all-reduces of one element and of a fixed buffer (4 MiB on CPU, 64 MiB on a GPU); None on one rank.

    A collective: every rank calls it at job start. A slow network, a wrong interface or NCCL's silent fallback to
    TCP sockets shows here, before hours are spent training at a fraction of the expected speed."""
    if world_size < 2 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    size_bytes = (64 if device.type == "cuda" else 4) * 2**20
    small = torch.zeros(1, device=device)
    big = torch.zeros(size_bytes // 4, device=device)

    def seconds_per_op(tensor: torch.Tensor) -> float:
        torch.distributed.all_reduce(tensor)  # warm-up: connections, NCCL channels
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(iterations):
            torch.distributed.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - started) / iterations

    latency_s, big_s = seconds_per_op(small), seconds_per_op(big)
    slowest = torch.tensor([latency_s, big_s], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    latency_s, big_s = slowest.tolist()
    bus_bytes = 2 * (world_size - 1) / world_size * size_bytes
    return AllReduceProbe(bus_bandwidth_bytes_per_s=bus_bytes / big_s, latency_s=latency_s, size_bytes=size_bytes)


class WorkerRuntime(Protocol):
    """What the loop needs from the launcher that started its process group (Ray Train, or plain
    ``torch.distributed`` for the parity baseline).

    The loop also uses these when a runtime has them (``RayTrainRuntime`` does; the others need not):
    ``started_unix`` (the worker process's start, for the cost of a resume), ``nccl_debug_dir`` (where NCCL's INFO
    log goes), ``preemption_notice()`` (Ray Train's notice that a node of the group is being preempted) and
    ``run_on_main_thread`` (to install the SIGTERM handler from the loop's thread)."""

    rank: int
    world_size: int
    device: torch.device

    def prepare_model(self, model: nn.Module, ddp_kwargs: dict[str, Any] | None = None) -> nn.Module:
        """Move ``model`` to ``device`` and wrap it in DDP when ``world_size > 1``, with ``ddp_kwargs`` (bucket size,
        gradient views, static graph)."""

    def report(self, metrics: dict[str, float]) -> None:
        """Called by every rank once per epoch with the epoch's record (``EpochRecord.to_dict()``)."""


class RayTrainRuntime:
    """The runtime inside a Ray Train worker (``TorchTrainer`` set up the process group)."""

    def __init__(self, *, nccl_debug_dir: str | None = None) -> None:
        import ray.train
        import ray.train.torch

        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.device = ray.train.torch.get_device()
        # The other ranks' worker actors, exchanged while the group is healthy (one collective at start), so a rank
        # whose collective times out can still reach them (abandon_group).
        handles = all_gather_objects(ray.get_runtime_context().current_actor, self.world_size)
        self.peers = [handle for rank, handle in enumerate(handles) if rank != self.rank]
        # A restarted worker group is new actors: their process's start bounds the attempt's (the loop also bounds
        # it by the checkpoint's time, since Ray may place an actor in a process its pool started earlier).
        self.started_unix = process_start_unix()
        self.nccl_debug_dir = nccl_debug_dir
        """Where NCCL writes this process's debug log (:func:`training_core.parallel.nccl_network.debug_env`), or
        None."""

    def preemption_notice(self) -> bool:
        """Whether Ray Train's preemption watcher has told this worker that a node of its group is being preempted
        (the node is drained with reason preemption: KubeRay's autoscaler, a spot termination handler). The watcher
        marks every worker's context; it is read here where it lands, without a collective: the public
        ``ray.train.get_preemption_info`` is a barrier through an actor on every call, and the loop already agrees
        on a stop in its own all-reduce. False where this Ray has no such context."""
        try:
            from ray.train.v2._internal.execution.context import get_train_context

            return get_train_context().preemption_context.preemption_info is not None
        except (ImportError, AttributeError) as exc:
            if not getattr(self, "_notice_unreadable", False):
                self._notice_unreadable = True
                log.warning("Ray Train's preemption notices cannot be read in this Ray version (%s): SIGTERM only", exc)
            return False

    def abandon_group(self, reason: str) -> None:
        """A collective timed out: the group is lost, and Ray Train restarts all of it from the latest checkpoint.
        Kill the peers' worker actors now (the raylet SIGKILLs one that does not exit within
        ``RAY_kill_worker_timeout_milliseconds``), so a hung rank does not hold the restart up: Ray Train waits up to
        5 s for every worker's answer to its shutdown call, and ``TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S`` for its
        process group, and a stopped process never answers. Only called on the way out of a failed run."""
        import ray

        log.warning(
            "rank %d: a collective timed out (%s): killing the %d other worker(s) so the group restarts now",
            self.rank,
            reason[:300],
            len(self.peers),
        )
        for peer in self.peers:
            try:
                ray.kill(peer, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - a peer already gone is what we want
                log.info("killing a peer worker: %s", exc)

    def prepare_model(self, model: nn.Module, ddp_kwargs: dict[str, Any] | None = None) -> nn.Module:
        import ray.train.torch

        return ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_kwargs)

    def report(self, metrics: dict[str, float]) -> None:
        import ray.train

        ray.train.report(metrics)

    def run_on_main_thread(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on this worker process's main thread and return its result. The loop runs in a
        thread of the Ray Train worker actor; the actor's own tasks run on the main thread, and it is idle
        between the controller's polls."""
        import ray

        actor = ray.get_runtime_context().current_actor
        return ray.get(actor.execute.remote(fn, *args))

    def report_result(self, metrics: dict[str, Any]) -> None:
        """Hand ``metrics`` to the driver as the run's ``Result.metrics``. Every rank calls it, as its last report.

        Ray Train V2 keeps in the result only metrics reported with a checkpoint, so rank 0 attaches a Ray
        checkpoint holding nothing but ``result.json`` (a few bytes under the run's storage path); the training
        checkpoints stay ours (:mod:`training_core.checkpoint`)."""
        import json
        import tempfile

        import ray.train

        if self.rank != 0:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as directory:
            with open(os.path.join(directory, "result.json"), "w") as f:
                json.dump(metrics, f)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


class CommTimer:
    """Measures how long DDP's gradient all-reduces are in flight during each step.

    A DDP communication hook stamps each bucket's all-reduce when it is launched and when it completes; the
    union of those intervals is the step's communication time (overlapping buckets count once). It does
    not change what is reduced: the hook is the default all-reduce plus two clock reads.
    """

    def __init__(self) -> None:
        self._intervals: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def install(self, model: nn.Module) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def timed_allreduce(state, bucket):
            started = time.perf_counter()
            future = default_hooks.allreduce_hook(state, bucket)

            def finished(fut):
                with self._lock:
                    self._intervals.append((started, time.perf_counter()))
                return fut.value()

            return future.then(finished)

        model.register_comm_hook(None, timed_allreduce)

    def take_step_seconds(self) -> float:
        """Communication time since the previous call (the intervals' union), and reset."""
        with self._lock:
            intervals, self._intervals = sorted(self._intervals), []
        total, end = 0.0, -math.inf
        for start, stop in intervals:
            if stop > end:
                total += stop - max(start, end)
                end = stop
        return total
