"""Elastic training on a real two-node Ray cluster on this machine: a head and a second node started with
``ray start --address``, one CPU each, so a 2-worker run is placed across both. The second node is lost mid-epoch
(its raylet and every process it started, SIGKILL): Ray Train restarts the group on the worker the cluster still
has room for (``scaling.min_workers: 1``), the loop keeps the global batch by accumulating and the epoch's position,
and the run finishes with each sample of the epoch trained once and the figures of an uninterrupted run."""

from __future__ import annotations

import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks.common import TwoNodeCluster
from tests.conftest import REPO_ROOT
from tests.helpers.image_data import write_jpegs
from tests.helpers.runtime import InProcessRuntime
from tests.helpers.sample_recorder import records_dir
from training_core import checkpoint as ckpt
from training_core.config import DataConfig, TrainingConfig
from training_core.data import Manifest, ShardStream, prepare
from training_core.records import WorkerArgs
from training_core.runners.ray_train import checkpoint_root
from training_core.train.loop import run_worker

BATCH_SIZE = 8
INTERVAL_STEPS = 4

_DRIVER = """
import json, sys
import ray
from training_core.config import TrainingConfig
from training_core.runners.ray_train import fit

config, names = json.loads(sys.argv[1]), json.loads(sys.argv[2])
ray.init(address=names.pop("address"))
result = fit(TrainingConfig.from_dict(config), **names)
# One write with its newline: Ray's threads print to the same stdout, and print() writes the line and its end apart.
sys.stdout.write("RESULT " + json.dumps({
    "resumed_from_steps": result.meta.resumed_from_steps,
    "resume_timings": result.meta.resume_timings,
    "global_step": result.meta.global_step,
    "history": [r.__dict__ for r in result.meta.history],
}) + "\\n")
sys.stdout.flush()
"""


@pytest.fixture(scope="module")
def two_nodes():
    """One cluster for the module's tests: each leaves its second node lost or drained, and the next test that needs
    one starts a new one (``restore_second_node``), seconds instead of a new cluster."""
    workdir = tempfile.mkdtemp(prefix="nodes-")  # in the session's short TMPDIR: Ray's socket paths are bounded
    cluster = TwoNodeCluster(Path(workdir))
    # Ray Train's preemption watcher polls the drains every second (5 s by default). Its callback reads this in the
    # Train controller, a process of the cluster: it must be in the nodes' environment, not only the driver's.
    cluster.env["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "1"
    with cluster:
        yield cluster
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, str]:
    """The module's image tree and its prepared shards (read-only for the runs): the source path and the data dir."""
    root = tmp_path_factory.mktemp("elastic-data")
    tree = write_jpegs(root / "images", per_class=120, side=16)
    data_dir = str(root / "prepared")
    prepare(DataConfig(dataset="image_folder", path=str(tree), image_size=16, num_shards=4), data_dir)
    return tree, data_dir


def _config(tree: Path) -> dict:
    return {
        "workload": {"name": "tests.helpers.sample_recorder:SampleRecorder"},
        "data": {"dataset": "image_folder", "path": str(tree), "image_size": 16, "num_shards": 4},
        "model": {"name": "small_cnn"},
        "loop": {"epochs": 1, "batch_size": BATCH_SIZE},
        # The restart right after the loss may still count the lost node (until the cluster declares it dead, ~3 s
        # here): it gives up after elastic_start_timeout_s and goes on with the worker left.
        "scaling": {
            "num_workers": 2,
            "min_workers": 1,
            "elastic_resize_interval_s": 3600,
            "elastic_start_timeout_s": 5,
        },
        "checkpoint": {"interval_steps": INTERVAL_STEPS, "max_worker_restarts": 2},
        "observability": {"enabled": False},
    }


def _driver(config: dict, names: dict, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _DRIVER, json.dumps(config), json.dumps(names)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _result(driver: subprocess.Popen, timeout_s: float) -> tuple[dict, str]:
    output, _ = driver.communicate(timeout=timeout_s)
    assert driver.returncode == 0, output[-6000:]
    (line,) = [line for line in output.splitlines() if line.startswith("RESULT ")]
    # raw_decode: a log line of Ray's that still lands after the object on the same line is not part of it.
    return json.JSONDecoder().raw_decode(line.removeprefix("RESULT "))[0], output


def _refresh_capacity_view(cluster: TwoNodeCluster) -> None:
    """An elastic run sizes its group from the capacity view of Ray's AutoscalingCoordinator, a detached actor of the
    cluster that refreshes it every 20 s: after the previous test, it may not count the node just restored yet, and
    the run would start on one worker. Ask it to recompute now (absent on a fresh cluster: nothing to refresh)."""
    cluster.ask(
        "try:\n    actor = ray.get_actor('AutoscalingCoordinator', namespace='AutoscalingCoordinator')\n"
        "except ValueError:\n    actor = None\n"
        "if actor is not None:\n    ray.get(actor.get_reserved_resources.remote('refresh', recompute=True))"
    )


def test_a_lost_node_shrinks_the_run_to_the_remaining_worker_which_finishes_the_epoch_once(
    two_nodes, prepared, tmp_path
):
    address, env = two_nodes.address, two_nodes.env
    tree, data_dir = prepared
    manifest = Manifest.load(data_dir)
    train_ids = set()
    for batch in ShardStream(manifest, "train", rank=0, world_size=1).eval_batches(batch_size=64):
        train_ids.update(batch["sample_ids"].tolist())
    steps_per_epoch = Manifest.load(data_dir).steps_per_epoch(world_size=2, batch_size=BATCH_SIZE, grad_accum_steps=1)
    assert steps_per_epoch > 2 * INTERVAL_STEPS + 2, "the loss must come mid-epoch"
    config = _config(tree)

    def names(run: str) -> dict:
        return {"address": address, "data_dir": data_dir, "checkpoint_dir": str(tmp_path / f"{run}-final"),
                "run_name": run, "storage_path": str(tmp_path / "runs")}  # fmt: skip

    # The uninterrupted run of the same global batch, in this process (2 x 8 samples a step as 8 x 2 on one rank:
    # DDP's equality with one process is proven in test_ddp.py).
    run_worker(
        WorkerArgs.build(TrainingConfig.from_dict(config), data_dir=data_dir, checkpoint_root=str(tmp_path / "whole"),
                         run_name="whole"),
        InProcessRuntime(),
    )  # fmt: skip
    whole = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(tmp_path / "whole"))).meta

    shutil.rmtree(records_dir(), ignore_errors=True)
    storage = ckpt.CheckpointStorage(checkpoint_root(str(tmp_path / "runs"), "elastic"))
    driver = _driver(config, names("elastic"), env)
    deadline = time.monotonic() + 300
    while not [s for s in storage.list_steps() if int(s.split("-")[1]) >= 2 * INTERVAL_STEPS]:
        assert driver.poll() is None and time.monotonic() < deadline, "the run ended or stalled before the loss"
        time.sleep(0.05)
    first_group = {path.name for path in records_dir().glob("*.jsonl")}
    assert len(first_group) == 2, "one recording per worker of the 2-worker group"
    # The node is lost: its raylet and every process it started (its Ray Train worker among them) die at once.
    lost_unix = two_nodes.lose_second_node()
    result, output = _result(driver, timeout_s=600)

    (resumed_from,) = result["resumed_from_steps"]
    assert 2 * INTERVAL_STEPS <= resumed_from < steps_per_epoch
    assert "elastic: 1 of scaling.num_workers=2 workers; micro-batch 8, 2 accumulation step(s)" in output
    resumed_s = result["resume_timings"][-1]["first_step_unix"] - lost_unix
    print(f"node lost to the first step on the remaining worker: {resumed_s:.1f} s")
    assert resumed_s < 60, "the restart should wait elastic_start_timeout_s, not Ray's 60 s, for the lost node"
    # Each sample of the epoch trained once: the 2 first workers' batches up to the resumed step, then the one
    # remaining worker's (validation batches hold other ids).
    runs = {
        path.name: [json.loads(line) for line in path.read_text().splitlines()]
        for path in records_dir().glob("*.jsonl")
    }
    assert len(runs) == 3, f"2 workers, then 1: {sorted(runs)}"
    trained = [i for name in first_group for batch in runs[name][:resumed_from] for i in batch]
    (second,) = [batches for name, batches in runs.items() if name not in first_group]
    trained += [i for batch in second for i in batch if i in train_ids]
    seen = collections.Counter(trained)
    assert max(seen.values()) == 1, "a sample was trained twice in the epoch"
    assert set(seen) <= train_ids and len(seen) >= len(train_ids) - 2 * BATCH_SIZE
    # The epoch's steps, and the uninterrupted run's figures within tolerance (the epoch's loss weighs the steps on
    # 2 workers and on 1 alike).
    assert result["global_step"] == steps_per_epoch
    (got,), (want,) = result["history"], whole.history
    assert got["val_accuracy"] == pytest.approx(want.val_accuracy, abs=0.1)
    assert got["train_loss"] == pytest.approx(want.train_loss, rel=0.25)


def test_a_preemption_notice_from_ray_saves_the_step_and_the_run_goes_on_without_the_drained_node(
    two_nodes, prepared, tmp_path
):
    """A spot reclaim announced through Ray: the second node is drained with reason preemption and a deadline (what
    KubeRay's autoscaler or a termination handler does; the node keeps running). Ray Train's preemption watcher
    tells every worker, the loop writes a just-in-time checkpoint of the step it is at and stops as preempted, and
    the run goes on with the worker the cluster still has room for: nothing is recomputed."""
    two_nodes.restore_second_node()  # the previous test lost it
    _refresh_capacity_view(two_nodes)
    tree, data_dir = prepared
    config = _config(tree)
    # The notice is read at log steps. The drain comes after the first epoch; five more leave the watcher (1 s polls)
    # seconds to see it before the run ends, where an epoch of this tiny model takes well under a second.
    epochs = 6
    config["loop"].update(epochs=epochs, log_interval_steps=1)
    # No interval checkpoint: a resume can only come from the just-in-time one.
    config["checkpoint"]["interval_steps"] = 10_000
    steps_per_epoch = Manifest.load(data_dir).steps_per_epoch(world_size=2, batch_size=BATCH_SIZE, grad_accum_steps=1)
    names = {"address": two_nodes.address, "data_dir": data_dir, "checkpoint_dir": str(tmp_path / "final"),
             "run_name": "noticed", "storage_path": str(tmp_path / "runs")}  # fmt: skip
    driver = _driver(config, names, two_nodes.env)
    shutil.rmtree(records_dir(), ignore_errors=True)
    deadline = time.monotonic() + 300
    while sum(len(p.read_text().splitlines()) for p in records_dir().glob("*.jsonl")) < steps_per_epoch:  # mid-epoch
        assert driver.poll() is None and time.monotonic() < deadline, "the run ended or stalled before the notice"
        time.sleep(0.05)
    assert len(list(records_dir().glob("*.jsonl"))) == 2, "the run must start on both nodes"
    drained_unix = two_nodes.drain_second_node(deadline_s=120)
    result, output = _result(driver, timeout_s=600)

    notices = [line for line in output.splitlines() if re.search("preempt|drain|restart|resum", line, re.I)][:20]
    assert len(result["resumed_from_steps"]) == 1, f"one resume after the notice: {result}; {notices}"
    (resumed_from,) = result["resumed_from_steps"]
    (timing,) = result["resume_timings"]
    assert timing["preempted"] == 1 and timing["num_workers"] == 1, timing
    # The last step the 2-worker group logged is the step the run resumed from: nothing computed twice.
    before_restart = output.split("resumed from", 1)[0]
    last_logged = max(int(step) for step in re.findall(r"\[rank 0\] step=(\d+) epoch=", before_restart))
    assert resumed_from == last_logged and 0 < resumed_from < epochs * steps_per_epoch
    assert "Ray Train's notice that its node is being preempted" in output
    assert f"preempted: checkpoint of step {resumed_from} saved" in output
    assert result["global_step"] == epochs * steps_per_epoch
    print(f"notice to the first step on the remaining worker: {timing['first_step_unix'] - drained_unix:.1f} s")
