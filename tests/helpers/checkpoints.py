"""Checkpoints to save in tests: a small CNN trained three steps, with its optimizer, scheduler and metadata."""

from __future__ import annotations

import torch

from training_core import checkpoint as ckpt
from training_core.config import OptimizerConfig, ScheduleConfig, TrainingConfig
from training_core.models import build_model
from training_core.records import EpochRecord
from training_core.train.loop import train_step
from training_core.train.optim import build_optimizer, build_scheduler
from training_core.workloads.protocol import classification_loss


def trained_objects(seed: int):
    """``(model, optimizer, scheduler, scaler)`` of a small CNN after three AdamW steps on random digits-shaped data."""
    torch.manual_seed(seed)
    model = build_model("small_cnn", num_classes=10, input_shape=(1, 8, 8))
    optimizer = build_optimizer(OptimizerConfig(name="adamw"), model.parameters())
    scheduler = build_scheduler(ScheduleConfig(warmup_steps=2), optimizer, total_steps=10)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for _ in range(3):
        batch = (torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)))
        train_step(
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            micro_batches=[batch],
            autocast_dtype=None,
            max_grad_norm=1.0,
            loss_fn=classification_loss,
        )
        scheduler.step()
    return model, optimizer, scheduler, scaler


def checkpoint_meta(global_step: int, metric: float | None = None) -> ckpt.CheckpointMeta:
    """Metadata of a small-CNN digits checkpoint at ``global_step``, mid-epoch (one epoch of history)."""
    return ckpt.CheckpointMeta(
        model_name="small_cnn",
        classes=[str(i) for i in range(10)],
        input_shape=[1, 8, 8],
        mean=[0.3],
        std=[0.2],
        epoch=1,
        step_in_epoch=2,
        global_step=global_step,
        config=TrainingConfig.from_dict({"model": {"name": "small_cnn"}}).to_dict(),
        metric=metric,
        history=[EpochRecord(1, 10, 1.2, 0.4, 1.3, 0.5, 0.01, 900.0)],
        epoch_partial={"loss": 1.5, "correct": 3.0, "samples": 8.0, "time_s": 0.1},
    )


def checkpoint_state(global_step: int, seed: int = 0, metric: float | None = None):
    """A whole checkpoint (``ckpt.snapshot``) of :func:`trained_objects` with :func:`checkpoint_meta`: ~350 KB,
    most of it AdamW's state."""
    model, optimizer, scheduler, scaler = trained_objects(seed)
    return ckpt.snapshot(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        meta=checkpoint_meta(global_step, metric),
        torch_rng={"0": {"cpu": torch.get_rng_state()}},
    )
