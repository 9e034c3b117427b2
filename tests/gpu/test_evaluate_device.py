"""``evaluate`` in the task's process runs on the GPU when the pod has one (the workflow gives it one when training
used GPUs): the figures equal the CPU's. The ``cpu`` case is the CPU twin; ``cuda`` runs where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runtime import InProcessRuntime
from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.data import prepare
from training_core.evaluation import evaluate_checkpoint
from training_core.records import WorkerArgs
from training_core.train.loop import run_worker

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_evaluates_on_the_device_with_the_cpus_figures(device, tmp_path):
    cfg = TrainingConfig.from_dict(
        {
            "model": {"name": "small_cnn"},
            "loop": {"epochs": 1, "batch_size": 64},
            "scaling": {"num_workers": 1, "torch_threads_per_worker": 1},
            "observability": {"enabled": False},
        }
    )
    data_dir = str(tmp_path / "data")
    prepare(cfg.data, data_dir)
    args = WorkerArgs.build(cfg, data_dir=data_dir, checkpoint_root=str(tmp_path / "ckpt"), run_name="eval")
    run_worker(args, InProcessRuntime())
    final = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(tmp_path / "ckpt")))
    on_cpu = evaluate_checkpoint(final.uri, data_dir, device="cpu")
    on_device = evaluate_checkpoint(final.uri, data_dir, device=device)
    assert on_device.num_samples == on_cpu.num_samples > 0
    assert on_device.metrics["loss"] == pytest.approx(on_cpu.metrics["loss"], rel=1e-4)
    assert on_device.metrics["accuracy"] == pytest.approx(on_cpu.metrics["accuracy"], abs=2 / on_cpu.num_samples)
    if device == "cpu":
        assert on_device.confusion == on_cpu.confusion
