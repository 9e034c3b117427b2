import torch

from training_core import checkpoint as ckpt
from training_core.config import OptimizerConfig, ScheduleConfig, TrainingConfig
from training_core.loop import build_optimizer, build_scheduler, train_step
from training_core.models import build_model


def _trained_objects(seed: int):
    torch.manual_seed(seed)
    model = build_model("small_cnn", num_classes=10, input_shape=(1, 8, 8))
    optimizer = build_optimizer(OptimizerConfig(name="adamw"), model.parameters())
    scheduler = build_scheduler(ScheduleConfig(warmup_steps=2), optimizer, total_steps=10)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for _ in range(3):
        batch = (torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)))
        train_step(model=model, optimizer=optimizer, scaler=scaler, micro_batches=[batch], autocast_dtype=None, max_grad_norm=1.0)
        scheduler.step()
    return model, optimizer, scheduler, scaler


def test_save_then_load_restores_every_stateful_object_exactly(tmp_path):
    model, optimizer, scheduler, scaler = _trained_objects(seed=0)
    meta = ckpt.CheckpointMeta(
        model_name="small_cnn", classes=[str(i) for i in range(10)], input_shape=[1, 8, 8], mean=[0.3], std=[0.2],
        epoch=1, global_step=3, config=TrainingConfig().to_dict(), history=[{"epoch": 1.0, "val_accuracy": 0.5}],
    )
    ckpt.save(str(tmp_path), model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, meta=meta)

    other_model, other_optimizer, other_scheduler, other_scaler = _trained_objects(seed=1)
    position = ckpt.load_trainer_state(str(tmp_path), model=other_model, optimizer=other_optimizer, scheduler=other_scheduler, scaler=other_scaler)
    assert position == {"epoch": 1, "global_step": 3}
    for a, b in zip(model.state_dict().values(), other_model.state_dict().values()):
        assert torch.equal(a, b)
    for group_a, group_b in zip(optimizer.state_dict()["state"].values(), other_optimizer.state_dict()["state"].values()):
        for key in group_a:
            assert torch.equal(torch.as_tensor(group_a[key]), torch.as_tensor(group_b[key]))
    assert other_scheduler.state_dict() == scheduler.state_dict()
    assert other_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]

    rebuilt, loaded_meta = ckpt.load_model(str(tmp_path))
    assert loaded_meta == meta
    x = torch.randn(4, 1, 8, 8)
    assert torch.equal(rebuilt.eval()(x), model.eval()(x))
