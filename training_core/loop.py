"""The training loop that runs on every Ray Train worker.

``train_loop_per_worker`` is what :class:`ray.train.torch.TorchTrainer` runs. It reads the whole story
top to bottom: build the model, optimizer and schedule, then for each epoch take ``steps_per_epoch``
optimizer steps over this rank's shards, validate, and report a checkpoint. ``train_step`` (one optimizer
step over ``grad_accum_steps`` micro-batches) is the only piece factored out, so tests can check it alone.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from training_core import checkpoint as ckpt
from training_core.config import OptimizerConfig, ScheduleConfig, TrainingConfig
from training_core.data import Manifest, ShardStream
from training_core.metrics import MlflowSink, build_sink, flatten
from training_core.models import build_model
from training_core.telemetry import JobLabels, build_telemetry

log = logging.getLogger("training_core")

# Per-step times kept for the step-time percentiles of one run (bounded: 8 bytes each).
MAX_STEP_TIMES_KEPT = 100_000


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_precision(mode: str, device: torch.device) -> tuple[torch.dtype | None, bool]:
    """Autocast dtype (None = fp32) and whether to use a GradScaler, for ``precision.mode`` on ``device``."""
    if device.type != "cuda":
        if mode == "fp16":
            log.warning("precision.mode='fp16' needs a GPU; training in fp32 on %s", device)
        return (torch.bfloat16, False) if mode == "bf16" else (None, False)
    if mode == "auto":
        mode = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return {"fp32": (None, False), "bf16": (torch.bfloat16, False), "fp16": (torch.float16, True)}[mode]


def build_optimizer(cfg: OptimizerConfig, params) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0, weight_decay=cfg.weight_decay
        )
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"optimizer.name={cfg.name!r} is invalid: choose one of sgd, adam, adamw")


def lr_factor(step: int, *, cfg: ScheduleConfig, total_steps: int) -> float:
    """Multiplier of the peak LR before optimizer step ``step`` (0-based): linear warmup, then the schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.name == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, *, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg=cfg, total_steps=total_steps))


@dataclass
class StepResult:
    loss: torch.Tensor
    """Mean loss over the step's samples (detached)."""
    num_correct: torch.Tensor
    num_samples: int
    grad_norm: torch.Tensor
    """Global gradient L2 norm before clipping."""


def train_step(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    autocast_dtype: torch.dtype | None,
    max_grad_norm: float,
) -> StepResult:
    """One optimizer step over equally sized micro-batches, equal to one step on their concatenation.

    Gradients of the micro-batches are accumulated (each loss scaled by ``1/len(micro_batches)``); a DDP
    model all-reduces only on the last one (``no_sync`` elsewhere). ``max_grad_norm <= 0`` disables clipping.
    """
    num_micro = len(micro_batches)
    loss_sum = torch.zeros((), device=micro_batches[0][0].device)
    num_correct = torch.zeros((), dtype=torch.long, device=loss_sum.device)
    num_samples = 0
    for index, (inputs, targets) in enumerate(micro_batches):
        is_last = index == num_micro - 1
        sync_context = model.no_sync() if (not is_last and hasattr(model, "no_sync")) else contextlib.nullcontext()
        with sync_context:
            with torch.autocast(
                device_type=inputs.device.type,
                dtype=autocast_dtype or torch.float32,
                enabled=autocast_dtype is not None,
            ):
                logits = model(inputs)
                loss = F.cross_entropy(logits, targets)
            scaler.scale(loss / num_micro).backward()
        loss_sum += loss.detach().float()
        num_correct += (logits.detach().argmax(dim=1) == targets).sum()
        num_samples += len(targets)
    scaler.unscale_(optimizer)
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss=loss_sum / num_micro, num_correct=num_correct, num_samples=num_samples, grad_norm=grad_norm.detach()
    )


class Normalizer:
    """uint8 numpy batches -> normalised float tensors on the device."""

    def __init__(self, manifest: Manifest, device: torch.device) -> None:
        self.device = device
        self.mean = torch.tensor(manifest.mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(manifest.std, device=device).view(1, -1, 1, 1)

    def __call__(self, images: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.from_numpy(images).to(self.device, non_blocking=True).float().div_(255.0)
        y = torch.from_numpy(labels).to(self.device, non_blocking=True)
        return (x - self.mean) / self.std, y


@dataclass
class EvalSums:
    """Additive evaluation totals, so ranks can all-reduce them."""

    loss_sum: float
    num_correct_top1: int
    num_correct_top5: int
    num_samples: int
    confusion: np.ndarray
    """``confusion[true, predicted]`` counts."""

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.num_samples)

    @property
    def accuracy(self) -> float:
        return self.num_correct_top1 / max(1, self.num_samples)

    @property
    def top5_accuracy(self) -> float:
        return self.num_correct_top5 / max(1, self.num_samples)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches,
    *,
    normalize: Normalizer,
    num_classes: int,
    autocast_dtype: torch.dtype | None = None,
    all_reduce: bool = False,
) -> EvalSums:
    """Loss, top-1/top-5 and confusion over ``batches``; ``all_reduce`` sums the totals over all ranks."""
    bare = getattr(model, "module", model)  # no DDP forward: ranks may hold different numbers of batches
    was_training = bare.training
    bare.eval()
    device = normalize.device
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.long, device=device)
    k = min(5, num_classes)
    for images, labels in batches:
        x, y = normalize(images, labels)
        with torch.autocast(
            device_type=device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
        ):
            logits = bare(x)
        logits = logits.float()
        top = logits.topk(k, dim=1).indices
        totals += torch.stack(
            [
                F.cross_entropy(logits, y, reduction="sum").double(),
                (top[:, 0] == y).sum().double(),
                (top == y[:, None]).any(dim=1).sum().double(),
                torch.tensor(float(len(y)), dtype=torch.float64, device=device),
            ]
        )
        confusion += torch.bincount(y * num_classes + top[:, 0], minlength=num_classes * num_classes)
    if all_reduce and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals)
        torch.distributed.all_reduce(confusion)
    bare.train(was_training)
    t = totals.tolist()
    return EvalSums(
        loss_sum=t[0],
        num_correct_top1=int(t[1]),
        num_correct_top5=int(t[2]),
        num_samples=int(t[3]),
        confusion=confusion.view(num_classes, num_classes).cpu().numpy(),
    )


def _broadcast_buffers_from_rank0(model: nn.Module) -> None:
    """Give every rank rank 0's BatchNorm running stats, so validation describes the checkpointed model.

    DDP broadcasts buffers only at the start of a forward pass; after the last step each rank still holds
    the statistics of its own batches."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        for buffer in getattr(model, "module", model).buffers():
            torch.distributed.broadcast(buffer, src=0)


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def _json_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached]}


def _torch_rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _gather_rng_states(world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rank's RNG states, gathered on all ranks (a collective: every rank must call it)."""
    local = (_json_rng_state(), _torch_rng_state())
    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        gathered: list[Any] = [None] * world_size
        torch.distributed.all_gather_object(gathered, local)
    else:
        gathered = [local]
    return {str(r): g[0] for r, g in enumerate(gathered)}, {str(r): g[1] for r, g in enumerate(gathered)}


def _restore_rng(rank: int, json_states: dict[str, Any], torch_states: dict[str, Any]) -> None:
    """Restore this rank's RNG streams; a rank the checkpoint does not know (the job grew) keeps its seed."""
    if str(rank) in json_states:
        python_state, numpy_state = json_states[str(rank)]["python"], json_states[str(rank)]["numpy"]
        random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
        name, keys, pos, has_gauss, cached = numpy_state
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if str(rank) in torch_states:
        torch.set_rng_state(torch_states[str(rank)]["cpu"])
        if "cuda" in torch_states[str(rank)] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(torch_states[str(rank)]["cuda"])


class WorkerRuntime(Protocol):
    """What the loop needs from the launcher that started its process group (Ray Train, or plain
    ``torch.distributed`` for the parity baseline)."""

    rank: int
    world_size: int
    device: torch.device

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to ``device`` and wrap it in DDP when ``world_size > 1``."""

    def report(self, metrics: dict[str, float]) -> None:
        """Called by every rank once per epoch with the epoch's record."""


class RayTrainRuntime:
    """The runtime inside a Ray Train worker (``TorchTrainer`` set up the process group)."""

    def __init__(self) -> None:
        import ray.train
        import ray.train.torch

        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.device = ray.train.torch.get_device()

    def prepare_model(self, model: nn.Module) -> nn.Module:
        import ray.train.torch

        return ray.train.torch.prepare_model(model)

    def report(self, metrics: dict[str, float]) -> None:
        import ray.train

        ray.train.report(metrics)


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


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train entry point, run by every worker: :func:`run_worker` with the Ray Train runtime."""
    run_worker(loop_config, RayTrainRuntime())


def apply_hyperparameters(cfg: TrainingConfig, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Make the restored optimizer and schedule follow ``cfg``: a resumed run keeps the checkpoint's moments
    and position, but its learning rate, weight decay and momentum come from the config (PBT perturbs them
    between slices; for an unchanged config this changes nothing)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.optimizer.lr
        group["weight_decay"] = cfg.optimizer.weight_decay
        if "momentum" in group:
            group["momentum"] = cfg.optimizer.momentum
    scheduler.base_lrs = [cfg.optimizer.lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = cfg.optimizer.lr * factor(scheduler.last_epoch)


def run_worker(loop_config: dict[str, Any], runtime: WorkerRuntime) -> None:
    """The training loop, run by every rank.

    ``loop_config``: ``config`` (TrainingConfig as a dict), ``data_dir`` (prepared data), ``checkpoint_root``
    (where this run's checkpoints live; the loop resumes from the newest valid one there), optional
    ``resume_from`` (a checkpoint directory URI to continue from when the root holds none), ``mlflow``
    (``tracking_uri``, ``run_id``), ``log_params`` (log the config as MLflow params; default: when not
    resuming), ``warmup_steps_excluded`` (steps left out of steady-state throughput and step-time
    percentiles) and ``job_labels`` (``execution``, ``node``, ``attempt`` of the Flyte task, for the metrics'
    labels; see :mod:`training_core.telemetry`).
    """
    cfg = TrainingConfig.from_dict(loop_config["config"])
    rank, world_size, device = runtime.rank, runtime.world_size, runtime.device
    torch.set_num_threads(cfg.scaling.torch_threads_per_worker)
    seed_everything(cfg.loop.seed)
    autocast_dtype, use_scaler = resolve_precision(cfg.precision.mode, device)

    manifest = Manifest.load(loop_config["data_dir"])
    model = build_model(cfg.model.name, num_classes=manifest.num_classes, input_shape=manifest.input_shape)
    if cfg.model.sync_batchnorm and device.type == "cuda" and world_size > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = runtime.prepare_model(model)
    comm_timer = CommTimer()
    if hasattr(model, "register_comm_hook"):
        comm_timer.install(model)
    optimizer = build_optimizer(cfg.optimizer, model.parameters())
    steps_per_epoch = manifest.steps_per_epoch(
        world_size=world_size, batch_size=cfg.loop.batch_size, grad_accum_steps=cfg.loop.grad_accum_steps
    )
    total_steps = steps_per_epoch * cfg.loop.epochs
    if cfg.loop.max_steps:
        total_steps = min(total_steps, cfg.loop.max_steps)
    scheduler = build_scheduler(cfg.schedule, optimizer, total_steps=total_steps)
    end_epoch = cfg.loop.stop_at_epoch or cfg.loop.epochs
    scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
    normalize = Normalizer(manifest, device)
    train_stream = ShardStream(manifest, "train", rank=rank, world_size=world_size)
    val_stream = ShardStream(manifest, "val", rank=rank, world_size=world_size)

    mlflow_info = loop_config.get("mlflow") or {}
    telemetry = build_telemetry(
        cfg.observability,
        scaling=cfg.scaling,
        world_size=world_size,
        labels=JobLabels(**loop_config.get("job_labels", {}), rank=str(rank), model=cfg.model.name),
        system_sink=MlflowSink(tracking_uri=mlflow_info["tracking_uri"], run_id=mlflow_info["run_id"])
        if rank == 0 and mlflow_info
        else None,
    )
    finished = False
    # The telemetry threads stop, and the last push says whether training finished, however the loop ends.
    try:
        root = loop_config["checkpoint_root"]
        storage = ckpt.CheckpointStorage(root, storage_options=cfg.checkpoint.storage_options(root))
        checkpointer = ckpt.Checkpointer(
            storage,
            keep_last=cfg.checkpoint.keep_last,
            keep_best=cfg.checkpoint.keep_best,
            best_mode="max" if cfg.checkpoint.best_metric == "val_accuracy" else "min",
            async_save=cfg.checkpoint.async_save,
            max_consecutive_failures=cfg.checkpoint.max_consecutive_save_failures,
            observer=telemetry,
        )
        sink = build_sink(rank=rank, tracking_uri=mlflow_info.get("tracking_uri"), run_id=mlflow_info.get("run_id"))

        # Position: epoch index, steps already taken in it, and what the epoch's record has accumulated so far.
        start_epoch, start_step_in_epoch, global_step = 0, 0, 0
        history: list[dict[str, float]] = []
        step_log: list[dict[str, float]] = []
        best_metric: float | None = None
        resumed_from_steps: list[int] = []
        resume_timings: list[dict[str, float]] = []
        awaiting_first_step = False
        elapsed_before_s = 0.0  # the run's seconds before this resume: step_log's clock continues from there
        partial = {"loss": 0.0, "correct": 0.0, "samples": 0.0, "time_s": 0.0}
        loaded = ckpt.load_latest_valid(storage)
        is_restart = loaded is not None  # this run's own checkpoint: a worker restart or a task retry
        if loaded is None and loop_config.get("resume_from"):
            loaded = ckpt.load_directory(loop_config["resume_from"])
        if loaded is not None:
            ckpt.restore(loaded, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
            apply_hyperparameters(cfg, optimizer, scheduler)
            meta = loaded.meta
            start_epoch, start_step_in_epoch, global_step = meta.epoch, meta.step_in_epoch, meta.global_step
            history, step_log, best_metric = list(meta.history), list(meta.step_log), meta.best_metric
            partial = dict(meta.epoch_partial or partial)
            resumed_from_steps = [*meta.resumed_from_steps, global_step]
            resume_timings = [*meta.resume_timings, {"from_step": float(global_step), "restored_unix": time.time()}]
            awaiting_first_step = True
            if is_restart:  # a fine-tune from another run starts its own clock, cost and restart count
                elapsed_before_s = meta.elapsed_s
                telemetry.resumed(
                    meta.telemetry,
                    global_step=global_step,
                    elapsed_s=elapsed_before_s,
                    num_restarts=len(resumed_from_steps),
                )
            _restore_rng(rank, meta.rng, loaded.trainer.get("rng", {}))
            if rank == 0:
                log.warning(
                    "resumed from %s: epoch %d, step %d of it, global step %d",
                    loaded.uri,
                    start_epoch,
                    start_step_in_epoch,
                    global_step,
                )
        if start_epoch >= end_epoch:
            raise ValueError(
                f"loop.stop_at_epoch={cfg.loop.stop_at_epoch} (loop.epochs={cfg.loop.epochs}) is not past the "
                "checkpoint's "
                f"epoch {start_epoch}: there is nothing to train; raise loop.stop_at_epoch"
            )
        run_clock_start = time.monotonic() - elapsed_before_s
        if loop_config.get("log_params", loaded is None):
            sink.log_params(
                flatten(cfg.to_dict())
                | {"world_size": world_size, "steps_per_epoch": steps_per_epoch, "device": device.type}
            )
            sink.log_dict(cfg.to_dict(), "config.json")

        def save_checkpoint(
            *, epoch: int, step_in_epoch: int, metric: float | None, mlflow_model_uri: str = ""
        ) -> None:
            """Every rank calls this at the same steps (the RNG gather is a collective); rank 0 writes."""
            json_rng, torch_rng = _gather_rng_states(world_size)
            if rank != 0:
                return
            started = time.perf_counter()
            meta = ckpt.CheckpointMeta(
                model_name=cfg.model.name,
                classes=manifest.classes,
                input_shape=manifest.input_shape,
                mean=manifest.mean,
                std=manifest.std,
                epoch=epoch,
                step_in_epoch=step_in_epoch,
                global_step=global_step,
                config=cfg.to_dict(),
                best_metric=best_metric,
                metric=metric,
                history=history,
                step_log=step_log,
                rng=json_rng,
                resumed_from_steps=resumed_from_steps,
                resume_timings=resume_timings,
                epoch_partial=dict(partial),
                mlflow_run_id=mlflow_info.get("run_id", ""),
                mlflow_model_uri=mlflow_model_uri,
                elapsed_s=time.monotonic() - run_clock_start,
                telemetry=telemetry.snapshot(),
            )
            state = checkpointer.stage(
                model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, meta=meta, torch_rng=torch_rng
            )
            checkpointer.save(global_step, state, metric=metric)
            sink.log_metrics({"checkpoint_stall_s": time.perf_counter() - started}, step=global_step)

        warmup_excluded = loop_config.get("warmup_steps_excluded", min(5, total_steps // 4))
        global_batch = cfg.loop.batch_size * cfg.loop.grad_accum_steps * world_size
        interval = cfg.checkpoint.interval_steps
        steady_time_s, steady_steps = 0.0, 0
        # Steady-state step times and their all-reduce seconds, for percentiles and the communication share.
        steady_step_times_s: list[float] = []
        steady_comm_s = 0.0
        for epoch in range(start_epoch, end_epoch):
            if global_step >= total_steps:
                break
            first_step = start_step_in_epoch if epoch == start_epoch else 0
            steps_this_epoch = min(steps_per_epoch, first_step + total_steps - global_step)
            batches = train_stream.train_batches(
                epoch=epoch,
                seed=cfg.loop.seed,
                batch_size=cfg.loop.batch_size,
                num_batches=steps_this_epoch * cfg.loop.grad_accum_steps,
                start_batch=first_step * cfg.loop.grad_accum_steps,
            )
            if epoch != start_epoch:
                partial = {"loss": 0.0, "correct": 0.0, "samples": 0.0, "time_s": 0.0}
            window = {
                "loss": 0.0,
                "correct": 0.0,
                "samples": 0.0,
                "time_s": 0.0,
                "data_s": 0.0,
                "comm_s": 0.0,
                "steps": 0,
            }
            # A step's wall time runs from the previous step's end, so logging and all-reduces of metrics count
            # against throughput; only the epoch boundary (validation, checkpoint) is left out.
            last_step_end = time.perf_counter()
            for step_in_epoch in range(first_step, steps_this_epoch):
                step_start = time.perf_counter()
                micro_batches = [normalize(*next(batches)) for _ in range(cfg.loop.grad_accum_steps)]
                data_wait_s = time.perf_counter() - step_start
                try:
                    result = train_step(
                        model=model,
                        optimizer=optimizer,
                        scaler=scaler,
                        micro_batches=micro_batches,
                        autocast_dtype=autocast_dtype,
                        max_grad_norm=cfg.optimizer.max_grad_norm,
                    )
                except torch.cuda.OutOfMemoryError:
                    telemetry.gpu_oom()
                    raise
                lr = optimizer.param_groups[0]["lr"]
                scheduler.step()
                global_step += 1
                if awaiting_first_step:
                    resume_timings[-1]["first_step_unix"] = time.time()
                    awaiting_first_step = False
                is_epoch_end = step_in_epoch == steps_this_epoch - 1
                save_now = bool(interval) and global_step % interval == 0 and not is_epoch_end
                # Reading the loss synchronises with the device; on GPU that happens once per log window only. An
                # epoch's last step and a checkpoint step close the window, so every step is in one logged record
                # and a checkpoint never holds half a window.
                is_log_step = global_step % cfg.loop.log_interval_steps == 0 or is_epoch_end or save_now
                window["loss"] += result.loss
                window["correct"] += result.num_correct
                window["samples"] += result.num_samples
                if device.type == "cuda" and is_log_step:
                    torch.cuda.synchronize()  # queued kernels belong to this window's time, not the next one's
                step_end = time.perf_counter()
                step_time_s, last_step_end = step_end - last_step_end, step_end
                window["time_s"] += step_time_s
                window["data_s"] += data_wait_s
                window["steps"] += 1
                comm_s = comm_timer.take_step_seconds()
                window["comm_s"] += comm_s
                telemetry.step(
                    duration_s=step_time_s, num_samples=result.num_samples, data_wait_s=data_wait_s, comm_s=comm_s
                )
                if global_step > warmup_excluded:
                    steady_time_s += step_time_s
                    steady_steps += 1
                    steady_comm_s += comm_s
                    if len(steady_step_times_s) < MAX_STEP_TIMES_KEPT:
                        steady_step_times_s.append(step_time_s)
                if is_log_step:
                    loss_sum, correct, samples = _all_reduce_sum(
                        [float(window["loss"]), float(window["correct"]), float(window["samples"])], device
                    )
                    steps = window["steps"]
                    record = {
                        "train_loss": loss_sum / (steps * world_size),
                        "train_accuracy": correct / samples,
                        "lr": lr,
                        "grad_norm": float(result.grad_norm),
                        "samples_per_s": samples / window["time_s"] if window["time_s"] else 0.0,
                        "step_time_s": window["time_s"] / steps,
                        "data_wait_s": window["data_s"] / steps,
                        "allreduce_fraction": window["comm_s"] / window["time_s"] if window["time_s"] else 0.0,
                        "epoch": float(epoch),
                    }
                    partial["loss"] += loss_sum
                    partial["correct"] += correct
                    partial["samples"] += samples
                    partial["time_s"] += window["time_s"]
                    step_log.append(
                        {"step": float(global_step), **record, "elapsed_s": time.monotonic() - run_clock_start}
                    )
                    sink.log_metrics(record, step=global_step)
                    telemetry.window(record, global_step=global_step)
                    window = {
                        "loss": 0.0,
                        "correct": 0.0,
                        "samples": 0.0,
                        "time_s": 0.0,
                        "data_s": 0.0,
                        "comm_s": 0.0,
                        "steps": 0,
                    }
                if save_now:
                    save_checkpoint(epoch=epoch, step_in_epoch=step_in_epoch + 1, metric=None)
                    last_step_end = time.perf_counter()  # the stall is measured on its own, not as step time

            _broadcast_buffers_from_rank0(model)
            val = evaluate(
                model,
                val_stream.eval_batches(batch_size=256),
                normalize=normalize,
                num_classes=manifest.num_classes,
                autocast_dtype=autocast_dtype,
                all_reduce=True,
            )
            epoch_record = {
                "epoch": float(epoch + 1),
                "global_step": float(global_step),
                "train_loss": partial["loss"] / max(1, steps_this_epoch * world_size),
                "train_accuracy": partial["correct"] / max(1, partial["samples"]),
                "val_loss": val.loss,
                "val_accuracy": val.accuracy,
                "lr": optimizer.param_groups[0]["lr"],
                "samples_per_s": partial["samples"] / partial["time_s"] if partial["time_s"] else 0.0,
                "steady_samples_per_s": global_batch * steady_steps / steady_time_s if steady_time_s else 0.0,
                "steady_steps": float(steady_steps),
                "step_time_p50_s": _percentile(steady_step_times_s, 50),
                "step_time_p95_s": _percentile(steady_step_times_s, 95),
                "allreduce_fraction": steady_comm_s / steady_time_s if steady_time_s else 0.0,
            }
            history.append(epoch_record)
            telemetry.validation(loss=val.loss, accuracy=val.accuracy)
            sink.log_metrics({k: v for k, v in epoch_record.items() if k.startswith("val_")}, step=global_step)
            metric = epoch_record[cfg.checkpoint.best_metric]
            if best_metric is None or (
                metric > best_metric if cfg.checkpoint.best_metric == "val_accuracy" else metric < best_metric
            ):
                best_metric = metric
            partial = {"loss": 0.0, "correct": 0.0, "samples": 0.0, "time_s": 0.0}
            done = global_step >= total_steps or epoch == end_epoch - 1
            if done:
                # A slice that stops before the full budget (a tuning rung) logs no model: only a trial that
                # finishes can be registered, and logging one costs seconds per slice.
                full_budget = global_step >= total_steps or epoch == cfg.loop.epochs - 1
                model_uri = (
                    _log_model_to_mlflow(model, manifest, mlflow_info)
                    if rank == 0 and mlflow_info and full_budget
                    else ""
                )
                save_checkpoint(epoch=epoch + 1, step_in_epoch=0, metric=metric, mlflow_model_uri=model_uri)
            elif cfg.checkpoint.at_epoch_end or (interval and global_step % interval == 0):
                save_checkpoint(epoch=epoch + 1, step_in_epoch=0, metric=metric)
            if done and rank == 0:
                checkpointer.wait()  # the final checkpoint is the task's output: it must be on storage
            runtime.report(epoch_record)
            if done:
                break
        if rank == 0:
            checkpointer.wait()
        sink.close()
        finished = True
    finally:
        telemetry.close(finished=finished)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _log_model_to_mlflow(model: nn.Module, manifest: Manifest, mlflow_info: dict[str, str]) -> str:
    """Log the trained model with its input/output signature; returns its ``models:/`` URI."""
    import mlflow
    import torchvision
    from mlflow.models import infer_signature

    bare = copy.deepcopy(getattr(model, "module", model)).cpu().eval()
    example = np.zeros((2, *manifest.input_shape), dtype=np.float32)
    with torch.no_grad():
        output = bare(torch.from_numpy(example)).numpy()
    mlflow.set_tracking_uri(mlflow_info["tracking_uri"])
    # Pinned requirements: skips MLflow's slow dependency inference, which imports the model in a subprocess.
    requirements = [
        f"torch=={torch.__version__.split('+')[0]}",
        f"torchvision=={torchvision.__version__.split('+')[0]}",
    ]
    # The driver that created the run owns its final status; re-entering it here only attaches the model.
    with mlflow.start_run(run_id=mlflow_info["run_id"]):
        info = mlflow.pytorch.log_model(
            bare,
            name="model",
            signature=infer_signature(example, output),
            input_example=example,
            pip_requirements=requirements,
        )
    return info.model_uri
