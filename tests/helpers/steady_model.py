"""A user model (``workload.model_factory``) whose every forward lasts a set time: a run whose step and validation
times a loaded test machine does not blur, for checking the ETA against the run's real end."""

from __future__ import annotations

import math
import time

import torch

TRAIN_FORWARD_S = 0.04
EVAL_FORWARD_S = 0.1
"""Longer than a step's, so that a run's validations weigh nearly half of its time."""


class SteadyModel(torch.nn.Module):
    """A linear classifier whose forward sleeps first: ``TRAIN_FORWARD_S`` in training, ``EVAL_FORWARD_S`` in eval."""

    def __init__(self, num_inputs: int, num_classes: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(num_inputs, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(TRAIN_FORWARD_S if self.training else EVAL_FORWARD_S)
        return self.linear(x.flatten(1))


def build(config, manifest) -> torch.nn.Module:
    return SteadyModel(math.prod(manifest.input_shape), len(manifest.classes))
