"""Hostile checkpoint input: every defect of issue 16's "A malformed checkpoint falls back instead of crashing" and
the checkpoint part of "Files we read are data, never paths out", on real checkpoint directories written by the
module's own save path, then damaged (and re-signed, where the damage must get past the manifest's hashes).

A malformed newest checkpoint is skipped with a warning that names it and the reason, and the older valid one is
loaded; nothing else escapes; every message stays under a few kilobytes.
"""

from __future__ import annotations

import dataclasses
import errno
import fractions
import io
import json
import logging
import os
import pickle
import re
import shutil
import typing
import uuid
from pathlib import Path

import hypothesis
import pytest
import torch

from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.records import EpochRecord, StepRecord
from training_core.schema import describe
from training_core.train.rng import gather_rng_states

MAX_MESSAGE_CHARS = 4096
OLDER, NEWER = "step-000000010", "step-000000020"
FIXTURE_CHECKPOINT = (
    Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_before_typed_records" / "step-000000011"
)


def _save_checkpoints(root: str, steps: tuple[int, ...] = (10, 20)) -> None:
    """Real checkpoints of a small model with an optimizer, scheduler and RNG states, one per step, written by the
    module's save path (``Checkpointer.stage`` and ``save``)."""
    checkpointer = ckpt.Checkpointer(ckpt.CheckpointStorage(root), keep_last=len(steps), async_save=False)
    for step in steps:
        torch.manual_seed(step)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
        json_rng, torch_rng = gather_rng_states(1)
        meta = ckpt.CheckpointMeta(
            model_name="small_cnn",
            classes=["a", "b", "c"],
            input_shape=[4],
            mean=[0.5],
            std=[0.25],
            epoch=1,
            step_in_epoch=step - 10,
            global_step=step,
            config=TrainingConfig().to_dict(),
            best_metric=0.5,
            metric=0.5,
            history=[EpochRecord(1, 10, 1.2, 0.4, 1.3, 0.5, 0.01, 900.0)],
            step_log=[StepRecord(step, 1, 1.0, 0.5, 0.1, 2.0, 100.0, 0.01, 0.001, 0.1, elapsed_s=1.0, num_steps=5)],
            rng=json_rng,
            resumed_from_steps=[10],
            resume_timings=[{"from_step": 10.0, "restored_unix": 1.0, "first_step_unix": 2.0}],
            epoch_partial={"loss": 1.5, "correct": 3.0, "samples": 8.0, "time_s": 0.1},
            elapsed_s=3.5,
        )
        state = checkpointer.stage(
            model=model, optimizer=optimizer, scheduler=scheduler, meta=meta, torch_rng=torch_rng
        )
        checkpointer.save(step, state, metric=0.5)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("checkpoints")
    _save_checkpoints(str(root))
    return root


@pytest.fixture
def root(template, tmp_path) -> Path:
    """A fresh copy of the two real checkpoints, ``step-000000010`` and ``step-000000020``."""
    copy = tmp_path / "ckpt"
    shutil.copytree(template, copy)
    return copy


def _resign(directory: Path) -> None:
    """Rewrite the manifest to match the files as they are now, as a writer that damaged them knowingly would."""
    manifest = json.loads((directory / ckpt.MANIFEST_FILE).read_text())
    files = {name: (directory / name).read_bytes() for name in ckpt.CHECKPOINT_FILES}
    signed = ckpt.manifest_for(files, global_step=manifest["global_step"], metric=manifest["metric"])
    (directory / ckpt.MANIFEST_FILE).write_bytes(signed)


def _edit_json(path: Path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def _torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _load_with_warnings(storage: ckpt.CheckpointStorage, caplog) -> tuple[ckpt.LoadedCheckpoint | None, str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="training_core"):
        loaded = ckpt.load_latest_valid(storage)
    for record in caplog.records:
        assert len(record.getMessage()) < MAX_MESSAGE_CHARS, record.getMessage()[:500]
    return loaded, caplog.text


def _manifest(edit):
    return lambda d: _edit_json(d / ckpt.MANIFEST_FILE, edit)


def _resigned(damage):
    def apply(directory: Path) -> None:
        damage(directory)
        _resign(directory)

    return apply


def _meta(edit):
    return _resigned(lambda d: _edit_json(d / ckpt.META_FILE, edit))


def _write(file: str, data: bytes):
    return _resigned(lambda d: (d / file).write_bytes(data))


MALFORMED = {
    "manifest-is-a-json-list": (
        lambda d: (d / ckpt.MANIFEST_FILE).write_text('["model.pt", "trainer_state.pt", "meta.json"]'),
        "manifest.json holds ['model.pt', 'trainer_state.pt', 'meta.json']: expected a JSON object",
    ),
    "manifest-lacks-files": (_manifest(lambda m: m.pop("files")), "manifest.json has no files: expected exactly"),
    "manifest-omits-model.pt": (
        _manifest(lambda m: m["files"].pop(ckpt.MODEL_FILE)),
        "manifest.json lists the files 'meta.json', 'trainer_state.pt': expected exactly model.pt,",
    ),
    "manifest-omits-trainer_state.pt": (
        _manifest(lambda m: m["files"].pop(ckpt.TRAINER_STATE_FILE)),
        "manifest.json lists the files 'meta.json', 'model.pt': expected exactly",
    ),
    "manifest-omits-meta.json": (
        _manifest(lambda m: m["files"].pop(ckpt.META_FILE)),
        "manifest.json lists the files 'model.pt', 'trainer_state.pt': expected exactly",
    ),
    "manifest-entry-is-a-string": (
        _manifest(lambda m: m["files"].update({ckpt.MODEL_FILE: "c98a4e8c"})),
        "manifest.json entry of model.pt='c98a4e8c' is invalid: expected {\"bytes\"",
    ),
    "manifest-has-an-unknown-key": (
        _manifest(lambda m: m.update({"signed_by": "someone"})),
        "manifest.json has unknown key(s) 'signed_by': expected exactly the keys global_step, metric, files",
    ),
    "manifest-is-not-json": (
        lambda d: (d / ckpt.MANIFEST_FILE).write_bytes(b"\xff{not json"),
        "manifest.json is not valid JSON: UnicodeDecodeError",
    ),
    "model-refused-by-weights-only": (
        _write(ckpt.MODEL_FILE, _torch_bytes({"weight": fractions.Fraction(1, 3)})),
        "model.pt cannot be loaded with torch.load(weights_only=True): UnpicklingError",
    ),
    "model-is-not-a-state-dict": (
        _write(ckpt.MODEL_FILE, _torch_bytes([torch.zeros(2)])),
        "model.pt holds [tensor([0., 0.])]: expected a model's state dict of tensors",
    ),
    "trainer-state-is-garbage": (
        _write(ckpt.TRAINER_STATE_FILE, b"\x80\x02garbage, not a torch file" * 10),
        "trainer_state.pt cannot be loaded with torch.load(weights_only=True):",
    ),
    "trainer-state-holds-an-unknown-entry": (
        _write(ckpt.TRAINER_STATE_FILE, _torch_bytes({"optimizer": {}, "surprise": 3})),
        "trainer_state.pt holds {'optimizer': {}, 'surprise': 3}: expected a mapping of state dicts named optimizer",
    ),
    "meta-has-an-unknown-key": (
        _meta(lambda m: m.update({"surprise": 1})),
        "meta.json has unknown field(s) 'surprise': it was not written by this module; valid fields are model_name,",
    ),
    "meta-is-not-an-object": (
        _write(ckpt.META_FILE, b'["model_name", "small_cnn"]'),
        "meta.json holds ['model_name', 'small_cnn']: expected a JSON object of checkpoint metadata",
    ),
    "meta-lacks-a-required-key": (
        _meta(lambda m: m.pop("model_name")),
        "meta.json lacks the required field(s) model_name",
    ),
    "meta-epoch-is-a-string": (
        _meta(lambda m: m.update({"epoch": "one"})),
        "meta.json field epoch='one' is invalid: expected an integer >= 0",
    ),
    "meta-classes-are-numbers": (
        _meta(lambda m: m.update({"classes": [1, 2, 3]})),
        "meta.json field classes=[1, 2, 3] is invalid: expected a list of strings",
    ),
    "meta-history-record-lacks-figures": (
        _meta(lambda m: m["history"][0].pop("val_loss")),
        "meta.json field history=[{'allreduce_fraction': 0.0, ",
    ),
    "meta-rng-is-a-list": (
        _meta(lambda m: m.update({"rng": [1, 2]})),
        "meta.json field rng=[1, 2] is invalid: expected an object of per-rank 'python' and 'numpy' RNG states",
    ),
    "meta-is-not-json": (_write(ckpt.META_FILE, b'{"epoch": 1,'), "meta.json is not valid JSON: JSONDecodeError"),
}


@pytest.mark.parametrize("damage", sorted(MALFORMED))
def test_a_malformed_newest_checkpoint_is_skipped_with_a_warning_and_the_older_one_loads(root, caplog, damage):
    mutate, reason = MALFORMED[damage]
    mutate(root / NEWER)
    loaded, warnings = _load_with_warnings(ckpt.CheckpointStorage(str(root)), caplog)
    assert loaded is not None and loaded.name == OLDER and loaded.meta.global_step == 10
    assert f"skipping checkpoint {root / NEWER}: " in warnings
    assert reason in warnings, warnings
    assert f"resuming from {root / OLDER} instead of the newer {NEWER}" in warnings


def test_verify_and_load_raises_a_checkpoint_error_naming_the_file_for_each_malformation(root):
    for damage, (mutate, reason) in MALFORMED.items():
        directory = root / f"step-{damage}"
        shutil.copytree(root / NEWER, directory)
        mutate(directory)
        with pytest.raises(ckpt.CheckpointError) as excinfo:
            ckpt.verify_and_load(ckpt.CheckpointStorage(str(root)), directory.name)
        assert str(excinfo.value).startswith(f"{directory}/") and reason in str(excinfo.value), damage


def test_a_checkpoint_written_before_typed_records_passes_every_check():
    storage = ckpt.CheckpointStorage(str(FIXTURE_CHECKPOINT.parent))
    loaded = ckpt.verify_and_load(storage, FIXTURE_CHECKPOINT.name)
    assert loaded.meta.global_step == 11 and loaded.meta.model_name == "small_cnn"
    assert set(loaded.trainer) == {"optimizer", "scheduler", "scaler", "rng"}
    assert ckpt.load_meta(str(FIXTURE_CHECKPOINT)) == loaded.meta


def test_every_meta_field_has_a_schema_check():
    hints = typing.get_type_hints(ckpt.CheckpointMeta, include_extras=True)
    assert set(hints) == {f.name for f in dataclasses.fields(ckpt.CheckpointMeta)}
    assert all(describe(hint).split()[0] in ("a", "an", "true") for hint in hints.values())


def test_unknown_meta_fields_are_listed_up_to_ten_each_bounded():
    raw = json.loads((FIXTURE_CHECKPOINT / ckpt.META_FILE).read_text())
    raw.update({f"extra_{i:03d}_" + "x" * 10_000: i for i in range(300)})
    with pytest.raises(ValueError) as excinfo:
        ckpt.CheckpointMeta.from_dict(raw, where="meta.json")
    message = str(excinfo.value)
    assert message.startswith("meta.json has unknown field(s) 'extra_000_xxx") and "and 290 more" in message
    assert len(message) < MAX_MESSAGE_CHARS


class RecordingStorage(ckpt.CheckpointStorage):
    """A local storage that records every file it reads."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.files_read: list[str] = []

    def read(self, name: str, file: str, *, max_bytes: int) -> bytes:
        self.files_read.append(file)
        return super().read(name, file, max_bytes=max_bytes)


@pytest.mark.parametrize(
    "name",
    [
        "../outside.pt",
        "../../etc/hostname",
        "/etc/hostname",
        "sub/model.pt",
        "sub\\model.pt",
        "..",
        ".",
        "",
        "s3://bucket/model.pt",
        "file:///etc/hostname",
        "C:model.pt",
    ],
)
def test_a_manifest_naming_a_file_outside_its_directory_is_refused_before_any_read(root, caplog, name):
    outside = root / "outside.pt"
    outside.write_bytes((root / NEWER / ckpt.MODEL_FILE).read_bytes())

    def point_outside(manifest):
        manifest["files"][name] = manifest["files"].pop(ckpt.MODEL_FILE)

    _edit_json(root / NEWER / ckpt.MANIFEST_FILE, point_outside)
    storage = RecordingStorage(str(root))
    with pytest.raises(ckpt.CheckpointError, match="which is not a plain name inside the checkpoint's directory"):
        ckpt.verify_and_load(storage, NEWER)
    assert storage.files_read == [ckpt.MANIFEST_FILE]
    loaded, warnings = _load_with_warnings(storage, caplog)
    assert loaded.name == OLDER and f"skipping checkpoint {root / NEWER}" in warnings


def test_step_directories_are_ordered_by_their_parsed_step_and_other_names_are_ignored(root, caplog):
    shutil.copytree(root / OLDER, root / "step-5")  # a stray copy: string order would make it the newest
    for stray in ("step-7x", "step-", "step-\u00b2", "step-0x10", ".tmp-step-000000099-abcd", "notes"):
        (root / stray).mkdir()
    (root / "step-000000099.txt").write_text("not a checkpoint")
    storage = ckpt.CheckpointStorage(str(root))
    assert storage.list_steps() == ["step-5", OLDER, NEWER]
    loaded, warnings = _load_with_warnings(storage, caplog)
    assert loaded.name == NEWER and "skipping" not in warnings


def test_a_stray_invalid_step_directory_with_a_large_step_is_skipped(root, caplog):
    (root / "step-999999999999").mkdir()
    loaded, warnings = _load_with_warnings(ckpt.CheckpointStorage(str(root)), caplog)
    assert loaded.name == NEWER
    assert f"skipping checkpoint {root / 'step-999999999999'}: " in warnings and "no readable manifest.json" in warnings


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda path: path.mkdir(), "a directory"),
        (lambda path: os.mkfifo(path), "a FIFO"),  # a plain read waited for a writer forever
        (lambda path: path.symlink_to("/dev/zero"), "a character device"),  # a plain read never ended
    ],
    ids=["directory", "fifo", "dev-zero"],
)
def test_a_manifest_that_is_no_regular_file_fails_at_once_without_retries_and_the_older_one_loads(
    root, caplog, make, kind
):
    (root / NEWER / ckpt.MANIFEST_FILE).unlink()
    make(root / NEWER / ckpt.MANIFEST_FILE)
    # Were it retried, the first retry alone would wait an hour.
    storage = ckpt.CheckpointStorage(str(root), retries=5, retry_wait_s=3600.0)
    loaded, warnings = _load_with_warnings(storage, caplog)
    assert loaded.name == OLDER
    assert "retrying" not in warnings
    assert f"reading {root / NEWER}/manifest.json failed after 1 attempt(s), not retryable: " in warnings
    assert f"is {kind}, not a regular file" in warnings


def test_a_checkpoint_file_longer_than_its_manifest_says_is_not_read_past_it(root, caplog):
    model = root / NEWER / ckpt.MODEL_FILE
    model.write_bytes(model.read_bytes() + b"\0" * 4096)
    loaded, warnings = _load_with_warnings(ckpt.CheckpointStorage(str(root)), caplog)
    assert loaded.name == OLDER and "holds more than" in warnings


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")


def _permanent_errors():
    return [
        IsADirectoryError(errno.EISDIR, "Is a directory"),
        NotADirectoryError(errno.ENOTDIR, "Not a directory"),
        PermissionError(errno.EACCES, "Permission denied"),
        OSError(errno.EACCES, "Permission denied"),
        OSError(errno.ENOSPC, "No space left on device"),
        ValueError("bad argument"),
        TypeError("bad type"),
        _client_error("AccessDenied", 403),
    ]


def _transient_errors():
    from botocore.exceptions import EndpointConnectionError

    return [
        ConnectionError("endpoint unreachable"),
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        TimeoutError("read timed out"),
        EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),
        _client_error("SlowDown", 503),
        _client_error("Throttling", 400),
        _client_error("InternalError", 500),
    ]


def test_the_metadata_of_a_directory_without_one_is_a_checkpoint_error_without_credentials():
    root = f"memory://AKIAMARKER:SECRETMARKER@bucket-{uuid.uuid4().hex[:8]}/run"
    with pytest.raises(
        ckpt.CheckpointError, match=r"memory://\*\*\*@bucket-.*/run/step-000000001/meta.json is missing"
    ) as excinfo:
        ckpt.load_meta(f"{root}/step-000000001")
    assert "SECRETMARKER" not in str(excinfo.value)


def test_storage_errors_that_waiting_cannot_fix_are_not_retried(tmp_path, caplog):
    storage = ckpt.CheckpointStorage(str(tmp_path), retries=5, retry_wait_s=3600.0)
    for error in _permanent_errors():
        calls = []

        def fail(error=error, calls=calls):
            calls.append(1)
            raise error

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="training_core"):
            with pytest.raises(ckpt.CheckpointError, match="failed after 1 attempt\\(s\\), not retryable"):
                storage._retry("reading x", fail)
        assert calls == [1] and "retrying" not in caplog.text, error
    calls = []
    with pytest.raises(FileNotFoundError):
        storage._retry("reading x", lambda: calls.append(1) or open(tmp_path / "missing", "rb"))
    assert calls == [1]


def test_transient_storage_errors_are_retried(tmp_path, caplog):
    storage = ckpt.CheckpointStorage(str(tmp_path), retries=2, retry_wait_s=0.0)
    for error in _transient_errors():
        calls = []

        def flaky(error=error, calls=calls):
            calls.append(1)
            if len(calls) < 3:
                raise error
            return "ok"

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="training_core"):
            assert storage._retry("reading x", flaky) == "ok"
        assert len(calls) == 3 and caplog.text.count("retrying") == 2, error


def test_credentials_in_the_root_never_reach_a_message_and_io_still_uses_them(caplog):
    import fsspec

    bucket = f"bucket-{uuid.uuid4().hex[:8]}"
    root = f"memory://AKIAMARKER:SECRETMARKER@{bucket}/run/checkpoints"
    storage = ckpt.CheckpointStorage(root, retries=1, retry_wait_s=0.0)
    fs = fsspec.filesystem("memory")
    try:
        with caplog.at_level(logging.INFO, logger="training_core"):
            _save_checkpoints(root)
        fs.rm(f"{storage.path}/{NEWER}/{ckpt.MANIFEST_FILE}")
        fs.mkdir(
            f"{storage.path}/{NEWER}/{ckpt.MANIFEST_FILE}"
        )  # the filesystem's own error quotes its path, userinfo and all
        # The older one: an empty meta.json, re-signed, so that its reason is the schema's.
        older = f"{storage.path}/{OLDER}"
        files = {name: fs.cat_file(f"{older}/{name}") for name in ckpt.CHECKPOINT_FILES} | {ckpt.META_FILE: b"{}"}
        fs.pipe_file(f"{older}/{ckpt.META_FILE}", b"{}")
        fs.pipe_file(f"{older}/{ckpt.MANIFEST_FILE}", ckpt.manifest_for(files, global_step=10, metric=0.5))
        loaded, warnings = _load_with_warnings(storage, caplog)
        assert loaded is None
        with pytest.raises(ckpt.CheckpointError) as excinfo:
            ckpt.load_directory(f"{root}/{OLDER}")
        with pytest.raises(ckpt.CheckpointError) as meta_error:
            ckpt.load_meta(f"{root}/{OLDER}")
        for text in (caplog.text, str(excinfo.value), str(meta_error.value)):
            assert "SECRETMARKER" not in text and "AKIAMARKER" not in text, text
        assert f"skipping checkpoint memory://***@{bucket}/run/checkpoints/{NEWER}" in warnings
        assert f"memory://***@{bucket}/run/checkpoints/{OLDER}/meta.json lacks the required field(s)" in warnings
        assert storage.display_uri(OLDER) == f"memory://***@{bucket}/run/checkpoints/{OLDER}"
        assert storage.uri(OLDER) == f"{root}/{OLDER}"
    finally:
        fsspec.filesystem("memory").rm(storage.path, recursive=True)


def _assert_well_typed(meta: ckpt.CheckpointMeta) -> None:
    """Whatever loads holds every field with the type the code that reads it expects (an oracle independent of
    the module's schema table)."""

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def is_number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    checks = {
        "model_name": isinstance(meta.model_name, str),
        "classes": isinstance(meta.classes, list) and all(isinstance(c, str) for c in meta.classes),
        "input_shape": isinstance(meta.input_shape, list) and all(is_int(n) and n >= 0 for n in meta.input_shape),
        "mean": isinstance(meta.mean, list) and all(is_number(x) for x in meta.mean),
        "std": isinstance(meta.std, list) and all(is_number(x) for x in meta.std),
        "epoch": is_int(meta.epoch) and meta.epoch >= 0,
        "global_step": is_int(meta.global_step) and meta.global_step >= 0,
        "config": isinstance(meta.config, dict),
        "step_in_epoch": is_int(meta.step_in_epoch) and meta.step_in_epoch >= 0,
        "best_metric": meta.best_metric is None or is_number(meta.best_metric),
        "metric": meta.metric is None or is_number(meta.metric),
        "history": all(
            isinstance(r, EpochRecord) and all(is_number(v) for v in dataclasses.asdict(r).values())
            for r in meta.history
        ),
        "step_log": all(
            isinstance(r, StepRecord) and all(is_number(v) for v in dataclasses.asdict(r).values())
            for r in meta.step_log
        ),
        "rng": isinstance(meta.rng, dict)
        and all(isinstance(s, dict) and {"python", "numpy"} <= s.keys() for s in meta.rng.values()),
        "resumed_from_steps": all(is_int(n) for n in meta.resumed_from_steps),
        "resume_timings": all(isinstance(t, dict) for t in meta.resume_timings),
        "epoch_partial": isinstance(meta.epoch_partial, dict)
        and all(is_number(v) for v in meta.epoch_partial.values()),
        "mlflow_model_uri": isinstance(meta.mlflow_model_uri, str),
        "mlflow_run_id": isinstance(meta.mlflow_run_id, str),
        "elapsed_s": is_number(meta.elapsed_s),
        "saved_unix": is_number(meta.saved_unix),
        "telemetry": isinstance(meta.telemetry, dict),
        "data": isinstance(meta.data, dict),
        "preempted": isinstance(meta.preempted, bool),
        "data_exhausted": isinstance(meta.data_exhausted, bool),
        "num_parameters": is_int(meta.num_parameters) and meta.num_parameters >= 0,
        "frozen_base_sha256": meta.frozen_base_sha256 == "" or len(meta.frozen_base_sha256) == 64,
        "data_remaining": all(len(pair) == 2 and all(is_int(n) for n in pair) for pair in meta.data_remaining),
    }
    assert set(checks) == {f.name for f in dataclasses.fields(meta)}
    assert all(checks.values()), [name for name, ok in checks.items() if not ok]


PATH_LIKE_NAMES = [
    "../model.pt",
    "../../etc/hostname",
    "/etc/hostname",
    "s3://bucket/model.pt",
    "file:///etc/passwd",
    "sub\\model.pt",
    "model.pt/..",
    "C:model.pt",
    "",
    ".",
    "..",
    "model.pt\x00",
]
HOSTILE_TEXTS = [
    b"",
    b"\xff\xfe\x00",
    b"[" * 100_000,
    b'{"files": ' + b"1" * 5000 + b"}",
    b"NaN",
    b"null",
    b'{"a": 1, "a": 2}',
]


def _mutations(st):
    """A target file (``manifest.json`` as is, or ``meta.json`` re-signed) and a list of edits of its parsed JSON:
    drop, add or replace keys with random JSON values (numbers of any size, NaN and inf, text, nested lists and
    objects), path-like file names, record fields, or the whole document replaced by JSON or by hostile text."""
    texts = st.text(max_size=12)
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-3, max_value=100),
        st.integers(min_value=-(10**40), max_value=10**40),
        st.floats(),
        texts,
        st.sampled_from(PATH_LIKE_NAMES + ["0" * 64, "f" * 64, "F" * 64, "model.pt"]),
    )
    values = st.recursive(
        scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=10
    )
    manifest_keys = ["global_step", "metric", "files", "written_at"]
    meta_keys = [f.name for f in dataclasses.fields(ckpt.CheckpointMeta)]
    edit = st.one_of(
        st.tuples(st.just("drop"), st.sampled_from(manifest_keys + meta_keys)),
        st.tuples(st.just("set"), st.sampled_from(manifest_keys + meta_keys) | texts, values),
        st.tuples(st.just("drop file"), st.sampled_from(ckpt.CHECKPOINT_FILES)),
        st.tuples(
            st.just("rename file"), st.sampled_from(ckpt.CHECKPOINT_FILES), st.sampled_from(PATH_LIKE_NAMES) | texts
        ),
        st.tuples(
            st.just("set entry"), st.sampled_from(ckpt.CHECKPOINT_FILES), st.sampled_from(["bytes", "sha256"]), values
        ),
        st.tuples(
            st.just("set record"),
            st.sampled_from(["history", "step_log"]),
            st.sampled_from(["epoch", "lr"]) | texts,
            values,
        ),
        st.tuples(
            st.just("drop record field"), st.sampled_from(["history", "step_log"]), st.sampled_from(["epoch", "lr"])
        ),
        st.tuples(st.just("replace"), values),
        st.tuples(st.just("raw"), st.sampled_from(HOSTILE_TEXTS)),
    )
    return st.tuples(st.sampled_from([ckpt.MANIFEST_FILE, ckpt.META_FILE]), st.lists(edit, min_size=1, max_size=3))


def _apply(raw, edits):
    """``raw`` (parsed JSON) with ``edits`` applied; bytes when an edit replaced the text itself."""
    for edit in edits:
        kind = edit[0]
        if kind == "raw":
            return edit[1]
        if kind == "replace":
            raw = edit[1]
        elif not isinstance(raw, dict):
            continue
        elif kind == "drop":
            raw.pop(edit[1], None)
        elif kind == "set":
            raw[edit[1]] = edit[2]
        elif isinstance(raw.get("files"), dict) and kind == "drop file":
            raw["files"].pop(edit[1], None)
        elif isinstance(raw.get("files"), dict) and kind == "rename file" and edit[1] in raw["files"]:
            raw["files"][edit[2]] = raw["files"].pop(edit[1])
        elif isinstance(raw.get("files"), dict) and kind == "set entry" and isinstance(raw["files"].get(edit[1]), dict):
            raw["files"][edit[1]][edit[2]] = edit[3]
        elif kind in ("set record", "drop record field") and isinstance(raw.get(edit[1]), list) and raw[edit[1]]:
            record = raw[edit[1]][0]
            if isinstance(record, dict):
                if kind == "set record":
                    record[edit[2]] = edit[3]
                else:
                    record.pop(edit[2], None)
    return json.dumps(raw).encode()


def test_a_mutated_manifest_or_meta_loads_unchanged_or_falls_back_with_a_short_warning(template, tmp_path, caplog):
    root = tmp_path / "ckpt"
    shutil.copytree(template, root)
    newest = root / NEWER
    originals = {name: (newest / name).read_bytes() for name in (ckpt.MANIFEST_FILE, ckpt.META_FILE)}
    storage = ckpt.CheckpointStorage(str(root), retries=0)
    expected = {name: ckpt.verify_and_load(storage, name) for name in (OLDER, NEWER)}
    outcomes = {OLDER: 0, NEWER: 0}

    @hypothesis.settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @hypothesis.given(_mutations(hypothesis.strategies))
    def check(mutation):
        target, edits = mutation
        for name, data in originals.items():
            (newest / name).write_bytes(data)
        (newest / target).write_bytes(_apply(json.loads(originals[target]), edits))
        if target == ckpt.META_FILE:
            _resign(newest)
        loaded, warnings = _load_with_warnings(storage, caplog)
        assert loaded is not None and loaded.name in (OLDER, NEWER), warnings
        outcomes[loaded.name] += 1
        want = expected[loaded.name]
        assert loaded.model.keys() == want.model.keys()
        assert all(torch.equal(loaded.model[k], want.model[k]) for k in want.model)
        assert loaded.trainer.keys() == want.trainer.keys()
        _assert_well_typed(loaded.meta)
        if loaded.name == NEWER:
            assert "skipping" not in warnings, warnings
        else:
            assert f"skipping checkpoint {newest}: " in warnings, warnings
            assert loaded.meta == want.meta

    caplog.set_level(logging.WARNING, logger="training_core")
    check()
    num_cases = sum(outcomes.values())
    print(f"hypothesis: {num_cases} mutated checkpoint manifests and metas: {outcomes}")
    assert num_cases >= 100 and outcomes[OLDER] > 0 and outcomes[NEWER] > 0, outcomes


# ------------------------------------------------------------------------------------ sharded checkpoints (FSDP)


def _sharded_manifest(names: list[str]) -> bytes:
    entry = {"bytes": 1, "sha256": "0" * 64}
    raw = {
        "global_step": 1,
        "metric": None,
        "written_at": 0.0,
        "format": "sharded",
        "files": dict.fromkeys(names, entry),
    }
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    ("names", "fragment"),
    [
        (["trainer_state.pt", "meta.json", "shards/.metadata", "shards/../../etc.distcp"], "not a plain name"),
        (["trainer_state.pt", "meta.json", "shards/.metadata", "/abs/__0_0.distcp"], "not a plain name"),
        (["trainer_state.pt", "meta.json", "shards/__0_0.distcp"], "a sharded checkpoint lists exactly"),
        (["model.pt", "trainer_state.pt", "meta.json", "shards/.metadata", "shards/__0_0.distcp"], "lists exactly"),
    ],
    ids=["traversal", "absolute", "no-metadata", "model-file"],
)
def test_a_sharded_manifest_names_only_its_own_files(names, fragment):
    with pytest.raises(ckpt.CheckpointError, match=re.escape(fragment)):
        ckpt.CheckpointManifest.parse(_sharded_manifest(names), where="m.json")


def test_a_full_manifest_cannot_name_shard_files():
    raw = json.loads(_sharded_manifest(["model.pt", "trainer_state.pt", "meta.json", "shards/__0_0.distcp"]))
    del raw["format"]
    with pytest.raises(ckpt.CheckpointError, match="not a plain name"):
        ckpt.CheckpointManifest.parse(json.dumps(raw).encode(), where="m.json")


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_shard_metadata_pickle_that_names_anything_else_is_refused_without_running_it(tmp_path):
    """torch's own reader runs pickle.load on shards/.metadata; ours allows only the checkpoint's own records."""
    marker = tmp_path / "ran"
    with pytest.raises(ckpt.CheckpointError, match=r"posix\.system is not allowed"):
        ckpt.parse_shard_metadata(pickle.dumps(_RunsCode(str(marker))), where="shards/.metadata")
    assert not marker.exists()
