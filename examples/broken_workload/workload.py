"""``Broken``: a first draft of a tabular workload that never got ``eval_sums`` or ``metrics``.

Naming it (``examples/broken_workload.yaml``) fails in the first task, in seconds and before any Ray worker
starts, with a message that names the missing methods:
``workload.name='examples.broken_workload.workload:Broken' is invalid: it returned a Broken,
which is not a workload: it lacks eval_sums(), metrics(); implement the training_core.workloads.Workload protocol``.
"""

from __future__ import annotations

from examples.tabular_mlp.workload import TabularMLP


class Broken:
    """Prepares data, builds a model and computes a loss, but cannot evaluate: no ``eval_sums``, no ``metrics``."""

    name = "broken"
    primary_metric = "accuracy"
    primary_mode = "max"

    def __init__(self) -> None:
        self._tabular = TabularMLP()

    def prepare_data(self, data, out_dir):
        return self._tabular.prepare_data(data, out_dir)

    def check(self, config, manifest):
        return None

    def build_model(self, config, manifest):
        return self._tabular.build_model(config, manifest)

    def to_device(self, manifest, device):
        return self._tabular.to_device(manifest, device)

    def loss(self, model, batch):
        return self._tabular.loss(model, batch)

    def example_input(self, manifest):
        return self._tabular.example_input(manifest)
