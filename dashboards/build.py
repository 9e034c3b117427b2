"""Build the Grafana training dashboard with grafana-foundation-sdk and write it as committed JSON.

``python -m dashboards.build`` (re)writes ``dashboards/training.json``; ``--check`` writes nothing and exits 1
when the committed file differs from what the code builds. Queries name only series from
:mod:`training_core.telemetry.catalog` (a test holds this), filtered by the ``execution``, ``model`` and
``rank`` template variables. The JSON is deterministic: sorted keys, two-space indentation, one final newline.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builder
from grafana_foundation_sdk.builders import dashboard as dashboard_builder
from grafana_foundation_sdk.builders import prometheus as prometheus_builder
from grafana_foundation_sdk.builders import stat as stat_builder
from grafana_foundation_sdk.builders import timeseries as timeseries_builder
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, dashboard

DASHBOARD_DIR = Path(__file__).resolve().parent
TRAINING_DASHBOARD_PATH = DASHBOARD_DIR / "training.json"
TRAINING_DASHBOARD_UID = "flyte-ray-training"
REGENERATE_COMMAND = "python -m dashboards.build"

STALE_AFTER_S = 120
"""A rank whose last push is older than this counts as gone (the TrainingWorkerLost alert uses the same figure)."""

DATASOURCE = dashboard.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Job-level series (cost, world size) come from rank 0 only, so they are not filtered by rank.
JOB = 'execution=~"$execution", model=~"$model"'
RANK = JOB + ', rank=~"$rank"'
RANK_KEY = "execution, node, attempt, rank"
RUNNING = (
    f"(training_run_finished{{{JOB}}} == 0 and on({RANK_KEY}) "
    f"(time() - training_last_push_timestamp_seconds{{{JOB}}}) < {STALE_AFTER_S})"
)
"""Ranks that push and have not finished: the same condition the alerts use for "running"."""

PER_RANK = "{{execution}} r{{rank}}"
PER_GPU = "{{execution}} r{{rank}} gpu{{gpu}}"


def _query(expr: str, legend: str, ref_id: str) -> prometheus_builder.Dataquery:
    return prometheus_builder.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id).datasource(DATASOURCE)


def _targets(queries: list[tuple[str, str]]) -> list[prometheus_builder.Dataquery]:
    return [_query(expr, legend, chr(ord("A") + index)) for index, (expr, legend) in enumerate(queries)]


def _timeseries(
    title: str,
    description: str,
    unit: str,
    queries: list[tuple[str, str]],
    *,
    span: int = 8,
    min_value: float | None = None,
    max_value: float | None = None,
    stacked: bool = False,
) -> timeseries_builder.Panel:
    panel = (
        timeseries_builder.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .targets(_targets(queries))
        .span(span)
        .height(8)
        .line_width(1)
        .fill_opacity(10)
        .legend(
            common_builder.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
    )
    if stacked:
        panel = panel.stacking(common_builder.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(60)
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    return panel


def _stat(
    title: str, description: str, unit: str, queries: list[tuple[str, str]], *, span: int = 6
) -> stat_builder.Panel:
    return (
        stat_builder.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .targets(_targets(queries))
        .span(span)
        .height(4)
        .graph_mode(common.BigValueGraphMode.AREA)
        .reduce_options(common_builder.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


def _quantiles(metric: str, selector: str, by: str, legend: str) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{selector}}}[$__rate_interval])))",
            f"p{round(q * 100)} {legend}",
        )
        for q in (0.5, 0.95)
    ]


def _cluster_overview() -> list[Builder[dashboard.Panel]]:
    return [
        _stat(
            "Workers up",
            f"Ranks that pushed in the last {STALE_AFTER_S} s and whose training loop has not returned.",
            "none",
            [(f"count({RUNNING}) or vector(0)", "workers")],
        ),
        _stat(
            "GPUs in use",
            "GPUs visible through NVML to the running ranks (0 on CPU-only workers).",
            "none",
            [(f"sum(training_gpus{{{JOB}}} and on({RANK_KEY}) {RUNNING}) or vector(0)", "GPUs")],
        ),
        _stat(
            "Running jobs",
            "Flyte executions with at least one running rank.",
            "none",
            [(f"count(count by (execution) ({RUNNING})) or vector(0)", "jobs")],
        ),
        _stat(
            "World size",
            "Ranks in each running execution's process group.",
            "none",
            [(f"max by (execution) (training_world_size{{{JOB}}} and on({RANK_KEY}) {RUNNING})", "{{execution}}")],
        ),
    ]


def _gpu_metrics() -> list[Builder[dashboard.Panel]]:
    return [
        _timeseries(
            "GPU utilisation",
            "Compute utilisation per GPU over NVML's sample period.",
            "percentunit",
            [(f"training_gpu_utilization_ratio{{{RANK}}}", PER_GPU)],
            min_value=0,
            max_value=1,
        ),
        _timeseries(
            "GPU memory used vs total",
            "Memory in use per GPU against the memory installed.",
            "bytes",
            [
                (f"training_gpu_memory_used_bytes{{{RANK}}}", "used " + PER_GPU),
                (f"training_gpu_memory_total_bytes{{{RANK}}}", "total " + PER_GPU),
            ],
            min_value=0,
        ),
        _timeseries(
            "GPU temperature",
            "Core temperature per GPU; the TrainingGpuTemperatureHigh alert fires above 85 °C.",
            "celsius",
            [(f"training_gpu_temperature_celsius{{{RANK}}}", PER_GPU)],
        ),
        _timeseries(
            "GPU power", "Power draw per GPU.", "watt", [(f"training_gpu_power_watts{{{RANK}}}", PER_GPU)], min_value=0
        ),
        _timeseries(
            "GPU clock throttling",
            "1 while NVML reports a clock-throttle reason active, per GPU and reason.",
            "bool_on_off",
            [(f"training_gpu_throttled{{{RANK}}} == 1", PER_GPU + " {{reason}}")],
        ),
        _timeseries(
            "GPU XID errors",
            "Critical XID errors NVML reported per GPU in each interval.",
            "short",
            [(f"increase(training_gpu_xid_errors_total{{{RANK}}}[$__rate_interval])", PER_GPU)],
            min_value=0,
        ),
    ]


def _training_progress() -> list[Builder[dashboard.Panel]]:
    return [
        _timeseries(
            "Loss",
            "Mean loss of the last log window (train) and of the last validation (val).",
            "none",
            [(f"training_loss{{{RANK}}}", "{{split}} " + PER_RANK)],
            span=6,
        ),
        _timeseries(
            "Accuracy",
            "Top-1 accuracy of the last log window (train) and of the last validation (val).",
            "percentunit",
            [(f"training_accuracy{{{RANK}}}", "{{split}} " + PER_RANK)],
            span=6,
            min_value=0,
            max_value=1,
        ),
        _timeseries(
            "Throughput",
            "Global samples/s each run reports, and the samples/s each rank processed.",
            "suffix: samples/s",
            [
                (f"max by (execution, attempt) (training_samples_per_second{{{JOB}}})", "global {{execution}}"),
                (f"rate(training_samples_total{{{RANK}}}[$__rate_interval])", PER_RANK),
            ],
            span=6,
            min_value=0,
        ),
        _timeseries(
            "Token throughput",
            "Language models: global tokens/s each run reports, and the tokens/s each rank processed (0 for "
            "workloads without tokens).",
            "suffix: tokens/s",
            [
                (f"max by (execution, attempt) (training_tokens_per_second{{{JOB}}})", "global {{execution}}"),
                (f"rate(training_tokens_total{{{RANK}}}[$__rate_interval])", PER_RANK),
            ],
            span=6,
            min_value=0,
        ),
        _timeseries(
            "Learning rate",
            "Learning rate of the last optimizer step.",
            "sci",
            [(f"max by (execution, attempt) (training_learning_rate{{{JOB}}})", "{{execution}}")],
            span=6,
            min_value=0,
        ),
        _timeseries(
            "Gradient norm",
            "Global gradient L2 norm of the last step, before clipping.",
            "none",
            [(f"training_grad_norm{{{RANK}}}", PER_RANK)],
            span=6,
            min_value=0,
        ),
        _timeseries(
            "Non-finite steps",
            "Optimizer steps with a NaN or infinite loss or gradient norm, cumulative per run (every rank counts the "
            "same steps): skipped under loop.nonfinite_policy=skip_step, the end of the run under stop. The "
            "TrainingNonFiniteSteps alert fires on any.",
            "short",
            [(f"max by (execution, attempt) (training_nonfinite_steps_total{{{JOB}}})", "{{execution}}")],
            span=6,
            min_value=0,
        ),
        _timeseries(
            "Epoch and global step",
            "Current epoch (0-based) and optimizer steps taken by the run.",
            "none",
            [
                (f"max by (execution, attempt) (training_epoch{{{JOB}}})", "epoch {{execution}}"),
                (f"max by (execution, attempt) (training_global_step{{{JOB}}})", "step {{execution}}"),
            ],
            span=6,
            min_value=0,
        ),
    ]


def _communication_and_data_wait() -> list[Builder[dashboard.Panel]]:
    return [
        _timeseries(
            "Communication share of step time",
            "Share of step time in gradient all-reduce; the TrainingCommunicationHigh alert fires above 50 %.",
            "percentunit",
            [(f"training_communication_ratio{{{RANK}}}", PER_RANK)],
            span=12,
            min_value=0,
            max_value=1,
        ),
        _timeseries(
            "Data wait share of step time",
            "Share of step time spent waiting for input batches.",
            "percentunit",
            [(f"training_data_wait_ratio{{{RANK}}}", PER_RANK)],
            span=12,
            min_value=0,
            max_value=1,
        ),
        _timeseries(
            "All-reduce and data wait seconds per second",
            "Rate of the seconds counters: the share of wall time each rank spent in all-reduce or waiting for data.",
            "percentunit",
            [
                (f"rate(training_communication_seconds_total{{{RANK}}}[$__rate_interval])", "all-reduce " + PER_RANK),
                (f"rate(training_data_wait_seconds_total{{{RANK}}}[$__rate_interval])", "data wait " + PER_RANK),
            ],
            span=12,
            min_value=0,
        ),
        _timeseries(
            "Step duration p50 / p95",
            "Quantiles of the optimizer step duration histogram, per rank.",
            "s",
            _quantiles("training_step_duration_seconds", RANK, "execution, rank", PER_RANK),
            span=12,
            min_value=0,
        ),
        _timeseries(
            "All-reduce check at job start",
            "Bus bandwidth of a fixed all-reduce measured on the workers when the job (or its restart) starts, slowest "
            "rank; far below the fabric's speed means a wrong interface or NCCL's fallback to TCP sockets "
            "(see scaling.min_allreduce_gbps).",
            "Bps",
            [
                (
                    f"max by (execution) (training_allreduce_bus_bandwidth_bytes_per_second{{{JOB}}})",
                    "bus bandwidth {{execution}}",
                )
            ],
            span=24,
            min_value=0,
        ),
    ]


def _checkpoints_health_cost() -> list[Builder[dashboard.Panel]]:
    return [
        _stat(
            "Job cost",
            "Cost so far: GPU-hours and CPU-hours times the configured prices, all attempts.",
            "currencyUSD",
            [(f"max by (execution) (training_job_cost_usd{{{JOB}}})", "{{execution}}")],
            span=8,
        ),
        _stat(
            "GPU-hours",
            "GPU-hours the job's workers held, all attempts, and those lost to preemptions (start-up after each).",
            "h",
            [
                (f"max by (execution) (training_job_gpu_seconds_total{{{JOB}}}) / 3600", "{{execution}}"),
                (
                    f"max by (execution) (training_job_preemption_gpu_seconds_total{{{JOB}}}) / 3600",
                    "{{execution}} lost to preemptions",
                ),
            ],
            span=8,
        ),
        _stat(
            "CPU-hours",
            "CPU-hours the job's workers held, all attempts, and those lost to preemptions (start-up after each).",
            "h",
            [
                (f"max by (execution) (training_job_cpu_seconds_total{{{JOB}}}) / 3600", "{{execution}}"),
                (
                    f"max by (execution) (training_job_preemption_cpu_seconds_total{{{JOB}}}) / 3600",
                    "{{execution}} lost to preemptions",
                ),
            ],
            span=8,
        ),
        _timeseries(
            "Checkpoint save duration p50 / p95",
            "Time to stage and write one checkpoint.",
            "s",
            _quantiles("training_checkpoint_save_duration_seconds", JOB, "execution", "{{execution}}"),
            min_value=0,
        ),
        _timeseries(
            "Checkpoint saves and failures",
            "Checkpoints written and writes that failed, cumulative per run.",
            "short",
            [
                (f"training_checkpoint_saves_total{{{JOB}}}", "saved " + PER_RANK),
                (f"training_checkpoint_save_failures_total{{{JOB}}}", "failed " + PER_RANK),
            ],
            min_value=0,
        ),
        _timeseries(
            "Checkpoint bytes written",
            "Rate at which checkpoint bytes are written.",
            "binBps",
            [(f"rate(training_checkpoint_written_bytes_total{{{JOB}}}[$__rate_interval])", PER_RANK)],
            min_value=0,
        ),
        _timeseries(
            "Worker restarts, preemptions and GPU OOMs",
            "Resumes after a worker-group restart (preemptions: those after a just-in-time checkpoint, no step lost), "
            "and CUDA out-of-memory errors.",
            "short",
            [
                (f"max by (execution, attempt) (training_worker_restarts_total{{{JOB}}})", "restarts {{execution}}"),
                (f"max by (execution, attempt) (training_preemptions_total{{{JOB}}})", "preemptions {{execution}}"),
                (f"sum by (execution, attempt) (training_gpu_oom_total{{{JOB}}})", "GPU OOMs {{execution}}"),
            ],
            min_value=0,
        ),
        _timeseries(
            "Host CPU",
            "Host CPU utilisation seen by each rank.",
            "percentunit",
            [(f"training_host_cpu_utilization_ratio{{{RANK}}}", PER_RANK)],
            min_value=0,
            max_value=1,
        ),
        _timeseries(
            "Host memory used vs total",
            "Host memory in use against the memory installed.",
            "bytes",
            [
                (f"training_host_memory_used_bytes{{{RANK}}}", "used " + PER_RANK),
                (f"training_host_memory_total_bytes{{{RANK}}}", "total " + PER_RANK),
            ],
            min_value=0,
        ),
        _timeseries(
            "Host network",
            "Bytes received and sent per second on all host interfaces.",
            "binBps",
            [
                (f"rate(training_host_network_received_bytes_total{{{RANK}}}[$__rate_interval])", "rx " + PER_RANK),
                (f"rate(training_host_network_transmitted_bytes_total{{{RANK}}}[$__rate_interval])", "tx " + PER_RANK),
            ],
            span=12,
            min_value=0,
        ),
        _timeseries(
            "Host disk",
            "Bytes read from and written to host disks per second.",
            "binBps",
            [
                (f"rate(training_host_disk_read_bytes_total{{{RANK}}}[$__rate_interval])", "read " + PER_RANK),
                (f"rate(training_host_disk_written_bytes_total{{{RANK}}}[$__rate_interval])", "write " + PER_RANK),
            ],
            span=12,
            min_value=0,
        ),
    ]


def _goodput_stragglers_progress() -> list[Builder[dashboard.Panel]]:
    return [
        _timeseries(
            "Worker-hours by category",
            "Where the job's worker-hours went, all workers and attempts, stacked: productive steps, data wait, "
            "communication not hidden behind compute, checkpoint stalls, evaluation, start-up, steps recomputed after "
            "a failure, preemption, hung, idle at the end. The stack's height is workers x wall time.",
            "h",
            [
                (
                    f"max by (execution, category) (training_job_goodput_seconds_total{{{JOB}}}) / 3600",
                    "{{category}} {{execution}}",
                )
            ],
            span=12,
            min_value=0,
            stacked=True,
        ),
        _timeseries(
            "Goodput ratio",
            "Productive worker-seconds over all of them, for the whole execution so far (all attempts).",
            "percentunit",
            [(f"max by (execution) (training_goodput_ratio{{{JOB}}})", "{{execution}}")],
            span=12,
            min_value=0,
            max_value=1,
        ),
        _timeseries(
            "Straggling ranks",
            "1 while a rank's compute and data wait stay above the other ranks' median by "
            "observability.straggler_threshold (the TrainingStraggler alert), per rank and cause (compute or data).",
            "bool_on_off",
            [(f"training_straggler{{{RANK}}}", PER_RANK + " {{cause}}")],
            span=12,
        ),
        _timeseries(
            "Time to the end of the run",
            "ETA to the run's last step: the recent step rate plus the validation and checkpoint time per step "
            "measured so far.",
            "s",
            [(f"max by (execution) (training_eta_seconds{{{JOB}}} and on({RANK_KEY}) {RUNNING})", "{{execution}}")],
            span=12,
            min_value=0,
        ),
    ]


ROWS: tuple[tuple[str, Callable[[], list[Builder[dashboard.Panel]]]], ...] = (
    ("Cluster overview", _cluster_overview),
    ("GPU metrics per GPU", _gpu_metrics),
    ("Training progress", _training_progress),
    ("Communication and data wait", _communication_and_data_wait),
    ("Checkpoints, system health and cost", _checkpoints_health_cost),
    ("Goodput, stragglers and progress", _goodput_stragglers_progress),
)
"""Row titles in dashboard order, each with the function that builds its panels."""


def _label_variable(name: str, label: str, query: str) -> dashboard_builder.QueryVariable:
    return (
        dashboard_builder.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(dashboard.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard.VariableSort.NATURAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def build_training_dashboard() -> dashboard.Dashboard:
    """The training dashboard: a Prometheus datasource variable, execution/model/rank variables, six rows."""
    board = (
        dashboard_builder.Dashboard("Flyte + Ray training")
        .uid(TRAINING_DASHBOARD_UID)
        .description("Per-job training, GPU, host and cost metrics pushed by the training ranks.")
        .tags(["flyte", "ray", "training"])
        .editable()
        .time("now-6h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(dashboard.DashboardCursorSync.CROSSHAIR)
        .with_variable(dashboard_builder.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(_label_variable("execution", "Execution", "label_values(training_world_size, execution)"))
        .with_variable(
            _label_variable("model", "Model", 'label_values(training_world_size{execution=~"$execution"}, model)')
        )
        .with_variable(_label_variable("rank", "Rank", f"label_values(training_steps_total{{{JOB}}}, rank)"))
    )
    panel_id = 0
    for title, panels in ROWS:
        panel_id += 1
        board = board.with_row(dashboard_builder.Row(title).id(panel_id))
        for panel in panels():
            panel_id += 1
            board = board.with_panel(panel.id(panel_id))
    return board.build()


def render(board: dashboard.Dashboard) -> str:
    """The committed form: sorted keys, two-space indentation, a final newline."""
    return json.dumps(board, cls=JSONEncoder, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def rendered_dashboards() -> dict[Path, str]:
    """Every dashboard this module writes, by path."""
    return {TRAINING_DASHBOARD_PATH: render(build_training_dashboard())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE_COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a committed file is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, text in rendered_dashboards().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(path)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(str(p) for p in stale)}; run `{REGENERATE_COMMAND}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
