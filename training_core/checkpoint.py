"""Training checkpoints: a dict of stateful objects, saved and loaded by this one module.

A checkpoint is one directory ``step-<global step, 9 digits>`` under a root (a local path or any fsspec URI
such as ``s3://bucket/prefix``):

- ``model.pt``: the bare model's ``state_dict`` (no DDP ``module.`` prefix);
- ``trainer_state.pt``: optimizer, LR scheduler and GradScaler state, and the torch/CUDA RNG states;
- ``meta.json``: position (epoch, step in epoch, global step), best metric, python/numpy RNG states,
  metrics history, the resolved config, and what is needed to rebuild the model (name, classes, shape);
- ``manifest.json``: size and sha256 of each file above. It is written last, so a directory without a
  valid manifest is an incomplete checkpoint.

Local roots are written to a temporary directory and renamed into place (atomic). Object stores get the
files first and the manifest last. Every file is verified against the manifest before loading, and tensor
files are read with ``torch.load(weights_only=True)``, which never executes pickled code.

:class:`Checkpointer` saves asynchronously: ``save`` copies tensors to CPU memory (the only part the
training step waits for) and a background thread serialises, writes and prunes. At most one save is in
flight; the next ``save`` waits for it instead of piling up.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

from training_core.records import EpochRecord, StepLog, StepRecord

log = logging.getLogger("training_core")

MODEL_FILE = "model.pt"
TRAINER_STATE_FILE = "trainer_state.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
STEP_PREFIX = "step-"
STEP_LOG_CAPACITY = 64
"""Step windows a checkpoint's ``meta.json`` keeps (about 25 KB); MLflow has every window."""


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
    """Per resume: ``from_step``, ``restored_unix`` (state loaded) and ``first_step_unix`` (first step done)."""
    epoch_partial: dict[str, float] = field(default_factory=dict)
    """Loss, correct and sample sums of ``epoch`` so far, so a resumed epoch reports the same record."""
    mlflow_model_uri: str = ""
    mlflow_run_id: str = ""
    elapsed_s: float = 0.0
    """Seconds the run has trained so far, across resumes (the clock of ``step_log``'s ``elapsed_s``)."""
    telemetry: dict[str, Any] = field(default_factory=dict)
    """Rank 0's telemetry for the Deck: ``samples`` (a bounded timeline of ``elapsed_s``, ``cpu_utilization``
    and ``gpu_utilization`` per GPU as ratios 0-1, ``memory_used_bytes`` and ``gpu_memory_used_bytes`` per GPU)
    and ``cost`` (``gpu_hours``, ``cpu_hours``, ``cost_usd`` and the prices). Empty with observability off."""

    def __post_init__(self) -> None:
        # From JSON the records arrive as mappings; a checkpoint written before the step log was bounded holds
        # every window, merged down here to the bound.
        self.history = [r if isinstance(r, EpochRecord) else EpochRecord.from_dict(r) for r in self.history]
        self.step_log = StepLog.from_list(self.step_log, capacity=STEP_LOG_CAPACITY).records


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
    staging: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The state to save, detached from the live objects (tensors copied to CPU, into ``staging`` buffers
    when given: see :meth:`Checkpointer.stage`)."""
    import torch

    bare = getattr(model, "module", model)
    trainer: dict[str, Any] = {}
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            trainer[name] = obj.state_dict()
    if torch_rng:
        trainer["rng"] = torch_rng
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


def manifest_for(files: dict[str, bytes], *, global_step: int, metric: float | None) -> bytes:
    entries = {name: {"bytes": len(data), "sha256": _sha256(data)} for name, data in files.items()}
    return json.dumps(
        {"global_step": global_step, "metric": metric, "files": entries, "written_at": time.time()}, indent=1
    ).encode()


class CheckpointStorage:
    """Where checkpoint directories live: a local path or an fsspec URI, with bounded retries."""

    def __init__(
        self, root: str, *, storage_options: dict[str, Any] | None = None, retries: int = 5, retry_wait_s: float = 1.0
    ) -> None:
        import fsspec

        self.root = root.rstrip("/")
        self.fs, self.path = fsspec.core.url_to_fs(self.root, **(storage_options or {}))
        self.is_local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self.retries = retries
        self.retry_wait_s = retry_wait_s

    def uri(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        delay = self.retry_wait_s
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise  # an answer, not a hiccup: the caller decides what a missing path means
            except Exception as exc:  # noqa: BLE001 - botocore's connection errors are not OSErrors
                # A full disk will not empty itself by waiting: fail at once so the caller reports it.
                if getattr(exc, "errno", None) == 28 or attempt == self.retries:
                    raise CheckpointError(f"{what} failed after {attempt + 1} attempt(s): {exc}") from exc
                log.warning("%s failed (%s); retrying in %.1fs (%d/%d)", what, exc, delay, attempt + 1, self.retries)
                time.sleep(delay)
                delay = min(delay * 2, 30.0)

    def write(self, name: str, files: dict[str, bytes], manifest: bytes) -> None:
        """Write one checkpoint directory so that it becomes visible complete or not at all."""
        final = f"{self.path}/{name}"
        if self.is_local:
            staging = f"{self.path}/.tmp-{name}-{uuid.uuid4().hex[:8]}"
            os.makedirs(staging, exist_ok=True)
            try:
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
                raise CheckpointError(f"writing checkpoint {self.uri(name)} failed: {exc}") from exc
            return
        for file, data in files.items():
            self._retry(
                f"uploading {self.uri(name)}/{file}", lambda f=file, d=data: self.fs.pipe_file(f"{final}/{f}", d)
            )
        self._retry(
            f"uploading {self.uri(name)}/{MANIFEST_FILE}",
            lambda: self.fs.pipe_file(f"{final}/{MANIFEST_FILE}", manifest),
        )

    def read(self, name: str, file: str) -> bytes:
        return self._retry(f"reading {self.uri(name)}/{file}", lambda: self.fs.cat_file(f"{self.path}/{name}/{file}"))

    def list_steps(self) -> list[str]:
        """Checkpoint directory names, oldest first (staging directories excluded)."""
        try:
            entries = self._retry(f"listing {self.root}", lambda: self.fs.ls(self.path, detail=False, refresh=True))
        except FileNotFoundError:
            return []
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        return sorted(n for n in names if n.startswith(STEP_PREFIX) and n[len(STEP_PREFIX) :].isdigit())

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
    model: dict[str, Any]
    trainer: dict[str, Any]
    meta: CheckpointMeta


def verify_and_load(storage: CheckpointStorage, name: str) -> LoadedCheckpoint:
    """Read one checkpoint, check every file against its manifest, and decode it safely."""
    import torch

    try:
        manifest = json.loads(storage.read(name, MANIFEST_FILE))
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        raise CheckpointError(
            f"{storage.uri(name)} has no readable {MANIFEST_FILE} (incomplete write?): {exc}"
        ) from None
    payloads = {}
    for file, entry in manifest["files"].items():
        try:
            data = storage.read(name, file)
        except (CheckpointError, FileNotFoundError) as exc:
            raise CheckpointError(f"{storage.uri(name)}/{file} is missing: {exc}") from None
        if len(data) != entry["bytes"]:
            raise CheckpointError(
                f"{storage.uri(name)}/{file} is truncated: {len(data)} bytes, manifest says {entry['bytes']}"
            )
        if _sha256(data) != entry["sha256"]:
            raise CheckpointError(f"{storage.uri(name)}/{file} is corrupt: sha256 differs from the manifest")
        payloads[file] = data
    model = torch.load(io.BytesIO(payloads[MODEL_FILE]), map_location="cpu", weights_only=True)
    trainer = torch.load(io.BytesIO(payloads[TRAINER_STATE_FILE]), map_location="cpu", weights_only=True)
    meta = CheckpointMeta(**json.loads(payloads[META_FILE]))
    return LoadedCheckpoint(name=name, uri=storage.uri(name), model=model, trainer=trainer, meta=meta)


def load_directory(uri: str) -> LoadedCheckpoint:
    """Verify and load the one checkpoint at ``uri`` (a ``step-...`` directory, local or ``s3://``)."""
    parent, name = uri.rstrip("/").rsplit("/", 1)
    return verify_and_load(CheckpointStorage(parent), name)


def load_latest_valid(storage: CheckpointStorage) -> LoadedCheckpoint | None:
    """The newest checkpoint that verifies; each newer one that does not is skipped with a warning."""
    rejected: list[str] = []
    for name in reversed(storage.list_steps()):
        try:
            loaded = verify_and_load(storage, name)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", storage.uri(name), exc)
            rejected.append(name)
            continue
        if rejected:
            log.warning(
                "resuming from %s instead of the newer %s, which failed verification", loaded.uri, ", ".join(rejected)
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
    ) -> None:
        assert keep_last >= 1 and max_consecutive_failures >= 1, "validated by CheckpointConfig"
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
        start = time.perf_counter()
        self._settle()
        if self.async_save:
            self._thread = threading.Thread(
                target=self._write_guarded, args=(global_step, state, metric), name="checkpoint-writer", daemon=True
            )
            self._thread.start()
        else:
            self._write(global_step, state, metric)
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

    def _write_guarded(self, global_step: int, state: dict[str, Any], metric: float | None) -> None:
        try:
            self._write(global_step, state, metric)
        except BaseException as exc:  # reported by the next save() or wait() on the training thread
            log.error("checkpoint save of step %d failed: %s", global_step, exc)
            self._error = (
                exc
                if isinstance(exc, CheckpointError)
                else CheckpointError(f"checkpoint save of step {global_step} failed: {exc}")
            )

    def _write(self, global_step: int, state: dict[str, Any], metric: float | None) -> None:
        start = time.perf_counter()
        name = step_name(global_step)
        try:
            files = encode(state)
            manifest = manifest_for(files, global_step=global_step, metric=metric)
            self.storage.write(name, files, manifest)
        except BaseException:
            self.num_failed += 1
            self.consecutive_failures += 1
            if self.observer is not None:
                self.observer.checkpoint_failed()
            raise
        self.num_saved += 1
        self.consecutive_failures = 0
        num_bytes = sum(len(d) for d in files.values()) + len(manifest)
        self.bytes_written += num_bytes
        self.last_save_s = time.perf_counter() - start
        if self.observer is not None:
            self.observer.checkpoint_saved(duration_s=self._last_stage_s + self.last_save_s, bytes_written=num_bytes)
        log.info("checkpoint %s written in %.2fs", self.storage.uri(name), self.last_save_s)
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
                metric = json.loads(self.storage.read(name, MANIFEST_FILE)).get("metric")
            except (CheckpointError, FileNotFoundError, ValueError):
                continue
            if metric is not None:
                scored.append((metric if self.best_mode == "max" else -metric, name))
        return max(scored)[1] if scored else None


def load_meta(directory: str) -> CheckpointMeta:
    """The metadata of the checkpoint at ``directory`` (local or ``s3://``), without loading its tensors."""
    parent, name = directory.rstrip("/").rsplit("/", 1)
    return CheckpointMeta(**json.loads(CheckpointStorage(parent).read(name, META_FILE)))


def load_model(directory: str, *, map_location: str = "cpu"):
    """Rebuild the model a checkpoint directory describes, verify and load its weights. Returns ``(model, meta)``."""
    from training_core.models import build_model

    loaded = load_directory(os.path.abspath(directory))
    meta = loaded.meta
    model = build_model(meta.model_name, num_classes=len(meta.classes), input_shape=meta.input_shape)
    model.load_state_dict(loaded.model)
    return model.to(map_location), meta


def restore(loaded: LoadedCheckpoint, *, model, optimizer=None, scheduler=None, scaler=None) -> None:
    """Load every stateful object in place from a verified checkpoint."""
    bare = getattr(model, "module", model)
    bare.load_state_dict(loaded.model)
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None and name in loaded.trainer:
            obj.load_state_dict(loaded.trainer[name])
