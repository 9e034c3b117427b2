import copy
import math

import pytest
import torch

from training_core.config import OptimizerConfig, ScheduleConfig
from training_core.models import build_model
from training_core.train.optim import build_optimizer, lr_factor
from training_core.train.step import masked_step, resolve_precision, train_step
from training_core.workloads.protocol import classification_loss


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
            loss_fn=classification_loss,
        )
        micro = list(zip(inputs.chunk(num_micro), targets.chunk(num_micro)))
        accumulated = train_step(
            model=model_b,
            optimizer=opt_b,
            scaler=scaler_b,
            micro_batches=micro,
            autocast_dtype=None,
            max_grad_norm=0.5,
            loss_fn=classification_loss,
        )
        assert accumulated.num_samples == whole.num_samples == 16
        assert accumulated.num_tokens == whole.num_tokens == 0  # images: no tokens
        assert int(accumulated.sums["samples"]) == int(whole.sums["samples"]) == 16
        assert int(accumulated.sums["correct"]) == int(whole.sums["correct"])
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
        loss_fn=classification_loss,
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
        loss_fn=classification_loss,
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


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10)
    ).double()


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_a_batch_with_inf_is_flagged_and_skip_nonfinite_leaves_weights_buffers_and_optimizer_untouched(skip_nonfinite):
    model = _bn_model()
    optimizer = build_optimizer(OptimizerConfig(name="adamw", lr=0.05), model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    inputs, targets = torch.randn(8, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (8,))
    step = dict(
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        autocast_dtype=None,
        max_grad_norm=1.0,
        loss_fn=classification_loss,
    )
    assert not train_step(micro_batches=[(inputs, targets)], skip_nonfinite=skip_nonfinite, **step).nonfinite
    before = copy.deepcopy(model.state_dict())
    moments = copy.deepcopy(optimizer.state_dict()["state"])

    poisoned = inputs.clone()
    poisoned[0, 0, 0, 0] = math.inf
    result = train_step(micro_batches=[(poisoned, targets)], skip_nonfinite=skip_nonfinite, **step)

    assert result.nonfinite and not math.isfinite(result.grad_norm.item())
    after = model.state_dict()
    if skip_nonfinite:
        for name, tensor in before.items():
            assert torch.equal(after[name], tensor), name
        for index, state in optimizer.state_dict()["state"].items():
            for key, value in state.items():
                assert torch.equal(value, moments[index][key]), (index, key)
    else:
        assert not all(torch.isfinite(t).all() for t in after.values())


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_a_masked_step_not_kept_is_no_step_and_a_kept_one_is_a_plain_step(optimizer_name):
    """The device-side skip: a step not kept (even a first one, whose state it creates) leaves the run exactly
    where skipping it would, so the kept steps after it equal a run that never saw the bad batch."""
    torch.manual_seed(2)
    batches = [(torch.randn(8, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (8,))) for _ in range(3)]
    batches[0][0][0] = math.nan
    plain_model, plain_opt, _ = _setup(optimizer_name)
    masked_model, masked_opt, _ = _setup(optimizer_name)
    for index, (inputs, targets) in enumerate(batches):
        keep = index > 0
        for model, optimizer, masked in ((plain_model, plain_opt, False), (masked_model, masked_opt, True)):
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
            if masked:
                masked_step(optimizer, torch.tensor(keep))
            elif keep:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for a, b in zip(plain_model.parameters(), masked_model.parameters()):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for state_a, state_b in zip(plain_opt.state.values(), masked_opt.state.values()):
        for key, value in state_a.items():
            torch.testing.assert_close(torch.as_tensor(state_b[key]), torch.as_tensor(value), rtol=0, atol=0)
