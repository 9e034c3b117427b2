"""One optimizer step over a step's micro-batches (``train_step``): precision, accumulation, clipping, and the
skip of a non-finite step on the device."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from torch import nn

from training_core.parallel.sharding import full_tensor

if TYPE_CHECKING:
    from training_core.workloads import LossOutput

log = logging.getLogger("training_core")


def resolve_precision(mode: str, device: torch.device) -> tuple[torch.dtype | None, bool]:
    """Autocast dtype (None = fp32) and whether to use a GradScaler, for ``precision.mode`` on ``device``; the same
    under both strategies (FSDP gathers its parameters in the autocast dtype and reduces gradients in fp32). The
    GradScaler works on FSDP's sharded gradients: DTensor all-reduces its overflow flag, so every rank skips the same
    steps (tests/gpu/test_fsdp_precision.py)."""
    if device.type != "cuda":
        if mode == "fp16":
            log.warning("precision.mode='fp16' needs a GPU; training in fp32 on %s", device)
        return (torch.bfloat16, False) if mode == "bf16" else (None, False)
    if mode == "auto":
        mode = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return {"fp32": (None, False), "bf16": (torch.bfloat16, False), "fp16": (torch.float16, True)}[mode]


@dataclass
class StepResult:
    loss: torch.Tensor
    """Mean loss over the step's micro-batches (detached)."""
    sums: dict[str, torch.Tensor]
    """The workload's additive figures of the step's batches (see :class:`~training_core.workloads.LossOutput`)."""
    num_samples: int
    num_tokens: int
    """Tokens in the step's batches (0 for a workload without tokens)."""
    grad_norm: torch.Tensor
    """Global gradient L2 norm before clipping."""
    nonfinite: torch.Tensor
    """0-dim bool on the device: the loss or the gradient norm was NaN or infinite (see :func:`train_step`)."""


def train_step(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    micro_batches: Sequence[Any],
    autocast_dtype: torch.dtype | None,
    max_grad_norm: float,
    loss_fn: Callable[[nn.Module, Any], LossOutput],
    skip_nonfinite: bool = False,
    sync_gradients: bool = True,
) -> StepResult:
    """One optimizer step over equally sized micro-batches, equal to one step on their concatenation.

    ``loss_fn`` is the workload's :meth:`~training_core.workloads.Workload.loss` (image classification's is
    :func:`~training_core.workloads.protocol.classification_loss`).

    Gradients of the micro-batches are accumulated (each loss scaled by ``1/len(micro_batches)``); a DDP
    model all-reduces, an FSDP model reduce-scatters, only on the last one. ``max_grad_norm <= 0`` disables
    clipping; under FSDP it clips by the norm of all shards together. Without ``sync_gradients`` (local SGD)
    no micro-batch syncs: the step uses this rank's gradients alone.
    The result flags a step whose loss or gradient norm is not finite, on the device (nothing waits for it);
    under a GradScaler (fp16) overflowing gradients are routine (the scaler skips those steps and lowers its
    scale), so only the loss counts there. ``skip_nonfinite`` leaves the model (weights and buffers) and the
    optimizer as they were when the step is flagged.
    """
    saved_buffers = Saved(list(model.buffers())) if skip_nonfinite else None
    num_micro = len(micro_batches)
    loss_sum, sums, num_samples, num_tokens = _accumulate(
        model, scaler, micro_batches, loss_fn=loss_fn, autocast_dtype=autocast_dtype, sync_gradients=sync_gradients
    )
    scaler.unscale_(optimizer)
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
    # Under FSDP the norm of the sharded gradients is a partial DTensor: its full value is the global norm.
    loss, grad_norm = loss_sum / num_micro, full_tensor(grad_norm).detach()
    finite = torch.isfinite(loss) if scaler.is_enabled() else torch.isfinite(loss) & torch.isfinite(grad_norm)
    # Under DDP every rank flags the same steps: a non-finite loss makes non-finite gradients, and the gradient
    # all-reduce spreads those to every rank's norm. So ranks skip alike and replicas stay identical.
    if saved_buffers is None or scaler.is_enabled():
        scaler.step(optimizer)
    elif finite.device.type == "cuda":
        # Reading the flag would make the host wait for the step's kernels every step. The update is taken
        # and then masked on the device instead, at the cost of a copy of the weights and optimizer state.
        masked_step(optimizer, finite)
        saved_buffers.keep_if(finite)
    elif finite.item():  # on CPU the value is already computed: reading it costs nothing, the skip is exact
        optimizer.step()
    else:  # no step, and the buffers (BatchNorm statistics) put back
        saved_buffers.keep_if(finite)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss=loss, sums=sums, num_samples=num_samples, num_tokens=num_tokens, grad_norm=grad_norm, nonfinite=~finite
    )


def _accumulate(
    model: nn.Module,
    scaler: torch.amp.GradScaler,
    micro_batches: Sequence[Any],
    *,
    loss_fn: Callable[[nn.Module, Any], LossOutput],
    autocast_dtype: torch.dtype | None,
    sync_gradients: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int, int]:
    """Forward and backward of every micro-batch, gradients accumulated and synced on the last one only (when
    ``sync_gradients``): the sum of their losses, the workload's sums, and their samples and tokens."""
    num_micro = len(micro_batches)
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), device=device)
    sums: dict[str, torch.Tensor] = {}
    num_samples = num_tokens = 0
    for index, batch in enumerate(micro_batches):
        is_last = index == num_micro - 1
        with contextlib.nullcontext() if is_last and sync_gradients else no_gradient_sync(model):
            with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                output = loss_fn(model, batch)
            scaler.scale(output.loss / num_micro).backward()
        loss_sum += output.loss.detach().float()
        for name, value in output.sums.items():
            sums[name] = sums[name] + value.detach() if name in sums else value.detach()
        num_samples += output.num_samples
        num_tokens += output.num_tokens
    return loss_sum, sums, num_samples, num_tokens


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate this micro-batch's gradients locally: DDP's ``no_sync``, FSDP2's gradient sync switched off (the
    last micro-batch reduce-scatters the sum). A model of one process has nothing to sync."""
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` (a tensor, or a tuple, list or dict of them) cut along its first dimension into ``parts`` equal
    micro-batches; itself when ``parts`` is 1."""
    if parts == 1:
        return [batch]
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    pieces = [leaf.tensor_split(parts) if isinstance(leaf, torch.Tensor) else [leaf] * parts for leaf in leaves]
    return [torch.utils._pytree.tree_unflatten([piece[i] for piece in pieces], spec) for i in range(parts)]


class Saved:
    """Copies of tensors taken now, put back later wherever a 0-dim bool tensor says so, on the device."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.copies = [t.detach().clone() for t in tensors]

    @torch.no_grad()
    def keep_if(self, keep: torch.Tensor) -> None:
        """Each tensor keeps its current value where ``keep`` is true, else gets its copy back."""
        for tensor, copy in zip(self.tensors, self.copies):
            tensor.copy_(torch.where(keep, tensor, copy))


def masked_step(optimizer: torch.optim.Optimizer, keep: torch.Tensor) -> None:
    """``optimizer.step()`` that stands only where ``keep`` (a 0-dim bool tensor) is true, decided on the device.

    Where it is false the parameters and their optimizer state are as before; state the step created (a first
    step's moments or momentum) becomes zeros, which is how Adam starts and from which SGD's momentum continues
    as from a fresh start. State kept off the parameters' device (Adam's step count on the CPU for a GPU model)
    is not masked: its bias correction then counts the skipped step."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    saved_params = Saved(params)
    saved_state = [
        {key: value.detach().clone() for key, value in optimizer.state[p].items() if _on(value, p.device)}
        for p in params
    ]
    optimizer.step()
    saved_params.keep_if(keep)
    with torch.no_grad():
        for p, before in zip(params, saved_state):
            for key, value in optimizer.state[p].items():
                if _on(value, p.device):
                    value.copy_(torch.where(keep, value, before.get(key, torch.zeros_like(value))))


def _on(value: Any, device: torch.device) -> bool:
    return isinstance(value, torch.Tensor) and value.device == device
