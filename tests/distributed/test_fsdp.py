"""FSDP2 and activation checkpointing on 2 gloo workers under Ray Train, checked against one process (no sharding,
no checkpointing) on the union of the workers' batches, in float64."""

from __future__ import annotations

import copy
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
RESNET = {"model": {"name": "resnet18"}, "data": {"num_shards": 4}}
GPT = {
    "workload": {"name": "causal_lm"},
    "data": {"dataset": "stdlib", "max_text_bytes": 200_000, "seq_len": 32, "num_shards": 4},
    "model": {"name": "gpt2-tiny", "num_layers": 3},
}
# (model config, strategy, activation checkpointing): FSDP alone on both families, FSDP with every GPT block
# recomputed, and DDP (1 MiB buckets, gradients as bucket views) with every other ResNet stage recomputed.
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
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from training_core.parallel import sharding
    from training_core.parallel.distributed import RayTrainRuntime

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
        else:  # the loop's DDP options reach DDP through the runtime
            model = RayTrainRuntime().prepare_model(
                model, {"bucket_cap_mb": 1, "gradient_as_bucket_view": True, "static_graph": False}
            )
            assert (model.bucket_bytes_cap, model.gradient_as_bucket_view, model.static_graph) == (2**20, True, False)
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


# ----------------------------------------------------------------------------------------- sharded checkpoints

RESHARD_CASE = "gpt-fsdp"


def _fsdp_gpt(data_dir: str):
    """A fresh float64 GPT sharded over this job's workers, and its optimizer."""
    from training_core.parallel import sharding

    cfg = _config(RESHARD_CASE)
    model = _fresh_model(RESHARD_CASE, data_dir)
    blocks = sharding.model_blocks(model, resolve_workload(cfg.workload))
    model = sharding.shard_model(model, blocks, device=torch.device("cpu"), param_dtype=None, cpu_offload=False)
    return model, build_optimizer(OptimizerConfig(name="adamw", lr=0.01), model.parameters())


def _union_step_batches(data_dir: str, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step ``step``'s micro-batches of both ranks of a 2-worker run, rank by rank (the first steps' again past
    them)."""
    return [
        mb for rank in range(WORLD_SIZE) for mb in _rank_micro_batches(RESHARD_CASE, data_dir, rank)[step % NUM_STEPS]
    ]


def _reshard_worker(config: dict) -> None:
    """Phase ``save``: 2 steps, a sharded checkpoint, then a third step (its loss and the full weights are the
    reference). Phase ``load``: restore the newest valid checkpoint on this job's workers, check it against the
    reference, take the third step, and save again."""
    import ray.train
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    from training_core import checkpoint as ckpt
    from training_core.parallel.distributed import all_reduce_sum
    from training_core.train.loop import train_step

    context = ray.train.get_context()
    rank, world_size, out = context.get_world_rank(), context.get_world_size(), Path(config["out_dir"])
    data_dir, phase = config["data_dir"], config["phase"]
    model, optimizer = _fsdp_gpt(data_dir)
    loss_fn = resolve_workload(_config(RESHARD_CASE).workload).loss
    storage = ckpt.CheckpointStorage(config["root"])
    checkpointer = ckpt.Checkpointer(storage, keep_last=3, async_save=True)

    def step(index: int) -> float:
        union = _union_step_batches(data_dir, index)
        share = len(union) // world_size  # each rank's share of the global batch; 1 worker accumulates all 4
        result = train_step(
            model=model,
            optimizer=optimizer,
            scaler=torch.amp.GradScaler("cpu", enabled=False),
            micro_batches=union[rank * share : (rank + 1) * share],
            autocast_dtype=None,
            max_grad_norm=0.5,
            loss_fn=loss_fn,
        )
        (loss_sum,) = all_reduce_sum([float(result.loss)], torch.device("cpu"))
        return loss_sum / world_size  # the mean over the global batch's micro-batches

    def save(global_step: int) -> None:
        meta = ckpt.CheckpointMeta(
            model_name="gpt2-tiny", classes=[], input_shape=[], mean=[], std=[], epoch=0, global_step=global_step,
            config={},
        )  # fmt: skip
        checkpointer.save_sharded(
            global_step,
            model=model,
            optimizer=optimizer,
            trainer_state={"rng": {}} if rank == 0 else None,
            meta=meta if rank == 0 else None,
        )
        checkpointer.wait()

    def full_state() -> tuple[dict, dict]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # A copy: on one worker the full state dict's tensors are the live parameters themselves.
        return copy.deepcopy(
            (get_model_state_dict(model, options=options), get_state_dict(model, optimizer, options=options)[1])
        )

    if phase == "save":
        step(0), save(1), step(1), save(2)
        restored, loss = full_state(), step(2)
    else:
        loaded = ckpt.load_latest_valid(storage)
        assert loaded is not None and loaded.meta.global_step == config["expect_step"], loaded
        ckpt.restore(loaded, model=model, optimizer=optimizer)
        restored, loss = full_state(), step(config["expect_step"])
        save(config["expect_step"] + 1)
    after = full_state()
    if rank == 0:
        torch.save({"restored": restored, "loss": loss, "after": after}, out / f"{phase}-{world_size}.pt")
    ray.train.report({"rank": rank})


def _run(workers: int, config: dict, storage_path: Path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    TorchTrainer(
        _reshard_worker,
        train_loop_config=config,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"reshard-{config['phase']}-{workers}", storage_path=str(storage_path)),
    ).fit()


def _assert_same_state(got: dict, expected: dict, what: str) -> None:
    (got_model, got_optim), (model, optim) = got, expected
    assert got_model.keys() == model.keys()
    for name, tensor in model.items():
        assert torch.equal(got_model[name], tensor), f"{what}: weight {name}"
    for name, state in optim["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(got_optim["state"][name][key]), torch.as_tensor(value)), (what, name)


def test_a_sharded_checkpoint_reshards_from_2_workers_to_1_and_back_and_a_corrupt_shard_falls_back(
    ray_session, data_dirs, tmp_path
):
    import cloudpickle

    from training_core import checkpoint as ckpt

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    data_dir, root, out = data_dirs["gpt"], str(tmp_path / "checkpoints"), tmp_path
    base = {"data_dir": data_dir, "root": root, "out_dir": str(out)}
    _run(2, {**base, "phase": "save"}, tmp_path / "ray")
    storage = ckpt.CheckpointStorage(root)
    assert storage.list_steps() == [ckpt.step_name(1), ckpt.step_name(2)]
    manifest = ckpt.CheckpointManifest.parse(
        storage.read(ckpt.step_name(2), ckpt.MANIFEST_FILE, max_bytes=ckpt.MAX_MANIFEST_BYTES), where="manifest"
    )
    # Every rank wrote its own shard, and the manifest (written last) has the sha256 of each.
    assert manifest.format == "sharded"
    assert sorted(manifest.shards) == ["shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"]
    reference = torch.load(out / "save-2.pt", weights_only=True)

    # 2 -> 1: the state restored on one worker is the 2-worker run's at step 2, bit for bit, and its next step
    # (both halves of the global batch, accumulated) has the loss the 2-worker run's had.
    _run(1, {**base, "phase": "load", "expect_step": 2}, tmp_path / "ray")
    on_one = torch.load(out / "load-1.pt", weights_only=True)
    _assert_same_state(on_one["restored"], reference["restored"], "2 -> 1")
    assert on_one["loss"] == pytest.approx(reference["loss"], rel=1e-12)
    assert storage.list_steps()[-1] == ckpt.step_name(3)

    # 1 -> 2: the checkpoint the single worker wrote after that step restores on two workers, bit for bit.
    _run(2, {**base, "phase": "load", "expect_step": 3}, tmp_path / "ray")
    on_two = torch.load(out / "load-2.pt", weights_only=True)
    _assert_same_state(on_two["restored"], on_one["after"], "1 -> 2")

    # A corrupted shard of the newest checkpoint (step 4, from the 2 workers) is detected by its hash, and a resume
    # takes the previous valid one (step 3).
    shard = Path(root) / ckpt.step_name(4) / "shards" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"step-000000004/shards/__1_0.distcp is corrupt: sha256"):
        ckpt.verify_and_load(storage, ckpt.step_name(4))
    fallback = ckpt.load_latest_valid(storage)  # what every rank of a resumed run chooses (the 1 -> 2 run restored it)
    assert fallback is not None and fallback.name == ckpt.step_name(3)
