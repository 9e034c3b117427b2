"""The platform's Ray settings (``training_core/ray_settings.py``) are set where users run: a Ray task run by
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
from training_core.ray_settings import (
    DAEMONS_IDLE_ENV,
    LOCAL_DASHBOARD_ENV,
    POD_HOOK_COMMAND,
    PROCESS_ENV,
    apply_process_env,
    daemons_idle_enabled,
    process_table,
    ray_daemon_pids,
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
    from training_core.ray_settings import PROCESS_ENV


    @ray.remote(num_cpus=1)
    def worker_view() -> str:
        from training_core.ray_settings import ray_daemon_pids

        raylet = os.getppid()  # a Ray worker's parent; the raylet's is the process that started the cluster
        with open(f"/proc/{raylet}/stat") as f:
            driver = int(f.read().rsplit(")", 1)[1].split()[1])

        def policies(pid):
            return sorted({os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")})

        def name(pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return os.path.basename(f.read().split(b"\\0")[0].decode()) or "?"

        return json.dumps(
            {
                "niceness": os.nice(0),
                "env": {name: os.environ.get(name) for name in PROCESS_ENV},
                "policy": os.sched_getscheduler(0),
                "raylet_policies": policies(raylet),
                "daemons": {name(pid): policies(pid) for pid in ray_daemon_pids(parent_pid=driver)},
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
    daemons = view.pop("daemons")
    assert view == {
        "niceness": 0,
        "env": PROCESS_ENV,
        "policy": os.SCHED_OTHER,
        "raylet_policies": [os.SCHED_OTHER],
    }
    # Without the dashboard (above): the GCS, the log monitor, the autoscaler's monitor and the raylet's agents.
    assert "gcs_server" in daemons and len(daemons) >= 3, daemons
    assert all(policies == [os.SCHED_IDLE] for policies in daemons.values()), daemons


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
            pids = ray_daemon_pids(ray_temp_dir=str(temp_root / "ray"))
            idle = {pid: _policies(pid) == {os.SCHED_IDLE} for pid in pids}
            if len(idle) >= 3 and all(idle.values()):
                break
            assert time.monotonic() < deadline, f"daemons not all under SCHED_IDLE after 120 s: {idle}"
            time.sleep(1)
        table = process_table()
        names = {os.path.basename(table[pid][1][0]) for pid in pids if pid in table}
        assert "gcs_server" in names and "raylet" not in names
        (raylet,) = [
            pid for pid, (_, argv) in table.items() if argv[0].endswith("/raylet") and str(temp_root) in " ".join(argv)
        ]
        assert _policies(raylet) == {os.SCHED_OTHER}
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-f", str(temp_root)], check=False)  # the hook's watcher and any daemon left


def _policies(pid: int) -> set[int]:
    policies = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            policies.add(os.sched_getscheduler(int(tid)))
        except OSError:
            pass  # a thread that ended
    return policies


def test_the_daemon_policy_setting_is_validated():
    assert daemons_idle_enabled({}) and not daemons_idle_enabled({DAEMONS_IDLE_ENV: "0"})
    with pytest.raises(ValueError, match=f"{DAEMONS_IDLE_ENV}='yes' is invalid: use 1 .* or 0"):
        daemons_idle_enabled({DAEMONS_IDLE_ENV: "yes"})


def test_a_setting_the_user_made_is_kept():
    environ = {"RAY_worker_niceness": "15"}
    in_effect = apply_process_env(environ)
    assert in_effect == {**PROCESS_ENV, "RAY_worker_niceness": "15"} == environ


def test_the_local_dashboard_setting_is_validated():
    from training_core.ray_settings import local_init_kwargs

    assert local_init_kwargs({}) == {"include_dashboard": True}
    assert local_init_kwargs({LOCAL_DASHBOARD_ENV: "0"}) == {"include_dashboard": False}
    with pytest.raises(ValueError, match=f"{LOCAL_DASHBOARD_ENV}='off' is invalid: use 1 .* or 0"):
        local_init_kwargs({LOCAL_DASHBOARD_ENV: "off"})
