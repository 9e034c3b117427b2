"""Array workloads (:mod:`training_core.workloads.simple`): a user writes the model and the data as arrays; prep,
the losses, the additive sums and their metrics, ``check`` and ``example_input`` come from the base class. Real
``.npz`` files, a real map-style ``torch.utils.data.Dataset``, real shards read back by the loader, and preflight
on the driver as before any worker starts."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import torch

from examples.signal_cnn.make_data import signals
from tests.conftest import REPO_ROOT
from training_core.config import DataConfig, TrainingConfig
from training_core.data import Manifest, ShardStream
from training_core.workloads import preflight, resolve_workload
from training_core.workloads.simple import ArrayClassification, ArrayRegression

SIGNAL = "examples.signal_cnn.workload:SignalCNN"


def _config(name: str, data_path: str = "", **workload) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "workload": {"name": name, **workload},
            "data": {"path": data_path, "num_shards": 2},
            "loop": {"batch_size": 16},
            "scaling": {"num_workers": 1},
            "observability": {"enabled": False},
        }
    )


def _all(manifest: Manifest, split: str) -> dict[str, np.ndarray]:
    batches = list(ShardStream(manifest, split, rank=0, world_size=1).eval_batches(batch_size=1024))
    return {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}


@pytest.fixture(scope="module")
def signal_npz(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("signals") / "signals.npz"
    np.savez(path, **signals(120, seed=3))
    return str(path)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``write(source)``: a module holding ``source`` on ``sys.path``; its dotted name (forgotten after the test)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(source: str) -> str:
        name = f"simple_user_{len(written)}_{tmp_path.name}".replace("-", "_")
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


def test_float32_signals_from_an_npz_are_prepared_as_float32_shards_with_the_labels_as_classes(signal_npz, tmp_path):
    cfg = _config(SIGNAL, signal_npz)
    manifest = resolve_workload(cfg.workload).prepare_data(cfg.data, str(tmp_path / "prepared"))
    assert manifest.workload == "signal_cnn" and manifest.classes == ["sawtooth", "sine", "square"]
    assert manifest.input_shape == [1, 128] and sum(manifest.split_counts().values()) == 120
    assert manifest.arrays["inputs"].dtype == "float32" and manifest.arrays["targets"].max_value == 2
    reloaded = Manifest.load(str(tmp_path / "prepared"))
    source = signals(120, seed=3)
    stored = np.concatenate([_all(reloaded, split)["inputs"] for split in ("train", "val", "test")])
    assert stored.dtype == np.float32
    np.testing.assert_array_equal(  # the same samples, shuffled by data.split_seed, bit for bit
        np.sort(stored.reshape(120, -1), axis=0), np.sort(source["inputs"].reshape(120, -1), axis=0)
    )


def test_the_signal_example_passes_preflight_and_its_params_shape_the_model(signal_npz, tmp_path):
    cfg = _config(SIGNAL, signal_npz, params={"kernel_size": 7, "channels": 4})
    resolve_workload(cfg.workload).prepare_data(cfg.data, str(tmp_path))
    workload = preflight(cfg, str(tmp_path))
    model = workload.build_model(cfg, Manifest.load(str(tmp_path)))
    assert model[0].kernel_size == (7,) and model[0].out_channels == 4
    example = workload.example_input(Manifest.load(str(tmp_path)))
    assert example.shape == (2, 1, 128) and example.dtype == np.float32
    assert model(torch.from_numpy(example)).shape == (2, 3)


def test_the_classification_sums_add_up_over_batches_to_the_metrics_of_the_whole(signal_npz, tmp_path):
    cfg = _config(SIGNAL, signal_npz)
    workload = resolve_workload(cfg.workload)
    manifest = workload.prepare_data(cfg.data, str(tmp_path))
    torch.manual_seed(0)
    model = workload.build_model(cfg, manifest).eval()
    inputs, labels = workload.to_device(manifest, torch.device("cpu"))(_all(manifest, "train"))
    with torch.no_grad():
        halves = [workload.eval_sums(model, (inputs[s], labels[s])) for s in (slice(0, 37), slice(37, None))]
        whole = workload.eval_sums(model, (inputs, labels))
        logits = model(inputs)
    summed = {name: halves[0][name] + halves[1][name] for name in whole}
    for name in whole:
        torch.testing.assert_close(summed[name], whole[name])
    metrics = workload.metrics(summed)
    predicted = logits.argmax(dim=1)
    assert metrics["accuracy"] == pytest.approx(float((predicted == labels).float().mean()))
    assert metrics["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)), rel=1e-5)
    f1s = []
    for c in range(3):
        tp, fp = int(((predicted == c) & (labels == c)).sum()), int(((predicted == c) & (labels != c)).sum())
        fn = int(((predicted != c) & (labels == c)).sum())
        f1s.append(1.0 if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn))
    assert metrics["f1"] == pytest.approx(sum(f1s) / 3)
    assert int(summed["confusion"].sum()) == int(summed["samples"]) == len(labels)


def test_a_regression_from_a_map_style_torch_dataset_trains_on_float_targets_and_reports_mse_and_mae(
    user_module, tmp_path
):
    module = user_module(
        """
        import torch
        from torch import nn
        from training_core.workloads.simple import ArrayRegression

        class Points(torch.utils.data.Dataset):
            def __len__(self):
                return 50
            def __getitem__(self, index):
                x = torch.tensor([index / 50.0, 1.0 - index / 50.0], dtype=torch.float64)
                return x, torch.tensor(3.0 * index / 50.0)

        class Line(ArrayRegression):
            name = "line"
            def load_arrays(self, data):
                return Points()
            def build_model(self, config, manifest):
                return nn.Linear(manifest.input_shape[0], 1)
        """
    )
    cfg = _config(f"{module}:Line")
    workload = resolve_workload(cfg.workload)
    manifest = workload.prepare_data(cfg.data, str(tmp_path))
    assert manifest.arrays["inputs"].dtype == "float32" and manifest.arrays["targets"].dtype == "float32"
    assert manifest.classes == [] and sum(manifest.split_counts().values()) == 50
    preflight(cfg, str(tmp_path))
    torch.manual_seed(0)
    model = workload.build_model(cfg, manifest)
    inputs, targets = workload.to_device(manifest, torch.device("cpu"))(_all(manifest, "train"))
    output = workload.loss(model, (inputs, targets))
    assert output.loss.requires_grad and int(output.sums["samples"]) == output.num_samples == len(targets)
    with torch.no_grad():
        sums = workload.eval_sums(model, (inputs, targets))
        error = model(inputs).squeeze(1) - targets
    metrics = workload.metrics(sums)
    assert metrics["loss"] == pytest.approx(float(error.square().mean()), rel=1e-5)
    assert metrics["mae"] == pytest.approx(float(error.abs().mean()), rel=1e-5)
    assert workload.primary_metric == "loss" and workload.primary_mode == "min"


def test_named_splits_of_the_users_own_are_kept_and_integer_inputs_are_stored_as_they_are(user_module, tmp_path):
    module = user_module(
        """
        import numpy as np
        from torch import nn
        from training_core.workloads.simple import ArrayClassification

        class Counts(ArrayClassification):
            name = "counts"
            def load_arrays(self, data):
                x = np.arange(80, dtype=np.int32).reshape(40, 2)
                return {"train": {"inputs": x, "targets": x[:, 0] % 4 == 0, "ignored": x},
                        "test": {"inputs": x[:10], "targets": x[:10, 0] % 4 == 0}}
            def build_model(self, config, manifest):
                return nn.Linear(2, manifest.num_classes)
        """
    )
    cfg = _config(f"{module}:Counts")
    manifest = resolve_workload(cfg.workload).prepare_data(cfg.data, str(tmp_path))
    assert manifest.split_counts()["test"] == 10 and manifest.classes == ["False", "True"]
    assert manifest.arrays["inputs"].dtype == "int32" and set(manifest.arrays) == {"inputs", "targets"}
    np.testing.assert_array_equal(_all(manifest, "test")["targets"], np.arange(10) % 2 == 0)
    preflight(cfg, str(tmp_path))


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        ("{'inputs': np.zeros((4, 2), np.float32)}", "it lacks ['targets']"),
        ("{'inputs': np.zeros(4), 'targets': np.zeros(3)}", "give one target per input"),
        ("{'inputs': np.array(['a', 'b']), 'targets': np.arange(2)}", "give numeric arrays"),
        ("{'inputs': np.array([1.0, np.nan]), 'targets': np.arange(2)}", "fill or drop those samples"),
        ("{'inputs': np.zeros(4), 'targets': np.ones(4)}", "a classifier needs at least 2 distinct labels"),
        ("{'val': {'inputs': np.zeros(4), 'targets': np.arange(4)}}", "return a 'train' split"),
        ("{'inputs': np.zeros((3, 2)), 'targets': np.array([0.0, np.nan, 1.0])}", "give them their label"),
        ("{'inputs': [[1.0, 2.0], [3.0]], 'targets': [0, 1]}", "give every sample of a column the same shape"),
        ("42", "return a mapping of array names to arrays, or a Dataset"),
        (
            "{'train': {'inputs': np.zeros((4, 2)), 'targets': np.arange(4)}, "
            "'test': {'inputs': np.zeros((2, 2)), 'targets': np.array(['0', '1'])}}",
            "column 'targets' whose samples differ by split ({'train': 'int64 []', 'test': '<U1 []'})",
        ),
        (
            "{'train': {'inputs': np.zeros((4, 2)), 'targets': np.arange(4)}, "
            "'test': {'inputs': np.zeros((2, 2)), 'targets': np.zeros((2, 2))}}",
            "'test': 'float64 [2]'",
        ),
    ],
)
def test_arrays_a_classifier_cannot_train_on_are_refused_naming_the_source_and_the_fix(
    user_module, tmp_path, returned, expected
):
    module = user_module(
        f"""
        import numpy as np
        from training_core.workloads.simple import ArrayClassification

        class Bad(ArrayClassification):
            name = "bad"
            def load_arrays(self, data):
                return {returned}
        """
    )
    with pytest.raises(ValueError, match="Bad.load_arrays") as caught:
        resolve_workload(_config(f"{module}:Bad").workload).prepare_data(DataConfig(), str(tmp_path))
    assert expected in str(caught.value)


def test_an_empty_data_path_and_a_file_that_is_not_an_npz_name_data_path(tmp_path):
    workload = ArrayClassification()
    with pytest.raises(ValueError, match="data.path='' is invalid: name a .npz file"):
        workload.load_arrays(DataConfig())
    (tmp_path / "table.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="it is not a readable .npz file"):
        workload.load_arrays(DataConfig(path=str(tmp_path / "table.csv")))
    assert ArrayRegression().primary_metric == "loss"


def test_an_npz_whose_arrays_unpack_past_the_cap_is_refused_before_any_is_unpacked(tmp_path, monkeypatch):
    # The cap held for the compressed file only: a few KB of zeros unpacked to any size (5 GiB fit in 5 MB).
    from training_core.workloads import simple

    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, inputs=np.zeros((4, 2)), targets=np.arange(4), pad=np.zeros(2**20, np.uint8))
    assert path.stat().st_size < 10_000
    monkeypatch.setattr(simple, "MAX_NPZ_BYTES", 100_000)
    with pytest.raises(ValueError) as error:
        ArrayClassification().load_arrays(DataConfig(path=str(path)))
    message = str(error.value)
    assert message.startswith(f"data.path='{path}' is invalid: its arrays unpack to 1,04")
    assert "over 100,000; keep only 'inputs' and 'targets'" in message


def test_data_prepared_by_another_workload_is_refused_before_any_worker_starts(signal_npz, tmp_path):
    from training_core.data import prepare

    prepare(DataConfig(num_shards=2), str(tmp_path))  # digits, by image_classification
    with pytest.raises(ValueError, match="prepare the data with the same workload"):
        preflight(_config(SIGNAL, signal_npz), str(tmp_path))


def test_tuning_ranks_an_array_classifier_by_macro_f1_and_a_regression_by_mae_in_their_directions(user_module):
    from training_core.config import WorkloadConfig
    from training_core.tuning import metric_mode

    module = user_module(
        """
        from training_core.workloads.simple import ArrayRegression

        class Line(ArrayRegression):
            name = "line"
        """
    )
    assert metric_mode("val_f1", WorkloadConfig(name=SIGNAL)) == "max"
    assert metric_mode("val_mae", WorkloadConfig(name=f"{module}:Line")) == "min"


def test_the_signal_examples_training_config_prepares_its_npz_and_passes_preflight(signal_npz, tmp_path):
    from training_core.config import load_config
    from training_core.data import prepare

    config = load_config(REPO_ROOT / "examples" / "signal_cnn.yaml", environ={"TRAINING_CORE__DATA__PATH": signal_npz})
    manifest = prepare(config.data, str(tmp_path), workload=config.workload)
    assert manifest.workload == "signal_cnn" and manifest.arrays["inputs"].dtype == "float32"
    assert preflight(config, str(tmp_path)).params.kernel_size == 5
