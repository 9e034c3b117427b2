"""Evaluation: the test-split evaluation of a checkpoint where it fits: in one process (on a GPU when there is one),
or on Ray Train workers holding the model as training did (FSDP shards), for a model that cannot be gathered in one
process. A workload's metrics over batches (:func:`evaluate`) are :mod:`training_core.eval_sums`'s, re-exported here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from training_core.eval_sums import evaluate
from training_core.messages import clip

if TYPE_CHECKING:
    import torch
    from torch import nn

    from training_core.config import TrainingConfig
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


def require_finite(figures: Mapping[str, float], *, what: str, fix: str) -> None:
    """Raise a ``ValueError`` naming every figure of ``what`` that is NaN or infinite, and ``fix``."""
    bad = ", ".join(f"{name}={value}" for name, value in figures.items() if not math.isfinite(value))
    if bad:
        raise ValueError(f"{what} has non-finite {bad}: {fix}")


GATHER_BYTES_PER_PARAMETER = 8
"""Host memory a model's whole weights take in one process while it is loaded: fp32 weights, twice (the state read
from the checkpoint and the model it is loaded into)."""


def evaluation_placement(cfg: TrainingConfig, num_parameters: int) -> str:
    """``process`` or ``cluster``: where ``cfg.evaluation.placement`` puts the evaluation of a model of
    ``num_parameters`` parameters (0: unknown, an older checkpoint) trained under ``cfg.scaling``."""
    placement = cfg.evaluation.placement
    if placement != "auto":
        return placement
    gathered_bytes = num_parameters * GATHER_BYTES_PER_PARAMETER
    fits = gathered_bytes <= cfg.evaluation.process_memory_gib * 2**30
    return "cluster" if cfg.scaling.strategy == "fsdp" and not fits else "process"


def evaluate_checkpoint(
    checkpoint_dir: str,
    data_dir: str,
    *,
    split: str = "test",
    batch_size: int = 256,
    device: torch.device | str | None = None,
) -> EvalReport:
    """The checkpoint's model evaluated on ``split`` of the prepared data in ``data_dir``, in this process, on
    ``device`` (default: the GPU when there is one, else the CPU)."""
    import torch

    from training_core.checkpoint import load_model

    manifest = _split_of(data_dir, split)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, meta, workload = load_model(checkpoint_dir, map_location=str(device))
    require_finite(
        {name: float(t.abs().max()) for name, t in model.state_dict().items() if t.is_floating_point() and t.numel()},
        what=f"checkpoint {checkpoint_dir} (its largest absolute weights)",
        fix=DIVERGED_FIX,
    )
    require_same_data(meta, manifest, checkpoint_dir=checkpoint_dir, data_dir=data_dir)
    return _report(model, workload, manifest, split=split, batch_size=batch_size, device=device)


DIVERGED_FIX = (
    "a diverged model is neither evaluated nor registered; retrain with a lower optimizer.lr or with "
    "optimizer.max_grad_norm set"
)


def _split_of(data_dir: str, split: str):
    """The prepared data's manifest, which must hold ``split``."""
    from training_core.data.prepared import Manifest

    manifest = Manifest.load(data_dir)
    if split not in manifest.splits:
        raise ValueError(f"split={split!r} is invalid: the prepared data has {', '.join(manifest.splits)}")
    return manifest


def require_same_data(meta, manifest, *, checkpoint_dir: str, data_dir: str) -> None:
    """Raise a ``ValueError`` unless the checkpoint (its metadata ``meta``) was trained on data like ``manifest``'s:
    the same classes, input shape, workload and spec."""
    from training_core.data.prepared import Manifest

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


def _report(
    model: nn.Module, workload: Workload, manifest, *, split: str, batch_size: int, device, runtime=None, sharded=False
) -> EvalReport:
    """The :class:`EvalReport` of ``model`` on ``split``: in one process, or on each of ``runtime``'s ranks its shards
    of the split, the sums all-reduced. A language model's continuations are generated here (under FSDP every rank
    generates, in lockstep: greedy decoding runs the same forwards on each)."""
    from training_core.data.prepared import ShardStream

    rank, world_size = (runtime.rank, runtime.world_size) if runtime is not None else (0, 1)
    result = evaluate(
        model,
        ShardStream(manifest, split, rank=rank, world_size=world_size).eval_batches(batch_size=batch_size),
        workload=workload,
        to_device=workload.to_device(manifest, device),
        device=device,
        all_reduce=runtime is not None,
        lockstep=sharded,
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


REPORT_METRIC = "eval_report"
"""The key under which rank 0 of a cluster evaluation reports its :class:`EvalReport` (as JSON) to Ray Train."""


def evaluate_on_cluster(
    checkpoint_uri: str,
    data_dir: str,
    cfg: TrainingConfig,
    *,
    storage_path: str,
    run_name: str,
    split: str = "test",
    batch_size: int = 256,
) -> EvalReport:
    """The checkpoint's model evaluated on ``split`` by ``cfg.scaling.num_workers`` Ray Train workers that hold it
    as training did: under ``scaling.strategy: fsdp`` each keeps its shard (a sharded checkpoint is loaded shard by
    shard, resharded to this number of workers), so no process ever holds the whole model. Each worker evaluates
    its own shards of the split; the sums are all-reduced. ``checkpoint_uri`` and ``data_dir`` must be readable
    by every worker (``s3://`` on a cluster). Ray Train's run state goes to ``storage_path``/``run_name``."""
    import json

    import ray
    from ray.train import RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from training_core.checkpoint import load_meta
    from training_core.parallel.ray_settings import ray_scaling_config, start_local_cluster
    from training_core.runners.ray_processes import reaped_run

    manifest = _split_of(data_dir, split)
    require_same_data(load_meta(checkpoint_uri), manifest, checkpoint_dir=checkpoint_uri, data_dir=data_dir)
    if not ray.is_initialized():
        start_local_cluster()
    trainer = TorchTrainer(
        _evaluate_worker,
        train_loop_config={
            "checkpoint_uri": checkpoint_uri,
            "data_dir": data_dir,
            "split": split,
            "batch_size": batch_size,
            "sharded": cfg.scaling.strategy == "fsdp",
            "torch_threads": cfg.scaling.torch_threads_per_worker,
        },
        torch_config=TorchConfig(backend=cfg.scaling.resolved_backend(), timeout_s=cfg.scaling.collective_timeout_s),
        scaling_config=ray_scaling_config(cfg),
        run_config=RunConfig(name=run_name, storage_path=storage_path),
    )
    with reaped_run():  # no process of the run outlives it (Ray's exit deadlock)
        result = trainer.fit()
    raw = json.loads(result.metrics[REPORT_METRIC])
    raw["continuations"] = [Continuation(**c) for c in raw["continuations"]]
    return EvalReport(**raw)


def _evaluate_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker of :func:`evaluate_on_cluster`."""
    import dataclasses
    import json

    import torch

    from training_core.checkpoint import build_saved_model, load_directory, restore
    from training_core.data.prepared import Manifest
    from training_core.parallel import sharding
    from training_core.parallel.distributed import RayTrainRuntime, all_reduce_sum

    torch.set_num_threads(config["torch_threads"])
    runtime = RayTrainRuntime()
    device = runtime.device
    loaded = load_directory(config["checkpoint_uri"])  # every rank verifies what it reads
    model, workload = build_saved_model(loaded.meta)
    if config["sharded"]:
        if device.type == "cpu":
            sharding.return_freed_host_memory()
        model = sharding.shard_model(
            model, sharding.model_blocks(model, workload), device=device, param_dtype=None, cpu_offload=False
        )
    else:
        model = model.to(device)
    restore(loaded, model=model)  # a collective under FSDP
    local = [sharding.local_tensor(t) for t in model.state_dict().values() if t.is_floating_point()]
    (num_nonfinite,) = all_reduce_sum([float(sum(not bool(torch.isfinite(t).all()) for t in local))], device)
    if num_nonfinite:
        raise ValueError(f"checkpoint {config['checkpoint_uri']} has non-finite weights: {DIVERGED_FIX}")
    report = _report(
        model, workload, Manifest.load(config["data_dir"]), split=config["split"], batch_size=config["batch_size"],
        device=device, runtime=runtime, sharded=config["sharded"],
    )  # fmt: skip
    runtime.report_result({REPORT_METRIC: json.dumps(dataclasses.asdict(report))})
