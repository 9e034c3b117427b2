"""A dataset source or a named model is one registry entry: the config accepts it, prep and the model builder use
it, and no second list of the names exists anywhere in ``training_core``."""

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from training_core import config as config_module
from training_core import registry
from training_core.config import DataConfig, TrainingConfig
from training_core.data.sources import RawDataset
from training_core.registry import DATASET_SOURCES, IMAGE_MODELS, LM_SIZES, WORKLOADS, DatasetSource

PACKAGE = Path(__file__).resolve().parents[2] / "training_core"


def tiny_stripes(data: DataConfig) -> RawDataset:
    """A source of 40 one-channel 8x8 images: horizontal stripes (class 0) or vertical ones (class 1)."""
    rows = np.zeros((8, 8), dtype=np.uint8)
    rows[::2] = 255
    images = np.stack([rows if i % 2 == 0 else rows.T for i in range(40)])[:, None]
    return RawDataset(splits={"train": (images, np.arange(40, dtype=np.int64) % 2)}, classes=["rows", "columns"])


def tiny_linear(name: str, *, in_channels: int, num_classes: int, side: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * side * side, num_classes))


@pytest.fixture
def restored_registries():
    """The registries as they were, whatever a test registers."""
    saved = dict(DATASET_SOURCES), dict(IMAGE_MODELS)
    yield
    for table, entries in zip((DATASET_SOURCES, IMAGE_MODELS), saved):
        table.clear()
        table.update(entries)


def _message(build) -> str:
    with pytest.raises(ValueError) as caught:
        build()
    return str(caught.value)


def test_a_dataset_source_and_a_model_registered_in_one_place_are_accepted_by_the_config_prepared_and_built(
    restored_registries, tmp_path
):
    from training_core.workloads import resolve_workload

    assert "choose one of" in _message(lambda: DataConfig(dataset="tiny_stripes"))
    registry.register_dataset_source(
        "tiny_stripes", DatasetSource("image_classification", read=f"{__name__}:tiny_stripes")
    )
    registry.register_model("tiny_linear", f"{__name__}:tiny_linear")

    config = TrainingConfig.from_dict(
        {"data": {"dataset": "tiny_stripes", "num_shards": 2}, "model": {"name": "tiny_linear"}}
    )
    workload = resolve_workload(config.workload)
    manifest = workload.prepare_data(config.data, str(tmp_path / "prepared"))
    assert manifest.dataset == "tiny_stripes" and manifest.classes == ["rows", "columns"]
    assert sum(split.num_samples for split in manifest.splits.values()) == 40
    torch.manual_seed(0)
    model = workload.build_model(config, manifest)
    assert isinstance(model[1], nn.Linear)
    logits = model(torch.from_numpy(workload.example_input(manifest)))
    assert logits.shape == (2, 2)


def test_the_configs_choices_are_the_registries_keys_in_their_order(restored_registries):
    assert _message(lambda: DataConfig(dataset="mnist")).endswith(f"choose one of {', '.join(DATASET_SOURCES)}")
    model = _message(lambda: TrainingConfig.from_dict({"model": {"name": "resnet9000"}}))
    assert model.endswith(f"choose one of {', '.join(IMAGE_MODELS)}")
    lm = _message(lambda: TrainingConfig.from_dict({"workload": {"name": "causal_lm"}, "data": {"dataset": "stdlib"}}))
    assert f"builds {', '.join(LM_SIZES)} or a transformers" in lm
    assert f"choose {', '.join(WORKLOADS)} or name user code" in _message(
        lambda: TrainingConfig.from_dict({"workload": {"name": "tabular"}})
    )
    # One registration moves every list: the config reads the registry whenever it validates.
    last = list(registry.DATASET_SOURCES)[-1]
    registry.register_dataset_source("tiny_stripes", DatasetSource("image_classification", read=f"{__name__}:x"))
    assert _message(lambda: DataConfig(dataset="mnist")).endswith(f", {last}, tiny_stripes")
    images = _message(lambda: TrainingConfig.from_dict({"data": {"dataset": "stdlib"}}))
    assert "reads digits, synthetic, cifar10, image_folder, tiny_stripes;" in images


def test_no_module_of_training_core_keeps_a_second_list_of_registered_names():
    """A tuple, list, set or dict literal naming two registered datasets, models or GPT-2 sizes outside the registry
    would be a second list that drifts from it."""
    lists = []
    for names in (set(DATASET_SOURCES), set(IMAGE_MODELS), set(LM_SIZES)):
        for path in PACKAGE.rglob("*.py"):
            if path.name == "registry.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
                if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and items:
                    found = {item.value for item in items if isinstance(item, ast.Constant)} & names
                    if len(found) >= 2:
                        lists.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {sorted(found)}")
    assert lists == []
    assert not {"DATASETS", "IMAGE_DATASETS", "TEXT_DATASETS", "MODELS", "DATASETS_BY_WORKLOAD"} & set(
        vars(config_module)
    )


def test_an_image_source_that_is_not_encoded_is_an_error_in_image_shards_not_read_as_cifar(tmp_path):
    from training_core.data.image_shards import ImageItem, ShardTask, check_source, prepare_images, write_shard

    digits = DataConfig(dataset="digits")
    expected = (
        "data.dataset='digits' is invalid: it is not an encoded image source; choose one of cifar10, image_folder"
    )
    assert _message(lambda: check_source(digits)) == expected
    assert _message(lambda: prepare_images(digits, str(tmp_path / "out"))) == expected
    task = ShardTask(
        "train", "train-0.parquet", "digits", str(tmp_path), str(tmp_path / "out"), 8, [ImageItem("a#0", 0, 0)]
    )
    assert _message(lambda: write_shard(task)) == expected
