"""How workers hold the model (``scaling.strategy``): its blocks, activation checkpointing, and FSDP2 sharding.

A block is one repeated unit of the model (a ResNet stage, a ViT or GPT block): FSDP shards each on its own, so only
one block's parameters are gathered at a time, and activation checkpointing recomputes a block's activations in the
backward pass. Both attach hooks to the blocks and leave the model's parameter names as they are, so checkpoints
and MLflow models read the same with and without them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections import Counter
from typing import Any, Callable, Iterator

import torch
from torch import nn

from training_core.messages import invalid

log = logging.getLogger("training_core")


def model_blocks(model: nn.Module, workload: Any) -> list[nn.Module]:
    """The model's blocks, outermost first in forward order.

    A workload that declares ``blocks(model)`` (a user workload) is asked; otherwise they are found: the block
    classes a ``transformers`` model names in ``_no_split_modules`` (GPT, Llama...), a torchvision ResNet's four
    stages, a torchvision ViT's encoder blocks. Empty for a model with none of these (the small CNN)."""
    declared = getattr(workload, "blocks", None)
    if callable(declared):
        blocks = list(declared(model))
        owned = {id(m) for m in model.modules()}
        stray = [type(b).__name__ for b in blocks if not isinstance(b, nn.Module) or id(b) not in owned]
        if stray:
            raise ValueError(
                f"the workload's blocks(model) returned {', '.join(stray[:5])}, which are not submodules of the "
                "model: return the model's own repeated modules (e.g. its transformer layers)"
            )
        return blocks
    return find_blocks(model)


def require_blocks(config: Any, manifest: Any, workload: Any) -> int:
    """``scaling.strategy=fsdp`` checked before any worker starts: the model (built on the meta device, so without
    its memory) must have blocks to shard one at a time. Returns how many; raises ``ValueError`` naming the fields
    and the fixes."""
    model = build_on_meta(config, manifest, workload)
    blocks = model_blocks(model, workload)
    if not blocks:
        invalid(
            "scaling.strategy",
            config.scaling.strategy,
            f"FSDP shards a model block by block, and model.name={config.model.name!r} ({type(model).__name__}) has "
            "no blocks this package can find: declare blocks(model) in the workload (its repeated layers), choose a "
            "model with repeated blocks (resnet18-152, vit_b_16, a GPT or a transformers config), or use "
            "scaling.strategy='ddp'",
        )
    return len(blocks)


def build_on_meta(config: Any, manifest: Any, workload: Any) -> nn.Module:
    """The workload's model built on the meta device (without its memory), for checks before any worker starts."""
    try:
        with torch.device("meta"):
            return workload.build_model(config, manifest)
    except Exception:  # noqa: BLE001 - a model whose construction needs real tensors is built on CPU instead
        return workload.build_model(config, manifest)


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """Blocks of the architectures this package builds (see :func:`model_blocks`). A ``transformers`` block that
    shares a parameter with a module outside it (BERT's embeddings, their word embeddings tied to the masked-LM
    decoder) is not one: FSDP2 shards a tied parameter in one unit only, so it stays in the root's with the other."""
    block_classes: set[str] = set()
    for module in model.modules():
        block_classes.update(getattr(module, "_no_split_modules", None) or ())
    if block_classes:
        named = [m for m in model.modules() if type(m).__name__ in block_classes]
        everywhere = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        return _outermost([m for m in named if not _shares_parameters(m, everywhere)])
    if all(isinstance(getattr(model, f"layer{i}", None), nn.Module) for i in range(1, 5)):
        return [getattr(model, f"layer{i}") for i in range(1, 5)]
    layers = getattr(getattr(model, "encoder", None), "layers", None)
    if isinstance(layers, nn.Sequential) and len(layers):
        return list(layers)
    return []


def _shares_parameters(block: nn.Module, everywhere: Counter) -> bool:
    """Whether a parameter of ``block`` is registered more often in the model (``everywhere``: how many times each
    parameter is, by id) than in ``block`` itself: tied to a parameter outside it."""
    inside = Counter(id(p) for _, p in block.named_parameters(remove_duplicate=False))
    return any(everywhere[key] > count for key, count in inside.items())


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def apply_activation_checkpointing(blocks: list[nn.Module], *, mode: str, every_k: int) -> int:
    """Recompute the activations of the blocks ``mode`` selects (``model.activation_checkpointing``) in the backward
    pass; returns how many. Non-reentrant checkpointing, attached as hooks (composable API): names stay the same."""
    if mode == "none" or not blocks:
        return 0
    from torch.distributed._composable import checkpoint

    chosen = blocks if mode == "full" else blocks[::every_k]
    for block in chosen:
        checkpoint(block)
    return len(chosen)


def shard_model(
    model: nn.Module,
    blocks: list[nn.Module],
    *,
    device: torch.device,
    param_dtype: torch.dtype | None,
    cpu_offload: bool,
) -> nn.Module:
    """FSDP2 ``fully_shard`` on each block, then on the root (which holds what no block does: stems, heads,
    embeddings), over the default process group. ``param_dtype`` (bf16 or fp16) is the dtype parameters are
    gathered in for compute, gradients being reduced in fp32 into fp32 shards; None keeps fp32. With
    ``cpu_offload`` the shards, their gradients and the optimizer state stay in host memory.

    A model whose parameters are on the meta device (:func:`empty_parameters`) is sharded there, then each rank
    allocates its shards alone, uninitialised, and its buffers keep their values: the caller fills the shards
    (:func:`training_core.pretrained.load_shards`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not blocks:
        log.warning(
            "scaling.strategy='fsdp': %s has no blocks to shard one at a time (declare blocks(model) in the "
            "workload), so the whole model is one FSDP unit and is gathered whole for each forward and backward",
            type(model).__name__,
        )
    empty = any(p.is_meta for p in model.parameters())
    buffers = dict(model.named_buffers())
    if not empty:
        model.to(torch.device("cpu") if cpu_offload else device)
    options = {
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None
        ),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    if empty:
        model.to_empty(device=torch.device("cpu") if cpu_offload else device)
        with torch.no_grad():
            for name, buffer in buffers.items():
                model.get_buffer(name).copy_(buffer)
    return model


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """A context in which modules are built with their parameters on the meta device (no memory, no values) and
    their buffers as usual (small, and some, such as position ids, are not in any state dict to load them from).
    A parameter already on the meta device is registered as itself, so a weight a model ties by assigning one
    parameter to two modules (``transformers``' ``tie_weights``: a masked LM's decoder and its word embeddings)
    stays one parameter, as when built whole (accelerate's context would register a new one)."""
    from accelerate import init_empty_weights

    plain = nn.Module.register_parameter
    with init_empty_weights(include_buffers=False):
        emptying = nn.Module.register_parameter

        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            (plain if param is not None and param.is_meta else emptying)(module, name, param)

        nn.Module.register_parameter = register  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.register_parameter = emptying  # type: ignore[method-assign]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is FSDP2-sharded (its state dict holds ``DTensor`` shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor``, else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a ``DTensor`` (a collective when it is sharded or partial), else the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def channels_last_inputs(to_device: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``to_device`` whose 4-D floating-point tensors (image batches) come out in the channels-last memory format."""

    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_floating_point():
            return value.contiguous(memory_format=torch.channels_last)
        return value

    return lambda batch: torch.utils._pytree.tree_map(convert, to_device(batch))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
FSDP_HOST_MMAP_THRESHOLD_BYTES = 2**20
"""FSDP on CPU: allocations from this size up get their own mapping, returned to the kernel when freed."""


def return_freed_host_memory() -> bool:
    """FSDP on CPU: make glibc give freed memory back to the kernel at once (blocks of 1 MiB and more are mapped on
    their own, and the heap is trimmed past 1 MiB). Returns whether glibc took the settings.

    The platform's process settings (:mod:`training_core.parallel.ray_settings`) keep freed memory mapped, which makes
    DDP's steps faster; under FSDP every step all-gathers each block's parameters and gradients into buffers it frees
    again, and kept mapped they would hold on to most of what sharding saves (measured on a GPT-2 on 2 CPU workers:
    a peak of 2.7 GB per worker instead of 1.6 GB; ``benchmarks/memory_scaling.py``). Set at run time with
    ``mallopt``, for this process only."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator has its own policy
        return False
    threshold = FSDP_HOST_MMAP_THRESHOLD_BYTES
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, threshold))
