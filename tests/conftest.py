"""Session-wide test environment.

- Everything temporary lives under one directory that is removed at the end (``TMPDIR``, ``RAY_TMPDIR``
  and ``HOME`` of subprocesses point there), so a run leaves nothing in /tmp.
- One Ray cluster is started per session, on demand, and shared: in-process tests ``ray.init`` to it, and
  ``pyflyte`` subprocesses attach to it through ``RAY_ADDRESS``.
- A Ray process of the session that outlives its cluster (Ray's exit deadlock, deployment/docs/troubleshooting.md)
  is killed at the end, and the session fails, naming it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from training_core.parallel.ray_settings import apply_process_env, process_table
from training_core.runners.launch import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# Set before anything imports ray or tempfile caches the directory. Kept short: Ray's socket paths are
# limited to ~107 characters.
_SESSION_ROOT = Path(tempfile.mkdtemp(prefix="frt-", dir=os.environ.get("FRT_TEST_ROOT", "/tmp")))
os.environ["TMPDIR"] = str(_SESSION_ROOT)
os.environ["RAY_TMPDIR"] = str(_SESSION_ROOT)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
# Ray Train's controller polls its workers every 2 s by default; the suite runs ~60 short Train runs, each
# waiting up to two polls to notice its start and end. A shorter interval only costs idle polling.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# Pin gloo to loopback so DDP tests never depend on the machine's network interfaces.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
tempfile.tempdir = None
# The session's Ray cluster, and every process the suite starts, run with the platform's Ray settings, as a
# user's run does (training_core/parallel/ray_settings.py).
apply_process_env()


# The session's S3 endpoint (moto, started on demand by the ``s3_server`` fixture). Its address and test
# credentials are in the environment before the Ray cluster starts, because Ray workers inherit the
# environment of `ray start`, as pods on a cluster get theirs from the pod spec.
S3_PORT = free_port()
S3_ENDPOINT = f"http://127.0.0.1:{S3_PORT}"
for _name, _value in {
    "AWS_ENDPOINT_URL": S3_ENDPOINT,
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "FLYTE_AWS_ENDPOINT": S3_ENDPOINT,
    "FLYTE_AWS_ACCESS_KEY_ID": "testing",
    "FLYTE_AWS_SECRET_ACCESS_KEY": "testing",
}.items():
    os.environ[_name] = _value


TESTS_DIR = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "distributed", "flyte", "tools", "gpu")
"""The suite's tiers: each is a folder of ``tests/`` and a marker (``pytest -m integration``) that every test in the
folder carries, set by :func:`pytest_collection_modifyitems`. docs/testing.md says what belongs in which."""


def pytest_collection_modifyitems(config, items) -> None:
    """Mark each test with its tier, the folder of ``tests/`` it is in."""
    for item in items:
        try:
            tier = item.path.relative_to(TESTS_DIR).parts[0]
        except ValueError:
            continue  # a test outside tests/ (an inner session's, in a temporary directory)
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


LEFTOVER_WAIT_S = float(os.environ.get("FRT_LEFTOVER_WAIT_S", "10"))
"""How long the session's Ray processes get to exit once its cluster has stopped (a worker notices its raylet's
end within a second or two). ``FRT_LEFTOVER_WAIT_S`` sets it for a session that leaves one on purpose (a test's)."""

_LEFT_BEHIND: list[tuple[int, str]] = []


def _is_ray_command(argv: list[str]) -> bool:
    """A Ray process's command line: a worker's or agent's title (``ray::...``), a Ray program (``raylet``,
    ``gcs_server``), script or module (dashboard, log monitor, client server), or the ``ray`` CLI."""
    return argv[0].startswith("ray::") or any(
        "/ray/" in arg or arg.startswith("ray.") or os.path.basename(arg) == "ray" for arg in argv[:3]
    )


def session_ray_processes(root: Path) -> dict[int, str]:
    """This machine's Ray processes started with ``root`` as their ``TMPDIR`` or ``RAY_TMPDIR``, as every process of
    a session's clusters is (they inherit it from ``ray start``, or from the process that started a local cluster):
    pid -> command line. Another session's processes, and zombies (their environment reads empty), are not."""
    wanted = {f"TMPDIR={root}".encode(), f"RAY_TMPDIR={root}".encode()}
    found = {}
    for pid, (_, argv) in process_table().items():
        if pid == os.getpid() or not _is_ray_command(argv):
            continue
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue  # exited, or another user's
        if wanted & environ:
            found[pid] = " ".join(argv).strip()
    return found


RUN_SHARED_TITLES = ("ray::IDLE", "ray::_AutoscalingCoordinatorActor")
"""Processes a Ray Train run may leave by design: Ray's pool of idle workers, and Ray Data's autoscaling coordinator
(a named detached actor that the first run creates and later runs share)."""


def new_run_processes(root: Path, before: dict[int, str]) -> dict[int, str]:
    """The Ray actor processes of ``root`` (:func:`session_ray_processes`) not in ``before``, but those a run leaves
    by design (:data:`RUN_SHARED_TITLES`): what a finished run left running."""
    return {
        pid: command
        for pid, command in session_ray_processes(root).items()
        if pid not in before and command.startswith("ray::") and not command.startswith(RUN_SHARED_TITLES)
    }


EXIT_BEGUN = "Destructing CoreWorkerProcessImpl"
"""What a Ray process's core-worker log says once its exit has begun (a clean exit logs more lines after it)."""


def kills_not_in_rays_exit(log_text: str, root: Path) -> list[str]:
    """The processes ``reaped_run`` logged as killed (``log_text``) that had not begun to exit by themselves: each
    one's core-worker log under ``root`` lacks :data:`EXIT_BEGUN`. A process whose exit had begun was caught in Ray
    2.60's exit deadlock (deployment/docs/troubleshooting.md: about 1 run in 20, not provoked by the run), which the
    kill is there for; one held alive, as Ray Train's SIGINT handler held a finished run's controller, never got
    that far."""
    import re

    not_exiting = []
    for pid, name in re.findall(r"Ray process (\d+) \(ray::(\S+)\) of the finished run did not exit", log_text):
        logs = list(root.rglob(f"python-core-worker-*_{pid}.log"))
        if not any(EXIT_BEGUN in log.read_text(errors="replace") for log in logs):
            not_exiting.append(f"{pid} (ray::{name})")
    return not_exiting


def leftover_ray_processes(root: Path, *, wait_s: float = LEFTOVER_WAIT_S) -> list[tuple[int, str]]:
    """The Ray processes of ``root`` (:func:`session_ray_processes`) still running after up to ``wait_s``: each is
    killed (``SIGKILL``) and returned with its command line."""
    deadline = time.monotonic() + wait_s
    found = session_ray_processes(root)
    while found and time.monotonic() < deadline:
        time.sleep(0.1)
        found = session_ray_processes(root)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    return sorted(found.items())


@pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down
def pytest_sessionfinish(session) -> None:
    """Stop the session's cluster; a Ray process of the session that outlives it fails the session."""
    _stop_ray_cluster()
    _LEFT_BEHIND.extend(leftover_ray_processes(_SESSION_ROOT))
    if _LEFT_BEHIND:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if not _LEFT_BEHIND:
        return
    terminalreporter.section("Ray processes left behind", red=True)
    for pid, command in _LEFT_BEHIND:
        terminalreporter.line(f"pid {pid}: {command[:200]}")
    terminalreporter.line(
        f"{len(_LEFT_BEHIND)} Ray process(es) of this session outlived its cluster by {LEFTOVER_WAIT_S:g} s: "
        "killed; the session fails (deployment/docs/troubleshooting.md, 'A Ray process left behind')"
    )


def pytest_unconfigure(config) -> None:
    _stop_ray_cluster()  # when the session ended before pytest_sessionfinish
    shutil.rmtree(_SESSION_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def session_root() -> Path:
    return _SESSION_ROOT


_RAY_STATE: dict[str, object] = {}


def _stop_ray_cluster() -> None:
    """Stop this session's cluster only: it runs as its own process group (``ray stop`` would end every
    Ray process on the machine)."""
    ray = sys.modules.get("ray")  # not imported: no driver here (and no import at the end of a unit-test session)
    try:
        if ray is not None and ray.is_initialized():  # this process's driver, or a local cluster a test started in it
            ray.shutdown()
    except Exception:
        pass
    process = _RAY_STATE.pop("process", None)
    if process is None:
        return
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=wait_s)
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    _RAY_STATE.clear()


@pytest.fixture(scope="session")
def ray_address() -> str:
    """Address of the session's Ray cluster (4 logical CPUs so a 2-worker run and its controller fit)."""
    if "address" not in _RAY_STATE:
        temp_dir = _SESSION_ROOT / "ray"
        log = open(_SESSION_ROOT / "ray-head.log", "w")
        process = subprocess.Popen(
            [
                str(VENV_BIN / "ray"),
                "start",
                "--head",
                "--block",
                "--num-cpus=4",
                "--num-gpus=0",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--temp-dir={temp_dir}",
                "--port=0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Ray 2.60's `ray start --block` drains its node for up to 30 s on SIGTERM (for Ray Serve) before it
            # stops its processes: the session's stop timed out at 20 s and killed them all instead.
            env={**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},
        )
        _RAY_STATE["process"] = process
        address_file = temp_dir / "ray_current_cluster"
        deadline = time.monotonic() + 180
        while not (address_file.exists() and address_file.read_text().strip()):
            if process.poll() is not None or time.monotonic() > deadline:
                _stop_ray_cluster()
                pytest.fail(f"ray start failed:\n{(_SESSION_ROOT / 'ray-head.log').read_text()[-4000:]}")
            time.sleep(0.5)
        _RAY_STATE["address"] = address_file.read_text().strip()
        os.environ["RAY_ADDRESS"] = str(_RAY_STATE["address"])
    return str(_RAY_STATE["address"])


@pytest.fixture(scope="session")
def ray_session(ray_address: str):
    """This process attached to the shared cluster."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_address, log_to_driver=True)
    return ray


@pytest.fixture
def subprocess_env(session_root: Path, tmp_path: Path) -> dict[str, str]:
    """Environment for pyflyte subprocesses: private HOME (flytekit's local cache lives there)."""
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ)
    env.update({"HOME": str(home), "PYTHONUNBUFFERED": "1", "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"})
    return env


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 HTTP endpoint (moto in server mode) on 127.0.0.1, with bucket ``flyte``."""
    import urllib.request

    log = open(_SESSION_ROOT / "moto.log", "w")
    process = subprocess.Popen(
        [str(VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(S3_PORT)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(S3_ENDPOINT, timeout=1)
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"moto_server did not start:\n{(_SESSION_ROOT / 'moto.log').read_text()[-3000:]}")
            time.sleep(0.2)
    import boto3

    boto3.client("s3", endpoint_url=S3_ENDPOINT).create_bucket(Bucket="flyte")
    yield {"endpoint": S3_ENDPOINT, "bucket": "flyte", "process": process}
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=20)


def session_train_workers() -> list[int]:
    """This machine's Ray Train workers of the session's own cluster: ``ray start`` (see :func:`ray_address`) leads
    the session its raylet and workers run in, so another cluster's workers on the machine (another test run's, a
    benchmark's) are neither counted nor killed."""
    from benchmarks.common import ray_train_worker_pids

    leader = _RAY_STATE["process"].pid
    found = []
    for pid in ray_train_worker_pids():
        try:
            if os.getsid(pid) == leader:
                found.append(pid)
        except ProcessLookupError:
            continue
    return found


@pytest.fixture
def process_group(tmp_path):
    """A one-process gloo group, as Ray Train sets up for one worker (FSDP shards over it, DDP buckets in it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> str:
    """The default data (scikit-learn's digits, ``DataConfig()``: 4 shards a split), prepared once per session.
    Read only: a test that changes prepared data prepares its own."""
    from training_core.config import DataConfig
    from training_core.data import prepare

    out = tmp_path_factory.mktemp("digits")
    prepare(DataConfig(), str(out))
    return str(out)
