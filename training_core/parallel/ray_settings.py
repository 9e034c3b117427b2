"""The Ray and process settings the platform ships: every Ray cluster it starts or sizes gets them.

They are set where users run, not in benchmarks: the Ray tasks apply them before their ``ray.init`` starts a
local cluster (``pyflyte run`` on a laptop), and every RayJob pod (head and workers) carries them as
container environment, so ``ray start``, its daemons and every worker and loader process inherit them. A
variable already set in the environment is left as it is: a user restores Ray's or glibc's default by setting
it (for example ``RAY_worker_niceness=15``).

Why each one (figures from ``benchmarks/scaling.py`` and ``benchmarks/loop_overhead.py``, README "Ray's tax"):

- ``RAY_worker_niceness=0``. Ray starts worker processes at nice 15, below its nice-0 daemons (GCS, raylet,
  dashboard agents) and below anything else on the node. A training worker is the job, not background work:
  at nice 15 every daemon wake-up preempts it at once, and with DDP a rank that waits stalls every rank.
  Data-loader processes forked by a worker inherit its niceness too.
- ``MALLOC_ARENA_MAX=1``, ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``. Ray Train runs the loop in a
  thread of the worker process, and glibc gives such a thread an arena of its own: heaps of at most 64 MiB that are
  shrunk and grown again, so a step's activation and gradient buffers are faulted in again on every step (measured
  on a small CNN: ~1,800 minor page faults per step in a thread, ~11,700 on a main thread at glibc's defaults). One
  arena and the two thresholds (setting both turns off glibc's adaptive threshold) keep freed memory mapped: 0
  faults per step in a thread or not. Ray Train's throughput on one worker went from 0.79-0.92 of the plain
  launcher's to 1.00-1.02 (``benchmarks/scaling.py``, per round). Blocks above :data:`MMAP_THRESHOLD_BYTES` still
  get their own mapping and go back to the kernel when freed, and at most :data:`TRIM_THRESHOLD_BYTES` of free heap
  stays mapped per process. One arena serialises ``malloc`` between a process's threads: in a training process
  nearly every allocation comes from the training thread, and loader workers are processes of their own.
- ``TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S=5``. Before Ray Train restarts a worker group it asks every worker to
  destroy its process group and waits up to this long (Ray's default: 30 s). A hung rank (the very failure
  ``scaling.collective_timeout_s`` catches) never answers, so every hang cost 30 s more before the restart. A healthy
  group is destroyed in milliseconds, and a group cut short is discarded anyway: its workers are killed next.
  Measured (tests/distributed/test_recovery.py, SIGSTOP with a 15 s collective timeout): stall to resume 59 s at
  Ray's default, 30-35 s with it.
- ``RAY_kill_worker_timeout_milliseconds=1000``. When a worker actor is killed (``ray.kill``, a worker group torn
  down), the raylet asks the process to exit and SIGKILLs it after this long (Ray's default: 5 s). A rank whose
  collective timed out kills its peers' workers so the group restarts at once
  (:meth:`~training_core.parallel.distributed.RayTrainRuntime.abandon_group`); a hung peer never exits by itself, so
  it held the restart up for the whole 5 s. A worker that is killed is being discarded: its checkpoints are written or
  abandoned by then (a checkpoint's manifest comes last).

Not an environment variable: the cluster's daemons (GCS, dashboard, log monitor, autoscaler monitor; never the
raylet, its agents or a worker) run under Linux's ``SCHED_IDLE`` (:func:`idle_ray_daemons`), set by
:func:`start_local_cluster` and by every RayJob pod's ``postStart`` hook (:data:`POD_HOOK_COMMAND`);
``TRAINING_RAY_DAEMONS_IDLE=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training_core.config import TrainingConfig

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 128 * 1024**2
"""Allocations up to this size come from the heap (glibc's default: 128 KiB, adapting upwards to 32 MiB)."""
TRIM_THRESHOLD_BYTES = 512 * 1024**2
"""Free memory at the top of a process's heap kept mapped for the next step (glibc's default: 128 KiB)."""

PROCESS_ENV: dict[str, str] = {
    "RAY_worker_niceness": "0",
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES),
    "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": "5",
    "RAY_kill_worker_timeout_milliseconds": "1000",
}
"""Environment of every process of a Ray cluster the platform starts (daemons, workers, loader processes).
All are read when a process starts (glibc at ``exec``, the raylet at ``ray start``), so they must be in the
environment before the cluster starts; setting them in a running worker does nothing."""


def apply_process_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each :data:`PROCESS_ENV` variable that ``environ`` (default ``os.environ``) does not set already.
    Call it before a local Ray cluster starts. Returns the values in effect afterwards."""
    environ = os.environ if environ is None else environ
    for name, value in PROCESS_ENV.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in PROCESS_ENV}


@contextlib.contextmanager
def environment_defaults(values: Mapping[str, str]) -> Iterator[None]:
    """Set each of ``values`` that ``os.environ`` does not set already while the block runs; remove them after."""
    added = [name for name in values if name not in os.environ]
    os.environ.update({name: values[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


LOCAL_DASHBOARD_ENV = "TRAINING_LOCAL_RAY_DASHBOARD"
"""``1`` (default): a local cluster the platform starts runs Ray's dashboard; ``0``: it does not. Only for local
clusters: KubeRay submits RayJobs through the dashboard, so the RayJob pods always run it."""


def _switch(environ: Mapping[str, str] | None, name: str, *, on: str, off: str) -> bool:
    """The ``0``/``1`` switch ``name`` of ``environ`` (default ``os.environ``), on when unset; ``on`` and ``off``
    say what each value does, for the error a third value gets."""
    value = (os.environ if environ is None else environ).get(name, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value[:40]!r} is invalid: use 1 ({on}) or 0 ({off})")
    return value == "1"


def local_init_kwargs(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``ray.init`` arguments of a local cluster the platform starts, from :data:`LOCAL_DASHBOARD_ENV`."""
    dashboard = _switch(
        environ,
        LOCAL_DASHBOARD_ENV,
        on="a local run serves Ray's dashboard on http://127.0.0.1:8265",
        off="no dashboard: its processes' CPU goes to training",
    )
    return {"include_dashboard": dashboard}


def start_local_cluster(**ray_init_kwargs: Any) -> dict[str, str]:
    """Start a local Ray cluster as the platform does: :func:`apply_process_env`, then ``ray.init`` with
    :func:`local_init_kwargs` and ``ray_init_kwargs`` (resources, for example), then :func:`idle_ray_daemons` on
    the cluster this process started. Returns the process settings."""
    import ray

    process_env = apply_process_env()
    idle_daemons = daemons_idle_enabled()  # a wrong value fails before the cluster starts
    ray.init(**local_init_kwargs(), **ray_init_kwargs)
    if idle_daemons:
        idle_ray_daemons(parent_pid=os.getpid())
    return process_env


DAEMONS_IDLE_ENV = "TRAINING_RAY_DAEMONS_IDLE"
"""``1`` (default): the Ray daemons of a cluster the platform starts run under Linux's ``SCHED_IDLE``
(:func:`idle_ray_daemons`); ``0``: they keep the default policy. Read by a local run's process, and in RayJob pods
by the ``postStart`` hook from the container's environment (set it in the image to turn it off there)."""

DAEMON_PROGRAMS = ("gcs_server",)
"""Daemons the raylet's parent starts beside it that are programs of their own (``argv[0]``'s name)."""

DAEMON_SCRIPTS = (
    "/ray/dashboard/dashboard.py",
    "/ray/_private/log_monitor.py",
    "/ray/autoscaler/_private/monitor.py",
    "/ray/autoscaler/v2/monitor.py",
)
"""Daemons the raylet's parent starts beside it that are Python scripts (one of the interpreter's first two
arguments ends with one). Not the raylet's agents: the raylet exits when its runtime-env agent does not answer
within 30 s of its start (``RAY_agent_register_timeout_ms``), and KubeRay's readiness and liveness probes ask the
dashboard agent with timeouts of 2-5 s; both stay at the default policy."""


def _is_daemon(argv: list[str]) -> bool:
    return os.path.basename(argv[0]) in DAEMON_PROGRAMS or any(arg.endswith(DAEMON_SCRIPTS) for arg in argv[1:3])


def daemons_idle_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`DAEMONS_IDLE_ENV` asks for :func:`idle_ray_daemons` (default: yes)."""
    return _switch(
        environ,
        DAEMONS_IDLE_ENV,
        on="Ray's daemons run only on CPU time training leaves idle",
        off="they compete with training at the default priority",
    )


def process_table() -> dict[int, tuple[int, list[str]]]:
    """Every visible process: its parent's pid and its command line."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue  # exited while listed
        table[int(entry)] = (ppid, argv)
    return table


def ray_daemon_pids(*, parent_pid: int | None = None, ray_temp_dir: str | None = None) -> list[int]:
    """The Ray daemons of the clusters whose raylet was started by ``parent_pid`` (any, when ``None``) under
    ``ray_temp_dir`` (any, when ``None``): what the raylet's parent started beside it (:data:`DAEMON_PROGRAMS`,
    :data:`DAEMON_SCRIPTS`: GCS, dashboard, log monitor, autoscaler monitor), with their descendants (the
    dashboard's modules). Never the raylet (it starts every worker, which would inherit its policy; it also
    serves the object store), its children (workers and agents), or anything else the parent started."""
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)

    def subtree(pid: int) -> list[int]:
        found, stack = [], [pid]
        while stack:
            found.append(stack.pop())
            stack.extend(children.get(found[-1], ()))
        return found

    session_prefix = None if ray_temp_dir is None else "--session_dir=" + ray_temp_dir.rstrip("/") + "/"
    daemons: list[int] = []
    for pid, (ppid, argv) in table.items():
        if os.path.basename(argv[0]) != "raylet" or (parent_pid is not None and ppid != parent_pid):
            continue
        if session_prefix is not None and not any(arg.startswith(session_prefix) for arg in argv):
            continue
        for sibling in children.get(ppid, ()):
            if sibling != pid and _is_daemon(table[sibling][1]):
                daemons += subtree(sibling)
    return sorted(set(daemons))


def ray_temp_dir(environ: Mapping[str, str] | None = None) -> str:
    """Where ``ray start`` keeps its sessions unless ``--temp-dir`` says otherwise: Ray's own rule (``RAY_TMPDIR``,
    then ``TMPDIR`` on Linux, then ``/tmp``), plus ``ray``."""
    environ = os.environ if environ is None else environ
    return os.path.join(environ.get("RAY_TMPDIR") or environ.get("TMPDIR") or "/tmp", "ray")


def idle_ray_daemons(*, parent_pid: int | None = None, ray_temp_dir: str | None = None) -> list[int]:
    """Put every thread of :func:`ray_daemon_pids` under ``SCHED_IDLE``: they run on CPU time nothing else wants.

    Why: under DDP a rank that waits for its core stalls every rank, and Ray's daemons wake hundreds of times a
    second (their Python processes check for signals every 10 ms). Measured on 2 cores, 2 Ray Train workers:
    +3.8% samples/s (mean of 6 alternating pairs of ``fit``, 5 faster) with the daemons under ``SCHED_IDLE``; +0.3% at
    nice 19 and +0.4% under ``SCHED_BATCH`` (README, "Ray's tax"). A ``SCHED_IDLE`` thread runs when its core
    would otherwise idle, which every DDP step leaves at its all-reduce; on a saturated core the kernel still gives
    it a small share (weight 3 against a normal thread's 1,024). What answers checks with timeouts of seconds stays
    at the default policy: the raylet and its agents (KubeRay's probes). The GCS's own checks of the raylets wait
    10 s for a reply and need 5 misses in a row; the dashboard head, which KubeRay's head probe also asks, runs on
    the head pod, where no Ray Train worker runs. Threads inherit the policy, and an unprivileged process cannot
    leave it: hence never the raylet, whose workers would inherit it. A no-op without Linux's ``SCHED_IDLE``
    (macOS); a thread that exits is skipped, one that refuses is logged and its process not counted.
    Returns the pids whose threads were set."""
    if not hasattr(os, "SCHED_IDLE"):
        return []
    done = []
    for pid in ray_daemon_pids(parent_pid=parent_pid, ray_temp_dir=ray_temp_dir):
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # exited
        refused = 0
        for tid in threads:
            try:
                if os.sched_getscheduler(int(tid)) != os.SCHED_IDLE:
                    os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:
                continue  # the thread ended
            except OSError as exc:  # not ours, or a policy a container's seccomp profile refuses
                refused += 1
                log.warning("SCHED_IDLE refused for thread %s of Ray daemon %d: %s", tid, pid, exc)
        if not refused:
            done.append(pid)
    return done


def idle_pod_daemons(*, wait_s: float = 300.0, watch_s: float = 60.0, interval_s: float = 2.0) -> int:
    """A RayJob pod's ``postStart`` hook (:data:`POD_HOOK_COMMAND`, in the background): wait up to ``wait_s`` for
    the pod's raylet and a daemon beside it, then apply :func:`idle_ray_daemons` every ``interval_s`` for
    ``watch_s`` (on a worker pod the log monitor may start after the raylet). The pod's cluster is the one under
    :func:`ray_temp_dir`. Returns how many daemon processes were set."""
    temp_dir = ray_temp_dir()
    deadline = time.monotonic() + wait_s
    while not ray_daemon_pids(ray_temp_dir=temp_dir):
        if time.monotonic() >= deadline:
            log.warning("no Ray daemons under %s after %.0f s: nothing set", temp_dir, wait_s)
            return 0
        time.sleep(interval_s)
    pids: set[int] = set()
    watch_end = time.monotonic() + watch_s
    while True:
        pids.update(idle_ray_daemons(ray_temp_dir=temp_dir))
        if time.monotonic() >= watch_end:
            return len(pids)
        time.sleep(interval_s)


POD_HOOK_COMMAND = [
    "/bin/sh",
    "-c",
    f'[ "${DAEMONS_IDLE_ENV}" = 0 ] || '
    "(python -m training_core.parallel.ray_settings >/tmp/ray-daemons-idle.log 2>&1 &)",
]
"""Every RayJob pod's ``postStart`` hook: :func:`idle_pod_daemons` in the background, so the hook returns at
once and never fails the container (the image holds ``training_core``; a failure lands in the log file)."""


def ray_scaling_config(cfg: TrainingConfig):
    """Ray Train's scaling of a run (``scaling.*``): its workers, their resources, and the elastic range."""
    from ray.train import ScalingConfig

    scaling = cfg.scaling
    resources = {"CPU": scaling.cpus_per_worker} | ({"GPU": scaling.gpus_per_worker} if scaling.use_gpu else {})
    workers: dict[str, Any] = {"num_workers": scaling.num_workers}
    if scaling.elastic:  # Ray Train's elastic policy: (min, max) workers, resized at its monitor interval
        workers = {
            "num_workers": (scaling.min_workers, scaling.num_workers),
            "elastic_resize_monitor_interval_s": scaling.elastic_resize_interval_s,
        }
    return ScalingConfig(use_gpu=scaling.use_gpu, resources_per_worker=resources, **workers)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    if daemons_idle_enabled():
        log.info("SCHED_IDLE set on %d Ray daemon processes", idle_pod_daemons())
