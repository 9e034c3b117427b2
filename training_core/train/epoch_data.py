"""The run's length in steps, which samples an epoch trains on this attempt (see :mod:`training_core.data.loader`): from
the epoch's start, or from the positions a checkpoint left, on any number of workers; and what is left of them for the
next checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from training_core.data.loader import check_intervals, remaining_after, steps_left

if TYPE_CHECKING:
    from training_core.config import LoopConfig
    from training_core.data import Manifest, ShardStream


def run_length(manifest: Manifest, loop: LoopConfig, *, world_size: int) -> tuple[int, int, int]:
    """The run's steps per epoch, its length in optimizer steps (``loop.epochs``, ``loop.max_steps``) and the epoch
    it stops at."""
    steps_per_epoch = manifest.steps_per_epoch(
        world_size=world_size, batch_size=loop.batch_size, grad_accum_steps=loop.grad_accum_steps
    )
    total_steps = steps_per_epoch * loop.epochs
    if loop.max_steps:
        total_steps = min(total_steps, loop.max_steps)
    return steps_per_epoch, total_steps, loop.stop_at_epoch or loop.epochs


class EpochData:
    """The current epoch's base: the positions of its sample order left when this attempt began training it, and
    the epoch's step there."""

    def __init__(self, stream: ShardStream, loop: LoopConfig, *, world_size: int, steps_per_epoch: int) -> None:
        self.stream, self.world_size, self.seed, self.steps_per_epoch = stream, world_size, loop.seed, steps_per_epoch
        self.batch_size, self.grad_accum_steps = loop.batch_size, loop.grad_accum_steps
        self.base: tuple[list[tuple[int, int]], int] = ([(0, stream.num_samples)], 0)

    def open(
        self, epoch: int, *, first_step: int, remaining: list[tuple[int, int]] | None, max_steps: int
    ) -> tuple[int, Iterator[Any]]:
        """The epoch's step to stop at (at most ``max_steps`` past ``first_step``) and its batches from
        ``first_step``: from the epoch's start (``remaining`` None: resumed on the workers that began it, if at all),
        or from a checkpoint's ``remaining`` positions."""
        accum = self.grad_accum_steps
        if remaining is None:
            epoch_steps, skip_batches = self.steps_per_epoch, first_step * accum
            self.base = ([(0, self.stream.num_samples)], 0)
        else:
            remaining = check_intervals(remaining, self.stream.num_samples)
            epoch_steps = first_step + steps_left(
                remaining, world_size=self.world_size, samples_per_step=self.batch_size * accum
            )
            self.base, skip_batches = (remaining, first_step), 0
        steps_this_epoch = min(epoch_steps, first_step + max_steps)
        batches = self.stream.train_batches(
            epoch=epoch, seed=self.seed, batch_size=self.batch_size, remaining=self.base[0],
            num_batches=skip_batches + (steps_this_epoch - first_step) * accum, start_batch=skip_batches,
        )  # fmt: skip
        return steps_this_epoch, batches

    def left(self, step_in_epoch: int) -> list[tuple[int, int]]:
        """Positions of the current epoch's order no rank has trained yet, ``step_in_epoch`` steps into it (none at
        an epoch's start)."""
        if step_in_epoch == 0:
            return []
        base, base_step = self.base
        consumed = (step_in_epoch - base_step) * self.batch_size * self.grad_accum_steps
        return remaining_after(base, world_size=self.world_size, consumed_per_rank=consumed)
