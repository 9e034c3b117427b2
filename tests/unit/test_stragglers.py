"""Straggler detection on simulated DDP windows, where every rank's step takes as long as the slowest rank's and
the others wait for it in the all-reduce: a slowed rank is named within the configured windows with its cause, a
data-bound rank as such, a healthy noisy run never; and the two settings are checked where the config is read."""

from __future__ import annotations

import random

import pytest

from training_core.config import ObservabilityConfig
from training_core.telemetry.stragglers import RankWindow, StragglerDetector, rank_slots, rank_windows

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


def test_the_straggler_settings_default_to_twenty_percent_over_three_windows():
    cfg = ObservabilityConfig()
    assert (cfg.straggler_threshold, cfg.straggler_windows) == (0.2, 3)


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [
        ("straggler_threshold", 0.0, "such as 0.2 for 20 %"),
        ("straggler_threshold", -0.5, "in (0, 10]"),
        ("straggler_threshold", 50.0, "in (0, 10]"),
        ("straggler_windows", 0, "it must be >= 1 log window"),
    ],
)
def test_bad_straggler_settings_name_the_field_the_value_and_the_fix(field, value, fix):
    with pytest.raises(ValueError) as raised:
        ObservabilityConfig(**{field: value})
    message = str(raised.value)
    assert f"observability.{field}={value!r}" in message and fix in message
