"""What every benchmark shares: writing its result, starting its Ray cluster as the product does, and finding Ray
Train worker processes."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


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
    """PIDs of this node's Ray Train worker processes (their command line is ``ray::RayTrainWorker...``), not their
    loader processes (forked from a worker, they carry its command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    found[int(entry.name)] = parent
            except (OSError, IndexError, ValueError):
                continue
    return [pid for pid, parent in found.items() if parent not in found]


def start_ray(*, num_cpus: int, num_gpus: int | None = None) -> dict[str, str] | str:
    """Connect to ``RAY_ADDRESS`` when it is set (that cluster as it is: returns ``"external cluster"``), else start a
    local cluster of ``num_cpus`` CPUs the way the product's Ray task does: the platform's process settings
    and ``ray.init`` arguments (:func:`training_core.ray_settings.start_local_cluster`). A benchmark adds nothing
    a user does not get. Returns the process settings in effect."""
    import ray

    from training_core.ray_settings import start_local_cluster

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return "external cluster"
    return start_local_cluster(num_cpus=num_cpus, num_gpus=num_gpus)
