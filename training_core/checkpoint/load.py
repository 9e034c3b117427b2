"""Reading checkpoints back: every file verified against the manifest and decoded safely, and the newest valid one."""

from __future__ import annotations

import io
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from training_core.checkpoint.layout import (
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    MAX_META_BYTES,
    META_FILE,
    MODEL_FILE,
    SHARD_METADATA_FILE,
    SHARDS_DIR,
    TRAINER_STATE_FILE,
    CheckpointError,
    reason,
)
from training_core.checkpoint.manifest import CheckpointManifest, ManifestEntry, file_entry, sha256
from training_core.checkpoint.meta import CheckpointMeta, decode_meta
from training_core.checkpoint.shard_metadata import check_shard_metadata, parse_shard_metadata
from training_core.checkpoint.storage import Storage, open_storage, remove_local
from training_core.files import UnreadableFile, open_regular_local
from training_core.messages import quote
from training_core.redact import redact

log = logging.getLogger("training_core")


@dataclass
class LoadedCheckpoint:
    name: str
    uri: str
    """Where the checkpoint is, for I/O (with any credentials of its root): log :attr:`display_uri` instead."""
    model: dict[str, Any]
    """The model's state dict (a full checkpoint); empty for a sharded one, whose weights are in :attr:`shards_dir`."""
    trainer: dict[str, Any]
    meta: CheckpointMeta
    shards_dir: str = ""
    """A sharded checkpoint's verified ``torch.distributed.checkpoint`` files, on this machine."""
    owns_shards_dir: bool = False
    """:attr:`shards_dir` is a download of this process's: :meth:`release` removes it."""
    shard_metadata: Any = None
    """A sharded checkpoint's ``shards/.metadata``, parsed and checked (:func:`parse_shard_metadata`,
    :func:`check_shard_metadata`): :func:`restore` loads by it and never reads the file again."""

    @property
    def display_uri(self) -> str:
        """:attr:`uri` as messages show it, credentials redacted."""
        return redact(self.uri)

    def release(self) -> None:
        """Remove this process's download of the shards (once they are loaded)."""
        if self.owns_shards_dir:
            remove_local(self.shards_dir)
            self.owns_shards_dir = False


_TRAINER_STATE_KEYS = ("optimizer", "scheduler", "scaler", "rng", "replicas")


def verify_and_load(
    storage: Storage, name: str, *, expected_shapes: dict[str, tuple[int, ...]] | None = None
) -> LoadedCheckpoint:
    """Read one checkpoint, check every file against its manifest, and decode it safely.

    Raises :class:`CheckpointError` naming the checkpoint and the reason for anything that keeps it from loading:
    a missing or malformed manifest (see :meth:`CheckpointManifest.parse`), a missing, truncated or corrupt file,
    a tensor file that ``torch.load(weights_only=True)`` refuses or that does not hold a state dict (model) or the
    trainer's state dicts, and metadata that :meth:`CheckpointMeta.from_dict` refuses. A sharded checkpoint's
    ``shards/.metadata`` is parsed here, safely, and must name only shards the manifest lists
    (:func:`check_shard_metadata`); with ``expected_shapes`` (:func:`model_state_shapes` of the model it will be
    restored into) its weights must have those names and shapes. A full checkpoint's weights are not checked
    against ``expected_shapes``."""
    where = storage.display_uri(name)
    try:
        manifest_bytes = storage.read(name, MANIFEST_FILE, max_bytes=MAX_MANIFEST_BYTES)
    except (CheckpointError, FileNotFoundError) as exc:
        raise CheckpointError(
            f"{where} has no readable {MANIFEST_FILE} (incomplete write?): {storage.scrub(reason(exc))}"
        ) from None
    manifest = CheckpointManifest.parse(manifest_bytes, where=f"{where}/{MANIFEST_FILE}")
    payloads = {}
    for file, entry in manifest.files.items():
        if file in manifest.shards:
            continue
        try:
            data = storage.read(name, file, max_bytes=entry.num_bytes)
        except (CheckpointError, FileNotFoundError) as exc:
            raise CheckpointError(f"{where}/{file} is missing: {storage.scrub(reason(exc))}") from None
        _check_entry(ManifestEntry(num_bytes=len(data), sha256=sha256(data)), entry, where=f"{where}/{file}")
        payloads[file] = data
    if manifest.format == "full":
        return _decoded(storage, name, manifest, payloads)
    local = storage.local_path(name)
    shards_dir = f"{local}/{SHARDS_DIR}" if local else tempfile.mkdtemp(prefix=f"ckpt-{name}-")
    try:
        metadata_where = f"{where}/{SHARD_METADATA_FILE}"
        metadata_bytes = _verified_shards(storage, name, manifest, shards_dir, download=not local)
        shard_metadata = parse_shard_metadata(metadata_bytes, where=metadata_where)
        check_shard_metadata(shard_metadata, manifest, where=metadata_where, expected_shapes=expected_shapes)
        loaded = _decoded(storage, name, manifest, payloads)
    except BaseException:
        if not local:  # this process's download
            remove_local(shards_dir)
        raise
    loaded.shards_dir, loaded.owns_shards_dir, loaded.shard_metadata = shards_dir, not local, shard_metadata
    return loaded


def _decoded(storage: Storage, name: str, manifest: CheckpointManifest, payloads: dict[str, bytes]) -> LoadedCheckpoint:
    """The checkpoint of the verified ``payloads`` (its files besides the shards), decoded safely."""
    import torch

    where = storage.display_uri(name)
    tensors = {MODEL_FILE: {}}
    for file in (MODEL_FILE, TRAINER_STATE_FILE) if manifest.format == "full" else (TRAINER_STATE_FILE,):
        try:
            tensors[file] = torch.load(io.BytesIO(payloads[file]), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ... for bad bytes
            raise CheckpointError(
                f"{where}/{file} cannot be loaded with torch.load(weights_only=True): {reason(exc)}"
            ) from None
    model, trainer = tensors[MODEL_FILE], tensors[TRAINER_STATE_FILE]
    if not (isinstance(model, dict) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in model.items())):
        raise CheckpointError(f"{where}/{MODEL_FILE} holds {quote(model)}: expected a model's state dict of tensors")
    if not (
        isinstance(trainer, dict)
        and set(trainer) <= set(_TRAINER_STATE_KEYS)
        and all(isinstance(v, dict) for v in trainer.values())
    ):
        raise CheckpointError(
            f"{where}/{TRAINER_STATE_FILE} holds {quote(trainer)}: expected a mapping of state dicts named "
            f"{', '.join(_TRAINER_STATE_KEYS)}"
        )
    meta = decode_meta(payloads[META_FILE], where=f"{where}/{META_FILE}")
    return LoadedCheckpoint(name=name, uri=storage.uri(name), model=model, trainer=trainer, meta=meta)


def _check_entry(found: ManifestEntry, expected: ManifestEntry, *, where: str) -> None:
    if found.num_bytes != expected.num_bytes:
        raise CheckpointError(f"{where} is truncated: {found.num_bytes} bytes, manifest says {expected.num_bytes}")
    if found.sha256 != expected.sha256:
        raise CheckpointError(f"{where} is corrupt: sha256 differs from the manifest")


def _verified_shards(
    storage: Storage, name: str, manifest: CheckpointManifest, directory: str, *, download: bool
) -> bytes:
    """Check each of the checkpoint's shards in the local ``directory`` (downloaded there first when ``download``)
    against the manifest. Returns the bytes of its ``.metadata``: read once, at most the manifest's size of them,
    and checked, so what is parsed is what was hashed."""
    where = storage.display_uri(name)
    metadata = b""
    for relative, entry in manifest.shards.items():
        path = os.path.join(directory, relative.split("/", 1)[1])
        try:
            if download:
                storage.get_file(name, relative, path, max_bytes=entry.num_bytes)
            if relative == SHARD_METADATA_FILE:
                with open_regular_local(path, f"{where}/{relative}") as f:
                    metadata = f.read(entry.num_bytes + 1)  # one byte more tells a longer file
                found = ManifestEntry(num_bytes=len(metadata), sha256=sha256(metadata))
            else:
                found = file_entry(path, max_bytes=entry.num_bytes)
        except FileNotFoundError as exc:  # not on storage (a local file missing is a MissingFile)
            raise CheckpointError(f"{where} has a missing shard: {storage.scrub(reason(exc))}") from None
        except (OSError, UnreadableFile) as exc:
            raise CheckpointError(f"{where}/{relative} is missing: {storage.scrub(reason(exc))}") from None
        _check_entry(found, entry, where=f"{where}/{relative}")
    return metadata


def load_directory(uri: str, *, expected_shapes: dict[str, tuple[int, ...]] | None = None) -> LoadedCheckpoint:
    """Verify and load the one checkpoint at ``uri`` (a ``step-...`` directory, local or ``s3://``); see
    :func:`verify_and_load` for ``expected_shapes``."""
    parent, name = uri.rstrip("/").rsplit("/", 1)
    return verify_and_load(open_storage(parent), name, expected_shapes=expected_shapes)


def load_latest_valid(
    storage: Storage, *, expected_shapes: dict[str, tuple[int, ...]] | None = None
) -> LoadedCheckpoint | None:
    """The newest checkpoint that verifies and loads; each newer one that does not, for whatever reason, is skipped
    with a warning naming it and the reason. ``None`` when there is none. With ``expected_shapes``
    (:func:`model_state_shapes` of the model to restore), a sharded checkpoint whose weights do not fit it is one
    that does not load."""
    rejected: list[str] = []
    for name in reversed(storage.list_steps()):
        try:
            loaded = verify_and_load(storage, name, expected_shapes=expected_shapes)
        except Exception as exc:  # noqa: BLE001 - the last line of defence: a resume must reach an older checkpoint
            why = str(exc) if isinstance(exc, CheckpointError) else f"it could not be loaded: {reason(exc)}"
            log.warning("skipping checkpoint %s: %s", storage.display_uri(name), storage.scrub(why))
            rejected.append(name)
            continue
        if rejected:
            log.warning(
                "resuming from %s instead of the newer %s, which failed verification",
                storage.display_uri(name),
                ", ".join(rejected),
            )
        return loaded
    return None


def load_meta(directory: str) -> CheckpointMeta:
    """The metadata of the checkpoint at ``directory`` (local or ``s3://``), without loading its tensors (nor
    verifying it against the manifest). Raises :class:`CheckpointError` when it is missing or not valid metadata."""
    parent, name = directory.rstrip("/").rsplit("/", 1)
    storage = open_storage(parent)
    where = f"{storage.display_uri(name)}/{META_FILE}"
    try:
        data = storage.read(name, META_FILE, max_bytes=MAX_META_BYTES)
    except FileNotFoundError as exc:  # its text quotes the real path, credentials and all
        raise CheckpointError(f"{where} is missing: {storage.scrub(reason(exc))}") from None
    return decode_meta(data, where=where)
