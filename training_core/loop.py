"""The training loop that runs on every rank: Ray Train workers, or the plain ``torch.distributed`` launcher.

:func:`run_worker` reads top to bottom: set up (:meth:`Trainer.setup`), resume (:meth:`Trainer.resume`),
train epoch by epoch (:meth:`Trainer.train`), finish. ``train_step`` (one optimizer step over
``grad_accum_steps`` micro-batches) is the piece tests check alone. The sums behind each record live in
:class:`StepMeter`, the run's position and history in :class:`RunState` (what a checkpoint's meta holds), and
the save policy in :meth:`Checkpointer.should_save <training_core.checkpoint.Checkpointer.should_save>`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NoReturn, Sequence

import numpy as np
import torch
from torch import nn

from training_core import batch_size, nccl_network, preemption, sharding
from training_core import checkpoint as ckpt
from training_core.config import AUTO, METRIC_DIRECTIONS, TrainingConfig, is_better
from training_core.data import Manifest, ShardStream
from training_core.distributed import (
    CommTimer,
    RayTrainRuntime,
    WorkerRuntime,
    all_reduce_sum,
    broadcast_buffers_from_rank0,
    ddp_options,
    probe_allreduce,
)
from training_core.evaluation import evaluate
from training_core.failures import DIVERGED_METRIC, TrainingDiverged, WorkerPreempted, is_collective_timeout
from training_core.loader import check_intervals, remaining_after, steps_left
from training_core.metrics import MetricSink, MlflowSink, build_sink, flatten
from training_core.optim import apply_hyperparameters, build_optimizer, build_scheduler
from training_core.records import EpochRecord, StepLog, StepRecord, WorkerArgs
from training_core.redact import redact
from training_core.rng import gather_rng_states, restore_rng, seed_everything
from training_core.sharding import full_tensor
from training_core.telemetry import JobLabels, build_telemetry
from training_core.workloads import LossOutput, resolve_workload
from training_core.workloads.image import classification_loss

log = logging.getLogger("training_core")

# Per-step times kept for the step-time percentiles of one run (bounded: 8 bytes each).
MAX_STEP_TIMES_KEPT = 100_000
# A workload's epoch figures in a checkpoint's ``epoch_partial``, beside the loop's own sums.
EPOCH_FIGURE_PREFIX = "sum."


def resolve_precision(mode: str, device: torch.device) -> tuple[torch.dtype | None, bool]:
    """Autocast dtype (None = fp32) and whether to use a GradScaler, for ``precision.mode`` on ``device``; the same
    under both strategies (FSDP gathers its parameters in the autocast dtype and reduces gradients in fp32). The
    GradScaler works on FSDP's sharded gradients: DTensor all-reduces its overflow flag, so every rank skips the same
    steps (tests/gpu/test_fsdp_precision.py)."""
    if device.type != "cuda":
        if mode == "fp16":
            log.warning("precision.mode='fp16' needs a GPU; training in fp32 on %s", device)
        return (torch.bfloat16, False) if mode == "bf16" else (None, False)
    if mode == "auto":
        mode = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return {"fp32": (None, False), "bf16": (torch.bfloat16, False), "fp16": (torch.float16, True)}[mode]


@dataclass
class StepResult:
    loss: torch.Tensor
    """Mean loss over the step's micro-batches (detached)."""
    sums: dict[str, torch.Tensor]
    """The workload's additive figures of the step's batches (see :class:`~training_core.workloads.LossOutput`)."""
    num_samples: int
    num_tokens: int
    """Tokens in the step's batches (0 for a workload without tokens)."""
    grad_norm: torch.Tensor
    """Global gradient L2 norm before clipping."""
    nonfinite: torch.Tensor
    """0-dim bool on the device: the loss or the gradient norm was NaN or infinite (see :func:`train_step`)."""


def train_step(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    micro_batches: Sequence[Any],
    autocast_dtype: torch.dtype | None,
    max_grad_norm: float,
    skip_nonfinite: bool = False,
    loss_fn: Callable[[nn.Module, Any], LossOutput] = classification_loss,
    sync_gradients: bool = True,
) -> StepResult:
    """One optimizer step over equally sized micro-batches, equal to one step on their concatenation.

    ``loss_fn`` is the workload's :meth:`~training_core.workloads.Workload.loss` (default: cross-entropy over
    ``(inputs, targets)`` pairs).

    Gradients of the micro-batches are accumulated (each loss scaled by ``1/len(micro_batches)``); a DDP
    model all-reduces, an FSDP model reduce-scatters, only on the last one. ``max_grad_norm <= 0`` disables
    clipping; under FSDP it clips by the norm of all shards together. Without ``sync_gradients`` (local SGD)
    no micro-batch syncs: the step uses this rank's gradients alone.
    The result flags a step whose loss or gradient norm is not finite, on the device (nothing waits for it);
    under a GradScaler (fp16) overflowing gradients are routine (the scaler skips those steps and lowers its
    scale), so only the loss counts there. ``skip_nonfinite`` leaves the model (weights and buffers) and the
    optimizer as they were when the step is flagged.
    """
    saved_buffers = _Saved(list(model.buffers())) if skip_nonfinite else None
    num_micro = len(micro_batches)
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), device=device)
    sums: dict[str, torch.Tensor] = {}
    num_samples = num_tokens = 0
    for index, batch in enumerate(micro_batches):
        is_last = index == num_micro - 1
        with contextlib.nullcontext() if is_last and sync_gradients else _no_gradient_sync(model):
            with torch.autocast(
                device_type=device.type,
                dtype=autocast_dtype or torch.float32,
                enabled=autocast_dtype is not None,
            ):
                output = loss_fn(model, batch)
            scaler.scale(output.loss / num_micro).backward()
        loss_sum += output.loss.detach().float()
        for name, value in output.sums.items():
            sums[name] = sums[name] + value.detach() if name in sums else value.detach()
        num_samples += output.num_samples
        num_tokens += output.num_tokens
    scaler.unscale_(optimizer)
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
    # Under FSDP the norm of the sharded gradients is a partial DTensor: its full value is the global norm.
    loss, grad_norm = loss_sum / num_micro, full_tensor(grad_norm).detach()
    finite = torch.isfinite(loss) if scaler.is_enabled() else torch.isfinite(loss) & torch.isfinite(grad_norm)
    # Under DDP every rank flags the same steps: a non-finite loss makes non-finite gradients, and the gradient
    # all-reduce spreads those to every rank's norm. So ranks skip alike and replicas stay identical.
    if saved_buffers is not None and not scaler.is_enabled():
        _step_if(optimizer, finite, saved_buffers)
    else:
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss=loss, sums=sums, num_samples=num_samples, num_tokens=num_tokens, grad_norm=grad_norm, nonfinite=~finite
    )


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate this micro-batch's gradients locally: DDP's ``no_sync``, FSDP2's gradient sync switched off (the
    last micro-batch reduce-scatters the sum). A model of one process has nothing to sync."""
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` (a tensor, or a tuple, list or dict of them) cut along its first dimension into ``parts`` equal
    micro-batches; itself when ``parts`` is 1."""
    if parts == 1:
        return [batch]
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    pieces = [leaf.tensor_split(parts) if isinstance(leaf, torch.Tensor) else [leaf] * parts for leaf in leaves]
    return [torch.utils._pytree.tree_unflatten([piece[i] for piece in pieces], spec) for i in range(parts)]


class _Saved:
    """Copies of tensors taken now, put back later wherever a 0-dim bool tensor says so, on the device."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.copies = [t.detach().clone() for t in tensors]

    @torch.no_grad()
    def keep_if(self, keep: torch.Tensor) -> None:
        """Each tensor keeps its current value where ``keep`` is true, else gets its copy back."""
        for tensor, copy in zip(self.tensors, self.copies):
            tensor.copy_(torch.where(keep, tensor, copy))


def _step_if(optimizer: torch.optim.Optimizer, finite: torch.Tensor, saved_buffers: _Saved) -> None:
    """``optimizer.step()`` when ``finite``, else no step and the buffers (BatchNorm statistics) put back."""
    if finite.device.type == "cuda":
        # Reading the flag would make the host wait for the step's kernels every step. The update is taken
        # and then masked on the device instead, at the cost of a copy of the weights and optimizer state.
        masked_step(optimizer, finite)
        saved_buffers.keep_if(finite)
    elif finite.item():  # on CPU the value is already computed: reading it costs nothing, the skip is exact
        optimizer.step()
    else:
        saved_buffers.keep_if(finite)


def masked_step(optimizer: torch.optim.Optimizer, keep: torch.Tensor) -> None:
    """``optimizer.step()`` that stands only where ``keep`` (a 0-dim bool tensor) is true, decided on the device.

    Where it is false the parameters and their optimizer state are as before; state the step created (a first
    step's moments or momentum) becomes zeros, which is how Adam starts and from which SGD's momentum continues
    as from a fresh start. State kept off the parameters' device (Adam's step count on the CPU for a GPU model)
    is not masked: its bias correction then counts the skipped step."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    saved_params = _Saved(params)
    saved_state = [
        {key: value.detach().clone() for key, value in optimizer.state[p].items() if _on(value, p.device)}
        for p in params
    ]
    optimizer.step()
    saved_params.keep_if(keep)
    with torch.no_grad():
        for p, before in zip(params, saved_state):
            for key, value in optimizer.state[p].items():
                if _on(value, p.device):
                    value.copy_(torch.where(keep, value, before.get(key, torch.zeros_like(value))))


def _on(value: Any, device: torch.device) -> bool:
    return isinstance(value, torch.Tensor) and value.device == device


@dataclass
class Sums:
    """Additive figures of a span of steps. Loss, correct and samples of an open window stay on the device
    (tensors) until the window closes, so a step never waits for the device."""

    loss: Any = 0.0
    """Sum of the steps' mean losses, finite steps only: this rank's in a window; in an epoch, each step's mean over
    the ranks."""
    nonfinite: Any = 0.0
    """Steps whose loss or gradient norm was not finite: this rank's in a window; in an epoch, the steps' mean over
    the ranks (the ranks flag the same steps)."""
    samples: Any = 0.0
    tokens: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    """The workload's sums (:attr:`StepResult.sums`), by name."""
    time_s: float = 0.0
    data_s: float = 0.0
    comm_s: float = 0.0
    steps: int = 0


@dataclass
class NonFiniteSteps:
    """A closed window's steps whose loss or gradient norm was not finite."""

    num_steps: int
    """How many: the same on every rank (a reduced figure)."""
    first_step: int | None
    """Global step of this rank's first one; None when only other ranks had one."""
    loss: float
    """This rank's loss at ``first_step``."""
    grad_norm: float


class NonFiniteTally:
    """This rank's non-finite steps of the open window, counted on the device (no step waits for it): how many,
    how many steps came before the first, and the first one's loss and gradient norm; and the window's last
    finite gradient norm (what its record reports)."""

    def __init__(self, device: torch.device) -> None:
        self.count = torch.zeros((), dtype=torch.long, device=device)
        self.steps_before_first = torch.zeros((), dtype=torch.long, device=device)
        self.first = torch.full((2,), math.nan, dtype=torch.float64, device=device)
        self.last_finite_grad_norm = torch.full((), math.nan, dtype=torch.float64, device=device)

    def add(self, result: StepResult) -> None:
        is_first = result.nonfinite & (self.count == 0)
        values = torch.stack([result.loss.double(), result.grad_norm.double()])
        self.first = torch.where(is_first, values, self.first)
        self.count += result.nonfinite
        self.steps_before_first += self.count == 0
        self.last_finite_grad_norm = torch.where(result.nonfinite, self.last_finite_grad_norm, values[1])

    def read(self, *, num_steps: int, window_end_step: int, window_steps: int) -> NonFiniteSteps:
        """The window's figures, once its ``num_steps`` over all ranks are known (a host read: window end only)."""
        if not num_steps:
            return NonFiniteSteps(num_steps=0, first_step=None, loss=math.nan, grad_norm=math.nan)
        before, (loss, grad_norm) = int(self.steps_before_first), self.first.tolist()
        first_step = window_end_step - window_steps + before + 1 if int(self.count) else None
        return NonFiniteSteps(num_steps=num_steps, first_step=first_step, loss=loss, grad_norm=grad_norm)


class StepMeter:
    """The sums behind every record: the open log window, the epoch so far (across a resume: it is saved in
    checkpoints) and the steady state (this run's steps after warm-up)."""

    def __init__(
        self,
        *,
        world_size: int,
        device: torch.device,
        global_batch: int,
        warmup_steps_excluded: int,
        metrics: Callable[[Mapping[str, float]], dict[str, float]],
    ):
        self.world_size, self.device, self.metrics = world_size, device, metrics
        self.global_batch, self.warmup_steps_excluded = global_batch, warmup_steps_excluded
        self.window, self.epoch = Sums(), Sums()
        self.tally = NonFiniteTally(device)
        self.steady, self.steady_step_times_s = Sums(), []

    def step(self, result: StepResult, *, global_step: int, step_time_s: float, data_wait_s: float, comm_s: float):
        w = self.window
        w.loss, w.nonfinite, w.samples, w.tokens = (
            w.loss + torch.where(result.nonfinite, 0.0, result.loss),
            w.nonfinite + result.nonfinite,
            w.samples + result.num_samples,
            w.tokens + result.num_tokens,
        )
        for name, value in result.sums.items():
            w.figures[name] = w.figures.get(name, 0.0) + value
        self.tally.add(result)
        w.time_s, w.data_s, w.comm_s, w.steps = (
            w.time_s + step_time_s,
            w.data_s + data_wait_s,
            w.comm_s + comm_s,
            w.steps + 1,
        )
        if global_step > self.warmup_steps_excluded:
            s = self.steady
            s.time_s, s.comm_s, s.steps = s.time_s + step_time_s, s.comm_s + comm_s, s.steps + 1
            if len(self.steady_step_times_s) < MAX_STEP_TIMES_KEPT:
                self.steady_step_times_s.append(step_time_s)

    def close_window(
        self, *, global_step: int, epoch: int, lr: float, elapsed_s: float
    ) -> tuple[StepRecord, NonFiniteSteps]:
        """The window's record over all ranks, and its non-finite steps (a collective: every rank calls it at the
        same steps, and all read the same count). Loss and gradient norm are over its finite steps (NaN if none)."""
        w, e = self.window, self.epoch
        names = sorted(w.figures)
        loss_sum, nonfinite, samples, tokens, *values = all_reduce_sum(
            [float(w.loss), float(w.nonfinite), float(w.samples), w.tokens, *(float(w.figures[n]) for n in names)],
            self.device,
        )
        figures = dict(zip(names, values))
        # The epoch keeps per-step means over the ranks (ranks train equal shares of each step's global batch): an
        # elastic run that resumes an epoch on another number of workers weighs every step alike, before and after.
        e.loss, e.nonfinite, e.samples, e.tokens, e.time_s = (
            e.loss + loss_sum / self.world_size,
            e.nonfinite + nonfinite / self.world_size,
            e.samples + samples,
            e.tokens + tokens,
            e.time_s + w.time_s,
        )
        for name, value in figures.items():
            e.figures[name] = e.figures.get(name, 0.0) + value
        # Ranks flag the same steps (see train_step), so the mean over ranks is the window's count; rounded up,
        # a step flagged on one rank only still counts.
        found = self.tally.read(
            num_steps=math.ceil(nonfinite / self.world_size), window_end_step=global_step, window_steps=w.steps
        )
        grad_norm = float(self.tally.last_finite_grad_norm)
        self.window, self.tally = Sums(), NonFiniteTally(self.device)
        num_finite = w.steps * self.world_size - nonfinite
        record = StepRecord(
            step=global_step,
            epoch=epoch,
            train_loss=loss_sum / num_finite if num_finite > 0 else math.nan,
            train_accuracy=self.metrics(figures).get("accuracy", math.nan),
            lr=lr,
            grad_norm=grad_norm,
            samples_per_s=samples / w.time_s if w.time_s else 0.0,
            tokens_per_s=tokens / w.time_s if w.time_s else 0.0,
            step_time_s=w.time_s / w.steps,
            data_wait_s=w.data_s / w.steps,
            allreduce_fraction=w.comm_s / w.time_s if w.time_s else 0.0,
            elapsed_s=elapsed_s,
            num_steps=w.steps,
        )
        return record, found

    def close_epoch(
        self, *, epoch: int, global_step: int, steps_in_epoch: int, val: dict[str, float], lr: float
    ) -> EpochRecord:
        """The finished epoch's record (epoch sums already reduced), and a fresh epoch."""
        e, s = self.epoch, self.steady
        self.epoch = Sums()
        return EpochRecord(
            epoch=epoch + 1,
            global_step=global_step,
            train_loss=e.loss / max(1, steps_in_epoch - e.nonfinite),
            train_accuracy=self.metrics(e.figures).get("accuracy", math.nan),
            val_loss=val["loss"],
            val_accuracy=val.get("accuracy", math.nan),
            val_perplexity=val.get("perplexity", math.nan),
            lr=lr,
            samples_per_s=e.samples / e.time_s if e.time_s else 0.0,
            tokens_per_s=e.tokens / e.time_s if e.time_s else 0.0,
            steady_samples_per_s=self.global_batch * s.steps / s.time_s if s.time_s else 0.0,
            steady_steps=s.steps,
            step_time_p50_s=_percentile(self.steady_step_times_s, 50),
            step_time_p95_s=_percentile(self.steady_step_times_s, 95),
            allreduce_fraction=s.comm_s / s.time_s if s.time_s else 0.0,
        )

    def epoch_sums(self) -> dict[str, float]:
        """The epoch's reduced sums, for a checkpoint (a resume mid-epoch reports the same epoch record): the sum of
        the steps' mean losses over the ranks and the count of non-finite steps, samples and time, and the
        workload's figures as ``sum.<name>``."""
        e = self.epoch
        saved = {
            "step_loss": float(e.loss),
            "nonfinite_steps": float(e.nonfinite),
            "samples": e.samples,
            "tokens": e.tokens,
            "time_s": e.time_s,
        }
        return saved | {f"{EPOCH_FIGURE_PREFIX}{name}": value for name, value in e.figures.items()}

    def restore_epoch_sums(self, saved: dict[str, float]) -> None:
        figures = {k[len(EPOCH_FIGURE_PREFIX) :]: v for k, v in saved.items() if k.startswith(EPOCH_FIGURE_PREFIX)}
        if "correct" in saved:  # written before workloads: image classification's count
            figures = {"correct": saved["correct"], "samples": saved.get("samples", 0.0)}
        if "step_loss" in saved:
            loss, nonfinite = saved["step_loss"], saved.get("nonfinite_steps", 0.0)
        else:  # written before elastic runs: sums over every rank's steps, of a run on this many workers
            loss, nonfinite = saved.get("loss", 0.0) / self.world_size, saved.get("nonfinite", 0.0) / self.world_size
        self.epoch = Sums(
            loss=loss,
            nonfinite=nonfinite,
            samples=saved.get("samples", 0.0),
            tokens=saved.get("tokens", 0.0),
            time_s=saved.get("time_s", 0.0),
            figures=figures,
        )


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


@dataclass
class RunState:
    """Where the run is and what it recorded: everything a resume restores besides the stateful objects."""

    epoch: int = 0
    """Epoch the run is in (0-based)."""
    step_in_epoch: int = 0
    """Optimizer steps of ``epoch`` already taken."""
    global_step: int = 0
    best_metric: float | None = None
    history: list[EpochRecord] = field(default_factory=list)
    step_log: StepLog = field(default_factory=lambda: StepLog(capacity=ckpt.STEP_LOG_CAPACITY))
    resumed_from_steps: list[int] = field(default_factory=list)
    resume_timings: list[dict[str, float]] = field(default_factory=list)
    clock_start: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` at which the run would have started had it never stopped (its clock continues)."""
    data_remaining: list[tuple[int, int]] | None = None
    """Positions of ``epoch``'s sample order left when this attempt resumed into it (the checkpoint's), or None:
    the epoch's first ``step_in_epoch`` steps were taken on this number of workers (see :mod:`training_core.loader`)."""

    @classmethod
    def resumed(cls, meta: ckpt.CheckpointMeta, *, same_run: bool) -> RunState:
        """The state a checkpoint saved, plus this resume. A fine-tune from another run (``same_run`` false)
        starts its own clock."""
        return cls(
            epoch=meta.epoch,
            step_in_epoch=meta.step_in_epoch,
            global_step=meta.global_step,
            data_remaining=[(a, b) for a, b in meta.data_remaining]
            if meta.data_remaining or meta.data_exhausted
            else None,
            best_metric=meta.best_metric,
            history=list(meta.history),
            step_log=StepLog.from_list(meta.step_log, capacity=ckpt.STEP_LOG_CAPACITY),
            resumed_from_steps=[*meta.resumed_from_steps, meta.global_step],
            resume_timings=[
                *meta.resume_timings,
                {
                    "from_step": float(meta.global_step),
                    "restored_unix": time.time(),
                    "preempted": float(meta.preempted),  # 1: the run stopped at this step, nothing recomputed
                },
            ],
            clock_start=time.monotonic() - (meta.elapsed_s if same_run else 0.0),
        )

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.clock_start


class Trainer:
    """One rank's training run: the stateful objects, the streams, and where results go.

    Every rank runs the same calls in the same order (collectives inside); rank 0 alone writes checkpoints,
    logs to the metric sink and logs the model.
    """

    def __init__(self, args: WorkerArgs, runtime: WorkerRuntime) -> None:
        self.args, self.cfg, self.runtime = args, args.config, runtime
        self.rank, self.world_size, self.device = runtime.rank, runtime.world_size, runtime.device
        self.num_nonfinite_steps = 0
        """Steps of this run attempt whose loss or gradient norm was not finite (``loop.max_nonfinite_steps``)."""

    def setup(self) -> None:
        """Build the model, optimizer, schedule and streams from the config and the prepared data."""
        cfg, device = self.cfg, self.device
        torch.set_num_threads(cfg.scaling.torch_threads_per_worker)
        seed_everything(cfg.loop.seed)
        self.sharded = cfg.scaling.strategy == "fsdp"
        if self.sharded and device.type == "cpu":
            sharding.return_freed_host_memory()
        self.autocast_dtype, use_scaler = resolve_precision(cfg.precision.mode, device)
        self.manifest = manifest = Manifest.load(self.args.data_dir)
        self.workload = resolve_workload(cfg.workload)
        model = self.workload.build_model(cfg, manifest)
        self.num_parameters = sum(p.numel() for p in model.parameters())
        if cfg.model.sync_batchnorm and device.type == "cuda" and self.world_size > 1:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.model = self.hold_model(model)
        self.comm_timer = CommTimer()
        if hasattr(self.model, "register_comm_hook"):
            self.comm_timer.install(self.model)
        self.optimizer = build_optimizer(cfg.optimizer, self.model.parameters())
        if cfg.loop.batch_size == AUTO:
            self.cfg = cfg = self.plan_batch(cfg)
        elif cfg.scaling.elastic and self.world_size != cfg.scaling.num_workers:
            self.cfg = cfg = self.keep_global_batch(cfg)
        self.oom_split = 1
        """Each loaded batch is split into this many micro-batches: doubled by each out-of-memory step retried under
        ``loop.oom_policy='reduce'``, so the data order and the global batch stay as they were."""
        self.steps_per_epoch = manifest.steps_per_epoch(
            world_size=self.world_size, batch_size=cfg.loop.batch_size, grad_accum_steps=cfg.loop.grad_accum_steps
        )
        self.total_steps = self.steps_per_epoch * cfg.loop.epochs
        if cfg.loop.max_steps:
            self.total_steps = min(self.total_steps, cfg.loop.max_steps)
        self.end_epoch = cfg.loop.stop_at_epoch or cfg.loop.epochs
        self.scheduler = build_scheduler(cfg.schedule, self.optimizer, total_steps=self.total_steps)
        self.preemption_armed = cfg.checkpoint.preemption_grace_s > 0 and preemption.arm(
            getattr(self.runtime, "run_on_main_thread", None)
        )
        self.scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
        self.local_sgd = cfg.sync.mode == "local_sgd" and self.world_size > 1
        """Workers step on their own gradients past the warm-up (``sync.mode``); one worker has nothing to sync."""
        self.to_device = self.workload.to_device(manifest, device)
        if self.channels_last:
            self.to_device = sharding.channels_last_inputs(self.to_device)
        self.train_stream = ShardStream(manifest, "train", rank=self.rank, world_size=self.world_size, data=cfg.data)
        self.val_stream = ShardStream(manifest, "val", rank=self.rank, world_size=self.world_size, data=cfg.data)
        self.epoch_base: tuple[list[tuple[int, int]], int] = ([(0, manifest.splits["train"].num_samples)], 0)
        """What this attempt trains of the current epoch: the positions left at its start, and the epoch's step
        there; a checkpoint records what is left of them."""
        warmup = self.args.warmup_steps_excluded
        self.meter = StepMeter(
            world_size=self.world_size,
            device=device,
            global_batch=cfg.loop.batch_size * cfg.loop.grad_accum_steps * self.world_size,
            warmup_steps_excluded=min(5, self.total_steps // 4) if warmup is None else warmup,
            metrics=self.workload.metrics,
        )
        self.allreduce_probe = probe_allreduce(device, self.world_size)
        self.nccl_network = self.check_nccl_network()
        mlflow = self.args.mlflow
        self.telemetry = build_telemetry(
            cfg.observability,
            scaling=cfg.scaling,
            world_size=self.world_size,
            labels=JobLabels(**self.args.job_labels, rank=str(self.rank), model=cfg.model.name),
            system_sink=MlflowSink(tracking_uri=mlflow.tracking_uri, run_id=mlflow.run_id)
            if self.rank == 0 and mlflow
            else None,
        )
        if self.allreduce_probe is not None:
            self.telemetry.allreduce_probe(
                bus_bandwidth_bytes_per_s=self.allreduce_probe.bus_bandwidth_bytes_per_s,
                latency_s=self.allreduce_probe.latency_s,
            )

    def hold_model(self, model: nn.Module) -> nn.Module:
        """How this worker holds the model (``scaling.strategy``, ``model.*``): channels-last on a GPU, activation
        checkpointing and compilation of its blocks, then FSDP shards over the workers or a DDP replica."""
        cfg, device = self.cfg, self.device
        self.channels_last = cfg.model.channels_last and device.type == "cuda" and sharding.has_conv2d(model)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        blocks = sharding.model_blocks(model, self.workload)
        sharding.apply_activation_checkpointing(
            blocks, mode=cfg.model.activation_checkpointing, every_k=cfg.model.activation_checkpointing_every_k
        )
        if cfg.model.compile:  # in place, block by block under FSDP: parameter names and DDP's hooks stay as they are
            for module in blocks if self.sharded and blocks else [model]:
                module.compile()
        self.checkpoint_group = None
        """Sharded checkpoints' own (gloo) process group: their writes run collectives in the background."""
        if self.sharded:
            self.checkpoint_group = torch.distributed.new_group(backend="gloo")
            return sharding.shard_model(
                model,
                blocks,
                device=device,
                param_dtype=self.autocast_dtype,
                cpu_offload=cfg.scaling.fsdp_cpu_offload,
            )
        if self.world_size == 1:
            return self.runtime.prepare_model(model)
        return self.runtime.prepare_model(model, ddp_options(cfg.scaling))

    def plan_batch(self, cfg: TrainingConfig) -> TrainingConfig:
        """``cfg`` with ``loop.batch_size: auto`` resolved: the largest micro-batch that fits the memory budget and
        divides this worker's share of ``loop.global_batch_size``, the smallest over the ranks (a collective), and
        the accumulation that keeps the global batch."""
        per_worker = cfg.loop.global_batch_size // self.world_size
        per_rank = self.manifest.splits["train"].num_samples // self.world_size
        if per_rank < per_worker:
            raise ValueError(
                f"loop.global_batch_size={cfg.loop.global_batch_size} is too large: with {self.world_size} worker(s) "
                f"each has {per_rank} training sample(s), fewer than its {per_worker} of a global batch; lower "
                "loop.global_batch_size or scaling.num_workers"
            )
        if per_worker == 1:  # the only micro-batch there is; measuring needs two of this rank's samples
            return dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, batch_size=1, grad_accum_steps=1))
        to_device = self.workload.to_device(self.manifest, self.device)
        stream = ShardStream(self.manifest, "train", rank=self.rank, world_size=self.world_size, data=cfg.data)
        probes = tuple(
            to_device(next(stream.train_batches(epoch=0, seed=cfg.loop.seed, batch_size=n, num_batches=1)))
            for n in (1, 2)
        )
        # On CPU the probe is a forward alone, of the module itself: no DDP or FSDP state is left expecting a backward.
        probed = self.model if self.device.type == "cuda" or self.sharded else getattr(self.model, "module", self.model)
        fixed_bytes, bytes_per_sample = batch_size.measure(
            probed,
            self.workload.loss,
            probes,
            device=self.device,
            optimizer_name=cfg.optimizer.name,
            momentum=cfg.optimizer.momentum,
            no_sync=_no_gradient_sync,
            checkpoint_staging=cfg.checkpoint.async_save and self.rank == 0,
        )
        budget = batch_size.budget_bytes(
            cfg.loop.memory_budget_gib, device=self.device, memory_per_worker_gib=cfg.scaling.memory_per_worker_gib
        )
        plan = batch_size.plan_micro_batch(
            per_worker, fixed_bytes=fixed_bytes, bytes_per_sample=bytes_per_sample, budget_bytes=budget
        )
        size = batch_size.agree(plan.micro_batch_size, self.device)
        if self.rank == 0:
            log.warning(
                "loop.batch_size=auto: micro-batch %d, %d accumulation step(s) per optimizer step (global batch %d); "
                "predicted %.3f GiB of a %.3f GiB budget (%.3f GiB fixed, %.3f MiB per sample)",
                size,
                per_worker // size,
                cfg.loop.global_batch_size,
                plan.predicted_bytes(size) / 2**30,
                budget / 2**30,
                fixed_bytes / 2**30,
                bytes_per_sample / 2**20,
            )
        return dataclasses.replace(
            cfg, loop=dataclasses.replace(cfg.loop, batch_size=size, grad_accum_steps=per_worker // size)
        )

    def keep_global_batch(self, cfg: TrainingConfig) -> TrainingConfig:
        """``cfg`` for an elastic job running on another number of workers than ``scaling.num_workers`` (after a
        lost node, or grown back): the largest micro-batch up to ``loop.batch_size`` that divides this worker's share
        of the global batch, and the accumulation that keeps it (the config checked that the share is whole)."""
        loop = cfg.loop
        global_batch = loop.batch_size * loop.grad_accum_steps * cfg.scaling.num_workers
        share = global_batch // self.world_size
        size = max(n for n in range(1, min(loop.batch_size, share) + 1) if share % n == 0)
        if self.rank == 0:
            log.warning(
                "elastic: %d of scaling.num_workers=%d workers; micro-batch %d, %d accumulation step(s) per optimizer "
                "step keep the global batch of %d",
                self.world_size,
                cfg.scaling.num_workers,
                size,
                share // size,
                global_batch,
            )
        return dataclasses.replace(cfg, loop=dataclasses.replace(loop, batch_size=size, grad_accum_steps=share // size))

    def connect_outputs(self) -> None:
        """Checkpoint storage and the metric sink (after telemetry: the checkpointer reports to it)."""
        cfg, root = self.cfg, self.args.checkpoint_root
        self.checkpointer = ckpt.Checkpointer(
            ckpt.CheckpointStorage(root, storage_options=cfg.checkpoint.storage_options(root)),
            keep_last=cfg.checkpoint.keep_last,
            interval_steps=cfg.checkpoint.interval_steps,
            at_epoch_end=cfg.checkpoint.at_epoch_end,
            keep_best=cfg.checkpoint.keep_best,
            best_mode=METRIC_DIRECTIONS[cfg.checkpoint.best_metric],
            async_save=cfg.checkpoint.async_save,
            max_consecutive_failures=cfg.checkpoint.max_consecutive_save_failures,
            observer=self.telemetry,
        )
        mlflow = self.args.mlflow
        self.sink: MetricSink = build_sink(
            rank=self.rank,
            tracking_uri=mlflow.tracking_uri if mlflow else None,
            run_id=mlflow.run_id if mlflow else None,
        )

    def resume(self) -> None:
        """Restore the newest valid checkpoint of this run (a worker restart or a task retry), else the
        ``resume_from`` checkpoint (a fine-tune, the next slice of a trial), else start fresh."""
        cfg = self.cfg
        loaded = ckpt.load_latest_valid(self.checkpointer.storage, expected_shapes=ckpt.model_state_shapes(self.model))
        same_run = loaded is not None
        if loaded is None and self.args.resume_from:
            loaded = ckpt.load_directory(self.args.resume_from)
        self.require_same_checkpoint(loaded)
        self.awaiting_first_step = loaded is not None
        if loaded is None:
            self.state = RunState()
        else:
            ckpt.restore(
                loaded, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler
            )
            self.restore_replica(loaded)
            apply_hyperparameters(cfg, self.optimizer, self.scheduler)
            self.state = state = RunState.resumed(loaded.meta, same_run=same_run)
            state.resume_timings[-1]["num_workers"] = float(self.world_size)  # an elastic run's shrink or growth
            self.meter.restore_epoch_sums(loaded.meta.epoch_partial)
            if same_run:  # a fine-tune from another run starts its own clock, cost and restart count
                self.telemetry.resumed(
                    loaded.meta.telemetry,
                    global_step=state.global_step,
                    elapsed_s=loaded.meta.elapsed_s,
                    num_restarts=len(state.resumed_from_steps),
                    num_preemptions=sum(int(t.get("preempted", 0.0)) for t in state.resume_timings),
                    attempt_start_unix=self.attempt_start_unix(loaded.meta),
                )
            restore_rng(self.rank, loaded.meta.rng, loaded.trainer.get("rng", {}))
            if self.rank == 0:
                log.warning(
                    "resumed from %s: epoch %d, step %d of it, global step %d",
                    redact(loaded.uri),
                    state.epoch,
                    state.step_in_epoch,
                    state.global_step,
                )
        if self.state.epoch >= self.end_epoch:
            raise ValueError(
                f"loop.stop_at_epoch={cfg.loop.stop_at_epoch} (loop.epochs={cfg.loop.epochs}) is not past the "
                f"checkpoint's epoch {self.state.epoch}: there is nothing to train; raise loop.stop_at_epoch"
            )
        self.report_allreduce_probe()
        if self.args.log_params if self.args.log_params is not None else loaded is None:
            extra = {"world_size": self.world_size, "steps_per_epoch": self.steps_per_epoch, "device": self.device.type}
            self.sink.log_params(flatten(cfg.to_dict()) | extra)
            self.sink.log_dict(cfg.to_dict(), "config.json")

    def attempt_start_unix(self, meta: ckpt.CheckpointMeta) -> float | None:
        """When this attempt began: its worker process's start (a Ray Train restart starts new actors), but not
        before the checkpoint it resumes was written (the actor may run in a process Ray started earlier, idle in
        its pool). None when the runtime does not know its start."""
        process_start = getattr(self.runtime, "started_unix", None)
        return None if process_start is None else max(process_start, meta.saved_unix)

    def require_same_checkpoint(self, loaded: ckpt.LoadedCheckpoint | None) -> None:
        """Every rank chose its checkpoint on its own: all must have chosen the same step (a collective), or a
        shard read while another rank wrote it, or a flaky read, would resume ranks from different states."""
        step = float(loaded.meta.global_step) if loaded is not None else -1.0
        total, squares = all_reduce_sum([step, step * step], self.device)
        if squares * self.world_size != total * total:  # the steps' variance over the ranks is not 0
            if loaded is not None:
                loaded.release()
            raise ckpt.CheckpointError(
                f"rank {self.rank} chose the checkpoint of step {int(step)} (-1: none) but another rank chose another "
                f"one under {self.checkpointer.storage.display_uri()}: storage changed while the ranks read it; a "
                "restart reads it again"
            )

    def check_nccl_network(self) -> nccl_network.NcclNetwork | None:
        """After the job-start all-reduce (NCCL's communicator is up): the network NCCL chose on this rank, from its
        log, with a warning naming the variable when it is not the one the environment asked for (a silent
        fallback to TCP sockets). None off GPUs, or with NCCL's log off (a user's own ``NCCL_DEBUG``)."""
        directory = getattr(self.runtime, "nccl_debug_dir", None)
        if directory is None or self.device.type != "cuda":
            return None
        found = nccl_network.read(directory)
        if found is None:
            return None
        reason = nccl_network.mismatch(found, os.environ)
        if reason is not None:
            log.warning("rank %d: NCCL is not on the network it was told to use: %s", self.rank, reason)
        elif self.rank == 0:
            log.info("NCCL network: %s", found.describe())
        return found

    def report_allreduce_probe(self) -> None:
        """The job-start all-reduce check to MLflow (at the step training starts from), and a warning when its bus
        bandwidth is below ``scaling.min_allreduce_gbps``."""
        probe, floor_gbps = self.allreduce_probe, self.cfg.scaling.min_allreduce_gbps
        if probe is None or self.rank != 0:
            return
        gbps = probe.bus_bandwidth_bytes_per_s * 8 / 1e9
        if self.nccl_network is not None:
            found = self.nccl_network
            self.sink.log_dict(
                {
                    "network": found.network,
                    "devices": found.devices,
                    "inter_node": found.inter_node,
                    "mismatch": nccl_network.mismatch(found, os.environ) or "",
                },
                f"nccl_network/step-{self.state.global_step}.json",
            )
        self.sink.log_metrics(
            {"allreduce_bus_bandwidth_gbps": gbps, "allreduce_latency_s": probe.latency_s}, step=self.state.global_step
        )
        log.info(
            "all-reduce check over %d ranks: bus bandwidth %.2f Gbit/s (%d MiB buffer), latency %.3f ms",
            self.world_size,
            gbps,
            probe.size_bytes // 2**20,
            probe.latency_s * 1e3,
        )
        if gbps < floor_gbps:
            log.warning(
                "all-reduce bus bandwidth %.2f Gbit/s is below scaling.min_allreduce_gbps=%g: check the network "
                "interface the collectives use (NCCL_SOCKET_IFNAME, NCCL_DEBUG=INFO shows whether NCCL fell back to "
                "TCP sockets)",
                gbps,
                floor_gbps,
            )

    def train(self) -> None:
        """Epochs from the resumed position to ``end_epoch`` (or ``total_steps``), each followed by validation,
        a checkpoint when the policy asks, and the epoch's report."""
        cfg, state, accum = self.cfg, self.state, self.cfg.loop.grad_accum_steps
        for epoch in range(state.epoch, self.end_epoch):
            if state.global_step >= self.total_steps:
                break
            first_step, remaining = state.step_in_epoch, state.data_remaining
            if remaining is None:  # the epoch from its start, or resumed on the workers that began it
                epoch_steps, num_samples = self.steps_per_epoch, self.train_stream.num_samples
                self.epoch_base, skip_batches = ([(0, num_samples)], 0), first_step * accum
            else:  # resumed from a checkpoint's position, on any number of workers
                remaining = check_intervals(remaining, self.train_stream.num_samples)
                epoch_steps = first_step + steps_left(
                    remaining, world_size=self.world_size, samples_per_step=cfg.loop.batch_size * accum
                )
                self.epoch_base, skip_batches = (remaining, first_step), 0
            steps_this_epoch = min(epoch_steps, first_step + self.total_steps - state.global_step)
            batches = self.train_stream.train_batches(
                epoch=epoch, seed=cfg.loop.seed, batch_size=cfg.loop.batch_size, remaining=self.epoch_base[0],
                num_batches=skip_batches + (steps_this_epoch - first_step) * accum, start_batch=skip_batches,
            )  # fmt: skip
            # A step's wall time runs from the previous step's end, so logging and metric all-reduces count
            # against throughput; only the epoch boundary (validation, checkpoint) and checkpoint stalls do not.
            last_step_end = time.perf_counter()
            for step_in_epoch in range(first_step, steps_this_epoch):
                step_start = time.perf_counter()
                micro_batches = [self.to_device(next(batches)) for _ in range(accum)]
                data_wait_s = time.perf_counter() - step_start
                result, lr = self.optimizer_step(micro_batches)
                state.global_step, state.step_in_epoch = state.global_step + 1, step_in_epoch + 1
                is_epoch_end = step_in_epoch == steps_this_epoch - 1
                save_now = not is_epoch_end and self.checkpointer.should_save(state.global_step, epoch_end=False)
                # Reading the loss synchronises with the device: on GPU once per log window only. An epoch's
                # last step and a checkpoint step close the window, so a checkpoint never holds half a window.
                is_log_step = state.global_step % cfg.loop.log_interval_steps == 0 or is_epoch_end or save_now
                if self.device.type == "cuda" and is_log_step:
                    torch.cuda.synchronize()  # queued kernels belong to this window's time, not the next one's
                step_end = time.perf_counter()
                step_time_s, last_step_end = step_end - last_step_end, step_end
                self.measure_step(result, step_time_s=step_time_s, data_wait_s=data_wait_s)
                preempted = False
                if is_log_step:
                    self.close_window(epoch=epoch, lr=lr)
                    preempted = self.preemption_requested()
                if save_now or preempted:
                    self.save_checkpoint(preempted=preempted)
                    last_step_end = time.perf_counter()  # the stall is measured on its own, not as step time
                if preempted:
                    self.stop_for_preemption()

            batches.close()  # the epoch's loader processes end now, not beside validation's
            self.average_replicas()
            record = self.validate(epoch=epoch, steps_in_epoch=steps_this_epoch)
            state.epoch, state.step_in_epoch, state.data_remaining = epoch + 1, 0, None
            done = state.global_step >= self.total_steps or epoch == self.end_epoch - 1
            if done:
                self.save_checkpoint(metric=record.metric(cfg.checkpoint.best_metric), model_uri=self.log_model(epoch))
                self.checkpointer.wait()  # the final checkpoint is the task's output: it must be on storage
            elif self.checkpointer.should_save(state.global_step, epoch_end=True):
                self.save_checkpoint(metric=record.metric(cfg.checkpoint.best_metric))
            self.runtime.report(record.to_dict())
            if done:
                break

    def average_replicas(self) -> None:
        """Local SGD past its warm-up: average the workers' parameters at an epoch's end, so validation, the
        epoch's checkpoint and the logged model describe one model (a collective)."""
        if self.local_sgd and self.state.global_step > self.cfg.sync.local_sgd_warmup_steps:
            self.average_parameters()

    def average_parameters(self) -> None:
        """Every rank's parameters become their mean over the ranks (one all-reduce of them all, flattened)."""
        from torch.distributed.algorithms.model_averaging.utils import average_parameters

        average_parameters(iter(list(self.model.parameters())), process_group=None)

    def gather_replicas(self) -> dict[str, dict[str, Any]] | None:
        """Local SGD past its warm-up: every rank's own model and optimizer state, by rank, on rank 0 (a collective;
        None elsewhere, and when the replicas are one model): what an exact resume needs, as they differ between
        averages."""
        if not self.local_sgd or self.state.global_step <= self.cfg.sync.local_sgd_warmup_steps:
            return None
        own = ckpt.detached({"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict()})
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        torch.distributed.gather_object(own, gathered, dst=0)
        return {str(rank): state for rank, state in enumerate(gathered)} if gathered is not None else None

    def restore_replica(self, loaded: ckpt.LoadedCheckpoint) -> None:
        """Local SGD: this rank's own model and optimizer state from a checkpoint that holds every rank's, when it
        was written by as many workers (else every rank continues from rank 0's, logged)."""
        replicas = loaded.trainer.get("replicas")
        if not replicas or not self.local_sgd:
            return
        if len(replicas) != self.world_size:
            if self.rank == 0:
                log.warning(
                    "the checkpoint holds the local SGD replicas of %d workers, this run has %d: every worker "
                    "continues from worker 0's",
                    len(replicas),
                    self.world_size,
                )
            return
        mine = replicas[str(self.rank)]
        self.model.module.load_state_dict(mine["model"])
        self.optimizer.load_state_dict(mine["optimizer"])

    def preemption_requested(self) -> bool:
        """Whether any rank was told to stop: SIGTERM, or Ray Train's notice that a node of the group is being
        preempted. A collective at log steps, when armed: all ranks agree, so all save the just-in-time checkpoint
        together."""
        if not self.preemption_armed:
            return False
        told = preemption.requested_unix() is not None
        if not told and getattr(self.runtime, "preemption_notice", lambda: False)():
            preemption.record("Ray Train's notice that its node is being preempted")
            told = True
        if self.world_size > 1:
            told = all_reduce_sum([float(told)], self.device)[0] > 0
        return told

    def stop_for_preemption(self) -> NoReturn:
        """After the just-in-time checkpoint: wait until it is on storage (rank 0 writes; the others wait at a
        barrier, so no rank's exit tears the group down mid-write), then stop as recoverable."""
        step, told = self.state.global_step, preemption.requested_unix()
        self.checkpointer.wait()  # each rank its own writes: rank 0's, and every rank's shards under FSDP
        all_reduce_sum([0.0], self.device)
        took_s = time.time() - told if told is not None else 0.0
        grace_s = self.cfg.checkpoint.preemption_grace_s
        if told is not None and took_s > grace_s:
            log.warning(
                "the preemption checkpoint of step %d was on storage %.1f s after SIGTERM, past "
                "checkpoint.preemption_grace_s=%d: lower loop.log_interval_steps so it comes sooner",
                step,
                took_s,
                grace_s,
            )
        if self.rank == 0:
            log.warning("preempted: checkpoint of step %d saved; stopping so the retry resumes from it", step)
        raise WorkerPreempted(
            f"rank {self.rank}: a worker was told to stop ({preemption.reason() or 'by another rank'}); the "
            f"checkpoint of step {step} is saved and a retry resumes from it"
        )

    def optimizer_step(self, batches: Sequence[Any]) -> tuple[StepResult, float]:
        """:func:`train_step` over ``batches`` (each split into ``oom_split`` micro-batches), the schedule's step,
        and the LR the step used. Under ``loop.oom_policy='reduce'`` a CUDA out-of-memory error retries the step
        with twice the split."""
        while True:
            try:
                result = self.train_step([piece for batch in batches for piece in split_batch(batch, self.oom_split)])
                break
            except torch.cuda.OutOfMemoryError:
                self.telemetry.gpu_oom()
                self.reduce_after_oom(batches)
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        if self.awaiting_first_step:
            timing = self.state.resume_timings[-1]
            timing["first_step_unix"] = time.time()
            if timing.get("preempted"):  # this attempt's start-up is what the preemption cost
                timing["lost_s"] = self.telemetry.preemption_recovered(first_step_unix=timing["first_step_unix"])
            self.awaiting_first_step = False
        past_warmup = self.state.global_step - self.cfg.sync.local_sgd_warmup_steps  # of this update, 0-based
        if self.local_sgd and past_warmup >= 0 and past_warmup % self.cfg.sync.local_sgd_period_steps == 0:
            self.average_parameters()
        return result, lr

    def reduce_after_oom(self, batches: Sequence[Any]) -> None:
        """After a step ran out of memory: halve the micro-batch for the rest of the run (``loop.oom_policy``), or
        re-raise when the policy is ``fail`` or the micro-batch cannot be halved into equal parts."""
        micro = self.cfg.loop.batch_size // self.oom_split
        if self.cfg.loop.oom_policy != "reduce" or micro % 2:
            raise
        self.optimizer.zero_grad(set_to_none=True)  # what the failed step accumulated
        torch.cuda.empty_cache()
        self.oom_split *= 2
        self.telemetry.oom_retried()
        log.warning(
            "rank %d: CUDA out of memory at step %d with micro-batch %d; retrying it with micro-batch %d and %d "
            "accumulation steps (loop.oom_policy=reduce), the global batch unchanged",
            self.rank,
            self.state.global_step + 1,
            micro,
            micro // 2,
            len(batches) * self.oom_split,
        )

    def train_step(self, micro_batches: Sequence[Any]) -> StepResult:
        return train_step(
            model=self.model,
            optimizer=self.optimizer,
            scaler=self.scaler,
            micro_batches=micro_batches,
            autocast_dtype=self.autocast_dtype,
            max_grad_norm=self.cfg.optimizer.max_grad_norm,
            skip_nonfinite=self.cfg.loop.nonfinite_policy == "skip_step",
            loss_fn=self.workload.loss,
            sync_gradients=not self.local_sgd or self.state.global_step < self.cfg.sync.local_sgd_warmup_steps,
        )

    def measure_step(self, result: StepResult, *, step_time_s: float, data_wait_s: float) -> None:
        """A finished step's times (and its all-reduce time) into the meter's sums and the telemetry."""
        comm_s = self.comm_timer.take_step_seconds()
        self.meter.step(
            result, global_step=self.state.global_step, step_time_s=step_time_s, data_wait_s=data_wait_s, comm_s=comm_s
        )
        self.telemetry.step(
            duration_s=step_time_s,
            num_samples=result.num_samples,
            num_tokens=result.num_tokens,
            data_wait_s=data_wait_s,
            comm_s=comm_s,
        )

    def close_window(self, *, epoch: int, lr: float) -> None:
        """Close the log window: its non-finite steps meet ``loop.nonfinite_policy`` first (all ranks read the same
        reduced count, so all stop together, before anything non-finite is logged or saved), then its record is
        emitted unless no step of it was finite."""
        record, nonfinite = self.meter.close_window(
            global_step=self.state.global_step, epoch=epoch, lr=lr, elapsed_s=self.state.elapsed_s
        )
        if nonfinite.num_steps:
            self.handle_nonfinite(nonfinite, lr=lr)
        if math.isfinite(record.train_loss):
            self.emit(record)

    def handle_nonfinite(self, found: NonFiniteSteps, *, lr: float) -> None:
        """Count a window's non-finite steps; stop (``stop``, or ``skip_step`` past its budget) or warn."""
        loop, optimizer = self.cfg.loop, self.cfg.optimizer
        self.telemetry.nonfinite_steps(found.num_steps)
        self.num_nonfinite_steps += found.num_steps
        where = (
            f"step {found.first_step} (loss {found.loss}, gradient norm {found.grad_norm})"
            if found.first_step is not None
            else f"a step of another rank in the window ending at step {self.state.global_step}"
        )
        if loop.nonfinite_policy == "skip_step" and self.num_nonfinite_steps <= loop.max_nonfinite_steps:
            if self.rank == 0:
                log.warning(
                    "skipped %d step(s) with a non-finite loss or gradient norm, the first at %s: %d of "
                    "loop.max_nonfinite_steps=%d",
                    found.num_steps,
                    where,
                    self.num_nonfinite_steps,
                    loop.max_nonfinite_steps,
                )
            return
        what = (
            f"{self.num_nonfinite_steps} steps had a non-finite loss or gradient norm and were skipped, more than "
            f"loop.max_nonfinite_steps={loop.max_nonfinite_steps} (the latest window's first at {where})"
            if loop.nonfinite_policy == "skip_step"
            else f"the loss or gradient norm is not finite at {where}"
        )
        raise self.diverged(
            f"training diverged: {what}; nothing after the last finite window was logged or checkpointed. Lower "
            f"optimizer.lr (now {optimizer.lr:g}, {lr:g} at this step), set or lower optimizer.max_grad_norm "
            f"(now {optimizer.max_grad_norm:g}; 0 disables clipping), or set loop.nonfinite_policy=skip_step "
            f"(now {loop.nonfinite_policy}) with loop.max_nonfinite_steps (now {loop.max_nonfinite_steps}) to "
            "skip such steps"
        )

    def require_finite_weights(self, what: str) -> None:
        """Every rank checks its weights and buffers, and all agree (the count is reduced): a model with a NaN or
        infinite value is never checkpointed or logged."""
        # Under FSDP each rank checks its own shard: the count is reduced either way.
        tensors = {
            name: sharding.local_tensor(t) for name, t in self.model.state_dict().items() if t.is_floating_point()
        }
        nonfinite = torch.stack([~torch.isfinite(t).all() for t in tensors.values()])
        (num_bad,) = all_reduce_sum([float(nonfinite.sum())], self.device)
        if num_bad:
            names = [name for name, bad in zip(tensors, nonfinite.tolist()) if bad] or ["(on another rank)"]
            raise self.diverged(
                f"training diverged: the weights at step {self.state.global_step} are not finite "
                f"({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}), so {what} was not written. Lower "
                f"optimizer.lr (now {self.cfg.optimizer.lr:g}) or set optimizer.max_grad_norm "
                f"(now {self.cfg.optimizer.max_grad_norm:g})"
            )

    def diverged(self, message: str) -> TrainingDiverged:
        """The error that stops a diverged run, raised once this rank's checkpoint writes in flight (all of finite
        weights) are on storage."""
        try:
            self.checkpointer.wait()
        except Exception:  # noqa: BLE001 - the divergence is the error to report; this one is logged
            log.exception("a checkpoint write failed while the diverged run stopped")
        return TrainingDiverged(message)

    def emit(self, record: StepRecord) -> None:
        """The one place a window's record goes: the step log, the metric sink and the telemetry."""
        self.state.step_log.append(record)
        self.sink.log_metrics(record.metrics(), step=record.step)
        self.telemetry.window(record.metrics(), global_step=record.step)

    def validate(self, *, epoch: int, steps_in_epoch: int) -> EpochRecord:
        """Validation on every rank's share of the split, the epoch's record, and the best metric so far."""
        broadcast_buffers_from_rank0(self.model)
        val = evaluate(
            self.model,
            self.val_stream.eval_batches(batch_size=min(256, self.cfg.loop.batch_size * 4)),
            workload=self.workload,
            to_device=self.to_device,
            device=self.device,
            autocast_dtype=self.autocast_dtype,
            all_reduce=True,
            lockstep=self.sharded,
        ).metrics
        if not math.isfinite(val["loss"]):  # reduced: every rank sees it
            raise self.diverged(
                f"training diverged: the validation loss after step {self.state.global_step} is {val['loss']}, so the "
                f"epoch is neither recorded nor checkpointed. Lower optimizer.lr (now {self.cfg.optimizer.lr:g}) "
                f"or set optimizer.max_grad_norm (now {self.cfg.optimizer.max_grad_norm:g})"
            )
        record = self.meter.close_epoch(
            epoch=epoch,
            global_step=self.state.global_step,
            steps_in_epoch=steps_in_epoch,
            val=val,
            lr=self.optimizer.param_groups[0]["lr"],
        )
        self.state.history.append(record)
        self.telemetry.validation(loss=val["loss"], accuracy=val.get("accuracy", math.nan))
        self.sink.log_metrics({f"val_{name}": value for name, value in val.items()}, step=self.state.global_step)
        metric_name = self.cfg.checkpoint.best_metric
        if is_better(metric_name, record.metric(metric_name), self.state.best_metric):
            self.state.best_metric = record.metric(metric_name)
        return record

    def log_model(self, epoch: int) -> str:
        """Rank 0 logs the model to MLflow when the run trained its full budget; returns its ``models:/`` URI.
        A slice that stops before the budget (a tuning rung) logs none: only a finished trial is registered,
        and logging costs seconds per slice."""
        full_budget = self.state.global_step >= self.total_steps or epoch == self.cfg.loop.epochs - 1
        if self.args.mlflow is None or not full_budget:
            return ""
        self.require_finite_weights("the MLflow model")  # on every rank: a collective
        model = self.gathered_model() if self.sharded else self.model
        if self.rank != 0:
            return ""
        from training_core.tracking import log_model

        example = self.workload.example_input(self.manifest)
        # A workload may free more input axes than the batch (a language model: the sequence length).
        dynamic_axes = getattr(self.workload, "dynamic_axes", (0,))
        return log_model(model, example, self.args.mlflow, dynamic_axes=dynamic_axes)

    def gathered_model(self) -> nn.Module | None:
        """The FSDP model whole, in one process on rank 0's CPU (None on the other ranks): a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        model = self.workload.build_model(self.cfg, self.manifest)
        model.load_state_dict(full)
        return model

    def save_checkpoint(self, *, metric: float | None = None, model_uri: str = "", preempted: bool = False) -> None:
        """Every rank calls this at the same steps (the weight check and the RNG gather are collectives); rank 0
        writes."""
        self.require_finite_weights(f"the checkpoint of step {self.state.global_step}")
        json_rng, torch_rng = gather_rng_states(self.world_size)
        replicas = self.gather_replicas()
        started = time.perf_counter()
        meta = self.checkpoint_meta(metric=metric, model_uri=model_uri, preempted=preempted, json_rng=json_rng)
        if self.sharded:  # every rank writes its shard
            trainer_state = {
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "rng": torch_rng,
            }
            self.checkpointer.save_sharded(
                self.state.global_step,
                model=self.model,
                optimizer=self.optimizer,
                trainer_state=ckpt.detached(trainer_state) if self.rank == 0 else None,
                meta=meta,
                metric=metric,
                process_group=self.checkpoint_group,
            )
        elif self.rank == 0:
            staged = self.checkpointer.stage(
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                scaler=self.scaler,
                meta=meta,
                torch_rng=torch_rng,
                replicas=replicas,
            )
            self.checkpointer.save(self.state.global_step, staged, metric=metric)
        self.sink.log_metrics({"checkpoint_stall_s": time.perf_counter() - started}, step=self.state.global_step)

    def checkpoint_meta(
        self, *, metric: float | None, model_uri: str, preempted: bool, json_rng: dict[str, Any]
    ) -> ckpt.CheckpointMeta | None:
        """What a checkpoint's ``meta.json`` records of this run now: rank 0's (None on the other ranks)."""
        if self.rank != 0:
            return None
        state, cfg, manifest = self.state, self.cfg, self.manifest
        left = self.data_left()
        return ckpt.CheckpointMeta(
            model_name=cfg.model.name,
            classes=manifest.classes,
            input_shape=manifest.input_shape,
            mean=manifest.mean,
            std=manifest.std,
            epoch=state.epoch,
            step_in_epoch=state.step_in_epoch,
            global_step=state.global_step,
            config=redact(cfg.to_dict()),  # a record only: the run's real config stays in memory
            best_metric=state.best_metric,
            metric=metric,
            history=list(state.history),
            step_log=list(state.step_log.records),
            rng=json_rng,
            resumed_from_steps=list(state.resumed_from_steps),
            resume_timings=[dict(t) for t in state.resume_timings],
            epoch_partial=self.meter.epoch_sums(),
            mlflow_run_id=self.args.mlflow.run_id if self.args.mlflow else "",
            mlflow_model_uri=model_uri,
            elapsed_s=state.elapsed_s,
            telemetry=self.telemetry.snapshot(),
            data=manifest.description(),
            data_remaining=[list(pair) for pair in left],
            data_exhausted=self.state.step_in_epoch > 0 and not left,
            preempted=preempted,
            num_parameters=self.num_parameters,
            saved_unix=time.time(),
        )

    def data_left(self) -> list[tuple[int, int]]:
        """Positions of the current epoch's order no rank has trained yet (none at an epoch's start)."""
        if self.state.step_in_epoch == 0:
            return []
        base, base_step = self.epoch_base
        samples_per_step = self.cfg.loop.batch_size * self.cfg.loop.grad_accum_steps
        consumed = (self.state.step_in_epoch - base_step) * samples_per_step
        return remaining_after(base, world_size=self.world_size, consumed_per_rank=consumed)


def run_worker(args: WorkerArgs, runtime: WorkerRuntime) -> None:
    """The training run of one rank: set up, resume, train, finish."""
    trainer = Trainer(args, runtime)
    trainer.setup()
    finished = False
    # The telemetry threads stop, and the last push says whether training finished, however the run ends.
    try:
        trainer.connect_outputs()
        trainer.resume()
        trainer.train()
        trainer.checkpointer.wait()
        trainer.sink.close()
        finished = True
    finally:
        trainer.telemetry.close(finished=finished)
        preemption.disarm()


def add_code_paths(paths: Sequence[str]) -> None:
    """Make the user code the driver imported importable here (see ``WorkerArgs.code_paths``)."""
    import sys

    for path in paths:
        if path not in sys.path:
            sys.path.append(path)


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train entry point, run by every worker: :func:`run_worker` with the Ray Train runtime, its logs redacted
    (:func:`~training_core.redact.install_log_redaction`: Ray starts the process with its own logging).

    A divergence is reported, not raised: Ray Train restarts the worker group on any worker error, and a diverged
    run resumed from its last checkpoint diverges again, so each restart would only burn time. Every rank stops
    at the same point (the figures it rests on are reduced), so every rank reports; ``fit`` raises it.

    An error of the user's code or data (:class:`~training_core.failures.UserCodeError`, what a user workload's
    methods raise: :class:`~training_core.workloads.UserWorkload`) is raised, on whichever rank meets it, its peers
    perhaps still in a collective: Ray Train's controller, which sees every rank's error, ends the run without a
    restart (:class:`~training_core.failures.FailFastPolicy`).

    A collective that timed out (a hung or unreachable peer) kills the other ranks' workers before it is raised
    (:meth:`~training_core.distributed.RayTrainRuntime.abandon_group`): the group restarts without waiting on
    the hung one."""
    from training_core.redact import install_log_redaction

    install_log_redaction()
    args = WorkerArgs.from_dict(loop_config)
    # Ray Train has started the process group; torch creates NCCL's communicators at the first collective, which
    # reads these. On a cluster the RayJob pods also have them from the start (tasks/ray_config.py).
    os.environ.update(args.config.scaling.nccl_env)
    # NCCL logs the network it chooses only at INFO: to a file of this process, read after the job-start
    # all-reduce (Trainer.check_nccl_network). A user's own NCCL_DEBUG wins, and the check is off.
    nccl_debug_dir = None
    if args.config.scaling.use_gpu and "NCCL_DEBUG" not in os.environ:
        nccl_debug_dir = tempfile.mkdtemp(prefix="nccl-")
        os.environ.update(nccl_network.debug_env(nccl_debug_dir))
    runtime = RayTrainRuntime(nccl_debug_dir=nccl_debug_dir)
    add_code_paths(args.code_paths)
    try:
        run_worker(args, runtime)
    except TrainingDiverged as exc:
        runtime.report_result({DIVERGED_METRIC: str(exc)})
    except Exception as exc:
        if is_collective_timeout(exc):
            runtime.abandon_group(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise
