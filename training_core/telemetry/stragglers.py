"""Which rank slows the others: per rank and log window, its own time against the other ranks' median.

Contract. Under DDP every rank's step takes the same wall time: a slow rank makes the others wait in the gradient
all-reduce. So step time cannot name it; what it spent before it was ready to reduce can. Per rank and window,
``compute = step - data wait - communication wait`` and its own time is ``compute + data wait`` (the step less its
communication wait): the slow rank has the most of it and the least communication wait. A rank whose own time stays
above the median of the other ranks' by more than ``threshold`` (a fraction: 0.2 is 20 %), and by at least
``min_excess_s`` seconds, for ``windows`` consecutive windows is a :class:`Straggler`, with cause ``data`` when it
waited for input longer than it computed, else ``compute``. It stays flagged while that holds; one window within
either bound clears it.

Why the seconds too. The operating system delays a runnable process by milliseconds whenever another one holds its
core, whatever the window's length, and those delays fall on either rank at random. On a window of milliseconds that
alone is 20 %: on 2 gloo workers sharing 2 busy cores, 3-step windows of ~10 ms put one rank or the other over 20 %
in a third of the windows, and in 10 of 11 runs of 200 windows some rank stayed over for 3 in a row (1-6 flagged
windows a run), by 1-9 ms a window. A rank slowed by its code or its node is over by its whole slowdown in every
window (30 ms a step in ``benchmarks/goodput.py``: 30-60 ms a 2-step window); a window of seconds, as on an
accelerator, is over 20 % only by far more than ``min_excess_s``, so there the bound changes nothing.

Every rank can run the same :class:`StragglerDetector` on the same figures (all ranks' windows are summed into one
list with :func:`rank_slots`, so one all-reduce gives every rank all of them) and reach the same verdict. Pure
arithmetic: nothing is measured here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal, Sequence

Cause = Literal["compute", "data"]
CAUSES: tuple[Cause, ...] = ("compute", "data")
FIGURES_PER_RANK = 3
"""Step, data wait and communication wait seconds: a rank's slots in :func:`rank_slots`."""


@dataclass(frozen=True)
class RankWindow:
    """One rank's seconds over one log window (sums over its steps, or means: alike for all ranks)."""

    rank: int
    step_s: float
    data_wait_s: float
    comm_wait_s: float

    @property
    def compute_s(self) -> float:
        return max(0.0, self.step_s - self.data_wait_s - self.comm_wait_s)

    @property
    def own_s(self) -> float:
        """Compute and data wait: the time before the rank was ready to communicate."""
        return max(0.0, self.step_s - self.comm_wait_s)

    @property
    def cause(self) -> Cause:
        return "data" if self.data_wait_s > self.compute_s else "compute"


def rank_slots(rank: int, world_size: int, *, step_s: float, data_wait_s: float, comm_wait_s: float) -> list[float]:
    """This rank's window in its slots of a zero list of ``world_size`` x 3: summed over the ranks (an all-reduce),
    the lists give every rank's; :func:`rank_windows` reads them back."""
    assert 0 <= rank < world_size, (rank, world_size)
    slots = [0.0] * (world_size * FIGURES_PER_RANK)
    slots[rank * FIGURES_PER_RANK : (rank + 1) * FIGURES_PER_RANK] = [step_s, data_wait_s, comm_wait_s]
    return slots


def rank_windows(summed: Sequence[float]) -> tuple[RankWindow, ...]:
    """Every rank's window from the summed :func:`rank_slots` lists."""
    assert len(summed) % FIGURES_PER_RANK == 0, len(summed)
    return tuple(
        RankWindow(rank, *(float(v) for v in summed[start : start + FIGURES_PER_RANK]))
        for rank, start in enumerate(range(0, len(summed), FIGURES_PER_RANK))
    )


@dataclass(frozen=True)
class Straggler:
    """A rank flagged in the latest window, and the figures that flagged it."""

    rank: int
    node: str
    cause: Cause
    consecutive_windows: int
    """Windows in a row its own time has been over the threshold."""
    new: bool
    """Flagged for the first time in this stretch (the window that reached ``windows``): warn once."""
    own_s: float
    others_median_s: float
    compute_s: float
    data_wait_s: float
    comm_wait_s: float

    @property
    def excess(self) -> float:
        """How far its own time is above the others' median, as a fraction of that median."""
        return self.own_s / self.others_median_s - 1.0 if self.others_median_s > 0 else float("inf")

    @property
    def excess_s(self) -> float:
        """How far its own time is above the others' median, in seconds."""
        return self.own_s - self.others_median_s

    def message(self) -> str:
        what = "waits for input" if self.cause == "data" else "computes"
        return (
            f"rank {self.rank} on node {self.node or '?'} is a straggler ({self.cause}-bound): it {what} "
            f"{self.excess:.0%} ({self.excess_s:.3g} s) longer than the other ranks' median for "
            f"{self.consecutive_windows} log windows "
            f"(compute {self.compute_s:.4g} s, data wait {self.data_wait_s:.4g} s, communication wait "
            f"{self.comm_wait_s:.4g} s; others' compute + data wait {self.others_median_s:.4g} s)"
        )


class StragglerDetector:
    """Flags ranks whose own time stays above the others' median (see the module docstring); ``min_excess_s`` is
    ``observability.straggler_min_excess_s``."""

    def __init__(
        self, *, nodes: Sequence[str], threshold: float = 0.2, windows: int = 3, min_excess_s: float = 0.02
    ) -> None:
        assert threshold > 0 and windows >= 1 and min_excess_s >= 0, (threshold, windows, min_excess_s)
        self.nodes, self.threshold, self.windows, self.min_excess_s = tuple(nodes), threshold, windows, min_excess_s
        self.streaks = [0] * len(self.nodes)
        """Per rank, consecutive windows over the threshold so far."""

    def observe(self, ranks: Sequence[RankWindow]) -> tuple[Straggler, ...]:
        """One log window of every rank: the ranks flagged now (empty with fewer than two ranks)."""
        assert len(ranks) == len(self.nodes), (len(ranks), len(self.nodes))
        flagged = []
        for window in ranks:
            others = [r.own_s for r in ranks if r.rank != window.rank]
            median_s = statistics.median(others) if others else window.own_s
            over = bool(others) and self.is_over(window.own_s, median_s)
            streak = self.streaks[window.rank] = self.streaks[window.rank] + 1 if over else 0
            if streak >= self.windows:
                flagged.append(
                    Straggler(
                        rank=window.rank,
                        node=self.nodes[window.rank],
                        cause=window.cause,
                        consecutive_windows=streak,
                        new=streak == self.windows,
                        own_s=window.own_s,
                        others_median_s=median_s,
                        compute_s=window.compute_s,
                        data_wait_s=window.data_wait_s,
                        comm_wait_s=window.comm_wait_s,
                    )
                )
        return tuple(flagged)

    def is_over(self, own_s: float, others_median_s: float) -> bool:
        """Whether a rank's own time is over the others' median in one window: by more than ``threshold`` of it and
        by at least ``min_excess_s`` (see the module docstring)."""
        return own_s > others_median_s * (1.0 + self.threshold) and own_s - others_median_s >= self.min_excess_s
