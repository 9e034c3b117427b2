"""DDP's gradient buckets as the config asks for them, in a real one-process gloo group."""

import pytest
import torch
from torch import nn

from training_core.config import ScalingConfig
from training_core.parallel.distributed import ddp_options

MIB = 2**20


def bucket_sizes_mib(scaling: ScalingConfig) -> list[float]:
    """The sizes of the buckets DDP all-reduces, in launch order, once it has rebuilt them after the first
    backward pass (as it does in training), read by a communication hook."""
    torch.manual_seed(0)
    # Eight 256 KiB layers: 2 MiB of gradients, ready last layer first in the backward pass.
    model = nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(8)))
    ddp = nn.parallel.DistributedDataParallel(model, **ddp_options(scaling))
    sizes: list[float] = []

    def record(state, bucket):
        sizes.append(bucket.buffer().numel() * 4 / MIB)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, record)
    for _ in range(2):
        sizes.clear()
        ddp(torch.randn(4, 256)).sum().backward()
    return sizes


def test_the_default_bucket_size_keeps_pytorchs_small_first_bucket(process_group):
    """At the default ``scaling.ddp_bucket_cap_mb`` the first all-reduce starts once 1 MiB of the last layers'
    gradients is ready, as with PyTorch's own default: passing the default size explicitly made the first bucket
    25 MiB, and here the first all-reduce waited for the whole model's gradients."""
    assert bucket_sizes_mib(ScalingConfig()) == pytest.approx([1.0, 1.0])
    # A size of one's own caps every bucket, the first too (PyTorch's rule).
    assert bucket_sizes_mib(ScalingConfig(ddp_bucket_cap_mb=2)) == pytest.approx([2.0])
    assert "bucket_cap_mb" not in ddp_options(ScalingConfig())
    assert ddp_options(ScalingConfig(ddp_bucket_cap_mb=50))["bucket_cap_mb"] == 50
