"""A workload for tests: the built-in image workload, recording the sample ids of every batch a rank trains on.

Each training worker process (Ray Train sets its ``RANK``) appends one JSON line per batch (its ids) to
``$TMPDIR/sample-ids/<pid>.jsonl``; ``TMPDIR`` is the test session's directory in the Ray cluster's processes too
(``tests/conftest.py``). A short sleep per batch keeps an epoch long enough for a test to stop it in the middle.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from training_core.workloads.image import ImageClassification

BATCH_DELAY_S = 0.05


def records_dir() -> Path:
    return Path(tempfile.gettempdir()) / "sample-ids"


class SampleRecorder(ImageClassification):
    def to_device(self, manifest, device):
        convert = super().to_device(manifest, device)
        if "RANK" not in os.environ:
            # The driver's preflight runs a user workload once on one batch before any worker starts: not trained.
            return convert
        path = records_dir() / f"{os.getpid()}.jsonl"
        path.parent.mkdir(exist_ok=True)

        def record(batch):
            with open(path, "a") as f:
                f.write(json.dumps([int(i) for i in batch["sample_ids"]]) + "\n")
            time.sleep(BATCH_DELAY_S)
            return convert(batch)

        return record


def recorded() -> list[list[list[int]]]:
    """Every worker process's batches, in the order it trained them."""
    return [
        [json.loads(line) for line in path.read_text().splitlines()] for path in sorted(records_dir().glob("*.jsonl"))
    ]
