"""Where the job's worker-seconds went: every second of every worker, from the first attempt's start to the end,
attributed to exactly one category (:data:`CATEGORIES`), per run attempt and for the whole execution.

Contract. One :class:`GoodputClock` per worker and run attempt (a Flyte retry or a Ray Train restart) attributes the
time from the attempt's start to each reported moment, and nothing else: every call attributes exactly the seconds
since the previous one, so the categories always add up to the time elapsed (workers x wall, summed over ranks).

- Before the attempt's first step: ``startup`` (scheduling, imports, joining the process group, the restore), or
  ``preempted`` when the attempt resumes a preemption's just-in-time checkpoint (what the stop cost, as in
  :mod:`~training_core.telemetry.cost`).
- A step (:meth:`GoodputClock.step`): its data wait is ``data_wait``, the communication it waited for (not hidden
  behind compute) is ``communication``, the rest ``productive``; the whole step is ``recomputed`` when its global
  step was already trained by an interrupted earlier attempt (``recompute_through_step``). Time between the
  previous reported moment and the step's start (the loop between epochs) counts as the step's data wait.
- A checkpoint stall or a validation (:meth:`GoodputClock.span`): ``checkpoint`` or ``evaluation``, with the time
  before it.
- The attempt's end (:meth:`GoodputClock.close`): after its last step, ``idle`` when it finished (ranks waiting for
  the others, shutdown), ``hung`` when it failed (waiting on a collective until its timeout), ``preempted`` after a
  stop signal.

An interrupted attempt cannot record its own end (the process is killed). The next attempt settles it
(:func:`settle_interrupted`) from what the checkpoint carries and, when known, the attempt's last progress
(:class:`LastProgress`): the time from its last record to its last step kept ``productive`` (those steps are then
``recomputed`` by the next attempt), to its end ``hung``, to the next attempt's start ``startup`` (the retry's
scheduling). An end it could not write (a SIGKILL: nothing of it ran after its last step's record) is taken as that
record's time: none of the rest is ``hung`` (a killed process waits on nothing), all of it ``startup`` (detecting the
loss and starting again). Without :class:`LastProgress` all of it counts as ``recomputed``: work lost after the
checkpoint.

:class:`ExecutionGoodput` is the record a checkpoint's ``meta.telemetry`` carries across attempts (as the cost is):
:meth:`ExecutionGoodput.summary` writes it, :meth:`ExecutionGoodput.from_summary` reads it back, and
:meth:`ExecutionGoodput.with_attempt` merges an attempt's newer record. Pure arithmetic: no clock is read here.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

Category = Literal[
    "productive",
    "data_wait",
    "communication",
    "checkpoint",
    "evaluation",
    "startup",
    "recomputed",
    "preempted",
    "hung",
    "idle",
]
CATEGORIES: tuple[Category, ...] = typing.get_args(Category)
"""Every category, in the order of :meth:`GoodputSeconds.as_list` (and of the dashboard's stack)."""
CATEGORY_INDEX: dict[str, int] = {name: index for index, name in enumerate(CATEGORIES)}

Outcome = Literal["running", "finished", "failed", "preempted"]
OUTCOMES: tuple[Outcome, ...] = typing.get_args(Outcome)
TAIL_CATEGORY: dict[Outcome, Category] = {"finished": "idle", "failed": "hung", "preempted": "preempted"}
"""What the time after an attempt's last step went to, by how the attempt ended."""


@dataclass(frozen=True)
class GoodputSeconds:
    """Worker-seconds by category (one worker's, or summed over workers and attempts)."""

    productive: float = 0.0
    data_wait: float = 0.0
    communication: float = 0.0
    checkpoint: float = 0.0
    evaluation: float = 0.0
    startup: float = 0.0
    recomputed: float = 0.0
    preempted: float = 0.0
    hung: float = 0.0
    idle: float = 0.0

    @property
    def total_s(self) -> float:
        return math.fsum(self.as_list())

    @property
    def goodput(self) -> float:
        """Productive seconds over all of them (0 before any second is attributed)."""
        total = self.total_s
        return self.productive / total if total > 0 else 0.0

    def as_list(self) -> list[float]:
        """The seconds in :data:`CATEGORIES` order: what an all-reduce over the ranks sums."""
        return [getattr(self, name) for name in CATEGORIES]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> GoodputSeconds:
        assert len(values) == len(CATEGORIES), f"{len(values)} values for {len(CATEGORIES)} categories"
        return cls(*(float(v) for v in values))

    def __add__(self, other: GoodputSeconds) -> GoodputSeconds:
        return GoodputSeconds.from_list([a + b for a, b in zip(self.as_list(), other.as_list())])

    def plus(self, category: Category, seconds: float) -> GoodputSeconds:
        return dataclasses.replace(self, **{category: getattr(self, category) + seconds})

    def scaled(self, factor: float) -> GoodputSeconds:
        return GoodputSeconds.from_list([v * factor for v in self.as_list()])


class GoodputClock:
    """One worker's attribution of one run attempt, fed as the loop runs (see the module docstring). Times are
    seconds on one monotonic clock; durations are measured on the same or a finer one."""

    def __init__(self, *, start_s: float, recompute_through_step: int = 0, after_preemption: bool = False) -> None:
        self.cursor_s = start_s
        """The end of the time attributed so far."""
        self.recompute_through_step = recompute_through_step
        self.before_first = "preempted" if after_preemption else "startup"
        self.stepped = False
        self._seconds = [0.0] * len(CATEGORIES)

    @property
    def seconds(self) -> GoodputSeconds:
        """What is attributed so far: up to the last reported moment (a counter's value: it never decreases)."""
        return GoodputSeconds.from_list(self._seconds)

    def step(
        self, *, end_s: float, global_step: int, step_time_s: float, data_wait_s: float, comm_wait_s: float
    ) -> None:
        """A step ended at ``end_s``, of ``step_time_s`` wall time: ``data_wait_s`` waiting for input and
        ``comm_wait_s`` waiting for communication of it."""
        elapsed = self._advance(end_s)
        if not self.stepped:  # the time before the attempt's first step is its start-up
            self.stepped = True
            lead_s = max(0.0, elapsed - step_time_s)
            self._add(self.before_first, lead_s)
            elapsed -= lead_s
        if global_step <= self.recompute_through_step:
            self._add("recomputed", elapsed)
            return
        step_s = min(step_time_s, elapsed)
        waits = max(0.0, data_wait_s) + max(0.0, comm_wait_s)
        share = min(1.0, step_s / waits) if waits > 0 else 0.0  # waits cannot exceed the step they are part of
        comm_s = max(0.0, comm_wait_s) * share
        productive_s = max(0.0, step_s - max(0.0, data_wait_s) * share - comm_s)
        self._add("communication", comm_s)
        self._add("productive", productive_s)
        self._add("data_wait", elapsed - comm_s - productive_s)  # with the time before the step

    def span(self, category: Category, *, end_s: float) -> None:
        """A checkpoint stall or a validation ended at ``end_s``; it (and the time before it) is ``category``."""
        assert category in ("checkpoint", "evaluation"), category
        elapsed = self._advance(end_s)
        self._add(self.before_first if not self.stepped else category, elapsed)

    def close(self, *, end_s: float, outcome: Outcome) -> GoodputSeconds:
        """The attempt ended at ``end_s`` as ``outcome``: the time since the last step is its tail's category
        (start-up when it never stepped). Returns the attempt's seconds."""
        assert outcome != "running", outcome
        elapsed = self._advance(end_s)
        self._add(TAIL_CATEGORY[outcome] if self.stepped else self.before_first, elapsed)
        return self.seconds

    def _advance(self, end_s: float) -> float:
        """Seconds from the cursor to ``end_s`` (none if it lies before), and the cursor moved there."""
        elapsed = max(0.0, end_s - self.cursor_s)
        self.cursor_s = max(self.cursor_s, end_s)
        return elapsed

    def _add(self, category: Category, seconds: float) -> None:
        self._seconds[CATEGORY_INDEX[category]] += seconds


@dataclass(frozen=True)
class LastProgress:
    """What an interrupted attempt reached, recorded outside its checkpoints (it cannot write one at its end)."""

    global_step: int
    """Its last finished step: the next attempt trains the steps after its checkpoint up to this one again."""
    step_unix: float
    end_unix: float | None = None
    """When it ended: the failure, or the collective timeout of a hang; None when it could not record it (killed),
    then taken as ``step_unix`` (see the module docstring)."""

    @property
    def ended_unix(self) -> float:
        """Its end, or its last step's time when the end is unknown."""
        return self.step_unix if self.end_unix is None else max(self.step_unix, self.end_unix)

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> LastProgress:
        end = saved.get("end_unix")
        return cls(int(saved["global_step"]), float(saved["step_unix"]), None if end is None else float(end))


@dataclass(frozen=True)
class AttemptGoodput:
    """One run attempt's seconds, summed over its workers, as of ``end_unix``."""

    index: int
    """The attempt's place in the execution: 0 for the first, then one more per resume."""
    num_workers: int
    start_unix: float
    end_unix: float
    """When this record was taken (the attempt's end once it has one)."""
    outcome: Outcome
    seconds: GoodputSeconds
    last_progress: LastProgress | None = None
    """Where an interrupted attempt got to after its last checkpoint, as the next attempt settled it (None: unknown,
    or the attempt was not interrupted)."""

    @property
    def wall_s(self) -> float:
        return max(0.0, self.end_unix - self.start_unix)

    @property
    def goodput(self) -> float:
        return self.seconds.goodput

    @property
    def attributed_fraction(self) -> float:
        """Attributed seconds over workers x wall: 1 when nothing is missing or counted twice."""
        held = self.num_workers * self.wall_s
        return self.seconds.total_s / held if held > 0 else 1.0


def settle_interrupted(
    attempt: AttemptGoodput, *, resumed_unix: float, preempted: bool, progress: LastProgress | None = None
) -> AttemptGoodput:
    """``attempt`` as its checkpoint recorded it, its unrecorded time up to ``resumed_unix`` (the next attempt's start)
    attributed as the module docstring says, each span clipped to what lies between the record and ``resumed_unix``."""
    workers, seconds = attempt.num_workers, attempt.seconds
    cursor = attempt.end_unix
    end = max(cursor, resumed_unix)
    if preempted:
        parts: list[tuple[Category, float]] = [("preempted", end)]
    elif progress is None:
        parts = [("recomputed", end)]
    else:
        parts = [("productive", progress.step_unix), ("hung", progress.ended_unix), ("startup", end)]
    for category, until in parts:
        until = min(max(until, cursor), end)
        seconds = seconds.plus(category, workers * (until - cursor))
        cursor = until
    outcome: Outcome = "preempted" if preempted else "failed"
    kept = None if preempted else progress
    return dataclasses.replace(attempt, end_unix=end, outcome=outcome, seconds=seconds, last_progress=kept)


def recompute_through_step(checkpoint_step: int, progress: LastProgress | None) -> int:
    """The last step a resumed attempt trains again: the interrupted attempt's last, when known, else none past the
    checkpoint's (:func:`settle_interrupted` then counted that work as recomputed already)."""
    return max(checkpoint_step, progress.global_step) if progress is not None else checkpoint_step


@dataclass(frozen=True)
class ExecutionGoodput:
    """Every attempt of one execution so far: what a checkpoint carries across Flyte retries and restarts."""

    attempts: tuple[AttemptGoodput, ...] = ()

    @property
    def seconds(self) -> GoodputSeconds:
        return sum((a.seconds for a in self.attempts), GoodputSeconds())

    @property
    def goodput(self) -> float:
        return self.seconds.goodput

    @property
    def worker_seconds(self) -> float:
        """Workers x wall, summed over the attempts."""
        return math.fsum(a.num_workers * a.wall_s for a in self.attempts)

    @property
    def attributed_fraction(self) -> float:
        held = self.worker_seconds
        return self.seconds.total_s / held if held > 0 else 1.0

    def with_attempt(self, attempt: AttemptGoodput) -> ExecutionGoodput:
        """This record with ``attempt`` replacing the record of the same index (a newer one), or added."""
        kept = [a for a in self.attempts if a.index != attempt.index]
        return ExecutionGoodput(tuple(sorted([*kept, attempt], key=lambda a: a.index)))

    def summary(self) -> dict[str, Any]:
        """The ``goodput`` entry of a checkpoint's ``meta.telemetry`` (JSON)."""
        attempts = [dataclasses.asdict(a) for a in self.attempts]
        return {"attempts": [{k: v for k, v in a.items() if k != "last_progress" or v is not None} for a in attempts]}

    @classmethod
    def from_summary(cls, saved: Mapping[str, Any] | None) -> ExecutionGoodput:
        """What :meth:`summary` wrote (empty for None: a checkpoint written before goodput was recorded)."""
        attempts = []
        for entry in (saved or {}).get("attempts", []):
            seconds = entry.get("seconds", {})
            outcome = entry.get("outcome", "running")
            last = entry.get("last_progress")
            attempts.append(
                AttemptGoodput(
                    index=int(entry["index"]),
                    num_workers=int(entry["num_workers"]),
                    start_unix=float(entry["start_unix"]),
                    end_unix=float(entry["end_unix"]),
                    outcome=outcome if outcome in OUTCOMES else "running",
                    seconds=GoodputSeconds.from_list([float(seconds.get(name, 0.0)) for name in CATEGORIES]),
                    last_progress=LastProgress.from_dict(last) if last else None,
                )
            )
        return cls(tuple(attempts))
