"""What Ray costs a training run, measured with a profiler: where the CPU goes while a Ray Train run trains.

One ``fit`` (the scaling preset, ``--num-workers`` Ray Train workers, one torch thread each) on a Ray cluster
started as the product starts it (``common.start_ray``). Once its steady state begins, for ``--window-s``:

- Every process of the machine is charged its CPU time (``utime + stime`` from ``/proc/<pid>/stat``) and
  grouped by what it is: the Train workers, the Train controller, the GCS, the raylet, the dashboard, its
  agents, the log monitor, idle Ray workers, this driver, everything else. ``cpu_share`` is each group's CPU
  seconds over the window's capacity (wall seconds times CPUs): what the group took from training.
- ``py-spy record`` samples one Train worker (all threads, 200 Hz, active samples only) over the same window;
  each sample is attributed to what its stack is doing: the training step, checkpointing, ``ray.train.report``,
  our telemetry, the actor's main thread serving the controller's polls, Ray's own threads. ``worker_share``
  is each part's fraction of the worker's active samples.

Prints one JSON object as the last line and writes it to ``benchmarks/results/ray_tax.json``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, ray_train_worker_pids, start_ray  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")

# First match wins: (group, a substring of the process's command line).
PROCESS_GROUPS = (
    ("train_worker", "ray::RayTrainWorker"),
    ("train_controller", "ray::TrainController"),
    ("gcs", "gcs_server"),
    ("raylet", "raylet"),
    ("dashboard_agent", "dashboard/agent.py"),
    ("runtime_env_agent", "runtime_env/agent"),
    ("dashboard", "dashboard/dashboard.py"),
    ("log_monitor", "log_monitor.py"),
    ("ray_other_workers", "ray::"),
    ("ray_other_workers", "default_worker.py"),
)

# What a Train worker's sample is doing, from the innermost matching frame outwards: (part, a substring of a
# frame's function or file). Checked in order; the first part any frame of the stack matches wins.
WORKER_PARTS = (
    ("checkpoint", "training_core/checkpoint/"),
    ("ray_train_report", "report ("),
    ("telemetry", "training_core/telemetry"),
    ("train_step", "train_step ("),
    ("data", "training_core/data/__init__.py"),
    ("loop_other", "training_core/train/loop.py"),
    ("actor_main_thread", "main_loop ("),
)


def process_cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's command line and CPU seconds so far."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry.name)] = (cmdline, (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return out


def group_of(pid: int, cmdline: str) -> str:
    if pid == os.getpid():
        return "driver"
    for group, needle in PROCESS_GROUPS:
        if needle in cmdline:
            return group
    return "other"


def worker_breakdown(collapsed: str) -> tuple[dict[str, float], dict[str, float]]:
    """Fractions of a worker's active samples per part, and per innermost frame of our own code for the samples
    outside ``train_step``, from ``py-spy record --format raw`` output."""
    samples: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        part = "ray_threads"
        for name, needle in WORKER_PARTS:
            if needle in stack:
                part = name
                break
        samples[part] += int(count)
        if part != "train_step":
            frames = [f for f in stack.split(";") if "training_core/" in f]
            ours[frames[-1].split(" (")[0] if frames else f"({part})"] += int(count)
    total = sum(samples.values()) or 1
    top = {name: n / total for name, n in ours.most_common(12)}
    return {part: samples[part] / total for part in sorted(samples)}, top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--window-s", type=float, default=30.0, help="measured window, in the steady state")
    parser.add_argument("--settle-s", type=float, default=15.0, help="wait after the workers start")
    args = parser.parse_args()

    from training_core.config import TrainingConfig
    from training_core.data import prepare
    from training_core.runners.ray_train import fit
    from training_core.scaling_benchmark import point_config, scaling_preset

    preset = scaling_preset().to_dict()
    preset["data"].update(synthetic_num_samples=16384, synthetic_image_size=32)
    preset["loop"].update(batch_size=args.batch_size, max_steps=args.steps, epochs=args.steps, log_interval_steps=20)
    cfg = point_config(TrainingConfig.from_dict(preset), model="small_cnn", num_workers=args.num_workers)
    with tempfile.TemporaryDirectory(prefix="ray-tax-") as workdir:
        data_dir = os.path.join(workdir, "data")
        prepare(cfg.data, data_dir)
        process_env = start_ray(num_cpus=max(2, args.num_workers))
        outcome: dict[str, object] = {}

        def run() -> None:
            try:
                outcome["result"] = fit(
                    cfg,
                    data_dir=data_dir,
                    checkpoint_dir=os.path.join(workdir, "final"),
                    run_name="ray-tax",
                    storage_path=os.path.join(workdir, "runs"),
                )
            except BaseException as e:  # reported below, after the measurement
                outcome["error"] = e

        trainer = threading.Thread(target=run)
        trainer.start()
        deadline = time.monotonic() + 120
        while len(ray_train_worker_pids()) < args.num_workers and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(args.settle_s)
        worker_pid = ray_train_worker_pids()[0]
        before, wall_before = process_cpu_seconds(), time.monotonic()
        profile = os.path.join(workdir, "worker.txt")
        spy = subprocess.run(
            [
                shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--pid",
                str(worker_pid),
                "--duration",
                str(int(args.window_s)),
                "--rate",
                "200",
                "--format",
                "raw",
                "--output",
                profile,
                "--nonblocking",
            ],
            capture_output=True,
            text=True,
        )
        after, wall_s = process_cpu_seconds(), time.monotonic() - wall_before
        finished_in_window = not trainer.is_alive()
        trainer.join()
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        if spy.returncode != 0:
            raise RuntimeError(f"py-spy failed: {spy.stderr[-2000:]}")
        breakdown, outside_step = worker_breakdown(Path(profile).read_text())
        import ray

        ray.shutdown()

    capacity_s = wall_s * os.cpu_count()
    cpu_by_group: collections.Counter[str] = collections.Counter()
    cpu_by_process: collections.Counter[str] = collections.Counter()
    for pid, (cmdline, cpu_s) in after.items():
        if "py-spy" in cmdline:
            continue  # the profiler's own cost is not Ray's
        used_s = cpu_s - before.get(pid, (cmdline, 0.0))[1]
        cpu_by_group[group_of(pid, cmdline)] += used_s
        cpu_by_process[f"{pid} {cmdline[:90]}"] += used_s
    result = {
        "benchmark": "ray_tax",
        "cpu_share": {group: cpu_s / capacity_s for group, cpu_s in cpu_by_group.most_common()},
        "ray_daemons_cpu_share": sum(
            cpu_s / capacity_s
            for group, cpu_s in cpu_by_group.items()
            if group not in ("train_worker", "driver", "other")
        ),
        "worker_share": breakdown,
        "worker_share_outside_train_step": outside_step,
        "processes_cpu_share": {p: cpu_s / capacity_s for p, cpu_s in cpu_by_process.most_common(15)},
        "window_s": wall_s,
        "run_finished_inside_window": finished_in_window,
        "samples_per_s": outcome["result"].metrics.steady_samples_per_s,  # type: ignore[union-attr]
        "process_env": process_env,
        "ray_env": {k: v for k, v in os.environ.items() if k.startswith("RAY_") and "TMPDIR" not in k},
        "config": vars(args),
    }
    emit("ray_tax", result)


if __name__ == "__main__":
    main()
