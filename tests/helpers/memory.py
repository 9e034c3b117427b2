"""Memory a training step takes, measured as the loop measures it (``loop.batch_size: auto``)."""

from __future__ import annotations

import contextlib

import torch

from training_core.config import TrainingConfig
from training_core.train import batch_size

RSS_BASE = {
    "data": {"dataset": "synthetic", "synthetic_image_size": 32, "synthetic_num_samples": 512, "num_shards": 1},
    "model": {"name": "resnet18"},
    "loop": {"epochs": 1, "max_steps": 3},
    "scaling": {"num_workers": 1},
    "observability": {"enabled": False},
}
"""A run of resnet18 on 32-pixel synthetic images whose peak RSS the batch-size tests measure."""


def measured_step_memory(cfg: TrainingConfig, data_dir: str) -> tuple[int, int]:
    """``(fixed_bytes, bytes_per_sample)`` of a CPU training step of ``cfg``'s model on rank 0's data, measured as
    the loop measures them (asynchronous checkpoints on)."""
    from training_core.data import Manifest, ShardStream
    from training_core.workloads import resolve_workload

    manifest, workload = Manifest.load(data_dir), resolve_workload(cfg.workload)
    model = workload.build_model(cfg, manifest)
    to_device = workload.to_device(manifest, torch.device("cpu"))
    stream = ShardStream(manifest, "train", rank=0, world_size=1)
    probes = tuple(to_device(next(stream.train_batches(epoch=0, seed=0, batch_size=n, num_batches=1))) for n in (1, 2))
    return batch_size.measure(
        model, workload.loss, probes, device=torch.device("cpu"), optimizer_name=cfg.optimizer.name,
        momentum=cfg.optimizer.momentum, no_sync=lambda m: contextlib.nullcontext(), checkpoint_staging=True,
    )  # fmt: skip
