"""``image_classification``: the image models of :mod:`training_core.models` (or a user's) on the image sources of
:mod:`training_core.data.sources` (or a user's), trained with cross-entropy; accuracy is the primary metric."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from training_core.config import DataConfig, TrainingConfig, WorkloadConfig
from training_core.data.prepared import Manifest, split_samples, write_prepared
from training_core.messages import invalid, quote
from training_core.registry import DATASET_SOURCES
from training_core.workloads.protocol import (
    Classifier,
    check_prepared_by,
    classification_sums,
    mean_of,
    to_device_async,
)
from training_core.workloads.user_code import call_configured, load_optional, raised

if TYPE_CHECKING:
    import torch
    from torch import nn


class ImageClassification(Classifier):
    """Images in, class logits out. ``model_factory(config, manifest)`` and ``dataset_source(data)`` (returning
    a :class:`~training_core.data.sources.RawDataset`) replace the built-in model and dataset; either is also given
    ``params=`` (``workload.params``, typed by its ``params_type`` if it declares one) when it has that parameter."""

    name = "image_classification"
    primary_metric = "accuracy"
    primary_mode = "max"
    loads_pretrained_sharded = True
    """Under FSDP each rank reads only its shards' rows of ``model.pretrained`` (the file's names are the model's)."""

    def __init__(self, selected: WorkloadConfig | None = None) -> None:
        selected = self.selected = selected or WorkloadConfig()
        self.model_factory = load_optional("workload.model_factory", selected.model_factory)
        self.dataset_source = load_optional("workload.dataset_source", selected.dataset_source)

    def prepare_data(self, data: DataConfig, out_dir: str) -> Manifest:
        from training_core.data.sources import RawDataset, load_raw, resize_images

        if self.dataset_source is None and DATASET_SOURCES[data.dataset].list_images:
            return self.prepare_encoded(data, out_dir)
        if self.dataset_source is None:
            raw, source = load_raw(data), f"data.dataset={data.dataset!r}"
        else:
            source = f"workload.dataset_source={quote(self.selected.dataset_source)}"
            raw = call_configured(self.selected, "dataset_source", self.dataset_source, data)
            if not isinstance(raw, RawDataset):
                raise ValueError(
                    f"{source} returned a {type(raw).__name__}; it must return a training_core.data.sources.RawDataset "
                    "(uint8 images N x C x H x W and int64 labels per split, and the class names); for other arrays, a "
                    "PyTorch Dataset or a Hugging Face datasets.Dataset, set workload.name to array_classification "
                    "(or array_regression)"
                )
            if data.image_size:  # what a resize reads checked first; the shapes agree after it
                raw.check(source, one_shape=False)
                raw.splits = {name: (resize_images(x, data.image_size), y) for name, (x, y) in raw.splits.items()}
            raw.check(source)
        splits = split_samples(
            {name: {"images": x, "labels": y} for name, (x, y) in raw.splits.items()}, data, source=source
        )
        train = splits["train"]["images"]
        scaled = train.astype(np.float64) / 255.0
        template = Manifest(  # arrays: left empty, the Manifest's image arrays
            dataset=self.selected.dataset_source or data.dataset,
            classes=raw.classes,
            input_shape=list(train.shape[1:]),
            mean=scaled.mean(axis=(0, 2, 3)).tolist(),
            std=np.maximum(scaled.std(axis=(0, 2, 3)), 1e-6).tolist(),
            splits={},
            workload=self.name,
        )
        return write_prepared(out_dir, splits, template=template, num_shards=data.num_shards)

    def prepare_encoded(self, cfg: DataConfig, out_dir: str) -> Manifest:
        """An image folder or the CIFAR-10 tarball as Parquet shards of encoded images (Ray tasks)."""
        from dataclasses import asdict

        from training_core.data.image_shards import prepare_images
        from training_core.data.prepared import ShardInfo, SplitInfo, write_manifest

        prep = prepare_images(cfg, out_dir)
        size = cfg.image_size or 32
        splits: dict[str, SplitInfo] = {}
        for result in prep.results:
            split = splits.setdefault(result.split, SplitInfo(num_samples=0, shards=[]))
            split.num_samples += result.num_samples
            split.shards.append(
                ShardInfo(
                    file=result.file,
                    num_samples=result.num_samples,
                    sha256=result.sha256,
                    bounds={"labels": result.label_range},
                )
            )
        manifest = Manifest(
            dataset=cfg.dataset,
            classes=prep.classes,
            input_shape=[3, size, size],
            mean=prep.mean,
            std=prep.std,
            splits=splits,
            workload=self.name,
            spec={
                "statistics": f"exact, over every training image at {size}x{size}",
                "left_out": asdict(prep.left_out),
                "reencoded": {"count": prep.num_reencoded, "examples": prep.reencoded_examples},
            },
            format="parquet",
            bad_samples={"count": prep.num_bad, "examples": prep.bad_examples},
            directory=out_dir,
        )
        write_manifest(manifest)
        return manifest

    def check(self, config: TrainingConfig, manifest: Manifest) -> None:
        check_prepared_by(self.name, "images", manifest, len(manifest.input_shape) == 3)
        if self.model_factory is not None:
            check_user_model(config, manifest, self.model_factory, self.example_input(manifest))
        if config.model.pretrained:
            self.check_pretrained(config, manifest)

    def check_pretrained(self, config: TrainingConfig, manifest: Manifest) -> None:
        """Read ``model.pretrained`` and match it against the model (built on the meta device, so without its
        memory): bad weights or names and shapes that do not fit fail here, before any worker starts, and the
        weights' sha256 is recorded in ``config.model.pretrained_sha256`` (:func:`~training_core.pretrained.
        check_weights`), so the workers verify that they read the same weights and the MLflow params name them."""
        import torch

        from training_core.pretrained import check_weights

        try:
            with torch.device("meta"):
                model = self.new_model(config, manifest)
        except Exception:  # noqa: BLE001 - a user's model whose construction needs real tensors: built on CPU
            model = self.new_model(config, manifest)
        check_weights(config, model)

    def build_model(self, config: TrainingConfig, manifest: Manifest) -> nn.Module:
        """The model, with the ``model.pretrained`` weights loaded when there are some (not into a model on the
        meta device, which holds no values: under FSDP each rank reads its shards' rows after sharding,
        ``loads_pretrained_sharded``). A resumed run's checkpoint is restored over them afterwards."""
        from training_core.pretrained import load_pretrained

        model = self.new_model(config, manifest)
        load_pretrained(model, config.model, seed=config.loop.seed)
        return model

    def new_model(self, config: TrainingConfig, manifest: Manifest) -> nn.Module:
        """The model ``workload.model_factory`` or ``model.name`` builds, randomly initialised."""
        if self.model_factory is not None:
            return user_model(config, manifest, self.model_factory)
        from training_core.models import build_model

        return build_model(config.model.name, num_classes=manifest.num_classes, input_shape=manifest.input_shape)

    def to_device(self, manifest: Manifest, device: torch.device) -> Callable[[Mapping[str, np.ndarray]], Any]:
        return Normalizer(manifest, device)

    def eval_sums(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        logits = model(inputs).float()
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        correct_top5 = (top == targets[:, None]).any(dim=1).sum()
        return classification_sums(logits, targets, predicted=top[:, 0]) | {"correct_top5": correct_top5}

    def metrics(self, sums: Mapping[str, Any]) -> dict[str, float]:
        found = super().metrics(sums)
        if "loss_sum" in sums:
            found["top5_accuracy"] = mean_of(sums, "correct_top5", "samples")
        return found

    def example_input(self, manifest: Manifest) -> np.ndarray:
        return np.zeros((2, *manifest.input_shape), dtype=np.float32)


def user_model(config: TrainingConfig, manifest: Manifest, factory: Callable[..., Any]) -> nn.Module:
    """The model ``workload.model_factory`` builds, checked to be a ``torch.nn.Module``."""
    from torch import nn

    model = call_configured(config.workload, "model_factory", factory, config, manifest)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"workload.model_factory={quote(config.workload.model_factory)} returned a {type(model).__name__}; it "
            "must return a torch.nn.Module"
        )
    return model


def check_user_model(
    config: TrainingConfig, manifest: Manifest, factory: Callable[..., Any], example: np.ndarray
) -> None:
    """Build the ``workload.model_factory`` model once and run ``example`` through it, so a factory that fails,
    returns no ``torch.nn.Module`` or builds a model that does not fit the data fails in the driver (preflight),
    before any worker starts, rather than in every worker."""
    model = user_model(config, manifest, factory)
    built, batch, expected = type(model).__name__, tuple(example.shape), (len(example), manifest.num_classes)
    found = example_output(model, example)
    if found == expected:
        return
    if isinstance(found, Exception):
        problem = (
            f"it built a {built} that fails on a batch of inputs {batch} ({raised(found)}); build a model for "
            f"inputs of shape {manifest.input_shape}"
        )
    else:
        problem = (
            f"it built a {built} whose output on a batch of inputs {batch} is {found}; it must be logits of shape "
            f"{expected} (batch, the data's {manifest.num_classes} classes)"
        )
    invalid("workload.model_factory", config.workload.model_factory, problem)


def example_output(model: nn.Module, example: np.ndarray) -> tuple[int, ...] | str | Exception:
    """What ``model``, in eval mode and without grad, makes of ``example``: the output's shape, the type name of an
    output that is no tensor, or what the model raised (user code: the caller names it)."""
    import torch

    try:
        with torch.no_grad():
            output = model.eval()(torch.from_numpy(example))
    except Exception as exc:  # noqa: BLE001 - user code: returned for the caller's message
        return exc
    return tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__


class Normalizer:
    """Stored uint8 images and int64 labels -> normalised float images and labels on the device."""

    def __init__(self, manifest: Manifest, device: torch.device) -> None:
        import torch

        self.device = device
        self.mean = torch.tensor(manifest.mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(manifest.std, device=device).view(1, -1, 1, 1)

    def __call__(self, batch: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        x = to_device_async(batch["images"], self.device).float().div_(255.0)
        y = to_device_async(batch["labels"], self.device)
        return (x - self.mean) / self.std, y
