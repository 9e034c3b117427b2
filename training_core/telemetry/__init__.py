"""Prometheus telemetry of one training worker: the catalogue's metrics, GPU and host samplers, delivery, cost.

MLflow's own ``SystemMetricsMonitor`` is not reused: it samples on a thread of its own (its numbers would
differ from what Prometheus gets), logs through the fluent API's active run, which Ray Train workers do not
have, and knows no throttling, XID or disk I/O. Here one sample feeds both, under MLflow's metric names.

Each module's docstring states its part of the contract, :mod:`~training_core.telemetry.exporter` the whole's
(README.md's module map lists them).

Importing this package is light: prometheus_client, pynvml and psutil are imported where they are used.
"""

from training_core.telemetry.cost import job_cost
from training_core.telemetry.exporter import JobLabels, NullTelemetry, PrometheusTelemetry, Telemetry, build_telemetry
from training_core.telemetry.gpu import GpuReading, NvmlGpus
from training_core.telemetry.host import HostReading, HostSampler
from training_core.telemetry.mlflow_system import mlflow_system_metrics
from training_core.telemetry.timeline import Timeline

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
