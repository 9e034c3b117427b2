"""The light route for any numeric arrays: the built-ins ``array_classification`` and ``array_regression`` with a
``workload.dataset_source`` returning named arrays, a real map-style ``torch.utils.data.Dataset`` subclass, or a real
Hugging Face ``datasets.Dataset`` (or ``DatasetDict``), and a ``workload.model_factory``. Prep writes the same shards
(sha256, bounds, manifest) as any workload, reads a Dataset a sample or a block of rows at a time, and refuses what a
shard cannot store naming the field, the column and the fix."""

from __future__ import annotations

import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
import torch

from examples.signal_cnn.make_data import signals
from training_core.config import DataConfig, TrainingConfig, WorkloadConfig
from training_core.data import Manifest, ShardStream
from training_core.workloads import preflight, resolve_workload
from training_core.workloads.simple import named_arrays

SOURCES = """
import datasets
import numpy as np
import torch
from torch import nn

from examples.signal_cnn.make_data import signals


def arrays(data_config, params=None):
    return signals(60, seed=1)


class Signals(torch.utils.data.Dataset):
    def __init__(self, as_mapping=False):
        self.samples, self.as_mapping = signals(60, seed=1), as_mapping

    def __len__(self):
        return 60

    def __getitem__(self, index):
        x, y = torch.from_numpy(self.samples["inputs"][index]), str(self.samples["targets"][index])
        return {"inputs": x, "targets": y, "index": index} if self.as_mapping else (x, y)


def torch_pairs(data_config):
    return Signals()


def torch_mappings(data_config):
    return Signals(as_mapping=True)


def hugging_face(data_config):
    samples = signals(60, seed=1)
    return datasets.Dataset.from_dict({**samples, "note": [f"free text {i}" for i in range(60)]})


def hugging_face_splits(data_config):
    whole = hugging_face(data_config)
    return datasets.DatasetDict({"train": whole.select(range(50)), "validation": whole.select(range(50, 60))})


def regression_points(data_config):
    x = np.linspace(0, 1, 40)
    return datasets.Dataset.from_dict({"inputs": np.stack([x, 1 - x], 1), "targets": np.stack([2 * x, -x], 1)})


def cnn(config, manifest, params=None):
    width = (params or {}).get("width", 4)
    return nn.Sequential(
        nn.Conv1d(manifest.input_shape[0], width, 3, padding=1),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(width, manifest.num_classes),
    )


def two_class_head(config, manifest):
    return nn.Sequential(nn.Flatten(), nn.Linear(128, 2))


def linear(config, manifest):
    return nn.Linear(2, 2)


class Ragged(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.zeros(3 if index == 0 else 4), index % 2


class Singles(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.zeros(3)


class MixedLabels(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.zeros(3), "cat" if index == 0 else 1.5


def text_inputs(data_config):
    return datasets.Dataset.from_dict({"inputs": ["a b", "c d", "e f"], "targets": [0, 1, 0]})


def ragged_rows(data_config):
    return datasets.Dataset.from_dict({"inputs": [[1.0, 2.0], [1.0], [3.0, 4.0]], "targets": [0, 1, 0]})


def missing_label(data_config):
    return datasets.Dataset.from_dict({"inputs": [[1.0], [2.0], [3.0]], "targets": [0, None, 1]})


def nan_label(data_config):
    return {"inputs": np.zeros((3, 2), np.float32), "targets": np.array([0.0, np.nan, 1.0])}


def ragged_lists(data_config):
    return {"inputs": [[1.0, 2.0], [1.0]], "targets": [0, 1]}


def objects(data_config):
    return {"inputs": np.array([{"a": 1}, {"b": 2}], dtype=object), "targets": np.arange(2)}


def wrong_columns(data_config):
    return datasets.Dataset.from_dict({"x": [[1.0], [2.0]], "label": [0, 1]})


def streaming(data_config):
    return datasets.Dataset.from_dict({"inputs": [[1.0], [2.0]], "targets": [0, 1]}).to_iterable_dataset()


def ragged_items(data_config):
    return Ragged()


def single_items(data_config):
    return Singles()


def mixed_labels(data_config):
    return MixedLabels()


def empty(data_config):
    return datasets.Dataset.from_dict({"inputs": [], "targets": []})
"""


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """The dotted name of a module holding :data:`SOURCES`, on ``sys.path`` for the test."""
    name = f"array_sources_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SOURCES))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _config(sources: str, source: str, *, name="array_classification", factory="cnn", **data) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "workload": {
                "name": name,
                "dataset_source": f"{sources}:{source}" if source else "",
                "model_factory": f"{sources}:{factory}",
                "params": {"width": 6},
            },
            "data": {"num_shards": 2, **data},
            "loop": {"batch_size": 4},
            "scaling": {"num_workers": 1},
            "observability": {"enabled": False},
        }
    )


def _stored(manifest: Manifest) -> dict[str, np.ndarray]:
    """Every split's samples, read back through the shard reader (which checks each shard's sha256 and bounds)."""
    found: dict[str, list[np.ndarray]] = {}
    for split in manifest.splits:
        for batch in ShardStream(manifest, split, rank=0, world_size=1).eval_batches(batch_size=1024):
            for name, values in batch.items():
                found.setdefault(name, []).append(values)
    return {name: np.concatenate(parts) for name, parts in found.items()}


@pytest.mark.parametrize("source", ["arrays", "torch_pairs", "torch_mappings", "hugging_face", "hugging_face_splits"])
def test_a_dataset_source_of_float_arrays_a_torch_dataset_or_a_hugging_face_dataset_is_prepared_and_trains(
    sources, tmp_path, source
):
    cfg = _config(sources, source)
    manifest = resolve_workload(cfg.workload).prepare_data(cfg.data, str(tmp_path))
    assert manifest.workload == "array_classification" and manifest.dataset == f"{sources}:{source}"
    assert manifest.classes == ["sawtooth", "sine", "square"] and manifest.input_shape == [1, 128]
    assert manifest.arrays["inputs"].dtype == "float32" and manifest.arrays["targets"].max_value == 2
    shards = [shard for split in manifest.splits.values() for shard in split.shards]
    assert all(len(shard.sha256) == 64 and shard.bounds["targets"] for shard in shards), shards
    stored, given = _stored(Manifest.load(str(tmp_path))), signals(60, seed=1)
    assert stored["inputs"].dtype == np.float32 and set(stored) == {"inputs", "targets"}
    np.testing.assert_array_equal(  # the same samples, shuffled by data.split_seed, bit for bit
        np.sort(stored["inputs"].reshape(60, -1), axis=0), np.sort(given["inputs"].reshape(60, -1), axis=0)
    )
    assert sorted(np.asarray(manifest.classes)[stored["targets"]]) == sorted(given["targets"])
    if source == "hugging_face_splits":  # a DatasetDict's own validation split is kept as it is
        assert manifest.split_counts()["val"] == 10
    workload = preflight(cfg, str(tmp_path))  # the factory's model runs on a batch, before any worker starts
    model = workload.build_model(cfg, manifest)
    assert model[0].out_channels == 6, "workload.params reached the model factory"


def test_array_regression_stores_a_hugging_face_datasets_vector_targets_as_float32(sources, tmp_path):
    cfg = _config(sources, "regression_points", name="array_regression", factory="linear")
    manifest = resolve_workload(cfg.workload).prepare_data(cfg.data, str(tmp_path))
    assert manifest.arrays["targets"].dtype == "float32" and manifest.arrays["targets"].shape == [2]
    assert manifest.classes == [] and sum(manifest.split_counts().values()) == 40
    workload = preflight(cfg, str(tmp_path))
    assert workload.name == "array_regression" and workload.primary_mode == "min"


@pytest.mark.parametrize(
    ("source", "found", "fix"),
    [
        ("text_inputs", "column 'inputs' of dtype <U3", "give numeric arrays"),
        ("ragged_rows", "column 'inputs' of dtype object (samples of different shapes", "the same shape"),
        ("ragged_lists", "column 'inputs' that is no array", "the same shape"),
        ("objects", "column 'inputs' of dtype object", "numbers only"),
        ("ragged_items", "column 'inputs' of samples of shape [3] and, from sample 1, [4]", "pad or crop them"),
        ("mixed_labels", "column 'targets' mixing <U3 and float64 values", "numbers only"),
        ("missing_label", "column 'targets' with a NaN or infinite label (sample 1", "drop those samples"),
        ("nan_label", "column 'targets' with a NaN or infinite label (sample 1", "drop those samples"),
        ("wrong_columns", "a datasets.Dataset of columns ['x', 'label']", "dataset.rename_column"),
        ("streaming", "a IterableDataset", "not an iterable or streaming one"),
        ("single_items", "a Singles whose item 0 is a Tensor", "(input, target) pairs"),
        ("empty", "a Dataset of no samples", "give it samples"),
    ],
)
def test_what_a_shard_cannot_store_is_refused_naming_the_dataset_source_the_column_and_the_fix(
    sources, tmp_path, source, found, fix
):
    cfg = _config(sources, source)
    with pytest.raises(ValueError) as caught:
        resolve_workload(cfg.workload).prepare_data(cfg.data, str(tmp_path / "prepared"))
    message = str(caught.value)
    assert message.startswith(f"workload.dataset_source='{sources}:{source}' gave {found}"), message
    assert fix in message.partition("; ")[2], message
    assert not (tmp_path / "prepared").exists()


def test_an_array_workload_needs_a_model_factory_and_data_path_or_a_dataset_source():
    with pytest.raises(ValueError) as caught:
        TrainingConfig.from_dict({"workload": {"name": "array_classification"}, "data": {"path": "/d.npz"}})
    assert str(caught.value).startswith(
        "workload.model_factory='' is invalid: workload.name='array_classification' trains your model"
    )
    with pytest.raises(ValueError) as caught:
        TrainingConfig.from_dict({"workload": {"name": "array_regression", "model_factory": "m:f"}})
    assert str(caught.value).startswith(
        "data.path='' is invalid: workload.name='array_regression' reads a .npz file of 'inputs' and 'targets' there"
    )
    assert "workload.dataset_source" in str(caught.value)


def test_a_model_factory_whose_model_does_not_fit_the_arrays_is_refused_before_any_worker_starts(sources, tmp_path):
    cfg = _config(sources, "arrays", factory="two_class_head")
    resolve_workload(cfg.workload).prepare_data(cfg.data, str(tmp_path))
    with pytest.raises(ValueError) as caught:
        preflight(cfg, str(tmp_path))
    assert str(caught.value).startswith(f"workload.model_factory='{sources}:two_class_head' is invalid: its Sequential")
    assert "returns (2, 2) on a batch of inputs (2, 1, 128)" in str(caught.value)
    assert "returning (2, 3) (logits: the batch, the data's 3 classes)" in str(caught.value)


def test_an_npz_at_data_path_is_read_without_a_dataset_source_and_is_part_of_preps_fingerprint(sources, tmp_path):
    from training_core.data.fingerprint import data_locations

    np.savez(tmp_path / "signals.npz", **signals(30, seed=2))
    cfg = _config(sources, "", path=str(tmp_path / "signals.npz"))
    manifest = resolve_workload(cfg.workload).prepare_data(cfg.data, str(tmp_path / "prepared"))
    assert sum(manifest.split_counts().values()) == 30 and manifest.dataset == str(tmp_path / "signals.npz")
    # Replacing the file at the same path must re-run the cached prep: its fingerprint covers data.path.
    assert data_locations(cfg.data, cfg.workload.for_prep()) == [("data.path", str(tmp_path / "signals.npz"))]


def test_the_image_workloads_dataset_source_returning_arrays_is_pointed_at_the_array_workloads(sources, tmp_path):
    workload = resolve_workload(WorkloadConfig(dataset_source=f"{sources}:arrays"))
    with pytest.raises(ValueError, match="set workload.name to array_classification"):
        workload.prepare_data(DataConfig(), str(tmp_path))


class Counted(torch.utils.data.Dataset):
    """20,000 samples of 64 float32, each a fresh array."""

    def __len__(self):
        return 20_000

    def __getitem__(self, index):
        return np.full(64, index, np.float32), index % 3


def test_a_datasets_samples_are_read_into_one_array_per_column_not_a_list_of_every_sample():
    import datasets

    table = datasets.Dataset.from_dict(
        {"inputs": np.random.default_rng(0).random((20_000, 64), dtype=np.float32), "targets": np.arange(20_000) % 3}
    )
    for dataset in (Counted(), table):
        tracemalloc.start()
        try:
            found = named_arrays(dataset, "source")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        result = sum(array.nbytes for array in found.values())
        # The result and one sample or block of rows: a list of every sample, or to_dict()'s Python lists, held
        # the data two to ten times over.
        assert peak < 1.6 * result, (type(dataset).__name__, peak, result)
        assert found["inputs"].shape == (20_000, 64) and found["inputs"].dtype == np.float32


def test_split_samples_refuses_arrays_of_one_split_that_differ_in_length_naming_the_source():
    # A user's own prep calls split_samples directly (examples/tabular_mlp): 100 features for 90 labels used to end
    # in numpy's IndexError from inside the shuffle.
    from training_core.data import split_samples

    raw = {"train": {"features": np.zeros((100, 3), np.float32), "labels": np.zeros(90, np.int64)}}
    with pytest.raises(ValueError) as error:
        split_samples(raw, DataConfig(), source="workload.dataset_source='mine:load'")
    assert str(error.value) == (
        "workload.dataset_source='mine:load' gave split 'train' arrays of different lengths ('features': 100, "
        "'labels': 90); give each array one entry per sample"
    )
