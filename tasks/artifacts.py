"""Helpers that turn local files into Flyte-tracked artifacts in the run's raw-output location."""

from __future__ import annotations

import os

from flytekit import Deck, FlyteContextManager, current_context
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile


def tracked_directory(local_path: str) -> FlyteDirectory:
    """A FlyteDirectory uploaded to a fresh path under the raw-output prefix (local or s3://).

    Local flytekit only uploads a directory whose ``remote_directory`` is set, so set it explicitly.
    """
    remote = FlyteContextManager.current_context().file_access.get_random_remote_directory()
    return FlyteDirectory(local_path, remote_directory=remote)


def publish_report(title: str, html_page: str, deck_html: str) -> FlyteFile:
    """Show ``deck_html`` as a Deck and return the standalone page as a tracked HTML file.

    pyflyte does not say where a local Deck lands, so the same content also travels as an output whose
    path the pipeline prints.
    """
    Deck(title, deck_html)
    directory = current_context().working_directory
    path = os.path.join(directory, f"{title.lower().replace(' ', '_')}.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(html_page)
    return FlyteFile(path, remote_path=FlyteContextManager.current_context().file_access.get_random_remote_path(os.path.basename(path)))
