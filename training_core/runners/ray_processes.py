"""The processes of one Ray Train run on this machine, and ending the ones that outlive it.

Why: Ray 2.60's worker processes can deadlock in their own exit (``deployment/docs/troubleshooting.md``, "A Ray
process left behind after a local run"). Such a process has already told its raylet it is gone, so neither Ray nor
the cluster's stop ends it: it sleeps, keeps its memory, and outlives the run and the cluster. :func:`reaped_run`
wraps ``TorchTrainer.fit``: afterwards it lets go of the run's controller (which Ray Train's SIGINT handler would
keep alive until the next run), waits up to :data:`RUN_EXIT_WAIT_S` for the run's processes to exit and sends
``SIGKILL`` to the ones still there, with a warning naming each. Linux only (``/proc``): elsewhere it kills nothing.

The run's processes are found in Ray's actor table (the GCS's; the state API needs the dashboard, which a local run
may not start): its Ray Train controller (an actor this process created while the run went) and every actor owned by
it, transitively (workers, dataset manager, synchronization actor, placement-group cleaner), except named detached
ones (singletons that later runs share, such as Ray Data's autoscaling coordinator). Only processes on this machine
count: on a multi-node cluster, another node's processes go with their node (a pod), and their pids mean nothing
here. The raylet, the GCS, and other runs' actors are never touched. Two runs at once from one process would count
each other's actors: :func:`~training_core.runners.ray_train.fit` blocks, and the platform runs one at a time per
process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

CONTROLLER_CLASS = "TrainController"
"""Ray Train's controller actor class: the root of a run's actors."""

RUN_EXIT_WAIT_S = 10.0
"""How long a finished run's processes get to exit by themselves before they are killed. A healthy run's were gone
0.2-2.6 s after the driver let go of its controller (1-worker runs on 2 cores shared with other work, load 6-20)."""

POLL_INTERVAL_S = 0.05


@dataclass(frozen=True)
class RunProcess:
    """A process of a Ray Train run on this machine."""

    pid: int
    name: str
    """The actor's class name (``TrainController``, ``RayTrainWorker``, ...): its process title is ``ray::<name>``."""
    start_ticks: int
    """When the process started (``/proc/<pid>/stat``, clock ticks since boot): tells it from a later process that
    reuses its pid."""


def start_ticks(pid: int) -> int | None:
    """``pid``'s start time in clock ticks since boot, or ``None`` when no such process runs (or it is a zombie:
    it has exited, only its parent has not collected it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == b"Z":
        return None
    return int(fields[19])


def _titled(pid: int, name: str) -> bool:
    """Whether ``pid``'s process title is the one Ray gives an actor of class ``name`` (``ray::<name>``, followed by
    ``.<method>`` while it runs one)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return False
    prefix = f"ray::{name}"
    return title == prefix or title.startswith(prefix + ".")


def _alive(process: RunProcess) -> bool:
    return start_ticks(process.pid) == process.start_ticks


def _actor_table():
    """The actor table of this process's Ray job, as ``ActorTableData`` messages, straight from the GCS."""
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    job_id = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    # Ray 2.60's GlobalState: what ``ray._private.state.actors`` reads, before it drops the owners' worker ids.
    rows = state._connect_and_get_accessor().get_actor_table(job_id, None)
    return [gcs_pb2.ActorTableData.FromString(row) for row in rows]


def run_actors(table, *, created_after: set[bytes], owner_worker_id: bytes) -> list:
    """The actors of ``table`` that belong to the runs ``owner_worker_id`` started: its controllers not in
    ``created_after`` (the actor ids that existed before), and what they own, transitively, except named detached
    actors (shared singletons)."""
    found = [
        actor
        for actor in table
        if actor.class_name == CONTROLLER_CLASS
        and actor.actor_id not in created_after
        and actor.owner_address.worker_id == owner_worker_id
    ]
    owners = {actor.address.worker_id for actor in found}
    seen = {actor.actor_id for actor in found}
    while owners:
        owned = [
            actor
            for actor in table
            if actor.owner_address.worker_id in owners
            and actor.actor_id not in seen
            and not (actor.is_detached and actor.name)
        ]
        found += owned
        seen.update(actor.actor_id for actor in owned)
        owners = {actor.address.worker_id for actor in owned}
    return found


def local_processes(actors, node_id: bytes) -> list[RunProcess]:
    """The processes of ``actors`` that run on node ``node_id`` (this machine's) now, under their actor's title."""
    processes = []
    for actor in actors:
        if actor.address.node_id != node_id or actor.pid <= 0 or not _titled(actor.pid, actor.class_name):
            continue
        ticks = start_ticks(actor.pid)
        if ticks is not None:
            processes.append(RunProcess(pid=actor.pid, name=actor.class_name, start_ticks=ticks))
    return processes


KILLED_EXIT_WAIT_S = 5.0
"""How long a killed process gets to be gone: ``SIGKILL`` is delivered asynchronously, and a process with many
threads (a controller with Ray's core worker) took a moment to die after it."""


def _wait_gone(processes: list[RunProcess], wait_s: float) -> list[RunProcess]:
    """Poll until every one of ``processes`` has exited (or is a zombie), at most ``wait_s``: those still alive."""
    deadline = time.monotonic() + wait_s
    remaining = [p for p in processes if _alive(p)]
    while remaining and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
        remaining = [p for p in remaining if _alive(p)]
    return remaining


def reap(processes: list[RunProcess], *, wait_s: float = RUN_EXIT_WAIT_S) -> list[RunProcess]:
    """Wait up to ``wait_s`` for ``processes`` to exit, then ``SIGKILL`` the ones still there, logging a warning
    that names each, and wait up to :data:`KILLED_EXIT_WAIT_S` until they are gone. Returns those killed."""
    remaining = _wait_gone(processes, wait_s)
    killed = []
    for process in remaining:
        if not _alive(process):
            continue
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.append(process)
        log.warning(
            "Ray process %d (ray::%s) of the finished run did not exit within %g s (Ray's exit deadlock, "
            "deployment/docs/troubleshooting.md): killed it",
            process.pid,
            process.name,
            wait_s,
        )
    for process in _wait_gone(killed, KILLED_EXIT_WAIT_S):
        log.warning("Ray process %d (ray::%s) was sent SIGKILL and is still alive", process.pid, process.name)
    return killed


@contextlib.contextmanager
def reaped_run(*, wait_s: float = RUN_EXIT_WAIT_S) -> Iterator[None]:
    """Around one ``TorchTrainer.fit`` in this process (Ray initialised): when the block ends, by a return or an
    exception, :func:`reap` the run's processes on this machine. A failure to look them up is logged, never raised:
    it must not replace the run's own outcome, nor keep the run from starting."""
    try:
        import ray

        context = ray.get_runtime_context()
        owner_worker_id, node_id = bytes.fromhex(context.get_worker_id()), bytes.fromhex(context.get_node_id())
        created_before = {actor.actor_id for actor in _actor_table()}
    except Exception:  # noqa: BLE001 - see the docstring
        log.warning("cannot read Ray's actor table: a process this run leaves behind stays", exc_info=True)
        created_before = None
    # TorchTrainer.fit (Ray 2.60) installs a SIGINT handler that holds the run's controller (and so every actor it
    # owns) until the next run or the driver's exit: the one in effect before is put back, which lets it go.
    main = threading.current_thread() is threading.main_thread()
    previous_sigint = signal.getsignal(signal.SIGINT) if main else None
    try:
        yield
    finally:
        if previous_sigint is not None and signal.getsignal(signal.SIGINT) is not previous_sigint:
            signal.signal(signal.SIGINT, previous_sigint)
        if created_before is not None:
            try:
                actors = run_actors(_actor_table(), created_after=created_before, owner_worker_id=owner_worker_id)
                reap(local_processes(actors, node_id), wait_s=wait_s)
            except Exception:  # noqa: BLE001 - see the docstring
                log.warning("could not check for processes the Ray Train run left behind", exc_info=True)
