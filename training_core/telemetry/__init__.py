"""Prometheus telemetry of one training worker: the catalogue's metrics, GPU and host samplers, delivery, cost.

Every rank builds one :class:`PrometheusTelemetry` (or a :class:`NullTelemetry` when
``observability.enabled`` is false) with :func:`build_telemetry`; the loop and the
:class:`~training_core.checkpoint.Checkpointer` report into it, and its thread samples the GPUs and the host and
pushes to the Pushgateway (the contract: :mod:`training_core.telemetry.exporter`). Delivery never fails training.

MLflow's own ``SystemMetricsMonitor`` is not reused: it samples on a thread of its own (its numbers would
differ from what Prometheus gets), logs through the fluent API's active run, which Ray Train workers do not
have, and knows no throttling, XID or disk I/O. Here one sample feeds both, under MLflow's metric names.

The modules, one per part (each docstring states its contract):

- ``catalog``: the table of every metric (name, kind, help, labels, buckets), read by the exporter, the
  dashboards, the alert rules' tests and the integration test.
- ``exporter``: :class:`JobLabels`, the :class:`Telemetry` protocol, :class:`NullTelemetry`,
  :class:`PrometheusTelemetry` (registry, sampler thread, Pushgateway pushes, HTTP) and :func:`build_telemetry`.
- ``gpu``: NVML readings (:class:`NvmlGpus`, :class:`GpuReading`).
- ``host``: psutil readings (:class:`HostSampler`, :class:`HostReading`).
- ``cost``: the job's cost (:func:`job_cost`).
- ``timeline``: the bounded timeline of rank 0's samples for the Deck (:class:`Timeline`).
- ``mlflow_system``: rank 0's samples under MLflow's system-metric names (:func:`mlflow_system_metrics`).
- ``goodput``: every worker-second in one category, per attempt and across retries (:class:`goodput.GoodputClock`,
  :class:`goodput.ExecutionGoodput`).
- ``stragglers``: the rank that slows the others, and why (:class:`stragglers.StragglerDetector`).
- ``eta``: steps done and left, the recent rate, the time to the end and to the next checkpoint
  (:class:`eta.EtaEstimator`).

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
