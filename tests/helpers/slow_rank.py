"""A user model (``workload.model_factory``) whose forward sleeps on one rank: a straggler on real processes."""

from __future__ import annotations

import math
import os
import time

import torch

SLOW_RANK_ENV = "TEST_SLOW_RANK"
"""The rank whose forward sleeps (unset: none)."""
SLOW_FORWARD_S = 0.03


class SlowOnOneRank(torch.nn.Module):
    """A linear classifier; on the rank ``TEST_SLOW_RANK`` names, each forward sleeps ``SLOW_FORWARD_S`` first."""

    def __init__(self, num_inputs: int, num_classes: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(num_inputs, num_classes)
        slow = os.environ.get(SLOW_RANK_ENV)
        self.sleeps = (
            slow is not None and torch.distributed.is_initialized() and torch.distributed.get_rank() == int(slow)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleeps and self.training:
            time.sleep(SLOW_FORWARD_S)
        return self.linear(x.flatten(1))


def build(config, manifest) -> torch.nn.Module:
    return SlowOnOneRank(math.prod(manifest.input_shape), len(manifest.classes))
