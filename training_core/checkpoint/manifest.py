"""A checkpoint's ``manifest.json``: what it lists (size and sha256 of each file), written and checked."""

from __future__ import annotations

import hashlib
import json
import time
import typing
from dataclasses import dataclass
from typing import Annotated, Any

from training_core.checkpoint.layout import (
    CHECKPOINT_FILES,
    FORMATS,
    SHA256_HEX,
    SHARD_FILE_PATTERN,
    SHARD_METADATA_FILE,
    SHARDED_FILES,
    SHARDS_DIR,
    CheckpointError,
    is_count,
    is_mapping,
    is_number,
    parse_json,
)
from training_core.files import open_regular_local
from training_core.messages import is_plain_file_name, listed, quote
from training_core.schema import UNKNOWN_KEY_KINDS, Count, Problem, Rule, SchemaError, check, describe

_MANIFEST_KEYS = ("global_step", "metric", "files", "written_at")


@dataclass(frozen=True)
class ManifestEntry:
    """What the manifest says one file of the checkpoint is."""

    num_bytes: int
    sha256: str


@dataclass(frozen=True)
class CheckpointManifest:
    """A checkpoint's ``manifest.json``, checked: see :meth:`parse`."""

    global_step: int
    metric: float | None
    files: dict[str, ManifestEntry]
    written_at: float
    format: str = "full"
    """``full`` (one process wrote the whole model: :data:`CHECKPOINT_FILES`) or ``sharded`` (every rank wrote its
    shard under :data:`SHARDS_DIR`, beside :data:`SHARDED_FILES`)."""

    @property
    def shards(self) -> dict[str, ManifestEntry]:
        return {name: entry for name, entry in self.files.items() if name.startswith(f"{SHARDS_DIR}/")}

    @classmethod
    def parse(cls, data: bytes, *, where: str) -> CheckpointManifest:
        """The manifest in ``data``, checked before any file it names is read: a JSON object of exactly ``global_step``
        (an integer >= 0), ``metric`` (a number or null), ``written_at`` (a number), optionally ``format`` (``full``,
        the default, or ``sharded``) and ``files``, which maps each file (a plain name inside the checkpoint's
        directory or its ``shards`` folder) to ``{"bytes": integer >= 0, "sha256": 64 hex digits}``: exactly
        :data:`CHECKPOINT_FILES`, or for a sharded one :data:`SHARDED_FILES`, ``shards/.metadata`` and one or more
        ``shards/__<rank>_<n>.distcp``. Raises :class:`CheckpointError` naming ``where``, the key, the value (bounded
        in size) and what was expected."""
        raw = parse_json(data, where=where)
        if not isinstance(raw, dict):
            raise CheckpointError(
                f"{where} holds {quote(raw)}: expected a JSON object with {', '.join(_MANIFEST_KEYS)}"
            )
        try:
            format = check(_Written, raw).format
        except SchemaError as exc:
            raise _manifest_error(exc.problems, raw, where=where) from None
        for name in raw["files"]:
            _check_file_name(name, where=where, sharded=format == "sharded")
        names = set(raw["files"])
        if format == "full" and names != set(CHECKPOINT_FILES):
            raise CheckpointError(
                f"{where} lists the files {listed(sorted(names))}: expected exactly {', '.join(CHECKPOINT_FILES)}"
            )
        shard_files = {name for name in names if name.startswith(f"{SHARDS_DIR}/")}
        if format == "sharded" and (
            names - shard_files != set(SHARDED_FILES) or SHARD_METADATA_FILE not in shard_files or len(shard_files) < 2
        ):
            raise CheckpointError(
                f"{where} lists the files {listed(sorted(names))}: a sharded checkpoint lists exactly "
                f"{', '.join(SHARDED_FILES)}, {SHARD_METADATA_FILE} and the ranks' {SHARDS_DIR}/__<rank>_0.distcp"
            )
        return cls(
            global_step=raw["global_step"],
            metric=raw["metric"],
            files={name: _entry(name, entry, where=where) for name, entry in raw["files"].items()},
            written_at=raw["written_at"],
            format=format,
        )


@dataclass(frozen=True)
class _Written:
    """The keys of ``manifest.json`` and their types, as written (the schema layer checks them)."""

    global_step: Count
    metric: float | None
    files: Annotated[dict[str, Any], Rule(is_mapping, f"an object of {', '.join(CHECKPOINT_FILES)}")]
    written_at: Annotated[float, Rule(is_number, "a number (seconds since the epoch)")]
    format: Annotated[str, Rule(FORMATS.__contains__, f"one of {', '.join(FORMATS)}")] = "full"


def _manifest_error(problems: list[Problem], raw: dict[str, Any], *, where: str) -> CheckpointError:
    """The message of the first of the schema layer's ``problems`` with the manifest ``raw``."""
    unknown = [p.key for p in problems if p.kind in UNKNOWN_KEY_KINDS]
    missing = [p.path for p in problems if p.kind == "missing"]
    if unknown or missing:
        found = f"unknown key(s) {listed(unknown)}" if unknown else f"no {', '.join(missing)}"
        return CheckpointError(f"{where} has {found}: expected exactly the keys {', '.join(_MANIFEST_KEYS)}")
    key = problems[0].path
    expected = describe(typing.get_type_hints(_Written, include_extras=True)[key])
    return CheckpointError(f"{where} key {key}={quote(raw[key])} is invalid: expected {expected}")


def _entry(name: str, entry: Any, *, where: str) -> ManifestEntry:
    """One file's entry of a manifest, checked: ``{"bytes": integer >= 0, "sha256": 64 hex digits}``."""
    if not (
        isinstance(entry, dict)
        and set(entry) == {"bytes", "sha256"}
        and is_count(entry["bytes"])
        and isinstance(entry["sha256"], str)
        and SHA256_HEX.fullmatch(entry["sha256"])
    ):
        raise CheckpointError(
            f"{where} entry of {name}={quote(entry)} is invalid: expected "
            '{"bytes": an integer >= 0, "sha256": 64 lowercase hex digits}'
        )
    return ManifestEntry(num_bytes=entry["bytes"], sha256=entry["sha256"])


def _check_file_name(name: Any, *, where: str, sharded: bool) -> None:
    """Refuse a file name read from a manifest unless it is a plain name inside the checkpoint's directory
    (:func:`~training_core.messages.is_plain_file_name`), or in a sharded checkpoint one of the names
    ``torch.distributed.checkpoint`` gives its files in ``shards/``. Checked before anything is read."""
    if is_plain_file_name(name) or (sharded and isinstance(name, str) and SHARD_FILE_PATTERN.fullmatch(name)):
        return
    expected = (
        f"{', '.join(SHARDED_FILES)} and {SHARDS_DIR}/.metadata, {SHARDS_DIR}/__<rank>_<n>.distcp"
        if sharded
        else ", ".join(CHECKPOINT_FILES)
    )
    raise CheckpointError(
        f"{where} names the file {quote(name)}, which is not a plain name inside the checkpoint's directory: "
        f"a manifest lists only {expected}"
    )


def sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def file_entry(path: str, *, max_bytes: int | None = None) -> ManifestEntry:
    """Size and sha256 of a local regular file, read in 1 MiB pieces (a shard can be gigabytes). With ``max_bytes``
    the read stops once past it (the size then reads as larger than ``max_bytes``): a shard verified against its
    manifest entry is never read beyond it. A FIFO or device is refused unread (``UnreadableFile``)."""
    digest, num_bytes = hashlib.sha256(), 0
    with open_regular_local(path) as f:
        while (max_bytes is None or num_bytes <= max_bytes) and (piece := f.read(2**20)):
            digest.update(piece)
            num_bytes += len(piece)
    return ManifestEntry(num_bytes=num_bytes, sha256=digest.hexdigest())


def manifest_for(
    files: dict[str, bytes],
    *,
    global_step: int,
    metric: float | None,
    shards: dict[str, ManifestEntry] | None = None,
) -> bytes:
    """The manifest of ``files`` (contents in hand); ``shards`` (already written, hashed where they were written)
    makes it a sharded checkpoint's."""
    entries = {name: {"bytes": len(data), "sha256": sha256(data)} for name, data in files.items()}
    raw = {"global_step": global_step, "metric": metric, "files": entries, "written_at": time.time()}
    if shards is not None:
        raw["files"] |= {name: {"bytes": e.num_bytes, "sha256": e.sha256} for name, e in shards.items()}
        raw["format"] = "sharded"
    return json.dumps(raw, indent=1).encode()
