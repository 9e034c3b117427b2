"""Reading a user's file: only regular files, never more bytes than allowed, never a hang (real FIFOs, devices,
symlinks)."""

from __future__ import annotations

import os

import fsspec
import pytest

from training_core.files import UnreadableFile, open_regular, read_regular, read_regular_path

LOCAL = fsspec.filesystem("file")


@pytest.mark.timeout(30)
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "x.png"
    os.mkfifo(fifo)
    with pytest.raises(UnreadableFile, match=r"x\.png' is a FIFO, not a regular file"):
        read_regular(LOCAL, str(fifo), max_bytes=1024)
    with pytest.raises(UnreadableFile, match="FIFO"):
        open_regular(LOCAL, str(fifo))


@pytest.mark.timeout(30)
def test_a_symlink_to_dev_zero_is_refused_before_any_read(tmp_path):
    link = tmp_path / "big.txt"
    link.symlink_to("/dev/zero")
    with pytest.raises(UnreadableFile, match="character device"):
        read_regular(LOCAL, str(link), max_bytes=1024)


def test_a_dangling_symlink_names_the_file(tmp_path):
    link = tmp_path / "gone.txt"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(UnreadableFile, match=r"gone\.txt' does not exist"):
        read_regular_path(str(link), max_bytes=1024)


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(UnreadableFile, match="a directory"):
        read_regular(LOCAL, str(tmp_path), max_bytes=1024)


def test_the_cap_counts_bytes_read_and_admits_a_file_of_exactly_the_cap(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"x" * 100)
    assert read_regular(LOCAL, str(path), max_bytes=100) == b"x" * 100
    with pytest.raises(UnreadableFile, match="more than 99 bytes"):
        read_regular(LOCAL, str(path), max_bytes=99)
    # Through a symlink to a regular file: read as the file it points at.
    link = tmp_path / "link.txt"
    link.symlink_to(path)
    assert read_regular_path(str(link), max_bytes=100) == b"x" * 100
