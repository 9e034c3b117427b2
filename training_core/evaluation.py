"""Evaluation: loss, top-1/top-5 and the confusion matrix of a model over batches (all-reduced across ranks
during training), and the test-split evaluation of a checkpoint in one process."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import nn

    from training_core.data import Normalizer


@dataclass
class EvalReport:
    split: str
    num_samples: int
    loss: float
    accuracy: float
    top5_accuracy: float
    confusion: list[list[int]]
    """``confusion[true][predicted]`` counts."""
    classes: list[str]


@dataclass
class EvalSums:
    """Additive evaluation totals, so ranks can all-reduce them."""

    loss_sum: float
    num_correct_top1: int
    num_correct_top5: int
    num_samples: int
    confusion: np.ndarray
    """``confusion[true, predicted]`` counts."""

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.num_samples)

    @property
    def accuracy(self) -> float:
        return self.num_correct_top1 / max(1, self.num_samples)

    @property
    def top5_accuracy(self) -> float:
        return self.num_correct_top5 / max(1, self.num_samples)


def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[np.ndarray, np.ndarray]],
    *,
    normalize: Normalizer,
    num_classes: int,
    autocast_dtype: torch.dtype | None = None,
    all_reduce: bool = False,
) -> EvalSums:
    """Loss, top-1/top-5 and confusion over ``batches``; ``all_reduce`` sums the totals over all ranks."""
    import torch
    import torch.nn.functional as F

    bare = getattr(model, "module", model)  # no DDP forward: ranks may hold different numbers of batches
    was_training = bare.training
    bare.eval()
    device = normalize.device
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.long, device=device)
    k = min(5, num_classes)
    for images, labels in batches:
        x, y = normalize(images, labels)
        with (
            torch.no_grad(),
            torch.autocast(
                device_type=device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
            ),
        ):
            logits = bare(x)
        logits = logits.float()
        top = logits.topk(k, dim=1).indices
        totals += torch.stack(
            [
                F.cross_entropy(logits, y, reduction="sum").double(),
                (top[:, 0] == y).sum().double(),
                (top == y[:, None]).any(dim=1).sum().double(),
                torch.tensor(float(len(y)), dtype=torch.float64, device=device),
            ]
        )
        confusion += torch.bincount(y * num_classes + top[:, 0], minlength=num_classes * num_classes)
    if all_reduce and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals)
        torch.distributed.all_reduce(confusion)
    bare.train(was_training)
    t = totals.tolist()
    return EvalSums(
        loss_sum=t[0],
        num_correct_top1=int(t[1]),
        num_correct_top5=int(t[2]),
        num_samples=int(t[3]),
        confusion=confusion.view(num_classes, num_classes).cpu().numpy(),
    )


def require_finite(figures: Mapping[str, float], *, what: str, fix: str) -> None:
    """Raise a ``ValueError`` naming every figure of ``what`` that is NaN or infinite, and ``fix``."""
    bad = ", ".join(f"{name}={value}" for name, value in figures.items() if not math.isfinite(value))
    if bad:
        raise ValueError(f"{what} has non-finite {bad}: {fix}")


def evaluate_checkpoint(
    checkpoint_dir: str, data_dir: str, *, split: str = "test", batch_size: int = 256
) -> EvalReport:
    import torch

    from training_core.checkpoint import load_model
    from training_core.data import Manifest, Normalizer, ShardStream

    manifest = Manifest.load(data_dir)
    if split not in manifest.splits:
        raise ValueError(f"split={split!r} is invalid: the prepared data has {', '.join(manifest.splits)}")
    model, meta = load_model(checkpoint_dir)
    require_finite(
        {name: float(t.abs().max()) for name, t in model.state_dict().items() if t.is_floating_point() and t.numel()},
        what=f"checkpoint {checkpoint_dir} (its largest absolute weights)",
        fix="a diverged model is neither evaluated nor registered; retrain with a lower optimizer.lr or with "
        "optimizer.max_grad_norm set",
    )
    if meta.classes != manifest.classes or list(meta.input_shape) != list(manifest.input_shape):
        raise ValueError(
            f"checkpoint {checkpoint_dir} was trained on classes {meta.classes} and input {meta.input_shape}, "
            f"but the data at {data_dir} has {manifest.classes} and {manifest.input_shape}; evaluate on matching data"
        )
    device = torch.device("cpu")
    stream = ShardStream(manifest, split, rank=0, world_size=1)
    sums = evaluate(
        model,
        stream.eval_batches(batch_size=batch_size),
        normalize=Normalizer(manifest, device),
        num_classes=manifest.num_classes,
    )
    return EvalReport(
        split=split,
        num_samples=sums.num_samples,
        loss=sums.loss,
        accuracy=sums.accuracy,
        top5_accuracy=sums.top5_accuracy,
        confusion=sums.confusion.tolist(),
        classes=manifest.classes,
    )
