"""The GPU fast path's settings take effect on a GPU and stand aside on CPU (each test's ``cpu`` case is its CPU
twin, run everywhere; the ``cuda`` case runs where a GPU is present)."""

from __future__ import annotations

import pytest
import torch

from training_core.config import OptimizerConfig
from training_core.models import build_model
from training_core.parallel import sharding
from training_core.train.optim import build_optimizer

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine")),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_optimizer_fused_uses_the_fused_kernel_on_a_gpu_only(device, name):
    model = build_model("small_cnn", num_classes=10, input_shape=(1, 8, 8)).to(device)
    fused = build_optimizer(OptimizerConfig(name=name, fused=True), model.parameters())
    assert bool(fused.defaults.get("fused")) == (device == "cuda")
    plain = build_optimizer(OptimizerConfig(name=name, fused=False), model.parameters())
    assert not plain.defaults.get("fused")
    model(torch.randn(4, 1, 8, 8, device=device)).sum().backward()
    fused.step()  # the kernel runs on its device


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_inputs_change_the_layout_of_image_batches_only(device):
    images, labels = torch.randn(4, 3, 8, 8, device=device), torch.arange(4, device=device)
    tokens = torch.randint(0, 9, (4, 8, 8, 3), device=device)  # 4-D but not floating point: left alone
    inputs, targets, ids = sharding.channels_last_inputs(lambda batch: batch)((images, labels, tokens))
    assert inputs.is_contiguous(memory_format=torch.channels_last) and torch.equal(inputs, images)
    assert targets is labels and ids is tokens
    model = build_model("resnet18", num_classes=10, input_shape=(3, 8, 8)).to(device)
    assert sharding.has_conv2d(model) and not sharding.has_conv2d(torch.nn.Linear(2, 2))
    model = model.to(memory_format=torch.channels_last)
    torch.testing.assert_close(model(inputs), model(images))  # the same numbers in either layout
