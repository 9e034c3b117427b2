"""The ``causal_lm`` workload under DDP on 2 gloo workers, checked against one process on the union of their data."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from training_core.config import OptimizerConfig, TrainingConfig
from training_core.data import Manifest, ShardStream, prepare
from training_core.train.loop import train_step
from training_core.train.optim import build_optimizer
from training_core.workloads import resolve_workload

NUM_STEPS = 3
MICRO_BATCH = 4
GRAD_ACCUM = 2
WORLD_SIZE = 2
CONFIG = {
    "workload": {"name": "causal_lm"},
    "data": {"dataset": "stdlib", "max_text_bytes": 300_000, "seq_len": 32, "num_shards": 4},
    "model": {"name": "gpt2-tiny"},
}


def _config() -> TrainingConfig:
    return TrainingConfig.from_dict(CONFIG)


def _rank_micro_batches(manifest: Manifest, rank: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The (inputs, targets) micro-batches rank ``rank`` trains on, step by step, from its own shards."""
    workload = resolve_workload(_config().workload)
    to_device = workload.to_device(manifest, torch.device("cpu"))
    stream = ShardStream(manifest, "train", rank=rank, world_size=WORLD_SIZE)
    batches = stream.train_batches(epoch=0, seed=0, batch_size=MICRO_BATCH, num_batches=NUM_STEPS * GRAD_ACCUM)
    tensors = [to_device(b) for b in batches]
    return [tensors[s * GRAD_ACCUM : (s + 1) * GRAD_ACCUM] for s in range(NUM_STEPS)]


def _fresh_model(manifest: Manifest) -> torch.nn.Module:
    torch.manual_seed(0)
    return resolve_workload(_config().workload).build_model(_config(), manifest).double()


def _steps(model, manifest: Manifest, micro_batches_per_step) -> None:
    workload = resolve_workload(_config().workload)
    optimizer = build_optimizer(OptimizerConfig(name="adamw", lr=0.01, max_grad_norm=1.0), model.parameters())
    for micro_batches in micro_batches_per_step:
        train_step(
            model=model,
            optimizer=optimizer,
            scaler=torch.amp.GradScaler("cpu", enabled=False),
            micro_batches=micro_batches,
            autocast_dtype=None,
            max_grad_norm=1.0,
            loss_fn=workload.loss,
        )


def _ddp_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch

    rank = ray.train.get_context().get_world_rank()
    manifest = Manifest.load(config["data_dir"])
    model = ray.train.torch.prepare_model(_fresh_model(manifest))
    _steps(model, manifest, _rank_micro_batches(manifest, rank))
    torch.save(model.module.state_dict(), Path(config["out_dir"]) / f"rank{rank}.pt")
    ray.train.report({"rank": rank})


@pytest.fixture(scope="module")
def stdlib_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("stdlib")
    cfg = _config()
    prepare(cfg.data, str(out), workload=cfg.workload)
    return str(out)


def test_a_gpt_under_ddp_on_two_gloo_workers_equals_one_process_on_the_union_of_their_batches(
    ray_session, stdlib_dir, tmp_path
):
    import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    TorchTrainer(
        _ddp_worker,
        train_loop_config={"data_dir": stdlib_dir, "out_dir": str(tmp_path)},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=WORLD_SIZE, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="lm-ddp-exactness", storage_path=str(tmp_path / "ray")),
    ).fit()

    manifest = Manifest.load(stdlib_dir)
    per_rank = [_rank_micro_batches(manifest, rank) for rank in range(WORLD_SIZE)]
    # Every micro-batch holds the same number of tokens, so the mean over the union is the mean of the means.
    union_steps = [
        [
            (
                torch.cat([x for rank in range(WORLD_SIZE) for x, _ in per_rank[rank][step]]),
                torch.cat([y for rank in range(WORLD_SIZE) for _, y in per_rank[rank][step]]),
            )
        ]
        for step in range(NUM_STEPS)
    ]
    reference = _fresh_model(manifest)
    _steps(reference, manifest, union_steps)
    expected = reference.state_dict()
    for rank in range(WORLD_SIZE):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert set(got) == set(expected)
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-9, atol=1e-11, msg=f"rank {rank} {name}")
    # The ranks trained on different sequences.
    assert not torch.equal(per_rank[0][0][0][0], per_rank[1][0][0][0])
