"""A checkpoint of the trainable part of a model (LoRA adapters, parameters not in ``model.freeze``).

Contract: a run with frozen parameters (``model.lora``, ``model.freeze``) saves only what training changes, the
trainable parameters and the buffers; the frozen ones, its base, come back from where they came from (the pretrained
weights, or the seeded initialisation), rebuilt as the run built them. So the checkpoint names the base it needs by a
content digest of the frozen parameters (:func:`base_sha256`, in ``meta.json``'s ``frozen_base_sha256``), and
:func:`require_base` refuses a model whose frozen parameters differ before anything is loaded. A sharded (FSDP)
checkpoint holds the same, through ``StateDictOptions(ignore_frozen_params=True)`` (:func:`state_dict_options`). A
run without frozen parameters saves and loads the whole state dict, as always.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def frozen_names(model: nn.Module) -> set[str]:
    """The state-dict names of ``model``'s frozen parameters (``requires_grad`` off; a tied one under each name)."""
    bare = getattr(model, "module", model)
    return {name for name, param in bare.named_parameters(remove_duplicate=False) if not param.requires_grad}


def base_sha256(model: nn.Module) -> str:
    """The sha256 of ``model``'s frozen parameters (names, dtypes, shapes and bytes, in name order); "" when none is
    frozen. Every rank of a run computes the same: each builds the same base. Under FSDP each frozen parameter is
    gathered whole in turn: a collective, every rank calls it."""
    import torch

    bare = getattr(model, "module", model)
    frozen = sorted((name, p) for name, p in bare.named_parameters() if not p.requires_grad)
    if not frozen:
        return ""
    digest = hashlib.sha256()
    for name, param in frozen:
        whole = param.full_tensor() if hasattr(param, "full_tensor") else param  # a DTensor shard: all of it
        data = whole.detach().to("cpu").contiguous()
        digest.update(f"{name}\0{data.dtype}\0{tuple(data.shape)}\0".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def state_dict_options(model: nn.Module, **options: Any) -> Any:
    """``torch.distributed.checkpoint``'s ``StateDictOptions`` (with ``options``) for ``model``: without its frozen
    parameters when it has some, as a sharded checkpoint holds it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=bool(frozen_names(model)), **options)


def require_base(model: nn.Module, base: str, *, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` (a checkpoint of trainable parameters) unless ``model``'s frozen
    parameters are the base ``base`` it needs (a collective under FSDP)."""
    own = base_sha256(model)
    if own != base:
        raise ValueError(
            f"{where} holds the trainable parameters of a model whose frozen base has sha256 {base}, but this "
            f"model's frozen parameters have {own or 'none (nothing is frozen)'}: resume with the run's pretrained "
            "weights (model.pretrained), loop.seed, model.* architecture and model.lora/model.freeze settings"
        )


def load_trainable(model: nn.Module, state: dict[str, Any], *, where: str) -> None:
    """Load ``state`` (``model``'s state dict without its frozen parameters) into ``model`` (one process or a DDP
    replica, its frozen base checked by :func:`require_base`), whose other tensors ``state`` must hold exactly.
    Raises ``ValueError`` naming ``where`` (the checkpoint) and the fix otherwise."""
    from training_core.messages import clip

    bare = getattr(model, "module", model)
    missing, unexpected = bare.load_state_dict(state, strict=False)
    left = sorted(set(missing) - frozen_names(bare))
    if left or unexpected:
        raise ValueError(
            f"{where} does not fit this model: missing {clip(', '.join(left[:4]) or '-')}, unexpected "
            f"{clip(', '.join(sorted(unexpected)[:4]) or '-')}; resume with the run's model.lora and model.freeze"
        )
