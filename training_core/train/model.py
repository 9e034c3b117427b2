"""The model as a worker holds it (``scaling.strategy``, ``model.*``: channels-last, activation checkpointing and
compilation of its blocks, FSDP shards or a DDP replica), and the trained model to MLflow (:class:`ModelExport`)."""

from __future__ import annotations

import logging
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from training_core.checkpoint import base_sha256
from training_core.parallel import sharding
from training_core.parallel.distributed import ddp_options
from training_core.train.lora import adapter_values, prepare_trainable, unadapted_names

if TYPE_CHECKING:
    from training_core.config import TrainingConfig
    from training_core.data import Manifest
    from training_core.parallel.distributed import WorkerRuntime
    from training_core.records import MlflowRun
    from training_core.train.guards import DivergenceGuard
    from training_core.workloads import Workload

log = logging.getLogger("training_core")


@dataclass
class HeldModel:
    model: nn.Module
    """The model as this worker trains it: FSDP-sharded, a DDP replica, or itself on one worker."""
    channels_last: bool
    """Its weights, and so its inputs, are channels-last (a GPU model with convolutions, ``model.channels_last``)."""
    checkpoint_group: Any
    """Sharded checkpoints' own (gloo) process group (their writes run collectives in the background); None
    unsharded."""


def hold_model(
    model: nn.Module,
    cfg: TrainingConfig,
    workload: Workload,
    runtime: WorkerRuntime,
    *,
    param_dtype: torch.dtype | None,
) -> HeldModel:
    """``model`` as this worker holds it: BatchNorm synced over GPU workers (``model.sync_batchnorm``),
    channels-last on a GPU, its blocks checkpointed and compiled in place (block by block under FSDP: parameter
    names and DDP's hooks stay as they are), then sharded (``scaling.strategy: fsdp``) or replicated."""
    device, world_size = runtime.device, runtime.world_size
    if cfg.model.sync_batchnorm and device.type == "cuda" and world_size > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    sharded = cfg.scaling.strategy == "fsdp"
    channels_last = cfg.model.channels_last and device.type == "cuda" and sharding.has_conv2d(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    blocks = sharding.model_blocks(model, workload)
    sharding.apply_activation_checkpointing(
        blocks, mode=cfg.model.activation_checkpointing, every_k=cfg.model.activation_checkpointing_every_k
    )
    if cfg.model.compile:
        for module in blocks if sharded and blocks else [model]:
            module.compile()
    if sharded:
        group = torch.distributed.new_group(backend="gloo")
        shards = sharding.shard_model(
            model, blocks, device=device, param_dtype=param_dtype, cpu_offload=cfg.scaling.fsdp_cpu_offload
        )
        return HeldModel(shards, channels_last, group)
    if world_size == 1:
        return HeldModel(runtime.prepare_model(model), channels_last, None)
    return HeldModel(runtime.prepare_model(model, ddp_options(cfg.scaling)), channels_last, None)


def build_held_model(
    cfg: TrainingConfig, workload: Workload, manifest: Manifest, runtime: WorkerRuntime, *, param_dtype: Any
) -> tuple[HeldModel, int, str]:
    """The model this worker trains, held (:func:`hold_model`), its parameter count and the sha256 of its frozen base
    (:func:`~training_core.checkpoint.base_sha256`: with ``model.lora`` or ``model.freeze`` checkpoints hold the
    trainable parameters and name this base). Read by rows under FSDP (:func:`loads_by_rows`): never whole here."""
    if loads_by_rows(cfg, workload):
        held, num_parameters, _ = build_sharded_pretrained(cfg, workload, manifest, runtime, param_dtype=param_dtype)
        return held, num_parameters, base_sha256(held.model)  # a collective: each frozen tensor gathered in turn
    model = prepare_trainable(workload.build_model(cfg, manifest), cfg.model, seed=cfg.loop.seed)
    num_parameters, frozen_base_sha256 = sum(p.numel() for p in model.parameters()), base_sha256(model)
    return hold_model(model, cfg, workload, runtime, param_dtype=param_dtype), num_parameters, frozen_base_sha256


def loads_by_rows(cfg: TrainingConfig, workload: Workload) -> bool:
    """Whether the model's ``model.pretrained`` weights are read shard by shard (:func:`build_sharded_pretrained`):
    under FSDP, for a workload that declares ``loads_pretrained_sharded`` (with ``model.lora`` and ``model.freeze``
    too)."""
    sharded = cfg.scaling.strategy == "fsdp" and bool(cfg.model.pretrained)
    return sharded and bool(getattr(workload, "loads_pretrained_sharded", False))


def build_sharded_pretrained(
    cfg: TrainingConfig,
    workload: Workload,
    manifest: Manifest,
    runtime: WorkerRuntime,
    *,
    param_dtype: torch.dtype | None,
) -> tuple[HeldModel, int, int]:
    """The model held under FSDP (:func:`hold_model`), its parameter count and the bytes of weights this rank read,
    never whole in this process: built with its parameters on the meta device, given its ``model.lora`` adapters and
    ``model.freeze`` there (:func:`~training_core.train.lora.prepare_trainable`), sharded, then each rank reads only
    the rows of ``model.pretrained`` it holds (:func:`training_core.pretrained.load_shards`; an adapted layer's
    ``base_layer`` tensors read the layer's own) and takes its rows of the adapters' seeded starting values
    (:func:`~training_core.train.lora.adapter_values`): the same step-0 weights as the model built whole."""
    from training_core.pretrained import load_shards, plan_sharded_load

    with sharding.empty_parameters():
        model = workload.build_model(cfg, manifest)
    mapping_of = getattr(workload, "pretrained_mapping", None)  # how its model names the weights' tensors
    # Planned on the model as the weights name it, before peft renames an adapted layer's tensors.
    load = plan_sharded_load(model, cfg.model, seed=cfg.loop.seed, mapping_of=mapping_of)
    with sharding.empty_parameters():  # the adapters on the meta device too: their values come after sharding
        model = prepare_trainable(model, cfg.model)
    if cfg.model.lora.enabled:
        load = load.wrapped(unadapted_names(model), adapter_values(model, cfg.loop.seed))
    num_parameters = sum(p.numel() for p in model.parameters())
    held = hold_model(model, cfg, workload, runtime, param_dtype=param_dtype)
    bytes_read = load_shards(held.model, load)
    log.info("model.pretrained: this rank read %.1f MB of the weights by rows (FSDP)", bytes_read / 1e6)
    return held, num_parameters, bytes_read


@dataclass
class ModelExport:
    """What it takes to log the model: the run's MLflow run (None: no logging), and how to rebuild the model whole."""

    mlflow: MlflowRun | None
    cfg: TrainingConfig
    _: KW_ONLY
    manifest: Manifest
    workload: Workload
    rank: int
    sharded: bool

    def log_checked(self, model: nn.Module, guard: DivergenceGuard, *, full_budget: bool, global_step: int) -> str:
        """Rank 0 logs ``model`` once the weights are checked finite (collectives: the check, and the gather under
        FSDP); returns its ``models:/`` URI. "" on the other ranks, without MLflow, or for a slice that stops before
        the budget (a tuning rung): only a finished trial is registered, and logging costs seconds."""
        if self.mlflow is None or not full_budget:
            return ""
        guard.require_finite_weights(model, "the MLflow model", global_step=global_step)
        whole = self.gathered(model) if self.sharded else model
        if self.rank != 0:
            return ""
        from training_core.tracking import log_model

        example = self.workload.example_input(self.manifest)
        # A workload may free more input axes than the batch (a language model: the sequence length).
        dynamic_axes = getattr(self.workload, "dynamic_axes", (0,))
        # A workload may log files beside the model (a text classifier: its tokenizer and classes).
        model_files = getattr(self.workload, "model_files", None)
        files = {"extra_files": model_files(self.manifest)} if callable(model_files) else {}
        return log_model(whole, example, self.mlflow, dynamic_axes=dynamic_axes, **files)

    def gathered(self, model: nn.Module) -> nn.Module | None:
        """The FSDP model whole, in one process on rank 0's CPU (None on the other ranks): a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from training_core.pretrained import without_pretrained

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        # Built without model.pretrained, as a checkpoint's rebuild is: the gathered state replaces every tensor, and
        # the weights the run started from may be gone or changed by its end.
        raw = self.cfg.to_dict()
        cfg = type(self.cfg).from_dict({**raw, "model": without_pretrained(raw["model"])})
        rebuilt = prepare_trainable(self.workload.build_model(cfg, self.manifest), cfg.model)
        rebuilt.load_state_dict(full)
        return rebuilt
