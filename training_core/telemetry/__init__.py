"""Prometheus telemetry of one training worker: the catalogue's metrics, GPU and host samplers, delivery, cost.

Every rank builds one :class:`PrometheusTelemetry` (or a :class:`NullTelemetry` when
``observability.enabled`` is false) with :func:`build_telemetry`. It owns a private ``CollectorRegistry``
holding exactly the metrics of :mod:`training_core.telemetry.catalog`, every series labelled with
:data:`~training_core.telemetry.catalog.JOB_LABELS`.

- The loop calls :meth:`~PrometheusTelemetry.step` once per optimizer step (a histogram observation and
  four counter increments, no device sync), :meth:`~PrometheusTelemetry.window` at log windows and
  :meth:`~PrometheusTelemetry.validation` at epoch ends; the :class:`~training_core.checkpoint.Checkpointer`
  reports each save's real outcome through :meth:`~PrometheusTelemetry.checkpoint_saved` /
  :meth:`~PrometheusTelemetry.checkpoint_failed`.
- One background thread samples the GPUs (NVML, :class:`NvmlGpus`) and the host (psutil, :class:`HostSampler`)
  every ``sample_interval_s``, and pushes the registry to the Pushgateway every ``push_interval_s``. On rank 0
  the same samples go to the MLflow run as ``system/...`` metrics and into a bounded timeline for the Deck,
  and the job's cost is updated.
- :meth:`~PrometheusTelemetry.close` (the loop calls it in a ``finally``) stops the thread and pushes a last
  time, with ``training_run_finished`` = 1 when training returned normally.

Delivery never fails training: a failed push is a (rate-limited) warning.

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
