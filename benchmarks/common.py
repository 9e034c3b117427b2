"""What every benchmark shares: writing its result, starting its Ray cluster, glibc's malloc settings for the
processes it starts, and finding Ray Train worker processes."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# Allocations below this size come from the heap, and this much free memory at its top stays mapped (glibc's
# defaults: 128 KiB each, adjusted upwards at run time). See ``scaling.py`` for why it matters.
KEEP_FREED_BYTES = 4 * 1024**3


def emit(name: str, result: dict[str, Any]) -> None:
    """Add the machine's description, write ``results/<name>.json`` and print the JSON as the last line."""
    result = {
        **result,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


def ray_train_worker_pids() -> list[int]:
    """PIDs of this node's Ray Train worker processes (their command line is ``ray::RayTrainWorker...``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def malloc_env(default_malloc: bool) -> dict[str, str]:
    """glibc settings that keep freed memory mapped (both are needed: setting either one turns off glibc's adaptive
    mmap threshold), or none with ``default_malloc``. glibc reads them when a process starts: put them in
    ``os.environ`` before starting the Ray cluster or any process they should apply to."""
    if default_malloc:
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(KEEP_FREED_BYTES), "MALLOC_TRIM_THRESHOLD_": str(KEEP_FREED_BYTES)}


def start_ray(*, num_cpus: int, worker_niceness: int, num_gpus: int | None = None) -> str | int:
    """Connect to ``RAY_ADDRESS`` when it is set (that cluster as it is), else start a local cluster of ``num_cpus``
    CPUs whose worker processes run at nice ``worker_niceness``. Returns the niceness, or ``"external cluster"``."""
    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return "external cluster"
    os.environ["RAY_worker_niceness"] = str(worker_niceness)
    ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)
    return worker_niceness
