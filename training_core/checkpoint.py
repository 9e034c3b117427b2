"""Training checkpoints: a dict of stateful objects, saved and loaded by this one module.

A checkpoint is one directory ``step-<global step, 9 digits>`` under a root (a local path or any fsspec URI
such as ``s3://bucket/prefix``):

- ``model.pt``: the bare model's ``state_dict`` (no DDP ``module.`` prefix);
- ``trainer_state.pt``: optimizer, LR scheduler and GradScaler state, and the torch/CUDA RNG states;
- ``meta.json``: position (epoch, step in epoch, global step), best metric, python/numpy RNG states,
  metrics history, the resolved config, and what is needed to rebuild the model (name, classes, shape);
- ``manifest.json``: size and sha256 of each file above. It is written last, so a directory without a
  valid manifest is an incomplete checkpoint.

Everything read back is data, checked before use: the manifest against its schema (the three file names above and
nothing else, so it cannot point outside its directory), every file against the manifest, the tensor files by
``torch.load(weights_only=True)`` and their shape, ``meta.json`` by :meth:`CheckpointMeta.from_dict`, a sharded
checkpoint's ``shards/.metadata`` by a bounded unpickler that builds only torch's records, each stored in a shard the
manifest lists (:func:`parse_shard_metadata`, :func:`check_shard_metadata`; the restore loads by the parsed copy and
never reads the file again). A checkpoint that fails any check raises :class:`CheckpointError`, and
:func:`load_latest_valid` falls back to the next older one.
Step directories are ordered by their parsed step. Messages and log lines show storage URIs with their credentials
redacted (:func:`~training_core.redact.redact`); the I/O uses the real root.

Local roots are written to a temporary directory and renamed into place (atomic). Object stores get the
files first and the manifest last. Every file is verified against the manifest before loading, and tensor
files are read with ``torch.load(weights_only=True)``, which never executes pickled code.

:class:`Checkpointer` saves asynchronously: ``save`` copies tensors to CPU memory (the only part the
training step waits for) and a background thread serialises, writes and prunes. At most one save is in
flight; the next ``save`` waits for it instead of piling up.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

from training_core.config import clip, is_plain_file_name, quote
from training_core.files import UnreadableFile, open_regular_local
from training_core.records import EpochRecord, StepLog, StepRecord
from training_core.redact import redact

log = logging.getLogger("training_core")

MODEL_FILE = "model.pt"
TRAINER_STATE_FILE = "trainer_state.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_FILES = (MODEL_FILE, TRAINER_STATE_FILE, META_FILE)
"""The files a manifest lists: exactly these, each a plain name inside the checkpoint's directory."""
SHARDS_DIR = "shards"
"""Folder of a sharded checkpoint's ``torch.distributed.checkpoint`` files: ``.metadata`` and one
``__<rank>_0.distcp`` per rank."""
SHARD_METADATA_FILE = f"{SHARDS_DIR}/.metadata"
_SHARD_FILE = re.compile(rf"{SHARDS_DIR}/(__[0-9]{{1,6}}_[0-9]{{1,6}}\.distcp|\.metadata)")
SHARDED_FILES = (TRAINER_STATE_FILE, META_FILE)
"""The files a sharded checkpoint's manifest lists besides its shards (no ``model.pt``: the weights are in them)."""
FORMATS = ("full", "sharded")
STEP_PREFIX = "step-"
_STEP_NAME = re.compile(r"step-([0-9]+)")
STEP_LOG_CAPACITY = 64
"""Step windows a checkpoint's ``meta.json`` keeps (about 25 KB); MLflow has every window."""
MAX_REASON_CHARS = 1000
"""Longest quote of an underlying error (torch's unpickling errors run to pages) in a message of this module."""


@dataclass
class CheckpointMeta:
    model_name: str
    classes: list[str]
    input_shape: list[int]
    mean: list[float]
    std: list[float]
    epoch: int
    """Epoch the run is in (0-based); with ``step_in_epoch == 0`` it has not started yet."""
    global_step: int
    """Optimizer steps completed."""
    config: dict[str, Any]
    step_in_epoch: int = 0
    """Optimizer steps of ``epoch`` already taken: a resume skips exactly these batches."""
    best_metric: float | None = None
    """Best value so far of the metric that ranks checkpoints (see ``CheckpointConfig``)."""
    metric: float | None = None
    """This checkpoint's value of that metric, when it was measured here."""
    history: list[EpochRecord] = field(default_factory=list)
    """One record per completed epoch: train/val loss and accuracy, LR, throughput."""
    step_log: list[StepRecord] = field(default_factory=list)
    """Logged step windows (loss, accuracy, LR, grad norm, samples/s), at most ``STEP_LOG_CAPACITY``: once full,
    adjacent windows are merged (see :class:`~training_core.records.StepLog`), so the file's size does not grow
    with the run's length. Every window is in MLflow at full resolution."""
    rng: dict[str, Any] = field(default_factory=dict)
    """Python and numpy RNG states per rank (JSON-safe); torch states live in ``trainer_state.pt``."""
    resumed_from_steps: list[int] = field(default_factory=list)
    """Global step each resume of this run started from (worker restarts, task retries)."""
    resume_timings: list[dict[str, float]] = field(default_factory=list)
    """Per resume: ``from_step``, ``restored_unix`` (state loaded), ``first_step_unix`` (first step done),
    ``num_workers`` (the world size it resumed on), ``preempted`` (1: resumed from a preemption checkpoint) and then
    ``lost_s``, the attempt's seconds from its start to that first step (counted in the cost as lost to the
    preemption; 0 with observability off)."""
    epoch_partial: dict[str, float] = field(default_factory=dict)
    """Loss, correct and sample sums of ``epoch`` so far, so a resumed epoch reports the same record."""
    mlflow_model_uri: str = ""
    mlflow_run_id: str = ""
    elapsed_s: float = 0.0
    """Seconds the run has trained so far, across resumes (the clock of ``step_log``'s ``elapsed_s``)."""
    num_parameters: int = 0
    """The model's parameter count (0 in checkpoints written before it): where it can be evaluated, without loading
    it (:func:`~training_core.evaluation.evaluation_placement`)."""
    saved_unix: float = 0.0
    """Unix time this metadata was written (0 in checkpoints written before it)."""
    preempted: bool = False
    """Written just in time because a worker was told to stop (SIGTERM): the run stopped at this very step, so
    a resume from it recomputes nothing."""
    data_remaining: list[list[int]] = field(default_factory=list)
    """Positions of ``epoch``'s global sample order not trained yet, as ``[start, stop)`` intervals
    (:mod:`training_core.loader`); empty at an epoch's start and in checkpoints written before it (which resume
    on the same number of workers only)."""
    data_exhausted: bool = False
    """Every sample of ``epoch``'s order was trained (``data_remaining`` is empty because nothing is left, not
    because the field predates it): written when a worker is told to stop at an epoch's last step, before its
    validation. A resume, on any number of workers, trains no more of that epoch."""
    data: dict[str, Any] = field(default_factory=dict)
    """The prepared data's description (:meth:`~training_core.data.Manifest.description`: workload, arrays, spec)
    that rebuilds the model; empty in checkpoints written before workloads (image classification)."""
    telemetry: dict[str, Any] = field(default_factory=dict)
    """Rank 0's telemetry for the Deck: ``samples`` (a bounded timeline of ``elapsed_s``, ``cpu_utilization``
    and ``gpu_utilization`` per GPU as ratios 0-1, ``memory_used_bytes`` and ``gpu_memory_used_bytes`` per GPU)
    and ``cost`` (``gpu_hours``, ``cpu_hours``, ``cost_usd`` and the prices). Empty with observability off."""

    def __post_init__(self) -> None:
        # From JSON the records arrive as mappings; a checkpoint written before the step log was bounded holds
        # every window, merged down here to the bound.
        self.history = [r if isinstance(r, EpochRecord) else EpochRecord.from_dict(r) for r in self.history]
        self.step_log = StepLog.from_list(self.step_log, capacity=STEP_LOG_CAPACITY).records

    @classmethod
    def from_dict(cls, raw: Any, *, where: str = META_FILE) -> CheckpointMeta:
        """The metadata in ``raw`` (the parsed ``meta.json``), checked before use.

        ``raw`` must be a JSON object with every required field, no unknown field, and each field of the type this
        module writes (records must hold their required figures as numbers). Fields added later take their
        defaults, so metadata written by earlier versions loads. Raises ``ValueError`` naming ``where``, the field,
        its value (quoted bounded in size) and what was expected."""
        if not isinstance(raw, dict):
            raise ValueError(f"{where} holds {quote(raw)}: expected a JSON object of checkpoint metadata")
        fields = dataclasses.fields(cls)
        unknown = [key for key in raw if key not in _META_FIELD_TYPES]
        if unknown:
            raise ValueError(
                f"{where} has unknown field(s) {_listed(unknown)}: it was not written by this module; "
                f"valid fields are {', '.join(f.name for f in fields)}"
            )
        required = [
            f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in raw]
        if missing:
            raise ValueError(f"{where} lacks the required field(s) {', '.join(missing)}")
        for key, value in raw.items():
            is_valid, expected = _META_FIELD_TYPES[key]
            if not is_valid(value):
                raise ValueError(f"{where} field {key}={quote(value)} is invalid: expected {expected}")
        return cls(**raw)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_mapping(value: Any) -> bool:
    return isinstance(value, dict)


def _list_of(is_item: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(is_item(v) for v in value)


def _numbers_by_name(value: Any) -> bool:
    return isinstance(value, dict) and all(_is_number(v) for v in value.values())


def _record_of(cls: type) -> Callable[[Any], bool]:
    """Whether a value is one record of ``cls`` as JSON holds it: its required fields present, its fields numbers
    (integral where the field is an int; JSON stores them as floats). Other keys are left to ``cls.from_dict``."""
    fields = dataclasses.fields(cls)
    required = {f.name for f in fields if f.default is dataclasses.MISSING}
    integral = {f.name for f in fields if f.type == "int"}
    numeric = {f.name for f in fields}

    def is_record(value: Any) -> bool:
        if not isinstance(value, dict) or not required <= value.keys():
            return False
        for key in numeric & value.keys():
            number = value[key]
            if not _is_number(number) or (key in integral and not float(number).is_integer()):
                return False
        return True

    return is_record


def _is_rng_states(value: Any) -> bool:
    """Whether a value is the per-rank python/numpy RNG states :func:`training_core.rng.restore_rng` takes."""
    if not isinstance(value, dict):
        return False
    for rank, states in value.items():
        if not (isinstance(rank, str) and rank.isdigit() and isinstance(states, dict)):
            return False
        python, numpy = states.get("python"), states.get("numpy")
        if not (isinstance(python, list) and len(python) == 3 and _list_of(_is_int)(python[1])):
            return False
        if not (isinstance(numpy, list) and len(numpy) == 5 and _list_of(_is_int)(numpy[1])):
            return False
    return True


_META_FIELD_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model_name": (_is_str, "a string"),
    "classes": (_list_of(_is_str), "a list of strings"),
    "input_shape": (_list_of(_is_count), "a list of integers >= 0"),
    "mean": (_list_of(_is_number), "a list of numbers"),
    "std": (_list_of(_is_number), "a list of numbers"),
    "epoch": (_is_count, "an integer >= 0"),
    "global_step": (_is_count, "an integer >= 0"),
    "config": (_is_mapping, "a JSON object (the resolved config)"),
    "step_in_epoch": (_is_count, "an integer >= 0"),
    "best_metric": (lambda v: v is None or _is_number(v), "a number or null"),
    "metric": (lambda v: v is None or _is_number(v), "a number or null"),
    "history": (_list_of(_record_of(EpochRecord)), "a list of epoch records (objects of numbers)"),
    "step_log": (_list_of(_record_of(StepRecord)), "a list of step records (objects of numbers)"),
    "rng": (_is_rng_states, "an object of per-rank 'python' and 'numpy' RNG states"),
    "resumed_from_steps": (_list_of(_is_count), "a list of integers >= 0"),
    "resume_timings": (_list_of(_numbers_by_name), "a list of objects of numbers"),
    "epoch_partial": (_numbers_by_name, "an object of numbers"),
    "mlflow_model_uri": (_is_str, "a string"),
    "mlflow_run_id": (_is_str, "a string"),
    "elapsed_s": (_is_number, "a number"),
    "telemetry": (_is_mapping, "a JSON object"),
    "data_remaining": (
        _list_of(lambda v: isinstance(v, list) and len(v) == 2 and all(_is_count(x) for x in v)),
        "a list of [start, stop] pairs of integers >= 0",
    ),
    "data_exhausted": (lambda v: isinstance(v, bool), "true or false"),
    "data": (_is_mapping, "a JSON object (the prepared data's description)"),
    "preempted": (lambda v: isinstance(v, bool), "true or false"),
    "num_parameters": (_is_count, "an integer >= 0"),
    "saved_unix": (_is_number, "a number (Unix time)"),
}
"""How each field of :class:`CheckpointMeta` is checked when read from JSON, and what the message says it expects."""


def _listed(names: list[Any], limit: int = 10) -> str:
    """Up to ``limit`` names, each quoted bounded in size, and how many more there are."""
    shown = ", ".join(quote(n) for n in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _reason(exc: BaseException) -> str:
    """An underlying error for a message: its type (unless it is this module's own) and its text, clipped. For
    ``torch.distributed.checkpoint``'s ``CheckpointException`` (whose text is every rank's whole traceback), each
    failed rank's own error."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = [(rank, f[0] if isinstance(f, tuple) else f) for rank, f in sorted(failures.items())]
        text = "; ".join(f"rank {rank}: {_reason(cause)}" for rank, cause in causes if isinstance(cause, BaseException))
        return clip(text, MAX_REASON_CHARS)
    text = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    return clip(text, MAX_REASON_CHARS)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which one and why."""


def step_name(global_step: int) -> str:
    return f"{STEP_PREFIX}{global_step:09d}"


def _sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def _to_cpu(obj: Any, staging: dict[str, Any] | None = None, path: str = "") -> Any:
    """Deep copy of a state tree with every tensor copied to CPU, so later steps cannot change it.

    With ``staging`` (a dict kept between saves) each tensor is copied into the buffer of the same path,
    shape and dtype from the previous save: no fresh allocation and page faults on the step's time.
    """
    import torch

    if isinstance(obj, torch.Tensor) and hasattr(obj, "device_mesh"):  # a DTensor: copy its shard, keep its layout
        from torch.distributed.tensor import DTensor

        local = _to_cpu(obj.to_local(), staging, path)
        return DTensor.from_local(
            local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
        )
    if isinstance(obj, torch.Tensor):
        if staging is None:
            return obj.detach().to("cpu", copy=True)
        buffer = staging.get(path)
        if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
            buffer = staging[path] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=obj.is_cuda)
        buffer.copy_(obj.detach(), non_blocking=obj.is_cuda)
        return buffer
    if isinstance(obj, dict):
        return {k: _to_cpu(v, staging, f"{path}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v, staging, f"{path}/{i}") for i, v in enumerate(obj))
    return obj


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


def detached(state: Any) -> Any:
    """A copy of a state tree with every tensor on CPU, which later steps cannot change."""
    return _to_cpu(state)


def _torch_bytes(obj: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def snapshot(
    *,
    model,
    optimizer=None,
    scheduler=None,
    scaler=None,
    meta: CheckpointMeta,
    torch_rng: dict | None = None,
    replicas: dict[str, dict[str, Any]] | None = None,
    staging: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The state to save, detached from the live objects (tensors copied to CPU, into ``staging`` buffers
    when given: see :meth:`Checkpointer.stage`). ``replicas`` (local SGD) are every rank's own model and optimizer
    state by rank, already on CPU."""
    import torch

    bare = getattr(model, "module", model)
    trainer: dict[str, Any] = {}
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            trainer[name] = obj.state_dict()
    if torch_rng:
        trainer["rng"] = torch_rng
    if replicas:
        trainer["replicas"] = replicas
    state = {
        "model": _to_cpu(bare.state_dict(), staging, "model"),
        "trainer": _to_cpu(trainer, staging, "trainer"),
        "meta": asdict(meta),
    }
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking device-to-host copies must land before the writer reads them
    return state


def encode(state: dict[str, Any]) -> dict[str, bytes]:
    """Files of a checkpoint (without the manifest) from a :func:`snapshot`."""
    return {
        MODEL_FILE: _torch_bytes(state["model"]),
        TRAINER_STATE_FILE: _torch_bytes(state["trainer"]),
        META_FILE: json.dumps(state["meta"], indent=1).encode(),
    }


def manifest_for(
    files: dict[str, bytes],
    *,
    global_step: int,
    metric: float | None,
    shards: dict[str, ManifestEntry] | None = None,
) -> bytes:
    """The manifest of ``files`` (contents in hand); ``shards`` (already written, hashed where they were written)
    makes it a sharded checkpoint's."""
    entries = {name: {"bytes": len(data), "sha256": _sha256(data)} for name, data in files.items()}
    raw = {"global_step": global_step, "metric": metric, "files": entries, "written_at": time.time()}
    if shards is not None:
        raw["files"] |= {name: {"bytes": e.num_bytes, "sha256": e.sha256} for name, e in shards.items()}
        raw["format"] = "sharded"
    return json.dumps(raw, indent=1).encode()


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_MANIFEST_KEYS = ("global_step", "metric", "files", "written_at")
_OPTIONAL_MANIFEST_KEYS = ("format",)


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
        """The manifest in ``data``, checked against its schema before any file it names is read.

        It must be a JSON object of exactly ``global_step`` (an integer >= 0), ``metric`` (a number or null),
        ``written_at`` (a number), optionally ``format`` (``full``, the default, or ``sharded``) and ``files``: an
        object that maps each file of the format to ``{"bytes": integer >= 0, "sha256": 64 hex digits}``. A full
        checkpoint lists exactly :data:`CHECKPOINT_FILES`; a sharded one :data:`SHARDED_FILES`, ``shards/.metadata``
        and one or more ``shards/__<rank>_<n>.distcp``. Every name is a plain name inside the checkpoint's directory
        (or its ``shards`` folder), nothing else. Raises :class:`CheckpointError` naming ``where``, the key, the
        value (bounded in size) and what was expected.
        """
        raw = _parse_json(data, where=where)
        if not isinstance(raw, dict):
            raise CheckpointError(
                f"{where} holds {quote(raw)}: expected a JSON object with {', '.join(_MANIFEST_KEYS)}"
            )
        unknown = [key for key in raw if key not in _MANIFEST_KEYS + _OPTIONAL_MANIFEST_KEYS]
        missing = [key for key in _MANIFEST_KEYS if key not in raw]
        if unknown or missing:
            found = f"unknown key(s) {_listed(unknown)}" if unknown else f"no {', '.join(missing)}"
            raise CheckpointError(f"{where} has {found}: expected exactly the keys {', '.join(_MANIFEST_KEYS)}")
        checks = {
            "global_step": (_is_count, "an integer >= 0"),
            "metric": (lambda v: v is None or _is_number(v), "a number or null"),
            "written_at": (_is_number, "a number (seconds since the epoch)"),
            "files": (_is_mapping, f"an object of {', '.join(CHECKPOINT_FILES)}"),
        }
        for key, (is_valid, expected) in checks.items():
            if not is_valid(raw[key]):
                raise CheckpointError(f"{where} key {key}={quote(raw[key])} is invalid: expected {expected}")
        format = raw.get("format", "full")
        if format not in FORMATS:
            raise CheckpointError(
                f"{where} key format={quote(format)} is invalid: expected one of {', '.join(FORMATS)}"
            )
        for name in raw["files"]:
            _check_file_name(name, where=where, sharded=format == "sharded")
        names = set(raw["files"])
        if format == "full" and names != set(CHECKPOINT_FILES):
            raise CheckpointError(
                f"{where} lists the files {_listed(sorted(raw['files']))}: "
                f"expected exactly {', '.join(CHECKPOINT_FILES)}"
            )
        shard_files = {name for name in names if name.startswith(f"{SHARDS_DIR}/")}
        if format == "sharded" and (
            names - shard_files != set(SHARDED_FILES) or SHARD_METADATA_FILE not in shard_files or len(shard_files) < 2
        ):
            raise CheckpointError(
                f"{where} lists the files {_listed(sorted(raw['files']))}: a sharded checkpoint lists exactly "
                f"{', '.join(SHARDED_FILES)}, {SHARD_METADATA_FILE} and the ranks' {SHARDS_DIR}/__<rank>_0.distcp"
            )
        files = {}
        for name, entry in raw["files"].items():
            if not (
                isinstance(entry, dict)
                and set(entry) == {"bytes", "sha256"}
                and _is_count(entry["bytes"])
                and isinstance(entry["sha256"], str)
                and _SHA256_HEX.fullmatch(entry["sha256"])
            ):
                raise CheckpointError(
                    f"{where} entry of {name}={quote(entry)} is invalid: expected "
                    '{"bytes": an integer >= 0, "sha256": 64 lowercase hex digits}'
                )
            files[name] = ManifestEntry(num_bytes=entry["bytes"], sha256=entry["sha256"])
        return cls(
            global_step=raw["global_step"],
            metric=raw["metric"],
            files=files,
            written_at=raw["written_at"],
            format=format,
        )


def _check_file_name(name: Any, *, where: str, sharded: bool = False) -> None:
    """Refuse a file name read from a manifest unless it is a plain name inside the checkpoint's directory
    (:func:`~training_core.config.is_plain_file_name`), or in a sharded checkpoint one of the names
    ``torch.distributed.checkpoint`` gives its files in ``shards/``. Checked before anything is read."""
    if is_plain_file_name(name) or (sharded and isinstance(name, str) and _SHARD_FILE.fullmatch(name)):
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


def _parse_json(data: bytes, *, where: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's stack
        raise CheckpointError(f"{where} is not valid JSON: {_reason(exc)}") from None


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
        if _is_int(status) and 400 <= status < 500:
            return False
    return True


class CheckpointStorage:
    """Where checkpoint directories live: a local path or an fsspec URI, with bounded retries of transient errors.

    :meth:`uri` is the real location, for I/O; :meth:`display_uri` and :meth:`scrub` are what messages and logs
    show, with any credentials in the root redacted."""

    def __init__(
        self, root: str, *, storage_options: dict[str, Any] | None = None, retries: int = 5, retry_wait_s: float = 1.0
    ) -> None:
        import fsspec

        self.root = root.rstrip("/")
        self.fs, self.path = fsspec.core.url_to_fs(self.root, **(storage_options or {}))
        self.is_local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
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
                retryable = is_retryable(exc)
                if not retryable or attempt == self.retries:
                    kind = "" if retryable else ", not retryable"
                    raise CheckpointError(
                        f"{what} failed after {attempt + 1} attempt(s){kind}: {self.scrub(_reason(exc))}"
                    ) from exc
                log.warning(
                    "%s failed (%s); retrying in %.1fs (%d/%d)",
                    what,
                    self.scrub(_reason(exc)),
                    delay,
                    attempt + 1,
                    self.retries,
                )
                time.sleep(delay)
                delay = min(delay * 2, 30.0)

    def write(self, name: str, files: dict[str, bytes], manifest: bytes) -> None:
        """Write one checkpoint directory so that it becomes visible complete or not at all."""
        final = f"{self.path}/{name}"
        if self.is_local:
            staging = f"{self.path}/.tmp-{name}-{uuid.uuid4().hex[:8]}"
            try:
                os.makedirs(staging, exist_ok=True)
                for file, data in {**files, MANIFEST_FILE: manifest}.items():
                    with open(os.path.join(staging, file), "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                if os.path.exists(final):
                    _remove_local(final)
                os.rename(staging, final)
            except OSError as exc:
                _remove_local(staging)
                raise CheckpointError(
                    f"writing checkpoint {self.display_uri(name)} failed: {self.scrub(_reason(exc))}"
                ) from exc
            return
        for file, data in files.items():
            self._retry(
                f"uploading {self.uri(name)}/{file}", lambda f=file, d=data: self.fs.pipe_file(f"{final}/{f}", d)
            )
        self._retry(
            f"uploading {self.uri(name)}/{MANIFEST_FILE}",
            lambda: self.fs.pipe_file(f"{final}/{MANIFEST_FILE}", manifest),
        )

    def add_files(self, name: str, files: dict[str, bytes], manifest: bytes) -> None:
        """Write ``files`` and then ``manifest`` into checkpoint ``name``, whose directory already holds its shards:
        on a local root each file goes to a temporary name, is synced and renamed into place (the manifest last, so
        it appears complete or not at all); on an object store the manifest is uploaded last."""
        if not self.is_local:
            for file, data in {**files, MANIFEST_FILE: manifest}.items():
                target = f"{self.path}/{name}/{file}"
                self._retry(f"uploading {self.uri(name)}/{file}", lambda t=target, d=data: self.fs.pipe_file(t, d))
            return
        try:
            for file, data in {**files, MANIFEST_FILE: manifest}.items():
                target = f"{self.path}/{name}/{file}"
                temporary = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
                with open(temporary, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(temporary, target)
        except OSError as exc:
            raise CheckpointError(
                f"writing checkpoint {self.display_uri(name)} failed: {self.scrub(_reason(exc))}"
            ) from exc

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
                raise CheckpointError(
                    f"writing {self.display_uri(name)}/{relative} failed: {self.scrub(_reason(exc))}"
                ) from exc
            return
        self._retry(f"uploading {self.uri(name)}/{relative}", lambda: self.fs.put_file(local_path, target))

    def get_file(self, name: str, relative: str, local_path: str) -> None:
        """Download ``relative`` of checkpoint ``name`` to ``local_path``."""
        source = f"{self.path}/{name}/{relative}"
        self._retry(f"reading {self.uri(name)}/{relative}", lambda: self.fs.get_file(source, local_path))

    def local_path(self, name: str) -> str | None:
        """The directory of checkpoint ``name`` on this machine's filesystem, or None on an object store."""
        return f"{self.path}/{name}" if self.is_local else None

    def sizes(self, name: str, folder: str) -> dict[str, int]:
        """Sizes of the files in ``folder`` of checkpoint ``name``, by their name inside the checkpoint."""
        where = f"{self.path}/{name}/{folder}"
        try:
            entries = self._retry(
                f"listing {self.uri(name)}/{folder}", lambda: self.fs.ls(where, detail=True, refresh=True)
            )
        except FileNotFoundError:
            return {}
        return {
            f"{folder}/{e['name'].rstrip('/').rsplit('/', 1)[-1]}": int(e["size"])
            for e in entries
            if e.get("type") != "directory"
        }

    def wait_for(self, name: str, expected_bytes: dict[str, int], *, timeout_s: float) -> None:
        """Wait until each file of ``expected_bytes`` (names inside checkpoint ``name``, all in one folder) is on
        storage at its size; :class:`CheckpointError` naming the missing ones after ``timeout_s``."""
        folder = next(iter(expected_bytes)).split("/", 1)[0]
        deadline, delay = time.monotonic() + timeout_s, 0.05
        while True:
            found = self.sizes(name, folder)
            missing = sorted(f for f, size in expected_bytes.items() if found.get(f) != size)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {self.display_uri(name)} is incomplete: {_listed(missing)} did not arrive within "
                    f"{timeout_s:g} s (the rank that writes it failed or is too slow); the previous checkpoint stays"
                )
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def discard(self, name: str) -> None:
        """Delete checkpoint ``name`` if it exists (an unfinished write of an earlier attempt)."""
        try:
            if self.is_local or self._retry(
                f"checking {self.uri(name)}", lambda: self.fs.exists(f"{self.path}/{name}")
            ):
                self.delete(name)
        except FileNotFoundError:
            pass

    def read(self, name: str, file: str) -> bytes:
        return self._retry(f"reading {self.uri(name)}/{file}", lambda: self.fs.cat_file(f"{self.path}/{name}/{file}"))

    def list_steps(self) -> list[str]:
        """Checkpoint directory names (``step-<digits>``), oldest first by their parsed step; any other name
        (a staging directory, a stray file) is ignored."""
        try:
            entries = self._retry(f"listing {self.root}", lambda: self.fs.ls(self.path, detail=False, refresh=True))
        except FileNotFoundError:
            return []
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        steps = [(int(match.group(1)), name) for name in names if (match := _STEP_NAME.fullmatch(name))]
        return [name for _, name in sorted(steps)]

    def delete(self, name: str) -> None:
        if self.is_local:
            _remove_local(f"{self.path}/{name}")
        else:
            self._retry(f"deleting {self.uri(name)}", lambda: self.fs.rm(f"{self.path}/{name}", recursive=True))


def _remove_local(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


@dataclass
class LoadedCheckpoint:
    name: str
    uri: str
    """Where the checkpoint is, for I/O (with any credentials of its root): log :attr:`display_uri` instead."""
    model: dict[str, Any]
    """The model's state dict (a full checkpoint); empty for a sharded one, whose weights are in :attr:`shards_dir`."""
    trainer: dict[str, Any]
    meta: CheckpointMeta
    shards_dir: str = ""
    """A sharded checkpoint's verified ``torch.distributed.checkpoint`` files, on this machine."""
    owns_shards_dir: bool = False
    """:attr:`shards_dir` is a download of this process's: :meth:`release` removes it."""
    shard_metadata: Any = None
    """A sharded checkpoint's ``shards/.metadata``, parsed and checked (:func:`parse_shard_metadata`,
    :func:`check_shard_metadata`): :func:`restore` loads by it and never reads the file again."""

    @property
    def display_uri(self) -> str:
        """:attr:`uri` as messages show it, credentials redacted."""
        return redact(self.uri)

    def release(self) -> None:
        """Remove this process's download of the shards (once they are loaded)."""
        if self.owns_shards_dir:
            _remove_local(self.shards_dir)
            self.owns_shards_dir = False


_TRAINER_STATE_KEYS = ("optimizer", "scheduler", "scaler", "rng", "replicas")


def verify_and_load(
    storage: CheckpointStorage, name: str, *, expected_shapes: dict[str, tuple[int, ...]] | None = None
) -> LoadedCheckpoint:
    """Read one checkpoint, check every file against its manifest, and decode it safely.

    Raises :class:`CheckpointError` naming the checkpoint and the reason for anything that keeps it from loading:
    a missing or malformed manifest (see :meth:`CheckpointManifest.parse`), a missing, truncated or corrupt file,
    a tensor file that ``torch.load(weights_only=True)`` refuses or that does not hold a state dict (model) or the
    trainer's state dicts, and metadata that :meth:`CheckpointMeta.from_dict` refuses. A sharded checkpoint's
    ``shards/.metadata`` is parsed here, safely, and must name only shards the manifest lists
    (:func:`check_shard_metadata`); with ``expected_shapes`` (:func:`model_state_shapes` of the model it will be
    restored into) its weights must have those names and shapes. A full checkpoint's weights are not checked
    against ``expected_shapes``."""
    where = storage.display_uri(name)
    try:
        manifest_bytes = storage.read(name, MANIFEST_FILE)
    except (CheckpointError, FileNotFoundError) as exc:
        raise CheckpointError(
            f"{where} has no readable {MANIFEST_FILE} (incomplete write?): {storage.scrub(_reason(exc))}"
        ) from None
    manifest = CheckpointManifest.parse(manifest_bytes, where=f"{where}/{MANIFEST_FILE}")
    payloads = {}
    for file, entry in manifest.files.items():
        if file in manifest.shards:
            continue
        try:
            data = storage.read(name, file)
        except (CheckpointError, FileNotFoundError) as exc:
            raise CheckpointError(f"{where}/{file} is missing: {storage.scrub(_reason(exc))}") from None
        _check_entry(ManifestEntry(num_bytes=len(data), sha256=_sha256(data)), entry, where=f"{where}/{file}")
        payloads[file] = data
    if manifest.format == "full":
        return _decoded(storage, name, manifest, payloads)
    shards_dir, owns_shards_dir, metadata_bytes = _verified_shards(storage, name, manifest)
    try:
        metadata_where = f"{where}/{SHARD_METADATA_FILE}"
        shard_metadata = parse_shard_metadata(metadata_bytes, where=metadata_where)
        check_shard_metadata(shard_metadata, manifest, where=metadata_where, expected_shapes=expected_shapes)
        loaded = _decoded(storage, name, manifest, payloads)
    except BaseException:
        if owns_shards_dir:
            _remove_local(shards_dir)
        raise
    loaded.shards_dir, loaded.owns_shards_dir, loaded.shard_metadata = shards_dir, owns_shards_dir, shard_metadata
    return loaded


def _decoded(
    storage: CheckpointStorage, name: str, manifest: CheckpointManifest, payloads: dict[str, bytes]
) -> LoadedCheckpoint:
    """The checkpoint of the verified ``payloads`` (its files besides the shards), decoded safely."""
    import torch

    where = storage.display_uri(name)
    tensors = {MODEL_FILE: {}}
    for file in (MODEL_FILE, TRAINER_STATE_FILE) if manifest.format == "full" else (TRAINER_STATE_FILE,):
        try:
            tensors[file] = torch.load(io.BytesIO(payloads[file]), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ... for bad bytes
            raise CheckpointError(
                f"{where}/{file} cannot be loaded with torch.load(weights_only=True): {_reason(exc)}"
            ) from None
    model, trainer = tensors[MODEL_FILE], tensors[TRAINER_STATE_FILE]
    if not (isinstance(model, dict) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in model.items())):
        raise CheckpointError(f"{where}/{MODEL_FILE} holds {quote(model)}: expected a model's state dict of tensors")
    if not (
        isinstance(trainer, dict)
        and set(trainer) <= set(_TRAINER_STATE_KEYS)
        and all(isinstance(v, dict) for v in trainer.values())
    ):
        raise CheckpointError(
            f"{where}/{TRAINER_STATE_FILE} holds {quote(trainer)}: expected a mapping of state dicts named "
            f"{', '.join(_TRAINER_STATE_KEYS)}"
        )
    meta = _decode_meta(payloads[META_FILE], where=f"{where}/{META_FILE}")
    return LoadedCheckpoint(name=name, uri=storage.uri(name), model=model, trainer=trainer, meta=meta)


def _check_entry(found: ManifestEntry, expected: ManifestEntry, *, where: str) -> None:
    if found.num_bytes != expected.num_bytes:
        raise CheckpointError(f"{where} is truncated: {found.num_bytes} bytes, manifest says {expected.num_bytes}")
    if found.sha256 != expected.sha256:
        raise CheckpointError(f"{where} is corrupt: sha256 differs from the manifest")


def _verified_shards(storage: CheckpointStorage, name: str, manifest: CheckpointManifest) -> tuple[str, bool, bytes]:
    """A local directory of the checkpoint's shards, each checked against the manifest: the checkpoint's own on a
    local root, else a download to ``TMPDIR`` (removed again when a file fails). Returns it, whether it is a
    download, and the bytes of its ``.metadata``: read once, at most the manifest's size of them, and checked, so
    what is parsed is what was hashed."""
    import tempfile

    where = storage.display_uri(name)
    local = storage.local_path(name)
    directory = f"{local}/{SHARDS_DIR}" if local else tempfile.mkdtemp(prefix=f"ckpt-{name}-")
    metadata = b""
    try:
        for relative, entry in manifest.shards.items():
            path = os.path.join(directory, relative.split("/", 1)[1])
            if not local:
                storage.get_file(name, relative, path)
            try:
                if relative == SHARD_METADATA_FILE:
                    with open_regular_local(path, f"{where}/{relative}") as f:
                        metadata = f.read(entry.num_bytes + 1)  # one byte more tells a longer file
                    found = ManifestEntry(num_bytes=len(metadata), sha256=_sha256(metadata))
                else:
                    found = file_entry(path, max_bytes=entry.num_bytes)
            except (OSError, UnreadableFile) as exc:
                raise CheckpointError(f"{where}/{relative} is missing: {storage.scrub(_reason(exc))}") from None
            _check_entry(found, entry, where=f"{where}/{relative}")
    except BaseException as exc:
        if not local:
            _remove_local(directory)
        if isinstance(exc, FileNotFoundError):
            raise CheckpointError(f"{where} has a missing shard: {storage.scrub(_reason(exc))}") from None
        raise
    return directory, not local, metadata


def _decode_meta(data: bytes, *, where: str) -> CheckpointMeta:
    raw = _parse_json(data, where=where)
    try:
        return CheckpointMeta.from_dict(raw, where=where)
    except (ValueError, TypeError, ArithmeticError) as exc:  # the records' own checks, past the schema
        raise CheckpointError(clip(str(exc), 2 * MAX_REASON_CHARS)) from None


def load_directory(uri: str, *, expected_shapes: dict[str, tuple[int, ...]] | None = None) -> LoadedCheckpoint:
    """Verify and load the one checkpoint at ``uri`` (a ``step-...`` directory, local or ``s3://``); see
    :func:`verify_and_load` for ``expected_shapes``."""
    parent, name = uri.rstrip("/").rsplit("/", 1)
    return verify_and_load(CheckpointStorage(parent), name, expected_shapes=expected_shapes)


def load_latest_valid(
    storage: CheckpointStorage, *, expected_shapes: dict[str, tuple[int, ...]] | None = None
) -> LoadedCheckpoint | None:
    """The newest checkpoint that verifies and loads; each newer one that does not, for whatever reason, is skipped
    with a warning naming it and the reason. ``None`` when there is none. With ``expected_shapes``
    (:func:`model_state_shapes` of the model to restore), a sharded checkpoint whose weights do not fit it is one
    that does not load."""
    rejected: list[str] = []
    for name in reversed(storage.list_steps()):
        try:
            loaded = verify_and_load(storage, name, expected_shapes=expected_shapes)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", storage.display_uri(name), storage.scrub(str(exc)))
            rejected.append(name)
            continue
        except Exception as exc:  # noqa: BLE001 - the last line of defence: a resume must reach an older checkpoint
            log.warning(
                "skipping checkpoint %s: it could not be loaded: %s",
                storage.display_uri(name),
                storage.scrub(_reason(exc)),
            )
            rejected.append(name)
            continue
        if rejected:
            log.warning(
                "resuming from %s instead of the newer %s, which failed verification",
                storage.display_uri(name),
                ", ".join(rejected),
            )
        return loaded
    return None


class SaveObserver(Protocol):
    """Told the real outcome of each write (from the writer thread when saves are asynchronous)."""

    def checkpoint_saved(self, *, duration_s: float, bytes_written: int) -> None: ...

    def checkpoint_failed(self) -> None: ...


class Checkpointer:
    """Asynchronous, verified checkpoints with retention (keep the last ``keep_last`` and, when a metric
    ranks them, the best one)."""

    def __init__(
        self,
        storage: CheckpointStorage,
        *,
        keep_last: int,
        interval_steps: int = 0,
        at_epoch_end: bool = True,
        keep_best: bool = False,
        best_mode: str = "max",
        async_save: bool = True,
        max_consecutive_failures: int = 1,
        observer: SaveObserver | None = None,
        shard_wait_s: float = 600.0,
    ) -> None:
        assert keep_last >= 1 and max_consecutive_failures >= 1, "validated by CheckpointConfig"
        self.shard_wait_s = shard_wait_s
        """How long rank 0 waits for the other ranks' shards of a sharded checkpoint to be on storage."""
        self.storage = storage
        self.interval_steps = interval_steps
        self.at_epoch_end = at_epoch_end
        self.max_consecutive_failures = max_consecutive_failures
        self.consecutive_failures = 0
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.best_mode = best_mode
        self.async_save = async_save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: dict[str, Any] = {}
        self.num_saved = 0
        self.num_failed = 0
        self.bytes_written = 0
        self.last_save_s = 0.0
        self.observer = observer
        self._last_stage_s = 0.0

    def should_save(self, global_step: int, *, epoch_end: bool) -> bool:
        """The save policy: every ``interval_steps`` optimizer steps, and at epoch ends when ``at_epoch_end``.
        A step that is both an interval step and an epoch's last is saved once, at the epoch end (after
        validation, so the checkpoint carries the epoch's metric). The final checkpoint is always saved."""
        on_interval = bool(self.interval_steps) and global_step % self.interval_steps == 0
        return (self.at_epoch_end or on_interval) if epoch_end else on_interval

    def stage(self, **snapshot_args: Any) -> dict[str, Any]:
        """:func:`snapshot` into buffers reused from save to save. It first lets the write in flight finish
        (it reads those buffers), so with saves spaced wider than a write it costs a memory copy only."""
        self._settle()
        start = time.perf_counter()
        state = snapshot(**snapshot_args, staging=self._staging if self.async_save else None)
        self._last_stage_s = time.perf_counter() - start
        return state

    def save(self, global_step: int, state: dict[str, Any], *, metric: float | None = None) -> float:
        """Queue ``state`` (from :func:`snapshot`) for writing; returns the seconds the caller was blocked.

        A failed save is logged as an error and counted (``num_failed``); training goes on with the last
        good checkpoint in place. Once ``max_consecutive_failures`` saves in a row have failed, this raises
        :class:`CheckpointError`.
        """
        name = step_name(global_step)

        def write() -> int:
            files = encode(state)
            manifest = manifest_for(files, global_step=global_step, metric=metric)
            self.storage.write(name, files, manifest)
            return sum(len(d) for d in files.values()) + len(manifest)

        return self._submit(global_step, write, prune=True)

    def save_sharded(
        self,
        global_step: int,
        *,
        model: Any,
        optimizer: Any,
        trainer_state: dict[str, Any] | None,
        meta: CheckpointMeta | None,
        metric: float | None = None,
        process_group: Any = None,
    ) -> float:
        """Save a sharded checkpoint (``scaling.strategy=fsdp``): every rank calls it at the same step. Returns the
        seconds the caller was blocked.

        What the step waits for: a copy of this rank's shards of the model and optimizer state in host memory
        (buffers reused from save to save). The rest runs in the background when ``async_save``: rank 0 removes what
        an earlier attempt left of this step, every rank writes its shard to local disk through
        ``torch.distributed.checkpoint`` (rank 0 adds ``.metadata``), hashes it, the hashes are gathered, and each
        rank moves (local root) or uploads its files into the checkpoint's ``shards/``; rank 0 waits until every
        shard is on storage at its size, then writes ``trainer_state.pt`` (scheduler, scaler, RNG), ``meta.json``
        and, last, the manifest with every file's sha256, and prunes. The background collectives run on
        ``process_group``: give it a group of its own (gloo) so they never meet training's collectives; None is the
        default group, for callers that wait for the save before any other collective.
        ``trainer_state`` and ``meta`` are rank 0's (tensors already on CPU); other ranks pass None. Failures count
        as in :meth:`save`; a rank whose write failed raises at its next save or :meth:`wait`, and rank 0's save
        fails when a shard does not arrive within ``shard_wait_s``."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._settle()
        started = time.perf_counter()
        rank, world_size, name = dist.get_rank(), dist.get_world_size(), step_name(global_step)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = _to_cpu(
            {"model": model_state, "optimizer": optim_state}, self._staging if self.async_save else None, "sharded"
        )
        self._last_stage_s = time.perf_counter() - started

        def write() -> int:
            import torch.distributed.checkpoint as dcp

            if rank == 0:
                self.storage.discard(name)  # an earlier attempt's unfinished write of this step (it has no manifest)
            staging = self.storage.staging_dir(name)
            try:
                # A collective: every rank returns only once rank 0 has discarded the leftovers above.
                dcp.save(state, storage_writer=dcp.FileSystemWriter(staging), process_group=process_group)
                own = {f"{SHARDS_DIR}/{f}": file_entry(os.path.join(staging, f)) for f in sorted(os.listdir(staging))}
                gathered: list[Any] = [None] * world_size
                dist.all_gather_object(gathered, own, group=process_group)
                for relative in own:
                    self.storage.put_file(name, relative, os.path.join(staging, relative.split("/", 1)[1]))
            finally:
                _remove_local(staging)
            written = sum(e.num_bytes for e in own.values())
            if rank != 0:
                return written
            assert trainer_state is not None and meta is not None, "rank 0 passes the trainer state and meta"
            shards = {relative: entry for per_rank in gathered for relative, entry in per_rank.items()}
            self.storage.wait_for(name, {k: e.num_bytes for k, e in shards.items()}, timeout_s=self.shard_wait_s)
            files = {
                TRAINER_STATE_FILE: _torch_bytes(trainer_state),
                META_FILE: json.dumps(asdict(meta), indent=1).encode(),
            }
            manifest = manifest_for(files, global_step=global_step, metric=metric, shards=shards)
            self.storage.add_files(name, files, manifest)
            return written + sum(len(d) for d in files.values()) + len(manifest)

        return self._last_stage_s + self._submit(global_step, write, prune=rank == 0)

    def _submit(self, global_step: int, write: Callable[[], int], *, prune: bool) -> float:
        start = time.perf_counter()
        self._settle()
        if self.async_save:
            self._thread = threading.Thread(
                target=self._write_guarded, args=(global_step, write, prune), name="checkpoint-writer", daemon=True
            )
            self._thread.start()
        else:
            self._write(global_step, write, prune)
        return time.perf_counter() - start

    def wait(self) -> None:
        """Block until the save in flight is done; raise its error, if any. For the final checkpoint."""
        self._join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _settle(self) -> None:
        """Finish the save in flight; tolerate its failure until too many failed in a row."""
        self._join()
        if self._error is None:
            return
        error, self._error = self._error, None
        if self.consecutive_failures >= self.max_consecutive_failures:
            raise CheckpointError(
                f"{self.consecutive_failures} checkpoint saves in a row failed; last: {error}"
            ) from error

    def _write_guarded(self, global_step: int, write: Callable[[], int], prune: bool) -> None:
        try:
            self._write(global_step, write, prune)
        except BaseException as exc:  # reported by the next save() or wait() on the training thread
            log.error("checkpoint save of step %d failed: %s", global_step, _reason(exc))
            self._error = (
                exc
                if isinstance(exc, CheckpointError)
                else CheckpointError(f"checkpoint save of step {global_step} failed: {_reason(exc)}")
            )

    def _write(self, global_step: int, write: Callable[[], int], prune: bool) -> None:
        """Run ``write`` (it returns the bytes it wrote), count its outcome, and prune after a success."""
        start = time.perf_counter()
        name = step_name(global_step)
        try:
            num_bytes = write()
        except BaseException:
            self.num_failed += 1
            self.consecutive_failures += 1
            if self.observer is not None:
                self.observer.checkpoint_failed()
            raise
        self.num_saved += 1
        self.consecutive_failures = 0
        self.bytes_written += num_bytes
        self.last_save_s = time.perf_counter() - start
        if self.observer is not None:
            self.observer.checkpoint_saved(duration_s=self._last_stage_s + self.last_save_s, bytes_written=num_bytes)
        log.info("checkpoint %s written in %.2fs", self.storage.display_uri(name), self.last_save_s)
        if prune:
            self._prune(keep=name)

    def _prune(self, *, keep: str) -> None:
        names = self.storage.list_steps()
        retained = set(names[-self.keep_last :]) | {keep}
        if self.keep_best:
            best = self._best(names)
            if best:
                retained.add(best)
        for name in names:
            if name not in retained:
                self.storage.delete(name)

    def _best(self, names: list[str]) -> str | None:
        scored = []
        for name in names:
            try:
                where = f"{self.storage.display_uri(name)}/{MANIFEST_FILE}"
                metric = CheckpointManifest.parse(self.storage.read(name, MANIFEST_FILE), where=where).metric
            except (CheckpointError, FileNotFoundError):
                continue  # not a candidate; load_latest_valid reports it when it matters
            if metric is not None:
                scored.append((metric if self.best_mode == "max" else -metric, name))
        return max(scored)[1] if scored else None


def load_meta(directory: str) -> CheckpointMeta:
    """The metadata of the checkpoint at ``directory`` (local or ``s3://``), without loading its tensors (nor
    verifying it against the manifest). Raises :class:`CheckpointError` when it is not valid metadata."""
    parent, name = directory.rstrip("/").rsplit("/", 1)
    storage = CheckpointStorage(parent)
    return _decode_meta(storage.read(name, META_FILE), where=f"{storage.display_uri(name)}/{META_FILE}")


def load_model(directory: str, *, map_location: str = "cpu"):
    """Rebuild the model a checkpoint directory describes with its workload (user code is imported again), verify
    and load its weights. Returns ``(model, meta, workload)``."""
    loaded = load_directory(os.path.abspath(directory))
    model, workload = build_saved_model(loaded.meta)
    restore(loaded, model=model)
    return model.to(map_location), loaded.meta, workload


def build_saved_model(meta: CheckpointMeta):
    """The model a checkpoint's metadata describes, freshly initialised, and its workload (user code is imported
    again): ``(model, workload)``. Load its weights with :func:`restore`."""
    from training_core.config import TrainingConfig
    from training_core.data import Manifest
    from training_core.workloads import resolve_workload

    # The saved config is a (redacted) record: only the sections that shape the model (and that a workload's
    # config checks read) are read back, so a checkpoint written by an older version, with fields since renamed
    # elsewhere, still loads.
    # One worker: the run's layout does not shape the model, and the default one (2 workers) would refuse the data
    # section of a run trained on fewer shards (data.num_shards >= scaling.num_workers).
    sections = {k: meta.config[k] for k in ("workload", "data", "model") if k in meta.config}
    config = TrainingConfig.from_dict({**sections, "scaling": {"num_workers": 1}})
    if meta.data:
        manifest = Manifest.from_description(meta.data)
    else:
        manifest = Manifest(
            dataset="", classes=meta.classes, input_shape=meta.input_shape, mean=meta.mean, std=meta.std, splits={}
        )
    workload = resolve_workload(config.workload)
    return workload.build_model(config, manifest), workload


def restore(loaded: LoadedCheckpoint, *, model, optimizer=None, scheduler=None, scaler=None) -> None:
    """Load every stateful object in place from a verified checkpoint, whatever wrote it and however ``model`` is
    held now: a sharded checkpoint into an FSDP model on any number of ranks (resharded), into a DDP model or into
    one process; a full checkpoint into a DDP model or, each rank reading the whole of it, into an FSDP model. Under
    a process group every rank calls it (the sharded load is a collective)."""
    from training_core.sharding import is_sharded

    try:
        if loaded.shards_dir:
            _load_shards(loaded.shards_dir, loaded.shard_metadata, model=model, optimizer=optimizer)
        elif is_sharded(model):
            _load_full_into_sharded(loaded, model=model, optimizer=optimizer)
        else:
            getattr(model, "module", model).load_state_dict(loaded.model)
            if optimizer is not None and "optimizer" in loaded.trainer:
                optimizer.load_state_dict(loaded.trainer["optimizer"])
    finally:
        loaded.release()
    for name, obj in (("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None and name in loaded.trainer:
            obj.load_state_dict(loaded.trainer[name])


def _load_shards(directory: str, metadata: Any, *, model, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, storage_reader=_safe_reader(directory, metadata), planner=_weights_only_planner())
        set_model_state_dict(model, state["model"])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, storage_reader=_safe_reader(directory, metadata), planner=_weights_only_planner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _load_full_into_sharded(loaded: LoadedCheckpoint, *, model, optimizer) -> None:
    """A full checkpoint (written under DDP) into an FSDP model: each rank keeps its shard of the whole. The
    optimizer's state, numbered in parameter order, is keyed by the parameters' names first (the order of
    ``named_parameters``, in which the optimizer was built)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, loaded.model, options=options)
    saved = loaded.trainer.get("optimizer")
    if optimizer is None or saved is None:
        return
    names = [name for name, _ in model.named_parameters()]
    by_name = {
        "state": {names[index]: value for index, value in saved["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in saved["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=options)


def model_state_shapes(model) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor :func:`restore` loads into ``model`` from a sharded checkpoint (its
    ``torch.distributed.checkpoint`` state dict: names without a DDP or ``torch.compile`` prefix, global shapes
    under FSDP): what ``expected_shapes`` of :func:`load_latest_valid` checks a checkpoint against."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {name: tuple(value.shape) for name, value in get_model_state_dict(model).items() if torch.is_tensor(value)}


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
    :data:`_METADATA_GLOBALS` (nothing that runs code), and it must hold the records torch's reader uses, each of
    its own type: every entry stored (the tensor's chunks inside its size), and stored in a plain file name of the
    same folder, untransformed (:func:`_check_storage_info`). Which files those are is checked against the
    manifest by :func:`check_shard_metadata`. Raises :class:`CheckpointError` naming ``where``."""
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
        raise CheckpointError(f"{where} cannot be read safely: {_reason(exc)}") from None
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
    (this module writes none; a transform would decompress)."""
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
    if not (_is_count(offset) and _is_count(length)):
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
            isinstance(value, torch.Size) and (rank is None or len(value) == rank) and all(_is_count(n) for n in value)
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
            f"{where} does not fit the model (another architecture?): its weights {_listed(mismatched, limit=5)}"
        )


def _safe_reader(directory: str, metadata: Any):
    """A ``FileSystemReader`` of ``directory`` that loads by ``metadata`` (its ``.metadata``, already parsed and
    checked by :func:`verify_and_load`) instead of reading the file again: torch's own reader runs ``pickle.load``
    on it, and a file read twice could have changed in between."""
    import copy

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    assert metadata is not None, "a sharded checkpoint's metadata is parsed and checked by verify_and_load"

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            loaded = copy.copy(metadata)
            loaded.storage_meta = copy.copy(getattr(metadata, "storage_meta", None)) or StorageMeta()
            loaded.storage_meta.load_id = self.load_id
            return loaded

    return SafeReader(directory)


def _weights_only_planner():
    """A ``DefaultLoadPlanner`` that decodes the non-tensor entries (optimizer hyper-parameters) with
    ``torch.load(weights_only=True)``; torch's own unpickles them with ``weights_only=False``."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            plain = torch.load(value, map_location="cpu", weights_only=True)
            super().load_bytes(read_item, io.BytesIO(_torch_bytes(plain)))

    return WeightsOnlyLoadPlanner()
