"""What retries a step or stops a run: a CUDA out-of-memory step (:class:`OomRetry`, ``loop.oom_policy``), a
non-finite loss, gradient norm, weight or validation loss (:class:`DivergenceGuard`, ``loop.nonfinite_policy``), and a
worker told to stop (:class:`PreemptionWatch`, :mod:`training_core.train.preemption`)."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

import torch
from torch import nn

from training_core.parallel import sharding
from training_core.parallel.distributed import all_reduce_sum
from training_core.train import preemption
from training_core.train.failures import TrainingDiverged, WorkerPreempted
from training_core.train.step import StepResult, split_batch

if TYPE_CHECKING:
    from training_core.checkpoint import Checkpointer
    from training_core.config import LoopConfig, TrainingConfig
    from training_core.parallel.distributed import WorkerRuntime
    from training_core.train.meter import NonFiniteSteps

log = logging.getLogger("training_core")


class OomRetry:
    """Each loaded batch is split into :attr:`split` micro-batches: doubled by each out-of-memory step retried
    under ``loop.oom_policy='reduce'``."""

    def __init__(self, loop: LoopConfig, *, rank: int, telemetry: Any) -> None:
        self.loop, self.rank, self.telemetry = loop, rank, telemetry
        self.split = 1

    def run(
        self,
        step: Callable[[Sequence[Any]], StepResult],
        batches: Sequence[Any],
        *,
        optimizer: torch.optim.Optimizer,
        global_step: int,
    ) -> StepResult:
        """``step`` over ``batches``, each split into :attr:`split` micro-batches. After an out-of-memory error: halve
        the micro-batch and retry, or re-raise when the policy is ``fail`` or the micro-batch cannot be halved into
        equal parts."""
        while True:
            try:
                return step([piece for batch in batches for piece in split_batch(batch, self.split)])
            except torch.cuda.OutOfMemoryError:
                self.telemetry.gpu_oom()
                micro = self.loop.batch_size // self.split
                if self.loop.oom_policy != "reduce" or micro % 2:
                    raise
                optimizer.zero_grad(set_to_none=True)  # what the failed step accumulated
                torch.cuda.empty_cache()
                self.split *= 2
                self.telemetry.oom_retried()
                log.warning(
                    "rank %d: CUDA out of memory at step %d with micro-batch %d; retrying it with micro-batch %d and "
                    "%d accumulation steps (loop.oom_policy=reduce), the global batch unchanged",
                    self.rank,
                    global_step + 1,
                    micro,
                    micro // 2,
                    len(batches) * self.split,
                )


class DivergenceGuard:
    """Counts this attempt's non-finite steps against ``loop.max_nonfinite_steps`` and raises the divergence, once
    this rank's checkpoint writes in flight (all of finite weights) are on storage. The figures it decides on are
    reduced, so every rank stops at the same point."""

    def __init__(
        self, cfg: TrainingConfig, runtime: WorkerRuntime, *, telemetry: Any, checkpointer: Checkpointer
    ) -> None:
        self.loop, self.optimizer, self.telemetry, self.checkpointer = cfg.loop, cfg.optimizer, telemetry, checkpointer
        self.rank, self.device = runtime.rank, runtime.device
        self.num_nonfinite_steps = 0
        """Steps of this run attempt whose loss or gradient norm was not finite (``loop.max_nonfinite_steps``)."""

    def window(self, found: NonFiniteSteps, *, lr: float, global_step: int) -> None:
        """Count a window's non-finite steps; stop (``stop``, or ``skip_step`` past its budget) or warn."""
        loop = self.loop
        self.telemetry.nonfinite_steps(found.num_steps)
        self.num_nonfinite_steps += found.num_steps
        where = (
            f"step {found.first_step} (loss {found.loss}, gradient norm {found.grad_norm})"
            if found.first_step is not None
            else f"a step of another rank in the window ending at step {global_step}"
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
            f"optimizer.lr (now {self.optimizer.lr:g}, {lr:g} at this step), set or lower optimizer.max_grad_norm "
            f"(now {self.optimizer.max_grad_norm:g}; 0 disables clipping), or set loop.nonfinite_policy=skip_step "
            f"(now {loop.nonfinite_policy}) with loop.max_nonfinite_steps (now {loop.max_nonfinite_steps}) to "
            "skip such steps"
        )

    def require_finite_weights(self, model: nn.Module, what: str, *, global_step: int) -> None:
        """Every rank checks its weights and buffers, and all agree (the count is reduced): a model with a NaN or
        infinite value is never checkpointed or logged."""
        # Under FSDP each rank checks its own shard: the count is reduced either way.
        tensors = {name: sharding.local_tensor(t) for name, t in model.state_dict().items() if t.is_floating_point()}
        nonfinite = torch.stack([~torch.isfinite(t).all() for t in tensors.values()])
        (num_bad,) = all_reduce_sum([float(nonfinite.sum())], self.device)
        if num_bad:
            names = [name for name, bad in zip(tensors, nonfinite.tolist()) if bad] or ["(on another rank)"]
            raise self.diverged(
                f"training diverged: the weights at step {global_step} are not finite "
                f"({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}), so {what} was not written. Lower "
                f"optimizer.lr (now {self.optimizer.lr:g}) or set optimizer.max_grad_norm "
                f"(now {self.optimizer.max_grad_norm:g})"
            )

    def require_finite_validation(self, loss: float, *, global_step: int) -> None:
        """A validation loss (reduced: every rank sees it) that is not finite stops the run before the epoch is
        recorded or checkpointed."""
        if not math.isfinite(loss):
            raise self.diverged(
                f"training diverged: the validation loss after step {global_step} is {loss}, so the "
                f"epoch is neither recorded nor checkpointed. Lower optimizer.lr (now {self.optimizer.lr:g}) "
                f"or set optimizer.max_grad_norm (now {self.optimizer.max_grad_norm:g})"
            )

    def diverged(self, message: str) -> TrainingDiverged:
        """The error that stops a diverged run, returned once this rank's checkpoint writes in flight are on
        storage."""
        try:
            self.checkpointer.wait()
        except Exception:  # noqa: BLE001 - the divergence is the error to report; this one is logged
            log.exception("a checkpoint write failed while the diverged run stopped")
        return TrainingDiverged(message)


class PreemptionWatch:
    """Armed when ``checkpoint.preemption_grace_s`` is positive and the process can take the signal; every rank
    asks at the same log steps."""

    def __init__(self, grace_s: int, runtime: WorkerRuntime) -> None:
        self.grace_s, self.runtime = grace_s, runtime
        self.rank, self.world_size, self.device = runtime.rank, runtime.world_size, runtime.device
        self.armed = grace_s > 0 and preemption.arm(getattr(runtime, "run_on_main_thread", None))

    def requested(self) -> bool:
        """Whether any rank was told to stop: SIGTERM, or Ray Train's notice that a node of the group is being
        preempted. A collective at log steps, when armed: all ranks agree, so all save the just-in-time checkpoint
        together."""
        if not self.armed:
            return False
        told = preemption.requested_unix() is not None
        if not told and getattr(self.runtime, "preemption_notice", lambda: False)():
            preemption.record("Ray Train's notice that its node is being preempted")
            told = True
        if self.world_size > 1:
            told = all_reduce_sum([float(told)], self.device)[0] > 0
        return told

    def stop(self, step: int, checkpointer: Checkpointer) -> NoReturn:
        """After the just-in-time checkpoint of ``step``: wait until it is on storage (rank 0 writes; the others wait
        at a barrier, so no rank's exit tears the group down mid-write), then stop as recoverable."""
        told = preemption.requested_unix()
        checkpointer.wait()  # each rank its own writes: rank 0's, and every rank's shards under FSDP
        all_reduce_sum([0.0], self.device)
        if told is not None and (took_s := time.time() - told) > self.grace_s:
            log.warning(
                "the preemption checkpoint of step %d was on storage %.1f s after SIGTERM, past "
                "checkpoint.preemption_grace_s=%d: lower loop.log_interval_steps so it comes sooner",
                step,
                took_s,
                self.grace_s,
            )
        if self.rank == 0:
            log.warning("preempted: checkpoint of step %d saved; stopping so the retry resumes from it", step)
        raise WorkerPreempted(
            f"rank {self.rank}: a worker was told to stop ({preemption.reason() or 'by another rank'}); the "
            f"checkpoint of step {step} is saved and a retry resumes from it"
        )
