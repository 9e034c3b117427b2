"""Failure classification on the real exception classes Ray, torch and our storage raise."""

import errno

import pytest
from ray.exceptions import ActorDiedError, GetTimeoutError, NodeDiedError
from ray.train import ControllerError, WorkerGroupError
from ray.train.v2._internal.exceptions import (
    CollectiveTimeoutError,
    UserExceptionWithTraceback,
    WorkerHealthCheckFailedError,
)

from training_core.checkpoint import CheckpointError
from training_core.train.failures import (
    INFRASTRUCTURE,
    USER,
    FailFastPolicy,
    TrainingDiverged,
    UserCodeError,
    classify,
    find_deterministic,
    is_collective_timeout,
)


def _user(exc: BaseException) -> UserExceptionWithTraceback:
    return UserExceptionWithTraceback(exc, traceback_str="Traceback (most recent call last): ...")


@pytest.mark.parametrize(
    "exc",
    [
        WorkerGroupError(
            "worker died",
            {
                0: _user(RuntimeError("[gloo/pair.cc:561] Connection closed by peer [127.0.0.1]:40846")),
                1: WorkerHealthCheckFailedError("health check failed", ActorDiedError()),
            },
        ),
        WorkerGroupError("lost node", {0: NodeDiedError("node 10.0.0.3 died")}),
        WorkerGroupError("hang", {1: CollectiveTimeoutError("barrier timed out")}),
        ControllerError(GetTimeoutError("timed out")),
        CheckpointError(
            "uploading s3://b/ckpt/step-000000010/model.pt failed after 6 attempt(s): endpoint unreachable"
        ),
        OSError(errno.ENOSPC, "No space left on device"),
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        # torch's NCCL watchdog, as a plain RuntimeError out of a wrapped collective: the words torch 2.14 writes.
        RuntimeError(
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=57, OpType=ALLREDUCE, "
            "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600042 milliseconds before timing out."
        ),
    ],
    ids=[
        "peer-crash",
        "node-died",
        "collective-timeout",
        "controller-timeout",
        "storage-after-retries",
        "disk-full",
        "network-reset",
        "nccl-watchdog-timeout",
    ],
)
def test_infrastructure_failures_are_retried(exc):
    verdict = classify(exc)
    assert verdict.kind == INFRASTRUCTURE and verdict.retryable, verdict


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("model.name='resnet9000' is invalid: choose one of small_cnn, ..."),
        WorkerGroupError("bug", {0: _user(TypeError("forward() takes 2 positional arguments but 3 were given"))}),
        # One rank's bug makes its peer see a broken collective: the bug is the root cause.
        WorkerGroupError("bug", {0: _user(RuntimeError("Connection closed by peer")), 1: _user(KeyError("images"))}),
        WorkerGroupError("data", {0: _user(ValueError("shard train-00001 is corrupt: sha256 ... re-run data prep"))}),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x1024 and 512x10)"),
    ],
    ids=["bad-config", "model-code", "bug-on-one-rank", "data-error", "shape-error"],
)
def test_user_errors_fail_fast(exc):
    verdict = classify(exc)
    assert verdict.kind == USER and not verdict.retryable, verdict


def test_the_reason_names_the_rank_and_the_root_exception():
    exc = WorkerGroupError("bug", {0: _user(RuntimeError("Connection closed by peer")), 1: _user(KeyError("images"))})
    assert classify(exc).reason == "rank 1: KeyError: 'images'"


def test_a_wrapped_infrastructure_cause_is_found():
    try:
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError as inner:
            raise RuntimeError("saving failed") from inner
    except RuntimeError as outer:
        assert classify(outer).kind == INFRASTRUCTURE


def test_only_a_collective_that_timed_out_abandons_the_group():
    # What a rank's gloo all-reduce raises when its peer is stopped (the DDP hook wraps it twice), as seen here.
    gloo = RuntimeError(
        "Got the following error when running the callback: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/"
        "tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation to complete"
    )
    assert is_collective_timeout(gloo)
    assert is_collective_timeout(CollectiveTimeoutError("barrier timed out"))
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise ValueError("validation failed") from inner
    except ValueError as outer:
        assert is_collective_timeout(outer)  # found along the chain
    # A peer that died is already gone, and a user's error is not the group's: neither kills anyone.
    assert not is_collective_timeout(RuntimeError("[gloo/pair.cc:561] Connection closed by peer [127.0.0.1]:40846"))
    assert not is_collective_timeout(ValueError("model.name='resnet9000' is invalid"))
    assert not is_collective_timeout(TimeoutError("reading s3://b/x timed out"))


def test_a_user_code_error_is_the_users_whatever_it_was_raised_from():
    try:
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError as inner:
            raise UserCodeError("data.path: sample 7 of shard train-00003 does not decode") from inner
    except UserCodeError as outer:
        assert classify(outer).kind == USER


def test_a_user_code_error_on_one_rank_is_found_beside_its_peers_broken_collective():
    peer = _user(RuntimeError("[gloo/pair.cc:561] Connection closed by peer [127.0.0.1]:40846"))
    error = WorkerGroupError("bug", {0: peer, 1: _user(UserCodeError("workload.name='m:W' failed in its loss()"))})
    found = find_deterministic(error)
    assert found.rank == 1
    raised = found.as_raised()
    assert type(raised) is UserCodeError and str(raised) == "rank 1: workload.name='m:W' failed in its loss()"
    assert classify(raised).kind == USER and classify(error).kind == USER
    assert type(find_deterministic(WorkerGroupError("nan", {0: _user(TrainingDiverged("nan"))})).as_raised()) is (
        TrainingDiverged
    )
    assert find_deterministic(WorkerGroupError("peer", {0: peer})) is None
    assert find_deterministic(WorkerGroupError("bug", {0: _user(KeyError("images"))})) is None


def test_ray_trains_failure_policy_raises_at_once_on_a_user_code_error_and_decides_the_rest_as_before():
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision

    policy = FailFastPolicy(DefaultFailurePolicy(FailureConfig(max_failures=2)))
    crash = WorkerGroupError("worker died", {1: WorkerHealthCheckFailedError("health check failed", ActorDiedError())})
    bad_sample = WorkerGroupError("data", {1: _user(UserCodeError("sample 7 does not decode"))})
    assert policy.make_decision(crash) == FailureDecision.RETRY
    assert policy.make_decision(bad_sample) == FailureDecision.RAISE
    assert policy.make_decision(crash) == FailureDecision.RETRY  # its second restart of max_failures=2
    assert policy.make_decision(crash) == FailureDecision.RAISE
