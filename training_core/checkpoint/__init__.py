"""Training checkpoints: this package owns how they are written, stored, verified, read back and restored.

A checkpoint is one directory ``step-<global step, 9 digits>`` under a root (a local path or any fsspec URI
such as ``s3://bucket/prefix``):

- ``model.pt``: the bare model's ``state_dict`` (no DDP ``module.`` prefix);
- ``trainer_state.pt``: optimizer, LR scheduler and GradScaler state, and the torch/CUDA RNG states;
- ``meta.json``: position (epoch, step in epoch, global step), best metric, python/numpy RNG states,
  metrics history, the resolved config, and what is needed to rebuild the model (name, classes, shape);
- ``manifest.json``: size and sha256 of each file above. It is written last, so a directory without a
  valid manifest is an incomplete checkpoint.

Everything read back is data, checked before use: the manifest against its schema (the three file names above and
nothing else, so it cannot point outside its directory), every file against the manifest, the tensor files by
``torch.load(weights_only=True)`` and their shape, ``meta.json`` by :meth:`CheckpointMeta.from_dict`, a sharded
checkpoint's ``shards/.metadata`` by a bounded unpickler that builds only torch's records, each stored in a shard the
manifest lists (:mod:`.shard_metadata`; the restore loads by the parsed copy and never reads the file again). A
checkpoint that fails any check raises :class:`CheckpointError`, and :func:`load_latest_valid` falls back to the next
older one.
Step directories are ordered by their parsed step. Messages and log lines show storage URIs with their credentials
redacted (:func:`~training_core.redact.redact`); the I/O uses the real root.

Local roots are written to a temporary directory and renamed into place (atomic). Object stores get the
files first and the manifest last. Every file is verified against the manifest before loading, and tensor
files are read with ``torch.load(weights_only=True)``, which never executes pickled code.

:class:`Checkpointer` saves asynchronously: ``save`` copies tensors to CPU memory (the only part the
training step waits for) and a background thread serialises, writes and prunes. At most one save is in
flight; the next ``save`` waits for it instead of piling up.

Modules: ``layout`` (names, formats, the shared error), ``meta`` (``meta.json``), ``manifest`` (``manifest.json``),
``snapshot`` (the state saved, encoded), ``storage`` (the :class:`Storage` seam and :func:`open_storage`),
``checkpointer`` (policy, async writes, retention), ``load`` (verify and load), ``shard_metadata`` (``.metadata``
checks), ``restore`` (into live objects, model rebuild).
"""

from training_core.checkpoint.checkpointer import Checkpointer, SaveObserver
from training_core.checkpoint.layout import (
    CHECKPOINT_FILES,
    MANIFEST_FILE,
    META_FILE,
    MODEL_FILE,
    SHARD_METADATA_FILE,
    SHARDED_FILES,
    SHARDS_DIR,
    STEP_LOG_CAPACITY,
    TRAINER_STATE_FILE,
    CheckpointError,
    step_name,
)
from training_core.checkpoint.load import (
    LoadedCheckpoint,
    load_directory,
    load_latest_valid,
    load_meta,
    verify_and_load,
)
from training_core.checkpoint.manifest import CheckpointManifest, ManifestEntry, file_entry, manifest_for
from training_core.checkpoint.meta import CheckpointMeta
from training_core.checkpoint.partial import base_sha256
from training_core.checkpoint.restore import build_saved_model, load_model, model_state_shapes, restore
from training_core.checkpoint.shard_metadata import parse_shard_metadata
from training_core.checkpoint.snapshot import detached, encode, snapshot
from training_core.checkpoint.storage import CheckpointStorage, Storage, open_storage

__all__ = [
    "CHECKPOINT_FILES",
    "MANIFEST_FILE",
    "META_FILE",
    "MODEL_FILE",
    "SHARDED_FILES",
    "SHARDS_DIR",
    "SHARD_METADATA_FILE",
    "STEP_LOG_CAPACITY",
    "TRAINER_STATE_FILE",
    "CheckpointError",
    "CheckpointManifest",
    "CheckpointMeta",
    "CheckpointStorage",
    "Checkpointer",
    "LoadedCheckpoint",
    "ManifestEntry",
    "SaveObserver",
    "Storage",
    "base_sha256",
    "build_saved_model",
    "detached",
    "encode",
    "file_entry",
    "load_directory",
    "load_latest_valid",
    "load_meta",
    "load_model",
    "manifest_for",
    "model_state_shapes",
    "open_storage",
    "parse_shard_metadata",
    "restore",
    "snapshot",
    "step_name",
    "verify_and_load",
]
