"""What a task's pod log shows of training_core."""

from __future__ import annotations

import logging

from training_core.redact import install_log_redaction

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def show_task_logs() -> None:
    """training_core's records from INFO up on this task's stderr (the pod log FlyteConsole links to), redacted.

    flytekit configures only its own logger, so without this Python prints a task's warnings bare and drops the
    INFO records that say what the task did: shards written and kept, images skipped, checkpoints, resumes. Where
    the process already has logging set up (a root handler: Ray's, pytest's, a user's), it is left to that.
    Idempotent; every task body that runs training_core code calls it first."""
    install_log_redaction()
    logger = logging.getLogger("training_core")
    if logging.root.handlers or any(getattr(h, "task_log", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.task_log = True  # marks ours, for idempotence
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
