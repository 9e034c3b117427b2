"""What every reader of prepared shards (``.npz`` in :mod:`training_core.data.prepared`, Parquet in
:mod:`training_core.data.image_shards`) checks and says: a shard is a plain file name inside the data directory, and a
bad
shard is a ``ValueError`` that names it and tells the user to re-run data prep."""

from __future__ import annotations

from typing import Any, Callable, NoReturn

from training_core.messages import is_plain_file_name

RERUN_PREP = "re-run data prep (prepare_data) to rewrite the directory"


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
