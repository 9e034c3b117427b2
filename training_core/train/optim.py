"""Optimizer and learning-rate schedule built from the config, and how a resumed run follows a changed config."""

from __future__ import annotations

import math
from typing import Any

import torch

from training_core.config import OptimizerConfig, ScheduleConfig, TrainingConfig, invalid, quote


def build_optimizer(cfg: OptimizerConfig, params) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` names over ``params`` (tensors, or the groups of :func:`param_groups`); with
    ``optimizer.fused`` PyTorch's fused kernel when the parameters are on a GPU."""
    params = list(params)
    tensors = [p for group in params for p in group["params"]] if params and isinstance(params[0], dict) else params
    fused = {"fused": True} if cfg.fused and tensors and all(p.device.type == "cuda" for p in tensors) else {}
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0, weight_decay=cfg.weight_decay, **fused
        )
    adam = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[cfg.name]  # the config checked the name
    return adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)


def param_groups(cfg: OptimizerConfig, model: torch.nn.Module) -> list[dict[str, Any]]:
    """The optimizer's parameter groups over ``model``'s trainable parameters (``requires_grad``; frozen ones are
    left out): first those no pattern of ``optimizer.param_groups`` matches, at ``lr`` (the one group of a run
    without patterns), then one group per pattern in the config's order at its own rate. Names are those of the
    model itself (without a DDP wrapper's ``module.`` prefix). A pattern that matches no trainable parameter, or a
    parameter two patterns match, raises ``ValueError`` naming the field, the value and the fix."""
    import fnmatch

    patterns = list(cfg.param_groups)
    groups: list[list[torch.nn.Parameter]] = [[] for _ in range(len(patterns) + 1)]
    for name, param in getattr(model, "module", model).named_parameters():
        if not param.requires_grad:
            continue
        matched = [i for i, pattern in enumerate(patterns) if fnmatch.fnmatchcase(name, pattern)]
        if len(matched) > 1:
            both = [patterns[i] for i in matched]
            invalid("optimizer.param_groups", both, f"parameter {quote(name)} matches each: make the groups disjoint")
        groups[matched[0] + 1 if matched else 0].append(param)
    for pattern, members in zip(patterns, groups[1:]):
        if not members:
            invalid(
                f"optimizer.param_groups[{pattern!r}]",
                cfg.param_groups[pattern],
                f"the pattern matches no trainable parameter of the model; names look like {_some_names(model)}",
            )
    return [{"params": members, "lr": lr} for members, lr in zip(groups, [cfg.lr, *cfg.param_groups.values()])]


def _some_names(model: torch.nn.Module, count: int = 4) -> str:
    names = [name for name, _ in getattr(model, "module", model).named_parameters()]
    return ", ".join(quote(name) for name in names[:count]) + (", ..." if len(names) > count else "")


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
    lrs = [cfg.optimizer.lr, *cfg.optimizer.param_groups.values()]  # each group's peak, in param_groups' order
    if len(lrs) != len(optimizer.param_groups):  # an optimizer built over bare parameters: one group at lr
        lrs = [cfg.optimizer.lr] * len(optimizer.param_groups)
    scheduler.base_lrs = list(lrs)
    for group, lr, factor in zip(optimizer.param_groups, lrs, scheduler.lr_lambdas):
        group.update(initial_lr=lr, lr=lr * factor(scheduler.last_epoch), weight_decay=cfg.optimizer.weight_decay)
        if "momentum" in group:
            group["momentum"] = cfg.optimizer.momentum
