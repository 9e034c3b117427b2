"""Which parameters train: LoRA adapters (``model.lora``, through Hugging Face ``peft``) and frozen parameters
(``model.freeze``), applied to the model a workload builds (:func:`prepare_trainable`; checked before any worker
starts by :func:`check_trainable`), and the adapters merged back into their layers for export (:func:`merge_adapters`).

``peft.inject_adapter_in_model`` keeps the model's class and its ``forward``: a target layer's weight moves to
``<layer>.base_layer.weight`` and its adapter is ``<layer>.lora_A.default.weight`` and
``<layer>.lora_B.default.weight``. With ``model.lora.train_head`` the classifier head trains in full as itself: a
head re-initialised for the data's classes has no pretrained weights to adapt, and peft's ``modules_to_save`` would
keep a second copy of it for adapter switching, which a run never does. Every target and pattern must match
something: otherwise ``ValueError`` naming the field, the value and the fix. peft is imported only where a model has
adapters.

What a checkpoint of such a model holds (its trainable parameters only, and the frozen base it needs) is
:mod:`training_core.checkpoint.partial`'s.
"""

from __future__ import annotations

import fnmatch
import sys
from typing import TYPE_CHECKING, Any

from training_core.messages import clip, invalid, quote

if TYPE_CHECKING:
    import torch
    from torch import nn

    from training_core.config import LoraConfig, ModelConfig, TrainingConfig


def prepare_trainable(model: nn.Module, cfg: ModelConfig, *, seed: int | None = None) -> nn.Module:
    """``model`` with ``model.lora``'s adapters added and ``model.freeze``'s parameters frozen (the same object;
    unchanged when neither is set). With ``seed`` (``loop.seed``) the adapters start at :func:`adapter_values`,
    as a model built on the meta device and sharded starts them; without, at peft's own draw (a model whose adapters
    a checkpoint fills, or one on the meta device)."""
    if cfg.lora.enabled:
        model = add_adapters(model, cfg.lora)
        if seed is not None:
            model.load_state_dict(adapter_values(model, seed), strict=False)  # the adapters alone
    freeze(model, cfg.freeze)
    if (cfg.lora.enabled or cfg.freeze) and not any(p.requires_grad for p in model.parameters()):
        invalid("model.freeze", cfg.freeze, "nothing is left to train: freeze fewer parameters")
    return model


def add_adapters(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """LoRA adapters on ``lora.target_modules`` of ``model``, everything else frozen but the head (``train_head``)."""
    import peft

    from training_core.pretrained import head_name

    names = [name for name, _ in model.named_modules()]
    for target in lora.target_modules:  # peft's rule: a module's full name, or its last dotted parts
        if not any(name == target or name.endswith(f".{target}") for name in names):
            invalid(
                "model.lora.target_modules",
                target,
                f"no layer of the model is named so (a target names a module by its full name or its last parts); "
                f"linear layers of this model: {_linear_names(model)}",
            )
    head = head_name(model)
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )
    try:
        model = peft.inject_adapter_in_model(config, model)
    except ValueError as exc:
        invalid("model.lora.target_modules", lora.target_modules, f"peft cannot adapt them ({clip(str(exc))})")
    if lora.train_head and head:
        _train_head(model, head)
    return model


def _linear_names(model: nn.Module, count: int = 6) -> str:
    from torch import nn

    names = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    return ", ".join(names[:count]) + (", ..." if len(names) > count else "") if names else "(none)"


def _train_head(model: nn.Module, head: str) -> None:
    """Unfreeze the classifier head ``head``, unless it got an adapter itself or its weight is tied to another
    parameter (a language model's output layer: training it would train the token embeddings)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    module = model.get_submodule(head)
    tied = sum(p is module.weight for _, p in model.named_parameters(remove_duplicate=False)) > 1
    if not isinstance(module, BaseTunerLayer) and not tied:
        module.requires_grad_(True)


def freeze(model: nn.Module, patterns: list[str]) -> None:
    """Turn off ``requires_grad`` of every parameter whose full name matches one of ``patterns`` (``fnmatch``)."""
    named = list(model.named_parameters())
    for pattern in patterns:
        matched = [param for name, param in named if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            some = ", ".join(quote(name) for name, _ in named[:4]) + (", ..." if len(named) > 4 else "")
            invalid("model.freeze", pattern, f"the pattern matches no parameter of the model; names look like {some}")
        for param in matched:
            param.requires_grad_(False)


def check_trainable(config: TrainingConfig, manifest: Any, workload: Any) -> None:
    """``model.lora``, ``model.freeze`` and ``optimizer.param_groups`` checked against the model (built on the meta
    device, so without its memory), before any worker starts."""
    from training_core.parallel.sharding import build_on_meta
    from training_core.train.optim import param_groups

    if not (config.model.lora.enabled or config.model.freeze or config.optimizer.param_groups):
        return
    param_groups(config.optimizer, prepare_trainable(build_on_meta(config, manifest, workload), config.model))


ADAPTER_INIT = {"lora_A": "kaiming", "lora_B": "zeros", "lora_embedding_A": "zeros", "lora_embedding_B": "normal"}
"""How peft initialises each kind of adapter tensor (``init_lora_weights=True``): A as ``nn.Linear`` initialises a
weight (Kaiming-uniform, ``a = sqrt(5)``) and B zeros, an embedding's the other way round (B standard normal)."""


def adapter_values(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The starting values of ``model``'s LoRA adapter tensors, by state-dict name, on the CPU: drawn as peft draws
    them (:data:`ADAPTER_INIT`), in name order, from a generator seeded with ``seed``. Only shapes and dtypes are
    read, so ``model`` may be on the meta device: a model built whole and one built on the meta device and sharded
    start the same adapters (peft's own draw comes from torch's global RNG after the model's own initialisation,
    which a meta build does not consume). {} for a model without adapters; torch's global RNG is left alone."""
    import math

    import torch

    generator = torch.Generator().manual_seed(seed)
    values: dict[str, torch.Tensor] = {}
    for name, (kind, param) in sorted(_adapter_tensors(model).items()):
        value = torch.empty(param.shape, dtype=param.dtype)
        if kind == "kaiming":
            torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
        elif kind == "normal":
            torch.nn.init.normal_(value, generator=generator)
        else:
            value.zero_()
        values[name] = value
    return values


def _adapted_layers(model: nn.Module) -> dict[str, Any]:
    """``model``'s layers that carry adapters, by name; {} while peft is not imported (a model with adapters has)."""
    if "peft" not in sys.modules:
        return {}
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)}


def _adapter_tensors(model: nn.Module) -> dict[str, tuple[str, Any]]:
    """Each adapter tensor of ``model`` by state-dict name: its :data:`ADAPTER_INIT` kind and the tensor."""
    found: dict[str, tuple[str, Any]] = {}
    for layer_name, layer in _adapted_layers(model).items():
        for kind_name in layer.adapter_layer_names:
            prefix = f"{layer_name}.{kind_name}" if layer_name else kind_name
            for name, param in getattr(layer, kind_name).named_parameters(prefix=prefix):
                assert kind_name in ADAPTER_INIT, f"{name}: an adapter this platform does not configure"
                kind = "zeros" if name.endswith(".bias") else ADAPTER_INIT[kind_name]  # a LoRA bias starts at 0
                found[name] = (kind, param)
    return found


def unadapted_names(model: nn.Module) -> dict[str, str]:
    """Each state-dict name of ``model`` but its adapters' -> the name it had before :func:`add_adapters`: an adapted
    layer's ``<layer>.base_layer.<tensor>`` was ``<layer>.<tensor>``, the rest kept theirs. What pretrained weights,
    saved for the model without adapters, are read by."""
    adapters = _adapter_tensors(model)
    names = [name for name in model.state_dict() if name not in adapters]
    adapted = _adapted_layers(model)
    plain: dict[str, str] = {}
    for name in names:
        head, marker, tail = name.rpartition("base_layer.")
        layer = head.removesuffix(".")
        wrapped = bool(marker) and (not head or head.endswith(".")) and layer in adapted
        plain[name] = head + tail if wrapped else name
    return plain


def merge_adapters(model: nn.Module) -> nn.Module:
    """``model`` with every LoRA adapter merged into its layer (``W + (alpha / rank) * B A``) and the layer put back
    as the plain one it wrapped (in place; returns ``model``): it loads and predicts without ``peft``. A model without
    adapters is unchanged."""
    for name, module in _adapted_layers(model).items():
        module.merge()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module.get_base_layer())
    return model
