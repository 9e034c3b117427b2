"""Recovery inside a Ray Train job from a worker that is killed, told to stop, or hung: time to resume and steps
lost, one scenario after another in one run.

For each scenario a child process trains small_cnn on digits with 2 gloo workers, checkpointing every
``--checkpoint-interval-steps`` steps and logging every step. Once a checkpoint past ``--kill-after-step``
exists, this process signals one Ray Train worker. Ray Train restarts the worker group, which resumes from
the newest valid checkpoint.

- SIGKILL (a lost process or node): ``resume_seconds``, from the kill to the first optimizer step completed after
  the resume (the loop records that moment in the checkpoint metadata), goal < 30 s; ``steps_lost``, the last
  step rank 0 logged before the kill minus the step the resume started from, i.e. optimizer steps computed
  twice, goal <= ``checkpoint_interval_steps``.
- SIGTERM (an eviction, a spot reclaim): ``preemption_steps_lost``, the same count, goal 0 (the workers write a
  just-in-time checkpoint of the step they are at).
- SIGSTOP (a hung rank), with ``scaling.collective_timeout_s`` = ``--collective-timeout-s``:
  ``hang_detect_seconds``, from the stall to the resumed state's restore, goal <= the timeout + 10 s.
- A lost node (elastic training, ``scaling.min_workers: 1``): the run is placed across a two-node Ray cluster on this
  machine (``common.TwoNodeCluster``: a head and a node started with ``ray start --address``, 1 CPU each), and the
  second node's raylet and every process it started are killed: ``node_loss_resume_seconds``, from the loss to the
  first step on the remaining worker, goal < 30 s. Once the run goes on with one worker, a new second node joins
  (capacity returns): ``node_regrow_seconds``, from its ``ray start`` to the first step of the 2-worker group Ray
  Train resizes to (at ``scaling.elastic_resize_interval_s`` = :data:`RESIZE_INTERVAL_S` here).
- Preemption's cost: ``preemption_lost_seconds``, the resumed attempt's seconds from its start to its first step,
  which the job's cost reports as lost to the preemption (times the workers' GPUs and CPUs).

Prints one JSON object as the last line and writes ``benchmarks/results/recovery.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import TwoNodeCluster, emit, ray_train_worker_pids, start_ray  # noqa: E402

STEP_LINE = re.compile(r"\[rank 0\] step=(\d+) .*train_loss=")
SHRUNK = "elastic: 1 of scaling.num_workers=2 workers"
"""What rank 0 logs when an elastic run goes on with one worker of two."""
RESIZE_INTERVAL_S = 10
"""``scaling.elastic_resize_interval_s`` of the runs (the product's default is 60 s): how often Ray Train looks for
room to grow back, so the node-loss run's regrowth comes within its length."""
NODE_LOSS_EPOCHS = 25
"""The node-loss run's length: long enough on one worker for the node's return and a resize to land in it."""


def child(workdir: str, interval: int, collective_timeout_s: int, min_workers: int, epochs: int, resize_s: int) -> None:
    """Train in this process (the Ray driver); worker log lines arrive on our stderr."""

    from training_core.config import DataConfig, TrainingConfig
    from training_core.data import prepare
    from training_core.runners.ray_train import fit

    prepare(DataConfig(), os.path.join(workdir, "data"))
    start_ray(num_cpus=4)  # as the product starts a local cluster; room for a restarted worker group
    cfg = TrainingConfig.from_dict(
        {
            "model": {"name": "small_cnn"},
            "loop": {"epochs": epochs, "batch_size": 16, "log_interval_steps": 1},
            "checkpoint": {"interval_steps": interval, "keep_last": 3, "max_worker_restarts": 2},
            "scaling": {
                "collective_timeout_s": collective_timeout_s,
                "min_workers": min_workers,
                "elastic_resize_interval_s": resize_s,
            },
        }
    )
    result = fit(
        cfg,
        data_dir=os.path.join(workdir, "data"),
        checkpoint_dir=os.path.join(workdir, "final"),
        run_name="recovery",
        storage_path=os.path.join(workdir, "runs"),
    )
    print(
        "RESULT "
        + json.dumps(
            {"resume_timings": result.meta.resume_timings, "resumed_from_steps": result.meta.resumed_from_steps}
        ),
        flush=True,
    )


def signal_a_worker(stop_signal: int):
    """A stop: ``stop_signal`` to one of this machine's Ray Train workers; returns the Unix time it was sent."""

    def stop() -> float:
        pids = ray_train_worker_pids()
        sent_unix = time.time()
        os.kill(max(pids), stop_signal)
        return sent_unix

    return stop


def run_scenario(
    name: str,
    stop,
    *,
    interval: int,
    kill_after_step: int,
    collective_timeout_s: int,
    min_workers: int = 0,
    ray_address: str = "",
    epochs: int = 4,
    restore=None,
) -> dict:
    """One training run that ``stop()`` interrupts once a checkpoint past ``kill_after_step`` exists, on a local
    cluster of its own or on the cluster at ``ray_address``. With ``restore``, once the run goes on with fewer
    workers, ``restore()`` brings the capacity back (returning the Unix time it did) and the run grows back."""
    env = dict(
        os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"), PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0"
    )
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    with tempfile.TemporaryDirectory(prefix="recovery-") as workdir:
        log_path = Path(workdir) / "child.log"
        process = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                workdir,
                "--checkpoint-interval-steps",
                str(interval),
                "--collective-timeout-s",
                str(collective_timeout_s),
                "--min-workers",
                str(min_workers),
                "--epochs",
                str(epochs),
                "--elastic-resize-interval-s",
                str(RESIZE_INTERVAL_S),
            ],
            stdout=open(log_path, "w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        checkpoints = Path(workdir) / "runs" / "recovery" / "checkpoints"
        deadline = time.monotonic() + 600
        try:
            while True:
                done = (
                    sorted(
                        int(p.name.split("-")[1]) for p in checkpoints.glob("step-*") if (p / "manifest.json").exists()
                    )
                    if checkpoints.exists()
                    else []
                )
                if done and done[-1] >= kill_after_step:
                    break
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"training ended or stalled before the kill:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.02)
            kill_unix = stop()
            restored_unix = None
            if restore is not None:
                while SHRUNK not in log_path.read_text():
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the run did not go on with fewer workers:\n{log_path.read_text()[-3000:]}")
                    time.sleep(0.1)
                restored_unix = restore()
            if process.wait(timeout=900) != 0:
                raise RuntimeError(f"training failed after the kill:\n{log_path.read_text()[-3000:]}")
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        log = log_path.read_text()
        if os.environ.get("RECOVERY_KEEP_LOG"):
            Path(os.environ["RECOVERY_KEEP_LOG"] + f".{name}").write_text(log)

    outcome = json.JSONDecoder().raw_decode(log.split("RESULT ", 1)[1])[0]  # a Ray log line may follow on its line
    timing, *grown = outcome["resume_timings"]
    resumed_from = int(timing["from_step"])
    # The restarted rank 0 logs "resumed from ..." before its first step: every step line before that marker
    # came from the stopped group, so the highest of them is where the signal landed.
    before_restart = log.split("resumed from", 1)[0]
    last_before_kill = max(int(m.group(1)) for m in STEP_LINE.finditer(before_restart))
    regrow = {}
    if restore is not None:
        (back,) = grown  # the resize to the full group, from the newest checkpoint
        regrow = {
            "regrow_seconds": back["first_step_unix"] - restored_unix,
            "num_workers_shrunk": int(timing["num_workers"]),
            "num_workers_grown": int(back["num_workers"]),
        }
    return regrow | {
        "resume_seconds": timing["first_step_unix"] - kill_unix,
        "restore_seconds": timing["restored_unix"] - kill_unix,
        "steps_lost": last_before_kill - resumed_from,
        "resumed_from_step": resumed_from,
        "last_step_before_kill": last_before_kill,
        "preempted_checkpoint": bool(timing.get("preempted", 0.0)),
        "lost_seconds": timing.get("lost_s", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-interval-steps", type=int, default=10)
    parser.add_argument(
        "--kill-after-step", type=int, default=25, help="signal once a checkpoint at or past this step exists"
    )
    parser.add_argument("--collective-timeout-s", type=int, default=30, help="the hung-rank scenario's timeout")
    parser.add_argument("--child", metavar="WORKDIR", help=argparse.SUPPRESS)
    parser.add_argument("--min-workers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--elastic-resize-interval-s", type=int, default=RESIZE_INTERVAL_S, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(
            args.child,
            args.checkpoint_interval_steps,
            args.collective_timeout_s,
            args.min_workers,
            args.epochs,
            args.elastic_resize_interval_s,
        )
        return

    common = {"interval": args.checkpoint_interval_steps, "kill_after_step": args.kill_after_step}
    # Only the hung-rank run gets the short collective timeout: the others keep the default, as users do.
    killed = run_scenario("sigkill", signal_a_worker(signal.SIGKILL), **common, collective_timeout_s=1800)
    preempted = run_scenario("sigterm", signal_a_worker(signal.SIGTERM), **common, collective_timeout_s=1800)
    hung = run_scenario(
        "sigstop", signal_a_worker(signal.SIGSTOP), **common, collective_timeout_s=args.collective_timeout_s
    )
    nodes_dir = tempfile.mkdtemp(prefix="recovery-nodes-")  # short: Ray's socket paths are bounded
    try:
        with TwoNodeCluster(Path(nodes_dir)) as cluster:
            node_loss = run_scenario(
                "node_loss",
                cluster.lose_second_node,
                **common,
                collective_timeout_s=1800,
                min_workers=1,
                ray_address=cluster.address,
                epochs=NODE_LOSS_EPOCHS,
                restore=cluster.restore_second_node,
            )
    finally:
        shutil.rmtree(nodes_dir, ignore_errors=True)
    result = {
        "benchmark": "recovery",
        "resume_seconds": killed["resume_seconds"],
        "restore_seconds": killed["restore_seconds"],
        "steps_lost": killed["steps_lost"],
        "preemption_steps_lost": preempted["steps_lost"],
        "preemption_resume_seconds": preempted["resume_seconds"],
        "hang_detect_seconds": hung["restore_seconds"],
        "node_loss_resume_seconds": node_loss["resume_seconds"],
        "node_loss_steps_lost": node_loss["steps_lost"],
        "node_regrow_seconds": node_loss["regrow_seconds"],
        "preemption_lost_seconds": preempted["lost_seconds"],
        "elastic_resize_interval_s": RESIZE_INTERVAL_S,
        "collective_timeout_s": args.collective_timeout_s,
        "checkpoint_interval_steps": args.checkpoint_interval_steps,
        "scenarios": {"sigkill": killed, "sigterm": preempted, "sigstop": hung, "node_loss": node_loss},
        "goal": "resume_seconds < 30, steps_lost <= checkpoint_interval_steps, preemption_steps_lost == 0, "
        "hang_detect_seconds <= collective_timeout_s + 10, node_loss_resume_seconds < 30",
    }
    emit("recovery", result)


if __name__ == "__main__":
    main()
