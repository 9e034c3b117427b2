"""Classify why training failed: infrastructure (worth retrying elsewhere) or the user's own error.

Retrying a bad config or a bug in model code burns GPU-hours for nothing; not retrying a lost node
throws away a run that would have finished. The orchestrator adapter turns ``infrastructure`` into a
retryable error (``FlyteRecoverableException``) and lets ``user`` fail fast.

Classes are matched by name along the MRO, so this module imports neither ray nor torch.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("training_core")

INFRASTRUCTURE = "infrastructure"
USER = "user"

# Lost processes, nodes and collectives, and storage that stayed unreachable after bounded retries.
_INFRASTRUCTURE_CLASSES = {
    "WorkerHealthCheckFailedError",
    "WorkerHealthCheckTimeoutError",
    "WorkerGroupStartupTimeoutError",
    "WorkerGroupStartupFailedError",
    "InsufficientClusterResourcesError",
    "CollectiveTimeoutError",
    "NCCLHangError",
    "PreemptionError",
    "WorkerPreempted",
    "ActorDiedError",
    "RayActorError",
    "ActorUnavailableError",
    "WorkerCrashedError",
    "NodeDiedError",
    "OwnerDiedError",
    "ObjectLostError",
    "RaySystemError",
    "GetTimeoutError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "CheckpointError",
    "ConnectionError",
    "TimeoutError",
}
# What a rank sees when a peer stopped answering inside a collective (gloo, NCCL's watchdog), and Ray Train's own.
_COLLECTIVE_TIMEOUT_CLASSES = {"CollectiveTimeoutError", "NCCLHangError"}
_COLLECTIVE_TIMEOUT_MARKERS = ("Timed out waiting", "Socket Timeout", "Watchdog caught collective operation timeout")
# What a peer sees when another rank dies mid-collective (gloo/NCCL report it as a plain RuntimeError), or a
# collective that timed out (NCCL's watchdog's own words among them).
_COLLECTIVE_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ncclSystemError",
    "ncclRemoteError",
    "NCCL watchdog",
    *_COLLECTIVE_TIMEOUT_MARKERS,
)
# Errors a restart would meet again at the same point: raised once, on any rank, they end the run.
_DETERMINISTIC_CLASSES = {"UserCodeError", "TrainingDiverged"}
# Raised out of user code but not its own error: out of memory (``loop.oom_policy`` handles CUDA's) and the
# platform's own signals, which pass through user code unchanged.
_NOT_USER_CODE_CLASSES = {"OutOfMemoryError", "MemoryError", "WorkerPreempted", *_DETERMINISTIC_CLASSES}
_INFRASTRUCTURE_ERRNOS = {
    errno.ENOSPC,
    errno.EIO,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
}


DIVERGED_METRIC = "training_diverged"
"""Key of the report by which Ray Train workers hand a :class:`TrainingDiverged` message to the driver."""


class TrainingDiverged(ValueError):
    """The loss, the gradients or the weights became NaN or infinite: a setting to change (learning rate,
    clipping, ``loop.nonfinite_policy``), never worth a retry, which would diverge the same way."""


class UserCodeError(ValueError):
    """A deterministic error of the user's code or data met inside a worker (a ``loss`` that returns a float, a
    sample that does not decode): a restart would meet it again, so neither Ray Train nor Flyte retries it. The
    message names the field or the file and the fix."""


class WorkerPreempted(RuntimeError):
    """A worker was told to stop (SIGTERM) and wrote a just-in-time checkpoint first: a retry resumes from it
    and recomputes nothing (see :mod:`training_core.train.preemption`)."""


@dataclass(frozen=True)
class FailureClass:
    kind: str
    """``infrastructure`` or ``user``."""
    reason: str
    """The exception the decision rests on, for the error message."""

    @property
    def retryable(self) -> bool:
        return self.kind == INFRASTRUCTURE


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".strip()


def classify(exc: BaseException) -> FailureClass:
    """Decide whether ``exc`` (as raised by ``fit``, or anything it wraps) is worth a retry."""
    names = _names(exc)
    if "WorkerGroupError" in names and getattr(exc, "worker_failures", None):
        verdicts = [(rank, classify(failure)) for rank, failure in sorted(exc.worker_failures.items())]
        # A user error on any rank is the root cause; its peers' broken collectives are consequences.
        rank, verdict = next(((r, v) for r, v in verdicts if not v.retryable), verdicts[0])
        return FailureClass(verdict.kind, f"rank {rank}: {verdict.reason}")
    if "UserExceptionWithTraceback" in names and getattr(exc, "_base_exc", None) is not None:
        return classify(exc._base_exc)
    if "ControllerError" in names and getattr(exc, "controller_failure", None) is not None:
        return classify(exc.controller_failure)
    if names & _DETERMINISTIC_CLASSES:  # whatever it was raised from: the run itself is wrong
        return FailureClass(USER, _describe(exc))
    if names & _INFRASTRUCTURE_CLASSES:
        return FailureClass(INFRASTRUCTURE, _describe(exc))
    if isinstance(exc, OSError) and exc.errno in _INFRASTRUCTURE_ERRNOS:
        return FailureClass(INFRASTRUCTURE, _describe(exc))
    if isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _COLLECTIVE_FAILURE_MARKERS):
        return FailureClass(INFRASTRUCTURE, _describe(exc))
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None and cause is not exc:
        inner = classify(cause)
        if inner.retryable:
            return inner
    return FailureClass(USER, _describe(exc))


def is_collective_timeout(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, is a collective that timed out: a peer hung or is
    unreachable, so the whole group is lost (``scaling.collective_timeout_s``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _names(current) & _COLLECTIVE_TIMEOUT_CLASSES:
            return True
        if isinstance(current, RuntimeError) and any(m in str(current) for m in _COLLECTIVE_TIMEOUT_MARKERS):
            return True
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return False


def blames_user_code(exc: BaseException) -> bool:
    """Whether ``exc``, raised out of the user's code (a workload's method, a factory), is that code's own error,
    to be raised as a :class:`UserCodeError` naming it: not an infrastructure failure met inside it (a collective
    whose peer is gone, storage out of reach: see :func:`classify`), not running out of memory, and not one of the
    platform's own signals (a :class:`UserCodeError` already named, a divergence, a preemption)."""
    return not (_names(exc) & _NOT_USER_CODE_CLASSES) and not classify(exc).retryable


@dataclass(frozen=True)
class DeterministicFailure:
    """A :class:`UserCodeError` or :class:`TrainingDiverged` that ended a run: a restart would meet it again."""

    error: BaseException
    """The error as the worker raised it (unwrapped from Ray Train's)."""
    rank: int | None
    """The Ray Train worker that raised it; None when it was not raised in a worker."""

    def as_raised(self) -> ValueError:
        """The error the driver raises for it: of its kind, with its message, prefixed with the rank."""
        kind = TrainingDiverged if "TrainingDiverged" in _names(self.error) else UserCodeError
        return kind(f"{'' if self.rank is None else f'rank {self.rank}: '}{self.error}")


def find_deterministic(exc: BaseException) -> DeterministicFailure | None:
    """The deterministic failure ``exc`` is or holds, on the lowest rank that raised one: ``exc`` as Ray Train
    raises it (a ``WorkerGroupError`` holding every failed rank's error), a worker's wrapped error, or one raised
    here. None when there is none: then a restart may help."""
    names = _names(exc)
    if "WorkerGroupError" in names and getattr(exc, "worker_failures", None):
        for rank, failure in sorted(exc.worker_failures.items()):
            found = find_deterministic(failure)
            if found is not None:
                return DeterministicFailure(error=found.error, rank=rank)
        return None
    if "UserExceptionWithTraceback" in names and getattr(exc, "_base_exc", None) is not None:
        return find_deterministic(exc._base_exc)
    if names & _DETERMINISTIC_CLASSES:
        return DeterministicFailure(error=exc, rank=None)
    return None


@dataclass
class FailFastPolicy:
    """Ray Train's failure policy, except that a worker group whose failed ranks include a deterministic failure
    (:func:`find_deterministic`) is not restarted: Ray Train raises at once, however many restarts
    ``checkpoint.max_worker_restarts`` leaves. The error may come from one rank alone (one bad sample), its peers
    still blocked in a collective: the decision is the controller's, which sees every rank's error.

    Ray Train's controller calls :meth:`make_decision` (its ``FailurePolicy`` interface) in its own process: this
    module imports no ray at import, so that process unpickles it cheaply."""

    default: Any
    """The policy Ray Train built from ``RunConfig.failure_config``: what decides every other failure."""

    def make_decision(self, training_failed_error: Exception) -> Any:
        from ray.train.v2._internal.execution.failure_handling import FailureDecision

        found = find_deterministic(training_failed_error)
        if found is None:
            return self.default.make_decision(training_failed_error)
        log.warning(
            "rank %s raised %s: a restart would meet it again, so the worker group is not restarted",
            found.rank,
            _describe(found.error)[:500],
        )
        return FailureDecision.RAISE
