"""The platform's Ray settings (``training_core/parallel/ray_settings.py``) are set where users run: a Ray task run by
``pyflyte run`` on a laptop starts its own Ray cluster with them (the packaged RayJob's pods are decoded in
``test_packaging.py`` and ``test_rayjob_sizing.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from training_core.parallel.ray_settings import (
    DAEMONS_IDLE_ENV,
    LOCAL_DASHBOARD_ENV,
    POD_HOOK_COMMAND,
    PROCESS_ENV,
    apply_process_env,
    daemons_idle_enabled,
    process_table,
    ray_temp_dir,
)

# A Ray task declared as the platform declares its own (``ray_job_config``): it reports what a worker of the Ray
# cluster it runs on sees.
PROBE = textwrap.dedent(
    """
    import json
    import os

    import ray
    from flytekit import task

    from tasks.ray_config import ray_job_config
    from training_core.config import ScalingConfig
    from training_core.parallel.ray_settings import PROCESS_ENV


    @ray.remote(num_cpus=1)
    def worker_view() -> str:
        raylet = os.getppid()  # a Ray worker's parent; the raylet's is the process that started the cluster
        with open(f"/proc/{raylet}/stat") as f:
            driver = int(f.read().rsplit(")", 1)[1].split()[1])

        def parent(pid):
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])

        def label(pid):  # the program, or a Python daemon's script, or a Ray worker's title
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\\0")
            scripts = [arg for arg in argv[1:3] if arg.endswith(".py")]
            return os.path.basename(scripts[0] if scripts else argv[0]).strip()

        def policies(pid):
            return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}

        def view(pids):
            seen = {}
            for pid in pids:
                seen.setdefault(label(pid), set()).update(policies(pid))
            return {name: sorted(p) for name, p in seen.items()}

        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        return json.dumps(
            {
                "niceness": os.nice(0),
                "env": {name: os.environ.get(name) for name in PROCESS_ENV},
                "policy": os.sched_getscheduler(0),
                "raylet": sorted(policies(raylet)),
                "beside_raylet": view(p for p in pids if p != raylet and parent(p) == driver),
                "raylet_children": view(p for p in pids if parent(p) == raylet),
            }
        )


    @task(task_config=ray_job_config(ScalingConfig()))
    def probe() -> str:
        return ray.get(worker_view.remote())
    """
)


def test_a_local_pyflyte_run_starts_its_ray_cluster_with_the_platforms_settings(subprocess_env, tmp_path):
    """Without ``RAY_ADDRESS``, flytekit's Ray task starts a local cluster in its ``ray.init``; ours puts the
    settings in the environment first, so Ray's workers run at nice 0 (Ray's default is 15) with glibc's malloc
    settings, and then puts the cluster's daemons (not the raylet, not the workers) under SCHED_IDLE."""
    (tmp_path / "probe.py").write_text(PROBE)
    env = {k: v for k, v in subprocess_env.items() if k != "RAY_ADDRESS" and k not in PROCESS_ENV}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env[LOCAL_DASHBOARD_ENV] = "0"  # the dashboard's start takes ~10 s of two cores; it is no part of the check
    # A temp dir of its own: ray.init joins a cluster that `ray start` recorded under RAY_TMPDIR (the session's).
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="local-", dir=os.environ.get("TMPDIR"))
    proc = subprocess.run(
        ["pyflyte", "run", "probe.py", "probe"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    view = json.loads(proc.stdout.strip().splitlines()[-1])
    beside_raylet, raylet_children = view.pop("beside_raylet"), view.pop("raylet_children")
    assert view == {"niceness": 0, "env": PROCESS_ENV, "policy": os.SCHED_OTHER, "raylet": [os.SCHED_OTHER]}
    # What the driver started beside the raylet: the GCS, the log monitor, the autoscaler's monitor and the
    # dashboard's head (Ray starts it for its API even without the dashboard's UI), all under SCHED_IDLE. The
    # raylet's children (workers, this one included, and its agents) are not.
    daemons = {name: beside_raylet.get(name) for name in ("gcs_server", "log_monitor.py", "monitor.py", "dashboard.py")}
    assert daemons == dict.fromkeys(daemons, [os.SCHED_IDLE]), beside_raylet
    assert "ray::worker_view" in raylet_children and "ray::RuntimeEnvAgent" in raylet_children, raylet_children
    assert all(policies == [os.SCHED_OTHER] for policies in raylet_children.values()), raylet_children


def test_a_rayjob_pods_hook_puts_the_daemons_that_ray_start_started_under_sched_idle(subprocess_env):
    """The ``postStart`` hook every RayJob container carries (POD_HOOK_COMMAND, as the packaging tests decode it),
    run beside a real ``ray start --head`` under its own ``RAY_TMPDIR``: it waits for the raylet in the
    background, then sets the daemons; the raylet and its workers keep the default policy."""
    temp_root = Path(tempfile.mkdtemp(prefix="hook-", dir=os.environ.get("TMPDIR")))
    env = {k: v for k, v in subprocess_env.items() if k != "RAY_ADDRESS"}
    env.update({"RAY_TMPDIR": str(temp_root), "PYTHONPATH": str(REPO_ROOT)})
    hook = subprocess.run(POD_HOOK_COMMAND, env=env, timeout=30)  # returns at once: the work is in the background
    assert hook.returncode == 0
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--num-cpus=1", "--include-dashboard=false", "--port=0"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            table = process_table()
            ours = {pid: argv for pid, (_, argv) in table.items() if str(temp_root) in " ".join(argv)}
            gcs = [pid for pid, argv in ours.items() if argv[0].endswith("/gcs_server")]
            raylets = [pid for pid, argv in ours.items() if argv[0].endswith("/raylet")]
            log_monitors = [pid for pid, argv in ours.items() if any(a.endswith("/log_monitor.py") for a in argv[1:3])]
            daemons = gcs + log_monitors
            if raylets and len(daemons) == 2 and all(_policies(pid) == {os.SCHED_IDLE} for pid in daemons):
                break
            assert time.monotonic() < deadline, f"not under SCHED_IDLE after 120 s: {[ours[p] for p in daemons]}"
            time.sleep(1)
        (raylet,) = raylets
        assert _policies(raylet) == {os.SCHED_OTHER}
        agents_and_workers = [pid for pid, (ppid, _) in table.items() if ppid == raylet]
        assert agents_and_workers and all(_policies(pid) == {os.SCHED_OTHER} for pid in agents_and_workers)
    finally:
        # SIGKILL, not SIGTERM: the daemons are set before `ray start` has finished starting, and a SIGTERM then left
        # it waiting for the raylet the same SIGTERM had stopped until our 30 s wait ran out (34 s of the test's 41 in
        # the suite); a graceful stop of a started head takes ~8 s more. How the cluster stops is no part of the check.
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
        _kill_environment_of(str(temp_root))  # the hook's watcher (its environment names temp_root), daemons left


def _kill_environment_of(temp_root: str) -> None:
    """SIGKILL every process whose environment has ``RAY_TMPDIR=temp_root``."""
    marker = f"RAY_TMPDIR={temp_root}".encode()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def _policies(pid: int) -> set[int]:
    policies = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            policies.add(os.sched_getscheduler(int(tid)))
        except OSError:
            pass  # a thread that ended
    return policies


def test_the_pods_hook_finds_the_cluster_where_ray_start_puts_it():
    assert ray_temp_dir({"RAY_TMPDIR": "/a", "TMPDIR": "/b"}) == "/a/ray"
    assert ray_temp_dir({"TMPDIR": "/b"}) == "/b/ray" and ray_temp_dir({}) == "/tmp/ray"


def test_the_daemon_policy_setting_is_validated():
    assert daemons_idle_enabled({}) and not daemons_idle_enabled({DAEMONS_IDLE_ENV: "0"})
    with pytest.raises(ValueError, match=f"{DAEMONS_IDLE_ENV}='yes' is invalid: use 1 .* or 0"):
        daemons_idle_enabled({DAEMONS_IDLE_ENV: "yes"})


def test_a_setting_the_user_made_is_kept():
    environ = {"RAY_worker_niceness": "15"}
    in_effect = apply_process_env(environ)
    assert in_effect == {**PROCESS_ENV, "RAY_worker_niceness": "15"} == environ


def test_the_local_dashboard_setting_is_validated():
    from training_core.parallel.ray_settings import local_init_kwargs

    assert local_init_kwargs({}) == {"include_dashboard": True}
    assert local_init_kwargs({LOCAL_DASHBOARD_ENV: "0"}) == {"include_dashboard": False}
    with pytest.raises(ValueError, match=f"{LOCAL_DASHBOARD_ENV}='off' is invalid: use 1 .* or 0"):
        local_init_kwargs({LOCAL_DASHBOARD_ENV: "off"})
