"""Scaling benchmark arithmetic and plan checks (no Ray, no processes)."""

from __future__ import annotations

import math

import pytest

from training_core.scaling_benchmark import (
    TABLE_COLUMNS,
    ScalingPoint,
    check_plan,
    efficiency_table,
    point_config,
    scaling_preset,
)


def _point(n: int, launcher: str, samples_per_s: float, model: str = "small_cnn") -> ScalingPoint:
    return ScalingPoint(
        model=model,
        num_workers=n,
        launcher=launcher,
        samples_per_s=samples_per_s,
        step_time_p50_s=0.1,
        step_time_p95_s=0.12,
        allreduce_fraction=0.0 if n == 1 else 0.05,
    )


def test_the_preset_builds_and_splits_its_shards_evenly_over_1_2_4_and_8_workers():
    preset = scaling_preset()
    assert preset.model.name == "small_cnn" and preset.scaling.torch_threads_per_worker == 1
    assert check_plan(preset, [1, 2, 4, 8], []) == ["small_cnn"]
    assert point_config(preset, model="resnet18", num_workers=4).scaling.num_workers == 4


def test_efficiency_is_per_worker_throughput_over_one_workers_and_parity_is_ray_over_torch():
    table = efficiency_table(
        [
            _point(2, "ray", 900.0),
            _point(1, "torch", 520.0),
            _point(1, "ray", 500.0),
            _point(2, "torch", 1000.0),
            _point(4, "ray", 1600.0),
            _point(4, "torch", 2080.0),
        ]
    )
    assert list(table.columns) == list(TABLE_COLUMNS)
    assert table["num_workers"].tolist() == [1, 2, 4]
    assert table["ray_efficiency"].tolist() == [1.0, 900 / (2 * 500), 1600 / (4 * 500)]
    assert table["torch_efficiency"].tolist() == [1.0, 1000 / (2 * 520), 2080 / (4 * 520)]
    assert table["parity"].tolist() == [500 / 520, 900 / 1000, 1600 / 2080]
    assert table["ray_allreduce_fraction"].tolist() == [0.0, 0.05, 0.05]


def test_efficiency_is_relative_to_the_smallest_count_of_each_model():
    table = efficiency_table(
        [
            _point(2, "ray", 1000.0),
            _point(2, "torch", 1000.0),
            _point(4, "ray", 1800.0),
            _point(4, "torch", 2000.0),
            _point(1, "ray", 80.0, "resnet18"),
            _point(1, "torch", 80.0, "resnet18"),
            _point(2, "ray", 120.0, "resnet18"),
            _point(2, "torch", 150.0, "resnet18"),
        ]
    )
    rows = {(r.model, r.num_workers): r for r in table.itertuples()}
    assert rows[("small_cnn", 2)].ray_efficiency == 1.0
    assert math.isclose(rows[("small_cnn", 4)].ray_efficiency, 0.9)
    assert math.isclose(rows[("resnet18", 2)].ray_efficiency, 0.75) and math.isclose(rows[("resnet18", 2)].parity, 0.8)


def test_a_point_without_its_other_launcher_or_measured_twice_is_refused_by_name():
    with pytest.raises(ValueError, match="points lack torch-small_cnn-2w"):
        efficiency_table([_point(1, "ray", 1.0), _point(1, "torch", 1.0), _point(2, "ray", 1.0)])
    with pytest.raises(ValueError, match="ray-small_cnn-1w twice"):
        efficiency_table([_point(1, "ray", 1.0), _point(1, "ray", 2.0)])
    with pytest.raises(ValueError, match="samples_per_s=0.0 of ray-small_cnn-1w is invalid"):
        _point(1, "ray", 0.0)


@pytest.mark.parametrize(
    ("worker_counts", "models", "message"),
    [
        ([], [], "worker_counts=[] is invalid"),
        ([1, 0], [], "worker_counts=[1, 0] is invalid: [0] are not whole numbers >= 1"),
        ([1, 1], [], "each count may appear once"),
        (
            [1, 2, 3],
            [],
            "data.num_shards=8 is invalid for worker_counts=[1, 2, 3]: every count must split the shards evenly; use "
            "a multiple of 6",
        ),
        (
            [1, 2],
            ["resnet9000"],
            "models=['resnet9000'] is invalid: 'resnet9000': model.name='resnet9000' is invalid: choose one of "
            "small_cnn",
        ),
    ],
)
def test_a_bad_plan_names_the_input_the_value_and_the_fix(worker_counts, models, message):
    with pytest.raises(ValueError) as excinfo:
        check_plan(scaling_preset(), worker_counts, models)
    assert message in str(excinfo.value)


def test_a_language_model_plan_measures_gpt_sizes_and_refuses_image_models_by_name():
    """The benchmark runs any workload: a GPT plan's points keep the text data and get each GPT size."""
    from training_core.config import TrainingConfig

    lm = TrainingConfig.from_dict(
        {
            "workload": {"name": "causal_lm"},
            "model": {"name": "gpt2-tiny"},
            "data": {"dataset": "stdlib", "num_shards": 4, "seq_len": 32},
        }
    )
    assert check_plan(lm, [1, 2, 4], ["gpt2-tiny", "gpt2-mini"]) == ["gpt2-tiny", "gpt2-mini"]
    point = point_config(lm, model="gpt2-mini", num_workers=2)
    assert (point.workload.name, point.model.name, point.data.dataset) == ("causal_lm", "gpt2-mini", "stdlib")
    with pytest.raises(ValueError, match=r"models=\['gpt2-tiny', 'resnet18'\] is invalid: 'resnet18': model.name"):
        check_plan(lm, [1, 2], ["gpt2-tiny", "resnet18"])
