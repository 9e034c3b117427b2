"""What a checkpoint is on disk (its directory and file names, its formats) and what the package's modules share:
:class:`CheckpointError`, how an underlying error is quoted, the checks of a JSON value."""

from __future__ import annotations

import json
import re
from typing import Any

from training_core.messages import clip
from training_core.schema import is_count, is_int, is_mapping, is_number  # noqa: F401 - re-exported for checkpoint/

MODEL_FILE = "model.pt"
TRAINER_STATE_FILE = "trainer_state.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
MAX_MANIFEST_BYTES = 16 * 2**20
"""The most bytes read of a checkpoint's ``manifest.json`` (a few hundred a file, a sharded one a file a rank)."""
MAX_META_BYTES = 64 * 2**20
"""The most bytes read of a ``meta.json`` without its manifest (:func:`~training_core.checkpoint.load.load_meta`):
its step log and timeline are bounded, its RNG states grow with the world size (about 10 KB a rank)."""
CHECKPOINT_FILES = (MODEL_FILE, TRAINER_STATE_FILE, META_FILE)
"""The files a manifest lists: exactly these, each a plain name inside the checkpoint's directory."""
SHARDS_DIR = "shards"
"""Folder of a sharded checkpoint's ``torch.distributed.checkpoint`` files: ``.metadata`` and one
``__<rank>_0.distcp`` per rank."""
SHARD_METADATA_FILE = f"{SHARDS_DIR}/.metadata"
SHARD_FILE_PATTERN = re.compile(rf"{SHARDS_DIR}/(__[0-9]{{1,6}}_[0-9]{{1,6}}\.distcp|\.metadata)")
SHARDED_FILES = (TRAINER_STATE_FILE, META_FILE)
"""The files a sharded checkpoint's manifest lists besides its shards (no ``model.pt``: the weights are in them)."""
FORMATS = ("full", "sharded")
STEP_NAME_PATTERN = re.compile(r"step-([0-9]+)")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
STEP_LOG_CAPACITY = 64
"""Step windows a checkpoint's ``meta.json`` keeps (about 25 KB); MLflow has every window."""
MAX_REASON_CHARS = 1000
"""Longest quote of an underlying error (torch's unpickling errors run to pages) in a message of this package."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which one and why."""


def step_name(global_step: int) -> str:
    return f"step-{global_step:09d}"


def reason(exc: BaseException) -> str:
    """An underlying error for a message: its type (unless it is this package's own) and its text, clipped. For
    ``torch.distributed.checkpoint``'s ``CheckpointException`` (whose text is every rank's whole traceback), each
    failed rank's own error."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = [(rank, f[0] if isinstance(f, tuple) else f) for rank, f in sorted(failures.items())]
        text = "; ".join(f"rank {rank}: {reason(cause)}" for rank, cause in causes if isinstance(cause, BaseException))
        return clip(text, MAX_REASON_CHARS)
    text = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    return clip(text, MAX_REASON_CHARS)


def parse_json(data: bytes, *, where: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's stack
        raise CheckpointError(f"{where} is not valid JSON: {reason(exc)}") from None
