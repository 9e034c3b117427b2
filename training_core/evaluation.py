"""Test-split evaluation of a checkpoint, in one process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalReport:
    split: str
    num_samples: int
    loss: float
    accuracy: float
    top5_accuracy: float
    confusion: list[list[int]]
    """``confusion[true][predicted]`` counts."""
    classes: list[str]


def evaluate_checkpoint(
    checkpoint_dir: str, data_dir: str, *, split: str = "test", batch_size: int = 256
) -> EvalReport:
    import torch

    from training_core.checkpoint import load_model
    from training_core.data import Manifest, ShardStream
    from training_core.loop import Normalizer, evaluate

    manifest = Manifest.load(data_dir)
    if split not in manifest.splits:
        raise ValueError(f"split={split!r} is invalid: the prepared data has {', '.join(manifest.splits)}")
    model, meta = load_model(checkpoint_dir)
    if meta.classes != manifest.classes or list(meta.input_shape) != list(manifest.input_shape):
        raise ValueError(
            f"checkpoint {checkpoint_dir} was trained on classes {meta.classes} and input {meta.input_shape}, "
            f"but the data at {data_dir} has {manifest.classes} and {manifest.input_shape}; evaluate on matching data"
        )
    device = torch.device("cpu")
    stream = ShardStream(manifest, split, rank=0, world_size=1)
    sums = evaluate(
        model,
        stream.eval_batches(batch_size=batch_size),
        normalize=Normalizer(manifest, device),
        num_classes=manifest.num_classes,
    )
    return EvalReport(
        split=split,
        num_samples=sums.num_samples,
        loss=sums.loss,
        accuracy=sums.accuracy,
        top5_accuracy=sums.top5_accuracy,
        confusion=sums.confusion.tolist(),
        classes=manifest.classes,
    )
