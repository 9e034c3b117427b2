"""Local SGD (``sync.mode: local_sgd``): when the workers step on their own gradients, when their parameters are
averaged, and each rank's own replica in a checkpoint."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from training_core import checkpoint as ckpt

if TYPE_CHECKING:
    from training_core.config import SyncConfig

log = logging.getLogger("training_core")


class LocalSgd:
    """Past ``sync.local_sgd_warmup_steps`` every rank steps on its own gradients and the ranks average their
    parameters every ``sync.local_sgd_period_steps`` updates and at each epoch's end; one worker has nothing to
    sync, so local SGD is off there."""

    def __init__(self, sync: SyncConfig, *, rank: int, world_size: int) -> None:
        self.enabled = sync.mode == "local_sgd" and world_size > 1
        self.warmup_steps, self.period_steps = sync.local_sgd_warmup_steps, sync.local_sgd_period_steps
        self.rank, self.world_size = rank, world_size

    def syncs_gradients(self, global_step: int) -> bool:
        """Whether the update after ``global_step`` all-reduces its gradients (always, unless local SGD is on and
        past its warm-up)."""
        return not self.enabled or global_step < self.warmup_steps

    def replicas_differ(self, global_step: int) -> bool:
        """Whether the ranks' models may differ after ``global_step`` updates (between averages)."""
        return self.enabled and global_step > self.warmup_steps

    def after_update(self, model: nn.Module, global_step: int) -> None:
        """After the update that took the run to ``global_step + 1``: average on the period (a collective)."""
        past_warmup = global_step - self.warmup_steps  # of this update, 0-based
        if self.enabled and past_warmup >= 0 and past_warmup % self.period_steps == 0:
            average_parameters(model)

    def at_epoch_end(self, model: nn.Module, global_step: int) -> None:
        """Average at an epoch's end, so validation, the epoch's checkpoint and the logged model describe one model
        (a collective)."""
        if self.replicas_differ(global_step):
            average_parameters(model)

    def gather_replicas(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, global_step: int
    ) -> dict[str, dict[str, Any]] | None:
        """Every rank's own model and optimizer state, by rank, on rank 0 (a collective; None elsewhere, and when
        the replicas are one model): what an exact resume needs, as they differ between averages."""
        if not self.replicas_differ(global_step):
            return None
        own = ckpt.detached({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()})
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        torch.distributed.gather_object(own, gathered, dst=0)
        return {str(rank): state for rank, state in enumerate(gathered)} if gathered is not None else None

    def restore_replica(
        self, loaded: ckpt.LoadedCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """This rank's own model and optimizer state from a checkpoint that holds every rank's, when it was written
        by as many workers (else every rank continues from rank 0's, logged)."""
        replicas = loaded.trainer.get("replicas")
        if not replicas or not self.enabled:
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
        model.module.load_state_dict(mine["model"])
        optimizer.load_state_dict(mine["optimizer"])


def average_parameters(model: nn.Module) -> None:
    """Every rank's parameters become their mean over the ranks (one all-reduce of them all, flattened)."""
    from torch.distributed.algorithms.model_averaging.utils import average_parameters as average

    average(iter(list(model.parameters())), process_group=None)
