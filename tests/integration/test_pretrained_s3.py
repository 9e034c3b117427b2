"""Pretrained weights on an object store (the session's S3 server): read as from a local path, with the same hash, and
a BERT directory there (weights and tokenizer) fine-tuned by the training loop from exactly its saved weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.labeled_text import pretrained_bert, topic_rows, write_jsonl
from tests.helpers.runtime import StartRecorder
from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.data import prepare
from training_core.pretrained import read_pretrained
from training_core.records import WorkerArgs
from training_core.train.loop import run_worker
from training_core.workloads import preflight


def _s3(s3_server):
    import s3fs

    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server["endpoint"]}, skip_instance_cache=True)


def test_weights_on_s3_read_as_the_local_copy_and_a_missing_object_names_the_field(s3_server, tmp_path):
    state = {"fc.weight": torch.arange(12.0).view(3, 4), "fc.bias": torch.ones(3)}
    local = tmp_path / "model"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    save_file(state, local / "model.safetensors")
    fs = _s3(s3_server)
    fs.put(str(local), "flyte/pretrained/model", recursive=True)
    fs.put(str(local / "model.safetensors"), "flyte/pretrained/weights.safetensors")

    for remote, local_source in (
        ("s3://flyte/pretrained/model", local),
        ("s3://flyte/pretrained/weights.safetensors", local / "model.safetensors"),
    ):
        found, expected = read_pretrained(remote), read_pretrained(str(local_source))
        assert found.sha256 == expected.sha256 and found.kind == expected.kind
        assert found.state_dict.keys() == state.keys()
        assert all(torch.equal(found.state_dict[key], state[key]) for key in state)

    with pytest.raises(ValueError) as raised:
        read_pretrained("s3://flyte/pretrained/missing.safetensors")
    assert "model.pretrained='s3://flyte/pretrained/missing.safetensors'" in str(raised.value)
    assert "nothing exists there" in str(raised.value)


def test_a_trained_bert_saved_to_s3_fine_tunes_from_exactly_its_saved_weights_but_the_new_head(s3_server, tmp_path):
    from safetensors.torch import load_file

    local = tmp_path / "bert"
    pretrained_bert(local, seed=0, steps=5)  # trained (briefly): weights no fresh initialisation gives
    _s3(s3_server).put(str(local), "flyte/pretrained/bert", recursive=True)
    remote = "s3://flyte/pretrained/bert"
    cfg = TrainingConfig.from_dict(
        {
            "workload": {"name": "sequence_classification"},
            "data": {
                "dataset": "labeled_text",
                "path": str(write_jsonl(tmp_path / "rows.jsonl", topic_rows(48, seed=1))),
                "tokenizer": remote,  # the tokenizer.json beside the weights, read from S3 too
                "seq_len": 16,
                "num_shards": 1,
            },
            "model": {"name": "", "pretrained": remote, "new_head": True},  # 6 pretraining classes, 3 here
            "optimizer": {"name": "adamw", "lr": 0.01},
            "loop": {"epochs": 1, "batch_size": 8},
            "checkpoint": {"interval_steps": 0},
            "scaling": {"num_workers": 1, "torch_threads_per_worker": 1},
            "observability": {"enabled": False},
        }
    )
    data_dir = str(tmp_path / "data")
    prepare(cfg.data, data_dir, workload=cfg.workload)
    preflight(cfg, data_dir)
    assert cfg.model.pretrained_sha256 == read_pretrained(str(local)).sha256
    runtime = StartRecorder()
    run_worker(WorkerArgs.build(cfg, data_dir=data_dir, checkpoint_root=str(tmp_path / "run"), run_name="s3"), runtime)

    saved = {f"encoder.{key}": value for key, value in load_file(local / "model.safetensors").items()}
    head = {"encoder.classifier.weight", "encoder.classifier.bias"}
    assert runtime.initial.keys() == saved.keys()
    assert [key for key in saved if key not in head and not torch.equal(runtime.initial[key], saved[key])] == []
    assert runtime.initial["encoder.classifier.weight"].shape == (3, 32) != saved["encoder.classifier.weight"].shape
    final = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(tmp_path / "run")))
    assert final is not None and final.meta.global_step > 0
    assert not torch.equal(final.model["encoder.bert.pooler.dense.weight"], saved["encoder.bert.pooler.dense.weight"])
