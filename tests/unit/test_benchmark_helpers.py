"""The benchmarks' helpers that other modules' refactors can break without a benchmark run noticing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def scaling_module():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import scaling

        yield scaling
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_an_independent_copy_trains_the_bare_loop_on_the_prepared_data(scaling_module, tmp_path):
    """scaling.py's machine ceiling: one copy of loop_overhead.py's bare loop (its signature changed once under
    it, and the benchmark failed at its first independent point)."""
    from training_core.config import DataConfig
    from training_core.data import prepare

    prepare(DataConfig(dataset="synthetic", synthetic_num_samples=160, synthetic_image_size=8), str(tmp_path))
    samples_per_s = scaling_module._bare_copy((str(tmp_path), 16, 1, 0))
    assert samples_per_s > 0


def test_rounds_alternate_direction_over_every_point(scaling_module):
    forward = scaling_module.round_order([2, 1], 0)
    assert forward[0] == (1, "ray") and len(forward) == 6
    assert scaling_module.round_order([2, 1], 1) == forward[::-1]
