"""``prepare_data``: raw dataset -> sharded splits with a manifest, cached by config."""

from __future__ import annotations

import os
from datetime import timedelta

from flytekit import Cache, Resources, current_context, task

from tasks.artifacts import tracked_directory
from tasks.types import PreparedData
from training_core.config import DataConfig, WorkloadConfig

# Bump when the shard format or split logic changes, so cached outputs are not reused.
# 4: Parquet shards of encoded images (cifar10, image_folder), manifest v4; 3: manifest v3 (workload, arrays);
# 2: label ranges; CIFAR checked at read
PREPARE_DATA_CACHE_VERSION = "4"


@task(
    cache=Cache(version=PREPARE_DATA_CACHE_VERSION),
    retries=2,
    interruptible=True,  # idempotent and cached: a preempted attempt is simply redone
    timeout=timedelta(hours=2),
    requests=Resources(cpu="1", mem="2Gi"),
    limits=Resources(cpu="2", mem="8Gi"),
)
def prepare_data(config: DataConfig, workload: WorkloadConfig = WorkloadConfig()) -> PreparedData:
    """Read the dataset, split it into train/val/test and write each split as shards plus a manifest.

    :param config: Which dataset, where its raw files are, split fractions, shard count, image size or text
        tokenizer and sequence length. Outputs are cached per distinct config and workload.
    :param workload: Which workload prepares the data: a built-in (image_classification, causal_lm) or user code.
    :return: The shard directory and the manifest's split counts, classes and input shape.
    """
    from training_core.workloads import resolve_workload

    out_dir = os.path.join(current_context().working_directory, "prepared")
    manifest = resolve_workload(workload).prepare_data(config, out_dir)
    return PreparedData(
        directory=tracked_directory(out_dir),
        workload=manifest.workload,
        dataset=manifest.dataset,
        num_classes=manifest.num_classes,
        input_shape=list(manifest.input_shape),
        split_counts=manifest.split_counts(),
    )
