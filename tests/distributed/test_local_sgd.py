"""Local SGD (``sync.mode=local_sgd``) through the training loop on 2 plain ``torch.distributed`` ranks (gloo):
against a simulation of the two replicas in this process, and its exact resume from a checkpoint written between
two parameter averages."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.data import Manifest, ShardStream
from training_core.runners.launch import launch
from training_core.runners.ray_train import checkpoint_root
from training_core.train.optim import build_optimizer, build_scheduler
from training_core.train.rng import seed_everything
from training_core.workloads import resolve_workload

WARMUP_STEPS, PERIOD_STEPS, INTERVAL_STEPS = 3, 4, 7
# Averages after global steps 4, 8, 12, ...; the checkpoint of step 7 falls between two of them.


def _config() -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "model": {"name": "small_cnn"},
            # Momentum: each replica's optimizer state is its own after the warm-up, so an exact resume needs both.
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "max_grad_norm": 1.0},
            "schedule": {"warmup_steps": 2},
            "loop": {"epochs": 1, "batch_size": 16, "log_interval_steps": 5},
            "sync": {
                "mode": "local_sgd",
                "local_sgd_period_steps": PERIOD_STEPS,
                "local_sgd_warmup_steps": WARMUP_STEPS,
            },
            "checkpoint": {"interval_steps": INTERVAL_STEPS, "keep_last": 10, "at_epoch_end": True},
            "observability": {"enabled": False},
        }
    )


def _simulate(cfg: TrainingConfig, data_dir: str) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    """Both replicas in one process, as the loop should train them: gradients averaged over the ranks for the
    warm-up, then each replica steps on its own batches; parameters averaged every period and at the epoch's end
    (each rank's value halved, then summed, as DDP's all-reduce and torch's averager do)."""
    manifest, workload = Manifest.load(data_dir), resolve_workload(cfg.workload)
    steps = manifest.steps_per_epoch(world_size=2, batch_size=cfg.loop.batch_size, grad_accum_steps=1)
    to_device = workload.to_device(manifest, torch.device("cpu"))
    batches = [
        ShardStream(manifest, "train", rank=rank, world_size=2).train_batches(
            epoch=0, seed=cfg.loop.seed, batch_size=cfg.loop.batch_size, num_batches=steps
        )
        for rank in range(2)
    ]
    models, optimizers, schedulers = [], [], []
    for _ in range(2):
        seed_everything(cfg.loop.seed)
        models.append(workload.build_model(cfg, manifest))
        optimizers.append(build_optimizer(cfg.optimizer, models[-1].parameters()))
        schedulers.append(build_scheduler(cfg.schedule, optimizers[-1], total_steps=steps))

    def average(tensors: list[torch.Tensor]) -> None:
        mean = tensors[0] / 2 + tensors[1] / 2
        for t in tensors:
            t.copy_(mean)

    for step in range(steps):
        for model, stream in zip(models, batches):
            workload.loss(model, to_device(next(stream))).loss.backward()
        pairs = list(zip(models[0].parameters(), models[1].parameters()))
        with torch.no_grad():
            if step < WARMUP_STEPS:
                for pair in pairs:
                    average([p.grad for p in pair])
            for model, optimizer, scheduler in zip(models, optimizers, schedulers):
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            if step == steps - 1 or (step >= WARMUP_STEPS and (step - WARMUP_STEPS) % PERIOD_STEPS == 0):
                for pair in pairs:
                    average(list(pair))
    return models, optimizers


def test_local_sgd_trains_like_its_simulation_and_resumes_bit_identical_between_two_averages(digits_dir, tmp_path):
    cfg = _config()
    whole = launch(
        cfg,
        data_dir=digits_dir,
        checkpoint_dir=str(tmp_path / "final"),
        run_name="local-sgd",
        storage_path=str(tmp_path),
    )
    final = ckpt.load_directory(whole.checkpoint_dir)
    models, optimizers = _simulate(cfg, digits_dir)
    for name, tensor in models[0].state_dict().items():
        torch.testing.assert_close(final.model[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    for rank, optimizer in enumerate(optimizers):
        saved = final.trainer["replicas"][str(rank)]["optimizer"]["state"]
        for index, state in optimizer.state_dict()["state"].items():
            torch.testing.assert_close(saved[index]["momentum_buffer"], state["momentum_buffer"], rtol=1e-5, atol=1e-6)

    # Step 7 is between two averages: the ranks' replicas differ, and the checkpoint holds both.
    root = checkpoint_root(str(tmp_path), "local-sgd")
    mid = ckpt.load_directory(f"{root}/{ckpt.step_name(INTERVAL_STEPS)}")
    replicas = mid.trainer["replicas"]
    assert sorted(replicas) == ["0", "1"]
    assert any(not torch.equal(replicas["0"]["model"][k], replicas["1"]["model"][k]) for k in replicas["0"]["model"])

    resumed_root = Path(checkpoint_root(str(tmp_path / "resumed"), "local-sgd"))
    resumed_root.mkdir(parents=True)
    shutil.copytree(f"{root}/{ckpt.step_name(INTERVAL_STEPS)}", resumed_root / ckpt.step_name(INTERVAL_STEPS))
    resumed = launch(
        cfg,
        data_dir=digits_dir,
        checkpoint_dir=str(tmp_path / "resumed-final"),
        run_name="local-sgd",
        storage_path=str(tmp_path / "resumed"),
    )
    again = ckpt.load_directory(resumed.checkpoint_dir)
    assert again.meta.resumed_from_steps == [INTERVAL_STEPS]
    for name, tensor in final.model.items():
        assert torch.equal(again.model[name], tensor), name
    for rank in ("0", "1"):
        for index, state in final.trainer["replicas"][rank]["optimizer"]["state"].items():
            assert torch.equal(again.trainer["replicas"][rank]["optimizer"]["state"][index]["momentum_buffer"],
                               state["momentum_buffer"])  # fmt: skip


def test_a_digits_run_with_local_sgd_reaches_the_accuracy_of_allreduce_within_one_point(digits_dir, tmp_path):
    from training_core.evaluation import evaluate_checkpoint

    accuracy = {}
    for mode in ("allreduce", "local_sgd"):
        cfg = TrainingConfig.from_dict(
            {
                "model": {"name": "small_cnn"},
                "loop": {"epochs": 8, "batch_size": 16, "log_interval_steps": 20},
                "sync": {"mode": mode, "local_sgd_period_steps": 4, "local_sgd_warmup_steps": 40},
                "observability": {"enabled": False},
            }
        )
        result = launch(
            cfg,
            data_dir=digits_dir,
            checkpoint_dir=str(tmp_path / f"{mode}-final"),
            run_name=mode,
            storage_path=str(tmp_path),
        )
        accuracy[mode] = evaluate_checkpoint(result.checkpoint_dir, digits_dir).metrics["accuracy"]
    print(f"test accuracy: {accuracy}")
    assert accuracy["allreduce"] > 0.9
    assert abs(accuracy["local_sgd"] - accuracy["allreduce"]) <= 0.01
