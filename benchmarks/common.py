"""What every benchmark shares: writing its result, and finding Ray Train worker processes."""

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
