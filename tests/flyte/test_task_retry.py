"""What the Flyte backend does on a retry, reproduced with two real ``pyflyte-execute`` calls.

Attempt 1 runs the train task with ``--checkpoint-path A1``; a Ray Train worker is SIGKILLed after some
checkpoints, with no in-job restarts left, so the task fails. Attempt 2 runs with ``--checkpoint-path A2
--prev-checkpoint A1``, as propeller would, and must resume from attempt 1's latest step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from flyteidl.core import errors_pb2, literals_pb2

from benchmarks.common import ray_train_worker_pids
from tests.conftest import REPO_ROOT, VENV_BIN

KILL_AFTER_STEP = 10


def _execute(tmp_path: Path, attempt: int, env: dict[str, str], *, prev: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(VENV_BIN / "pyflyte-execute"),
            "--inputs",
            str(tmp_path / "inputs.pb"),
            "--output-prefix",
            str(tmp_path / f"out{attempt}"),
            "--raw-output-data-prefix",
            str(tmp_path / "raw"),
            "--checkpoint-path",
            str(tmp_path / f"A{attempt}"),
            "--prev-checkpoint",
            prev,
            "--resolver",
            "flytekit.core.python_auto_container.default_task_resolver",
            "--",
            "task-module",
            "tasks.train",
            "task-name",
            "train",
        ],
        cwd=tmp_path,
        env=env,
        stdout=open(tmp_path / f"attempt{attempt}.log", "w"),
        stderr=subprocess.STDOUT,
    )


def _write_inputs(tmp_path: Path) -> None:
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.types.directory import FlyteDirectory

    from tasks.types import PreparedData
    from training_core.config import DataConfig, TrainingConfig
    from training_core.data import prepare

    manifest = prepare(DataConfig(), str(tmp_path / "prepared"))
    data = PreparedData(
        directory=FlyteDirectory(str(tmp_path / "prepared")),
        dataset=manifest.dataset,
        num_classes=manifest.num_classes,
        input_shape=manifest.input_shape,
        split_counts=manifest.split_counts(),
    )
    config = TrainingConfig.from_dict(
        {
            "model": {"name": "small_cnn"},
            "loop": {"epochs": 4, "batch_size": 16},
            "checkpoint": {"interval_steps": 5, "max_worker_restarts": 0},
            "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "promotion_threshold": 0.0},
        }
    )
    ctx = FlyteContextManager.current_context()
    literal_map = TypeEngine.dict_to_literal_map(
        ctx,
        {"config": config, "data": data, "resume_from": None},
        {"config": TrainingConfig, "data": PreparedData, "resume_from": FlyteDirectory | None},
    )
    (tmp_path / "inputs.pb").write_bytes(literal_map.to_flyte_idl().SerializeToString())


def _steps_written(raw: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in raw.rglob("step-*") if (p / "manifest.json").exists())


def test_a_failed_attempt_is_retried_and_the_retry_resumes_from_its_latest_checkpoint(
    ray_address, tmp_path, subprocess_env
):
    _write_inputs(tmp_path)
    env = dict(subprocess_env, RAY_ADDRESS=ray_address, PYTHONPATH=str(REPO_ROOT))

    first = _execute(tmp_path, 1, env, prev='""')
    deadline = time.monotonic() + 300
    while not [s for s in _steps_written(tmp_path / "raw") if s >= KILL_AFTER_STEP]:
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "attempt1.log").read_text()[-4000:]
        time.sleep(0.05)
    latest_before_kill = _steps_written(tmp_path / "raw")[-1]
    pids = ray_train_worker_pids()
    assert pids, "no Ray Train worker to kill"
    os.kill(max(pids), signal.SIGKILL)
    assert first.wait(timeout=300) == 0  # pyflyte-execute reports task errors in error.pb, not its exit code

    error = errors_pb2.ErrorDocument()
    error.ParseFromString((tmp_path / "out1" / "error.pb").read_bytes())
    assert error.error.kind == errors_pb2.ContainerError.RECOVERABLE, error
    assert "infrastructure failure" in error.error.message
    assert not (tmp_path / "out1" / "outputs.pb").exists()
    assert (tmp_path / "A1").exists(), "attempt 1 left no intra-task checkpoint for the retry"

    second = _execute(tmp_path, 2, env, prev=str(tmp_path / "A1"))
    assert second.wait(timeout=600) == 0
    log = (tmp_path / "attempt2.log").read_text()
    assert not (tmp_path / "out2" / "error.pb").exists(), log[-4000:]
    outputs = literals_pb2.LiteralMap()
    outputs.ParseFromString((tmp_path / "out2" / "outputs.pb").read_bytes())

    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import LiteralMap

    from tasks.types import TrainedModel
    from training_core import checkpoint as ckpt

    trained = TypeEngine.to_python_value(
        FlyteContextManager.current_context(), LiteralMap.from_flyte_idl(outputs).literals["o0"], TrainedModel
    )
    assert trained.metrics.global_step == 4 * 39
    meta = ckpt.load_meta(trained.checkpoint.download())
    (resumed_from,) = meta.resumed_from_steps
    assert resumed_from >= latest_before_kill >= KILL_AFTER_STEP, (
        "attempt 2 must resume from attempt 1's latest step, not step 0"
    )
    assert "retry: resuming in" in log
