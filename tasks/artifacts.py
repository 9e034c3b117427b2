"""Helpers that turn local files into Flyte-tracked artifacts in the run's raw-output location."""

from __future__ import annotations

import glob
import html
import json
import os
from typing import Sequence

from flytekit import Deck, FlyteContextManager, current_context
from flytekit.deck import DeckField
from flytekit.deck.deck import DECK_FILE_NAME
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from tasks import reports
from training_core.config import CheckpointConfig
from training_core.redact import redact


def tracked_directory(local_path: str) -> FlyteDirectory:
    """A FlyteDirectory uploaded to a fresh path under the raw-output prefix (local or s3://).

    Local flytekit only uploads a directory whose ``remote_directory`` is set, so set it explicitly.
    """
    remote = FlyteContextManager.current_context().file_access.get_random_remote_directory()
    return FlyteDirectory(local_path, remote_directory=remote)


# The Deck tabs flytekit renders beside ours. Its Dependencies tab runs `pip list` and `pip freeze` in every task
# (2-4 s each, in every attempt of every task); the image's dependencies are pinned in requirements.lock and its
# tag, so the tab repeats what the image already says.
DECK_FIELDS = (DeckField.SOURCE_CODE, DeckField.TIMELINE, DeckField.INPUT, DeckField.OUTPUT)


def publish_report(title: str, sections: Sequence[str]) -> FlyteFile:
    """Show ``sections`` as a Deck and return them as a standalone HTML page, a tracked task output.

    pyflyte does not say where a local Deck lands, so the same content also travels as an output whose
    path the pipeline prints; the Deck carries that path so ``local_deck_path`` can find it.
    """
    file_access = FlyteContextManager.current_context().file_access
    name = f"{title.lower().replace(' ', '_')}.html"
    remote_path = file_access.get_random_remote_path(name)
    Deck(title, reports.deck(sections, marker=remote_path))
    path = os.path.join(current_context().working_directory, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(reports.page(title, sections))
    return FlyteFile(path, remote_path=remote_path)


def artifact_location(artifact: FlyteFile | FlyteDirectory) -> str:
    """Where Flyte stored a task's file or directory input: s3:// on a cluster, a local path in a local run.

    Ray workers and downstream tasks read it from there, not from this pod's download location.
    """
    return str(artifact.remote_source or artifact.path)


def checkpoint_storage_path(config: CheckpointConfig) -> str:
    """Where a run's checkpoints go: ``config.storage_path``, or when that is empty ``checkpoints`` under the
    execution's raw-output location (s3:// on a cluster or with ``--raw-output-data-prefix``)."""
    raw_output_prefix = FlyteContextManager.current_context().file_access.raw_output_prefix
    return config.storage_path or f"{raw_output_prefix.rstrip('/')}/checkpoints"


def _flyte_checkpoint():
    try:
        return current_context().checkpoint
    except NotImplementedError:  # a platform without intra-task checkpoints
        return None


def read_attempt_record() -> dict | None:
    """What the previous attempt of this node wrote with :func:`write_attempt_record`, or None on a first attempt.

    Flyte hands each retry the intra-task checkpoint of the attempt before (``--prev-checkpoint``): a retry finds
    where its predecessor kept its work and continues there instead of starting over in a fresh location."""
    checkpoint = _flyte_checkpoint()
    if checkpoint is None or not checkpoint.prev_exists():
        return None
    payload = checkpoint.read()
    return json.loads(payload) if payload else None


def write_attempt_record(record: dict) -> None:
    """Record ``record`` (JSON) in Flyte's intra-task checkpoint, which the next attempt receives."""
    checkpoint = _flyte_checkpoint()
    if checkpoint is not None:
        checkpoint.write(json.dumps(record).encode())


def local_deck_path(report: FlyteFile) -> str | None:
    """The deck.html of the task that published ``report``, when that task ran in this process.

    flytekit writes a locally executed task's Deck to ``<local sandbox>/<random>/deck.html``
    (``flytekit.deck.deck._output_deck``) and tells nobody the path; on a cluster each task is its own pod
    and the Deck goes to ``<output metadata prefix>/deck.html``, shown by FlyteConsole, so this finds nothing
    there. The Deck is recognised by the report path ``publish_report`` put into it. A local run shares one
    list of Decks across its tasks, so later tasks' deck.html files show this report too: the first one
    written is the publishing task's.
    """
    sandbox = FlyteContextManager.current_context().file_access.local_sandbox_dir
    # The Deck holds the marker redacted, as all of its text (tasks.reports.deck).
    marker = f"data-report='{redact(html.escape(artifact_location(report), quote=True))}'"
    for path in sorted(glob.glob(os.path.join(os.fspath(sandbox), "*", DECK_FILE_NAME)), key=os.path.getmtime):
        with open(path, encoding="utf-8") as f:
            if marker in f.read():
                return path
    return None
