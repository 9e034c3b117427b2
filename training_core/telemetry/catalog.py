"""Every Prometheus series the training code exports: one table, read by the exporter, the dashboards and the tests.

The exporter (:mod:`training_core.telemetry.exporter`) creates exactly these metrics, the dashboards and alert rules in
``dashboards/`` may name only these (a test checks every PromQL expression against :func:`series_names`), and
the integration test queries them from a real Prometheus. Names follow Prometheus conventions: base units
(``_seconds``, ``_bytes``, ``_ratio``, ``_celsius``, ``_watts``) and ``_total`` on counters.

Every series carries :data:`JOB_LABELS` (which Flyte execution, node and attempt, which rank, which model);
``extra_labels`` are added on top (a GPU index, a split, a throttle reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from training_core.telemetry.goodput import CATEGORIES as GOODPUT_CATEGORIES
from training_core.telemetry.stragglers import CAUSES as STRAGGLER_CAUSES

JOB_LABELS: tuple[str, ...] = ("execution", "node", "attempt", "rank", "model")
"""Labels on every series: Flyte execution name, node id, retry attempt, Ray Train world rank, model name."""

PUSHGATEWAY_JOB = "flyte_ray_training"
"""The Pushgateway ``job`` label; the grouping key adds ``execution``, ``node``, ``attempt`` and ``rank``."""

# Step durations from sub-millisecond (tiny CPU models) to a minute (large GPU steps).
STEP_DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CHECKPOINT_DURATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    """The metric name as exported. Counters include the ``_total`` suffix."""
    kind: Kind
    help: str
    extra_labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    """Histogram bucket upper bounds (histograms only)."""
    label_values: tuple[str, ...] = ()
    """The values of the one extra label, when known in advance: the exporter creates each series (at 0) from the
    start, so a stacked panel or a ratio never misses one."""

    @property
    def series(self) -> tuple[str, ...]:
        """The sample names this metric produces in the exposition format."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


METRICS: tuple[MetricSpec, ...] = (
    # --- training progress (the loop) ---
    MetricSpec(
        "training_step_duration_seconds",
        "histogram",
        "Wall time of one optimizer step, from the previous step's end.",
        buckets=STEP_DURATION_BUCKETS_S,
    ),
    MetricSpec(
        "training_steps_total",
        "counter",
        "Optimizer steps taken by this rank in this job (resumed runs continue the count).",
    ),
    MetricSpec("training_samples_total", "counter", "Training samples processed by this rank."),
    MetricSpec(
        "training_samples_per_second", "gauge", "Global training throughput over the last log window (all ranks)."
    ),
    MetricSpec("training_tokens_total", "counter", "Training tokens processed by this rank (language models; else 0)."),
    MetricSpec(
        "training_tokens_per_second",
        "gauge",
        "Global training tokens/s over the last log window, all ranks (language models; else 0).",
    ),
    MetricSpec(
        "training_loss",
        "gauge",
        "Mean loss: the last log window (split=train) or the last validation (split=val).",
        ("split",),
    ),
    MetricSpec(
        "training_accuracy",
        "gauge",
        "Top-1 accuracy as a ratio: the last log window (split=train) or validation (split=val).",
        ("split",),
    ),
    MetricSpec("training_learning_rate", "gauge", "Learning rate of the last optimizer step."),
    MetricSpec("training_grad_norm", "gauge", "Global gradient L2 norm of the last optimizer step, before clipping."),
    MetricSpec("training_data_wait_seconds_total", "counter", "Seconds this rank waited for input batches."),
    MetricSpec(
        "training_communication_seconds_total",
        "counter",
        "Seconds DDP gradient all-reduces were in flight on this rank.",
    ),
    MetricSpec(
        "training_communication_ratio",
        "gauge",
        "Share of step time spent in gradient all-reduce over the last log window.",
    ),
    MetricSpec(
        "training_data_wait_ratio", "gauge", "Share of step time spent waiting for input over the last log window."
    ),
    MetricSpec("training_epoch", "gauge", "Current epoch (0-based) of the run."),
    MetricSpec("training_global_step", "gauge", "Optimizer steps taken by the run so far, across restarts."),
    MetricSpec(
        "training_last_step_timestamp_seconds",
        "gauge",
        "Unix time of this rank's last logged step; its start time until the first, so a hang before any step still "
        "shows.",
    ),
    MetricSpec(
        "training_last_push_timestamp_seconds",
        "gauge",
        "Unix time of this rank's latest push or scrape; stale while the rank is gone.",
    ),
    MetricSpec("training_run_finished", "gauge", "1 once this rank's training loop has returned, else 0."),
    MetricSpec(
        "training_worker_restarts_total",
        "counter",
        "Times the run resumed from a checkpoint after its workers restarted.",
    ),
    MetricSpec(
        "training_preemptions_total",
        "counter",
        "Of those resumes, the ones after a worker was told to stop (SIGTERM: eviction, spot reclaim) and saved a "
        "just-in-time checkpoint, so no step was lost; the rest followed failures.",
    ),
    MetricSpec(
        "training_nonfinite_steps_total",
        "counter",
        "Optimizer steps whose loss or gradient norm was NaN or infinite on any rank (skipped, or the one that stopped "
        "the run); every rank counts the same steps.",
    ),
    MetricSpec("training_gpu_oom_total", "counter", "CUDA out-of-memory errors raised in this rank's training step."),
    MetricSpec(
        "training_oom_retries_total",
        "counter",
        "Of those, the steps retried with half the micro-batch (loop.oom_policy=reduce) instead of stopping the run.",
    ),
    MetricSpec(
        "training_allreduce_bus_bandwidth_bytes_per_second",
        "gauge",
        "Bus bandwidth of the all-reduce check at the start of the run (or its latest restart), slowest rank: "
        "2 (n - 1) / n times the buffer over the time.",
    ),
    MetricSpec(
        "training_allreduce_latency_seconds",
        "gauge",
        "Time of a one-element all-reduce in the check at the start of the run (or its latest restart).",
    ),
    MetricSpec("training_world_size", "gauge", "Number of ranks in the process group."),
    # --- checkpoints (rank 0 writes) ---
    MetricSpec(
        "training_checkpoint_save_duration_seconds",
        "histogram",
        "Time to stage and write one checkpoint.",
        buckets=CHECKPOINT_DURATION_BUCKETS_S,
    ),
    MetricSpec("training_checkpoint_saves_total", "counter", "Checkpoints written successfully."),
    MetricSpec("training_checkpoint_save_failures_total", "counter", "Checkpoint writes that failed."),
    MetricSpec("training_checkpoint_written_bytes_total", "counter", "Bytes of checkpoints written."),
    # --- GPUs (NVML; absent on a machine without a GPU) ---
    MetricSpec("training_gpus", "gauge", "GPUs this rank can see through NVML (0 without a GPU)."),
    MetricSpec(
        "training_gpu_utilization_ratio", "gauge", "GPU compute utilisation over NVML's sample period, 0-1.", ("gpu",)
    ),
    MetricSpec("training_gpu_memory_used_bytes", "gauge", "GPU memory in use.", ("gpu",)),
    MetricSpec("training_gpu_memory_total_bytes", "gauge", "GPU memory installed.", ("gpu",)),
    MetricSpec("training_gpu_temperature_celsius", "gauge", "GPU core temperature.", ("gpu",)),
    MetricSpec("training_gpu_power_watts", "gauge", "GPU power draw.", ("gpu",)),
    MetricSpec(
        "training_gpu_throttled",
        "gauge",
        "1 while NVML reports the clock-throttle reason active, else 0.",
        ("gpu", "reason"),
    ),
    MetricSpec("training_gpu_xid_errors_total", "counter", "Critical XID errors NVML reported for the GPU.", ("gpu",)),
    # --- host (psutil) ---
    MetricSpec(
        "training_host_cpu_utilization_ratio", "gauge", "Host CPU utilisation over the last sample period, 0-1."
    ),
    MetricSpec("training_host_memory_used_bytes", "gauge", "Host memory in use."),
    MetricSpec("training_host_memory_total_bytes", "gauge", "Host memory installed."),
    MetricSpec(
        "training_host_network_received_bytes_total",
        "counter",
        "Bytes received on all host interfaces since this rank started.",
    ),
    MetricSpec(
        "training_host_network_transmitted_bytes_total",
        "counter",
        "Bytes sent on all host interfaces since this rank started.",
    ),
    MetricSpec("training_host_disk_read_bytes_total", "counter", "Bytes read from host disks since this rank started."),
    MetricSpec(
        "training_host_disk_written_bytes_total", "counter", "Bytes written to host disks since this rank started."
    ),
    # --- cost (rank 0, for the whole job: all workers, all attempts) ---
    MetricSpec(
        "training_job_gpu_seconds_total",
        "counter",
        "GPU-seconds the job's workers held (GPUs x wall time), all attempts.",
    ),
    MetricSpec(
        "training_job_cpu_seconds_total",
        "counter",
        "CPU-seconds the job's workers held (CPUs x wall time), all attempts.",
    ),
    MetricSpec(
        "training_job_preemption_gpu_seconds_total",
        "counter",
        "Of the job's GPU-seconds, those lost to preemptions: held from each resumed attempt's start to its first "
        "step after a preemption checkpoint.",
    ),
    MetricSpec(
        "training_job_preemption_cpu_seconds_total",
        "counter",
        "Of the job's CPU-seconds, those lost to preemptions (as the GPU-seconds).",
    ),
    MetricSpec(
        "training_job_cost_usd", "gauge", "Cost of the job so far: GPU-hours and CPU-hours times the configured prices."
    ),
    # --- goodput, stragglers, progress (training_core.telemetry.goodput, .stragglers, .eta) ---
    MetricSpec(
        "training_job_goodput_seconds_total",
        "counter",
        "Worker-seconds of the job (all workers, all attempts) by what they went to: productive steps, data wait, "
        "communication not hidden behind compute, checkpoint stalls, evaluation, start-up, steps recomputed after a "
        "failure, preemption, hung, idle at the end. The categories add up to workers x wall time (rank 0).",
        ("category",),
        label_values=GOODPUT_CATEGORIES,
    ),
    MetricSpec(
        "training_goodput_ratio",
        "gauge",
        "Productive worker-seconds over all of them, for the whole execution so far, all attempts (rank 0).",
    ),
    MetricSpec(
        "training_straggler",
        "gauge",
        "1 while this rank is flagged as a straggler for the cause (compute or data), else 0: its compute and data "
        "wait above the other ranks' median by observability.straggler_threshold for "
        "observability.straggler_windows log windows.",
        ("cause",),
        label_values=STRAGGLER_CAUSES,
    ),
    MetricSpec(
        "training_eta_seconds",
        "gauge",
        "Seconds until the run's last step: the recent step rate, plus the validation and checkpoint time per step "
        "measured so far.",
    ),
    MetricSpec(
        "training_eta_checkpoint_seconds",
        "gauge",
        "Seconds until the next checkpoint's step, at the rate of training_eta_seconds; NaN when none is due.",
    ),
    MetricSpec("training_total_steps", "gauge", "Optimizer steps the whole run takes (its last global step)."),
    MetricSpec(
        "training_steps_per_second",
        "gauge",
        "Optimizer steps per second of step time over the recent log windows (validation and checkpoints excluded).",
    ),
)


def series_names() -> frozenset[str]:
    """Every sample name the exporter can produce (histograms expand to ``_bucket``/``_sum``/``_count``)."""
    return frozenset(name for spec in METRICS for name in spec.series)
