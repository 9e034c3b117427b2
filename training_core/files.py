"""Reading a file a user named, safely: only regular files, and never more bytes than the caller allows.

A user's data folder may hold a FIFO named ``x.png`` (opening it blocks until a writer comes, forever), a symlink to
``/dev/zero`` (its reported size is 0 and a read never ends) or a dangling symlink. Every read of a user's file goes
through :func:`read_regular` so that each becomes a ``ValueError`` naming the file, never a hang or an exhausted
memory. Object stores (``s3://``) only hold regular objects: there the cap on bytes read is what applies.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from training_core.messages import clip, quote
from training_core.redact import redact

_PIECE_BYTES = 2**20


class UnreadableFile(ValueError):
    """A file that is not a regular file, that is larger than allowed, or that cannot be opened. The message names
    the file and what it is; callers add the field it came from and the fix."""


class MissingFile(UnreadableFile):
    """The file does not exist (or is a dangling symlink): callers that read an optional file tell it apart."""


def join_path(directory: str, name: str) -> str:
    """``name`` inside ``directory``, a local path or a URL, joined by one ``/``."""
    return f"{directory.rstrip('/')}/{name}"


def is_local(fs: Any) -> bool:
    """Whether the fsspec filesystem ``fs`` is this machine's disk."""
    protocol = getattr(fs, "protocol", "file")
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    return bool({"file", "local"} & set(protocols))


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` that is not a regular file is, in a message's words (``a FIFO``)."""
    kinds = {"p": "a FIFO", "c": "a character device", "b": "a block device", "s": "a socket", "d": "a directory"}
    return kinds.get(stat.filemode(mode)[0], "not a regular file")  # filemode: "prw-r--r--" for a FIFO


def _local_path(fs: Any, path: str) -> str:
    return fs._strip_protocol(path) if hasattr(fs, "_strip_protocol") else path


def _read_at_most(f: Any, max_bytes: int, name: str) -> bytes:
    # In pieces: one read of max_bytes + 1 would allocate the whole cap (hundreds of MiB) for every small file. One
    # byte past the cap tells a file of exactly max_bytes from a larger one, whatever size the file reports.
    pieces, num_bytes = [], 0
    while num_bytes <= max_bytes and (piece := f.read(min(_PIECE_BYTES, max_bytes + 1 - num_bytes))):
        pieces.append(piece)
        num_bytes += len(piece)
    if num_bytes > max_bytes:
        raise UnreadableFile(f"{quote(name)} holds more than {_size(max_bytes)}, the most read from one file")
    return b"".join(pieces)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB" if num_bytes >= 2**20 else f"{num_bytes:,} bytes"


def read_regular(fs: Any, path: str, *, max_bytes: int, name: str = "") -> bytes:
    """The bytes of the regular file ``path`` on the fsspec filesystem ``fs``, at most ``max_bytes`` of them.

    Raises :class:`UnreadableFile` (a ``ValueError``) naming ``name`` (default: ``path``, credentials redacted) for
    a FIFO, device, socket or directory (never opened for a blocking read), a dangling symlink, a file that cannot
    be opened, and a file holding more than ``max_bytes`` (counted as read, not as reported)."""
    name = redact(name or path)
    if is_local(fs):
        return read_regular_local(_local_path(fs, path), max_bytes=max_bytes, name=name)
    try:
        with fs.open(path, "rb") as f:
            return _read_at_most(f, max_bytes, name)
    except UnreadableFile:
        raise
    except FileNotFoundError:
        raise MissingFile(f"{quote(name)} does not exist (it was removed?)") from None
    except Exception as exc:  # noqa: BLE001 - whatever a remote filesystem raises for an object it cannot read
        raise UnreadableFile(f"{quote(name)} cannot be read ({type(exc).__name__}: {clip(redact(str(exc)))})") from None


def read_regular_local(path: str, *, max_bytes: int, name: str = "") -> bytes:
    """:func:`read_regular` of a path on this machine, without fsspec."""
    name = redact(name or path)
    with open_regular_local(path, name) as f:
        return _read_at_most(f, max_bytes, name)


def read_regular_path(path: str, *, max_bytes: int, name: str = "") -> bytes:
    """:func:`read_regular` of a local path or URL (``s3://...``), its filesystem chosen by fsspec."""
    import fsspec

    fs, fs_path = fsspec.core.url_to_fs(path)
    return read_regular(fs, fs_path, max_bytes=max_bytes, name=name or path)


def open_regular_local(path: str, name: str = "") -> Any:
    """A binary file object of the local regular file ``path``, opened without blocking on a FIFO;
    :class:`UnreadableFile` naming ``name`` (default ``path``) for anything else."""
    name = redact(name or path)
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer. The check is on the opened file
    # (fstat), so a path swapped for a symlink or a FIFO between a listing and this read is still refused.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MissingFile(f"{quote(name)} does not exist (a dangling symlink, or it was removed)") from None
    except OSError as exc:
        raise UnreadableFile(f"{quote(name)} cannot be opened ({type(exc).__name__}: {clip(str(exc))})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnreadableFile(f"{quote(name)} is {file_kind(mode)}, not a regular file; only regular files are read")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", closefd=True)


def open_regular(fs: Any, path: str, name: str = "") -> Any:
    """A binary file object of ``path`` on ``fs``: for a local path through :func:`open_regular_local`, else the
    filesystem's own (object stores hold only regular objects). The caller caps what it reads."""
    if is_local(fs):
        return open_regular_local(_local_path(fs, path), name)
    return fs.open(path, "rb")
