"""``scaling_benchmark``: one Ray Train run and one plain ``torch.distributed`` run per model and worker count,
then a report of scaling efficiency and Ray-vs-plain parity."""

from __future__ import annotations

from flytekit import dynamic

from tasks.data import prepare
from tasks.ray_config import ray_job_config
from tasks.scaling_benchmark import ScalingReport, baseline_resources, scaling_report, torch_baseline
from tasks.train import train
from tasks.types import PreparedData, TrainMetrics
from training_core.config import TrainingConfig
from training_core.scaling_benchmark import DEFAULT_WORKER_COUNTS, check_plan, point_config, point_name, scaling_preset


# A dynamic node only compiles its graph; its sub-nodes carry their own timeouts. Interruptible here is also the
# default of those sub-nodes.
@dynamic(interruptible=True)
def ray_point(config: TrainingConfig, data: PreparedData) -> TrainMetrics:
    """One Ray Train point: the ``train`` task on a RayJob with ``config.scaling.num_workers`` worker replicas.

    flytekit applies a ``task_config`` override to the task object itself, not to the node, so several
    overrides of ``train`` in one dynamic workflow would all serialize as the last one's RayJob. Each point is
    its own dynamic workflow, compiled in its own pod, and so gets its own RayJob shape.

    :param config: The point's config; ``scaling`` sizes the RayJob (worker replicas, requests and limits).
    :param data: Prepared shards from ``prepare_data``, shared by every point.
    :return: Last-epoch figures of the run: steady-state throughput, step-time p50/p95, all-reduce share.
    """
    trained = train(config=config, data=data).with_overrides(
        task_config=ray_job_config(config.scaling),
        name=point_name("train", model=config.model.name, num_workers=config.scaling.num_workers),
    )
    return trained.metrics


@dynamic(interruptible=True)
def scaling_benchmark(
    config: TrainingConfig = scaling_preset(),
    worker_counts: list[int] = list(DEFAULT_WORKER_COUNTS),
    models: list[str] = [],
) -> ScalingReport:
    """Measure how training throughput scales with workers, under Ray Train and under plain torch.distributed.

    :param config: The run every point trains (``scaling.num_workers`` and ``model.name`` are set per point).
        Defaults: a compute-bound small CNN on 32x32 synthetic images, 40 steps, one CPU and one thread per
        worker, 8 shards; ``data.num_shards`` must be a multiple of every worker count.
    :param worker_counts: Worker counts to measure, e.g. [1, 2, 4, 8]; efficiency is relative to the smallest.
    :param models: Models to measure (small_cnn, resnet18, ...); empty measures ``config.model.name`` only.
    :return: One row per model and worker count (throughput, efficiency, step time p50/p95, all-reduce share,
        parity) as a DataFrame and CSV, and the report page with throughput and efficiency plots.
    """
    planned_models = check_plan(config, worker_counts, models)
    data = prepare(config=config.data, workload=config.workload)
    point_models, point_counts, ray_runs, torch_runs = [], [], [], []
    previous = None
    for model in planned_models:
        for num_workers in worker_counts:
            point = point_config(config, model=model, num_workers=num_workers)
            ray_metrics = ray_point(config=point, data=data).with_overrides(
                name=point_name("ray", model=model, num_workers=num_workers)
            )
            resources = baseline_resources(point.scaling)
            torch_metrics = torch_baseline(config=point, data=data).with_overrides(
                name=point_name("torch", model=model, num_workers=num_workers), requests=resources, limits=resources
            )
            # One point at a time: runs sharing machines would measure each other.
            if previous is not None:
                previous >> ray_metrics
            ray_metrics >> torch_metrics
            previous = torch_metrics
            point_models.append(model)
            point_counts.append(num_workers)
            ray_runs.append(ray_metrics)
            torch_runs.append(torch_metrics)
    return scaling_report(models=point_models, worker_counts=point_counts, ray_runs=ray_runs, torch_runs=torch_runs)
