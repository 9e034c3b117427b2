"""Data: raw sources, sharded prep with a manifest, the per-worker shard streams and loader; :func:`prepare` runs
a workload's data prep.

``prepare`` writes each split as ``num_shards`` shard files (``.npz`` arrays, or Parquet encoded images) plus
``manifest.json``: split counts, classes, input shape, normalisation stats and every shard with its sha256, sample
count and label range. The directory may be local or any fsspec URI (``s3://...``). The public names of the data
layer are importable from here (users' workloads do: ``from training_core.data import Manifest, write_prepared``).

- :mod:`~training_core.data.sources`: the built-in raw sources (digits, synthetic, CIFAR-10), read into uint8 arrays.
- :mod:`~training_core.data.prepared`: the manifest, ``.npz`` shards and the per-worker :class:`ShardStream`, what the
  workloads write and read (they import it, never this package).
- :mod:`~training_core.data.shard_files`: what every shard reader checks and says.
- :mod:`~training_core.data.mapped_npz`: zero-copy reads of a local ``.npz`` shard (members memory-mapped).
- :mod:`~training_core.data.image_shards`: image datasets at scale, encoded images in Parquet shards written by Ray
  tasks.
- :mod:`~training_core.data.text`: tokenizers, text sources, the split by document and packing into sequences.
- :mod:`~training_core.data.loader`: the epoch's sample order, each rank's share, and the loader processes.
- :mod:`~training_core.data.fingerprint`: what prep reads, as one digest keying prep's cache.
"""

from __future__ import annotations

from training_core.config import DataConfig, WorkloadConfig
from training_core.data.prepared import (  # noqa: F401 - the data layer's names, importable from here
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
