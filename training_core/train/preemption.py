"""A worker told to stop (SIGTERM: a Kubernetes eviction, a spot reclaim, a drained node; or Ray Train's notice that
a node of its group is being preempted, :meth:`~training_core.parallel.distributed.RayTrainRuntime.preemption_notice`)
writes a just-in-time checkpoint at its current step instead of losing the steps since the last interval checkpoint.

Python runs signal handlers on a process's main thread only, and a Ray Train worker runs the training loop in
another thread: the handler is installed on the worker actor's main thread (:func:`arm`), where it only records
when the signal came. The loop reads the record at its next log step, all ranks agree on it in one all-reduce,
save the checkpoint together, and stop with :class:`~training_core.train.failures.WorkerPreempted`, which the task
classifies as recoverable: Ray Train's restart, or Flyte's retry, resumes from that step.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

_requested_unix: float | None = None
"""When this process was told to stop (Unix time); None until then."""

_previous_handler: Any = None
"""The SIGTERM handler :func:`arm` replaced on the calling (main) thread, for :func:`disarm`."""

_reason = ""
"""What told this process to stop: SIGTERM, or Ray Train's preemption notice."""


def record(reason: str) -> None:
    """Note that this process was told to stop, and by what (the first telling counts)."""
    global _requested_unix, _reason
    if _requested_unix is None:
        _requested_unix, _reason = time.time(), reason


def install_handler() -> None:
    """Record SIGTERM instead of exiting at once. Main thread of the process only (Python's rule)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: record("SIGTERM"))


def arm(run_on_main_thread: Callable[..., Any] | None) -> bool:
    """Install the handler from the calling thread if it is the main one, else through ``run_on_main_thread``
    (the worker runtime's way to run a function on its process's main thread). Returns whether it is armed."""
    global _previous_handler
    if threading.current_thread() is threading.main_thread():
        _previous_handler = signal.getsignal(signal.SIGTERM)
        install_handler()
        return True
    if run_on_main_thread is None:
        log.warning("SIGTERM will end this worker at once: its runtime cannot run code on the main thread")
        return False
    try:
        run_on_main_thread(install_handler)
    except Exception as exc:  # a runtime without a main-thread hook must not stop training
        log.warning("SIGTERM will end this worker at once: installing its handler failed (%s)", exc)
        return False
    return True


def disarm() -> None:
    """Give the main thread its SIGTERM handler back after a run armed from it (a run in a process that lives
    on, as an in-process test's or a plain launcher's). A Ray worker's handler stays: its process ends with it."""
    global _previous_handler
    if _previous_handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _previous_handler)
        _previous_handler = None


def requested_unix() -> float | None:
    """When this process was told to stop, or None."""
    return _requested_unix


def reason() -> str:
    """What told this process to stop ("" when nothing did)."""
    return _reason


def clear() -> None:
    """Forget a recorded request (a process that goes on training, as the tests' in-process runs do)."""
    global _requested_unix, _reason
    _requested_unix, _reason = None, ""
