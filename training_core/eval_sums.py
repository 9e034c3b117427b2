"""A workload's evaluation sums and metrics of a model over batches, all-reduced across ranks when asked: what the
loop's validation, a user workload's preflight and :mod:`training_core.evaluation` of a checkpoint each run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import nn

    from training_core.workloads import Workload


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
    reduced: dict[str, np.ndarray] = {}
    if names:
        flat = torch.cat([totals[n].reshape(-1) for n in names])
        if all_reduce and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flat)
        parts = flat.cpu().split([totals[n].numel() for n in names])
        reduced = {n: part.numpy().reshape(totals[n].shape) for n, part in zip(names, parts)}
    # A rank with no batches has no sums to add; every rank must still join the all-reduce with the same shapes.
    # The loop's shard assignment gives every rank a shard of each split, so no rank is ever empty.
    return EvalResult(sums=reduced, metrics=workload.metrics(reduced))


def _in_lockstep(batches: Iterable[Any], device: torch.device) -> Iterator[tuple[Any, bool]]:
    """``(batch, True)`` for each of this rank's batches, then ``(its last batch, False)`` until every rank ran out
    (one all-reduce per batch)."""
    from training_core.parallel.distributed import all_reduce_sum

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
