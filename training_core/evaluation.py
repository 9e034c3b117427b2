"""Evaluation: a workload's metrics of a model over batches (all-reduced across ranks during training), and the
test-split evaluation of a checkpoint in one process."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from training_core.config import clip

if TYPE_CHECKING:
    import torch
    from torch import nn

    from training_core.workloads import Workload


@dataclass
class Continuation:
    """A language model's greedy continuation of a fixed prompt."""

    prompt: str
    text: str


@dataclass
class EvalReport:
    """A model's evaluation on one split, as the evaluate task reports it."""

    split: str
    num_samples: int
    workload: str
    metrics: dict[str, float]
    """The workload's metrics: always ``loss`` and the primary metric (``accuracy``, ``perplexity``...)."""
    primary_metric: str
    primary_mode: str
    """``max`` or ``min``: which way the primary metric improves."""
    confusion: list[list[int]]
    """``confusion[true][predicted]`` counts (classification workloads; empty otherwise)."""
    classes: list[str]
    continuations: list[Continuation] = field(default_factory=list)
    """Language models: greedy continuations of fixed prompts, ``(prompt, continuation)``."""

    @property
    def loss(self) -> float:
        return self.metrics["loss"]

    @property
    def primary(self) -> float:
        return self.metrics[self.primary_metric]


@dataclass
class EvalResult:
    """Evaluation sums (all-reduced when asked) and the workload's metrics of them."""

    sums: dict[str, np.ndarray]
    metrics: dict[str, float]

    @property
    def num_samples(self) -> int:
        return int(self.sums.get("samples", 0))


def evaluate(
    model: nn.Module,
    batches: Iterable[Mapping[str, np.ndarray]],
    *,
    workload: Workload,
    to_device: Callable[[Mapping[str, np.ndarray]], Any],
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    all_reduce: bool = False,
    lockstep: bool = False,
) -> EvalResult:
    """The workload's evaluation sums over ``batches`` and its metrics; ``all_reduce`` sums over all ranks.
    ``lockstep`` (an FSDP model, whose forward is a collective): every rank runs as many forwards as the rank with
    the most batches, those past its own batches uncounted."""
    import torch

    bare = getattr(model, "module", model)  # no DDP forward: ranks may hold different numbers of batches
    was_training = bare.training
    bare.eval()
    totals: dict[str, torch.Tensor] = {}
    for batch, counted in _in_lockstep(batches, device) if lockstep else ((b, True) for b in batches):
        with (
            torch.no_grad(),
            torch.autocast(
                device_type=device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
            ),
        ):
            sums = workload.eval_sums(bare, to_device(batch))
        if not counted:
            continue
        for name, value in sums.items():
            value = value.detach().double()
            totals[name] = totals[name] + value if name in totals else value
    bare.train(was_training)
    names = sorted(totals)
    if names:
        flat = torch.cat([totals[n].reshape(-1) for n in names])
        if all_reduce and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flat)
        flat_values, offset, reduced = flat.cpu().numpy(), 0, {}
        for name in names:
            size = totals[name].numel()
            reduced[name] = flat_values[offset : offset + size].reshape(totals[name].shape)
            offset += size
    else:
        reduced = {}
    # A rank with no batches has no sums to add; every rank must still join the all-reduce with the same shapes.
    # The loop's shard assignment gives every rank a shard of each split, so no rank is ever empty.
    return EvalResult(sums=reduced, metrics=workload.metrics(reduced))


def _in_lockstep(batches: Iterable[Any], device: torch.device) -> Iterator[tuple[Any, bool]]:
    """``(batch, True)`` for each of this rank's batches, then ``(its last batch, False)`` until every rank ran out
    (one all-reduce per batch)."""
    from training_core.distributed import all_reduce_sum

    iterator, last = iter(batches), None
    while True:
        batch = next(iterator, None)
        (num_ranks_with_a_batch,) = all_reduce_sum([float(batch is not None)], device)
        if not num_ranks_with_a_batch:
            return
        if batch is not None:
            last = batch
        assert last is not None, "every rank holds a shard of each split (see the loop's shard assignment)"
        yield (batch, True) if batch is not None else (last, False)


def require_finite(figures: Mapping[str, float], *, what: str, fix: str) -> None:
    """Raise a ``ValueError`` naming every figure of ``what`` that is NaN or infinite, and ``fix``."""
    bad = ", ".join(f"{name}={value}" for name, value in figures.items() if not math.isfinite(value))
    if bad:
        raise ValueError(f"{what} has non-finite {bad}: {fix}")


def evaluate_checkpoint(
    checkpoint_dir: str, data_dir: str, *, split: str = "test", batch_size: int = 256
) -> EvalReport:
    """The checkpoint's model evaluated on ``split`` of the prepared data in ``data_dir``, in this process."""
    import torch

    from training_core.checkpoint import load_model
    from training_core.data import Manifest, ShardStream

    manifest = Manifest.load(data_dir)
    if split not in manifest.splits:
        raise ValueError(f"split={split!r} is invalid: the prepared data has {', '.join(manifest.splits)}")
    model, meta, workload = load_model(checkpoint_dir)
    require_finite(
        {name: float(t.abs().max()) for name, t in model.state_dict().items() if t.is_floating_point() and t.numel()},
        what=f"checkpoint {checkpoint_dir} (its largest absolute weights)",
        fix="a diverged model is neither evaluated nor registered; retrain with a lower optimizer.lr or with "
        "optimizer.max_grad_norm set",
    )
    trained_on = Manifest.from_description(meta.data) if meta.data else None
    if (
        meta.classes != manifest.classes
        or list(meta.input_shape) != list(manifest.input_shape)
        or (trained_on is not None and (trained_on.workload, trained_on.spec) != (manifest.workload, manifest.spec))
    ):
        raise ValueError(
            f"checkpoint {checkpoint_dir} was trained on classes {clip(str(meta.classes))} and input "
            f"{meta.input_shape}"
            + (f" ({trained_on.workload}, {clip(str(trained_on.spec))})" if trained_on else "")
            + f", but the data at {data_dir} has {clip(str(manifest.classes))} and {manifest.input_shape} "
            f"({manifest.workload}, {clip(str(manifest.spec))}); evaluate on matching data"
        )
    device = torch.device("cpu")
    stream = ShardStream(manifest, split, rank=0, world_size=1)
    result = evaluate(
        model,
        stream.eval_batches(batch_size=batch_size),
        workload=workload,
        to_device=workload.to_device(manifest, device),
        device=device,
    )
    confusion = result.sums.get("confusion")
    showcase = getattr(workload, "showcase", None)
    return EvalReport(
        split=split,
        num_samples=result.num_samples,
        workload=workload.name,
        metrics=result.metrics,
        primary_metric=workload.primary_metric,
        primary_mode=workload.primary_mode,
        confusion=confusion.astype(np.int64).tolist() if confusion is not None else [],
        classes=manifest.classes,
        continuations=[Continuation(p, t) for p, t in showcase(model, manifest)] if callable(showcase) else [],
    )
