"""How far the run is and when it will end: steps done and total, the recent step rate, and the time to the last
step and to the next checkpoint.

Contract. :class:`EtaEstimator` is fed what the loop measures: each log window's steps and step seconds
(:meth:`~EtaEstimator.window`), and each validation's and checkpoint stall's seconds (:meth:`~EtaEstimator.overhead`).
Step time excludes those stalls (the loop measures them on their own) and the loop's time between steps that no step
measured (:meth:`~EtaEstimator.gap`), so the estimate adds them back amortised per step: the seconds spent in them so
far over the steps this attempt took up to the last stall (the steps since then have not reached the next one yet:
counting them would dilute what is still to come). The time per step ahead is the recent windows'
(``recent_windows``) step seconds per step plus that overhead, and an ETA is the steps left times it. Before any
window there is no estimate (``None``). Pure arithmetic: no clock is read here.

:class:`EtaReading` is one estimate kept with the moment it was made, so that it can be checked against the run's real
end (:meth:`EtaReading.error`).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Progress:
    """Where the run is and how long it has left."""

    global_step: int
    total_steps: int
    steps_per_s: float
    """Recent training rate: steps over step seconds of the latest windows (0 before any)."""
    overhead_per_step_s: float
    """Validation and checkpoint seconds so far, per step taken before the latest of them."""
    eta_s: float | None
    """Seconds to the last step, with validation and checkpoints amortised; None before any window."""
    next_checkpoint_step: int | None
    eta_checkpoint_s: float | None
    """Seconds to the next checkpoint's step; None when none is due or before any window."""

    @property
    def fraction_done(self) -> float:
        return min(1.0, self.global_step / self.total_steps) if self.total_steps > 0 else 1.0


class EtaEstimator:
    """The run's progress from its windows and stalls (see the module docstring)."""

    def __init__(self, *, total_steps: int, recent_windows: int = 10) -> None:
        assert total_steps >= 0 and recent_windows >= 1, (total_steps, recent_windows)
        self.total_steps = total_steps
        self.recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=recent_windows)
        self.steps_taken = 0
        """Steps this attempt measured."""
        self.overhead_s = 0.0
        self.steps_before_overhead = 0
        """Steps taken before the latest validation or checkpoint (the amortisation's denominator)."""

    def window(self, *, num_steps: int, step_time_s: float) -> None:
        """A closed log window: ``num_steps`` steps that took ``step_time_s`` seconds in all."""
        if num_steps > 0:
            self.recent.append((num_steps, max(0.0, step_time_s)))
            self.steps_taken += num_steps

    def overhead(self, seconds: float) -> None:
        """A validation or a checkpoint stall of ``seconds``."""
        self.overhead_s += max(0.0, seconds)
        self.steps_before_overhead = self.steps_taken

    def gap(self, seconds: float) -> None:
        """Loop time between two steps that neither measured (an epoch's loader opening): overhead, amortised over
        the same steps as the stalls'."""
        self.overhead_s += max(0.0, seconds)

    def estimate(self, *, global_step: int, next_checkpoint_step: int | None = None) -> Progress:
        steps = sum(n for n, _ in self.recent)
        seconds = sum(s for _, s in self.recent)
        overhead_per_step_s = self.overhead_s / self.steps_before_overhead if self.steps_before_overhead else 0.0
        per_step_s = seconds / steps + overhead_per_step_s if steps else None
        due = next_checkpoint_step if next_checkpoint_step is not None and next_checkpoint_step > global_step else None
        return Progress(
            global_step=global_step,
            total_steps=self.total_steps,
            steps_per_s=steps / seconds if seconds > 0 else 0.0,
            overhead_per_step_s=overhead_per_step_s,
            eta_s=None if per_step_s is None else max(0, self.total_steps - global_step) * per_step_s,
            next_checkpoint_step=due,
            eta_checkpoint_s=None if per_step_s is None or due is None else (due - global_step) * per_step_s,
        )


@dataclass(frozen=True)
class EtaReading:
    """An ETA as it was estimated at ``unix`` (after ``global_step``)."""

    global_step: int
    unix: float
    eta_s: float

    def error(self, end_unix: float) -> float:
        """How far off it was from the real time left to ``end_unix``, relative to that time."""
        real_s = end_unix - self.unix
        return abs(self.eta_s - real_s) / real_s if real_s > 0 else float("inf")

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> EtaReading:
        return cls(int(saved["global_step"]), float(saved["unix"]), float(saved["eta_s"]))
