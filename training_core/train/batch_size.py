"""``loop.batch_size: auto``: the largest per-worker micro-batch that fits a memory budget, and the gradient
accumulation that keeps ``loop.global_batch_size``.

A training step's memory is a fixed part (weights, their gradients, the optimizer's state) plus a part that grows
with the micro-batch (the activations kept for the backward pass). Both are measured at start with two small
probes, of 1 and 2 samples, so no probe can itself run out of memory:

- on a GPU, the allocator's peak over a forward and backward pass (gradient sync off: no collective);
- on CPU, the bytes of the tensors autograd saves for the backward pass during a forward (saved-tensor hooks), times
  :data:`CPU_TRANSIENT_FACTOR` for what the backward allocates on top, plus the weights, gradients, optimizer state
  and step temporaries, and an asynchronous checkpoint's copy of them (all in host memory), the whole times
  :data:`CPU_ALLOCATOR_HEADROOM`.

The probes leave the model, its buffers (BatchNorm statistics) and the RNG as they found them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from training_core.config import AUTO
from training_core.data import ShardStream
from training_core.parallel.distributed import all_gather_objects
from training_core.parallel.sharding import local_tensor
from training_core.train.step import Saved, no_gradient_sync

if TYPE_CHECKING:
    from training_core.config import TrainingConfig
    from training_core.data import Manifest
    from training_core.parallel.distributed import WorkerRuntime
    from training_core.workloads import Workload

log = logging.getLogger("training_core")

CPU_TRANSIENT_FACTOR = 1.5
"""The backward pass holds, besides the saved activations, the gradients of the activations it is working on."""
CPU_ALLOCATOR_HEADROOM = 1.1
"""What host memory a step really takes over what its tensors add up to: the allocator's free lists, thread arenas
and the timing of an asynchronous save's copy. A ResNet-18's peak RSS ranged 0.93-1.075 of the tensors' sum over
nine runs (one a CI machine's); without headroom a run sized to its budget could exceed it."""
OPTIMIZER_STATE_COPIES = {"sgd": 1, "adam": 2, "adamw": 2}
"""Tensors of parameter size an optimizer keeps per parameter (SGD: momentum; Adam: two moments)."""
OPTIMIZER_STEP_COPIES = 2
"""Temporaries of parameter size an optimizer step allocates (the ``foreach`` implementations' intermediate lists). A
fused step (``optimizer.fused`` on a GPU) updates in place and allocates none."""
DEFAULT_BUDGET_SHARE = 0.8
"""Share of the device's memory (the GPU's, or the worker pod's on CPU) a step may use by default."""


@dataclass(frozen=True)
class BatchPlan:
    """The micro-batch a worker trains with, and what it was chosen from."""

    micro_batch_size: int
    grad_accum_steps: int
    fixed_bytes: int
    """Memory a step needs whatever the micro-batch: weights, gradients, optimizer state."""
    bytes_per_sample: int
    """What each sample of the micro-batch adds."""
    budget_bytes: int

    def predicted_bytes(self, micro_batch_size: int) -> int:
        return self.fixed_bytes + self.bytes_per_sample * micro_batch_size


def plan_micro_batch(per_worker: int, *, fixed_bytes: int, bytes_per_sample: int, budget_bytes: int) -> BatchPlan:
    """The largest divisor of ``per_worker`` (the worker's share of the global batch) whose predicted memory fits
    ``budget_bytes``. Raises ``ValueError`` naming the settings when not even one sample fits."""
    for size in sorted((d for d in range(1, per_worker + 1) if per_worker % d == 0), reverse=True):
        if fixed_bytes + bytes_per_sample * size <= budget_bytes:
            return BatchPlan(size, per_worker // size, fixed_bytes, bytes_per_sample, budget_bytes)
    gib = 2**30
    raise ValueError(
        f"loop.batch_size=auto: one sample needs {(fixed_bytes + bytes_per_sample) / gib:.2f} GiB "
        f"({fixed_bytes / gib:.2f} GiB of weights, gradients and optimizer state), more than "
        f"loop.memory_budget_gib={budget_bytes / gib:.2f}: raise it, shard the model (scaling.strategy=fsdp), "
        "recompute activations (model.activation_checkpointing=full) or use a smaller model"
    )


def budget_bytes(memory_budget_gib: float, *, device: torch.device, memory_per_worker_gib: float) -> int:
    """``loop.memory_budget_gib`` in bytes, or its default: a share of the GPU's memory, or of the worker pod's."""
    if memory_budget_gib:
        return int(memory_budget_gib * 2**30)
    if device.type == "cuda":
        return int(DEFAULT_BUDGET_SHARE * torch.cuda.get_device_properties(device).total_memory)
    return int(DEFAULT_BUDGET_SHARE * memory_per_worker_gib * 2**30)


def measure(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Any],
    batches: tuple[Any, Any],
    *,
    device: torch.device,
    optimizer_name: str,
    momentum: float,
    no_sync: Callable[[nn.Module], Any],
    checkpoint_staging: bool = False,
    fused: bool = False,
) -> tuple[int, int]:
    """``(fixed_bytes, bytes_per_sample)`` of a training step of ``model``, from ``batches``: micro-batches of 1 and 2
    samples, as the module docstring says. ``no_sync(model)`` is the context that keeps a backward pass from syncing
    gradients; ``fused``: the optimizer step (a GPU's fused kernel) allocates no temporaries; ``checkpoint_staging``:
    asynchronous saves on CPU keep a host copy of the weights and optimizer state."""
    buffers = Saved(list(model.buffers()))
    state_copies = OPTIMIZER_STATE_COPIES.get(optimizer_name, 2) if optimizer_name != "sgd" or momentum else 0
    weights = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in model.parameters())
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if device.type == "cuda" else []):
            if device.type == "cuda":
                # The peak holds the weights, the gradients and the activations; the optimizer's state comes at its
                # first step.
                peaks = [_cuda_peak_bytes(model, loss_fn, batch, device=device, no_sync=no_sync) for batch in batches]
                per_sample = max(0, peaks[1] - peaks[0])
                step_copies = 0 if fused else OPTIMIZER_STEP_COPIES
                return peaks[0] - per_sample + (state_copies + step_copies) * weights, per_sample
            saved = [_saved_tensor_bytes(model, loss_fn, batch) for batch in batches]
    finally:
        buffers.keep_if(torch.zeros((), dtype=torch.bool, device=device))
    # The difference of the two probes is one sample's activations; what both saved alike is mostly the weights
    # themselves (autograd keeps a reference to them), no new memory.
    per_sample = CPU_TRANSIENT_FACTOR * max(0, saved[1] - saved[0])
    # Weights, gradients, optimizer state and its step's temporaries, and a save's copy of weights and state.
    copies = 2 + state_copies + OPTIMIZER_STEP_COPIES + (1 + state_copies if checkpoint_staging else 0)
    return int(CPU_ALLOCATOR_HEADROOM * copies * weights), int(CPU_ALLOCATOR_HEADROOM * per_sample)


def _saved_tensor_bytes(model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], batch: Any) -> int:
    """Bytes of the distinct tensors autograd saves for the backward pass in one forward of ``batch``."""
    seen: dict[tuple[int, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_fn(model, batch).loss.detach()
    return sum(seen.values())


def _cuda_peak_bytes(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], batch: Any, *, device: torch.device, no_sync
) -> int:
    """The allocator's peak over a forward and backward of ``batch``, gradients synced nowhere and dropped after."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    with no_sync(model):
        loss_fn(model, batch).loss.backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    model.zero_grad(set_to_none=True)
    return peak


class BatchPlanner:
    """This worker's micro-batch and accumulation steps: ``loop.batch_size: auto`` measured and planned, or an
    elastic run's on another number of workers than ``scaling.num_workers``; the global batch stays as configured."""

    def __init__(
        self, model: nn.Module, workload: Workload, manifest: Manifest, runtime: WorkerRuntime, *, sharded: bool
    ) -> None:
        self.model, self.workload, self.manifest, self.sharded = model, workload, manifest, sharded
        self.rank, self.world_size, self.device = runtime.rank, runtime.world_size, runtime.device

    def plan(self, cfg: TrainingConfig) -> TrainingConfig:
        """``cfg`` with the micro-batch this worker trains (``cfg`` itself when the config's stands)."""
        if cfg.loop.batch_size == AUTO:
            return self.auto(cfg)
        if cfg.scaling.elastic and self.world_size != cfg.scaling.num_workers:
            return self.keep_global_batch(cfg)
        return cfg

    def auto(self, cfg: TrainingConfig) -> TrainingConfig:
        """``cfg`` with ``loop.batch_size: auto`` resolved: the largest micro-batch that fits the memory budget and
        divides this worker's share of ``loop.global_batch_size``, the smallest over the ranks, and the accumulation
        that keeps the global batch."""
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
        fixed_bytes, bytes_per_sample = self.measure(cfg)
        budget = budget_bytes(
            cfg.loop.memory_budget_gib, device=self.device, memory_per_worker_gib=cfg.scaling.memory_per_worker_gib
        )
        plan = plan_micro_batch(
            per_worker, fixed_bytes=fixed_bytes, bytes_per_sample=bytes_per_sample, budget_bytes=budget
        )
        # The smallest over the ranks: FSDP's collectives run per micro-batch, so every rank must take as many.
        size = min(all_gather_objects(plan.micro_batch_size, self.world_size))
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

    def measure(self, cfg: TrainingConfig) -> tuple[int, int]:
        """:func:`measure` on probes of 1 and 2 of this rank's first training samples."""
        to_device = self.workload.to_device(self.manifest, self.device)
        stream = ShardStream(self.manifest, "train", rank=self.rank, world_size=self.world_size, data=cfg.data)
        probes = tuple(
            to_device(next(stream.train_batches(epoch=0, seed=cfg.loop.seed, batch_size=n, num_batches=1)))
            for n in (1, 2)
        )
        # On CPU the probe is a forward alone, of the module itself: no DDP or FSDP state is left expecting a backward.
        probed = self.model if self.device.type == "cuda" or self.sharded else getattr(self.model, "module", self.model)
        return measure(
            probed,
            self.workload.loss,
            probes,
            device=self.device,
            optimizer_name=cfg.optimizer.name,
            momentum=cfg.optimizer.momentum,
            no_sync=no_gradient_sync,
            checkpoint_staging=cfg.checkpoint.async_save and self.rank == 0,
            fused=cfg.optimizer.fused and self.device.type == "cuda",
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
