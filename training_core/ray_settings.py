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
- ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``. glibc returns freed memory at the top of the heap
  to the kernel and serves large blocks with ``mmap``, so a step's activation and gradient buffers are faulted
  in again on every step (measured: ~4,900 minor page faults per step of a small CNN on CPU at glibc's
  defaults, ~100 with these). Setting both turns off glibc's adaptive threshold; blocks above
  :data:`MMAP_THRESHOLD_BYTES` still get their own mapping and go back to the kernel when freed, and at most
  :data:`TRIM_THRESHOLD_BYTES` of free heap stays mapped per process.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

MMAP_THRESHOLD_BYTES = 128 * 1024**2
"""Allocations up to this size come from the heap (glibc's default: 128 KiB, adapting upwards to 32 MiB)."""
TRIM_THRESHOLD_BYTES = 512 * 1024**2
"""Free memory at the top of a process's heap kept mapped for the next step (glibc's default: 128 KiB)."""

PROCESS_ENV: dict[str, str] = {
    "RAY_worker_niceness": "0",
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES),
}
"""Environment of every process of a Ray cluster the platform starts (daemons, workers, loader processes).
Both are read when a process starts (glibc at ``exec``, the raylet at ``ray start``), so they must be in the
environment before the cluster starts; setting them in a running worker does nothing."""


def apply_process_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each :data:`PROCESS_ENV` variable that ``environ`` (default ``os.environ``) does not set already.
    Call it before a local Ray cluster starts. Returns the values in effect afterwards."""
    environ = os.environ if environ is None else environ
    for name, value in PROCESS_ENV.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in PROCESS_ENV}
