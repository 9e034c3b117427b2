"""Scaling benchmark tasks: the plain ``torch.distributed`` baseline and the report.

The Ray side of each point is the pipeline's own ``train`` task (see ``workflows/scaling_benchmark.py``); the baseline
runs the same loop on the same config and data, started by ``training_core.runners.launch`` instead of Ray Train.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from flytekit import FlyteContextManager, Resources, current_context, task
from flytekit.types.file import FlyteFile
from flytekit.types.structured import StructuredDataset

from tasks import reports
from tasks.artifacts import DECK_FIELDS, artifact_location, publish_report
from tasks.train import TRAIN_TIMEOUT
from tasks.types import PreparedData, TrainMetrics
from training_core.config import ScalingConfig, TrainingConfig
from training_core.redact import redact


@dataclass
class ScalingReport:
    """Output of ``scaling_report``: one row per model and worker count, as a table, a CSV file and a page."""

    table: StructuredDataset
    """The rows as a DataFrame: ``model``, ``num_workers``; per launcher (``ray_``, ``torch_``) ``samples_per_s``
    (steady state, all workers), ``efficiency`` (against the smallest worker count), ``step_time_p50_s``,
    ``step_time_p95_s`` and ``allreduce_fraction``; and ``parity`` (Ray throughput over plain torch's)."""
    csv: FlyteFile
    """The same table as CSV."""
    report: FlyteFile
    """The Deck (table, throughput and efficiency plots) as a standalone HTML page."""


def baseline_resources(scaling: ScalingConfig) -> Resources:
    """What the baseline's pod needs: every worker's share at once, since all ranks run in that one pod."""
    n = scaling.num_workers
    gpu = str(n * scaling.gpus_per_worker) if scaling.use_gpu else None
    return Resources(
        cpu=f"{n * scaling.cpus_per_worker:g}", mem=f"{int(n * scaling.memory_per_worker_gib * 1024)}Mi", gpu=gpu
    )


@task(
    retries=1,
    # A preempted measurement is simply taken again; it may run as long as the Ray run it is compared with.
    interruptible=True,
    timeout=TRAIN_TIMEOUT,
    # One worker's share; the benchmark workflow overrides requests and limits per node with ``baseline_resources``.
    requests=baseline_resources(ScalingConfig(num_workers=1)),
    limits=baseline_resources(ScalingConfig(num_workers=1)),
)
def torch_baseline(config: TrainingConfig, data: PreparedData) -> TrainMetrics:
    """Run the training loop with plain ``torch.distributed`` (no Ray) on ``config.scaling.num_workers``
    processes in this pod: the parity baseline of a Ray Train run with the same config.

    :param config: The run's config, as the matching ``train`` node gets it; ``scaling.num_workers`` sets how
        many processes are spawned, ``scaling.resolved_backend()`` the collective backend.
    :param data: Prepared shards from ``prepare_data``; each rank streams only its own shards.
    :return: Last-epoch figures: steady-state throughput, step-time p50/p95 and the all-reduce share.
    """
    from training_core.runners.launch import launch

    workdir = current_context().working_directory
    result = launch(
        config,
        data_dir=artifact_location(data.directory),
        checkpoint_dir=os.path.join(workdir, "final_checkpoint"),
        run_name="torch-baseline",
        storage_path=os.path.join(workdir, "runs"),
    )
    return TrainMetrics.from_record(
        epochs=result.meta.epoch, global_step=result.meta.global_step, record=result.metrics
    )


@task(
    retries=1,
    interruptible=True,
    timeout=timedelta(minutes=30),
    requests=Resources(cpu="500m", mem="1Gi"),
    limits=Resources(cpu="1", mem="2Gi"),
    enable_deck=True,
    deck_fields=DECK_FIELDS,
)
def scaling_report(
    models: list[str], worker_counts: list[int], ray_runs: list[TrainMetrics], torch_runs: list[TrainMetrics]
) -> ScalingReport:
    """Tabulate scaling efficiency and Ray-vs-plain parity, and publish the table, plots and CSV.

    :param models: Model of each measured point; the four lists are parallel, one entry per point.
    :param worker_counts: Worker count of each measured point, parallel to ``models``.
    :param ray_runs: Figures of each point's Ray Train run (the ``train`` task), parallel to ``models``.
    :param torch_runs: Figures of each point's plain ``torch.distributed`` run, parallel to ``models``.
    :return: The table as a DataFrame and as CSV, and the report page.
    """
    from training_core.scaling_benchmark import ScalingPoint, efficiency_table

    lengths = {
        "models": len(models),
        "worker_counts": len(worker_counts),
        "ray_runs": len(ray_runs),
        "torch_runs": len(torch_runs),
    }
    if len(set(lengths.values())) != 1:
        raise ValueError(
            f"scaling_report inputs are invalid: lengths {lengths} differ; pass one entry per point in each list"
        )
    points = [
        ScalingPoint(
            model=model,
            num_workers=n,
            launcher=launcher,
            samples_per_s=m.samples_per_s,
            step_time_p50_s=m.step_time_p50_s,
            step_time_p95_s=m.step_time_p95_s,
            allreduce_fraction=m.allreduce_fraction,
        )
        for model, n, ray_metrics, torch_metrics in zip(models, worker_counts, ray_runs, torch_runs)
        for launcher, m in (("ray", ray_metrics), ("torch", torch_metrics))
    ]
    table = efficiency_table(points)
    csv_path = os.path.join(current_context().working_directory, "scaling.csv")
    table.to_csv(csv_path, index=False)
    file_access = FlyteContextManager.current_context().file_access
    csv = FlyteFile(csv_path, remote_path=file_access.get_random_remote_path("scaling.csv"))
    report = publish_report("Scaling report", reports.scaling_sections(table))
    _print_summary(table, csv=csv, report=report)
    return ScalingReport(table=StructuredDataset(dataframe=table), csv=csv, report=report)


def _print_summary(table, *, csv: FlyteFile, report: FlyteFile) -> None:
    """pyflyte prints outputs as literals; a person wants the table and where the files are."""
    lines = [
        "",
        "=== scaling benchmark finished ===",
        f"{'model':<12}{'workers':>8}{'ray samples/s':>15}{'ray eff':>9}"
        f"{'torch samples/s':>17}{'torch eff':>11}{'parity':>8}{'all-reduce':>12}",
    ]
    for row in table.itertuples(index=False):
        lines.append(
            f"{row.model:<12}{row.num_workers:>8}{row.ray_samples_per_s:>15.1f}{row.ray_efficiency:>9.3f}"
            f"{row.torch_samples_per_s:>17.1f}{row.torch_efficiency:>11.3f}{row.parity:>8.3f}{row.ray_allreduce_fraction:>12.3f}"
        )
    lines += [f"scaling table    : {csv.remote_path}", f"scaling report   : {report.remote_path}", ""]
    print(redact("\n".join(lines)), flush=True)
