"""``loop.batch_size: auto`` and ``loop.oom_policy: reduce`` on a real GPU. The CPU twins are in
tests/unit/test_batch_size.py (the probes) and tests/unit/test_run_worker.py (an out-of-memory step retried)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from training_core.config import OptimizerConfig
from training_core.models import build_model
from training_core.train import batch_size
from training_core.train.optim import build_optimizer
from training_core.workloads.protocol import classification_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine")


def _step_peak_bytes(model: torch.nn.Module, samples: int) -> int:
    """The peak of the step the probe predicts: forward, backward and the optimizer's step (plain SGD, fused: the
    loop's default on a GPU)."""
    optimizer = build_optimizer(OptimizerConfig(name="sgd", momentum=0.0, fused=True), list(model.parameters()))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    inputs = torch.randn(samples, 3, 32, 32, device="cuda")
    classification_loss(model, (inputs, torch.randint(0, 10, (samples,), device="cuda"))).loss.backward()
    optimizer.step()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated()


def _measured_resnet() -> tuple[torch.nn.Module, int, int]:
    """A ResNet-18 on the GPU, and its step's fixed memory and memory per sample as the loop measures them."""
    model = build_model("resnet18", num_classes=10, input_shape=(3, 32, 32)).cuda()
    probes = tuple(
        (torch.randn(n, 3, 32, 32, device="cuda"), torch.randint(0, 10, (n,), device="cuda")) for n in (1, 2)
    )
    fixed, per_sample = batch_size.measure(
        model, classification_loss, probes, device=torch.device("cuda"), optimizer_name="sgd", momentum=0.0,
        no_sync=lambda m: contextlib.nullcontext(), fused=True,
    )  # fmt: skip
    return model, fixed, per_sample


def test_the_cuda_probe_predicts_the_peak_of_a_larger_step():
    model, fixed, per_sample = _measured_resnet()
    for samples in (16, 64):
        actual = _step_peak_bytes(model, samples)
        predicted = fixed + per_sample * samples
        assert abs(predicted - actual) / actual < 0.25, (samples, predicted, actual)


def test_a_plan_from_the_probe_trains_without_running_out_of_memory():
    model, fixed, per_sample = _measured_resnet()
    # A budget of a quarter of what a 1024-sample step needs above the fixed part: the plan must split it.
    budget = fixed + per_sample * 256
    plan = batch_size.plan_micro_batch(1024, fixed_bytes=fixed, bytes_per_sample=per_sample, budget_bytes=budget)
    assert plan.micro_batch_size == 256 and plan.grad_accum_steps == 4
    assert _step_peak_bytes(model, plan.micro_batch_size) <= 1.25 * budget
