"""``DigitsCNN``: a user workload with its own hyperparameters (``workload.params``) and its own primary metric.

It is the built-in ``image_classification`` workload (digits, cross-entropy) with two changes: the model is a small
CNN shaped by :class:`CNNParams` (``workload.params.kernel_size`` and ``workload.params.channels``), and the primary
metric is macro-F1 over the classes, so ``tuning.metric: val_f1`` ranks trials by it (``max``, its
``primary_mode``). ``params_type`` makes the platform check ``workload.params`` against the dataclass (names, types
and its ``__post_init__``) before any worker starts; the workload then reads ``self.params``, a ``CNNParams``.

Train it with ``examples/cnn_params.yaml``; search its kernel size and learning rate with
``examples/cnn_params_tuning.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from torch import nn

from training_core.workloads.image import ImageClassification


@dataclass
class CNNParams:
    """The CNN's hyperparameters: ``workload.params`` in the config."""

    kernel_size: int = 3
    """Side of the convolution kernels: odd, so padding keeps the image size."""
    channels: int = 16
    """Feature maps of each convolution."""

    def __post_init__(self) -> None:
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size={self.kernel_size} must be an odd number >= 1, e.g. 3 or 5")
        if not 1 <= self.channels <= 512:
            raise ValueError(f"channels={self.channels} must be in [1, 512]")


class DigitsCNN(ImageClassification):
    """Digits (or any ``data.dataset`` of the image workload) through a CNN of :class:`CNNParams`; macro-F1 ranks."""

    params_type = CNNParams
    primary_metric = "f1"
    params: CNNParams  # set by the platform from workload.params

    def build_model(self, config: Any, manifest: Any) -> nn.Module:
        size, channels = self.params.kernel_size, self.params.channels
        return nn.Sequential(
            nn.Conv2d(manifest.input_shape[0], channels, size, padding=size // 2),
            nn.ReLU(),
            nn.Conv2d(channels, channels, size, padding=size // 2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(channels, manifest.num_classes),
        )

    def metrics(self, sums: Mapping[str, Any]) -> dict[str, float]:
        found = super().metrics(sums)
        if "confusion" in sums:  # evaluation figures: rows are true classes, columns predicted ones
            found["f1"] = macro_f1(sums["confusion"])
        return found


def macro_f1(confusion: Any) -> float:
    """The mean over classes of ``2 * tp / (2 * tp + fp + fn)``; a class never true nor predicted counts as 1."""
    counts = np.asarray(confusion, dtype=np.float64)  # summed figures reach metrics() as arrays on the host
    true_positives = counts.diagonal()
    denominators = counts.sum(axis=0) + counts.sum(axis=1)
    scores = np.where(denominators > 0, 2 * true_positives / np.maximum(denominators, 1), 1.0)
    return float(scores.mean())
