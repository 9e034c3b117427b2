"""Goodput, stragglers and ETA on real processes: where a job's worker-seconds went, how fast a slowed rank is named,
how close the ETA comes to the real end, and what the accounting costs the loop.

Runs 2 gloo workers with the plain ``torch.distributed`` launcher (:func:`training_core.runners.launch.launch`: the same
loop as under Ray Train, started in seconds) on scikit-learn's digits, with a linear user model
(``workload.model_factory``) whose forward sleeps on one rank when this module's environment asks:

1. A faulty run: rank 1 slowed (``SLOW_FORWARD_S`` a forward) and rank 0 killed with SIGKILL after
   ``--kill-after`` forwards; the same launch again resumes it from its last checkpoint. ``goodput`` and
   ``attributed_fraction`` (categories over workers x wall, goal within [0.98, 1.02]) are the execution's, over
   both attempts; ``straggler_detect_windows`` is the window of the second attempt whose close first warned
   that rank 1 straggles (goal <= ``observability.straggler_windows``, 3; from the workers' log, so a flag a noisy
   window cleared later does not move it), ``slow_rank_flagged_windows`` of its ``resumed_windows`` beside it.
2. A healthy run of ``--healthy-windows`` log windows (``--steps-per-window`` steps each): ``false_stragglers``,
   the windows any rank was flagged in (goal 0), and ``eta_error``, the ETA printed at the first window after the
   first epoch against the real time left to the run's end (goal <= 0.2; the median and the largest error of every
   later window's ETA beside it).
3. ``overhead_fraction`` (goal <= 0.01): in this one process, blocks of the loop's own training steps with and
   without the accounting's per-step and per-window calls, in ABBA order; one minus the median of the per-pair
   throughput ratios (as ``metrics_overhead.py`` measures the telemetry). ``modelled_overhead_fraction``: the
   CPU time of those calls per step over the step time without them (what the side-by-side figure resolves only
   down to the machine's noise).

Both runs flag stragglers by ``observability.straggler_min_excess_s`` (its default; ``--straggler-min-excess-s 0``
flags by the 20 % alone, as before that bound), recorded as ``straggler_min_excess_s``. Prints one JSON object as the
last line and writes it to ``benchmarks/results/goodput.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

SLOW_RANK_ENV, KILL_AFTER_ENV = "GOODPUT_BENCH_SLOW_RANK", "GOODPUT_BENCH_KILL_AFTER"
SLOW_FORWARD_S = 0.03
WINDOW_LINE = re.compile(r"\[rank 0\] step=\d+ epoch=")
"""Rank 0's line for a log window (the all-reduce probe's ``step=0`` line has no epoch)."""


def build_model(config, manifest):
    """``workload.model_factory``: a linear classifier that sleeps on the slow rank and kills rank 0 when asked."""
    import torch

    class Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(math.prod(manifest.input_shape), len(manifest.classes))
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self.sleeps = os.environ.get(SLOW_RANK_ENV) == str(rank)
            kill_after = int(os.environ.get(KILL_AFTER_ENV) or 0)
            self.kill_after = kill_after if rank == 0 else 0
            self.forwards = 0

        def forward(self, x):
            if self.training:
                self.forwards += 1
                if self.kill_after and self.forwards == self.kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.sleeps:
                    time.sleep(SLOW_FORWARD_S)
            return self.linear(x.flatten(1))

    return Linear()


def config(*, epochs: int, log_interval_steps: int, interval_steps: int, min_excess_s: float, max_steps: int = 0):
    """The runs' config; ``min_excess_s``: ``observability.straggler_min_excess_s``."""
    from training_core.config import TrainingConfig

    return TrainingConfig.from_dict(
        {
            "workload": {"model_factory": "goodput:build_model"},
            "loop": {
                "epochs": epochs,
                "batch_size": 16,
                "max_steps": max_steps,
                "log_interval_steps": log_interval_steps,
            },
            "checkpoint": {"interval_steps": interval_steps},
            "scaling": {"num_workers": 2, "torch_threads_per_worker": 1},
            "observability": {"straggler_min_excess_s": min_excess_s},
        }
    )


def run(cfg, data_dir: str, root: str, *, env: dict[str, str], log_path: str | None = None):
    """One launch with ``env`` set for its workers, their stderr into ``log_path`` when given."""
    from training_core.runners.launch import launch

    saved_env = {name: os.environ.get(name) for name in (SLOW_RANK_ENV, KILL_AFTER_ENV)}
    os.environ.update(env)
    saved_fd = os.dup(2)
    if log_path:
        with open(log_path, "ab") as log:
            os.dup2(log.fileno(), 2)
    try:
        return launch(cfg, data_dir=data_dir, checkpoint_dir=f"{root}/final", run_name="goodput", storage_path=root)
    finally:
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        for name, value in saved_env.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def faulty_run(data_dir: str, workdir: str, kill_after: int, min_excess_s: float) -> dict[str, float]:
    """Rank 1 slowed throughout; rank 0 SIGKILLed once; the second launch resumes."""
    from training_core.telemetry.goodput import ExecutionGoodput

    cfg = config(epochs=1, log_interval_steps=2, interval_steps=8, max_steps=40, min_excess_s=min_excess_s)
    root = f"{workdir}/faulty"
    try:
        run(cfg, data_dir, root, env={SLOW_RANK_ENV: "1", KILL_AFTER_ENV: str(kill_after)})
        raise SystemExit("the SIGKILLed run finished: raise --kill-after below its steps")
    except Exception as exc:  # noqa: BLE001 - torch's ProcessExitedException: the kill
        if "SIGKILL" not in str(exc) and "signal 9" not in str(exc):
            raise
    log_path = f"{workdir}/faulty-resumed.log"
    result = run(cfg, data_dir, root, env={SLOW_RANK_ENV: "1", KILL_AFTER_ENV: ""}, log_path=log_path)
    meta = result.meta
    execution = ExecutionGoodput.from_summary(meta.telemetry["goodput"])
    ranks = {r["rank"]: r for r in meta.telemetry["ranks"]}
    windows = len([r for r in meta.step_log if r.step > meta.resumed_from_steps[-1]])
    flagged = ranks[1]["flagged_windows"]
    return {
        "goodput": execution.goodput,
        "attributed_fraction": execution.attributed_fraction,
        "attempts": len(execution.attempts),
        "seconds": dict(zip(("first", "second"), (a.seconds.__dict__ for a in execution.attempts))),
        "straggler_detect_windows": first_warning_window(Path(log_path).read_text()),
        "straggler_cause": ranks[1]["cause"],
        "slow_rank_flagged_windows": flagged,
        "resumed_windows": windows,
        "healthy_rank_flagged_windows": ranks[0]["flagged_windows"],
    }


def first_warning_window(log_text: str) -> int | None:
    """The log window (1-based) whose close first warned of a straggler naming rank 1: rank 0 logs the warning just
    before that window's step line. None: never."""
    windows = 0
    for line in log_text.splitlines():
        if WINDOW_LINE.match(line):
            windows += 1
        elif "rank 1 on node" in line and "is a straggler" in line:
            return windows + 1
    return None


def healthy_run(
    data_dir: str, workdir: str, windows: int, steps_per_window: int, min_excess_s: float
) -> dict[str, float]:
    """No slow rank: windows flagged, and the ETA after the first epoch against the real end."""
    cfg = config(
        epochs=100,
        log_interval_steps=steps_per_window,
        interval_steps=0,
        max_steps=windows * steps_per_window,
        min_excess_s=min_excess_s,
    )
    log_path = f"{workdir}/healthy.log"
    result = run(cfg, data_dir, f"{workdir}/healthy", env={}, log_path=log_path)
    meta = result.meta
    etas = {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"\[rank 0\] step=(\d+) .*?eta_s=([0-9.e+-]+)", Path(log_path).read_text())
    }
    # The step log keeps every window's position and clock (merged windows keep the later one's).
    elapsed = {r.step: r.elapsed_s for r in meta.step_log}
    steps_per_epoch = meta.history[0].global_step
    after_first_epoch = sorted(step for step in etas if step > steps_per_epoch and step in elapsed)
    errors = {step: abs(etas[step] - (meta.elapsed_s - elapsed[step])) / (meta.elapsed_s - elapsed[step])
              for step in after_first_epoch if meta.elapsed_s > elapsed[step]}  # fmt: skip
    at = after_first_epoch[0]
    return {
        "false_stragglers": sum(r["flagged_windows"] for r in meta.telemetry["ranks"]),
        "healthy_windows": len(etas) + 1,  # the first window has no ETA yet
        "eta_at_step": at,
        "eta_s": etas[at],
        "real_left_s": meta.elapsed_s - elapsed[at],
        "eta_error": errors[at],
        "eta_error_median_after_first_epoch": statistics.median(errors.values()),
        "eta_error_max_after_first_epoch": max(errors.values()),
    }


def overhead(block_steps: int, block_pairs: int) -> dict[str, float]:
    """The accounting's per-step and per-window calls against none, on the loop's own steps in this process."""
    import torch

    from training_core.models import build_model as build_builtin
    from training_core.train.accounting import RunAccounting, WindowTimes
    from training_core.train.loop import train_step
    from training_core.workloads.image import classification_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_builtin("small_cnn", num_classes=10, input_shape=(3, 32, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batches = [(torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))) for _ in range(8)]

    def block(accounted: bool) -> float:
        accounting = RunAccounting.start(
            rank=0,
            world_size=1,
            device=torch.device("cpu"),
            total_steps=10**6,
            interval_steps=100,
            threshold=0.2,
            windows=3,
            min_excess_s=0.02,
            started_unix=None,
        )
        started = last = time.perf_counter()
        for index in range(block_steps):
            train_step(
                model=model,
                optimizer=optimizer,
                scaler=scaler,
                micro_batches=[batches[index % len(batches)]],
                autocast_dtype=None,
                max_grad_norm=1.0,
                loss_fn=classification_loss,
            )
            now = time.perf_counter()
            if accounted:
                accounting.step(global_step=index + 1, step_time_s=now - last, data_wait_s=0.0, comm_wait_s=0.0)
                if (index + 1) % 5 == 0:
                    accounting.window(WindowTimes(5, 5 * (now - last), 0.0, 0.0), global_step=index + 1)
            last = now
        return block_steps / (time.perf_counter() - started)

    def accounting_cpu_s_per_step(num_steps: int = 20_000) -> float:
        """CPU seconds of the accounting's calls per step: one step, and a window every 5 steps."""
        accounting = RunAccounting.start(
            rank=0,
            world_size=1,
            device=torch.device("cpu"),
            total_steps=10**6,
            interval_steps=100,
            threshold=0.2,
            windows=3,
            min_excess_s=0.02,
            started_unix=None,
        )
        started = time.thread_time()
        for index in range(num_steps):
            accounting.step(global_step=index + 1, step_time_s=0.01, data_wait_s=0.0, comm_wait_s=0.0)
            if (index + 1) % 5 == 0:
                accounting.window(WindowTimes(5, 0.05, 0.0, 0.0), global_step=index + 1)
        return (time.thread_time() - started) / num_steps

    for _ in range(2):
        block(False)
    cpu_s_per_step = accounting_cpu_s_per_step()
    ratios, off_speeds = [], []
    for pair in range(block_pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        speeds = {accounted: block(accounted) for accounted in order}
        ratios.append(speeds[True] / speeds[False])
        off_speeds.append(speeds[False])
    return {
        "overhead_fraction": 1.0 - statistics.median(ratios),
        "overhead_block_pairs": block_pairs,
        # The accounting's CPU time per step over the step time without it: what the side-by-side ratio resolves
        # only down to this shared machine's noise.
        "modelled_overhead_fraction": cpu_s_per_step * statistics.median(off_speeds),
        "accounting_cpu_s_per_step": cpu_s_per_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-after", type=int, default=30, help="rank 0's forwards before its SIGKILL")
    parser.add_argument("--healthy-windows", type=int, default=200)
    parser.add_argument("--steps-per-window", type=int, default=3)
    parser.add_argument("--block-steps", type=int, default=40)
    parser.add_argument("--block-pairs", type=int, default=10)
    parser.add_argument(
        "--straggler-min-excess-s",
        type=float,
        default=None,
        help="observability.straggler_min_excess_s for both runs (default: the config's; 0: the 20 %% alone)",
    )
    args = parser.parse_args()
    from training_core.config import DataConfig, ObservabilityConfig
    from training_core.data import prepare

    min_excess_s = args.straggler_min_excess_s
    if min_excess_s is None:
        min_excess_s = ObservabilityConfig().straggler_min_excess_s

    with tempfile.TemporaryDirectory(prefix="goodput-bench-") as workdir:
        data_dir = f"{workdir}/digits"
        prepare(DataConfig(), data_dir)
        started = time.monotonic()
        faulty = faulty_run(data_dir, workdir, args.kill_after, min_excess_s)
        healthy = healthy_run(data_dir, workdir, args.healthy_windows, args.steps_per_window, min_excess_s)
        costs = overhead(args.block_steps, args.block_pairs)
    rule = {"straggler_min_excess_s": min_excess_s}
    emit("goodput", {**faulty, **healthy, **rule, **costs, "wall_s": time.monotonic() - started})


if __name__ == "__main__":
    main()
