"""The training loop's runtime for one rank in the test's own process (what Ray Train gives each worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class InProcessRuntime:
    """The loop's runtime for a single rank in the calling process (what Ray Train gives each worker)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    reports: list[dict[str, float]] = field(default_factory=list)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)

    def report(self, metrics: dict[str, float]) -> None:
        self.reports.append(metrics)


@dataclass
class StartRecorder(InProcessRuntime):
    """Also records the weights the loop hands to the runtime: the model's state before its first step."""

    initial: dict[str, torch.Tensor] = field(default_factory=dict)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        self.initial = {key: value.clone() for key, value in model.state_dict().items()}
        return super().prepare_model(model)
