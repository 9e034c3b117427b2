"""A run attempt's accounting at each log window, checkpoint and validation: where this rank's seconds went
(:class:`~training_core.telemetry.goodput.GoodputClock`, summed over the ranks and carried across attempts in the
checkpoint's ``meta.telemetry["goodput"]``), which rank slows the others
(:class:`~training_core.telemetry.stragglers.StragglerDetector`) and the run's progress and ETA
(:class:`~training_core.telemetry.eta.EtaEstimator`).

Contract. Every rank holds one :class:`RunAccounting` and calls it at the same points (window closes and checkpoint
syncs are collectives: one small all-reduce each). Rank 0's figures are the ones recorded; every rank reaches the
same straggler verdict and sets its own ``training_straggler`` gauge.

An attempt that fails cannot write a checkpoint at its end, so its progress goes to a record beside the checkpoints
(:class:`ProgressLog`, :data:`PROGRESS_FILE` in their root, which every attempt of the run shares): rank 0 replaces it
at each log window with the attempt's last finished step and its time, and a rank that sees the attempt fail (an
error, a collective's timeout) adds the end. The next attempt reads it on resume and settles the interrupted one
with it (:func:`~training_core.telemetry.goodput.settle_interrupted`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from training_core.parallel.distributed import all_gather_objects, all_reduce_sum
from training_core.telemetry.eta import EtaEstimator, EtaReading, Progress
from training_core.telemetry.goodput import (
    CATEGORIES,
    AttemptGoodput,
    Category,
    ExecutionGoodput,
    GoodputClock,
    GoodputSeconds,
    LastProgress,
    Outcome,
    recompute_through_step,
    settle_interrupted,
)
from training_core.telemetry.stragglers import CAUSES, Straggler, StragglerDetector, rank_slots, rank_windows

if TYPE_CHECKING:
    import torch

    from training_core import checkpoint as ckpt
    from training_core.checkpoint.storage import Storage
    from training_core.config import TrainingConfig

log = logging.getLogger("training_core")

GOODPUT_KEY = "goodput"
"""The entry of a checkpoint's ``meta.telemetry`` that carries the execution's goodput across attempts."""
RANKS_KEY = "ranks"
"""The entry of a checkpoint's ``meta.telemetry`` with every rank's window sums and straggler flags."""
ETA_KEY = "eta"
"""The entry of a checkpoint's ``meta.telemetry`` with the ETA read at the first window after each validation (when
it first counts that validation's time), to check against the run's real end; at most :data:`MAX_ETA_READINGS`."""
MAX_ETA_READINGS = 64
PROGRESS_FILE = "progress.json"
"""The latest attempt's progress record, in the root of the run's checkpoints (:class:`ProgressLog`)."""
PROGRESS_MAX_BYTES = 4096


@dataclass(frozen=True)
class ProgressRecord:
    """An attempt's last progress as :class:`ProgressLog` stores it: which attempt (its start, the same on every
    rank), its last finished step and when the window that closed it ended, and its end when a rank saw it fail."""

    attempt_start_unix: float
    global_step: int
    step_unix: float
    end_unix: float | None = None

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ProgressRecord:
        """The record :meth:`to_json` wrote; ValueError for anything else."""
        try:
            saved = json.loads(data)
            end = saved["end_unix"]
            return cls(
                float(saved["attempt_start_unix"]),
                int(saved["global_step"]),
                float(saved["step_unix"]),
                None if end is None else float(end),
            )
        except (TypeError, KeyError, AttributeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a progress record ({type(exc).__name__})") from None


class ProgressLog:
    """:data:`PROGRESS_FILE` in a run's checkpoint storage, written off the training thread: :meth:`note` hands the
    newest record to a writer thread (an older one not yet written is dropped), so a step never waits for storage;
    :meth:`close` waits for the last one. A record that cannot be written or read is a warning, never an error:
    without it the next attempt counts the interrupted one's time after its checkpoint as recomputed."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._pending: ProgressRecord | None = None
        self._warned = False
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None
        """The thread writing the pending records; it ends when none is left."""

    def read(self) -> ProgressRecord | None:
        try:
            data = self.storage.read_note(PROGRESS_FILE, max_bytes=PROGRESS_MAX_BYTES)
            return None if data is None else ProgressRecord.from_json(data)
        except Exception as exc:  # noqa: BLE001 - a bad record only costs the split of the interrupted attempt
            log.warning("the progress record %s is unusable (%s): ignored", PROGRESS_FILE, exc)
            return None

    def note(self, record: ProgressRecord) -> None:
        with self._lock:
            self._pending = record
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_pending, name="progress-record", daemon=True)
                self._writer.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait (up to ``timeout_s``) until the last noted record is written."""
        with self._lock:
            writer = self._writer
        if writer is not None:
            writer.join(timeout=timeout_s)

    def _write_pending(self) -> None:
        while True:
            with self._lock:
                record, self._pending = self._pending, None
                if record is None:
                    self._writer = None
                    return
            try:
                self.storage.write_note(PROGRESS_FILE, record.to_json())
            except Exception as exc:  # noqa: BLE001 - see the class docstring
                if not self._warned:
                    self._warned = True
                    log.warning("writing the progress record %s failed (%s); retried at the next", PROGRESS_FILE, exc)


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
    progress_log: ProgressLog | None = None
    """Where this attempt's progress is recorded for the next one; None: nowhere."""
    last_window: tuple[int, float] | None = None
    """The global step and unix time of this attempt's latest window close."""
    eta_readings: list[EtaReading] = field(default_factory=list)
    """The run's ETA at the first window after each validation (the earlier attempts' included)."""
    validated: bool = False
    """A validation ended since the latest window."""

    @classmethod
    def for_run(
        cls, cfg: TrainingConfig, runtime: Any, *, total_steps: int, end_epoch: int, storage: Storage | None = None
    ) -> RunAccounting:
        """The accounting of a run of ``cfg`` on ``runtime``'s rank (a collective, see :meth:`start`), its progress
        recorded in ``storage`` (the run's checkpoint storage)."""
        accounting = cls.start(
            rank=runtime.rank,
            world_size=runtime.world_size,
            device=runtime.device,
            total_steps=total_steps,
            interval_steps=cfg.checkpoint.interval_steps,
            threshold=cfg.observability.straggler_threshold,
            windows=cfg.observability.straggler_windows,
            min_excess_s=cfg.observability.straggler_min_excess_s,
            started_unix=getattr(runtime, "started_unix", None),
        )
        accounting.end_epoch = end_epoch
        accounting.progress_log = ProgressLog(storage) if storage is not None else None
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
        min_excess_s: float,
        started_unix: float | None,
    ) -> RunAccounting:
        """A fresh attempt's accounting, its clock started at the earliest rank's ``started_unix`` (its worker
        process's start; now when unknown): every rank counts from the same moment, so the ranks' seconds add up to
        workers x wall. A collective: the ranks exchange their host names and starts once."""
        now_unix, now_s = time.time(), time.monotonic()
        own_start_unix = min(now_unix, started_unix) if started_unix is not None else now_unix
        nodes, starts = zip(*all_gather_objects((socket.gethostname(), own_start_unix), world_size))
        start_unix = min(starts)
        return cls(
            rank=rank,
            world_size=world_size,
            device=device,
            total_steps=total_steps,
            interval_steps=interval_steps,
            clock=GoodputClock(start_s=now_s - (now_unix - start_unix)),
            detector=StragglerDetector(nodes=nodes, threshold=threshold, windows=windows, min_excess_s=min_excess_s),
            eta=EtaEstimator(total_steps=total_steps),
            start_unix=start_unix,
            ranks=[RankTotals(rank=r, node=n) for r, n in enumerate(nodes)],
        )

    def resumed(self, meta: ckpt.CheckpointMeta) -> None:
        """This attempt resumes ``meta``'s run: the earlier attempts' goodput is carried, the last one settled up to
        this attempt's start (not before the checkpoint was written: Ray may place a restarted worker in a process
        its pool started earlier), and this attempt's time before its first step is start-up (or the
        preemption's). The interrupted attempt's progress record, when it is the one that attempt left, splits its
        time after the checkpoint, and this attempt's steps up to its last count as recomputed. The same on every
        rank: no collective."""
        prior = ExecutionGoodput.from_summary(meta.telemetry.get(GOODPUT_KEY))
        attempt_start_unix = min(time.time(), max(self.start_unix, meta.saved_unix))
        self.clock.cursor_s += attempt_start_unix - self.start_unix
        self.start_unix = attempt_start_unix
        progress = None
        if prior.attempts and prior.attempts[-1].outcome != "finished":  # a slice's end is no interruption
            last = prior.attempts[-1]
            progress = self.interrupted_progress(last.start_unix) if not meta.preempted else None
            settled = settle_interrupted(
                last, resumed_unix=self.start_unix, preempted=meta.preempted, progress=progress
            )
            prior = prior.with_attempt(settled)
        self.prior, self.execution = prior, prior
        self.eta_readings = [EtaReading.from_dict(saved) for saved in meta.telemetry.get(ETA_KEY, [])]
        self.attempt_index = len(prior.attempts)
        self.clock.recompute_through_step = recompute_through_step(meta.global_step, progress)
        self.clock.before_first = "preempted" if meta.preempted else "startup"

    def interrupted_progress(self, attempt_start_unix: float) -> LastProgress | None:
        """The progress record of the attempt that started at ``attempt_start_unix`` (None when the record is
        another attempt's, or there is none)."""
        record = self.progress_log.read() if self.progress_log is not None else None
        if record is None or record.attempt_start_unix != attempt_start_unix:
            return None
        return LastProgress(record.global_step, record.step_unix, record.end_unix)

    def end(self, *, failed: bool) -> None:
        """This rank's attempt ends: a failure it sees (after a window of this attempt) adds its end to the
        progress record, which is then written out."""
        if self.progress_log is None:
            return
        if failed and self.last_window is not None:
            step, step_unix = self.last_window
            self.progress_log.note(ProgressRecord(self.start_unix, step, step_unix, end_unix=time.time()))
        self.progress_log.close()

    def step(self, *, global_step: int, step_time_s: float, data_wait_s: float, comm_wait_s: float) -> None:
        """A step ended now. The loop's time before it that no step or stall measured (an epoch's loader opening)
        goes to the ETA's overhead: the time ahead has it too."""
        now_s = time.monotonic()
        if self.clock.stepped:  # before the first step, the time is the attempt's start-up
            self.eta.gap(now_s - self.clock.cursor_s - step_time_s)
        self.clock.step(
            end_s=now_s,
            global_step=global_step,
            step_time_s=step_time_s,
            data_wait_s=data_wait_s,
            comm_wait_s=comm_wait_s,
        )

    def stall(self, category: Category) -> None:
        """A checkpoint stall or a validation just ended: it, and the loop's time since the last reported moment (the
        window's close, the checkpoint's collectives), is ``category`` and overhead for the ETA."""
        now_s = time.monotonic()
        self.eta.overhead(now_s - self.clock.cursor_s)
        self.clock.span(category, end_s=now_s)
        self.validated = self.validated or category == "evaluation"

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
        self.last_window = (global_step, time.time())
        if self.rank == 0 and self.progress_log is not None:
            self.progress_log.note(ProgressRecord(self.start_unix, global_step, self.last_window[1]))
        if self.validated and self.progress.eta_s is not None:
            self.validated = False
            self.eta_readings.append(EtaReading(global_step, self.last_window[1], self.progress.eta_s))
            if len(self.eta_readings) > MAX_ETA_READINGS:  # the first, the earliest full estimate, stays
                del self.eta_readings[1]
        return self.flagged

    def sync(self, *, outcome: Outcome = "running") -> ExecutionGoodput:
        """The time up to now counted as a checkpoint's (the caller is writing one), summed over the ranks into the
        execution's record (a collective)."""
        self.stall("checkpoint")
        summed = all_reduce_sum(self.clock.seconds.as_list(), self.device)
        self._record(GoodputSeconds.from_list(summed), outcome=outcome)
        return self.execution

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint's ``meta.telemetry`` carries of this accounting (the latest sync's)."""
        return {
            GOODPUT_KEY: self.execution.summary(),
            RANKS_KEY: [dataclasses.asdict(r) for r in self.ranks],
            ETA_KEY: [dataclasses.asdict(r) for r in self.eta_readings],
        }

    def next_checkpoint(self, global_step: int) -> int | None:
        """The next interval checkpoint's step, or the run's last (which always saves); None without an interval."""
        if not self.interval_steps:
            return None
        return min(self.total_steps, (global_step // self.interval_steps + 1) * self.interval_steps)

    def own_causes(self) -> dict[str, float]:
        """This rank's ``training_straggler`` gauge values by cause: 1 for the cause it is flagged for now."""
        mine = [s.cause for s in self.flagged if s.rank == self.rank]
        return {cause: 1.0 if cause in mine else 0.0 for cause in CAUSES}

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


def goodput_metrics(execution: ExecutionGoodput) -> dict[str, float]:
    """The execution's goodput for MLflow: the ratio and the worker-seconds per category."""
    seconds = zip(CATEGORIES, execution.seconds.as_list())
    return {"goodput": execution.goodput} | {f"goodput_{name}_s": value for name, value in seconds}
