"""Optimizer and learning-rate schedule built from the config, and how a resumed run follows a changed config."""

from __future__ import annotations

import math

import torch

from training_core.config import OptimizerConfig, ScheduleConfig, TrainingConfig


def build_optimizer(cfg: OptimizerConfig, params) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` names over ``params``; with ``optimizer.fused`` PyTorch's fused kernel when the
    parameters are on a GPU."""
    params = list(params)
    fused = {"fused": True} if cfg.fused and params and all(p.device.type == "cuda" for p in params) else {}
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0, weight_decay=cfg.weight_decay, **fused
        )
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
    raise ValueError(f"optimizer.name={cfg.name!r} is invalid: choose one of sgd, adam, adamw")


def lr_factor(step: int, *, cfg: ScheduleConfig, total_steps: int) -> float:
    """Multiplier of the peak LR before optimizer step ``step`` (0-based): linear warmup, then the schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.name == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, *, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg=cfg, total_steps=total_steps))


def apply_hyperparameters(cfg: TrainingConfig, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Make the restored optimizer and schedule follow ``cfg``: a resumed run keeps the checkpoint's moments
    and position, but its learning rate, weight decay and momentum come from the config (PBT perturbs them
    between slices; for an unchanged config this changes nothing)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.optimizer.lr
        group["weight_decay"] = cfg.optimizer.weight_decay
        if "momentum" in group:
            group["momentum"] = cfg.optimizer.momentum
    scheduler.base_lrs = [cfg.optimizer.lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = cfg.optimizer.lr * factor(scheduler.last_epoch)
