"""Data: raw sources, sharded prep with a manifest, the per-worker shard streams and loader (README.md's module map
lists the modules); :func:`prepare` runs a workload's data prep.

``prepare`` writes each split as ``num_shards`` shard files (``.npz`` arrays, or Parquet encoded images) plus
``manifest.json``: split counts, classes, input shape, normalisation stats and every shard with its sha256, sample
count and label range. The directory may be local or any fsspec URI (``s3://...``). The public names of the data
layer are importable from here (users' workloads do: ``from training_core.data import Manifest, write_prepared``).
"""

from __future__ import annotations

from training_core.config import DataConfig, WorkloadConfig
from training_core.data.prepared import (  # noqa: F401 - the data layer's names, importable from here
    ARRAY_DTYPES,
    MANIFEST_NAME,
    SPLIT_NAMES,
    ArraySpec,
    Manifest,
    ShardInfo,
    ShardStream,
    read_shard,
    split_samples,
    write_prepared,
    write_shards,
)


def prepare(cfg: DataConfig, out_dir: str, *, workload: WorkloadConfig | None = None) -> Manifest:
    """Data prep of ``workload`` (default: image classification) for ``cfg``, written under ``out_dir``."""
    from training_core.workloads import resolve_workload

    return resolve_workload(workload or WorkloadConfig()).prepare_data(cfg, out_dir)
