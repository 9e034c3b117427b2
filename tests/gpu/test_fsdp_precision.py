"""FSDP2's mixed precision as the loop uses it (``precision.mode: bf16`` under ``scaling.strategy: fsdp``): bf16
parameters for compute, fp32 gradient reduction, fp32 master weights. The ``cpu`` case is the CPU twin (gloo); the
``cuda`` case runs where a GPU is present (nccl)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from training_core import sharding
from training_core.loop import train_step

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine")),
]


@pytest.fixture
def process_group(tmp_path):
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_compute_with_fp32_reduction_keeps_fp32_weights_and_trains_like_fp32(device, process_group):
    device = torch.device(device)
    reference = _mlp().to(device)
    sharded_model = copy.deepcopy(reference)
    blocks = [sharded_model[0], sharded_model[2]]
    sharded_model = sharding.shard_model(
        sharded_model, blocks, device=device, param_dtype=torch.bfloat16, cpu_offload=False
    )
    inputs, targets = torch.randn(16, 32, device=device), torch.randint(0, 10, (16,), device=device)
    results = {}
    for name, model, dtype in (("fp32", reference, None), ("bf16", sharded_model, torch.bfloat16)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        results[name] = train_step(
            model=model,
            optimizer=optimizer,
            scaler=torch.amp.GradScaler(device.type, enabled=False),
            micro_batches=[(inputs, targets)],
            autocast_dtype=dtype,
            max_grad_norm=1.0,
        )
    # The optimizer updates fp32 master weights: the sharded parameters stay fp32.
    assert all(sharding.local_tensor(p).dtype == torch.float32 for p in sharded_model.parameters())
    assert results["bf16"].loss.dtype == torch.float32 and torch.isfinite(results["bf16"].grad_norm)
    # Computed in bf16 (not bit-equal to fp32), within bf16's precision of it.
    assert not torch.equal(results["bf16"].loss, results["fp32"].loss)
    torch.testing.assert_close(results["bf16"].loss, results["fp32"].loss, rtol=2e-2, atol=2e-2)
    for (name, got), want in zip(sharded_model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(sharding.full_tensor(got.detach()), want.detach(), rtol=0, atol=2e-2, msg=name)
