"""The schema layer (training_core/schema.py): what each reader gets from pydantic, and what it never lets through."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from training_core import schema
from training_core.checkpoint import CheckpointMeta
from training_core.config import ScalingConfig, TrainingConfig, load_config
from training_core.data import Manifest

FIXTURE_META = (
    Path(__file__).resolve().parents[1]
    / "fixtures"
    / "checkpoint_before_typed_records"
    / "step-000000011"
    / "meta.json"
)
MANIFEST = {
    "version": 4,
    "workload": "image_classification",
    "dataset": "synthetic",
    "classes": ["a", "b"],
    "input_shape": [3, 4, 4],
    "mean": [0.5, 0.5, 0.5],
    "std": [0.25, 0.25, 0.25],
    "arrays": {
        "images": {"dtype": "uint8", "shape": [3, 4, 4], "max_value": None},
        "labels": {"dtype": "int64", "shape": [], "max_value": 1},
    },
    "spec": {},
    "format": "npz",
    "bad_samples": {"count": 0, "examples": []},
    "splits": {
        "train": {
            "num_samples": 2,
            "shards": [{"file": "train-0.npz", "num_samples": 2, "sha256": "0" * 64, "bounds": {"labels": [0, 1]}}],
        }
    },
}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def test_config_input_is_read_lax_as_it_always_was():
    config = TrainingConfig.from_dict(
        {
            "loop": {"epochs": "3", "batch_size": "auto", "global_batch_size": "64"},
            "scaling": {"use_gpu": "yes", "cpus_per_worker": 2},
        }
    )
    assert (config.loop.epochs, config.loop.batch_size, config.scaling.use_gpu) == (3, 0, True)
    assert config.scaling.cpus_per_worker == 2.0 and isinstance(config.scaling.cpus_per_worker, float)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"scaling": {"use_gpu": 1}}, "scaling.use_gpu=1 is invalid: expected true or false"),
        ({"loop": {"epochs": True}}, "loop.epochs=True is invalid: expected a number (int)"),
        ({"optimizer": {"lr": "1e999"}}, "optimizer.lr='1e999' is invalid: expected a finite number (float)"),
        ({"scaling": {"gpu_tolerations": [{"key": 5}]}}, "scaling.gpu_tolerations[0].key=5 is invalid: expected a str"),
        ({"scaling": {"nccl_env": {"NCCL_ALGO": 5}}}, "scaling.nccl_env[NCCL_ALGO]=5 is invalid: expected a string"),
        ({"scaling": {"nccl_env": {7: "x"}}}, "scaling.nccl_env key=7 is invalid: expected a string"),
    ],
)
def test_config_errors_name_the_nested_field_path_and_the_value(raw, message):
    with pytest.raises(ValueError) as excinfo:
        TrainingConfig.from_dict(raw)
    assert str(excinfo.value).startswith(message)


def test_a_records_own_check_reaches_the_reader_as_it_raised():
    with pytest.raises(ValueError, match=r"^loop.epochs=-3 is invalid: it must be in \[1, 1_000_000\]"):
        load_config(environ={"TRAINING_CORE__LOOP__EPOCHS": "-3"})


def test_what_was_written_to_disk_is_read_strictly():
    raw = json.loads(FIXTURE_META.read_text())
    assert CheckpointMeta.from_dict(raw).global_step == 11
    with pytest.raises(ValueError, match=r"^meta.json field global_step='11' is invalid: expected an integer >= 0$"):
        CheckpointMeta.from_dict({**raw, "global_step": "11"})
    with pytest.raises(ValueError, match=r"^meta.json field preempted=1 is invalid: expected true or false$"):
        CheckpointMeta.from_dict({**raw, "preempted": 1})


def test_a_rule_that_keeps_the_type_checks_the_container_first_then_each_item_with_its_location():
    size = Annotated[int, schema.Rule(lambda v: schema.is_int(v) and v >= 1, "an integer >= 1")]
    shape = Annotated[list[size], schema.Rule(lambda v: isinstance(v, list) and len(v) == 3, "", "three", True)]
    assert schema.check(shape, [3, 4, 4]) == [3, 4, 4]
    with pytest.raises(schema.SchemaError) as short:
        schema.check(shape, [3, "4"])
    with pytest.raises(schema.SchemaError) as item:
        schema.check(shape, [3, "4", 4])
    assert [(p.fix, p.loc) for p in short.value.problems] == [("three", ())]
    assert [(p.fix, p.loc, p.value) for p in item.value.problems] == [("expected an integer >= 1", (1,), "4")]


def test_one_validator_per_type_and_mode_is_built():
    assert schema.validator(ScalingConfig, lax=True) is schema.validator(ScalingConfig, lax=True)
    assert schema.validator(ScalingConfig, lax=True) is not schema.validator(ScalingConfig, lax=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(json.loads(FIXTURE_META.read_text()))), value=JSON_VALUES)
def test_any_json_value_in_any_checkpoint_meta_field_gives_a_record_or_an_error_naming_the_field(key, value):
    raw = {**json.loads(FIXTURE_META.read_text()), key: value}
    try:
        meta = CheckpointMeta.from_dict(raw)
    except ValueError as exc:
        assert str(exc).startswith(f"meta.json field {key}="), str(exc)
    else:
        assert getattr(meta, key) is not None or value is None


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(sorted(MANIFEST)), value=JSON_VALUES)
def test_any_json_value_in_any_data_manifest_field_gives_a_manifest_or_an_error_naming_the_file(key, value):
    raw = copy.deepcopy(MANIFEST)
    raw[key] = value
    try:
        Manifest.from_json(json.dumps(raw))
    except ValueError as exc:
        assert str(exc).startswith("manifest.json") and "re-run data prep" in str(exc), str(exc)


def test_importing_the_config_loads_neither_pydantic_nor_any_heavy_library():
    code = (
        "import sys, training_core.config; print(sorted({'pydantic', 'torch', 'ray', 'flytekit'} & set(sys.modules)))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
