"""``SignalCNN``: a 1D-CNN that tells sine, square and sawtooth waves apart, in a few lines of platform glue.

The data is a float32 ``.npz`` (``inputs`` [N, 1, 128], ``targets`` the wave names), made by ``make_data.py``;
:class:`~training_core.workloads.simple.ArrayClassification` prepares, splits, shards, trains and evaluates it
(cross-entropy, accuracy and macro-F1). ``workload.params.kernel_size`` and ``channels`` shape the model.
"""

from dataclasses import dataclass

from torch import nn

from training_core.workloads.simple import ArrayClassification


@dataclass
class SignalParams:
    kernel_size: int = 5
    channels: int = 16


class SignalCNN(ArrayClassification):
    name = "signal_cnn"
    params_type = SignalParams

    def build_model(self, config, manifest):
        k, c = self.params.kernel_size, self.params.channels
        return nn.Sequential(
            nn.Conv1d(manifest.input_shape[0], c, k, padding=k // 2),
            nn.ReLU(),
            nn.Conv1d(c, c, k, padding=k // 2),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
            nn.Linear(c, manifest.num_classes),
        )
