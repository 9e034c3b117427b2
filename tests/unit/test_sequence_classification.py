"""The ``sequence_classification`` workload: labelled CSV, JSONL and Parquet prepared through the shared text
pipeline, the encoder built from a named size or a Hugging Face directory (safetensors), and what fails before any
worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.labeled_text import (
    labeled_rows,
    tiny_bert,
    wordpiece_tokenizer,
    write_csv,
    write_jsonl,
    write_parquet,
)
from training_core.config import TrainingConfig, WorkloadConfig
from training_core.data import Manifest, prepare
from training_core.data.prepared import read_shard
from training_core.workloads import preflight, resolve_workload

ROWS = labeled_rows(90)
SEQ_LEN = 12


def _config(path: Path | str, *, tokenizer: str = "byte", **model) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "workload": {"name": "sequence_classification"},
            "data": {
                "dataset": "labeled_text",
                "path": str(path),
                "tokenizer": tokenizer,
                "seq_len": SEQ_LEN,
                "num_shards": 2,
            },
            "model": {"name": "bert-tiny", "hidden_size": 32, "num_heads": 2, **model},
            "scaling": {"num_workers": 1},
        }
    )


def _prepared(config: TrainingConfig, out: Path) -> Manifest:
    return prepare(config.data, str(out), workload=config.workload)


def _samples(manifest: Manifest, split: str) -> dict[str, np.ndarray]:
    shards = [read_shard(manifest, shard) for shard in manifest.splits[split].shards]
    return {name: np.concatenate([shard[name] for shard in shards]) for name in ("input_ids", "labels")}


def _prep_error(config: TrainingConfig, out: Path) -> str:
    with pytest.raises(ValueError) as raised:
        _prepared(config, out)
    return str(raised.value)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny BERT with 3 classes and its WordPiece tokenizer in one directory, and data prepared with it."""
    root = tmp_path_factory.mktemp("pretrained")
    wordpiece_tokenizer(root / "bert" / "tokenizer.json", [text for text, _ in ROWS])
    vocab_size = json.loads((root / "bert" / "tokenizer.json").read_text())["model"]["vocab"]
    tiny_bert(root / "bert", vocab_size=len(vocab_size), num_labels=3)
    config = _config(write_csv(root / "rows.csv", ROWS), tokenizer=str(root / "bert"))
    _prepared(config, root / "data")
    return root / "bert", root / "data"


# ------------------------------------------------------------------------------------------------ data prep


def test_csv_jsonl_and_parquet_records_prepare_into_the_same_verified_shards(tmp_path):
    files = {
        "csv": write_csv(tmp_path / "rows.csv", ROWS),
        "jsonl": write_jsonl(tmp_path / "rows.jsonl", ROWS),
        "parquet": write_parquet(tmp_path / "rows.parquet", ROWS),
    }
    manifests = {kind: _prepared(_config(path), tmp_path / kind) for kind, path in files.items()}
    digests = {kind: [s.sha256 for split in m.splits.values() for s in split.shards] for kind, m in manifests.items()}
    assert digests["csv"] == digests["jsonl"] == digests["parquet"]  # the split is by record size and seed
    manifest = manifests["csv"]
    assert manifest.workload == "sequence_classification" and manifest.classes == ["color", "fruit", "metal"]
    assert manifest.input_shape == [SEQ_LEN] and sum(manifest.split_counts().values()) == len(ROWS)
    spec = manifest.spec
    assert (spec["cls_id"], spec["sep_id"], spec["pad_id"], spec["vocab_size"]) == (256, None, 257, 258)
    # Each record once, with its label: byte ids after the start token, cut to seq_len, then padding.
    expected = {text.encode()[: SEQ_LEN - 1]: manifest.classes.index(label) for text, label in ROWS}
    found = {}
    for split in ("train", "val", "test"):
        samples = _samples(manifest, split)
        assert (samples["input_ids"][:, 0] == 256).all() and spec["truncated"][split] == len(samples["labels"])
        for ids, label in zip(samples["input_ids"], samples["labels"]):
            found[bytes(ids[1:][ids[1:] != 257].astype(np.uint8))] = int(label)
    assert found == expected


def test_integer_labels_and_integer_strings_sort_numerically(tmp_path):
    rows = [(text, [10, 2, 1][i % 3]) for i, (text, _) in enumerate(ROWS)]
    assert _prepared(_config(write_jsonl(tmp_path / "rows.jsonl", rows)), tmp_path / "a").classes == ["1", "2", "10"]
    csv_rows = [(text, str(label)) for text, label in rows]
    assert _prepared(_config(write_csv(tmp_path / "rows.csv", csv_rows)), tmp_path / "b").classes == ["1", "2", "10"]


def test_a_wordpiece_tokenizer_frames_each_text_with_cls_and_sep(pretrained):
    _, data_dir = pretrained
    manifest = Manifest.load(str(data_dir))
    spec = manifest.spec
    assert (spec["cls_id"], spec["sep_id"], spec["pad_id"]) == (2, 3, 0) and spec["tokenizer"] == "tokenizer.json"
    ids = _samples(manifest, "train")["input_ids"]
    lengths = (ids != 0).sum(axis=1)
    assert (ids[:, 0] == 2).all() and (ids[np.arange(len(ids)), lengths - 1] == 3).all()
    assert (Path(data_dir) / "tokenizer.json").read_bytes() == (pretrained[0] / "tokenizer.json").read_bytes()


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("rows.csv", "words,label\nred apple,fruit\n", "data.text_field='text' is invalid: the header row of CSV"),
        ("rows.csv", "text,kind\nred apple,fruit\n", "data.label_field='label' is invalid: the header row of CSV"),
        ("rows.csv", "text,label\nred apple,fruit,extra\n", "line 2 of 'rows.csv' has 3 fields, the header 2"),
        ("rows.csv", "text,label\nred apple,\n", "line 2 of 'rows.csv' under data.path="),
        ("rows.jsonl", '{"text": "red apple"}\n', "line 1 of 'rows.jsonl' under data.path="),
        ("rows.jsonl", '{"text": "red apple", "label": 1.5}\n', "has float 1.5 there"),
        ("rows.jsonl", '{"text": "red", "label": true}\n', "has bool True there"),
        ("rows.txt", "just text\n", "it holds no .csv, .jsonl, .parquet files"),
    ],
)
def test_a_bad_record_names_the_field_the_file_and_the_fix(tmp_path, name, content, expected):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / name).write_text(content)
    message = _prep_error(_config(tmp_path / "in"), tmp_path / "out")
    assert expected in message
    assert "data.path=" in message or "data.text_field" in message


def test_labels_that_mix_kinds_or_name_one_class_are_refused(tmp_path):
    mixed = [(text, 1 if i % 2 else "cat") for i, (text, _) in enumerate(ROWS)]
    message = _prep_error(_config(write_jsonl(tmp_path / "mixed.jsonl", mixed)), tmp_path / "a")
    assert "data.label_field='label' is invalid: the records' labels mix int and str" in message
    single = [(text, "only") for text, _ in ROWS]
    message = _prep_error(_config(write_csv(tmp_path / "single.csv", single)), tmp_path / "b")
    assert "a classifier needs at least 2 classes" in message


def test_a_parquet_label_column_of_floats_names_data_label_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a b", "c d"], "label": [0.5, 1.5]}), tmp_path / "rows.parquet")
    message = _prep_error(_config(tmp_path / "rows.parquet"), tmp_path / "out")
    assert "data.label_field='label' is invalid: column 'label' of 'rows.parquet' holds double" in message


# --------------------------------------------------------------------------------------------------- models


def test_a_named_size_builds_a_random_bert_of_the_datas_vocabulary_and_classes(tmp_path):
    config = _config(write_csv(tmp_path / "rows.csv", ROWS))
    manifest = _prepared(config, tmp_path / "data")
    workload = preflight(config, str(tmp_path / "data"))
    model = workload.build_model(config, manifest)
    encoder = model.encoder.config
    assert (encoder.num_hidden_layers, encoder.hidden_size, encoder.num_attention_heads) == (2, 32, 2)
    assert (encoder.vocab_size, encoder.num_labels, encoder.hidden_dropout_prob) == (258, 3, 0.0)
    assert model(torch.from_numpy(workload.example_input(manifest))).shape == (2, 3)
    assert config.model.encoder_config == {} and config.model.pretrained_sha256 == ""


def test_a_pretrained_directory_is_the_models_weights_and_classifies_strings(pretrained):
    bert_dir, data_dir = pretrained
    config = _config("unused", tokenizer=str(bert_dir), name="", hidden_size=0, num_heads=0, pretrained=str(bert_dir))
    config.data.path = "unused"
    workload = preflight(config, str(data_dir))
    assert config.model.encoder_config["hidden_size"] == 32 and len(config.model.pretrained_sha256) == 64
    model = workload.build_model(config, Manifest.load(str(data_dir)))
    from safetensors.torch import load_file

    saved = load_file(bert_dir / "model.safetensors")
    built = model.encoder.state_dict()
    assert built.keys() == saved.keys() and all(torch.equal(built[k], saved[k]) for k in saved)
    assert set(model.classify(["apple mango", "zinc tin iron"])) <= {"color", "fruit", "metal"}


def test_a_pretraining_checkpoint_loads_its_backbone_and_gets_a_new_head(pretrained, tmp_path, caplog):
    bert_dir, data_dir = pretrained
    masked = tiny_bert(tmp_path / "mlm", vocab_size=len(json.loads((bert_dir / "tokenizer.json").read_text())
                       ["model"]["vocab"]), num_labels=3, head=False)  # fmt: skip
    (tmp_path / "mlm" / "tokenizer.json").write_bytes((bert_dir / "tokenizer.json").read_bytes())
    config = _config("unused", tokenizer=str(bert_dir), name="", hidden_size=0, num_heads=0,
                     pretrained=str(tmp_path / "mlm"))  # fmt: skip
    workload = preflight(config, str(data_dir))
    with caplog.at_level("WARNING"):
        model = workload.build_model(config, Manifest.load(str(data_dir)))
    backbone = masked.bert.state_dict()
    built = model.encoder.bert.state_dict()
    assert all(torch.equal(built[k], backbone[k]) for k in backbone)
    assert "the classification head (classifier.weight, classifier.bias) is new" in caplog.text
    assert "the pooler (bert.pooler.dense.weight, bert.pooler.dense.bias) is new" in caplog.text
    assert "left out" in caplog.text and "cls.predictions" in caplog.text


def _preflight_error(config: TrainingConfig, data_dir: Path) -> str:
    with pytest.raises(ValueError) as raised:
        preflight(config, str(data_dir))
    return str(raised.value)


def test_weights_that_do_not_fit_fail_before_any_worker_naming_the_first_keys(pretrained, tmp_path):
    bert_dir, data_dir = pretrained
    vocab_size = len(json.loads((bert_dir / "tokenizer.json").read_text())["model"]["vocab"])
    two_classes = tmp_path / "two"
    tiny_bert(two_classes, vocab_size=vocab_size, num_labels=2)
    (two_classes / "tokenizer.json").write_bytes((bert_dir / "tokenizer.json").read_bytes())
    base = {"tokenizer": str(bert_dir), "name": "", "hidden_size": 0, "num_heads": 0}
    message = _preflight_error(_config("unused", pretrained=str(two_classes), **base), data_dir)
    assert "model.pretrained=" in message and "classifier.weight [2, 32] vs the model's [3, 32]" in message
    assert "model.new_head: true" in message
    preflight(_config("unused", pretrained=str(two_classes), new_head=True, **base), str(data_dir))  # re-initialised
    # Another model's weights under this config.json: the first differing names and shapes.
    (tmp_path / "wide").mkdir()
    tiny_bert(tmp_path / "other", vocab_size=vocab_size + 5, num_labels=3)
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / "wide" / name).write_bytes((bert_dir / name).read_bytes())
    (tmp_path / "wide" / "model.safetensors").write_bytes((tmp_path / "other" / "model.safetensors").read_bytes())
    message = _preflight_error(_config("unused", pretrained=str(tmp_path / "wide"), **base), data_dir)
    assert f"bert.embeddings.word_embeddings.weight [{vocab_size + 5}, 32] vs the model's [{vocab_size}, 32]" in message


def test_a_pickle_or_a_tokenizer_other_than_the_models_is_refused(pretrained, tmp_path):
    bert_dir, data_dir = pretrained
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_bytes((bert_dir / "config.json").read_bytes())
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"not even opened")
    base = {"tokenizer": str(bert_dir), "name": "", "hidden_size": 0, "num_heads": 0}
    message = _preflight_error(_config("unused", pretrained=str(tmp_path / "pickled"), **base), data_dir)
    assert "'pytorch_model.bin', a pickle" in message and "safetensors" in message
    byte_config = _config(write_csv(tmp_path / "rows.csv", ROWS))
    _prepared(byte_config, tmp_path / "byte-data")
    byte_config.model = _config("unused", pretrained=str(bert_dir), **{**base, "tokenizer": "byte"}).model
    message = _preflight_error(byte_config, tmp_path / "byte-data")
    assert "data.tokenizer='byte' is invalid: the data was tokenised with another tokenizer" in message


@pytest.mark.parametrize(("max_shard_size", "lora"), [("1GB", False), ("40KB", True)], ids=["one-file", "shards-lora"])
def test_under_fsdp_each_rank_reads_its_rows_of_a_pretraining_checkpoint_and_equals_the_whole_load(
    pretrained, tmp_path, process_group, caplog, max_shard_size, lora
):
    """With LoRA on the attention's query and value, the adapted layers' ``base_layer`` tensors read the stored
    layers' rows, and the adapters start from the seed alone, whatever torch's global RNG did before."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from tests.helpers.runtime import InProcessRuntime
    from training_core.train.lora import prepare_trainable, unadapted_names
    from training_core.train.model import build_sharded_pretrained

    bert_dir, data_dir = pretrained
    vocab_size = len(json.loads((bert_dir / "tokenizer.json").read_text())["model"]["vocab"])
    masked = tiny_bert(tmp_path / "saved", vocab_size=vocab_size, num_labels=3, head=False)
    masked.save_pretrained(tmp_path / "mlm", max_shard_size=max_shard_size)  # one file, or shards and their index
    assert (tmp_path / "mlm" / "model.safetensors.index.json").exists() == (max_shard_size == "40KB")
    (tmp_path / "mlm" / "tokenizer.json").write_bytes((bert_dir / "tokenizer.json").read_bytes())
    adapters = {"lora": {"enabled": True, "rank": 2, "target_modules": ["query", "value"]}} if lora else {}
    config = _config("unused", tokenizer=str(bert_dir), name="", hidden_size=0, num_heads=0,
                     pretrained=str(tmp_path / "mlm"), **adapters)  # fmt: skip
    config.scaling.strategy = "fsdp"
    workload, manifest = preflight(config, str(data_dir)), Manifest.load(str(data_dir))
    torch.manual_seed(7)  # the whole load's random initialisation differs from any other: only loaded tensors agree
    whole_model = prepare_trainable(workload.build_model(config, manifest), config.model, seed=config.loop.seed)
    whole = whole_model.state_dict()
    torch.manual_seed(8)
    with caplog.at_level("WARNING"):
        held, _, bytes_read = build_sharded_pretrained(config, workload, manifest, InProcessRuntime(),
                                                       param_dtype=None)  # fmt: skip
    sharded = get_model_state_dict(held.model)
    assert sharded.keys() == whole.keys()
    for key, tensor in sharded.items():
        assert torch.equal(tensor.full_tensor(), whole[key]), key  # the new head and pooler: the same seeded values
    backbone = masked.bert.state_dict()
    as_stored = {unadapted_names(whole_model).get(key, key): tensor for key, tensor in whole.items()}
    assert all(torch.equal(as_stored[f"encoder.bert.{key}"], value) for key, value in backbone.items())
    adapter = "encoder.bert.encoder.layer.1.attention.self.value.lora_{}.default.weight"
    assert (adapter.format("A") in whole) == lora
    if lora:  # A drawn from the seed, B zeros: the adapted model starts as the pretrained one
        assert whole[adapter.format("A")].abs().sum() > 0 and not whole[adapter.format("B")].any()
    assert "the pooler (bert.pooler.dense.weight, bert.pooler.dense.bias) is new" in caplog.text
    backbone_bytes = sum(t.numel() * t.element_size() for t in backbone.values())
    assert backbone_bytes < bytes_read < backbone_bytes + 16384  # cls.predictions.* are never read


def test_a_rebuilt_checkpoint_needs_no_pretrained_files(pretrained):
    """A checkpoint keeps model.encoder_config: the architecture rebuilds after model.pretrained is dropped."""
    from training_core.pretrained import without_pretrained

    bert_dir, data_dir = pretrained
    config = _config("unused", tokenizer=str(bert_dir), name="", hidden_size=0, num_heads=0, pretrained=str(bert_dir))
    preflight(config, str(data_dir))
    sections = config.to_dict()
    sections["model"] = without_pretrained(sections["model"])
    rebuilt = TrainingConfig.from_dict(
        {k: sections[k] for k in ("workload", "data", "model")} | {"scaling": {"num_workers": 1}}
    )
    model = resolve_workload(rebuilt.workload).build_model(rebuilt, Manifest.load(str(data_dir)))
    assert model.encoder.config.hidden_size == 32 and model.encoder.config.num_hidden_layers == 2


def test_macro_f1_and_accuracy_come_from_the_evaluation_sums():
    workload = resolve_workload(WorkloadConfig(name="sequence_classification", primary_metric="macro_f1"))
    confusion = np.array([[3, 1, 0], [0, 2, 0], [0, 0, 0]])
    metrics = workload.metrics({"correct": 5, "samples": 6, "loss_sum": 3.0, "confusion": confusion})
    # F1: class 0: 6/7, class 1: 4/5, class 2 (neither true nor predicted): 1.
    assert metrics["macro_f1"] == pytest.approx((6 / 7 + 4 / 5 + 1) / 3) and metrics["accuracy"] == 5 / 6
    assert workload.primary_metric == "macro_f1" and metrics["loss"] == 0.5


def test_a_labelled_source_is_checked_before_a_prep_cluster_starts(tmp_path):
    from training_core.workloads import prep_uses_ray
    from training_core.workloads.sequence_classification import check_source

    (tmp_path / "empty").mkdir()
    empty = _config(tmp_path / "empty")
    assert prep_uses_ray(empty.data, empty.workload)  # tokenised in Ray tasks, as causal_lm's text
    with pytest.raises(ValueError, match=r"data.path='.*empty' is invalid: it holds no .csv, .jsonl, .parquet files"):
        check_source(empty.data)
    no_tokenizer = _config(write_csv(tmp_path / "rows.csv", ROWS), tokenizer=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"data.tokenizer='.*missing.json' is invalid"):
        check_source(no_tokenizer.data)


def test_the_config_names_the_encoder_and_the_primary_metric_choices():
    data = {"dataset": "labeled_text", "path": "rows.csv"}
    with pytest.raises(ValueError, match=r"model.name='resnet18' is invalid: workload.name='sequence_classification'"):
        TrainingConfig.from_dict({"workload": {"name": "sequence_classification"}, "data": data})
    with pytest.raises(ValueError, match=r"workload.primary_metric='f1' is invalid: choose one of accuracy, macro_f1"):
        WorkloadConfig(name="sequence_classification", primary_metric="f1")
    with pytest.raises(ValueError, match=r"workload.primary_metric='macro_f1' is invalid: leave it empty"):
        WorkloadConfig(name="causal_lm", primary_metric="macro_f1")
    assert WorkloadConfig(name="sequence_classification", primary_metric="macro_f1").for_prep().primary_metric == ""
