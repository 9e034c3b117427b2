"""What data prep reads, as one digest: prep's cache is keyed on it, so data or code replaced at the same path
re-prepares instead of training on what an earlier run prepared.

:func:`fingerprint_prep_inputs` lists every input prep of a config reads and hashes what it finds there:

- ``data.path`` (when the source or user code reads it) and ``data.tokenizer`` (a ``tokenizer.json``): a local file
  or folder by each file's path, size and either its bytes (while the source's files fit
  :data:`CONTENT_HASH_MAX_BYTES`) or its modification time; an object store (``s3://``) by each object's key, size
  and ETag, from a listing: nothing is downloaded.
- the user code that prepares data (``workload.name`` or ``workload.dataset_source``): every file of the top-level
  package the import path names (helpers and files shipped beside the module included), by their bytes, located
  without importing the module.

A file keyed by its bytes is not keyed by its modification time: touching it, or a fresh checkout of the same code,
re-prepares nothing. Listing and hashing never open a FIFO or a device (:mod:`training_core.files`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Iterator

from training_core.config import DataConfig, WorkloadConfig
from training_core.files import UnreadableFile, is_local, open_regular_local
from training_core.messages import clip, quote
from training_core.redact import redact
from training_core.registry import ARRAY_WORKLOADS, DATASET_SOURCES, WORKLOADS

FINGERPRINT_VERSION = 1
"""Bump when what the fingerprint covers or how it is computed changes."""
CONTENT_HASH_MAX_BYTES = 64 * 2**20
"""Bytes of one source's local files read for content hashes (about a tenth of a second); files past it are keyed
by size and modification time."""
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "version_id", "LastModified", "last_modified", "mtime")
"""What an object store's listing says changes with an object's bytes, first found first (S3's ETag)."""


@dataclass
class SourceFingerprint:
    """One input of data prep and what was found there."""

    field: str
    """The config field that names it: ``data.path``, ``data.tokenizer``, ``workload.name``..."""
    location: str
    """The field's value (credentials redacted)."""
    found_at: str = ""
    """Code: the folder(s) or file of the package the import path names."""
    num_files: int = 0
    num_bytes: int = 0
    num_hashed: int = 0
    """Files keyed by their bytes (the others by size and modification time, or an object's ETag)."""
    note: str = ""
    """What stood in for a listing: ``nothing exists there``, ``not importable here``."""
    digest: str = ""

    def describe(self) -> str:
        """One line for the log: the field, where, what was found and how it is keyed."""
        found = self.note or (
            f"{self.num_files} file(s), {self.num_bytes:,} bytes, {self.num_hashed} keyed by content"
            + (", the rest by size and modification time or ETag" if self.num_hashed < self.num_files else "")
        )
        where = f" (package at {self.found_at})" if self.found_at else ""
        return f"{self.field}={quote(self.location)}{where}: {found}; sha256 {self.digest[:16]}"


@dataclass
class InputsFingerprint:
    """The digest of everything data prep reads, and its parts."""

    digest: str
    """sha256 (hex) over :data:`FINGERPRINT_VERSION` and every source's listing."""
    sources: list[SourceFingerprint] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"inputs of data prep: fingerprint {self.digest}"]
        lines += [f"  {source.describe()}" for source in self.sources] or ["  none outside the config"]
        return "\n".join(lines)


def fingerprint_prep_inputs(
    data: DataConfig, workload: WorkloadConfig, *, content_max_bytes: int = CONTENT_HASH_MAX_BYTES
) -> InputsFingerprint:
    """The fingerprint of what prep of ``data`` by ``workload`` reads outside its config (see the module's doc).
    A missing file or package is part of the fingerprint, not an error: prep itself names what is wrong. An object
    store that cannot be listed raises ``ValueError`` naming the field: the data's state cannot be known."""
    sources = [_data_source(name, location, content_max_bytes) for name, location in data_locations(data, workload)]
    sources += [_code_source(name, path, content_max_bytes) for name, path in user_code_paths(workload)]
    total = hashlib.sha256(f"prep inputs v{FINGERPRINT_VERSION}\n".encode())
    for source in sources:
        total.update(f"{json.dumps([source.field, source.digest])}\n".encode())
    return InputsFingerprint(digest=total.hexdigest(), sources=sources)


def user_code_paths(workload: WorkloadConfig) -> list[tuple[str, str]]:
    """(field, import path) of the user code that prepares data: a user workload, or a built-in's dataset source
    (the model factory never prepares data)."""
    found = []
    if workload.name not in WORKLOADS:
        found.append(("workload.name", workload.name))
    if workload.dataset_source:
        found.append(("workload.dataset_source", workload.dataset_source))
    return found


def data_locations(data: DataConfig, workload: WorkloadConfig) -> list[tuple[str, str]]:
    """(field, local path or URL) of the files prep reads: ``data.path`` where the source, user code or an array
    workload reads it, and a ``tokenizer.json`` for a workload other than images."""
    found = []
    reads_path = (
        user_code_paths(workload) or workload.name in ARRAY_WORKLOADS or DATASET_SOURCES[data.dataset].needs_path
    )
    if data.path and reads_path:
        found.append(("data.path", data.path))
    if data.tokenizer != "byte" and workload.name != "image_classification":
        found.append(("data.tokenizer", data.tokenizer))
    return found


def _data_source(name: str, location: str, content_max_bytes: int) -> SourceFingerprint:
    import fsspec

    source = SourceFingerprint(field=name, location=redact(location))
    # A fresh client: a listing an earlier one cached in this process could be of data since replaced.
    fs, root = fsspec.core.url_to_fs(location, skip_instance_cache=True)
    digest = hashlib.sha256(json.dumps(["data", location]).encode())
    if is_local(fs):
        entries = _local_entries(root, source, content_max_bytes, skip_hidden=False)
    else:
        entries = _listed_entries(fs, root, source)
    for entry in entries:
        digest.update(f"{json.dumps(entry)}\n".encode())
    source.digest = digest.hexdigest()
    return source


def _code_source(name: str, import_path: str, content_max_bytes: int) -> SourceFingerprint:
    top = import_path.partition(":")[0].split(".")[0]
    source = SourceFingerprint(field=name, location=import_path)
    digest = hashlib.sha256(json.dumps(["code", import_path]).encode())
    roots = package_roots(top)
    if not roots:
        source.note = f"package {top!r} is not importable here"
    source.found_at = ", ".join(roots)
    for index, root in enumerate(roots):
        # Keyed by the package's files relative to it: the same code unpacked elsewhere (a pod's /root) is the same.
        for entry in _local_entries(root, source, content_max_bytes, skip_hidden=True):
            digest.update(f"{json.dumps([index, *entry])}\n".encode())
    source.digest = digest.hexdigest()
    return source


def package_roots(top: str) -> list[str]:
    """Where the top-level package or module ``top`` is: its folder(s), or its file for a single-module; empty when
    it cannot be found. Only finds it: no user code runs (a top-level name has no parent package to import)."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return sorted(str(path) for path in spec.submodule_search_locations)
    return [spec.origin] if spec.origin and os.path.isfile(spec.origin) else []


def _local_entries(
    root: str, source: SourceFingerprint, content_max_bytes: int, *, skip_hidden: bool
) -> Iterator[list[Any]]:
    """One entry per file and folder under ``root`` (or ``root`` itself), depth first in name order, counted into
    ``source``: ``[relative path, kind, size, key]``. Folders linked more than once are listed once."""
    budget = [content_max_bytes]
    try:
        top = os.stat(root)
    except FileNotFoundError:
        source.note = "a dangling symlink" if os.path.islink(root) else "nothing exists there"
        yield ["", source.note]
        return
    except OSError as exc:
        source.note = f"cannot be read ({type(exc).__name__})"
        yield ["", "unreadable"]
        return
    if not stat.S_ISDIR(top.st_mode):
        yield _file_entry(root, "", top, source, budget)
        return
    yield from _folder_entries(root, "", source, budget, {(top.st_dev, top.st_ino)}, skip_hidden)


def _folder_entries(
    folder: str, prefix: str, source: SourceFingerprint, budget: list[int], seen: set, skip_hidden: bool
) -> Iterator[list[Any]]:
    try:
        with os.scandir(folder) as listing:
            names = sorted(entry.name for entry in listing)
    except OSError as exc:
        yield [prefix, f"unreadable folder ({type(exc).__name__})"]
        return
    for name in names:
        if skip_hidden and (name.startswith(".") or name == "__pycache__" or name.endswith(".pyc")):
            continue
        path, relative = os.path.join(folder, name), f"{prefix}{name}"
        try:
            status = os.stat(path)
        except FileNotFoundError:
            yield [relative, "dangling symlink" if os.path.islink(path) else "removed"]
            continue
        except OSError as exc:
            yield [relative, f"unreadable ({type(exc).__name__})"]
            continue
        if stat.S_ISDIR(status.st_mode):
            yield [relative, "folder"]
            if (status.st_dev, status.st_ino) not in seen:
                seen.add((status.st_dev, status.st_ino))
                yield from _folder_entries(path, f"{relative}/", source, budget, seen, skip_hidden)
            continue
        yield _file_entry(path, relative, status, source, budget)


def _file_entry(path: str, relative: str, status: os.stat_result, source: SourceFingerprint, budget: list[int]):
    if not stat.S_ISREG(status.st_mode):  # a FIFO or a device: named, never opened
        return [relative, f"not a regular file (mode {stat.S_IFMT(status.st_mode):o})"]
    source.num_files += 1
    source.num_bytes += status.st_size
    if status.st_size > budget[0]:
        return [relative, "file", status.st_size, f"mtime_ns {status.st_mtime_ns}"]
    try:
        with open_regular_local(path) as f:
            digest = hashlib.file_digest(f, "sha256")
    except (UnreadableFile, OSError) as exc:
        return [relative, "file", status.st_size, f"unreadable ({clip(str(exc), 200)})"]
    budget[0] -= status.st_size
    source.num_hashed += 1
    return [relative, "file", status.st_size, f"sha256 {digest.hexdigest()}"]


def _listed_entries(fs: Any, root: str, source: SourceFingerprint) -> list[list[Any]]:
    """``[relative key, size, version]`` of every object at or under ``root``, from the store's listing."""
    root = root.rstrip("/")
    try:
        listing = fs.find(root, detail=True)
    except FileNotFoundError:
        listing = {}
    except Exception as exc:  # noqa: BLE001 - whatever the store's client raises: the data cannot be known
        raise ValueError(
            f"{source.field}={quote(source.location)} cannot be listed to fingerprint the data prep reads "
            f"({type(exc).__name__}: {clip(redact(str(exc)))}); check the URI and the credentials where the "
            "pipeline's tasks run"
        ) from None
    entries = []
    for key in sorted(listing):
        info = listing[key]
        if info.get("type") == "directory":
            continue
        relative = key[len(root) :].lstrip("/") if key.startswith(root) else key
        version = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) not in (None, "")), "")
        size = int(info.get("size") or 0)
        source.num_files += 1
        source.num_bytes += size
        entries.append([relative, size, version])
    if not entries:
        source.note = "nothing exists there"
    return entries
