"""Where checkpoint directories live: the :class:`Storage` seam, its fsspec implementation with bounded retries of
transient errors, and :func:`open_storage`, the one place that makes one."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Protocol

from training_core.checkpoint.layout import (
    MANIFEST_FILE,
    STEP_NAME_PATTERN,
    CheckpointError,
    is_int,
    reason,
)
from training_core.files import MissingFile, is_local, read_regular, read_regular_local
from training_core.messages import listed
from training_core.redact import redact

if TYPE_CHECKING:
    from training_core.config import CheckpointConfig

log = logging.getLogger("training_core")


_NOT_RETRYABLE_ERRNOS = frozenset(
    {
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EACCES,
        errno.EPERM,
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
        errno.EEXIST,
        errno.ENAMETOOLONG,
        errno.ELOOP,
        errno.EINVAL,
    }
)
_NOT_RETRYABLE_TYPES = (
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    FileExistsError,
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    NotImplementedError,
)
_THROTTLING_CODES = frozenset(
    {"Throttling", "ThrottlingException", "SlowDown", "RequestLimitExceeded", "RequestTimeout"}
)


def is_retryable(exc: BaseException) -> bool:
    """Whether waiting could make a storage error go away.

    Connection errors, timeouts, throttling and server errors (HTTP 5xx, 408, 429, as botocore reports them) are
    retried, and so is an error of a kind not known here (object-store clients raise many of their own). A path
    that is missing, is a directory (or is not one), may not be accessed, a full or read-only disk, and a bad
    argument are answers that stay the same however long one waits."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, _NOT_RETRYABLE_TYPES) or getattr(exc, "errno", None) in _NOT_RETRYABLE_ERRNOS:
        return False
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        error, metadata = response.get("Error"), response.get("ResponseMetadata")
        code = error.get("Code") if isinstance(error, dict) else None
        status = metadata.get("HTTPStatusCode") if isinstance(metadata, dict) else None
        if code in _THROTTLING_CODES or status in (408, 429):
            return True
        if is_int(status) and 400 <= status < 500:
            return False
    return True


class Storage(Protocol):
    """What the :class:`~training_core.checkpoint.checkpointer.Checkpointer` and the loaders need of where checkpoints
    live; names are ``step-...`` directories under one root. :class:`CheckpointStorage` is the one implementation."""

    def uri(self, name: str) -> str: ...
    def display_uri(self, name: str = "") -> str: ...
    def scrub(self, text: str) -> str: ...
    def list_steps(self) -> list[str]: ...
    def read(self, name: str, file: str, *, max_bytes: int) -> bytes: ...
    def get_file(self, name: str, relative: str, local_path: str, *, max_bytes: int) -> None: ...
    def local_path(self, name: str) -> str | None: ...
    def download(self, name: str, local_dir: str) -> None: ...
    def write(self, name: str, files: dict[str, bytes], manifest: bytes) -> None: ...
    def add_files(self, name: str, files: dict[str, bytes], manifest: bytes) -> None: ...
    def staging_dir(self, name: str) -> str: ...
    def put_file(self, name: str, relative: str, local_path: str) -> None: ...
    def wait_for(self, name: str, expected_bytes: dict[str, int], *, timeout_s: float) -> None: ...
    def discard(self, name: str) -> None: ...
    def delete(self, name: str) -> None: ...
    def write_note(self, file: str, data: bytes) -> None: ...
    def read_note(self, file: str, *, max_bytes: int) -> bytes | None: ...


def open_storage(
    root: str, config: CheckpointConfig | None = None, *, storage_options: dict[str, Any] | None = None
) -> Storage:
    """The storage of the checkpoints under ``root`` (a local path or an fsspec URI): ``config``'s options for it
    (S3 server-side encryption), then ``storage_options`` (an endpoint, credentials)."""
    options = config.storage_options(root) if config is not None else {}
    return CheckpointStorage(root, storage_options={**options, **(storage_options or {})})


class CheckpointStorage:
    """Where checkpoint directories live: a local path or an fsspec URI, with bounded retries of transient errors.
    Messages and logs show :meth:`display_uri` and :meth:`scrub`, never the real :meth:`uri`."""

    def __init__(
        self, root: str, *, storage_options: dict[str, Any] | None = None, retries: int = 5, retry_wait_s: float = 1.0
    ) -> None:
        import fsspec

        self.root = root.rstrip("/")
        self._fs, self.path = fsspec.core.url_to_fs(self.root, **(storage_options or {}))
        self.is_local = is_local(self._fs)
        self.retries = retries
        self.retry_wait_s = retry_wait_s
        # The filesystem's own errors quote its path, where a root's userinfo stays without the "scheme://" that
        # redact() looks for (s3://KEY:SECRET@bucket is the path KEY:SECRET@bucket): scrub() removes it by value.
        userinfo = re.match(r"(?i)[a-z][a-z0-9+.\-]*://([^/?#]*)@", self.root)
        self._userinfo = userinfo.group(1) + "@" if userinfo and userinfo.group(1) else ""

    def uri(self, name: str) -> str:
        """The real URI of checkpoint ``name``, for I/O: never put it in a message (see :meth:`display_uri`)."""
        return f"{self.root}/{name}"

    def display_uri(self, name: str = "") -> str:
        """The URI of checkpoint ``name`` (of the root when empty) as messages show it: credentials redacted."""
        return self.scrub(f"{self.root}/{name}" if name else self.root)

    def scrub(self, text: str) -> str:
        """``text`` with the credentials of any URL, and the root's own userinfo wherever it appears, redacted."""
        text = redact(text)
        return text.replace(self._userinfo, "***@") if self._userinfo else text

    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, retried with exponential backoff while its error :func:`is_retryable`. A missing path is
        raised as ``FileNotFoundError`` at once (the caller decides what it means); any other error that waiting
        will not fix, or the last retryable one, as :class:`CheckpointError`. ``what`` is scrubbed of credentials."""
        what = self.scrub(what)
        delay = self.retry_wait_s
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except Exception as exc:  # noqa: BLE001 - botocore's connection errors are not OSErrors
                retryable, why = is_retryable(exc), self.scrub(reason(exc))
                if not retryable or attempt == self.retries:
                    kind = "" if retryable else ", not retryable"
                    raise CheckpointError(f"{what} failed after {attempt + 1} attempt(s){kind}: {why}") from exc
                log.warning("%s failed (%s); retrying in %.1fs (%d/%d)", what, why, delay, attempt + 1, self.retries)
                time.sleep(delay)
                delay = min(delay * 2, 30.0)

    def write(self, name: str, files: dict[str, bytes], manifest: bytes) -> None:
        """Write one checkpoint directory so that it becomes visible complete or not at all (on an object store: the
        manifest is uploaded last)."""
        if not self.is_local:
            self._upload(name, files, manifest)
            return
        final = f"{self.path}/{name}"
        staging = f"{self.path}/.tmp-{name}-{uuid.uuid4().hex[:8]}"
        try:
            os.makedirs(staging, exist_ok=True)
            for file, data in {**files, MANIFEST_FILE: manifest}.items():
                write_synced(os.path.join(staging, file), data)
            remove_local(final)  # a rewrite of this step (nothing when there is none)
            os.rename(staging, final)
        except OSError as exc:
            remove_local(staging)
            raise self._write_error(f"checkpoint {self.display_uri(name)}", exc) from exc

    def add_files(self, name: str, files: dict[str, bytes], manifest: bytes) -> None:
        """Write ``files`` and then ``manifest`` into checkpoint ``name``, whose directory already holds its shards:
        on a local root each file goes to a temporary name, is synced and renamed into place (the manifest last, so
        it appears complete or not at all); on an object store the manifest is uploaded last."""
        if not self.is_local:
            self._upload(name, files, manifest)
            return
        try:
            for file, data in {**files, MANIFEST_FILE: manifest}.items():
                target = f"{self.path}/{name}/{file}"
                temporary = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
                write_synced(temporary, data)
                os.replace(temporary, target)
        except OSError as exc:
            raise self._write_error(f"checkpoint {self.display_uri(name)}", exc) from exc

    def _write_error(self, what: str, exc: OSError) -> CheckpointError:
        return CheckpointError(f"writing {what} failed: {self.scrub(reason(exc))}")

    def _upload(self, name: str, files: dict[str, bytes], manifest: bytes) -> None:
        for file, data in {**files, MANIFEST_FILE: manifest}.items():
            target = f"{self.path}/{name}/{file}"
            self._retry(f"uploading {self.uri(name)}/{file}", lambda t=target, d=data: self._fs.pipe_file(t, d))

    def staging_dir(self, name: str) -> str:
        """A new local directory for this process's files of checkpoint ``name`` before they are put in place:
        beside the checkpoints on a local root (so putting them is a rename), in ``TMPDIR`` otherwise."""
        import tempfile

        if self.is_local:
            os.makedirs(self.path, exist_ok=True)
        return tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=self.path if self.is_local else None)

    def put_file(self, name: str, relative: str, local_path: str) -> None:
        """Move (local root) or upload the local file ``local_path`` to ``relative`` inside checkpoint ``name``."""
        target = f"{self.path}/{name}/{relative}"
        if self.is_local:
            try:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.replace(local_path, target)
            except OSError as exc:
                raise self._write_error(f"{self.display_uri(name)}/{relative}", exc) from exc
            return
        self._retry(f"uploading {self.uri(name)}/{relative}", lambda: self._fs.put_file(local_path, target))

    def get_file(self, name: str, relative: str, local_path: str, *, max_bytes: int) -> None:
        """Download ``relative`` of checkpoint ``name`` to ``local_path``. :class:`CheckpointError`, before a byte
        is copied, when storage holds more than ``max_bytes`` of it: an object replaced by a larger one must not
        fill the disk before its check against the manifest."""
        source = f"{self.path}/{name}/{relative}"
        self._fs.invalidate_cache(source)  # a listing cached by wait_for would give the size as written
        size = self._retry(f"checking {self.uri(name)}/{relative}", lambda: self._fs.size(source))
        if size > max_bytes:
            raise CheckpointError(f"{self.display_uri(name)}/{relative} holds more than {max_bytes:,} bytes")
        self._retry(f"reading {self.uri(name)}/{relative}", lambda: self._fs.get_file(source, local_path))

    def download(self, name: str, local_dir: str) -> None:
        """Copy checkpoint ``name``, every file of it, into the local directory ``local_dir``."""
        self._fs.get(f"{self.path}/{name}/", local_dir.rstrip("/") + "/", recursive=True)

    def local_path(self, name: str) -> str | None:
        """The directory of checkpoint ``name`` on this machine's filesystem, or None on an object store."""
        return f"{self.path}/{name}" if self.is_local else None

    def wait_for(self, name: str, expected_bytes: dict[str, int], *, timeout_s: float) -> None:
        """Wait until each file of ``expected_bytes`` (names inside checkpoint ``name``, all in one folder) is on
        storage at its size; :class:`CheckpointError` naming the missing ones after ``timeout_s``."""
        folder = next(iter(expected_bytes)).split("/", 1)[0]
        where = f"{self.path}/{name}/{folder}"
        deadline, delay = time.monotonic() + timeout_s, 0.05
        while True:
            try:
                entries = self._retry(
                    f"listing {self.uri(name)}/{folder}", lambda: self._fs.ls(where, detail=True, refresh=True)
                )
            except FileNotFoundError:
                entries = []
            found = {
                f"{folder}/{e['name'].rstrip('/').rsplit('/', 1)[-1]}": int(e["size"])
                for e in entries
                if e.get("type") != "directory"
            }
            missing = sorted(f for f, size in expected_bytes.items() if found.get(f) != size)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {self.display_uri(name)} is incomplete: {listed(missing)} did not arrive within "
                    f"{timeout_s:g} s (the rank that writes it failed or is too slow); the previous checkpoint stays"
                )
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def discard(self, name: str) -> None:
        """Delete checkpoint ``name`` if it exists (an unfinished write of an earlier attempt)."""
        with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
            if self.is_local or self._retry(
                f"checking {self.uri(name)}", lambda: self._fs.exists(f"{self.path}/{name}")
            ):
                self.delete(name)

    def read(self, name: str, file: str, *, max_bytes: int) -> bytes:
        """The bytes of ``file`` in checkpoint ``name``; :class:`CheckpointError` when it holds more than
        ``max_bytes`` (counted as read). A local file is read only when it is a regular one: a FIFO would block the
        read forever, a link to ``/dev/zero`` never end it (:func:`~training_core.files.read_regular_local`)."""
        target = f"{self.path}/{name}/{file}"
        if self.is_local:
            data = self._retry(f"reading {self.uri(name)}/{file}", lambda: _read_local(target, max_bytes))
        else:  # an object store holds regular objects only: a ranged read bounds it
            data = self._retry(
                f"reading {self.uri(name)}/{file}", lambda: self._fs.cat_file(target, start=0, end=max_bytes + 1)
            )
        if len(data) > max_bytes:
            raise CheckpointError(f"{self.display_uri(name)}/{file} holds more than {max_bytes:,} bytes")
        return data

    def list_steps(self) -> list[str]:
        """Checkpoint directory names (``step-<digits>``), oldest first by their parsed step; any other name
        (a staging directory, a stray file) is ignored."""
        try:
            entries = self._retry(f"listing {self.root}", lambda: self._fs.ls(self.path, detail=False, refresh=True))
        except FileNotFoundError:
            return []
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        steps = [(int(match.group(1)), name) for name in names if (match := STEP_NAME_PATTERN.fullmatch(name))]
        return [name for _, name in sorted(steps)]

    def write_note(self, file: str, data: bytes) -> None:
        """Replace the small file ``file`` in the root, beside the checkpoints and in none of them (step listings
        skip it), so that a reader sees its old or its new bytes whole: a temporary file renamed into place on a
        local root (not synced: it outlives the process, which is what it is for), one upload on an object store.
        Not retried: its writer writes it again at its next record."""
        target = f"{self.path}/{file}"
        if not self.is_local:
            self._fs.pipe_file(target, data)
            return
        os.makedirs(self.path, exist_ok=True)
        temporary = f"{self.path}/.tmp-{file}-{uuid.uuid4().hex[:8]}"
        try:
            with open(temporary, "wb") as f:
                f.write(data)
            os.replace(temporary, target)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)

    def read_note(self, file: str, *, max_bytes: int) -> bytes | None:
        """The bytes of :meth:`write_note`'s ``file`` (None when there is none); a file that is not a regular one or
        holds over ``max_bytes`` raises :class:`~training_core.files.UnreadableFile`."""
        target = f"{self.path}/{file}"
        if not self._retry(f"checking {self.root}/{file}", lambda: self._fs.lexists(target)):
            return None
        return read_regular(self._fs, target, max_bytes=max_bytes, name=self.display_uri(file))

    def delete(self, name: str) -> None:
        if self.is_local:
            remove_local(f"{self.path}/{name}")
        else:
            self._retry(f"deleting {self.uri(name)}", lambda: self._fs.rm(f"{self.path}/{name}", recursive=True))


def write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read_local(path: str, max_bytes: int) -> bytes:
    try:
        return read_regular_local(path, max_bytes=max_bytes + 1)
    except MissingFile:
        raise FileNotFoundError(errno.ENOENT, "no such file", path) from None


def remove_local(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
