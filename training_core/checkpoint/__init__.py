"""Training checkpoints: this package owns how they are written, stored, verified, read back and restored.

A checkpoint is one directory ``step-<global step, 9 digits>`` under a root (a local path or any fsspec URI
such as ``s3://bucket/prefix``):

- ``model.pt``: the bare model's ``state_dict`` (no DDP ``module.`` prefix);
- ``trainer_state.pt``: optimizer, LR scheduler and GradScaler state, and the torch/CUDA RNG states;
- ``meta.json``: position (epoch, step in epoch, global step), best metric, python/numpy RNG states,
  metrics history, the resolved config, and what is needed to rebuild the model (name, classes, shape);
- ``manifest.json``: size and sha256 of each file above. It is written last, so a directory without a
  valid manifest is an incomplete checkpoint.

Everything read back is data, checked before use (:func:`verify_and_load`): the manifest against its schema (it
cannot point outside its directory), every file against the manifest, the tensor files by
``torch.load(weights_only=True)``, ``meta.json`` by :meth:`CheckpointMeta.from_dict`, a sharded checkpoint's
``shards/.metadata`` by a bounded unpickler (:mod:`.shard_metadata`). A checkpoint that fails any check raises
:class:`CheckpointError`, and :func:`load_latest_valid` falls back to the next older one (by parsed step). Messages
and log lines show storage URIs with their credentials redacted; the I/O uses the real root.

Local roots are written to a temporary directory and renamed into place (atomic). Object stores get the
files first and the manifest last.

:class:`Checkpointer` saves asynchronously: ``save`` copies tensors to CPU memory (the only part the
training step waits for) and a background thread serialises, writes and prunes. At most one save is in
flight; the next ``save`` waits for it instead of piling up.
"""

from training_core.checkpoint.checkpointer import Checkpointer  # noqa: F401 - the package's names, importable here
from training_core.checkpoint.layout import (  # noqa: F401
    CHECKPOINT_FILES,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
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
from training_core.checkpoint.load import (  # noqa: F401
    LoadedCheckpoint,
    load_directory,
    load_latest_valid,
    load_meta,
    verify_and_load,
)
from training_core.checkpoint.manifest import CheckpointManifest, file_entry, manifest_for  # noqa: F401
from training_core.checkpoint.meta import CheckpointMeta  # noqa: F401
from training_core.checkpoint.partial import base_sha256  # noqa: F401
from training_core.checkpoint.restore import build_saved_model, load_model, model_state_shapes, restore  # noqa: F401
from training_core.checkpoint.shard_metadata import parse_shard_metadata  # noqa: F401
from training_core.checkpoint.snapshot import detached, encode, snapshot  # noqa: F401
from training_core.checkpoint.storage import CheckpointStorage, Storage, open_storage  # noqa: F401
