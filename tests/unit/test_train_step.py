import copy
import math

import pytest
import torch

from training_core.config import OptimizerConfig, ScheduleConfig
from training_core.loop import resolve_precision, train_step
from training_core.models import build_model
from training_core.optim import build_optimizer, lr_factor


def _setup(optimizer_name: str):
    torch.manual_seed(0)
    # float64 keeps reordering error ~1e-15, so the comparisons below can be strict.
    model = build_model("small_cnn", num_classes=10, input_shape=(1, 8, 8)).double()
    optimizer = build_optimizer(OptimizerConfig(name=optimizer_name, lr=0.05, max_grad_norm=0.5), model.parameters())
    return model, optimizer, torch.amp.GradScaler("cpu", enabled=False)


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
@pytest.mark.parametrize("num_micro", [2, 4])
def test_accumulating_k_micro_batches_equals_one_batch_k_times_larger(optimizer_name, num_micro):
    torch.manual_seed(1)
    inputs, targets = torch.randn(16, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (16,))
    model_a, opt_a, scaler_a = _setup(optimizer_name)
    model_b, opt_b, scaler_b = _setup(optimizer_name)
    for _ in range(3):
        whole = train_step(
            model=model_a,
            optimizer=opt_a,
            scaler=scaler_a,
            micro_batches=[(inputs, targets)],
            autocast_dtype=None,
            max_grad_norm=0.5,
        )
        micro = list(zip(inputs.chunk(num_micro), targets.chunk(num_micro)))
        accumulated = train_step(
            model=model_b, optimizer=opt_b, scaler=scaler_b, micro_batches=micro, autocast_dtype=None, max_grad_norm=0.5
        )
        assert accumulated.num_samples == whole.num_samples == 16
        # The reported loss is a float32 summary; the update itself is compared strictly below.
        torch.testing.assert_close(accumulated.loss, whole.loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(accumulated.grad_norm, whole.grad_norm, rtol=1e-10, atol=1e-12)
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_clipping_bounds_the_update_and_reports_the_norm_before_clipping():
    model, _, scaler = _setup("sgd")
    optimizer = build_optimizer(
        OptimizerConfig(name="sgd", lr=0.05, momentum=0.0, weight_decay=0.0), model.parameters()
    )
    before = copy.deepcopy(model)
    inputs, targets = torch.randn(8, 1, 8, 8, dtype=torch.float64) * 50, torch.randint(0, 10, (8,))
    result = train_step(
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        micro_batches=[(inputs, targets)],
        autocast_dtype=None,
        max_grad_norm=0.01,
    )
    assert result.grad_norm > 0.01
    step = torch.sqrt(sum(((p - q) ** 2).sum() for p, q in zip(model.parameters(), before.parameters())))
    torch.testing.assert_close(
        step, torch.tensor(0.05 * 0.01, dtype=torch.float64), rtol=1e-4, atol=0
    )  # lr * max_grad_norm


def test_precision_falls_back_cleanly_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_precision("fp16", cpu) == (None, False)
    assert resolve_precision("auto", cpu) == (None, False)
    assert resolve_precision("bf16", cpu) == (torch.bfloat16, False)


def test_bf16_autocast_step_runs_on_cpu():
    model, optimizer, scaler = _setup("adamw")
    model.float()
    inputs, targets = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    result = train_step(
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        micro_batches=[(inputs, targets)],
        autocast_dtype=torch.bfloat16,
        max_grad_norm=1.0,
    )
    assert math.isfinite(result.loss.item())


def test_lr_warms_up_linearly_then_decays_by_cosine():
    cfg = ScheduleConfig(name="cosine", warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg=cfg, total_steps=14) for s in range(15)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4] == pytest.approx(1.0)
    assert factors[9] == pytest.approx(0.1 + 0.9 * 0.5)
    assert factors[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    constant = ScheduleConfig(name="constant", warmup_steps=0)
    assert lr_factor(100, cfg=constant, total_steps=10) == 1.0
