"""Which parameters train: LoRA adapters (``model.lora``, through Hugging Face ``peft``) and frozen parameters
(``model.freeze``), applied to the model a workload builds, and the adapted model merged back for export.

Contract:

- :func:`prepare_trainable` turns the workload's model into the one that trains, in place: with ``model.lora``
  every target layer gets an adapter (``peft.inject_adapter_in_model``: the model keeps its class and its
  ``forward``; a target layer's weight moves to ``<layer>.base_layer.weight`` and its adapter is
  ``<layer>.lora_A.default.weight`` and ``<layer>.lora_B.default.weight``) and everything but the adapters is
  frozen, except the classifier head with ``model.lora.train_head`` (trained in full as itself: a head re-initialised
  for the data's classes has no pretrained weights to adapt; peft's ``modules_to_save`` would keep a second copy of
  it for adapter switching, which a run never does); then the ``model.freeze`` patterns freeze what they match.
  Every target and pattern must match something: otherwise ``ValueError`` naming the field, the value and the fix.
- :func:`check_trainable` runs the same on the model built on the meta device, before any worker starts, with the
  optimizer's parameter groups over it (:func:`~training_core.train.optim.param_groups`).
- :func:`merge_adapters` folds every adapter into its layer (``W + (alpha / rank) * B A``) and puts the plain layer
  back: a model that loads and predicts without ``peft`` (what MLflow registers). peft is imported only where a
  model has adapters.

What a checkpoint of such a model holds (its trainable parameters only, and the frozen base it needs) is
:mod:`training_core.checkpoint.partial`'s.
"""

from __future__ import annotations

import fnmatch
import sys
from typing import TYPE_CHECKING, Any

from training_core.messages import clip, invalid, quote

if TYPE_CHECKING:
    from torch import nn

    from training_core.config import LoraConfig, ModelConfig, TrainingConfig


def prepare_trainable(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """``model`` with ``model.lora``'s adapters added and ``model.freeze``'s parameters frozen (the same object;
    unchanged when neither is set)."""
    if cfg.lora.enabled:
        model = add_adapters(model, cfg.lora)
    freeze(model, cfg.freeze)
    if (cfg.lora.enabled or cfg.freeze) and not any(p.requires_grad for p in model.parameters()):
        invalid("model.freeze", cfg.freeze, "nothing is left to train: freeze fewer parameters")
    return model


def add_adapters(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """LoRA adapters on ``lora.target_modules`` of ``model``, everything else frozen but the head (``train_head``)."""
    import peft

    from training_core.pretrained import head_name

    names = [name for name, _ in model.named_modules()]
    for target in lora.target_modules:
        if not any(_is_target(name, target) for name in names):
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


def _is_target(module_name: str, target: str) -> bool:
    """peft's rule for a target module given by name: the module's full name, or its last dotted parts."""
    return module_name == target or module_name.endswith(f".{target}")


def _linear_names(model: nn.Module, count: int = 6) -> str:
    from torch import nn

    names = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    return ", ".join(names[:count]) + (", ..." if len(names) > count else "") if names else "(none)"


def _train_head(model: nn.Module, head: str) -> None:
    """Unfreeze the classifier head ``head``, unless it got an adapter itself or its weight is tied to another
    parameter (a language model's output layer: training it would train the token embeddings)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    module = model.get_submodule(head)
    if isinstance(module, BaseTunerLayer):
        return
    shared = [name for name, p in model.named_parameters(remove_duplicate=False) if p is module.weight]
    if len(shared) > 1:
        return
    for param in module.parameters():
        param.requires_grad_(True)


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
    import torch

    from training_core.train.optim import param_groups

    if not (config.model.lora.enabled or config.model.freeze or config.optimizer.param_groups):
        return
    try:
        with torch.device("meta"):
            model = workload.build_model(config, manifest)
    except Exception:  # noqa: BLE001 - a model whose construction needs real tensors is built on CPU instead
        model = workload.build_model(config, manifest)
    param_groups(config.optimizer, prepare_trainable(model, config.model))


def merge_adapters(model: nn.Module) -> nn.Module:
    """``model`` with every LoRA adapter merged into its layer and the layer put back as the plain one it wrapped
    (in place; returns ``model``): it loads and predicts without ``peft``. A model without adapters is unchanged
    (and peft is not imported: a model with adapters has imported it)."""
    if "peft" not in sys.modules:
        return model
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = [(name, m) for name, m in model.named_modules() if isinstance(m, BaseTunerLayer) and name]
    for name, module in adapted:
        module.merge()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module.get_base_layer())
    return model
