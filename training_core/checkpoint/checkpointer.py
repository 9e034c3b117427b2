"""Writing checkpoints: the save policy, asynchronous and sharded writes, failure counting and retention."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import KW_ONLY, asdict, dataclass, field
from typing import Any, Callable, Protocol

from training_core.checkpoint.layout import (
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    SHARDS_DIR,
    CheckpointError,
    reason,
    step_name,
)
from training_core.checkpoint.manifest import CheckpointManifest, file_entry, manifest_for
from training_core.checkpoint.meta import CheckpointMeta
from training_core.checkpoint.partial import state_dict_options
from training_core.checkpoint.snapshot import detached, encode, snapshot
from training_core.checkpoint.storage import Storage, remove_local

log = logging.getLogger("training_core")


class SaveObserver(Protocol):
    """Told the real outcome of each write (from the writer thread when saves are asynchronous)."""

    def checkpoint_saved(self, *, duration_s: float, bytes_written: int) -> None: ...

    def checkpoint_failed(self) -> None: ...


@dataclass(eq=False)
class Checkpointer:
    """Asynchronous, verified checkpoints with retention (keep the last ``keep_last`` and, when a metric
    ranks them, the best one)."""

    storage: Storage
    _: KW_ONLY
    keep_last: int
    interval_steps: int = 0
    at_epoch_end: bool = True
    keep_best: bool = False
    best_mode: str = "max"
    async_save: bool = True
    max_consecutive_failures: int = 1
    observer: SaveObserver | None = None
    shard_wait_s: float = 600.0
    """How long rank 0 waits for the other ranks' shards of a sharded checkpoint to be on storage."""
    consecutive_failures: int = field(default=0, init=False)
    num_saved: int = field(default=0, init=False)
    num_failed: int = field(default=0, init=False)
    bytes_written: int = field(default=0, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _error: BaseException | None = field(default=None, init=False)
    _staging: dict[str, Any] | None = field(default=None, init=False)
    _last_stage_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        assert self.keep_last >= 1 and self.max_consecutive_failures >= 1, "validated by CheckpointConfig"
        self._staging = {} if self.async_save else None

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
        state = snapshot(**snapshot_args, staging=self._staging)
        self._last_stage_s = time.perf_counter() - start
        return state

    def save(self, global_step: int, state: dict[str, Any], *, metric: float | None = None) -> float:
        """Queue ``state`` (from :func:`snapshot`) for writing; returns the seconds the caller was blocked.

        A failed save is logged as an error and counted (``num_failed``); training goes on with the last
        good checkpoint in place. Once ``max_consecutive_failures`` saves in a row have failed, this raises
        :class:`CheckpointError`.
        """

        def write() -> int:
            files = encode(state)
            manifest = manifest_for(files, global_step=global_step, metric=metric)
            self.storage.write(step_name(global_step), files, manifest)
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
        seconds the caller was blocked: a copy of this rank's shards of the model and optimizer state in host memory.

        The rest runs in the background when ``async_save``: every rank writes its shard through
        ``torch.distributed.checkpoint`` (rank 0 adds ``.metadata``) and moves or uploads it into ``shards/``; rank 0
        waits up to ``shard_wait_s`` until every shard is on storage at its size, then writes ``trainer_state.pt``,
        ``meta.json`` and, last, the manifest, and prunes. The background collectives run on ``process_group``: give
        it a group of its own (gloo) so they never meet training's collectives; None is the default group, for callers
        that wait for the save before any other collective. ``trainer_state`` and ``meta`` are rank 0's (tensors
        already on CPU); other ranks pass None. Failures count as in :meth:`save`."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._settle()
        started = time.perf_counter()
        rank, world_size, name = dist.get_rank(), dist.get_world_size(), step_name(global_step)
        model_state, optim_state = get_state_dict(model, optimizer, options=state_dict_options(model))
        state = detached({"model": model_state, "optimizer": optim_state}, self._staging, "sharded")
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
                remove_local(staging)
            written = sum(e.num_bytes for e in own.values())
            if rank != 0:
                return written
            assert trainer_state is not None and meta is not None, "rank 0 passes the trainer state and meta"
            shards = {relative: entry for per_rank in gathered for relative, entry in per_rank.items()}
            self.storage.wait_for(name, {k: e.num_bytes for k, e in shards.items()}, timeout_s=self.shard_wait_s)
            files = encode({"trainer": trainer_state, "meta": asdict(meta)})
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
        else:  # failures are tolerated as in the background, and raised once too many came in a row
            self._write_guarded(global_step, write, prune)
            if self.consecutive_failures >= self.max_consecutive_failures:
                self._settle()  # raises as a background save's failure would
        return time.perf_counter() - start

    def wait(self) -> None:
        """Block until the save in flight is done; raise its error, if any. For the final checkpoint."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _settle(self) -> None:
        """Finish the save in flight; tolerate its failure until too many failed in a row."""
        try:
            self.wait()
        except CheckpointError as error:  # what a background write failed with (see _write_guarded)
            if self.consecutive_failures >= self.max_consecutive_failures:
                raise CheckpointError(
                    f"{self.consecutive_failures} checkpoint saves in a row failed; last: {error}"
                ) from error

    def _write_guarded(self, global_step: int, write: Callable[[], int], prune: bool) -> None:
        try:
            self._write(global_step, write, prune)
        except BaseException as exc:  # reported by the next save() or wait() on the training thread
            log.error("checkpoint save of step %d failed: %s", global_step, reason(exc))
            failed = f"checkpoint save of step {global_step} failed: {reason(exc)}"
            self._error = exc if isinstance(exc, CheckpointError) else CheckpointError(failed)
            if not isinstance(exc, Exception):
                raise  # an interrupt (Ctrl-C during a synchronous save) stops the run: it is no failure to tolerate

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
        write_s = time.perf_counter() - start
        if self.observer is not None:
            self.observer.checkpoint_saved(duration_s=self._last_stage_s + write_s, bytes_written=num_bytes)
        log.info("checkpoint %s written in %.2fs", self.storage.display_uri(name), write_s)
        if prune:
            self._prune(keep=name)

    def _prune(self, *, keep: str) -> None:
        names = self.storage.list_steps()
        retained = set(names[-self.keep_last :]) | {keep}
        if self.keep_best and (best := self._best(names)):
            retained.add(best)
        for name in names:
            if name not in retained:
                self.storage.delete(name)

    def _best(self, names: list[str]) -> str | None:
        scored = []
        for name in names:
            try:
                where = f"{self.storage.display_uri(name)}/{MANIFEST_FILE}"
                metric = CheckpointManifest.parse(
                    self.storage.read(name, MANIFEST_FILE, max_bytes=MAX_MANIFEST_BYTES), where=where
                ).metric
            except (CheckpointError, FileNotFoundError):
                continue  # not a candidate; load_latest_valid reports it when it matters
            if metric is not None and not math.isnan(metric):  # NaN (a diverged validation) ranks nowhere
                scored.append((metric if self.best_mode == "max" else -metric, name))
        return max(scored)[1] if scored else None
