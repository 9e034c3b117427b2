"""The external tools the tests in ``tests/tools`` run, found on ``PATH``; a missing one fails the test, with how to
install it."""

from __future__ import annotations

import shutil

import pytest


def _on_path(name: str, missing: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(missing, pytrace=False)
    return path


def promtool() -> str:
    return _on_path(
        "promtool",
        "promtool is not on PATH: `make system-packages` (run by make test) installs Debian's prometheus package",
    )


def kubectl() -> str:
    return _on_path(
        "kubectl",
        "kubectl is not on PATH: it renders the kustomizations (`make system-packages` installs it where apt "
        "offers it; otherwise install kubectl >= 1.27)",
    )
