"""The fingerprint prep's cache is keyed on (training_core/data/fingerprint.py): it changes with what prep reads (a
file's bytes, size or modification time, a folder's files, an object's ETag, the user's code) and with nothing
else, and it lists and hashes without opening a FIFO, importing user code or downloading an object."""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

import pytest

from training_core.config import DataConfig, WorkloadConfig
from training_core.data.fingerprint import data_locations, fingerprint_prep_inputs, user_code_paths

USER = WorkloadConfig(name="fp_unit_pkg.workload:Build")
"""A user workload: it may read ``data.path``, and its package is fingerprinted."""


def fingerprint(path, workload: WorkloadConfig = USER, **kwargs) -> str:
    return fingerprint_prep_inputs(DataConfig(path=str(path)), workload, **kwargs).digest


def rewrite_keeping_mtime(path: Path, payload: bytes) -> None:
    status = path.stat()
    path.write_bytes(payload)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """``fp_unit_pkg`` on ``sys.path``: a workload module that must never be imported here, and a helper."""
    root = tmp_path / "code"
    package = root / "fp_unit_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "workload.py").write_text("raise RuntimeError('user code ran')\nEVERY = 1\n")
    (package / "helpers.py").write_text("SCALE = 1.0\n")
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    yield package
    sys.modules.pop("fp_unit_pkg", None)


def test_a_data_file_is_keyed_by_its_bytes_and_size_and_the_same_file_fingerprints_the_same(tmp_path, user_package):
    data = tmp_path / "samples.npz"
    data.write_bytes(b"a" * 100)
    before = fingerprint(data)
    assert fingerprint(data) == before
    rewrite_keeping_mtime(data, b"b" * 100)  # same size, same mtime: only the bytes tell
    assert fingerprint(data) != before
    data.write_bytes(b"b" * 120)
    assert fingerprint(data) != before
    same = fingerprint(data)
    os.utime(data, ns=(0, 10**18))  # a hashed file is keyed by its bytes: touching it re-prepares nothing
    assert fingerprint(data) == same


def test_a_file_past_the_content_budget_is_keyed_by_size_and_modification_time(tmp_path, user_package):
    data = tmp_path / "big.bin"
    data.write_bytes(b"a" * 1000)
    before = fingerprint(data, content_max_bytes=100)
    rewrite_keeping_mtime(data, b"b" * 1000)  # not hashed: the same size and mtime look the same (the cost of cheap)
    assert fingerprint(data, content_max_bytes=100) == before
    os.utime(data, ns=(0, data.stat().st_mtime_ns + 1))
    assert fingerprint(data, content_max_bytes=100) != before
    source, code = fingerprint_prep_inputs(DataConfig(path=str(data)), USER, content_max_bytes=100).sources
    assert source.field == "data.path" and (source.num_files, source.num_hashed, source.num_bytes) == (1, 0, 1000)
    assert code.field == "workload.name" and code.num_hashed == code.num_files == 3  # each source has its budget


def test_a_folder_changes_with_a_file_added_renamed_or_rewritten_and_a_fifo_in_it_is_named_never_opened(
    tmp_path, user_package
):
    folder = tmp_path / "images"
    (folder / "cat").mkdir(parents=True)
    (folder / "cat" / "1.jpg").write_bytes(b"x" * 10)
    seen = {fingerprint(folder)}
    (folder / "cat" / "2.jpg").write_bytes(b"y" * 10)
    seen.add(fingerprint(folder))
    (folder / "cat" / "2.jpg").rename(folder / "cat" / "3.jpg")
    seen.add(fingerprint(folder))
    rewrite_keeping_mtime(folder / "cat" / "1.jpg", b"z" * 10)
    seen.add(fingerprint(folder))
    (folder / "dog").mkdir()  # an empty class folder is part of what prep sees
    seen.add(fingerprint(folder))
    os.mkfifo(folder / "cat" / "4.jpg")  # opening it for reading would block
    started = time.monotonic()
    seen.add(fingerprint(folder))
    assert time.monotonic() - started < 10
    assert len(seen) == 6
    assert fingerprint(folder) in seen


def test_a_missing_path_is_fingerprinted_as_missing_and_prep_names_the_problem(tmp_path, user_package):
    found = fingerprint_prep_inputs(DataConfig(path=str(tmp_path / "nowhere.npz")), USER)
    assert found.sources[0].note == "nothing exists there"
    (tmp_path / "nowhere.npz").write_bytes(b"now it exists")
    assert fingerprint(tmp_path / "nowhere.npz") != found.digest


def test_the_user_code_that_prepares_data_is_fingerprinted_by_its_package_files_without_running_it(
    tmp_path, user_package
):
    data = tmp_path / "samples.npz"
    data.write_bytes(b"a")
    before = fingerprint(data)
    assert "fp_unit_pkg" not in sys.modules or not hasattr(sys.modules["fp_unit_pkg"], "workload")
    (user_package / "workload.py").write_text("raise RuntimeError('user code ran')\nEVERY = 2\n")
    edited = fingerprint(data)
    assert edited != before
    (user_package / "helpers.py").write_text("SCALE = 2.0\n")  # a helper the workload imports counts too
    helper = fingerprint(data)
    assert helper != edited
    (user_package / "__pycache__").mkdir()
    (user_package / "__pycache__" / "workload.cpython-311.pyc").write_bytes(b"compiled")
    os.utime(user_package / "workload.py", ns=(0, 10**18))  # a fresh checkout of the same code
    assert fingerprint(data) == helper
    (code,) = [s for s in fingerprint_prep_inputs(DataConfig(path=str(data)), USER).sources if s.field != "data.path"]
    assert code.field == "workload.name" and code.found_at == str(user_package)
    assert (code.num_files, code.num_hashed) == (3, 3)


def test_a_dataset_source_is_fingerprinted_and_code_that_is_not_importable_is_noted_not_raised(user_package):
    source = WorkloadConfig(dataset_source="fp_unit_pkg.workload:load")
    assert user_code_paths(source) == [("workload.dataset_source", "fp_unit_pkg.workload:load")]
    assert user_code_paths(WorkloadConfig(model_factory="fp_unit_pkg.workload:build")) == []
    missing = fingerprint_prep_inputs(DataConfig(), WorkloadConfig(name="fp_no_such_pkg.workload:Build"))
    assert missing.sources[0].note == "package 'fp_no_such_pkg' is not importable here"


def test_only_what_prep_reads_is_fingerprinted():
    assert data_locations(DataConfig(path="/data/ignored"), WorkloadConfig()) == []  # digits ignores data.path
    assert data_locations(DataConfig(dataset="cifar10", path="/data/c.tar.gz"), WorkloadConfig()) == [
        ("data.path", "/data/c.tar.gz")
    ]
    text = DataConfig(dataset="text", path="s3://b/docs", tokenizer="s3://b/tokenizer.json")
    assert data_locations(text, WorkloadConfig(name="causal_lm")) == [
        ("data.path", "s3://b/docs"),
        ("data.tokenizer", "s3://b/tokenizer.json"),
    ]
    assert data_locations(DataConfig(path="/data/table.csv"), USER) == [("data.path", "/data/table.csv")]
    assert fingerprint_prep_inputs(DataConfig(), WorkloadConfig()).sources == []


def test_s3_objects_are_keyed_by_their_listed_etags_and_sizes_and_never_downloaded(s3_server, session_root):
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    prefix = "s3://flyte/fp-unit/images"
    fs.pipe(f"{prefix}/cat/1.jpg", b"x" * 100)
    fs.pipe(f"{prefix}/dog/1.jpg", b"y" * 100)
    data = DataConfig(dataset="image_folder", path=prefix, image_size=32)
    moto_log = session_root / "moto.log"
    logged_before = moto_log.read_text()
    found = fingerprint_prep_inputs(data, WorkloadConfig())
    (source,) = found.sources
    assert (source.num_files, source.num_bytes, source.num_hashed) == (2, 200, 0)
    assert fingerprint_prep_inputs(data, WorkloadConfig()).digest == found.digest
    requests = moto_log.read_text()[len(logged_before) :]
    assert "list-type=2" in requests
    assert not [line for line in requests.splitlines() if '"GET /flyte/fp-unit/' in line], requests
    fs.pipe(f"{prefix}/cat/1.jpg", b"z" * 100)  # re-uploaded, same size: a new ETag
    changed = fingerprint_prep_inputs(data, WorkloadConfig()).digest
    assert changed != found.digest
    fs.pipe(f"{prefix}/cat/2.jpg", b"z")
    assert fingerprint_prep_inputs(data, WorkloadConfig()).digest not in (found.digest, changed)
    single = DataConfig(dataset="cifar10", path=f"{prefix}/cat/1.jpg")
    (one,) = fingerprint_prep_inputs(single, WorkloadConfig()).sources
    assert (one.num_files, one.num_bytes) == (1, 100)
