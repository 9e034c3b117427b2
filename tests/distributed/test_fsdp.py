"""FSDP2 and activation checkpointing on 2 gloo workers under Ray Train, checked against one process (no sharding,
no checkpointing) on the union of the workers' batches, in float64."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from training_core.config import OptimizerConfig, TrainingConfig
from training_core.data import Manifest, ShardStream, prepare
from training_core.loop import train_step
from training_core.optim import build_optimizer
from training_core.workloads import resolve_workload

NUM_STEPS = 3
MICRO_BATCH = 4
GRAD_ACCUM = 2
WORLD_SIZE = 2
RESNET = {"model": {"name": "resnet18"}, "data": {"num_shards": 4}}
GPT = {
    "workload": {"name": "causal_lm"},
    "data": {"dataset": "stdlib", "max_text_bytes": 200_000, "seq_len": 32, "num_shards": 4},
    "model": {"name": "gpt2-tiny", "num_layers": 3},
}
# (model config, strategy, activation checkpointing): FSDP alone on both families, FSDP with every GPT block
# recomputed, and DDP with every other ResNet stage recomputed.
CASES = {
    "resnet-fsdp": (RESNET, "fsdp", "none"),
    "gpt-fsdp": (GPT, "fsdp", "none"),
    "gpt-fsdp-full-ac": (GPT, "fsdp", "full"),
    "resnet-ddp-selective-ac": (RESNET, "ddp", "selective"),
}


def _config(case: str) -> TrainingConfig:
    sections, strategy, checkpointing = CASES[case]
    return TrainingConfig.from_dict(
        {
            **sections,
            "scaling": {"strategy": strategy},
            "model": {**sections["model"], "activation_checkpointing": checkpointing},
        }
    )


def _rank_micro_batches(case: str, data_dir: str, rank: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The micro-batches rank ``rank`` trains on, step by step, read from its own shards (floats in float64)."""
    manifest = Manifest.load(data_dir)
    to_device = resolve_workload(_config(case).workload).to_device(manifest, torch.device("cpu"))
    stream = ShardStream(manifest, "train", rank=rank, world_size=WORLD_SIZE)
    batches = stream.train_batches(epoch=0, seed=0, batch_size=MICRO_BATCH, num_batches=NUM_STEPS * GRAD_ACCUM)
    tensors = [tuple(t.double() if t.is_floating_point() else t for t in to_device(b)) for b in batches]
    return [tensors[s * GRAD_ACCUM : (s + 1) * GRAD_ACCUM] for s in range(NUM_STEPS)]


def _fresh_model(case: str, data_dir: str) -> torch.nn.Module:
    cfg = _config(case)
    torch.manual_seed(0)
    return resolve_workload(cfg.workload).build_model(cfg, Manifest.load(data_dir)).double()


def _steps(case: str, model: torch.nn.Module, micro_batches_per_step) -> None:
    loss = resolve_workload(_config(case).workload).loss
    optimizer = build_optimizer(OptimizerConfig(name="adamw", lr=0.01, max_grad_norm=0.5), model.parameters())
    for micro_batches in micro_batches_per_step:
        train_step(
            model=model,
            optimizer=optimizer,
            scaler=torch.amp.GradScaler("cpu", enabled=False),
            micro_batches=micro_batches,
            autocast_dtype=None,
            max_grad_norm=0.5,  # low enough to clip: the norm of the sharded gradients is the global one
            loss_fn=loss,
        )


def _worker(config: dict) -> None:
    import ray.train
    import ray.train.torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from training_core import sharding

    rank = ray.train.get_context().get_world_rank()
    for case, data_dir in config["cases"].items():
        cfg = _config(case)
        model = _fresh_model(case, data_dir)
        blocks = sharding.model_blocks(model, resolve_workload(cfg.workload))
        assert len(blocks) == (3 if case.startswith("gpt") else 4), case
        recomputed = sharding.apply_activation_checkpointing(
            blocks, mode=cfg.model.activation_checkpointing, every_k=cfg.model.activation_checkpointing_every_k
        )
        assert recomputed == {"none": 0, "full": 3, "selective": 2}[cfg.model.activation_checkpointing], case
        if cfg.scaling.strategy == "fsdp":
            model = sharding.shard_model(model, blocks, device=torch.device("cpu"), param_dtype=None, cpu_offload=False)
            assert sharding.is_sharded(model)
        else:
            model = ray.train.torch.prepare_model(model)
        _steps(case, model, _rank_micro_batches(case, data_dir, rank))
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, Path(config["out_dir"]) / f"{case}.pt")
    ray.train.report({"rank": rank})


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {}
    for name, sections in (("resnet", RESNET), ("gpt", GPT)):
        out = tmp_path_factory.mktemp(name)
        cfg = TrainingConfig.from_dict(sections)
        prepare(cfg.data, str(out), workload=cfg.workload)
        dirs[name] = str(out)
    return dirs


def test_fsdp_and_activation_checkpointing_on_two_workers_equal_one_process(ray_session, data_dirs, tmp_path):
    import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cases = {case: data_dirs[case.split("-")[0]] for case in CASES}
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    TorchTrainer(
        _worker,
        train_loop_config={"cases": cases, "out_dir": str(tmp_path)},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=WORLD_SIZE, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="fsdp-exactness", storage_path=str(tmp_path / "ray")),
    ).fit()

    for case, data_dir in cases.items():
        reference = _fresh_model(case, data_dir)
        initial = {name: p.detach().clone() for name, p in reference.named_parameters()}
        per_rank = [_rank_micro_batches(case, data_dir, rank) for rank in range(WORLD_SIZE)]
        # Gradient accumulation over every rank's micro-batches: the ranks' mean gradient, with BatchNorm's batch
        # statistics over the same micro-batches as on the ranks. Running statistics are each rank's own, so only
        # the parameters are compared.
        _steps(case, reference, [[mb for rank in range(WORLD_SIZE) for mb in per_rank[rank][s]] for s in range(3)])
        got = torch.load(tmp_path / f"{case}.pt", weights_only=True)
        assert any(not torch.equal(p, initial[name]) for name, p in reference.named_parameters()), case
        # Float tolerance: sums reduced in another order, and Adam's update (about lr / step) is amplified where a
        # gradient is near 0; 1e-8 is a millionth of one step's change (lr 0.01).
        for name, tensor in reference.named_parameters():
            torch.testing.assert_close(
                got[name], tensor.detach(), rtol=1e-6, atol=1e-8, msg=lambda m, where=f"{case} {name}": f"{where}: {m}"
            )
