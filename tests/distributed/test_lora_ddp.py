"""LoRA under DDP: 2 gloo worker processes (the plain ``torch.distributed`` launcher) train only the adapters and the
head, with ``optimizer.param_groups``, over the frozen base both built from the seed."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.labeled_text import labeled_rows, write_csv
from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.data import Manifest, prepare
from training_core.runners.launch import launch
from training_core.train.lora import prepare_trainable
from training_core.train.rng import seed_everything
from training_core.workloads import resolve_workload


def _config(rows: str, *, num_workers: int) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "workload": {"name": "sequence_classification"},
            "data": {"dataset": "labeled_text", "path": rows, "tokenizer": "byte", "seq_len": 12, "num_shards": 2},
            "model": {
                "name": "bert-tiny",
                "hidden_size": 32,
                "num_heads": 2,
                "lora": {"enabled": True, "rank": 2, "target_modules": ["query", "value"]},
            },  # fmt: skip
            "optimizer": {"lr": 0.01, "param_groups": {"encoder.classifier.*": 0.02}},
            "loop": {"epochs": 1, "batch_size": 16 // num_workers, "log_interval_steps": 100},
            "scaling": {"num_workers": num_workers, "torch_threads_per_worker": 1},
            "observability": {"enabled": False},
        }
    )


def test_lora_on_two_gloo_ddp_workers_trains_only_the_adapters_over_the_base_both_ranks_built(tmp_path):
    rows = str(write_csv(tmp_path / "rows.csv", labeled_rows(90)))
    config = _config(rows, num_workers=2)
    prepare(config.data, str(tmp_path / "data"), workload=config.workload)
    two = launch(config, data_dir=str(tmp_path / "data"), checkpoint_dir=str(tmp_path / "final"), run_name="ddp",
                 storage_path=str(tmp_path / "runs"))  # fmt: skip
    ddp = ckpt.load_directory(two.checkpoint_dir)
    seed_everything(config.loop.seed)
    model = resolve_workload(config.workload).build_model(config, Manifest.load(str(tmp_path / "data")))
    model = prepare_trainable(model, config.model)
    assert ddp.meta.global_step > 0 and ddp.meta.frozen_base_sha256 == ckpt.base_sha256(model)
    # Only the adapters and the head were saved, and they trained: each B started at zero, the head as built.
    assert set(ddp.model) == {name for name, p in model.named_parameters() if p.requires_grad}
    assert {name.rpartition(".")[0].rpartition(".")[2] for name in ddp.model} == {"default", "classifier"}
    assert all(ddp.model[name].abs().sum() > 0 for name in ddp.model if "lora_B" in name)
    assert not torch.equal(ddp.model["encoder.classifier.weight"], model.encoder.classifier.weight)
    # The head's group kept its own rate under the schedule: twice the rest's.
    base_lr, head_lr = (group["lr"] for group in ddp.trainer["optimizer"]["param_groups"])
    assert head_lr == pytest.approx(2 * base_lr) and base_lr > 0
