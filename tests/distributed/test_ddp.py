"""DDP on 2 gloo workers under Ray Train, checked against one process on the union of their data."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import kills_not_in_rays_exit, new_run_processes, session_ray_processes
from training_core.config import OptimizerConfig, TrainingConfig
from training_core.data import Manifest, ShardStream
from training_core.models import build_model
from training_core.train.loop import train_step
from training_core.train.optim import build_optimizer
from training_core.workloads.image import Normalizer
from training_core.workloads.protocol import classification_loss

NUM_STEPS = 3
MICRO_BATCH = 8
GRAD_ACCUM = 2
WORLD_SIZE = 2


def _rank_micro_batches(manifest: Manifest, rank: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The micro-batches rank ``rank`` trains on, step by step, read from its own shards (float64)."""
    stream = ShardStream(manifest, "train", rank=rank, world_size=WORLD_SIZE)
    normalize = Normalizer(manifest, torch.device("cpu"))
    batches = stream.train_batches(epoch=0, seed=0, batch_size=MICRO_BATCH, num_batches=NUM_STEPS * GRAD_ACCUM)
    tensors = [tuple(t.double() if t.is_floating_point() else t for t in normalize(b)) for b in batches]
    return [tensors[s * GRAD_ACCUM : (s + 1) * GRAD_ACCUM] for s in range(NUM_STEPS)]


def _fresh_model(manifest: Manifest) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("small_cnn", num_classes=manifest.num_classes, input_shape=manifest.input_shape).double()


def _ddp_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    rank = ray.train.get_context().get_world_rank()
    manifest = Manifest.load(config["data_dir"])
    model = ray.train.torch.prepare_model(_fresh_model(manifest))
    calls = {"n": 0}

    def counting_allreduce(state, bucket):
        calls["n"] += 1
        return allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting_allreduce)
    optimizer = build_optimizer(OptimizerConfig(name="adamw", lr=0.05, max_grad_norm=1.0), model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    seen = []
    for micro_batches in _rank_micro_batches(manifest, rank):
        train_step(
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            micro_batches=micro_batches,
            autocast_dtype=None,
            max_grad_norm=1.0,
            loss_fn=classification_loss,
        )
        for inputs, _ in micro_batches:
            seen.extend(hashlib.sha1(sample.numpy().tobytes()).hexdigest() for sample in inputs)
    out = Path(config["out_dir"])
    torch.save(model.module.state_dict(), out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({"allreduce_calls": calls["n"], "sample_hashes": seen}))
    ray.train.report({"rank": rank})


def test_ddp_on_two_gloo_workers_equals_one_process_on_the_union_of_their_batches(ray_session, digits_dir, tmp_path):
    import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # The workers import training_core from the installed package; this test module travels by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = TorchTrainer(
        _ddp_worker,
        train_loop_config={"data_dir": digits_dir, "out_dir": str(tmp_path)},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=WORLD_SIZE, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="ddp-exactness", storage_path=str(tmp_path / "ray")),
    )
    trainer.fit()

    manifest = Manifest.load(digits_dir)
    reference = _fresh_model(manifest)
    optimizer = build_optimizer(OptimizerConfig(name="adamw", lr=0.05, max_grad_norm=1.0), reference.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    per_rank = [_rank_micro_batches(manifest, rank) for rank in range(WORLD_SIZE)]
    for step in range(NUM_STEPS):
        union = [mb for rank in range(WORLD_SIZE) for mb in per_rank[rank][step]]
        inputs = torch.cat([x for x, _ in union])
        targets = torch.cat([y for _, y in union])
        train_step(
            model=reference,
            optimizer=optimizer,
            scaler=scaler,
            micro_batches=[(inputs, targets)],
            autocast_dtype=None,
            max_grad_norm=1.0,
            loss_fn=classification_loss,
        )

    expected = reference.state_dict()
    for rank in range(WORLD_SIZE):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-9, atol=1e-11, msg=f"rank {rank} {name}")

    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    # Disjoint data: no sample (identified by a hash of its pixels) trained on by both ranks.
    assert len(reports[0]["sample_hashes"]) == NUM_STEPS * GRAD_ACCUM * MICRO_BATCH
    assert not set(reports[0]["sample_hashes"]) & set(reports[1]["sample_hashes"])
    # no_sync on non-final micro-steps: one all-reduce per optimizer step (the model fits one bucket).
    assert [r["allreduce_calls"] for r in reports] == [NUM_STEPS, NUM_STEPS]


def ray_actors() -> dict[str, dict]:
    """The actor table of the session's cluster, by actor id (the state API needs the dashboard, which is off)."""
    from ray._private.state import actors

    return actors()


def test_fit_trains_two_workers_to_a_loadable_checkpoint_and_leaves_no_process_running(
    ray_session, session_root, digits_dir, tmp_path, caplog
):
    from training_core.evaluation import evaluate_checkpoint
    from training_core.runners.ray_train import fit

    cfg = TrainingConfig.from_dict(
        {
            "model": {"name": "small_cnn"},
            "loop": {"epochs": 2, "batch_size": 32, "grad_accum_steps": 2, "log_interval_steps": 2},
            "schedule": {"warmup_steps": 2},
        }
    )
    before = session_ray_processes(session_root)
    actors_before = set(ray_actors())
    with caplog.at_level(logging.WARNING, logger="training_core.runners.ray_processes"):
        result = fit(
            cfg,
            data_dir=digits_dir,
            checkpoint_dir=str(tmp_path / "final"),
            run_name="fit-smoke",
            storage_path=str(tmp_path / "ray"),
        )
    # Its controller, workers...: all exited by themselves when fit returned. Before the change, the controller (and
    # what it owns) lived on until the next run, held by the SIGINT handler Ray Train installs.
    assert new_run_processes(session_root, before) == {}
    # The run started no Ray Data actor: its workers read their shards themselves (Ray Train's datasets callback,
    # which would start a DatasetManager, is left out of a run without Ray Datasets).
    started = sorted(a["ActorClassName"] for actor_id, a in ray_actors().items() if actor_id not in actors_before)
    assert started.count("RayTrainWorker") == 2 and "DatasetManager" not in started, started
    # A process killed by fit had begun its own exit (Ray's exit deadlock), never one a handler held alive.
    assert kills_not_in_rays_exit(caplog.text, session_root) == [], caplog.text
    steps_per_epoch = Manifest.load(digits_dir).steps_per_epoch(world_size=2, batch_size=32, grad_accum_steps=2)
    assert result.meta.global_step == 2 * steps_per_epoch
    assert [r.epoch for r in result.meta.history] == [1.0, 2.0]
    assert result.metrics.steady_samples_per_s > 0
    # Gradient all-reduces are timed by a DDP comm hook: a real, partial share of the step.
    assert 0 < result.metrics.allreduce_fraction < 1
    assert 0 < result.metrics.step_time_p50_s <= result.metrics.step_time_p95_s
    global_batch = 32 * 2 * 2
    for record in result.meta.step_log:
        # samples/s over a window times the mean step time of that window is the global batch.
        assert record.samples_per_s * record.step_time_s == pytest.approx(global_batch, rel=1e-9)
        assert 0 <= record.data_wait_s < record.step_time_s and record.grad_norm > 0 and record.lr > 0
    for epoch in (0, 1):
        windows = [r for r in result.meta.step_log if r.epoch == epoch]
        steps = [r.step - p for r, p in zip(windows, [epoch * steps_per_epoch] + [w.step for w in windows[:-1]])]
        assert steps == [w.num_steps for w in windows]
        # The epoch's loss is the step-weighted mean of its log windows (every step lands in a window).
        weighted = sum(w.train_loss * n for w, n in zip(windows, steps)) / sum(steps)
        assert sum(steps) == steps_per_epoch
        assert result.meta.history[epoch].train_loss == pytest.approx(weighted, rel=1e-9)
    report = evaluate_checkpoint(result.checkpoint_dir, digits_dir)
    assert report.num_samples == 359
    assert (report.workload, report.primary_metric, report.primary_mode) == ("image_classification", "accuracy", "max")
    assert report.primary == report.metrics["accuracy"] > 0.5  # 10 classes: chance is 0.1
    assert report.metrics["accuracy"] <= report.metrics["top5_accuracy"] and report.loss > 0
    assert sum(map(sum, report.confusion)) == 359
