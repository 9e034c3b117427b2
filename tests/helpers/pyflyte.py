"""``pyflyte run`` in a subprocess, and how to compare its output: rich wraps lines and even words."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.conftest import REPO_ROOT, VENV_BIN

TRAINING_WORKFLOWS = str(REPO_ROOT / "workflows" / "training.py")


def pyflyte_run_entity(
    file: str, entity: str, *args: str, cwd: Path, env: dict[str, str], timeout_s: int = 900
) -> subprocess.CompletedProcess:
    """``pyflyte run <file> <entity> <args>``, its output captured as text."""
    return subprocess.run(
        [str(VENV_BIN / "pyflyte"), "run", file, entity, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def pyflyte_run(*args: str, cwd: Path, env: dict[str, str], timeout_s: int = 900) -> subprocess.CompletedProcess:
    """``pyflyte run workflows/training.py training_pipeline <args>``."""
    return pyflyte_run_entity(TRAINING_WORKFLOWS, "training_pipeline", *args, cwd=cwd, env=env, timeout_s=timeout_s)


def flat(text: str) -> str:
    """pyflyte's rich tracebacks wrap lines; compare messages with whitespace collapsed."""
    return re.sub(r"[\s│]+", " ", text)


def squashed(text: str) -> str:
    """Rich also wraps inside long words (paths): compare with every space and box character removed."""
    return re.sub(r"[\s│]+", "", text)
