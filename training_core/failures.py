"""Classify why training failed: infrastructure (worth retrying elsewhere) or the user's own error.

Retrying a bad config or a bug in model code burns GPU-hours for nothing; not retrying a lost node
throws away a run that would have finished. The orchestrator adapter turns ``infrastructure`` into a
retryable error (``FlyteRecoverableException``) and lets ``user`` fail fast.

Classes are matched by name along the MRO, so this module imports neither ray nor torch.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

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
# What a peer sees when another rank dies mid-collective (gloo/NCCL report it as a plain RuntimeError).
_COLLECTIVE_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ncclSystemError",
    "ncclRemoteError",
    "Timed out waiting",
    "Socket Timeout",
    "NCCL watchdog",
)
# What a rank sees when a peer stopped answering inside a collective (gloo, NCCL's watchdog), and Ray Train's own.
_COLLECTIVE_TIMEOUT_CLASSES = {"CollectiveTimeoutError", "NCCLHangError"}
_COLLECTIVE_TIMEOUT_MARKERS = ("Timed out waiting", "Socket Timeout", "Watchdog caught collective operation timeout")
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


class WorkerPreempted(RuntimeError):
    """A worker was told to stop (SIGTERM) and wrote a just-in-time checkpoint first: a retry resumes from it
    and recomputes nothing (see :mod:`training_core.preemption`)."""


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
        verdicts = {rank: classify(failure) for rank, failure in sorted(exc.worker_failures.items())}
        # A user error on any rank is the root cause; its peers' broken collectives are consequences.
        for rank, verdict in verdicts.items():
            if not verdict.retryable:
                return FailureClass(USER, f"rank {rank}: {verdict.reason}")
        rank, verdict = next(iter(verdicts.items()))
        return FailureClass(INFRASTRUCTURE, f"rank {rank}: {verdict.reason}")
    if "UserExceptionWithTraceback" in names and getattr(exc, "_base_exc", None) is not None:
        return classify(exc._base_exc)
    if "ControllerError" in names and getattr(exc, "controller_failure", None) is not None:
        return classify(exc.controller_failure)
    if "TrainingDiverged" in names:  # whatever it was raised from: the run itself is wrong
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
