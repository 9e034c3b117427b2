"""The platform's Ray settings (``training_core/ray_settings.py``) are set where users run: a Ray task run by
``pyflyte run`` on a laptop starts its own Ray cluster with them (the packaged RayJob's pods are decoded in
``test_packaging.py`` and ``test_rayjob_sizing.py``)."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from tests.conftest import REPO_ROOT
from training_core.ray_settings import LOCAL_DASHBOARD_ENV, PROCESS_ENV, apply_process_env

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
        return json.dumps({"niceness": os.nice(0), "env": {name: os.environ.get(name) for name in PROCESS_ENV}})


    @task(task_config=ray_job_config(ScalingConfig()))
    def probe() -> str:
        return ray.get(worker_view.remote())
    """
)


def test_a_local_pyflyte_run_starts_its_ray_cluster_with_the_platforms_settings(subprocess_env, tmp_path):
    """Without ``RAY_ADDRESS``, flytekit's Ray task starts a local cluster in its ``ray.init``; ours puts the
    settings in the environment first, so Ray's workers run at nice 0 (Ray's default is 15) with glibc's malloc
    settings."""
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
    assert view == {"niceness": 0, "env": PROCESS_ENV}


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
