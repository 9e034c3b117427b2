"""What every writer and reader of prepared shards (``.npz`` in :mod:`training_core.data.prepared`, Parquet in
:mod:`training_core.data.image_shards`) shares: the cut of a source's samples into splits, a shard is a plain file
name inside the data directory, and a bad shard is a ``ValueError`` that names it and tells the user to re-run data
prep."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, NoReturn, Sequence

from training_core.config import DataConfig, no_training_samples_error
from training_core.messages import clip, is_plain_file_name, quote
from training_core.redact import redact

RERUN_PREP = "re-run data prep (prepare_data) to rewrite the directory"
SPLIT_NAMES = ("train", "val", "test")
"""The splits of prepared data (and the split folders of an image folder)."""


def plain_shard_name(value: Any, fail: Callable[[str], NoReturn]) -> str:
    """``value`` when it is a plain file name inside its directory, else ``fail(why)``."""
    if not is_plain_file_name(value):
        fail(
            "a shard file is a plain name inside the data directory (letters, digits, '_', '-', '.', not starting "
            "with '.'; no '/', '\\', '..', ':' or absolute path)"
        )
    return value


def shard_error(where: str, found: str) -> NoReturn:
    """Raise the error for a shard (``where`` names it) that is not what its manifest says."""
    raise ValueError(f"{where} {found}; {RERUN_PREP}")


def shard_where(manifest: Any, shard: Any) -> str:
    """How errors name ``shard`` of ``manifest``; raises the shard error when its file is not a plain name."""
    where = f"shard {quote(shard.file)} in {clip(redact(manifest.directory), 500)}"
    plain_shard_name(shard.file, lambda why: shard_error(where, why))
    return where


def check_sha256(where: str, digest: str, expected: str) -> None:
    """Raise the shard error when a shard's ``digest`` is not the ``expected`` one its manifest records."""
    if digest != expected:
        shard_error(where, f"is corrupt: sha256 {digest} != manifest {expected}")


def read_verified(url: str, where: str, sha256: str) -> bytes:
    """The bytes of the shard file at ``url`` (local or fsspec URL), checked against its ``sha256``."""
    import fsspec

    with fsspec.open(url, "rb") as f:
        payload = f.read()
    check_sha256(where, hashlib.sha256(payload).hexdigest(), sha256)
    return payload


def held_out(ordered: Sequence, cfg: DataConfig, *, own: Any, source: str) -> dict[str, Sequence]:
    """``ordered`` (a source's train split, shuffled) cut into train, test and val: the first ``data.test_fraction``
    (rounded) to test, the next ``data.val_fraction`` to val, the rest to train; a split in ``own`` (the source has
    its own) is not carved, and an empty one left out. Raises :func:`no_training_samples_error` naming ``source``
    when nothing is left to train on."""
    n_test = 0 if "test" in own else int(round(len(ordered) * cfg.test_fraction))
    n_val = 0 if "val" in own else int(round(len(ordered) * cfg.val_fraction))
    if n_test + n_val >= len(ordered):
        raise no_training_samples_error(cfg, len(ordered), source=source)
    cut = {"train": ordered[n_test + n_val :], "test": ordered[:n_test], "val": ordered[n_test : n_test + n_val]}
    return {name: part for name, part in cut.items() if len(part)}
