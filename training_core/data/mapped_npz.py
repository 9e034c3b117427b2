"""Zero-copy reads of a local ``.npz`` written with ``numpy.savez`` (members stored, not compressed): each member is
memory-mapped where it lies in the zip file, so a shard read at every epoch costs no copy and holds no memory beyond
the page cache. A compressed or unusual file is read whole by ``numpy.load`` instead."""

from __future__ import annotations

import struct
import zipfile
from typing import Iterable

import numpy as np

_LOCAL_HEADER = struct.Struct("<4s22xHH")
"""A zip local file header's signature and, 26 bytes in, its file name and extra field lengths."""
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"
_NPY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def map_arrays(path: str, names: Iterable[str]) -> dict[str, np.ndarray] | None:
    """``name -> array`` of the members ``name.npy`` of the local ``.npz`` at ``path``, each memory-mapped
    copy-on-write (writable, the file never changes); None when a member is missing, compressed or holds objects.

    :raises OSError, ValueError, zipfile.BadZipFile: for a file that is not a readable ``.npz``.
    """
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: info for info in archive.infolist()}
    arrays = {}
    with open(path, "rb") as f:
        for name in names:
            info = members.get(f"{name}.npy")
            if info is None or info.compress_type != zipfile.ZIP_STORED:
                return None
            f.seek(info.header_offset)
            signature, name_length, extra_length = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
            if signature != _LOCAL_HEADER_SIGNATURE:
                return None
            member_start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
            f.seek(member_start)
            reader = _NPY_HEADER_READERS.get(np.lib.format.read_magic(f))
            if reader is None:  # a .npy header version this reader does not know
                return None
            shape, fortran_order, dtype = reader(f)
            offset = f.tell()  # where the array's data starts
            # The array must fill the member exactly: a truncated or padded one is left to numpy.load's own errors.
            if dtype.hasobject or offset + dtype.itemsize * int(np.prod(shape)) != member_start + info.compress_size:
                return None
            order = "F" if fortran_order else "C"
            arrays[name] = np.memmap(path, dtype=dtype, mode="c", shape=shape, offset=offset, order=order)
    return arrays
