"""Which workload a config names, built and checked before any worker starts: a built-in of
:data:`training_core.registry.WORKLOADS` or user code (:func:`resolve_workload`), and :func:`preflight`, which
checks it against the prepared data and runs a user workload once on a batch in the driver."""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
from typing import TYPE_CHECKING

from training_core.config import DataConfig, TrainingConfig, WorkloadConfig
from training_core.messages import invalid, quote
from training_core.registry import DATASET_SOURCES, SOURCE_CHECKS, WORKLOADS, load
from training_core.workloads.protocol import Workload, check_workload
from training_core.workloads.user_code import (
    UserWorkload,
    call_with_params,
    factory_params,
    load_attribute,
    signature_accepts,
    takes_params,
    typed_params,
)

if TYPE_CHECKING:
    from training_core.data.prepared import Manifest


PREFLIGHT_BATCH_SAMPLES = 8
"""At most this many samples make the batch :func:`preflight` runs a user workload on, on the driver's CPU: enough
for batch statistics, small enough for the driver pod's CPU and memory."""


def prep_uses_ray(data: DataConfig, workload: WorkloadConfig) -> bool:
    """Whether prep of ``data`` runs on a Ray cluster: the built-in image workload on an encoded source (a Ray
    task per shard) and the built-in ``causal_lm`` and ``sequence_classification`` on their text sources (tokenised
    in Ray tasks). A user's ``workload.dataset_source``, ``digits`` and ``synthetic`` prepare in their own process."""
    if workload.dataset_source:
        return False
    if workload.name == "image_classification":
        return bool(DATASET_SOURCES[data.dataset].list_images)
    return workload.name in SOURCE_CHECKS  # the text workloads: tokenised in Ray tasks


def resolve_workload(selected: WorkloadConfig) -> Workload:
    """The workload ``selected`` (a config's ``workload``) names, built and checked. User code is imported here:
    the drivers call it before any worker starts."""
    if selected.name in WORKLOADS:
        return load(WORKLOADS[selected.name])(selected)
    factory = load_attribute("workload.name", selected.name)
    if not signature_accepts(factory, 0) and not takes_params(factory):
        invalid("workload.name", selected.name, "it must be callable with no arguments (a class or a factory)")
    params = factory_params(selected, factory)
    workload = call_with_params("workload.name", selected.name, factory, params)
    if getattr(factory, "params_type", None) is None and getattr(workload, "params_type", None) is not None:
        params = typed_params(selected, workload.params_type)  # declared by the instance a factory function built
    workload = check_workload("workload.name", selected.name, workload)
    try:
        workload.params = params
    except AttributeError as exc:  # a read-only property or __slots__ without it
        invalid("workload.name", selected.name, f"its workload cannot take a params attribute ({exc}); let it")
    return UserWorkload(workload, selected.name)


def check_params(selected: WorkloadConfig) -> None:
    """Check ``workload.params`` against every ``params_type`` the user code ``selected`` names declares (the
    workload's, the model factory's, the dataset source's): ``ValueError`` naming the field, the value and the fix."""
    resolve_workload(selected)
    for field, path in (
        ("workload.model_factory", selected.model_factory),
        ("workload.dataset_source", selected.dataset_source),
    ):
        if path:
            factory_params(selected, load_attribute(field, path))


def preflight(config: TrainingConfig, data_dir: str) -> Workload:
    """Resolve the workload and check ``config`` against the prepared data in ``data_dir``: what the drivers run
    before any worker starts, so user code that does not import, a model that does not fit the data or a bad
    field fails here, in seconds, naming the field."""
    from training_core.data.prepared import Manifest
    from training_core.train.lora import check_trainable

    workload = resolve_workload(config.workload)
    manifest = Manifest.load(data_dir)
    if manifest.workload != workload.name and manifest.workload in (*WORKLOADS, config.workload.name):
        raise ValueError(
            f"workload.name={quote(config.workload.name)} trains a {workload.name} workload, but the data at "
            f"{quote(data_dir)} was prepared by {manifest.workload!r}; prepare the data with the same workload"
        )
    check_pretrained_supported(config, workload)
    workload.check(config, manifest)
    check_trainable(config, manifest, workload)
    if config.scaling.strategy == "fsdp":
        from training_core.parallel.sharding import require_blocks

        require_blocks(config, manifest, workload)
    elif isinstance(workload, UserWorkload):  # an FSDP model is one too large for this process: built on meta above
        run_on_a_batch(config, manifest, workload)
    return workload


def check_pretrained_supported(config: TrainingConfig, workload: Workload) -> None:
    """``model.pretrained`` names weights only a workload that loads them may take: the image and sequence
    classification workloads and ``masked_lm`` (which check them in their ``check``) or user code (which reads
    ``config.model.pretrained`` as it likes, with :func:`training_core.pretrained.read_pretrained`); a built-in
    that would ignore them is refused."""
    loads = ("image_classification", "sequence_classification", "masked_lm")
    if config.model.pretrained and workload.name not in loads and workload.name in WORKLOADS:
        invalid(
            "model.pretrained",
            config.model.pretrained,
            f"workload {workload.name!r} does not load pretrained weights yet ({' and '.join(loads)} do); leave "
            "model.pretrained empty",
        )


def run_on_a_batch(config: TrainingConfig, manifest: Manifest, workload: UserWorkload) -> None:
    """Run a user workload once, in this process on the CPU, on one small batch of the prepared training split (at
    most :data:`PREFLIGHT_BATCH_SAMPLES` samples), as a worker's step and validation do: ``build_model``,
    ``to_device``, ``loss`` and ``eval_sums``, then ``metrics`` of the evaluation figures. An error of its code or a
    result that breaks the protocol (a ``loss`` that returns a float, a ``build_model`` that returns ``None``) raises
    :class:`~training_core.train.failures.UserCodeError` naming the field here, before any worker starts, rather than on
    every rank. No backward pass and no optimizer step: the batch costs the driver a forward or two."""
    import torch

    from training_core.data.prepared import ShardStream
    from training_core.eval_sums import evaluate

    cpu = torch.device("cpu")
    size = min(PREFLIGHT_BATCH_SAMPLES, config.loop.batch_size or PREFLIGHT_BATCH_SAMPLES)
    stream = ShardStream(manifest, "train", rank=0, world_size=1, data=config.data)
    with contextlib.closing(stream.eval_batches(batch_size=size)) as batches:
        arrays = next(batches)
    model = workload.build_model(config, manifest).train()
    to_device = workload.to_device(manifest, cpu)
    workload.loss(model, to_device(arrays))
    metrics = evaluate(model, [arrays], workload=workload, to_device=to_device, device=cpu).metrics
    missing = [name for name in ("loss", workload.primary_metric) if name not in metrics]
    if missing:
        workload.wrong(
            "metrics",
            metrics,
            f"which lacks {', '.join(map(repr, missing))} of the evaluation figures: it must have "
            "'loss' and the primary_metric",
        )


def code_paths(selected: WorkloadConfig) -> list[str]:
    """The ``sys.path`` entries the user modules ``selected`` names were imported from (after
    :func:`resolve_workload` imported them); empty for built-ins."""
    roots = []
    for path in (selected.name, selected.model_factory, selected.dataset_source):
        module_name = path.partition(":")[0]
        file = getattr(sys.modules.get(module_name), "__file__", None)
        if path and path not in WORKLOADS and file:
            depth = module_name.count(".") + (os.path.basename(file) == "__init__.py")
            roots.append(str(pathlib.Path(os.path.abspath(file)).parents[depth]))
    return list(dict.fromkeys(roots))
