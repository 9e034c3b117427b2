"""Hostile sharded checkpoints (issue 33): a ``shards/.metadata`` is data too. On real sharded checkpoints written by
``Checkpointer.save_sharded`` under a one-process gloo group, then damaged and re-signed (the manifest's sha256
regenerated, as a writer with access to the checkpoint would), a resume never reads a byte outside the checkpoint,
never runs the pickle, never allocates beyond the file's size, and falls back to the older valid checkpoint with a
warning naming the newer one, as it does for a full checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import struct
import sys
import tracemalloc
from pathlib import Path

import hypothesis
import pytest
import torch

from training_core import checkpoint as ckpt

OLDER, NEWER, OTHER = ckpt.step_name(10), ckpt.step_name(20), ckpt.step_name(30)
MAX_MESSAGE_CHARS = 4096

_opened: list[str] | None = None
"""Paths opened while :func:`_tracing_opens` records (an audit hook sees every ``open``, ``os.open`` included)."""
_hooked: list[bool] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


@contextlib.contextmanager
def _tracing_opens():
    """The paths opened inside the block, by any code of this process."""
    global _opened
    if not _hooked:
        sys.addaudithook(_audit)  # an audit hook cannot be removed: it records only inside this block
        _hooked.append(True)
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


def _save(root: Path, step: int, *, in_features: int = 4) -> dict[str, torch.Tensor]:
    """A real sharded checkpoint of a small model with an optimizer at ``step``; returns its weights."""
    torch.manual_seed(step)
    model = torch.nn.Linear(in_features, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, in_features)).sum().backward()
    optimizer.step()
    meta = ckpt.CheckpointMeta(
        model_name="linear", classes=[], input_shape=[], mean=[], std=[], epoch=0, global_step=step, config={}
    )
    checkpointer = ckpt.Checkpointer(ckpt.CheckpointStorage(str(root)), keep_last=10, async_save=False)
    checkpointer.save_sharded(step, model=model, optimizer=optimizer, trainer_state={"rng": {}}, meta=meta)
    checkpointer.wait()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.fixture
def run(process_group, tmp_path):
    """Two sharded checkpoints of this run (``root``: OLDER, NEWER) and one of another run (``other``), whose
    shard a hostile ``.metadata`` points at. ``weights`` are each checkpoint's."""
    root, other = tmp_path / "run", tmp_path / "other"
    weights = {OLDER: _save(root, 10), NEWER: _save(root, 20), OTHER: _save(other, 30)}
    return root, other, weights


def _metadata_path(root: Path) -> Path:
    return root / NEWER / ckpt.SHARD_METADATA_FILE


def _original_metadata(root: Path):
    return pickle.loads(_metadata_path(root).read_bytes())  # the module's own file, written just now


def _resign(directory: Path) -> None:
    """Rewrite a sharded checkpoint's manifest to match its files as they are now."""
    path = directory / ckpt.MANIFEST_FILE
    manifest = ckpt.CheckpointManifest.parse(path.read_bytes(), where=str(path))
    files = {name: (directory / name).read_bytes() for name in ckpt.SHARDED_FILES}
    shards = {name: ckpt.file_entry(str(directory / name)) for name in manifest.shards}
    path.write_bytes(ckpt.manifest_for(files, global_step=manifest.global_step, metric=manifest.metric, shards=shards))


def _write_metadata(root: Path, data: bytes) -> None:
    _metadata_path(root).write_bytes(data)
    _resign(root / NEWER)


def _with_paths(metadata, path_of) -> bytes:
    """``metadata`` pickled with each storage entry's file renamed by ``path_of(index, relative_path)``."""
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=path_of(index, info.relative_path))
        for index, info in metadata.storage_data.items()
    }
    return pickle.dumps(metadata)


def _load(root: Path, caplog, **kwargs) -> tuple[ckpt.LoadedCheckpoint | None, str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="training_core"):
        loaded = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(root), retries=0), **kwargs)
    for record in caplog.records:
        assert len(record.getMessage()) < MAX_MESSAGE_CHARS, record.getMessage()[:500]
    return loaded, caplog.text


def _restored_weights(loaded: ckpt.LoadedCheckpoint) -> dict[str, torch.Tensor]:
    """The weights ``restore`` gives the run's model (and its optimizer) from ``loaded``."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt.restore(loaded, model=model, optimizer=optimizer)
    return model.state_dict()


def _assert_fell_back(root: Path, loaded, warnings: str, reason: str) -> None:
    assert loaded is not None and loaded.name == OLDER, warnings
    assert f"skipping checkpoint {root / NEWER}: " in warnings and reason in warnings, warnings
    assert f"resuming from {root / OLDER} instead of the newer {NEWER}" in warnings, warnings


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("form", ["absolute", "relative"])
def test_a_resigned_metadata_pointing_at_another_runs_shard_falls_back_and_reads_nothing_outside(run, caplog, form):
    root, other, weights = run
    target = other / OTHER / ckpt.SHARDS_DIR / "__0_0.distcp"
    path = str(target) if form == "absolute" else os.path.relpath(target, root / NEWER / ckpt.SHARDS_DIR)
    _write_metadata(root, _with_paths(_original_metadata(root), lambda index, name: path))
    with _tracing_opens() as opened:
        loaded, warnings = _load(root, caplog)
        restored = _restored_weights(loaded)
    _assert_fell_back(root, loaded, warnings, "which is not a plain file name beside it")
    _assert_same(restored, weights[OLDER])
    assert opened and not [p for p in opened if Path(p).resolve().is_relative_to(other)], opened


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_resigned_metadata_pickle_that_would_run_code_falls_back_without_running_it(run, caplog, tmp_path):
    root, _, weights = run
    marker = tmp_path / "ran"
    _write_metadata(root, pickle.dumps(_RunsCode(str(marker))))
    loaded, warnings = _load(root, caplog)
    _assert_fell_back(root, loaded, warnings, "posix.system is not allowed in shards/.metadata")
    _assert_same(_restored_weights(loaded), weights[OLDER])
    assert not marker.exists()


# PROTO 4, NONE, LONG_BINPUT 2**26, STOP: the C unpickler grows its memo to 2**26 slots (512 MiB) for it.
MEMO_BOMB = b"\x80\x04Nr" + struct.pack("<I", 2**26) + b"."


def test_a_metadata_with_a_huge_memo_index_is_refused_before_the_unpickler_allocates_for_it():
    assert len(MEMO_BOMB) == 9
    tracemalloc.start()
    try:
        with pytest.raises(ckpt.CheckpointError, match="memo index 67108864 at offset 3, beyond the 0 objects"):
            ckpt.parse_shard_metadata(MEMO_BOMB, where="shards/.metadata")
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 2**20, peak_bytes


def test_a_resigned_metadata_memo_bomb_falls_back(run, caplog):
    root, _, weights = run
    _write_metadata(root, MEMO_BOMB)
    tracemalloc.start()
    try:
        loaded, warnings = _load(root, caplog)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    _assert_fell_back(root, loaded, warnings, "is not a pickle this module reads: memo index 67108864")
    assert peak_bytes < 64 * 2**20, peak_bytes
    _assert_same(_restored_weights(loaded), weights[OLDER])


def _malformed(root: Path) -> dict[str, tuple[bytes, str]]:
    def edited(edit) -> bytes:
        metadata = _original_metadata(root)
        edit(metadata)
        return pickle.dumps(metadata)

    original = _metadata_path(root).read_bytes()
    first = next(iter(_original_metadata(root).storage_data))
    return {
        "garbage": (b"not a pickle at all", "is not a pickle this module reads"),
        "truncated": (original[: len(original) // 2], "is not a pickle this module reads"),
        "a-dict": (pickle.dumps({"storage_data": {}}), "holds {'storage_data': {}}: expected"),
        "no-storage-data": (
            edited(lambda m: setattr(m, "storage_data", None)),
            "lacks the state_dict_metadata and storage_data mappings",
        ),
        "an-entry-without-storage": (
            edited(lambda m: m.storage_data.pop(first)),
            f"has no storage for '{first.fqn}'",
        ),
        "a-chunk-outside-its-tensor": (
            edited(lambda m: setattr(m.state_dict_metadata["model.weight"].chunks[0], "sizes", torch.Size([9, 4]))),
            "expected offsets and sizes inside the tensor",
        ),
        "a-transformed-entry": (
            edited(lambda m: setattr(m.storage_data[first], "transform_descriptors", ["zstd"])),
            "transformed by ['zstd']",
        ),
        "a-shard-the-manifest-lacks": (
            _with_paths(_original_metadata(root), lambda index, name: "__1_0.distcp"),
            "in '__1_0.distcp', which the manifest does not list as a shard",
        ),
        "a-range-past-the-shard": (
            edited(lambda m: setattr(m.storage_data[first], "length", 10**9)),
            "of shards/__0_0.distcp, which holds",
        ),
    }


def test_a_resigned_malformed_metadata_or_one_naming_a_missing_shard_falls_back(run, caplog):
    root, _, weights = run
    cases = _malformed(root)
    for data, reason in cases.values():
        _write_metadata(root, data)
        loaded, warnings = _load(root, caplog)
        _assert_fell_back(root, loaded, warnings, reason)
        _assert_same(_restored_weights(loaded), weights[OLDER])
    assert len(cases) == 9


def test_shards_of_another_architecture_fall_back_when_the_model_is_known(process_group, tmp_path, caplog):
    root = tmp_path / "run"
    older = _save(root, 10)
    _save(root, 20, in_features=5)  # a valid checkpoint, of a model the run does not have
    model = torch.nn.Linear(4, 3)
    expected = ckpt.model_state_shapes(model)
    assert expected == {"weight": (3, 4), "bias": (3,)}
    loaded, warnings = _load(root, caplog, expected_shapes=expected)
    _assert_fell_back(
        root,
        loaded,
        warnings,
        "does not fit the model (another architecture?): its weights 'weight [3, 5] (model: [3, 4])'",
    )
    _assert_same(_restored_weights(loaded), older)
    unchecked, _ = _load(root, caplog)  # the shapes are what tells: without them the newer one is chosen
    assert unchecked.name == NEWER


PATH_LIKE_NAMES = [
    "__0_0.distcp",
    "__1_0.distcp",
    ".metadata",
    "../__0_0.distcp",
    "../../step-000000010/shards/__0_0.distcp",
    "/etc/hostname",
    "/dev/zero",
    "sub/__0_0.distcp",
    "sub\\__0_0.distcp",
    "",
    ".",
    "..",
    "C:__0_0.distcp",
    "file:///etc/hostname",
    "__0_0.distcp\x00",
]


def test_a_generated_metadata_is_refused_or_reads_only_its_own_listed_shards(run, caplog):
    """Property: whatever file names a re-signed ``.metadata`` gives its entries (any text, path-like names, another
    run's shard) and wherever the pickle is cut, a resume loads either the newer checkpoint, reading only the shard
    its manifest lists, or the older one with a warning; no file outside the run's checkpoints is opened."""
    st = hypothesis.strategies
    root, other, weights = run
    target = str(other / OTHER / ckpt.SHARDS_DIR / "__0_0.distcp")
    names = st.sampled_from(PATH_LIKE_NAMES + [target]) | st.text(max_size=20)
    expected_shapes = ckpt.model_state_shapes(torch.nn.Linear(4, 3))
    own_shards = {name: (root / name / ckpt.SHARDS_DIR / "__0_0.distcp").resolve() for name in (OLDER, NEWER)}
    original = _metadata_path(root).read_bytes()
    outcomes = {OLDER: 0, NEWER: 0}

    @hypothesis.settings(max_examples=100, deadline=None, database=None, derandomize=True)
    @hypothesis.given(
        paths=st.lists(st.none() | names, min_size=1, max_size=4),
        cut=st.none() | st.integers(0, 10**6),
    )
    def check(paths, cut):
        metadata = pickle.loads(original)  # the module's own file, as written
        for position, info in enumerate(metadata.storage_data.values()):
            if paths[position % len(paths)] is not None:
                info.relative_path = paths[position % len(paths)]
        data = pickle.dumps(metadata)
        _write_metadata(root, data if cut is None else data[: cut % len(data)])
        with _tracing_opens() as opened:
            loaded, warnings = _load(root, caplog, expected_shapes=expected_shapes)
            restored = _restored_weights(loaded)
        assert loaded is not None and loaded.name in outcomes, warnings
        outcomes[loaded.name] += 1
        resolved = [Path(p).resolve() for p in opened]
        outside = [p for p in resolved if p.is_relative_to(root.parent) and not p.is_relative_to(root)]
        assert not outside and not set(opened) & {"/etc/hostname", "/dev/zero"}, opened
        shards_read = {p for p in resolved if p.suffix == ".distcp"}
        if loaded.name == NEWER:
            assert "skipping" not in warnings, warnings
            assert shards_read == {own_shards[NEWER]}, shards_read
            _assert_same(restored, weights[NEWER])
        else:
            _assert_fell_back(root, loaded, warnings, f"{NEWER}/shards/.metadata")
            assert shards_read <= set(own_shards.values()), shards_read
            _assert_same(restored, weights[OLDER])

    caplog.set_level(logging.WARNING, logger="training_core")
    check()
    print(f"hypothesis: {sum(outcomes.values())} generated shards/.metadata: {outcomes}")
    assert outcomes[OLDER] > 0 and outcomes[NEWER] > 0, outcomes


@pytest.mark.timeout(60)
def test_a_fifo_planted_as_a_shard_is_refused_without_blocking(tmp_path):
    from training_core.files import UnreadableFile

    fifo = tmp_path / "__0_0.distcp"
    os.mkfifo(fifo)
    with pytest.raises(UnreadableFile, match="FIFO"):
        ckpt.file_entry(str(fifo))


def test_a_shard_is_never_read_past_its_manifest_size(tmp_path):
    from training_core.files import UnreadableFile

    link = tmp_path / "__0_0.distcp"
    link.symlink_to("/dev/zero")
    with pytest.raises(UnreadableFile, match="character device"):
        ckpt.file_entry(str(link), max_bytes=10)
    # A regular file longer than its entry: the read stops one piece past the entry's size.
    big = tmp_path / "big.distcp"
    big.write_bytes(b"\0" * (3 * 2**20))
    assert ckpt.file_entry(str(big), max_bytes=10).num_bytes == 2**20
