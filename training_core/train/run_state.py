"""Where a run is and what it recorded (:class:`RunState`), what a checkpoint's meta holds of it, which checkpoint a
run attempt resumes from (the same on every rank), and what each rank writes of one (:class:`CheckpointWrites`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from training_core import checkpoint as ckpt
from training_core.config import METRIC_DIRECTIONS
from training_core.parallel.distributed import all_reduce_sum
from training_core.records import EpochRecord, StepLog
from training_core.redact import redact

if TYPE_CHECKING:
    from torch import nn

    from training_core.config import CheckpointConfig, TrainingConfig
    from training_core.data import Manifest
    from training_core.parallel.distributed import WorkerRuntime

log = logging.getLogger("training_core")


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
    the epoch's first ``step_in_epoch`` steps were taken on this number of workers (see
    :mod:`training_core.data.loader`)."""

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

    def first_step_taken(self, telemetry: Any) -> None:
        """A resumed attempt's first step is done: when, and after a preemption the time the stop cost."""
        timing = self.resume_timings[-1]
        timing["first_step_unix"] = time.time()
        if timing.get("preempted"):  # this attempt's start-up is what the preemption cost
            timing["lost_s"] = telemetry.preemption_recovered(first_step_unix=timing["first_step_unix"])

    def log_resumed(self, uri: str) -> None:
        """Where the run resumed: the checkpoint (``uri``, credentials redacted) and its position."""
        log.warning(
            "resumed from %s: epoch %d, step %d of it, global step %d",
            redact(uri),
            self.epoch,
            self.step_in_epoch,
            self.global_step,
        )

    def resume_telemetry(self, telemetry: Any, loaded: ckpt.LoadedCheckpoint, *, runtime: Any, accounting: Any) -> None:
        """``telemetry`` continues the clock, cost and restart count of the run ``loaded`` was saved by, and
        ``accounting`` (a :class:`~training_core.train.accounting.RunAccounting`) its goodput."""
        accounting.resumed(loaded.meta)
        started = getattr(runtime, "started_unix", None)  # None when the runtime does not know its start
        telemetry.resumed(
            loaded.meta.telemetry,
            global_step=self.global_step,
            elapsed_s=loaded.meta.elapsed_s,
            num_restarts=len(self.resumed_from_steps),
            num_preemptions=sum(int(t.get("preempted", 0.0)) for t in self.resume_timings),
            # When this attempt began: its worker process's start (a Ray Train restart starts new actors), but not
            # before the checkpoint it resumes was written (the actor may run in a process Ray started earlier).
            attempt_start_unix=None if started is None else max(started, loaded.meta.saved_unix),
        )

    def checkpoint_meta(
        self,
        cfg: TrainingConfig,
        manifest: Manifest,
        *,
        data_left: list[tuple[int, int]],
        preempted: bool,
        **recorded: Any,
    ) -> ckpt.CheckpointMeta:
        """What a checkpoint's ``meta.json`` records of this run now, ``data_left`` of its epoch's order untrained;
        ``recorded``: the fields of :class:`~training_core.checkpoint.CheckpointMeta` the run's other parts hold."""
        return ckpt.CheckpointMeta(
            model_name=cfg.model.name,
            classes=manifest.classes,
            input_shape=manifest.input_shape,
            mean=manifest.mean,
            std=manifest.std,
            epoch=self.epoch,
            step_in_epoch=self.step_in_epoch,
            global_step=self.global_step,
            config=redact(cfg.to_dict()),  # a record only: the run's real config stays in memory
            best_metric=self.best_metric,
            history=list(self.history),
            step_log=list(self.step_log.records),
            resumed_from_steps=list(self.resumed_from_steps),
            resume_timings=[dict(t) for t in self.resume_timings],
            elapsed_s=self.elapsed_s,
            data=manifest.description(),
            data_remaining=[list(pair) for pair in data_left],
            data_exhausted=self.step_in_epoch > 0 and not data_left,
            preempted=preempted,
            saved_unix=time.time(),
            **recorded,
        )


def choose_checkpoint(
    storage: Any, *, resume_from: str, model: nn.Module, runtime: WorkerRuntime
) -> tuple[ckpt.LoadedCheckpoint | None, bool]:
    """The newest valid checkpoint of this run under ``storage`` (a worker restart or a task retry), else the
    ``resume_from`` checkpoint (a fine-tune, the next slice of a trial), else None; and whether it is this run's.

    Every rank chooses on its own, then all check they chose the same step (a collective): else a shard read while
    another rank wrote it, or a flaky read, would resume ranks from different states."""
    loaded = ckpt.load_latest_valid(storage, expected_shapes=ckpt.model_state_shapes(model))
    same_run = loaded is not None
    if loaded is None and resume_from:
        loaded = ckpt.load_directory(resume_from)
    step = float(loaded.meta.global_step) if loaded is not None else -1.0
    total, squares = all_reduce_sum([step, step * step], runtime.device)
    if squares * runtime.world_size != total * total:  # the steps' variance over the ranks is not 0
        if loaded is not None:
            loaded.release()
        raise ckpt.CheckpointError(
            f"rank {runtime.rank} chose the checkpoint of step {int(step)} (-1: none) but another rank chose another "
            f"one under {storage.display_uri()}: storage changed while the ranks read it; a restart reads it again"
        )
    return loaded, same_run


class CheckpointWrites:
    """Hands a checkpoint's objects to the :class:`~training_core.checkpoint.Checkpointer` the way this run holds
    them (``scaling.strategy``)."""

    def __init__(
        self,
        root: str,
        checkpoint: CheckpointConfig,
        *,
        objects: dict[str, Any],
        observer: Any,
        rank: int,
        sharded: bool,
        process_group: Any,
    ) -> None:
        """The writes of a run whose checkpoints go under ``root`` by the ``checkpoint`` policy, reported to
        ``observer``; ``objects``: the run's model, optimizer, scheduler and GradScaler, by those names."""
        self.objects, self.rank, self.sharded, self.process_group = objects, rank, sharded, process_group
        self.checkpointer = ckpt.Checkpointer(
            ckpt.open_storage(root, checkpoint),
            keep_last=checkpoint.keep_last,
            interval_steps=checkpoint.interval_steps,
            at_epoch_end=checkpoint.at_epoch_end,
            keep_best=checkpoint.keep_best,
            best_mode=METRIC_DIRECTIONS[checkpoint.best_metric],
            async_save=checkpoint.async_save,
            max_consecutive_failures=checkpoint.max_consecutive_save_failures,
            observer=observer,
        )

    def write(
        self, global_step: int, *, meta: ckpt.CheckpointMeta | None, metric: float | None, torch_rng: Any, replicas: Any
    ) -> None:
        """This rank's part of the checkpoint of ``global_step`` (``meta``: rank 0's, None elsewhere)."""
        objects = self.objects
        if self.sharded:  # every rank writes its shard
            trainer_state = {name: objects[name].state_dict() for name in ("scheduler", "scaler")} | {"rng": torch_rng}
            self.checkpointer.save_sharded(
                global_step,
                model=objects["model"],
                optimizer=objects["optimizer"],
                trainer_state=ckpt.detached(trainer_state) if self.rank == 0 else None,
                meta=meta,
                metric=metric,
                process_group=self.process_group,
            )
        elif self.rank == 0:
            staged = self.checkpointer.stage(**objects, meta=meta, torch_rng=torch_rng, replicas=replicas)
            self.checkpointer.save(global_step, staged, metric=metric)
