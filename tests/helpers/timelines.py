"""A worker's timeline of steps and stalls replayed through :class:`~training_core.telemetry.goodput.GoodputClock`:
synthetic attempts for the goodput property tests."""

from __future__ import annotations

from dataclasses import dataclass

from training_core.telemetry.goodput import Category, GoodputClock, GoodputSeconds, Outcome


@dataclass(frozen=True)
class StepEvent:
    """A finished step, as :meth:`GoodputClock.step` takes it."""

    end_s: float
    global_step: int
    step_time_s: float
    data_wait_s: float = 0.0
    comm_wait_s: float = 0.0


@dataclass(frozen=True)
class SpanEvent:
    """A finished checkpoint stall or validation, as :meth:`GoodputClock.span` takes it."""

    category: Category
    end_s: float


@dataclass(frozen=True)
class WorkerTimeline:
    """One worker's record of one attempt, from its start to its end."""

    start_s: float
    end_s: float
    outcome: Outcome
    events: tuple[StepEvent | SpanEvent, ...] = ()
    recompute_through_step: int = 0
    after_preemption: bool = False


def attribute(timeline: WorkerTimeline) -> GoodputSeconds:
    """The worker's seconds by category over its whole timeline (they add up to ``end_s - start_s``)."""
    clock = GoodputClock(
        start_s=timeline.start_s,
        recompute_through_step=timeline.recompute_through_step,
        after_preemption=timeline.after_preemption,
    )
    for event in timeline.events:
        if isinstance(event, StepEvent):
            clock.step(
                end_s=event.end_s,
                global_step=event.global_step,
                step_time_s=event.step_time_s,
                data_wait_s=event.data_wait_s,
                comm_wait_s=event.comm_wait_s,
            )
        else:
            clock.span(event.category, end_s=event.end_s)
    return clock.close(end_s=timeline.end_s, outcome=timeline.outcome)
