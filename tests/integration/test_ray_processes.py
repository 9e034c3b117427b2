"""Ray processes left behind: a Ray Train run's, found in Ray's actor table and ended when ``fit`` returns
(training_core/runners/ray_processes.py), and a test session's, which fail the session (tests/conftest.py). Real
processes
under Ray's process titles, real signals, and a real pytest session with a real Ray cluster."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from ray.core.generated import gcs_pb2

from tests.conftest import REPO_ROOT, leftover_ray_processes
from training_core.runners.ray_processes import RunProcess, local_processes, reap, run_actors, start_ticks

ME, OTHER = b"driver-worker-id", b"other-driver-id"
NODE, OTHER_NODE = b"this-node", b"other-node"


def titled_process(title: str, *, ignore_sigterm: bool = False, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A real process whose command line is ``title`` (as Ray titles its workers), running until killed; one that
    ignores SIGTERM stays when asked to exit, as a process stuck in its exit does."""
    trap = "trap '' TERM; " if ignore_sigterm else ""
    process = subprocess.Popen(["bash", "-c", f"{trap}exec -a '{title}' sleep 600"], env=env)
    deadline = time.monotonic() + 10
    while not open(f"/proc/{process.pid}/cmdline", "rb").read().startswith(title.encode()):
        assert time.monotonic() < deadline, "the process never took its title"
        time.sleep(0.01)
    return process


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def run_process(process: subprocess.Popen, name: str) -> RunProcess:
    return RunProcess(pid=process.pid, name=name, start_ticks=start_ticks(process.pid))


def test_a_run_process_that_ignores_sigterm_is_killed_after_the_wait_and_named(processes, caplog):
    stuck = titled_process("ray::TrainController", ignore_sigterm=True)
    processes.append(stuck)
    os.kill(stuck.pid, signal.SIGTERM)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="training_core.runners.ray_processes"):
        killed = reap([run_process(stuck, "TrainController")], wait_s=0.5)
    assert time.monotonic() - started >= 0.5
    assert stuck.wait(timeout=10) == -signal.SIGKILL
    assert [p.pid for p in killed] == [stuck.pid]
    assert f"Ray process {stuck.pid} (ray::TrainController) of the finished run did not exit within 0.5 s" in (
        caplog.text
    )


def test_a_run_process_that_exits_within_the_wait_is_left_to_exit(processes, caplog):
    exiting = subprocess.Popen(["bash", "-c", "exec -a ray::DatasetManager sleep 0.5"])
    processes.append(exiting)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="training_core.runners.ray_processes"):
        assert reap([run_process(exiting, "DatasetManager")], wait_s=30) == []
    assert time.monotonic() - started < 10  # done when it exited, not at the end of the wait
    assert exiting.wait(timeout=10) == 0 and caplog.text == ""


def test_a_process_that_took_over_a_run_process_pid_is_not_killed(processes):
    newer = titled_process("ray::TrainController", ignore_sigterm=True)
    processes.append(newer)
    # The run's process had this pid, but started at another time: it is gone, and the pid is another process's.
    earlier = RunProcess(pid=newer.pid, name="TrainController", start_ticks=start_ticks(newer.pid) - 1)
    assert reap([earlier], wait_s=0.2) == []
    time.sleep(0.2)
    assert newer.poll() is None


def actor(
    actor_id: bytes,
    class_name: str,
    *,
    owner: bytes,
    worker: bytes,
    node: bytes = NODE,
    pid: int = 0,
    detached: bool = False,
    name: str = "",
) -> gcs_pb2.ActorTableData:
    """A row of Ray's actor table: ``worker`` is the actor's own worker id, ``owner`` its owner's."""
    data = gcs_pb2.ActorTableData(actor_id=actor_id, class_name=class_name, pid=pid, is_detached=detached, name=name)
    data.owner_address.worker_id = owner
    data.address.worker_id = worker
    data.address.node_id = node
    return data


def test_a_runs_actors_are_its_new_controller_and_what_it_owns_but_shared_singletons():
    table = [
        actor(b"old", "TrainController", owner=ME, worker=b"w-old"),  # an earlier run of this process
        actor(b"old-worker", "RayTrainWorker", owner=b"w-old", worker=b"w-old-1"),
        actor(b"theirs", "TrainController", owner=OTHER, worker=b"w-theirs"),  # another process's run
        actor(b"theirs-worker", "RayTrainWorker", owner=b"w-theirs", worker=b"w-theirs-1"),
        actor(b"mine-not-a-run", "Counter", owner=ME, worker=b"w-counter"),
        actor(b"ctl", "TrainController", owner=ME, worker=b"w-ctl"),
        actor(b"worker", "RayTrainWorker", owner=b"w-ctl", worker=b"w-1"),
        actor(b"loader", "Loader", owner=b"w-1", worker=b"w-2"),  # owned by the run's worker
        actor(b"cleaner", "PlacementGroupCleaner", owner=b"w-ctl", worker=b"w-3", detached=True),
        actor(b"shared", "_AutoscalingCoordinatorActor", owner=b"w-ctl", worker=b"w-4", detached=True, name="AC"),
    ]
    found = run_actors(table, created_after={b"old", b"old-worker", b"theirs", b"mine-not-a-run"}, owner_worker_id=ME)
    assert sorted(a.actor_id for a in found) == [b"cleaner", b"ctl", b"loader", b"worker"]


def test_only_live_local_processes_under_their_actors_title_count(processes):
    worker = titled_process("ray::RayTrainWorker.run_train_fn")
    processes.append(worker)
    actors = [
        actor(b"a", "RayTrainWorker", owner=ME, worker=b"w", pid=worker.pid),
        actor(b"b", "TrainController", owner=ME, worker=b"w", pid=worker.pid),  # not its title: not its process
        actor(b"c", "RayTrainWorker", owner=ME, worker=b"w", pid=worker.pid, node=OTHER_NODE),  # a pid elsewhere
        actor(b"d", "RayTrainWorker", owner=ME, worker=b"w", pid=0),  # never started
    ]
    assert local_processes(actors, NODE) == [
        RunProcess(pid=worker.pid, name="RayTrainWorker", start_ticks=start_ticks(worker.pid))
    ]


def test_a_ray_process_started_with_the_sessions_directory_is_killed_and_reported(processes, tmp_path):
    root, elsewhere = tmp_path / "session", tmp_path / "another-session"
    env = {**os.environ, "TMPDIR": str(root), "RAY_TMPDIR": str(root)}
    stuck = titled_process("ray::TrainController", ignore_sigterm=True, env=env)
    exiting = subprocess.Popen(["bash", "-c", "exec -a ray::RayTrainWorker sleep 0.5"], env=env)
    not_ray = titled_process("sleep", env=env)
    theirs = titled_process("ray::TrainController", env={**os.environ, "TMPDIR": str(elsewhere)})
    processes.extend([stuck, exiting, not_ray, theirs])

    assert leftover_ray_processes(root, wait_s=2) == [(stuck.pid, "ray::TrainController 600")]
    assert stuck.wait(timeout=10) == -signal.SIGKILL
    assert exiting.wait(timeout=10) == 0  # it exited within the wait: not a leftover
    assert not_ray.poll() is None and theirs.poll() is None


INNER_TEST = """
import os
import subprocess


def test_a_ray_process_is_left_behind(ray_session):
    @ray_session.remote
    class Worker:
        def pid(self):
            return os.getpid()

    worker = Worker.remote()
    actor_pid = ray_session.get(worker.pid.remote())
    # As a Ray worker caught in its exit deadlock: it ignores SIGTERM and stays.
    stuck = subprocess.Popen(["bash", "-c", "trap '' TERM; exec -a ray::TrainController sleep 600"],
                             start_new_session=True)
    with open(os.environ["PIDS_FILE"], "w") as f:
        f.write(f"{actor_pid} {stuck.pid}")
"""


def test_a_session_whose_ray_process_outlives_its_cluster_fails_naming_only_that_process(
    subprocess_env, session_root, tmp_path
):
    test_file, pids_file = tmp_path / "test_inner.py", tmp_path / "pids"
    test_file.write_text(textwrap.dedent(INNER_TEST))
    # The inner session's directory goes under this one's, which is short: Ray's socket paths are limited.
    env = {**subprocess_env, "FRT_TEST_ROOT": str(session_root), "PIDS_FILE": str(pids_file)}
    env["FRT_LEFTOVER_WAIT_S"] = "3"  # what the stuck process costs the session; the cluster's need less
    env.pop("RAY_ADDRESS", None)  # the inner session starts a cluster of its own
    try:
        inner = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", "-rN",
             f"--rootdir={tmp_path}", str(test_file)],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        output = inner.stdout + inner.stderr
        assert pids_file.exists(), output
        actor_pid, stuck_pid = map(int, pids_file.read_text().split())
        assert inner.returncode == 1, output  # the test itself passed
        assert "1 passed" in output and "Ray processes left behind" in output, output
        assert f"pid {stuck_pid}: ray::TrainController 600" in output
        # The cluster's own processes, the actor's included, went with the cluster: only the stuck one is named.
        assert output.count("pid ") == 1 and str(actor_pid) not in output.split("Ray processes left behind")[1]
        assert start_ticks(stuck_pid) is None
    finally:
        if pids_file.exists() and start_ticks(stuck_pid := int(pids_file.read_text().split()[1])) is not None:
            os.kill(stuck_pid, signal.SIGKILL)  # the session before the change left it running
