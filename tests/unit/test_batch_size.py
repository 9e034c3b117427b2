"""``loop.batch_size: auto``: the plan from measured memory, and probes that leave the model as they found it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from training_core import batch_size
from training_core.config import TrainingConfig
from training_core.models import build_model
from training_core.workloads.image import classification_loss


def test_the_plan_is_the_largest_divisor_of_the_workers_share_that_fits():
    plan = batch_size.plan_micro_batch(96, fixed_bytes=1000, bytes_per_sample=10, budget_bytes=1500)
    assert (plan.micro_batch_size, plan.grad_accum_steps) == (48, 2)  # 50 would fit, but does not divide 96
    assert plan.predicted_bytes(48) == 1480 <= plan.budget_bytes
    whole = batch_size.plan_micro_batch(96, fixed_bytes=0, bytes_per_sample=1, budget_bytes=10**6)
    assert (whole.micro_batch_size, whole.grad_accum_steps) == (96, 1)


def test_a_budget_below_one_sample_names_the_setting_and_the_ways_out():
    with pytest.raises(ValueError, match=r"loop.memory_budget_gib=0.00: raise it, shard the model"):
        batch_size.plan_micro_batch(32, fixed_bytes=2**20, bytes_per_sample=1, budget_bytes=2**19)


def test_probes_grow_with_the_batch_and_leave_batchnorm_statistics_and_the_rng_as_they_were():
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=10, input_shape=(3, 16, 16))
    batches = tuple((torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,))) for n in (1, 2))
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    fixed, per_sample = batch_size.measure(
        model, classification_loss, batches, device=torch.device("cpu"), optimizer_name="sgd", momentum=0.9,
        no_sync=lambda m: contextlib.nullcontext(),
    )  # fmt: skip
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert fixed == 3 * weights  # weights, gradients, momentum
    # ResNet-18 at 16 px saves a few hundred KB of activations per sample: far more than the head's inputs.
    assert 100_000 < per_sample < 20_000_000
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("loop", "field", "fix"),
    [
        ({"batch_size": "auto"}, "loop.batch_size=0", "set loop.global_batch_size"),
        ({"batch_size": "auto", "global_batch_size": 64, "grad_accum_steps": 2}, "loop.grad_accum_steps=2", "leave it"),
        ({"batch_size": 16, "global_batch_size": 64}, "loop.global_batch_size=64", "16 * 1 * 2 = 32"),
        ({"batch_size": "auto", "global_batch_size": 63}, "loop.global_batch_size=63", "a multiple of 2"),
        ({"oom_policy": "ignore"}, "loop.oom_policy='ignore'", "fail, reduce"),
    ],
)
def test_auto_batch_settings_that_cannot_hold_name_the_field_and_the_fix(loop, field, fix):
    with pytest.raises(ValueError) as excinfo:
        TrainingConfig.from_dict({"loop": loop})
    assert field in str(excinfo.value) and fix in str(excinfo.value)


def test_auto_is_stored_as_zero_and_round_trips():
    cfg = TrainingConfig.from_dict({"loop": {"batch_size": "auto", "global_batch_size": 64}})
    assert cfg.loop.batch_size == 0
    assert TrainingConfig.from_dict(cfg.to_dict()).loop.batch_size == 0
