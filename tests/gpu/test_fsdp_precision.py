"""FSDP2's mixed precision as the loop uses it (``precision.mode: bf16`` or ``fp16`` under ``scaling.strategy:
fsdp``): bf16 or fp16 parameters for compute, fp32 gradient reduction, fp32 master weights, and under fp16 a GradScaler
whose overflow check agrees across ranks. The ``cpu`` case is the CPU twin (gloo); the ``cuda`` case runs where a GPU
is present (nccl)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from training_core.parallel import sharding
from training_core.train.loop import train_step
from training_core.workloads.protocol import classification_loss

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
            loss_fn=classification_loss,
        )
    # The optimizer updates fp32 master weights: the sharded parameters stay fp32.
    assert all(sharding.local_tensor(p).dtype == torch.float32 for p in sharded_model.parameters())
    assert results["bf16"].loss.dtype == torch.float32 and torch.isfinite(results["bf16"].grad_norm)
    # Computed in bf16 (not bit-equal to fp32), within bf16's precision of it.
    assert not torch.equal(results["bf16"].loss, results["fp32"].loss)
    torch.testing.assert_close(results["bf16"].loss, results["fp32"].loss, rtol=2e-2, atol=2e-2)
    for (name, got), want in zip(sharded_model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(sharding.full_tensor(got.detach()), want.detach(), rtol=0, atol=2e-2, msg=name)


def _fp16_rank(rank: int, world_size: int, device_name: str, out: str) -> None:
    """One rank of the fp16 test: a step that overflows (the last rank's inputs alone overflow fp16), then a normal
    one."""
    device = torch.device(device_name, rank) if device_name == "cuda" else torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{out}/pg", rank=rank, world_size=world_size)
    model = _mlp()
    blocks = [model[0], model[2]]
    model = sharding.shard_model(model, blocks, device=device, param_dtype=torch.float16, cpu_offload=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16)
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(8, 32, generator=generator).to(device)
    targets = torch.randint(0, 10, (8,), generator=generator).to(device)
    record = {}
    for name, scale in (("overflow", 1e4 if rank == world_size - 1 else 1.0), ("normal", 1.0)):
        before = [sharding.local_tensor(p).detach().clone() for p in model.parameters()]
        result = train_step(
            model=model, optimizer=optimizer, scaler=scaler, micro_batches=[(inputs * scale, targets)],
            autocast_dtype=torch.float16, max_grad_norm=0.0, loss_fn=classification_loss,
        )  # fmt: skip
        after = [sharding.local_tensor(p).detach() for p in model.parameters()]
        record[name] = {
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
            "scale": scaler.get_scale(),
            "loss": result.loss.item(),
            "dtypes": sorted({str(p.dtype) for p in after}),
        }
    record["weights"] = {n: sharding.full_tensor(p.detach()).cpu().tolist() for n, p in model.named_parameters()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_with_a_grad_scaler_skips_an_overflow_on_one_rank_on_every_rank_then_trains_like_fp32(device, tmp_path):
    """The GradScaler checks each rank's gradient shards for overflow; DTensor all-reduces the flag, so an overflow on
    one rank makes every rank skip the step and halve its scale. The next step trains like fp32 on the union of the
    ranks' batches (within fp16's precision)."""
    world_size = 2 if device == "cpu" else min(torch.cuda.device_count(), 2)
    mp.spawn(_fp16_rank, args=(world_size, device, str(tmp_path)), nprocs=world_size)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    for record in records:
        assert record["overflow"]["unchanged"] and record["overflow"]["scale"] == 2.0**15
        assert not record["normal"]["unchanged"] and record["normal"]["scale"] == 2.0**15
        assert record["normal"]["dtypes"] == ["torch.float32"], "the optimizer updates fp32 master shards"
        assert record["weights"] == records[0]["weights"]

    reference = _mlp()
    batches = []
    for rank in range(world_size):
        generator = torch.Generator().manual_seed(rank)
        batches.append((torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)))
    inputs, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.cross_entropy(reference(inputs), targets).backward()
    optimizer.step()
    for name, want in reference.named_parameters():
        got = torch.tensor(records[0]["weights"][name])
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=2e-2, msg=name)
