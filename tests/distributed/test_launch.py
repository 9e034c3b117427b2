"""The plain ``torch.distributed`` launcher: the scaling benchmark's baseline trains exactly as Ray Train does."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.runners.launch import launch

# Figures that depend on the clock; everything else in an epoch record is a function of the computation.
TIMING_KEYS = {
    "samples_per_s",
    "steady_samples_per_s",
    "step_time_p50_s",
    "step_time_p95_s",
    "allreduce_fraction",
    "step_time_s",
    "data_wait_s",
    "elapsed_s",
}


def _config() -> TrainingConfig:
    # small_cnn has no dropout or BatchNorm, and one thread per worker keeps CPU kernels deterministic.
    return TrainingConfig.from_dict(
        {
            "model": {"name": "small_cnn"},
            "loop": {"epochs": 2, "batch_size": 16, "max_steps": 8, "log_interval_steps": 3},
            "schedule": {"warmup_steps": 2},
            "scaling": {"num_workers": 2, "torch_threads_per_worker": 1},
        }
    )


def _figures(record) -> dict[str, float | str]:
    """The record's figures, NaN as a string so that it equals itself (an image model has no perplexity)."""
    return {k: "nan" if math.isnan(v) else v for k, v in dataclasses.asdict(record).items()}


def _without_timings(record) -> dict[str, float | str]:
    return {k: v for k, v in _figures(record).items() if k not in TIMING_KEYS}


def test_two_gloo_workers_without_ray_train_bit_identically_to_ray_train_fit(ray_session, digits_dir, tmp_path):
    from training_core.runners.ray_train import fit

    cfg = _config()
    plain = launch(
        cfg,
        data_dir=digits_dir,
        checkpoint_dir=str(tmp_path / "plain-final"),
        run_name="plain",
        storage_path=str(tmp_path / "runs"),
    )
    ray = fit(
        cfg,
        data_dir=digits_dir,
        checkpoint_dir=str(tmp_path / "ray-final"),
        run_name="ray",
        storage_path=str(tmp_path / "runs"),
    )

    assert plain.meta.global_step == ray.meta.global_step == 8
    # The record rank 0 reported is the checkpoint's last epoch record.
    assert _figures(plain.metrics) == _figures(plain.meta.history[-1])
    assert math.isnan(plain.metrics.val_perplexity) and plain.metrics.tokens_per_s == 0.0
    assert plain.metrics.steady_samples_per_s > 0
    assert 0 < plain.metrics.allreduce_fraction < 1
    assert 0 < plain.metrics.step_time_p50_s <= plain.metrics.step_time_p95_s
    # Same seeds, same shards per rank, DDP with the same defaults: same losses, same weights, same optimizer.
    assert [_without_timings(r) for r in plain.meta.history] == [_without_timings(r) for r in ray.meta.history]
    assert [_without_timings(r) for r in plain.meta.step_log] == [_without_timings(r) for r in ray.meta.step_log]
    plain_state, ray_state = ckpt.load_directory(plain.checkpoint_dir), ckpt.load_directory(ray.checkpoint_dir)
    assert plain_state.model.keys() == ray_state.model.keys()
    for name, tensor in ray_state.model.items():
        assert torch.equal(plain_state.model[name], tensor), name
    plain_moments, ray_moments = plain_state.trainer["optimizer"]["state"], ray_state.trainer["optimizer"]["state"]
    assert plain_moments.keys() == ray_moments.keys()
    for index, state in ray_moments.items():
        for key, value in state.items():
            assert torch.equal(plain_moments[index][key], value), (index, key)


def test_a_failing_rank_raises_in_the_caller_with_its_error(tmp_path):
    import torch.multiprocessing as mp

    one_worker = TrainingConfig.from_dict({**_config().to_dict(), "scaling": {"num_workers": 1}})
    with pytest.raises(mp.ProcessRaisedException, match="manifest.json"):
        launch(
            one_worker,
            data_dir=str(tmp_path / "no-data"),
            checkpoint_dir=str(tmp_path / "final"),
            run_name="broken",
            storage_path=str(tmp_path / "runs"),
        )
