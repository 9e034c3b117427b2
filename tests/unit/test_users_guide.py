"""The users' guide's examples run as written: its model factory (way 2) with its YAML prepares digits and passes
preflight, and its tuning file for the signal example loads, searching ``workload.params.kernel_size`` ranked by
``val_f1`` upwards."""

from __future__ import annotations

import re
import sys

from tests.conftest import REPO_ROOT
from training_core.config import load_config
from training_core.data import prepare
from training_core.tuning import load_tuning_config
from training_core.workloads import preflight

GUIDE = REPO_ROOT / "docs" / "users-guide.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(), re.DOTALL)


def test_the_model_factory_of_the_guide_trains_with_its_yaml_as_far_as_preflight(tmp_path, monkeypatch):
    (factory,) = [block for block in blocks("python") if "def tiny_cnn" in block]
    (config_text,) = [block for block in blocks("yaml") if "mymodels:tiny_cnn" in block]
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "mymodels.py").write_text(factory)
    (tmp_path / "tiny_cnn.yaml").write_text(config_text)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    try:
        config = load_config(tmp_path / "tiny_cnn.yaml", environ={})
        prepare(config.data, str(tmp_path / "data"), workload=config.workload)
        workload = preflight(config, str(tmp_path / "data"))
        assert workload.name == "image_classification" and config.workload.params == {"width": 16}
    finally:
        sys.modules.pop("mymodels", None)


def test_the_tuning_file_of_the_guide_searches_the_signal_examples_kernel_size_by_macro_f1(tmp_path):
    (tuning_text,) = [block for block in blocks("yaml") if "search_space" in block]
    (tmp_path / "signal_tuning.yaml").write_text(tuning_text)
    tuning = load_tuning_config(str(tmp_path / "signal_tuning.yaml"), environ={})
    assert tuning.metric == "val_f1" and tuning.metric_mode == "max"
    assert [p.path for p in tuning.search_space] == ["workload.params.kernel_size", "optimizer.lr"]
    assert tuning.base.workload.name == "examples.signal_cnn.workload:SignalCNN"


def test_the_array_workload_of_the_guide_prepares_its_torch_dataset_and_passes_preflight(tmp_path, monkeypatch):
    (source,) = [block for block in blocks("python") if "class Waves" in block]
    (config_text,) = [block for block in blocks("yaml") if "mydata:waves" in block]
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "mydata.py").write_text(source)
    (tmp_path / "waves.yaml").write_text(config_text)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    try:
        config = load_config(tmp_path / "waves.yaml", environ={})
        manifest = prepare(config.data, str(tmp_path / "data"), workload=config.workload)
        assert manifest.arrays["inputs"].dtype == "float32" and manifest.input_shape == [1, 128]
        assert sum(manifest.split_counts().values()) == 400 and manifest.classes == ["0", "1"]
        workload = preflight(config, str(tmp_path / "data"))
        assert workload.name == "array_classification"
    finally:
        sys.modules.pop("mydata", None)
