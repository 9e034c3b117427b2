"""User workloads without Ray: what ``resolve_workload`` and ``preflight`` say about user code that cannot train (each
message names the field, the value and the fix), where user code is imported from (``code_paths``), and the
example user package (``examples/tabular_mlp``) preparing, training, evaluating and loading in this process."""

from __future__ import annotations

import itertools
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import REPO_ROOT
from training_core.config import DataConfig, TrainingConfig, WorkloadConfig, load_config
from training_core.data import MANIFEST_NAME, Manifest, prepare
from training_core.registry import WORKLOADS
from training_core.train.failures import USER, UserCodeError, classify
from training_core.workloads import Workload, code_paths, preflight, resolve_workload

EXAMPLE = "examples.tabular_mlp.workload:TabularMLP"
BROKEN = "examples.broken_workload.workload:Broken"
IMPORTABLE_FIX = "make the package importable where the task runs"
_names = itertools.count()


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """``write(source)`` puts a module holding ``source`` in a fresh package under ``tmp_path`` (on ``sys.path``)
    and returns the module's dotted name; the package is forgotten after the test."""
    package = f"user_code_{next(_names)}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield lambda source, module="workload": _write(tmp_path / package, module, source)
    for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
        del sys.modules[name]


def _write(directory: Path, module: str, source: str) -> str:
    (directory / f"{module}.py").write_text(textwrap.dedent(source))
    return f"{directory.name}.{module}"


def _error(selected: WorkloadConfig) -> str:
    with pytest.raises(ValueError) as caught:
        resolve_workload(selected)
    return str(caught.value)


def _config(workload: dict, **sections) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "workload": workload,
            "scaling": {"num_workers": 1},
            "observability": {"enabled": False},
            **sections,
        }
    )


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("digits")
    prepare(DataConfig(), str(out))
    return str(out)


@pytest.fixture(scope="module")
def table_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("table")
    resolve_workload(WorkloadConfig(name=EXAMPLE)).prepare_data(DataConfig(), str(out))
    return str(out)


# --- workload.name: user code that cannot be used ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "raised"),
    [
        (
            "import a_dependency_nobody_installed\n",
            "ModuleNotFoundError: No module named 'a_dependency_nobody_installed'",
        ),
        ("raise ImportError('needs libfoo.so')\n", "ImportError: needs libfoo.so"),
        ("def build(:\n    pass\n", "SyntaxError: "),
        ("VALUE = 1 / 0\n", "ZeroDivisionError: division by zero"),
    ],
    ids=["missing-dependency", "import-error", "syntax-error", "error-at-import"],
)
def test_a_module_that_does_not_import_names_the_field_the_path_what_it_raised_and_the_fix(
    user_package, source, raised
):
    module = user_package(source)
    message = _error(WorkloadConfig(name=f"{module}:Workload"))
    assert message.startswith(f"workload.name='{module}:Workload' is invalid: module '{module}' does not import (")
    assert raised in message
    assert IMPORTABLE_FIX in message and "fast-registration tarball" in message and "PYTHONPATH" in message


def test_a_package_that_is_not_there_at_all_is_named_with_the_fix():
    message = _error(WorkloadConfig(name="nowhere_to_be_found.workload:Workload"))
    assert message.startswith(
        "workload.name='nowhere_to_be_found.workload:Workload' is invalid: module 'nowhere_to_be_found.workload' does "
        "not import (ModuleNotFoundError: No module named 'nowhere_to_be_found')"
    )
    assert IMPORTABLE_FIX in message


def test_a_missing_attribute_names_the_field_the_path_and_what_the_module_has(user_package):
    module = user_package("class TableWorkload:\n    pass\n\ndef helper():\n    pass\n\n_private = 1\n")
    message = _error(WorkloadConfig(name=f"{module}:TabularWorkload"))
    assert message == (
        f"workload.name='{module}:TabularWorkload' is invalid: module '{module}' has no attribute 'TabularWorkload'; "
        "name one it has after the ':' (TableWorkload, helper)"
    )


def test_an_attribute_that_is_not_callable_names_its_type_and_asks_for_a_factory(user_package):
    module = user_package("WORKLOAD = 'tabular'\n")
    message = _error(WorkloadConfig(name=f"{module}:WORKLOAD"))
    assert message == (
        f"workload.name='{module}:WORKLOAD' is invalid: {module}.WORKLOAD is a str, not callable; name a factory"
    )


def test_a_factory_that_needs_arguments_is_refused_before_it_is_called(user_package):
    module = user_package("def build(config):\n    raise AssertionError('never called')\n")
    message = _error(WorkloadConfig(name=f"{module}:build"))
    assert message == (
        f"workload.name='{module}:build' is invalid: it must be callable with no arguments (a class or a factory)"
    )


def test_a_factory_that_raises_names_the_field_the_path_the_error_and_the_fix(user_package):
    module = user_package("def build():\n    raise RuntimeError('no GPU here')\n")
    message = _error(WorkloadConfig(name=f"{module}:build"))
    assert message == f"workload.name='{module}:build' raised RuntimeError: no GPU here; fix the factory"


def test_an_object_that_is_not_a_workload_names_everything_it_lacks(user_package):
    module = user_package(
        """
        class Almost:
            name = "almost"
            primary_metric = "accuracy"

            def prepare_data(self, data, out_dir): ...
            def check(self, config, manifest): ...
            def build_model(self, config, manifest): ...
            def loss(self, model, batch): ...
            to_device = "not a method"
        """
    )
    message = _error(WorkloadConfig(name=f"{module}:Almost"))
    assert message == (
        f"workload.name='{module}:Almost' is invalid: it returned a Almost, which is not a workload: it lacks "
        "primary_mode, to_device(), eval_sums(), metrics(), example_input(); implement the "
        "training_core.workloads.Workload protocol"
    )


def test_a_factory_that_returns_nothing_is_not_a_workload(user_package):
    module = user_package("def build():\n    pass\n")
    message = _error(WorkloadConfig(name=f"{module}:build"))
    assert f"workload.name='{module}:build' is invalid: it returned a NoneType, which is not a workload" in message
    assert "implement the training_core.workloads.Workload protocol" in message


def test_the_broken_example_package_is_refused_naming_the_methods_it_lacks():
    message = _error(load_config(REPO_ROOT / "examples" / "broken_workload.yaml", environ={}).workload)
    assert message == (
        f"workload.name='{BROKEN}' is invalid: it returned a Broken, which is not a workload: it lacks "
        "eval_sums(), metrics(); implement the training_core.workloads.Workload protocol"
    )


@pytest.mark.parametrize(
    ("attributes", "expected"),
    [
        (
            'primary_metric = "accuracy"\n    primary_mode = "maximise"',
            "workload.name (its primary_mode)='maximise' is invalid: it must be 'max' or 'min'",
        ),
        (
            'primary_metric = ""\n    primary_mode = "max"',
            "workload.name (its primary_metric)='' is invalid: it must name a metric, e.g. 'accuracy'",
        ),
    ],
    ids=["mode", "metric"],
)
def test_a_workload_with_a_bad_primary_metric_or_direction_is_refused(user_package, attributes, expected):
    module = user_package(
        f"""
from examples.tabular_mlp.workload import TabularMLP

class Tuned(TabularMLP):
    {attributes}
"""
    )
    assert _error(WorkloadConfig(name=f"{module}:Tuned")) == expected


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {"name": "examples/tabular_mlp/workload.py"},
            f"workload.name='examples/tabular_mlp/workload.py' is invalid: choose {', '.join(WORKLOADS)} or name "
            "user code as 'package.module:attribute'",
        ),
        (
            {"name": "examples.tabular_mlp.workload.TabularMLP"},
            f"workload.name='examples.tabular_mlp.workload.TabularMLP' is invalid: choose {', '.join(WORKLOADS)} or "
            "name user code as 'package.module:attribute'",
        ),
        (
            {"name": "examples.tabular_mlp.workload:Tabular MLP"},
            "workload.name='examples.tabular_mlp.workload:Tabular MLP' is invalid",
        ),
        (
            {"model_factory": "my_models.make"},
            "workload.model_factory='my_models.make' is invalid: name user code as 'package.module:attribute'",
        ),
        (
            {"name": EXAMPLE, "model_factory": "my_models:make"},
            "workload.model_factory='my_models:make' is invalid: it applies to a built-in workload; a user workload "
            "builds its own",
        ),
        (
            {"dataset_source": "s3://bucket/table.csv"},
            "workload.dataset_source='s3://bucket/table.csv' is invalid: name user code as 'package.module:attribute'",
        ),
    ],
    ids=["file-path", "dot-not-colon", "space", "factory-path", "factory-for-user-workload", "source-is-a-uri"],
)
def test_a_malformed_import_path_is_a_config_error_naming_the_field_and_the_form(fields, expected):
    with pytest.raises(ValueError) as caught:
        TrainingConfig.from_dict({"workload": fields})
    assert str(caught.value).startswith(expected)
    assert "'package.module:attribute'" in str(caught.value) or "built-in" in str(caught.value)


# --- user code that exits the process, or breaks the protocol on a batch ----------------------------------------


@pytest.mark.parametrize(
    ("source", "raised"),
    [
        ("import sys\nsys.exit(0)\n", "SystemExit(0)"),
        ("import sys\nsys.exit(3)\n", "SystemExit(3)"),
        (
            "import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--lr', required=True)\n"
            "ARGS = parser.parse_args()\n",
            "SystemExit(2)",
        ),
        ("raise KeyboardInterrupt\n", "KeyboardInterrupt: "),
    ],
    ids=["exit-0", "exit-3", "argparse", "keyboard-interrupt"],
)
def test_a_module_that_exits_at_import_is_a_user_error_naming_the_field_and_the_fix(user_package, source, raised):
    module = user_package(source)
    with pytest.raises(UserCodeError) as caught:  # a ValueError, which a worker's restart would meet again
        resolve_workload(WorkloadConfig(name=f"{module}:Workload"))
    message = str(caught.value)
    assert message.startswith(f"workload.name='{module}:Workload' is invalid: module '{module}' raised {raised}")
    assert message.endswith(
        "at import; exit the process and parse the command line (argparse) only under "
        "`if __name__ == '__main__':`, never at import or in code the platform calls"
    ), message


def test_a_factory_that_exits_is_a_user_code_error_naming_the_field(user_package):
    module = user_package("import sys\n\ndef build():\n    sys.exit(3)\n")
    with pytest.raises(UserCodeError) as caught:
        resolve_workload(WorkloadConfig(name=f"{module}:build"))
    assert str(caught.value) == (
        f"workload.name='{module}:build' raised SystemExit(3): it exits the process (sys.exit(), or an argparse "
        "parser's error); fix the factory"
    )


EXAMPLE_SUBCLASS = """
from examples.tabular_mlp.workload import TabularMLP

class Tables(TabularMLP):
{body}
"""


def _tables(user_package, body: str) -> str:
    return f"{user_package(EXAMPLE_SUBCLASS.format(body=textwrap.indent(textwrap.dedent(body), '    ')))}:Tables"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            """
            def loss(self, model, batch):
                return float(super().loss(model, batch).loss.detach())
            """,
            "its loss() returned a float, not a training_core.workloads.LossOutput",
        ),
        (
            """
            def loss(self, model, batch):
                output = super().loss(model, batch)
                output.loss = output.loss.detach().item()
                return output
            """,
            "its loss() returned a LossOutput, whose loss is float: it must be a 0-dim floating-point tensor",
        ),
        (
            """
            def loss(self, model, batch):
                output = super().loss(model, batch)
                output.loss = output.loss.detach()
                return output
            """,
            "its loss() returned a LossOutput, whose loss does not require grad: compute it from the model's output, "
            "not detached",
        ),
        (
            """
            def build_model(self, config, manifest):
                super().build_model(config, manifest)
            """,
            "its build_model() returned a NoneType, not a torch.nn.Module",
        ),
        (
            """
            def eval_sums(self, model, batch):
                sums = super().eval_sums(model, batch)
                return {name: float(value.sum()) for name, value in sums.items()}
            """,
            "its eval_sums() returned a dict, which must map names to tensors",
        ),
        (
            """
            def metrics(self, sums):
                return {"accuracy": 1.0}
            """,
            "its metrics() returned a dict, which lacks 'loss' of the evaluation figures",
        ),
    ],
    ids=["loss-is-a-float", "loss-field-is-a-float", "loss-detached", "model-is-none", "sums-are-floats", "no-loss"],
)
def test_a_workload_that_breaks_the_protocol_on_a_batch_fails_preflight_naming_the_field(
    user_package, table_dir, body, expected
):
    path = _tables(user_package, body)
    with pytest.raises(UserCodeError) as caught:
        preflight(_config({"name": path}), table_dir)
    assert str(caught.value).startswith(f"workload.name='{path}': {expected}"), str(caught.value)
    assert str(caught.value).endswith("; see the training_core.workloads.Workload protocol")


def test_an_error_in_the_workloads_loss_fails_preflight_naming_the_field_and_the_method(user_package, table_dir):
    path = _tables(
        user_package,
        """
        def loss(self, model, batch):
            features, labels = batch
            return super().loss(model, (features[:, :20], labels))
        """,
    )
    with pytest.raises(UserCodeError) as caught:
        preflight(_config({"name": path}), table_dir)
    message = str(caught.value)
    assert message.startswith(
        f"workload.name='{path}' failed in its loss(): RuntimeError: The size of tensor a (20) must match "
    ), message
    assert message.endswith("; fix the workload's loss()")


def test_in_a_worker_the_workloads_own_errors_are_named_and_infrastructure_and_memory_errors_pass_through(
    user_package, table_dir
):
    path = _tables(
        user_package,
        """
        raises = None

        def loss(self, model, batch):
            raise self.raises
        """,
    )
    cfg = _config({"name": path})
    workload = resolve_workload(cfg.workload)
    manifest = Manifest.load(table_dir)
    model = workload.build_model(cfg, manifest)
    batch = workload.to_device(manifest, torch.device("cpu"))(
        {"features": np.zeros((2, 30), np.float32), "labels": np.zeros(2, np.int64)}
    )

    workload.workload.raises = KeyError("diagnosis")
    with pytest.raises(UserCodeError) as caught:
        workload.loss(model, batch)
    assert (
        str(caught.value)
        == f"workload.name='{path}' failed in its loss(): KeyError: 'diagnosis'; fix the workload's loss()"
    )
    assert classify(caught.value).kind == USER
    # What the loop handles (CUDA out of memory: loop.oom_policy), and a peer lost inside DDP's forward: unchanged.
    for passing in (
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("[gloo/pair.cc:561] Connection closed by peer [127.0.0.1]:40846"),
        UserCodeError("data.path: sample 7 of shard train-00000 does not decode"),
    ):
        workload.workload.raises = passing
        with pytest.raises(type(passing)) as caught:
            workload.loss(model, batch)
        assert caught.value is passing


# --- a built-in workload with a user model or dataset -----------------------------------------------------------


def test_a_model_factory_that_returns_no_module_fails_preflight(user_package, digits_dir):
    module = user_package("def make(config, manifest):\n    return 'resnet18'\n")
    cfg = _config({"model_factory": f"{module}:make"})
    with pytest.raises(ValueError) as caught:
        preflight(cfg, digits_dir)
    assert str(caught.value) == (
        f"workload.model_factory='{module}:make' returned a str; it must return a torch.nn.Module"
    )


def test_a_model_factory_whose_model_does_not_fit_the_data_fails_preflight(user_package, digits_dir):
    module = user_package(
        """
        from torch import nn

        def three_classes(config, manifest):
            return nn.Sequential(nn.Flatten(), nn.LazyLinear(3))

        def for_colour_images(config, manifest):
            return nn.Conv2d(3, 8, 3)
        """
    )
    cfg = _config({"model_factory": f"{module}:three_classes"})
    with pytest.raises(ValueError) as caught:
        preflight(cfg, digits_dir)
    assert str(caught.value) == (
        f"workload.model_factory='{module}:three_classes' is invalid: it built a Sequential whose output on a batch "
        "of inputs (2, 1, 8, 8) is (2, 3); it must be logits of shape (2, 10) (batch, the data's 10 classes)"
    )
    cfg = _config({"model_factory": f"{module}:for_colour_images"})
    with pytest.raises(ValueError) as caught:
        preflight(cfg, digits_dir)
    message = str(caught.value)
    assert message.startswith(
        f"workload.model_factory='{module}:for_colour_images' is invalid: it built a Conv2d that fails on a batch of "
        "inputs (2, 1, 8, 8) (RuntimeError: "
    )
    assert message.endswith("); build a model for inputs of shape [1, 8, 8]")


def test_a_model_factory_that_raises_or_takes_no_arguments_fails_preflight(user_package, digits_dir):
    module = user_package(
        "def broken(config, manifest):\n    raise KeyError('width')\n\ndef no_arguments():\n    pass\n"
    )
    with pytest.raises(ValueError) as caught:
        preflight(_config({"model_factory": f"{module}:broken"}), digits_dir)
    assert str(caught.value) == f"workload.model_factory='{module}:broken' raised KeyError: 'width'; fix the factory"
    with pytest.raises(ValueError) as caught:
        preflight(_config({"model_factory": f"{module}:no_arguments"}), digits_dir)
    assert str(caught.value).startswith(f"workload.model_factory='{module}:no_arguments' raised TypeError: ")
    assert str(caught.value).endswith("; fix the factory")


def test_a_model_factory_that_fits_passes_preflight_and_builds_the_training_model(user_package, digits_dir):
    module = user_package(
        """
        from torch import nn

        def make(config, manifest):
            return nn.Sequential(nn.Flatten(), nn.Linear(64, manifest.num_classes))
        """
    )
    cfg = _config({"model_factory": f"{module}:make"})
    workload = preflight(cfg, digits_dir)
    model = workload.build_model(cfg, Manifest.load(digits_dir))
    assert isinstance(model, torch.nn.Sequential) and model[1].out_features == 10


def test_a_model_factory_that_does_not_import_fails_when_the_workload_is_resolved():
    message = _error(WorkloadConfig(model_factory="nowhere_to_be_found.models:make"))
    assert message.startswith(
        "workload.model_factory='nowhere_to_be_found.models:make' is invalid: module 'nowhere_to_be_found.models' "
        "does not import"
    )
    assert IMPORTABLE_FIX in message


def test_a_dataset_source_that_returns_the_wrong_type_fails_data_prep(user_package, tmp_path):
    module = user_package("def source(data):\n    return {'train': ([], [])}\n")
    workload = resolve_workload(WorkloadConfig(dataset_source=f"{module}:source"))
    with pytest.raises(ValueError) as caught:
        workload.prepare_data(DataConfig(), str(tmp_path / "prepared"))
    assert str(caught.value) == (
        f"workload.dataset_source='{module}:source' returned a dict; it must return a "
        "training_core.data.sources.RawDataset (uint8 images N x C x H x W and int64 labels per split, and the class "
        "names); for other arrays, a PyTorch Dataset or a Hugging Face datasets.Dataset, set workload.name to "
        "array_classification (or array_regression)"
    )
    assert not (tmp_path / "prepared").exists()


@pytest.mark.parametrize("image_size", [0, 16], ids=["as-given", "resized"])
def test_a_dataset_source_whose_images_are_wrong_names_the_source_and_the_split(user_package, tmp_path, image_size):
    # Resized (data.image_size), the images used to reach torch's interpolate first and fail with its own words.
    module = user_package(
        """
        import numpy as np
        from training_core.data.sources import RawDataset

        def source(data):
            images = np.zeros((40, 8, 8), dtype=np.uint8)  # no channel axis
            return RawDataset(splits={"train": (images, np.zeros(40, dtype=np.int64))}, classes=["a", "b"])
        """
    )
    workload = resolve_workload(WorkloadConfig(dataset_source=f"{module}:source"))
    with pytest.raises(ValueError) as caught:
        workload.prepare_data(DataConfig(image_size=image_size), str(tmp_path / "prepared"))
    assert str(caught.value).startswith(f"workload.dataset_source='{module}:source' gave split 'train' images ")
    assert "expected uint8 N x C x H x W" in str(caught.value)


# --- data prepared by another workload --------------------------------------------------------------------------


def test_the_example_refuses_data_prepared_by_a_built_in_workload(digits_dir):
    with pytest.raises(ValueError) as caught:
        preflight(_config({"name": EXAMPLE}), digits_dir)
    assert str(caught.value) == (
        f"workload.name='{EXAMPLE}' trains a tabular_mlp workload, but the data at '{digits_dir}' was prepared by "
        "'image_classification'; prepare the data with the same workload"
    )


def test_a_built_in_workload_refuses_data_prepared_by_the_example(table_dir):
    with pytest.raises(ValueError) as caught:
        preflight(_config({"name": "image_classification"}), table_dir)
    assert str(caught.value) == (
        f"workload.name='image_classification' trains on images, but the prepared data at '{table_dir}' was written "
        "by workload 'tabular_mlp'; prepare the data with the same workload"
    )


def test_the_example_refuses_data_prepared_by_another_user_workload(table_dir, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(table_dir, other)
    manifest = json.loads((other / MANIFEST_NAME).read_text())
    manifest["workload"] = "someone_elses_tables"
    (other / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as caught:
        preflight(_config({"name": EXAMPLE}), str(other))
    assert str(caught.value) == (
        f"workload.name='{EXAMPLE}' trains an MLP on tables, but the prepared data at '{other}' was written by "
        "workload 'someone_elses_tables' with arrays ['features', 'labels']; prepare the data with the same workload"
    )


def test_the_example_checks_the_batch_against_the_data_before_any_worker_starts(table_dir):
    with pytest.raises(ValueError) as caught:
        preflight(_config({"name": EXAMPLE}, loop={"batch_size": 512}), table_dir)
    assert str(caught.value).startswith("loop.batch_size=512 is too large")
    assert "lower loop.batch_size or scaling.num_workers" in str(caught.value)


# --- where user code is imported from ---------------------------------------------------------------------------


def test_code_paths_of_the_example_is_the_repository_root():
    selected = load_config(REPO_ROOT / "examples" / "tabular_mlp.yaml", environ={}).workload
    assert selected.name == EXAMPLE
    workload = resolve_workload(selected)
    assert isinstance(workload, Workload)
    assert code_paths(selected) == [str(REPO_ROOT)]


def test_code_paths_of_a_user_package_elsewhere_is_its_sys_path_entry(user_package, tmp_path):
    module = user_package("from examples.tabular_mlp.workload import TabularMLP as Tables\n", module="tables")
    selected = WorkloadConfig(name=f"{module}:Tables")
    resolve_workload(selected)
    assert code_paths(selected) == [str(tmp_path)]


def test_code_paths_of_a_built_in_with_a_user_model_is_the_models_root(user_package, tmp_path):
    module = user_package("def make(config, manifest):\n    pass\n", module="models")
    selected = WorkloadConfig(model_factory=f"{module}:make")
    resolve_workload(selected)
    assert code_paths(selected) == [str(tmp_path)]
    assert code_paths(WorkloadConfig()) == []


# --- the example package ----------------------------------------------------------------------------------------


def test_the_example_prepares_standardisation_statistics_of_the_training_split_only(table_dir):
    from training_core.data import ShardStream

    manifest = Manifest.load(table_dir)
    assert manifest.workload == "tabular_mlp" and manifest.classes == ["benign", "malignant"]
    assert manifest.split_counts() == {"train": 398, "test": 114, "val": 57}
    assert manifest.input_shape == [30] and len(manifest.spec["feature_names"]) == 30
    assert manifest.spec["label_column"] == "diagnosis"
    assert manifest.arrays["features"].dtype == "float32" and manifest.arrays["labels"].max_value == 1
    train = np.concatenate(
        [b["features"] for b in ShardStream(manifest, "train", rank=0, world_size=1).eval_batches(batch_size=512)]
    )
    assert len(train) == 398
    np.testing.assert_allclose(manifest.mean, train.astype(np.float64).mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(manifest.std, train.astype(np.float64).std(axis=0), rtol=1e-6)


def test_the_example_reads_another_csv_from_data_path(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 3))
    rows = ["a,b,c,species"] + [f"{a:.4f},{b:.4f},{c:.4f},{'setosa' if a > 0 else 'virginica'}" for a, b, c in x]
    (tmp_path / "plants.csv").write_text("\n".join(rows) + "\n")
    data = DataConfig(path=str(tmp_path / "plants.csv"), num_shards=2)
    manifest = resolve_workload(WorkloadConfig(name=EXAMPLE)).prepare_data(data, str(tmp_path / "prepared"))
    assert manifest.dataset == str(tmp_path / "plants.csv")
    assert manifest.classes == ["setosa", "virginica"] and manifest.input_shape == [3]
    assert manifest.spec == {"feature_names": ["a", "b", "c"], "label_column": "species"}
    assert sum(manifest.split_counts().values()) == 60


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no CSV file there; give a local path or s3:// URI of a CSV table"),
        ("a,b,label\n1,x,yes\n2,y,no\n3,z,yes\n", "feature columns ['b'] are not numeric"),
        ("a,b,label\n1,2,yes\n2,,no\n3,4,yes\n", "feature columns ['b'] have missing or infinite values"),
        ("a,b,label\n1,2,yes\n2,3,yes\n3,4,yes\n", "the label column 'label' has one value ['yes']"),
        ("", "it is not a readable CSV table (EmptyDataError: "),
    ],
    ids=["missing", "text-feature", "missing-value", "one-class", "empty"],
)
def test_the_example_names_data_path_and_the_fix_for_a_table_it_cannot_train_on(tmp_path, content, expected):
    path = tmp_path / "table.csv"
    if content is not None:
        path.write_text(content)
    workload = resolve_workload(WorkloadConfig(name=EXAMPLE))
    with pytest.raises(ValueError) as caught:
        workload.prepare_data(DataConfig(path=str(path)), str(tmp_path / "prepared"))
    assert str(caught.value).startswith(f"data.path='{path}' is invalid: ")
    assert expected in str(caught.value)


def test_the_example_trains_evaluates_and_its_checkpoint_predicts_raw_rows_in_process(table_dir, tmp_path):
    import pandas as pd

    from tests.helpers.runtime import InProcessRuntime
    from training_core import checkpoint as ckpt
    from training_core.evaluation import evaluate_checkpoint
    from training_core.records import WorkerArgs
    from training_core.train.loop import run_worker

    cfg = load_config(REPO_ROOT / "examples" / "tabular_mlp.yaml", environ={})
    cfg = TrainingConfig.from_dict(
        cfg.to_dict()
        | {
            "loop": cfg.to_dict()["loop"] | {"epochs": 4},
            "scaling": cfg.to_dict()["scaling"] | {"num_workers": 1},
            "observability": {"enabled": False},
        }
    )
    preflight(cfg, table_dir)
    runtime = InProcessRuntime()
    run_worker(WorkerArgs.build(cfg, data_dir=table_dir, checkpoint_root=str(tmp_path), run_name="unit"), runtime)
    assert [r["epoch"] for r in runtime.reports] == [1.0, 2.0, 3.0, 4.0]
    assert runtime.reports[-1]["train_loss"] < runtime.reports[0]["train_loss"]
    assert runtime.reports[-1]["val_accuracy"] > 0.9 and runtime.reports[-1]["train_accuracy"] > 0.9

    final = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(tmp_path)))
    report = evaluate_checkpoint(final.uri, table_dir, split="test")
    assert report.workload == "tabular_mlp" and report.primary_metric == "accuracy" and report.primary_mode == "max"
    assert report.num_samples == 114 and report.metrics["accuracy"] > 0.9 and report.metrics["loss"] < 0.3
    assert np.asarray(report.confusion).sum() == 114 and report.classes == ["benign", "malignant"]

    # The checkpoint's model takes raw rows of the table: it standardises them itself.
    model, _, workload = ckpt.load_model(final.uri)
    table = pd.read_csv(REPO_ROOT / "examples" / "tabular_mlp" / "breast_cancer.csv")
    with torch.no_grad():
        predicted = model.eval()(torch.from_numpy(table.iloc[:, :-1].to_numpy(np.float32))).argmax(dim=1)
    truth = (table["diagnosis"] == "malignant").to_numpy()
    assert (predicted.numpy() == truth).mean() > 0.95
    assert workload.example_input(Manifest.load(table_dir)).shape == (2, 30)


# --- workload.params: the user's own hyperparameters, typed by the workload's dataclass ------------------------------

CNN = "examples.cnn_params.workload:DigitsCNN"


def test_params_reach_a_user_workload_as_the_dataclass_it_declares(digits_dir):
    from examples.cnn_params.workload import CNNParams

    cfg = _config({"name": CNN, "params": {"kernel_size": 5, "channels": 4}}, data={"num_shards": 2})
    workload = preflight(cfg, digits_dir)  # runs the model on a batch: it reports f1, its primary metric
    assert workload.params == CNNParams(kernel_size=5, channels=4)
    model = workload.build_model(cfg, Manifest.load(digits_dir))
    assert model[0].kernel_size == (5, 5) and model[0].out_channels == 4


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (
            {"kernel": 3},
            "workload.params.kernel=3 is invalid: CNNParams has no field 'kernel'; use one of its fields "
            "(kernel_size, channels) or add it",
        ),
        (
            {"kernel_size": "3"},
            "workload.params.kernel_size='3' is invalid: CNNParams.kernel_size is declared int: give a value of that "
            "type",
        ),
        (
            {"kernel_size": 4},
            "workload.params={'kernel_size': 4} is invalid: CNNParams refused it (ValueError: kernel_size=4 must be "
            "an odd number >= 1, e.g. 3 or 5); fix the value it names",
        ),
    ],
    ids=["unknown-name", "wrong-type", "refused-value"],
)
def test_bad_params_fail_before_any_worker_starts_naming_the_field_the_value_and_the_fix(params, expected):
    assert _error(WorkloadConfig(name=CNN, params=params)) == expected


def test_a_model_factory_and_a_dataset_source_that_take_params_get_them(user_package, tmp_path):
    module = user_package(
        """
        from dataclasses import dataclass

        import numpy as np
        from torch import nn

        from training_core.data.sources import RawDataset

        @dataclass
        class Width:
            hidden: int = 8

        def make(config, manifest, params):
            return nn.Sequential(nn.Flatten(), nn.Linear(64, params.hidden), nn.Linear(params.hidden, 10))

        make.params_type = Width

        def source(data, params):
            count = params["samples"]
            images = np.zeros((count, 1, 8, 8), dtype=np.uint8)
            return RawDataset(splits={"train": (images, np.arange(count) % 2)}, classes=["a", "b"])
        """
    )
    cfg = _config({"model_factory": f"{module}:make", "params": {"hidden": 12}})
    model = resolve_workload(cfg.workload).build_model(cfg, prepare(DataConfig(), str(tmp_path / "d")))
    assert model[1].out_features == 12
    selected = WorkloadConfig(dataset_source=f"{module}:source", params={"samples": 40})
    manifest = resolve_workload(selected).prepare_data(DataConfig(num_shards=1), str(tmp_path / "p"))
    assert sum(split.num_samples for split in manifest.splits.values()) == 40
