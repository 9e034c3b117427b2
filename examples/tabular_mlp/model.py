"""The model: an MLP classifier that standardises its raw input features itself.

The training split's per-feature mean and standard deviation are buffers of the model, so the model the pipeline
registers in MLflow takes raw rows of the table (what a caller has), not pre-scaled ones.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class MLPClassifier(nn.Module):
    """``(x - mean) / std`` -> ``num_layers`` x (Linear, ReLU, Dropout) -> Linear to ``num_classes`` logits."""

    def __init__(
        self,
        *,
        mean: Sequence[float],
        std: Sequence[float],
        num_classes: int,
        hidden_size: int = 64,
        num_layers: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(list(mean), dtype=torch.float32))
        self.register_buffer("std", torch.tensor(list(std), dtype=torch.float32))
        layers: list[nn.Module] = []
        width = len(mean)
        for _ in range(num_layers):
            layers += [nn.Linear(width, hidden_size), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden_size
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net((features.float() - self.mean) / self.std)
