"""Straggler detection on simulated DDP windows, where every rank's step takes as long as the slowest rank's and
the others wait for it in the all-reduce: a slowed rank is named within the configured windows with its cause, a
data-bound rank as such, a healthy noisy run never; the same on windows recorded from real 2-rank runs on a shared
2-core machine (``tests/fixtures/straggler_windows``); and the settings are checked where the config is read."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.helpers.runtime import InProcessRuntime
from training_core.config import ObservabilityConfig, TrainingConfig
from training_core.telemetry.stragglers import RankWindow, StragglerDetector, rank_slots, rank_windows
from training_core.train.accounting import RunAccounting

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "straggler_windows"
"""Every rank's [step_s, data_wait_s, comm_wait_s] per log window, as each rank's detector got them, from real runs of
``benchmarks/goodput.py``'s 2 gloo workers (3-step windows of ~10 ms when healthy; 2-step windows when rank 1's
forward sleeps 30 ms) while other jobs shared the 2 cores."""

ALLREDUCE_S = 0.05
"""The all-reduce itself, once the last rank is ready: every rank waits at least this long."""


def _ddp_window(compute_s: list[float], data_s: list[float]) -> list[RankWindow]:
    """One window of a DDP run: each rank is ready after its data wait and compute; all finish the step together."""
    ready = [c + d for c, d in zip(compute_s, data_s)]
    step_s = max(ready) + ALLREDUCE_S
    return [RankWindow(rank, step_s, data_s[rank], step_s - ready[rank]) for rank in range(len(ready))]


def _noisy(rng: random.Random, mean_s: float, spread: float = 0.05) -> float:
    return max(0.0, rng.gauss(mean_s, mean_s * spread))


def _detector(num_ranks: int, **kwargs) -> StragglerDetector:
    return StragglerDetector(nodes=[f"node-{rank // 2}" for rank in range(num_ranks)], **kwargs)


def _recorded(name: str) -> list[list[RankWindow]]:
    windows = json.loads((RECORDED / f"{name}.json").read_text())["windows"]
    return [[RankWindow(rank, *figures) for rank, figures in enumerate(window)] for window in windows]


def _flags(recorded: list[list[RankWindow]], **kwargs) -> list[tuple[int, int]]:
    """(1-based window, rank) of every flag a fresh 2-rank detector raises over ``recorded``."""
    detector = _detector(2, **kwargs)
    return [(index, s.rank) for index, window in enumerate(recorded, 1) for s in detector.observe(window)]


def test_a_rank_slowed_in_its_compute_is_named_within_three_windows_as_compute_bound():
    rng, detector = random.Random(0), _detector(4)
    slowed_from, first_flagged = 10, None
    for window in range(30):
        compute = [_noisy(rng, 1.0) * (1.5 if rank == 2 and window >= slowed_from else 1.0) for rank in range(4)]
        windows = _ddp_window(compute, [_noisy(rng, 0.1) for _ in range(4)])
        assert len({w.step_s for w in windows}) == 1  # step time names no one
        flagged = detector.observe(windows)
        if flagged and first_flagged is None:
            first_flagged = window
            (straggler,) = flagged
            assert (straggler.rank, straggler.node, straggler.cause, straggler.new) == (2, "node-1", "compute", True)
            assert straggler.excess > 0.2 and straggler.comm_wait_s == min(w.comm_wait_s for w in windows)
            assert "rank 2 on node node-1" in straggler.message() and "compute-bound" in straggler.message()
        elif flagged:
            assert [s.rank for s in flagged] == [2] and not flagged[0].new
    assert first_flagged is not None and first_flagged - slowed_from + 1 <= 3


def test_a_rank_waiting_for_its_input_is_named_data_bound():
    rng, detector = random.Random(1), _detector(3, windows=2)
    flagged = ()
    for _ in range(2):
        data = [_noisy(rng, 0.1), _noisy(rng, 2.0), _noisy(rng, 0.1)]
        flagged = detector.observe(_ddp_window([_noisy(rng, 1.0) for _ in range(3)], data))
    assert [(s.rank, s.cause) for s in flagged] == [(1, "data")]
    assert flagged[0].data_wait_s > flagged[0].compute_s
    assert "data-bound" in flagged[0].message() and "waits for input" in flagged[0].message()


def test_a_healthy_noisy_run_flags_no_rank_over_200_windows():
    rng, detector = random.Random(2), _detector(8)
    for _ in range(200):
        compute = [_noisy(rng, 1.0, spread=0.06) for _ in range(8)]
        assert detector.observe(_ddp_window(compute, [_noisy(rng, 0.2, spread=0.3) for _ in range(8)])) == ()


def test_one_window_within_the_threshold_clears_the_flag_and_a_new_stretch_warns_again():
    detector = _detector(2, threshold=0.2, windows=2)
    slow, even = _ddp_window([1.5, 1.0], [0.0, 0.0]), _ddp_window([1.0, 1.0], [0.0, 0.0])
    news = [[s.new for s in detector.observe(w)] for w in (slow, slow, slow, even, slow, slow)]
    assert news == [[], [True], [False], [], [], [True]]


@pytest.mark.parametrize(
    "name", ["healthy_2_cores_shared_a", "healthy_2_cores_shared_b", "healthy_2_cores_with_a_cpu_hog"]
)
def test_recorded_healthy_two_rank_runs_on_shared_cores_flag_no_rank_over_200_windows(name):
    windows = _recorded(name)
    assert len(windows) == 200
    # The scheduling noise is there: by the fraction alone, one rank or the other stays 20 % over for 3 windows.
    assert _flags(windows, min_excess_s=0.0)
    assert _flags(windows) == []


def test_a_few_milliseconds_over_twenty_percent_of_a_short_window_is_not_a_straggler():
    # Rank 1 in a recorded healthy run: over the other by 130 % (9 ms) and 34 % (7.7 ms), then one 545 ms wait for
    # its input. The fraction alone flags it at the third; by seconds, only the wait is over.
    windows = _recorded("healthy_2_cores_shared_a")[2:5]
    excess_s = [w[1].own_s - w[0].own_s for w in windows]
    assert all(w[1].own_s > 1.2 * w[0].own_s for w in windows) and min(excess_s) < 0.01 < 0.5 < max(excess_s)
    assert _flags(windows, min_excess_s=0.0) == [(3, 1)]
    assert _flags(windows) == []


def test_the_recorded_slowed_rank_is_named_at_its_third_window_as_compute_bound_and_the_healthy_one_never():
    windows = _recorded("slowed_rank_1")
    detector, flagged = _detector(2), []
    for index, window in enumerate(windows, 1):
        flagged += [(index, straggler) for straggler in detector.observe(window)]
    first_index, first = flagged[0]
    assert first_index == 3 and (first.rank, first.cause, first.new) == (1, "compute", True)
    assert {straggler.rank for _, straggler in flagged} == {1} and len(flagged) >= len(windows) - 3
    assert first.excess_s > detector.min_excess_s and f"({first.excess_s:.3g} s) longer" in first.message()


@pytest.mark.parametrize("name", ["slowed_rank_1", "slowed_rank_1_with_a_stall"])
def test_the_seconds_bound_misses_no_window_of_a_recorded_slowed_rank(name):
    # With a stall of both ranks in its 3rd window, the count starts again after it: flagged from window 6 either way.
    windows = _recorded(name)
    assert _flags(windows) == _flags(windows, min_excess_s=0.0) != []


def test_a_rank_over_the_fraction_is_flagged_only_when_over_by_min_excess_s_too():
    def flags(own_s: list[float], min_excess_s: float) -> list[tuple[int, int]]:
        return _flags([_ddp_window(own_s, [0.0, 0.0])] * 3, min_excess_s=min_excess_s)

    assert flags([0.010, 0.0195], min_excess_s=0.01) == []  # 95 % over, by 9.5 ms
    assert flags([0.010, 0.0205], min_excess_s=0.01) == [(3, 1)]
    assert flags([1.0, 1.1], min_excess_s=0.01) == []  # 0.1 s over, by 10 %
    assert flags([0.010, 0.0195], min_excess_s=0.0) == [(3, 1)]


def test_the_run_accounting_detector_takes_the_configured_straggler_settings():
    cfg = TrainingConfig.from_dict(
        {"observability": {"straggler_threshold": 0.5, "straggler_windows": 4, "straggler_min_excess_s": 0.25}}
    )
    accounting = RunAccounting.for_run(cfg, InProcessRuntime(), total_steps=10, end_epoch=1)
    detector = accounting.detector
    assert (detector.threshold, detector.windows, detector.min_excess_s) == (0.5, 4, 0.25)


def test_a_single_rank_is_never_a_straggler():
    detector = _detector(1, windows=1)
    assert detector.observe([RankWindow(0, 5.0, 4.0, 0.0)]) == ()


def test_every_ranks_window_comes_back_from_the_sum_of_their_slots():
    windows = _ddp_window([1.0, 1.4, 0.9], [0.1, 0.2, 0.3])
    summed = [0.0] * 9
    for w in windows:  # what an all-reduce sum of every rank's slots gives each rank
        own = rank_slots(w.rank, 3, step_s=w.step_s, data_wait_s=w.data_wait_s, comm_wait_s=w.comm_wait_s)
        summed = [a + b for a, b in zip(summed, own)]
    assert rank_windows(summed) == tuple(windows)


def test_the_straggler_settings_default_to_twenty_percent_and_twenty_milliseconds_over_three_windows():
    cfg = ObservabilityConfig()
    assert (cfg.straggler_threshold, cfg.straggler_min_excess_s, cfg.straggler_windows) == (0.2, 0.02, 3)


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [
        ("straggler_threshold", 0.0, "such as 0.2 for 20 %"),
        ("straggler_threshold", -0.5, "in (0, 10]"),
        ("straggler_threshold", 50.0, "in (0, 10]"),
        ("straggler_windows", 0, "it must be >= 1 log window"),
        ("straggler_min_excess_s", -0.01, "it must be >= 0"),
    ],
)
def test_bad_straggler_settings_name_the_field_the_value_and_the_fix(field, value, fix):
    with pytest.raises(ValueError) as raised:
        ObservabilityConfig(**{field: value})
    message = str(raised.value)
    assert f"observability.{field}={value!r}" in message and fix in message
