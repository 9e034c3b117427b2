"""Prometheus telemetry of one training worker (see :mod:`training_core.telemetry.exporter`) and the catalogue of
its metrics (:mod:`training_core.telemetry.catalog`)."""

from training_core.telemetry.exporter import (
    GpuReading,
    HostReading,
    HostSampler,
    JobLabels,
    NullTelemetry,
    NvmlGpus,
    PrometheusTelemetry,
    Telemetry,
    Timeline,
    build_telemetry,
    job_cost,
    mlflow_system_metrics,
)

__all__ = [
    "GpuReading",
    "HostReading",
    "HostSampler",
    "JobLabels",
    "NullTelemetry",
    "NvmlGpus",
    "PrometheusTelemetry",
    "Telemetry",
    "Timeline",
    "build_telemetry",
    "job_cost",
    "mlflow_system_metrics",
]
