"""An error of the user's code on one rank only, on 2 gloo workers through Ray Train: rank 1's ``loss`` raises while
rank 0 waits in the gradient all-reduce. The worker group is not restarted (one attempt, though
``checkpoint.max_worker_restarts`` allows 2 more), and ``fit`` raises a ``UserCodeError`` naming the rank, the field
and the method, which Flyte does not retry either."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from training_core.config import DataConfig, TrainingConfig, WorkloadConfig
from training_core.runners.ray_train import fit
from training_core.train.failures import UserCodeError, classify
from training_core.workloads import resolve_workload

WORKLOAD = """
import sys

if {repo!r} not in sys.path:  # the example this workload extends, where the workers run
    sys.path.append({repo!r})

import torch.distributed as dist

from examples.tabular_mlp.workload import TabularMLP


class OneBadRank(TabularMLP):
    def build_model(self, config, manifest):
        if dist.is_initialized():  # a worker's attempt, not the driver's preflight
            with open({attempts!r}, "a") as attempts:
                attempts.write(f"{{dist.get_rank()}}\\n")
        return super().build_model(config, manifest)

    def loss(self, model, batch):
        if dist.is_initialized() and dist.get_rank() == 1:
            raise KeyError("diagnosis")
        return super().loss(model, batch)
"""


@pytest.fixture(scope="module")
def table_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("table")
    resolve_workload(WorkloadConfig(name="examples.tabular_mlp.workload:TabularMLP")).prepare_data(
        DataConfig(num_shards=4), str(out)
    )
    return str(out)


def test_a_user_code_error_on_one_rank_ends_the_run_after_one_attempt_as_a_user_error(
    ray_session, table_dir, tmp_path, monkeypatch
):
    package, attempts = tmp_path / "one_bad_rank", tmp_path / "attempts.txt"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "workload.py").write_text(WORKLOAD.format(repo=str(REPO_ROOT), attempts=str(attempts)))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TrainingConfig.from_dict(
        {
            "workload": {"name": "one_bad_rank.workload:OneBadRank"},
            "model": {"name": "mlp"},
            "loop": {"epochs": 1, "batch_size": 16},
            "checkpoint": {"max_worker_restarts": 2},
            "scaling": {"num_workers": 2, "torch_threads_per_worker": 1},
            "observability": {"enabled": False},
        }
    )

    started = time.monotonic()
    with pytest.raises(UserCodeError) as raised:
        fit(cfg, data_dir=table_dir, checkpoint_dir=str(tmp_path / "final"), run_name="bad-rank",
            storage_path=str(tmp_path / "runs"))  # fmt: skip
    took_s = time.monotonic() - started

    assert sorted(Path(attempts).read_text().split()) == ["0", "1"]  # one attempt of both ranks, no restart
    assert str(raised.value) == (
        "rank 1: workload.name='one_bad_rank.workload:OneBadRank' failed in its loss(): KeyError: 'diagnosis'; fix "
        "the workload's loss()"
    )
    verdict = classify(raised.value)
    assert verdict.kind == "user" and not verdict.retryable, verdict
    assert took_s < 120, took_s
