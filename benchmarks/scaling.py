"""Scaling efficiency of our loop under Ray Train, and its parity with plain ``torch.distributed``.

What ``scaling_benchmark`` (``workflows/scaling_benchmark.py``) measures, outside Flyte: for each worker count, the
same config (the workflow's preset, longer) is trained by :func:`training_core.runners.ray_train.fit` (Ray Train) and by
:func:`training_core.runners.launch.launch` (processes spawned here, the same loop without Ray). Throughput is steady
state, over all workers: the first ``--warmup-steps`` steps and epoch boundaries are left out of both.

- ``efficiency_n = throughput_n / (n * throughput_1)`` for each launcher (against the smallest count when 1
  is not measured); ``efficiency_2`` is Ray Train's at 2 workers.
- ``parity_n`` = Ray Train's throughput / plain ``torch.distributed``'s at ``n`` workers.

Small shared machines drift by 10-20% within minutes, so each round measures every point once, and the
rounds alternate direction (1w ray, 1w torch, 1w independent, 2w ray, ..., then the same backwards): a linear
drift then weighs every point equally. Efficiency and parity are computed within each round and
the median over rounds is reported (a burst of load from another process spoils one round, not the figure);
throughputs and step times are means over rounds.

As a reference for what this machine can give ``n`` workers at all, each round also runs ``n`` independent
copies of ``loop_overhead.py``'s bare PyTorch loop at once (one thread each, no communication): their summed
throughput over ``n`` times one copy's is ``independent_efficiency_n``. DDP can only lose to it: ranks wait for
each other at every all-reduce, so whatever delays one rank (another process taking its core) stalls all.

Both launchers run as the product ships them (:mod:`training_core.parallel.ray_settings`): the Ray cluster is started
the
way a local ``pyflyte run`` starts it (``start_local_cluster``: the platform's process settings, Ray workers at
nice 0 and glibc's malloc in one arena keeping freed memory mapped, then ``ray.init`` with log streaming and the
dashboard as the product sets it, and its daemons under ``SCHED_IDLE``), and the plain launcher's ranks get the
same process settings from
:func:`training_core.runners.launch.launch`. To measure
without one of them, set the variable yourself (``RAY_worker_niceness=15``: Ray's own default); the settings in
effect are in the result. When ``RAY_ADDRESS`` is set, that cluster is used as it is. The load average before
and after is recorded: other processes on the machine take cores from multi-worker runs first.

Prints one JSON object as the last line and writes it to ``benchmarks/results/scaling.json``.
Goals, on CPU with a compute-bound model and one thread per worker: ``parity_1`` and ``parity_2`` >= 0.97,
``efficiency_2`` >= 0.90.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

FIGURES = ("samples_per_s", "step_time_p50_s", "step_time_p95_s", "allreduce_fraction")


def run_point(launcher: str, cfg, *, data_dir: str, workdir: str, warmup_steps: int):
    """Train ``cfg`` with one launcher; the point's steady-state figures."""
    from training_core.runners.launch import launch
    from training_core.runners.ray_train import fit
    from training_core.scaling_benchmark import ScalingPoint

    run = fit if launcher == "ray" else launch
    name = f"{launcher}-{cfg.scaling.num_workers}w"
    result = run(
        cfg,
        data_dir=data_dir,
        checkpoint_dir=os.path.join(workdir, name, "final"),
        run_name=name,
        storage_path=os.path.join(workdir, name, "runs"),
        warmup_steps_excluded=warmup_steps,
    )
    m = result.metrics
    return ScalingPoint(
        model=cfg.model.name,
        num_workers=cfg.scaling.num_workers,
        launcher=launcher,
        samples_per_s=m.steady_samples_per_s,
        step_time_p50_s=m.step_time_p50_s,
        step_time_p95_s=m.step_time_p95_s,
        allreduce_fraction=m.allreduce_fraction,
    ), int(m.steady_steps)


def _bare_copy(job: tuple[str, int, int, int]) -> float:
    from loop_overhead import Setup, bare_loop

    data_dir, batch_size, warmup_steps, seed = job
    setup = Setup(
        model_name="small_cnn", batch_size=batch_size, epochs=1, threads=1, warmup_steps=warmup_steps, seed=seed
    )
    return bare_loop(data_dir, setup)["samples_per_s"]


def independent_copies(num_copies: int, *, data_dir: str, batch_size: int, warmup_steps: int) -> float:
    """Summed steady-state throughput of ``num_copies`` bare single-threaded loops running at once."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(num_copies) as pool:
        return sum(pool.map(_bare_copy, [(data_dir, batch_size, warmup_steps, seed) for seed in range(num_copies)]))


def round_order(worker_counts: list[int], round_index: int) -> list[tuple[int, str]]:
    """Every point once; odd rounds run the even rounds' order backwards."""
    order = [(n, launcher) for n in sorted(worker_counts) for launcher in ("ray", "torch", "independent")]
    return order if round_index % 2 == 0 else order[::-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small_cnn")
    parser.add_argument("--worker-counts", default="1,2", help="comma-separated, e.g. 1,2")
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps per run")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=16384, help="synthetic dataset size")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="times every point is measured")
    parser.add_argument("--settle-s", type=float, default=30.0, help="wait after starting the Ray cluster")
    args = parser.parse_args()
    worker_counts = [int(n) for n in args.worker_counts.split(",")]

    import ray

    from training_core.config import TrainingConfig
    from training_core.data import prepare
    from training_core.parallel.ray_settings import (
        apply_process_env,
        daemons_idle_enabled,
        local_init_kwargs,
        start_local_cluster,
    )
    from training_core.scaling_benchmark import check_plan, efficiency_table, point_config, scaling_preset

    preset = scaling_preset().to_dict()
    preset["data"].update(synthetic_num_samples=args.samples, synthetic_image_size=args.image_size)
    # Enough epochs that --steps, not the epoch count, ends every run.
    preset["loop"].update(batch_size=args.batch_size, max_steps=args.steps, epochs=args.steps, log_interval_steps=20)
    base = TrainingConfig.from_dict(preset)
    check_plan(base, worker_counts, [args.model])
    load_before = os.getloadavg()
    # What the product's Ray task does before its ray.init; read when a process starts, so it applies to the
    # Ray cluster, the spawned ranks and the independent copies started below, not to this process.
    process_env = apply_process_env()

    tables: list = []
    runs: list[dict] = []
    steady_steps: dict[int, int] = {}
    with tempfile.TemporaryDirectory(prefix="scaling-") as workdir:
        data_dir = os.path.join(workdir, "data")
        prepare(base.data, data_dir)
        external_cluster = bool(os.environ.get("RAY_ADDRESS"))
        if external_cluster:
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            # One CPU per worker for the largest count (Ray Train's controller takes none); otherwise as the
            # product's Ray task starts a local cluster.
            start_local_cluster(num_cpus=max(worker_counts))
            # The dashboard's modules start in the background for ~20 s on 2 cores: let them, or the first
            # point measures the start-up.
            time.sleep(args.settle_s)
        for round_index in range(args.rounds):
            points, independent = [], {}
            for n, launcher in round_order(worker_counts, round_index):
                if launcher == "independent":
                    samples_per_s = independent[n] = independent_copies(
                        n, data_dir=data_dir, batch_size=args.batch_size, warmup_steps=args.warmup_steps
                    )
                    allreduce_fraction = 0.0
                else:
                    cfg = point_config(base, model=args.model, num_workers=n)
                    point, steady_steps[n] = run_point(
                        launcher,
                        cfg,
                        data_dir=data_dir,
                        workdir=os.path.join(workdir, f"round{round_index}"),
                        warmup_steps=args.warmup_steps,
                    )
                    points.append(point)
                    samples_per_s, allreduce_fraction = point.samples_per_s, point.allreduce_fraction
                runs.append(
                    {
                        "round": round_index,
                        "launcher": launcher,
                        "num_workers": n,
                        "samples_per_s": samples_per_s,
                        "load_average_1m_after": os.getloadavg()[0],
                    }
                )
                print(
                    f"round {round_index} {launcher:>11} {n}w: {samples_per_s:.1f} samples/s, all-reduce "
                    f"{allreduce_fraction:.3f}, load {runs[-1]['load_average_1m_after']:.2f}",
                    flush=True,
                )
            table = efficiency_table(points).set_index("num_workers")
            smallest = min(worker_counts)
            table["independent_samples_per_s"] = [independent[n] for n in table.index]
            table["independent_efficiency"] = [
                (independent[n] / n) / (independent[smallest] / smallest) for n in table.index
            ]
            tables.append(table)
        ray.shutdown()

    def mean(column: str, n: int) -> float:
        return statistics.fmean(float(t.loc[n, column]) for t in tables)

    def median(column: str, n: int) -> float:
        return statistics.median(float(t.loc[n, column]) for t in tables)

    per_count = {
        str(n): {
            **{
                f"{launcher}_{figure}": mean(f"{launcher}_{figure}", n)
                for launcher in ("ray", "torch")
                for figure in FIGURES
            },
            "independent_samples_per_s": mean("independent_samples_per_s", n),
            "ray_efficiency": median("ray_efficiency", n),
            "torch_efficiency": median("torch_efficiency", n),
            "independent_efficiency": median("independent_efficiency", n),
            "parity": median("parity", n),
            "steady_steps": steady_steps[n],
        }
        for n in sorted(worker_counts)
    }
    result = {
        "benchmark": "scaling",
        **{f"parity_{n}": figures["parity"] for n, figures in per_count.items()},
        "efficiency_2": per_count["2"]["ray_efficiency"] if "2" in per_count else None,
        "torch_efficiency_2": per_count["2"]["torch_efficiency"] if "2" in per_count else None,
        "independent_efficiency_2": per_count["2"]["independent_efficiency"] if "2" in per_count else None,
        "parity": {n: figures["parity"] for n, figures in per_count.items()},
        "per_count": per_count,
        "round_ray_efficiency": [[float(t.loc[n, "ray_efficiency"]) for n in sorted(worker_counts)] for t in tables],
        "round_torch_efficiency": [
            [float(t.loc[n, "torch_efficiency"]) for n in sorted(worker_counts)] for t in tables
        ],
        "round_independent_efficiency": [
            [float(t.loc[n, "independent_efficiency"]) for n in sorted(worker_counts)] for t in tables
        ],
        "round_parity": [[float(t.loc[n, "parity"]) for n in sorted(worker_counts)] for t in tables],
        "ray_cluster": "external (RAY_ADDRESS)" if external_cluster else "started here as the product does",
        "process_env": process_env,
        "ray_init": "external" if external_cluster else local_init_kwargs(),
        "ray_daemons_idle": None if external_cluster else daemons_idle_enabled(),
        "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "runs": runs,
        "goal": "parity_1 >= 0.97, parity_2 >= 0.97, efficiency_2 >= 0.90",
        "config": vars(args),
    }
    emit("scaling", result)


if __name__ == "__main__":
    main()
