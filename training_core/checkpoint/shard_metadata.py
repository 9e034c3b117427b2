"""A sharded checkpoint's ``shards/.metadata`` (``torch.distributed.checkpoint``'s pickle), parsed safely and checked
against the manifest and the model."""

from __future__ import annotations

import io
from typing import Any

from training_core.checkpoint.layout import (
    MAX_REASON_CHARS,
    SHARD_METADATA_FILE,
    SHARDS_DIR,
    CheckpointError,
    is_count,
    reason,
)
from training_core.checkpoint.manifest import CheckpointManifest
from training_core.messages import clip, is_plain_file_name, listed, quote

# What a ``torch.distributed.checkpoint`` ``.metadata`` pickle may name: its own records, torch's sizes, dtypes and
# layouts, and a path. Anything else (a callable that runs code when unpickled) is refused.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
_MEMO_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")
_MODEL_KEY_PREFIX = "model."
"""How a sharded checkpoint's keys name the model's tensors (the state ``save_sharded`` writes is
``{"model": ..., "optimizer": ...}``, flattened)."""


def _shown(value: Any) -> str:
    """A value read from a ``.metadata`` for a message: plain data quoted bounded in size, any other object by its
    type only (a record's own repr would walk all it holds)."""
    if isinstance(value, (str, int, float, bool, list, tuple, dict, type(None))):
        return quote(tuple(value) if isinstance(value, tuple) else value)
    return f"a {type(value).__name__}"


def check_pickle_bounds(data: bytes) -> None:
    """Raise ``ValueError`` when the pickle ``data`` asks the unpickler for more than its own size; call it before
    any unpickler runs.

    Python's C unpickler grows its memo table to the index a ``PUT`` names and reads a frame's declared length,
    so a 12-byte pickle can take gigabytes. ``pickletools.genops`` refuses a string, bytes or integer longer than
    the bytes that remain; here a frame must fit in them too, and an explicit memo index may name only a slot
    already filled or the next one (picklers number them 0, 1, 2, ... as they go). So the memo holds at most one
    slot per opcode, and the opcodes (a byte each at least), hence the objects built, are bounded by the size of
    ``data``."""
    import pickletools

    num_memoized = 0
    for opcode, arg, position in pickletools.genops(data):
        if opcode.name == "FRAME" and arg > len(data) - position:
            raise ValueError(f"a frame of {arg} bytes at offset {position}, beyond the {len(data)} bytes there are")
        if opcode.name in _MEMO_PUTS and arg > num_memoized:
            raise ValueError(f"memo index {arg} at offset {position}, beyond the {num_memoized} objects memoized")
        num_memoized += opcode.name in _MEMO_PUTS or opcode.name == "MEMOIZE"


def parse_shard_metadata(data: bytes, *, where: str) -> Any:
    """The ``torch.distributed.checkpoint`` ``Metadata`` in ``data`` (a ``shards/.metadata``), parsed safely: its
    size bounds what it may build (:func:`check_pickle_bounds`), it may name only the globals of
    :data:`_METADATA_GLOBALS` (nothing that runs code), and it must hold torch's records, every entry stored
    (:func:`_check_storage_info`, :func:`_check_tensor_entry`); :func:`check_shard_metadata` checks it against the
    manifest. Raises :class:`CheckpointError` naming ``where``."""
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        StorageMeta,
        TensorStorageMetadata,
    )

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            dtype = getattr(torch, name, None) if module == "torch" else None
            if name in _METADATA_GLOBALS.get(module, ()) or isinstance(dtype, torch.dtype):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(
                f"{clip(module, 100)}.{clip(name, 100)} is not allowed in {SHARDS_DIR}/.metadata"
            )

    try:
        check_pickle_bounds(data)
    except ValueError as exc:  # genops's too: a truncated pickle, a length beyond the bytes left, an unknown opcode
        raise CheckpointError(
            f"{where} is not a pickle this module reads: {clip(str(exc), MAX_REASON_CHARS)}"
        ) from None
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the file is not ours
        raise CheckpointError(f"{where} cannot be read safely: {reason(exc)}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where} holds {_shown(metadata)}: expected torch.distributed.checkpoint's Metadata")
    entries, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{where} lacks the state_dict_metadata and storage_data mappings torch reads")
    for index, info in storage.items():
        _check_storage_info(index, info, where=where)
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{where} names the entry {_shown(key)}: expected a string key")
        if isinstance(entry, BytesStorageMetadata):
            _require_stored(storage, key, None, where=where)
        elif isinstance(entry, TensorStorageMetadata):
            _check_tensor_entry(storage, key, entry, where=where)
        else:
            raise CheckpointError(
                f"{where} entry {quote(key)} is {_shown(entry)}: expected a tensor's or bytes' record"
            )
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        raise CheckpointError(f"{where} has storage_meta {_shown(storage_meta)}: expected a StorageMeta")
    return metadata


def _check_storage_info(index: Any, info: Any, *, where: str) -> None:
    """One entry of a ``.metadata``'s ``storage_data``: a ``MetadataIndex`` to a ``_StorageInfo`` that names a plain
    file name (torch's reader opens ``shards_dir / relative_path`` as it is), a byte range, and no transform
    (this package writes none; a transform would decompress)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
        raise CheckpointError(
            f"{where} stores {_shown(index)} as {_shown(info)}: expected a MetadataIndex and its _StorageInfo"
        )
    path = getattr(info, "relative_path", None)
    if not is_plain_file_name(path):
        raise CheckpointError(
            f"{where} stores {_shown(index.fqn)} in {_shown(path)}, which is not a plain file name beside it: a "
            f"checkpoint's entries are stored in its own {SHARDS_DIR}/__<rank>_<n>.distcp"
        )
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not (is_count(offset) and is_count(length)):
        raise CheckpointError(
            f"{where} stores {_shown(index.fqn)} at offset {_shown(offset)}, length {_shown(length)}: expected "
            "integers >= 0"
        )
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(
            f"{where} stores {_shown(index.fqn)} transformed by {_shown(info.transform_descriptors)}: this module "
            "writes and reads untransformed shards only"
        )


def _require_stored(storage: dict[Any, Any], key: str, offsets: Any, *, where: str) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if MetadataIndex(key, offsets) not in storage:
        at = "" if offsets is None else f" (its chunk at {quote(list(offsets))})"
        raise CheckpointError(f"{where} has no storage for {quote(key)}{at}: the entry cannot be read")


def _check_tensor_entry(storage: dict[Any, Any], key: str, entry: Any, *, where: str) -> None:
    """A tensor's record: a size of integers >= 0 and chunks inside it, each stored."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def is_shape(value: Any, rank: int | None = None) -> bool:
        return (
            isinstance(value, torch.Size) and (rank is None or len(value) == rank) and all(is_count(n) for n in value)
        )

    size, chunks = getattr(entry, "size", None), getattr(entry, "chunks", None)
    if not is_shape(size) or not isinstance(chunks, list):
        raise CheckpointError(f"{where} entry {quote(key)} has size {_shown(size)}: expected a torch.Size and chunks")
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (
            isinstance(chunk, ChunkStorageMetadata)
            and is_shape(offsets, len(size))
            and is_shape(sizes, len(size))
            and all(o + n <= total for o, n, total in zip(offsets, sizes, size))
        ):
            raise CheckpointError(
                f"{where} entry {quote(key)} of size {_shown(size)} has the chunk {_shown(chunk)}: expected offsets "
                "and sizes inside the tensor"
            )
        _require_stored(storage, key, offsets, where=where)


def check_shard_metadata(
    metadata: Any,
    manifest: CheckpointManifest,
    *,
    where: str,
    expected_shapes: dict[str, tuple[int, ...]] | None = None,
) -> None:
    """Refuse a parsed ``.metadata`` (:func:`parse_shard_metadata`) unless every entry is stored in a shard the
    manifest lists and hashes, within its size; with ``expected_shapes`` (:func:`model_state_shapes`), unless
    it holds a weight of each name and shape. Raises :class:`CheckpointError` naming ``where``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    shards = manifest.shards
    for index, info in metadata.storage_data.items():
        relative = f"{SHARDS_DIR}/{info.relative_path}"
        entry = shards.get(relative)
        if entry is None or relative == SHARD_METADATA_FILE:
            raise CheckpointError(
                f"{where} stores {_shown(index.fqn)} in {_shown(info.relative_path)}, which the manifest does not list "
                f"as a shard: a checkpoint reads only the shards it lists and hashes"
            )
        if info.offset + info.length > entry.num_bytes:
            raise CheckpointError(
                f"{where} stores {_shown(index.fqn)} at bytes {info.offset}..{info.offset + info.length} of "
                f"{relative}, which holds {entry.num_bytes} bytes"
            )
    if expected_shapes is None:
        return
    mismatched = []
    for name, shape in expected_shapes.items():
        stored = metadata.state_dict_metadata.get(_MODEL_KEY_PREFIX + name)
        found = list(stored.size) if isinstance(stored, TensorStorageMetadata) else None
        if found != list(shape):
            mismatched.append(f"{name} {'absent' if found is None else found} (model: {list(shape)})")
    if mismatched:
        raise CheckpointError(
            f"{where} does not fit the model (another architecture?): its weights {listed(mismatched, limit=5)}"
        )
