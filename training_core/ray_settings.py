"""The Ray and process settings the platform ships: every Ray cluster it starts or sizes gets them.

They are set where users run, not in benchmarks: the Ray tasks apply them before their ``ray.init`` starts a
local cluster (``pyflyte run`` on a laptop), and every RayJob pod (head and workers) carries them as
container environment, so ``ray start``, its daemons and every worker and loader process inherit them. A
variable already set in the environment is left as it is: a user restores Ray's or glibc's default by setting
it (for example ``RAY_worker_niceness=15``).

Why each one (figures from ``benchmarks/scaling.py`` and ``benchmarks/loop_overhead.py``, README "Ray's tax"):

- ``RAY_worker_niceness=0``. Ray starts worker processes at nice 15, below its nice-0 daemons (GCS, raylet,
  dashboard agents) and below anything else on the node. A training worker is the job, not background work:
  at nice 15 every daemon wake-up preempts it at once, and with DDP a rank that waits stalls every rank.
  Data-loader processes forked by a worker inherit its niceness too.
- ``MALLOC_ARENA_MAX=1``, ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``. Ray Train runs the loop in a
  thread of the worker process, and glibc gives such a thread an arena of its own: heaps of at most 64 MiB that are
  shrunk and grown again, so a step's activation and gradient buffers are faulted in again on every step (measured
  on a small CNN: ~1,800 minor page faults per step in a thread, ~11,700 on a main thread at glibc's defaults). One
  arena and the two thresholds (setting both turns off glibc's adaptive threshold) keep freed memory mapped: 0
  faults per step in a thread or not. Ray Train's throughput on one worker went from 0.79-0.92 of the plain
  launcher's to 1.00-1.02 (``benchmarks/scaling.py``, per round). Blocks above :data:`MMAP_THRESHOLD_BYTES` still
  get their own mapping and go back to the kernel when freed, and at most :data:`TRIM_THRESHOLD_BYTES` of free heap
  stays mapped per process. One arena serialises ``malloc`` between a process's threads: in a training process
  nearly every allocation comes from the training thread, and loader workers are processes of their own.
- ``TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S=5``. Before Ray Train restarts a worker group it asks every worker to
  destroy its process group and waits up to this long (Ray's default: 30 s). A hung rank (the very failure
  ``scaling.collective_timeout_s`` catches) never answers, so every hang cost 30 s more before the restart. A healthy
  group is destroyed in milliseconds, and a group cut short is discarded anyway: its workers are killed next.
  Measured (tests/distributed/test_recovery.py, SIGSTOP with a 15 s collective timeout): stall to resume 59 s at
  Ray's default, 30-35 s with it.
- ``RAY_kill_worker_timeout_milliseconds=1000``. When a worker actor is killed (``ray.kill``, a worker group torn
  down), the raylet asks the process to exit and SIGKILLs it after this long (Ray's default: 5 s). A rank whose
  collective timed out kills its peers' workers so the group restarts at once
  (:meth:`~training_core.distributed.RayTrainRuntime.abandon_group`); a hung peer never exits by itself, so it held
  the restart up for the whole 5 s. A worker that is killed is being discarded: its checkpoints are written or
  abandoned by then (a checkpoint's manifest comes last).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

MMAP_THRESHOLD_BYTES = 128 * 1024**2
"""Allocations up to this size come from the heap (glibc's default: 128 KiB, adapting upwards to 32 MiB)."""
TRIM_THRESHOLD_BYTES = 512 * 1024**2
"""Free memory at the top of a process's heap kept mapped for the next step (glibc's default: 128 KiB)."""

PROCESS_ENV: dict[str, str] = {
    "RAY_worker_niceness": "0",
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES),
    "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": "5",
    "RAY_kill_worker_timeout_milliseconds": "1000",
}
"""Environment of every process of a Ray cluster the platform starts (daemons, workers, loader processes).
All are read when a process starts (glibc at ``exec``, the raylet at ``ray start``), so they must be in the
environment before the cluster starts; setting them in a running worker does nothing."""


def apply_process_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each :data:`PROCESS_ENV` variable that ``environ`` (default ``os.environ``) does not set already.
    Call it before a local Ray cluster starts. Returns the values in effect afterwards."""
    environ = os.environ if environ is None else environ
    for name, value in PROCESS_ENV.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in PROCESS_ENV}


LOCAL_DASHBOARD_ENV = "TRAINING_LOCAL_RAY_DASHBOARD"
"""``1`` (default): a local cluster the platform starts runs Ray's dashboard; ``0``: it does not. Only for local
clusters: KubeRay submits RayJobs through the dashboard, so the RayJob pods always run it."""


def local_init_kwargs(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``ray.init`` arguments of a local cluster the platform starts, from :data:`LOCAL_DASHBOARD_ENV`."""
    environ = os.environ if environ is None else environ
    value = environ.get(LOCAL_DASHBOARD_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(
            f"{LOCAL_DASHBOARD_ENV}={value[:40]!r} is invalid: use 1 (a local run serves Ray's dashboard on "
            "http://127.0.0.1:8265) or 0 (no dashboard: its processes' CPU goes to training)"
        )
    return {"include_dashboard": value == "1"}


def start_local_cluster(**ray_init_kwargs: Any) -> dict[str, str]:
    """Start a local Ray cluster as the platform does: :func:`apply_process_env`, then ``ray.init`` with
    :func:`local_init_kwargs` and ``ray_init_kwargs`` (resources, for example). Returns the process settings."""
    import ray

    process_env = apply_process_env()
    ray.init(**local_init_kwargs(), **ray_init_kwargs)
    return process_env
