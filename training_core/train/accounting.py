"""A run attempt's accounting at each log window, checkpoint and validation: where this rank's seconds went
(:class:`~training_core.telemetry.goodput.GoodputClock`, summed over the ranks and carried across attempts in the
checkpoint's ``meta.telemetry["goodput"]``), which rank slows the others
(:class:`~training_core.telemetry.stragglers.StragglerDetector`) and the run's progress and ETA
(:class:`~training_core.telemetry.eta.EtaEstimator`).

Contract. Every rank holds one :class:`RunAccounting` and calls it at the same points (window closes and checkpoint
syncs are collectives: one small all-reduce each). Rank 0's figures are the ones recorded; every rank reaches the
same straggler verdict and sets its own ``training_straggler`` gauge.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from training_core.parallel.distributed import all_reduce_sum
from training_core.telemetry.eta import EtaEstimator, Progress
from training_core.telemetry.goodput import (
    CATEGORIES,
    AttemptGoodput,
    ExecutionGoodput,
    GoodputClock,
    GoodputSeconds,
    Outcome,
    settle_interrupted,
)
from training_core.telemetry.stragglers import Straggler, StragglerDetector, rank_slots, rank_windows

if TYPE_CHECKING:
    import torch

    from training_core import checkpoint as ckpt
    from training_core.config import TrainingConfig

log = logging.getLogger("training_core")

GOODPUT_KEY = "goodput"
"""The entry of a checkpoint's ``meta.telemetry`` that carries the execution's goodput across attempts."""
RANKS_KEY = "ranks"
"""The entry of a checkpoint's ``meta.telemetry`` with every rank's window sums and straggler flags."""


@dataclass
class RankTotals:
    """One rank's seconds over this attempt's log windows, and how often it was flagged."""

    rank: int
    node: str
    compute_s: float = 0.0
    data_wait_s: float = 0.0
    comm_wait_s: float = 0.0
    flagged_windows: int = 0
    cause: str = ""
    """The cause of its latest flag ("compute" or "data"); empty when it was never flagged."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class WindowTimes:
    """This rank's seconds over one log window, taken before the meter closes it."""

    steps: int
    step_s: float
    data_wait_s: float
    comm_wait_s: float


@dataclass
class RunAccounting:
    """This rank's goodput clock, the straggler detector and the ETA of one run attempt (see the module docstring)."""

    rank: int
    world_size: int
    device: torch.device
    nodes: Sequence[str]
    total_steps: int
    interval_steps: int
    clock: GoodputClock
    detector: StragglerDetector
    eta: EtaEstimator
    start_unix: float
    attempt_index: int = 0
    end_epoch: int = 0
    """The epoch this call of the run stops before (``loop.stop_at_epoch`` for a slice): its last checkpoint ends the
    attempt as finished."""
    prior: ExecutionGoodput = field(default_factory=ExecutionGoodput)
    ranks: list[RankTotals] = field(default_factory=list)
    execution: ExecutionGoodput = field(default_factory=ExecutionGoodput)
    """The execution's goodput as of the latest sync (the same on every rank)."""
    progress: Progress | None = None
    flagged: tuple[Straggler, ...] = ()

    @classmethod
    def for_run(cls, cfg: TrainingConfig, runtime: Any, *, total_steps: int, end_epoch: int) -> RunAccounting:
        """The accounting of a run of ``cfg`` on ``runtime``'s rank (a collective, see :meth:`start`)."""
        accounting = cls.start(
            rank=runtime.rank,
            world_size=runtime.world_size,
            device=runtime.device,
            total_steps=total_steps,
            interval_steps=cfg.checkpoint.interval_steps,
            threshold=cfg.observability.straggler_threshold,
            windows=cfg.observability.straggler_windows,
            started_unix=getattr(runtime, "started_unix", None),
        )
        accounting.end_epoch = end_epoch
        return accounting

    @classmethod
    def start(
        cls,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        total_steps: int,
        interval_steps: int,
        threshold: float,
        windows: int,
        started_unix: float | None,
    ) -> RunAccounting:
        """A fresh attempt's accounting, its clock started at the earliest rank's ``started_unix`` (its worker
        process's start; now when unknown): every rank counts from the same moment, so the ranks' seconds add up to
        workers x wall. A collective: the ranks exchange their host names and starts once."""
        now_unix, now_s = time.time(), time.monotonic()
        own_start_unix = min(now_unix, started_unix) if started_unix is not None else now_unix
        nodes, starts = zip(*gather_hosts(world_size, own_start_unix))
        start_unix = min(starts)
        return cls(
            rank=rank,
            world_size=world_size,
            device=device,
            nodes=list(nodes),
            total_steps=total_steps,
            interval_steps=interval_steps,
            clock=GoodputClock(start_s=now_s - (now_unix - start_unix)),
            detector=StragglerDetector(nodes=nodes, threshold=threshold, windows=windows),
            eta=EtaEstimator(total_steps=total_steps),
            start_unix=start_unix,
            ranks=[RankTotals(rank=r, node=n) for r, n in enumerate(nodes)],
        )

    def resumed(self, meta: ckpt.CheckpointMeta) -> None:
        """This attempt resumes ``meta``'s run: the earlier attempts' goodput is carried, the last one settled up to
        this attempt's start (not before the checkpoint was written: Ray may place a restarted worker in a process
        its pool started earlier), and this attempt's time before its first step is start-up (or the
        preemption's). The same on every rank: no collective."""
        prior = ExecutionGoodput.from_summary(meta.telemetry.get(GOODPUT_KEY))
        attempt_start_unix = min(time.time(), max(self.start_unix, meta.saved_unix))
        self.clock.cursor_s += attempt_start_unix - self.start_unix
        self.start_unix = attempt_start_unix
        if prior.attempts and prior.attempts[-1].outcome != "finished":  # a slice's end is no interruption
            settled = settle_interrupted(prior.attempts[-1], resumed_unix=self.start_unix, preempted=meta.preempted)
            prior = prior.with_attempt(settled)
        self.prior, self.execution = prior, prior
        self.attempt_index = len(prior.attempts)
        self.clock.recompute_through_step = meta.global_step
        self.clock.before_first = "preempted" if meta.preempted else "startup"

    def step(self, *, global_step: int, step_time_s: float, data_wait_s: float, comm_wait_s: float) -> None:
        self.clock.step(
            end_s=time.monotonic(),
            global_step=global_step,
            step_time_s=step_time_s,
            data_wait_s=data_wait_s,
            comm_wait_s=comm_wait_s,
        )

    def stall(self, category: str, seconds: float) -> None:
        """A checkpoint stall or a validation of ``seconds`` just ended."""
        self.clock.span(category, end_s=time.monotonic())  # type: ignore[arg-type]
        self.eta.overhead(seconds)

    def window(self, times: WindowTimes, *, global_step: int) -> tuple[Straggler, ...]:
        """A log window closed (a collective): the ranks' windows and goodput summed, stragglers flagged (the new
        ones are logged by rank 0), the ETA updated. Returns the ranks flagged now."""
        own = rank_slots(
            self.rank,
            self.world_size,
            step_s=times.step_s,
            data_wait_s=times.data_wait_s,
            comm_wait_s=times.comm_wait_s,
        )
        summed = all_reduce_sum([*own, *self.clock.seconds.as_list()], self.device)
        slots, goodput = summed[: len(own)], summed[len(own) :]
        windows = rank_windows(slots)
        self.flagged = self.detector.observe(windows)
        self._add_to_totals(windows)
        if self.rank == 0:
            for straggler in self.flagged:
                if straggler.new:
                    log.warning("%s", straggler.message())
        self._record(GoodputSeconds.from_list(goodput), outcome="running")
        self.eta.window(num_steps=times.steps, step_time_s=times.step_s)
        self.progress = self.eta.estimate(
            global_step=global_step, next_checkpoint_step=self.next_checkpoint(global_step)
        )
        return self.flagged

    def sync(self, *, outcome: Outcome = "running") -> ExecutionGoodput:
        """The time up to now counted as a checkpoint's (the caller is writing one), summed over the ranks into the
        execution's record (a collective)."""
        self.clock.span("checkpoint", end_s=time.monotonic())
        summed = all_reduce_sum(self.clock.seconds.as_list(), self.device)
        self._record(GoodputSeconds.from_list(summed), outcome=outcome)
        return self.execution

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint's ``meta.telemetry`` carries of this accounting (the latest sync's)."""
        return {GOODPUT_KEY: self.execution.summary(), RANKS_KEY: [r.as_dict() for r in self.ranks]}

    def next_checkpoint(self, global_step: int) -> int | None:
        """The next interval checkpoint's step, or the run's last (which always saves); None without an interval."""
        if not self.interval_steps:
            return None
        return min(self.total_steps, (global_step // self.interval_steps + 1) * self.interval_steps)

    def own_causes(self) -> dict[str, float]:
        """This rank's ``training_straggler`` gauge values by cause: 1 for the cause it is flagged for now."""
        mine = [s.cause for s in self.flagged if s.rank == self.rank]
        return {cause: 1.0 if cause in mine else 0.0 for cause in ("compute", "data")}

    def progress_metrics(self) -> dict[str, float]:
        """The window's progress for the step log line and MLflow: the ETA (when known) and the fraction done."""
        if self.progress is None or self.progress.eta_s is None:
            return {}
        found = {"eta_s": self.progress.eta_s, "progress": self.progress.fraction_done}
        if self.progress.eta_checkpoint_s is not None:
            found["eta_checkpoint_s"] = self.progress.eta_checkpoint_s
        return found

    def _record(self, seconds: GoodputSeconds, *, outcome: Outcome) -> None:
        attempt = AttemptGoodput(
            index=self.attempt_index,
            num_workers=self.world_size,
            start_unix=self.start_unix,
            end_unix=time.time(),
            outcome=outcome,
            seconds=seconds,
        )
        self.execution = self.prior.with_attempt(attempt)

    def _add_to_totals(self, windows: Sequence[Any]) -> None:
        flagged = {s.rank: s for s in self.flagged}
        for window, totals in zip(windows, self.ranks):
            totals.compute_s += window.compute_s
            totals.data_wait_s += window.data_wait_s
            totals.comm_wait_s += window.comm_wait_s
            if window.rank in flagged:
                totals.flagged_windows += 1
                totals.cause = flagged[window.rank].cause


def gather_hosts(world_size: int, start_unix: float) -> list[tuple[str, float]]:
    """Every rank's host name and ``start_unix``, by rank (a collective when a process group is up)."""
    import torch.distributed as dist

    own = (socket.gethostname(), start_unix)
    if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return [own] * world_size
    found: list[Any] = [None] * world_size
    dist.all_gather_object(found, own)
    return [(str(name), float(start)) for name, start in found]


def goodput_metrics(execution: ExecutionGoodput) -> dict[str, float]:
    """The execution's goodput for MLflow: the ratio and the worker-seconds per category."""
    seconds = execution.seconds
    return {"goodput": execution.goodput} | {
        f"goodput_{name}_s": value for name, value in zip(CATEGORIES, seconds.as_list())
    }
