"""Recovery from a worker SIGKILL inside a Ray Train job: time to resume and steps lost.

A child process trains small_cnn on digits with 2 gloo workers, checkpointing every
``--checkpoint-interval-steps`` steps and logging every step. Once a checkpoint past ``--kill-after-step``
exists, this process SIGKILLs one Ray Train worker. Ray Train restarts the worker group, which resumes from
the newest valid checkpoint.

- ``resume_seconds``: from the SIGKILL to the first optimizer step completed after the resume (the loop
  records that moment in the checkpoint metadata). Goal: < 30 s.
- ``steps_lost``: the last step rank 0 logged before the kill, minus the step the resume started from,
  i.e. optimizer steps computed twice. Goal: <= ``checkpoint_interval_steps``.

Prints one JSON object as the last line and writes ``benchmarks/results/recovery.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, ray_train_worker_pids  # noqa: E402

STEP_LINE = re.compile(r"\[rank 0\] step=(\d+) train_loss")


def child(workdir: str, interval: int) -> None:
    """Train in this process (the Ray driver); worker log lines arrive on our stderr."""
    import ray

    from training_core.config import DataConfig, TrainingConfig
    from training_core.data import prepare
    from training_core.trainer import fit

    prepare(DataConfig(), os.path.join(workdir, "data"))
    ray.init(num_cpus=4, include_dashboard=False)
    cfg = TrainingConfig.from_dict(
        {
            "model": {"name": "small_cnn"},
            "loop": {"epochs": 4, "batch_size": 16, "log_interval_steps": 1},
            "checkpoint": {"interval_steps": interval, "keep_last": 3, "max_worker_restarts": 2},
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-interval-steps", type=int, default=10)
    parser.add_argument(
        "--kill-after-step", type=int, default=25, help="kill once a checkpoint at or past this step exists"
    )
    parser.add_argument("--child", metavar="WORKDIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.checkpoint_interval_steps)
        return

    env = dict(
        os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"), PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0"
    )
    with tempfile.TemporaryDirectory(prefix="recovery-") as workdir:
        log_path = Path(workdir) / "child.log"
        process = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                workdir,
                "--checkpoint-interval-steps",
                str(args.checkpoint_interval_steps),
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
                if done and done[-1] >= args.kill_after_step:
                    break
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"training ended or stalled before the kill:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.02)
            pids = ray_train_worker_pids()
            kill_unix = time.time()
            os.kill(max(pids), signal.SIGKILL)
            if process.wait(timeout=900) != 0:
                raise RuntimeError(f"training failed after the kill:\n{log_path.read_text()[-3000:]}")
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        log = log_path.read_text()
        if os.environ.get("RECOVERY_KEEP_LOG"):
            Path(os.environ["RECOVERY_KEEP_LOG"]).write_text(log)

    outcome = json.loads(log.split("RESULT ", 1)[1].splitlines()[0])
    (timing,) = outcome["resume_timings"]
    resumed_from = int(timing["from_step"])
    # The restarted rank 0 logs "resumed from ..." before its first step: every step line before that marker
    # came from the killed group, so the highest of them is where the kill landed.
    before_restart = log.split("resumed from", 1)[0]
    last_before_kill = max(int(m.group(1)) for m in STEP_LINE.finditer(before_restart))
    result = {
        "benchmark": "recovery",
        "resume_seconds": timing["first_step_unix"] - kill_unix,
        "restore_seconds": timing["restored_unix"] - kill_unix,
        "steps_lost": last_before_kill - resumed_from,
        "checkpoint_interval_steps": args.checkpoint_interval_steps,
        "resumed_from_step": resumed_from,
        "last_step_before_kill": last_before_kill,
        "goal": "resume_seconds < 30 and steps_lost <= checkpoint_interval_steps",
    }
    emit("recovery", result)


if __name__ == "__main__":
    main()
