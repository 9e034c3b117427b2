"""Loading a verified checkpoint into live objects (full or sharded, into DDP, FSDP or one process) and rebuilding the
model a checkpoint describes."""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

from training_core.checkpoint.load import LoadedCheckpoint, load_directory
from training_core.checkpoint.meta import CheckpointMeta
from training_core.checkpoint.partial import load_trainable, require_base, state_dict_options
from training_core.checkpoint.snapshot import torch_bytes


def load_model(directory: str, *, map_location: str = "cpu"):
    """Rebuild the model a checkpoint directory describes with its workload (user code is imported again), verify
    and load its weights. Returns ``(model, meta, workload)``."""
    loaded = load_directory(os.path.abspath(directory))
    model, workload = build_saved_model(loaded.meta)
    restore(loaded, model=model)
    return model.to(map_location), loaded.meta, workload


def build_saved_model(meta: CheckpointMeta):
    """The model a checkpoint's metadata describes, freshly initialised, and its workload (user code is imported
    again): ``(model, workload)``. Load its weights with :func:`restore`."""
    from training_core.config import TrainingConfig
    from training_core.data.prepared import Manifest
    from training_core.pretrained import without_pretrained
    from training_core.train.lora import prepare_trainable
    from training_core.train.rng import seed_everything
    from training_core.workloads import resolve_workload

    # The saved config is a (redacted) record: only the sections that shape the model (and that a workload's
    # config checks read) are read back, so a checkpoint written by an older version, with fields since renamed
    # elsewhere, still loads.
    # One worker: the run's layout does not shape the model, and the default one (2 workers) would refuse the data
    # section of a run trained on fewer shards (data.num_shards >= scaling.num_workers).
    sections = {k: meta.config[k] for k in ("workload", "data", "model") if k in meta.config}
    # The checkpoint holds the weights: not the pretrained ones, maybe gone. A checkpoint of the trainable part only
    # needs its frozen base: the pretrained weights and the seeded initialisation, as the run built them.
    if isinstance(sections.get("model"), dict) and not meta.frozen_base_sha256:
        sections["model"] = without_pretrained(sections["model"])
    # The seed rebuilds a frozen base's initialisation: read back through the config schema (its field named on a bad
    # value), without the rest of the loop section.
    loop = meta.config.get("loop")
    if meta.frozen_base_sha256 and isinstance(loop, dict) and "seed" in loop:
        sections["loop"] = {"seed": loop["seed"]}
    config = TrainingConfig.from_dict({**sections, "scaling": {"num_workers": 1}})
    if meta.data:
        manifest = Manifest.from_description(meta.data)
    else:
        manifest = Manifest(
            dataset="", classes=meta.classes, input_shape=meta.input_shape, mean=meta.mean, std=meta.std, splits={}
        )
    workload = resolve_workload(config.workload)
    if meta.frozen_base_sha256:
        seed_everything(config.loop.seed)
    return prepare_trainable(workload.build_model(config, manifest), config.model), workload


def restore(loaded: LoadedCheckpoint, *, model, optimizer=None, scheduler=None, scaler=None) -> None:
    """Load every stateful object in place from a verified checkpoint, whatever wrote it and however ``model`` is
    held now: a sharded checkpoint into an FSDP model on any number of ranks (resharded), into a DDP model or into
    one process; a full checkpoint into a DDP model or, each rank reading the whole of it, into an FSDP model. Under
    a process group every rank calls it (the sharded load is a collective)."""
    from training_core.parallel.sharding import is_sharded

    try:
        if loaded.meta.frozen_base_sha256:
            require_base(model, loaded.meta.frozen_base_sha256, where=loaded.display_uri)
        if loaded.shards_dir:
            _load_shards(loaded.shards_dir, loaded.shard_metadata, model=model, optimizer=optimizer)
        elif is_sharded(model):
            _load_full_into_sharded(loaded, model=model, optimizer=optimizer)
        else:
            if loaded.meta.frozen_base_sha256:
                load_trainable(model, loaded.model, where=loaded.display_uri)
            else:
                getattr(model, "module", model).load_state_dict(loaded.model)
            if optimizer is not None and "optimizer" in loaded.trainer:
                optimizer.load_state_dict(loaded.trainer["optimizer"])
    finally:
        loaded.release()
    for name, obj in (("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None and name in loaded.trainer:
            obj.load_state_dict(loaded.trainer[name])


def _load_shards(directory: str, metadata: Any, *, model, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    # A model with frozen parameters loads its trainable ones (what such a checkpoint holds) over its frozen base.
    options = state_dict_options(model)
    into = dataclasses.replace(options, strict=not options.ignore_frozen_params)
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=options)}
        dcp.load(state, storage_reader=_safe_reader(directory, metadata), planner=_weights_only_planner())
        set_model_state_dict(model, state["model"], options=into)
        return
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, storage_reader=_safe_reader(directory, metadata), planner=_weights_only_planner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=into)


def _load_full_into_sharded(loaded: LoadedCheckpoint, *, model, optimizer) -> None:
    """A full checkpoint (written under DDP) into an FSDP model: each rank keeps its shard of the whole. The
    optimizer's state, numbered in the order of its groups' parameters, is keyed by the parameters' names first."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    partial = bool(loaded.meta.frozen_base_sha256)  # the trainable parameters only, over the frozen base
    options = StateDictOptions(full_state_dict=True, strict=not partial)
    set_model_state_dict(model, loaded.model, options=options)
    saved = loaded.trainer.get("optimizer")
    if optimizer is None or saved is None:
        return
    name_of = {id(param): name for name, param in model.named_parameters()}
    names = [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
    by_name = {
        "state": {names[index]: value for index, value in saved["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in saved["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=options)


def model_state_shapes(model) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor :func:`restore` loads into ``model`` from a sharded checkpoint (its
    ``torch.distributed.checkpoint`` state dict: names without a DDP or ``torch.compile`` prefix, global shapes
    under FSDP, frozen parameters left out): what ``expected_shapes`` of :func:`load_latest_valid` checks a
    checkpoint against."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=state_dict_options(model))
    return {name: tuple(value.shape) for name, value in state.items() if torch.is_tensor(value)}


def _safe_reader(directory: str, metadata: Any):
    """A ``FileSystemReader`` of ``directory`` that loads by ``metadata`` (its ``.metadata``, already parsed and
    checked by :func:`verify_and_load`) instead of reading the file again: torch's own reader runs ``pickle.load``
    on it, and a file read twice could have changed in between."""
    import copy

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    assert metadata is not None, "a sharded checkpoint's metadata is parsed and checked by verify_and_load"

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            loaded = copy.copy(metadata)
            loaded.storage_meta = copy.copy(getattr(metadata, "storage_meta", None)) or StorageMeta()
            loaded.storage_meta.load_id = self.load_id
            return loaded

    return SafeReader(directory)


def _weights_only_planner():
    """A ``DefaultLoadPlanner`` that decodes the non-tensor entries (optimizer hyper-parameters) with
    ``torch.load(weights_only=True)``; torch's own unpickles them with ``weights_only=False``."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            plain = torch.load(value, map_location="cpu", weights_only=True)
            super().load_bytes(read_item, io.BytesIO(torch_bytes(plain)))

    return WeightsOnlyLoadPlanner()
