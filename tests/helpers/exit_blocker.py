"""A Ray Train callback for tests: the run's controller cannot exit, as one caught in Ray's exit deadlock.

With ``RAY_TRAIN_CALLBACKS=tests.helpers.exit_blocker.BlockedExit`` in the driver's environment, Ray Train builds
a :class:`BlockedExit` there and runs it in the run's controller, where it starts a thread that never ends and is not a
daemon. At the end of the run the controller leaves its raylet as usual, then its interpreter waits for that thread
forever, and a ``SIGTERM`` only sends it down the same path: only ``SIGKILL`` ends it. The controller records its pid
in the directory named by :data:`RECORD_DIR_ENV` (read in the driver).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ray.train.v2._internal.execution.callback import ControllerCallback

RECORD_DIR_ENV = "TEST_EXIT_BLOCKED_DIR"


class BlockedExit(ControllerCallback):
    def __init__(self) -> None:
        self.record_dir = os.environ[RECORD_DIR_ENV]

    def after_controller_start(self, train_run_context) -> None:
        threading.Thread(target=threading.Event().wait, name="blocks-exit", daemon=False).start()
        Path(self.record_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.record_dir) / str(os.getpid())).touch()


def blocked_pids(record_dir: Path) -> list[int]:
    """The pids of the controllers :class:`BlockedExit` blocked, from ``record_dir``."""
    return sorted(int(path.name) for path in record_dir.iterdir()) if record_dir.exists() else []
