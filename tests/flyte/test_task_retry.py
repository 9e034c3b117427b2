"""What the Flyte backend does on a retry, reproduced with two real ``pyflyte-execute`` calls.

Attempt 1 runs the train task with ``--checkpoint-path A1``; a Ray Train worker is SIGKILLed after some
checkpoints, with no in-job restarts left, so the task fails. Attempt 2 runs with ``--checkpoint-path A2
--prev-checkpoint A1``, as propeller would, and must resume from attempt 1's latest step. The same for image prep on
Ray: attempt 1's pod is killed half way, and attempt 2 writes only the shards attempt 1 did not finish; and for text
prep on Ray, whose retry rewrites only the shard files it lacks (its pod log says how many).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from flyteidl.core import errors_pb2, literals_pb2

from tests.conftest import REPO_ROOT, VENV_BIN, session_train_workers
from tests.helpers.mlflow_db import seed_mlflow_db

KILL_AFTER_STEP = 10
EPOCHS = 2


def _execute(
    tmp_path: Path, attempt: int, env: dict[str, str], *, prev: str, task: tuple[str, str] = ("tasks.train", "train")
) -> subprocess.Popen:
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
            task[0],
            "task-name",
            task[1],
        ],
        cwd=tmp_path,
        env=env,
        stdout=open(tmp_path / f"attempt{attempt}.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a pod: killed with everything it started
    )


def _write_inputs(tmp_path: Path) -> int:
    """A tiny GPT under FSDP on the standard library's text: 2 epochs on 2 workers."""
    from flytekit.types.directory import FlyteDirectory

    from tasks.types import PreparedData
    from training_core.config import TrainingConfig
    from training_core.data import prepare

    config = TrainingConfig.from_dict(
        {
            "workload": {"name": "causal_lm"},
            "data": {"dataset": "stdlib", "max_text_bytes": 40_000, "seq_len": 32, "num_shards": 2},
            "model": {"name": "gpt2-tiny"},
            "scaling": {"strategy": "fsdp"},
            "loop": {"epochs": EPOCHS, "batch_size": 8},
            "checkpoint": {"interval_steps": 5, "max_worker_restarts": 0},
            "tracking": {"tracking_uri": seed_mlflow_db(tmp_path / "mlflow.db"), "promotion_threshold": 1e9},
        }
    )
    manifest = prepare(config.data, str(tmp_path / "prepared"), workload=config.workload)
    data = PreparedData(
        directory=FlyteDirectory(str(tmp_path / "prepared")),
        workload=manifest.workload,
        dataset=manifest.dataset,
        num_classes=manifest.num_classes,
        input_shape=list(manifest.input_shape),
        split_counts=manifest.split_counts(),
    )
    _write_literals(
        tmp_path / "inputs.pb",
        {"config": config, "data": data, "resume_from": None},
        {"config": TrainingConfig, "data": PreparedData, "resume_from": FlyteDirectory | None},
    )
    return manifest.steps_per_epoch(world_size=2, batch_size=8, grad_accum_steps=1)


def _write_literals(path: Path, values: dict, types: dict) -> None:
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    literal_map = TypeEngine.dict_to_literal_map(FlyteContextManager.current_context(), values, types)
    path.write_bytes(literal_map.to_flyte_idl().SerializeToString())


def _output(out_dir: Path, python_type: type):
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import LiteralMap

    outputs = literals_pb2.LiteralMap()
    outputs.ParseFromString((out_dir / "outputs.pb").read_bytes())
    literal = LiteralMap.from_flyte_idl(outputs).literals["o0"]
    return TypeEngine.to_python_value(FlyteContextManager.current_context(), literal, python_type)


def _steps_written(raw: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in raw.rglob("step-*") if (p / "manifest.json").exists())


def test_a_failed_attempt_is_retried_and_the_retry_resumes_from_its_latest_checkpoint(
    ray_address, tmp_path, subprocess_env
):
    """The run is sharded (``scaling.strategy=fsdp``, a GPT's blocks): each of attempt 1's checkpoints holds one
    shard per worker, and attempt 2 restores them. The full checkpoints of ``ddp`` go through the same pointer and
    the same ``load_latest_valid`` (tests/distributed/test_recovery.py resumes them after a SIGKILL)."""
    steps_per_epoch = _write_inputs(tmp_path)
    assert steps_per_epoch * EPOCHS > 2 * KILL_AFTER_STEP
    env = dict(subprocess_env, RAY_ADDRESS=ray_address, PYTHONPATH=str(REPO_ROOT))

    first = _execute(tmp_path, 1, env, prev='""')
    deadline = time.monotonic() + 300
    while not [s for s in _steps_written(tmp_path / "raw") if s >= KILL_AFTER_STEP]:
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "attempt1.log").read_text()[-4000:]
        time.sleep(0.05)
    latest_before_kill = _steps_written(tmp_path / "raw")[-1]
    pids = session_train_workers()
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

    from tasks.types import TrainedModel
    from training_core import checkpoint as ckpt

    trained = _output(tmp_path / "out2", TrainedModel)
    assert trained.metrics.global_step == EPOCHS * steps_per_epoch
    final = trained.checkpoint.download()
    manifest = ckpt.CheckpointManifest.parse(Path(final, ckpt.MANIFEST_FILE).read_bytes(), where="final")
    assert manifest.format == "sharded"
    assert sorted(manifest.shards) == ["shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"]
    meta = ckpt.load_meta(final)
    (resumed_from,) = meta.resumed_from_steps
    assert resumed_from >= latest_before_kill >= KILL_AFTER_STEP, (
        "attempt 2 must resume from attempt 1's latest step, not step 0"
    )
    assert "retry: resuming in" in log
    # Goodput over the whole execution: both Flyte attempts, each one's categories adding up to its workers x wall.
    from training_core.telemetry.goodput import ExecutionGoodput

    execution = ExecutionGoodput.from_summary(meta.telemetry["goodput"])
    assert trained.goodput.attempts == len(execution.attempts) == 2
    assert trained.goodput.goodput == pytest.approx(execution.goodput) and 0 < execution.goodput < 1
    for attempt in execution.attempts:
        assert 0.98 <= attempt.attributed_fraction <= 1.02, attempt
    # Attempt 1 was killed: its time past the checkpoint attempt 2 resumed from is settled (kept up to its last
    # recorded step, then start-up) or recomputed, never lost; attempt 2 starts up again.
    first_attempt, second_attempt = execution.attempts
    assert first_attempt.outcome == "failed" and second_attempt.seconds.startup > 0
    assert first_attempt.seconds.startup + first_attempt.seconds.recomputed > 0


def test_a_prep_attempt_killed_half_way_is_retried_into_its_directory_and_writes_only_the_missing_shards(
    ray_address, tmp_path, subprocess_env
):
    from tasks.types import PreparedData
    from tests.helpers.image_data import write_jpegs
    from training_core.config import DataConfig, WorkloadConfig
    from training_core.data import Manifest
    from training_core.data.image_shards import DONE_SUFFIX

    tree = write_jpegs(tmp_path / "images", per_class=80, side=96)
    config = DataConfig(dataset="image_folder", path=str(tree), image_size=64, num_shards=16, prep_num_workers=1)
    _write_literals(
        tmp_path / "inputs.pb",
        {"config": config, "workload": WorkloadConfig()},
        {"config": DataConfig, "workload": WorkloadConfig},
    )
    env = dict(subprocess_env, RAY_ADDRESS=ray_address, PYTHONPATH=str(REPO_ROOT))
    task = ("tasks.data", "prepare_on_ray")

    def done() -> set[Path]:
        return {p.with_name(p.name[: -len(DONE_SUFFIX)]) for p in (tmp_path / "raw").rglob(f"*{DONE_SUFFIX}")}

    first = _execute(tmp_path, 1, env, prev='""', task=task)
    deadline = time.monotonic() + 180
    while len(done()) < 4:
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "attempt1.log").read_text()[-4000:]
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGKILL)  # the pod is gone: no error document, no outputs
    first.wait()
    finished: set[Path] = set()
    while True:  # until Ray has ended the dead driver's shard tasks
        time.sleep(1.0)
        if done() == finished:
            break
        finished = done()
    assert not list((tmp_path / "raw").rglob("manifest.json")) and len(finished) < 3 * 16
    stamps = {path: path.stat().st_mtime_ns for path in finished}

    second = _execute(tmp_path, 2, env, prev=str(tmp_path / "A1"), task=task)
    assert second.wait(timeout=300) == 0
    assert not (tmp_path / "out2" / "error.pb").exists(), (tmp_path / "attempt2.log").read_text()[-4000:]
    prepared = _output(tmp_path / "out2", PreparedData)
    (directory,) = {path.parent for path in finished}
    assert prepared.directory.path == str(directory), "the retry must write into attempt 1's directory"
    manifest = Manifest.load(str(directory))
    shards = [directory / s.file for split in manifest.splits.values() for s in split.shards]
    assert set(shards) >= finished and sum(manifest.split_counts().values()) == 240
    assert all(path.stat().st_mtime_ns == stamp for path, stamp in stamps.items()), "a finished shard was rewritten"


def test_a_text_prep_retry_writes_into_its_predecessors_directory_and_only_the_shards_it_lacks(
    ray_address, tmp_path, subprocess_env
):
    """Text prep (``prepare_on_ray``, tokenising in Ray tasks on the shared cluster) retried: attempt 1 ends, and
    its directory is left as a kill half way leaves it (no manifest, a shard missing, one cut short); attempt 2,
    given attempt 1's intra-task checkpoint, writes there and rewrites those two files alone."""
    import hashlib

    from tasks.types import PreparedData
    from training_core.config import DataConfig, WorkloadConfig
    from training_core.data import MANIFEST_NAME, Manifest

    config = DataConfig(dataset="stdlib", max_text_bytes=200_000, seq_len=32, num_shards=6)
    _write_literals(
        tmp_path / "inputs.pb",
        {"config": config, "workload": WorkloadConfig(name="causal_lm")},
        {"config": DataConfig, "workload": WorkloadConfig},
    )
    env = dict(subprocess_env, RAY_ADDRESS=ray_address, PYTHONPATH=str(REPO_ROOT))
    task = ("tasks.data", "prepare_on_ray")

    first = _execute(tmp_path, 1, env, prev='""', task=task)
    assert first.wait(timeout=300) == 0, (tmp_path / "attempt1.log").read_text()[-4000:]
    directory = Path(_output(tmp_path / "out1", PreparedData).directory.path)
    assert directory.is_relative_to(tmp_path / "raw"), "prep writes straight to the raw-output location"
    shards = {
        directory / s.file: s.sha256 for split in Manifest.load(str(directory)).splits.values() for s in split.shards
    }
    files = sorted(shards)
    missing, cut = files[1], files[-1]
    (directory / MANIFEST_NAME).unlink()
    missing.unlink()
    cut.write_bytes(cut.read_bytes()[:100])
    stamps = {path: path.stat().st_mtime_ns for path in files if path not in (missing, cut)}

    second = _execute(tmp_path, 2, env, prev=str(tmp_path / "A1"), task=task)
    assert second.wait(timeout=300) == 0, (tmp_path / "attempt2.log").read_text()[-4000:]
    assert Path(_output(tmp_path / "out2", PreparedData).directory.path) == directory
    assert all(path.stat().st_mtime_ns == stamp for path, stamp in stamps.items()), "a whole shard was rewritten"
    assert {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in files} == shards
    log = (tmp_path / "attempt2.log").read_text()
    assert "wrote 2 of %d shards" % len(files) in log and "in Ray tasks, 2 at a time" in log
