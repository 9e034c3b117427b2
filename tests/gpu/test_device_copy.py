"""Batches reach the device through pinned host memory on a GPU (an asynchronous copy) and as they are on a CPU.

Each test runs on ``cpu`` (its CPU twin, always) and on ``cuda`` where a GPU is present."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training_core.data import ArraySpec, Manifest
from training_core.workloads import to_device_async
from training_core.workloads.causal_lm import TokenBatcher
from training_core.workloads.image import Normalizer

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_arrives_on_the_device_with_its_values(device):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(8, 3, 16, 16), dtype=np.uint8)
    labels = rng.integers(0, 10, size=8)
    manifest = Manifest(
        dataset="synthetic",
        classes=[str(i) for i in range(10)],
        input_shape=[3, 16, 16],
        mean=[0.5, 0.4, 0.3],
        std=[0.2, 0.25, 0.3],
        splits={},
        arrays={"images": ArraySpec("uint8", [3, 16, 16]), "labels": ArraySpec("int64", [])},
    )
    x, y = Normalizer(manifest, torch.device(device))({"images": images, "labels": labels})
    assert x.device.type == y.device.type == device and x.dtype == torch.float32
    mean = torch.tensor(manifest.mean).view(1, -1, 1, 1)
    std = torch.tensor(manifest.std).view(1, -1, 1, 1)
    expected = (torch.from_numpy(images).float() / 255.0 - mean) / std
    torch.testing.assert_close(x.cpu(), expected)
    assert torch.equal(y.cpu(), torch.from_numpy(labels))

    tokens = rng.integers(0, 50_000, size=(4, 17), dtype=np.int32)
    inputs, targets = TokenBatcher(torch.device(device))({"tokens": tokens})
    assert inputs.dtype == torch.int64 and inputs.device.type == device
    assert torch.equal(inputs.cpu(), torch.from_numpy(tokens[:, :-1]).long())
    assert torch.equal(targets.cpu(), torch.from_numpy(tokens[:, 1:]).long())


@pytest.mark.parametrize("device", DEVICES)
def test_the_host_copy_is_pinned_only_for_a_gpu(device, monkeypatch):
    pinned = []
    original = torch.Tensor.pin_memory

    def recording_pin(self, *args, **kwargs):
        pinned.append(self.shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", recording_pin)
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = to_device_async(array, torch.device(device))
    assert torch.equal(out.cpu(), torch.from_numpy(array))
    assert pinned == ([torch.Size([3, 4])] if device == "cuda" else [])
