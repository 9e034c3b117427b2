"""The data layer's entry point: :func:`prepare` runs a workload's data prep, beside what it writes and reads.

``prepare`` writes each split as ``num_shards`` shard files (``.npz`` arrays, or Parquet encoded images) plus
``manifest.json``: split counts, classes, input shape, normalisation stats and every shard with its sha256, sample
count and label range. The directory may be local or any fsspec URI (``s3://...``). The manifest, the shards and the
per-worker :class:`ShardStream` live in :mod:`training_core.prepared` (re-exported here), which the workloads use:
this module sits above them and they never import it.
"""

from __future__ import annotations

from training_core.config import DataConfig, WorkloadConfig
from training_core.prepared import (  # noqa: F401 - the data layer's names, importable from here
    ARRAY_DTYPES,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    SHARD_FORMATS,
    SPLIT_NAMES,
    ArraySamples,
    ArraySpec,
    Manifest,
    ShardInfo,
    ShardStream,
    SplitInfo,
    read_shard,
    split_samples,
    write_manifest,
    write_prepared,
    write_shards,
)


def prepare(cfg: DataConfig, out_dir: str, *, workload: WorkloadConfig | None = None) -> Manifest:
    """Data prep of ``workload`` (default: image classification) for ``cfg``, written under ``out_dir``."""
    from training_core.workloads import resolve_workload

    return resolve_workload(workload or WorkloadConfig()).prepare_data(cfg, out_dir)
