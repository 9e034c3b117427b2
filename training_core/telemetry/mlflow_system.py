"""Rank 0's samples as MLflow system metrics, under MLflow's own names.

Contract: :func:`mlflow_system_metrics` maps one host reading and the GPU readings to ``system/...`` metrics named as
``mlflow.system_metrics`` names them (so they show in the run's System Metrics tab), leaving out what a reading
lacks; it computes only. The exporter logs them to a :class:`training_core.metrics.MlflowSink`. Why MLflow's own
monitor is not used: see :mod:`training_core.telemetry`.
"""

from __future__ import annotations

from training_core.telemetry.gpu import GpuReading
from training_core.telemetry.host import HostReading


def mlflow_system_metrics(host: HostReading | None, gpus: list[GpuReading]) -> dict[str, float]:
    """A sample under MLflow's own system-metric names (see the module docstring)."""
    metrics: dict[str, float] = {}
    if host is not None:
        metrics = {
            "system/cpu_utilization_percentage": host.cpu_utilization_ratio * 100,
            "system/system_memory_usage_megabytes": host.memory_used_bytes / 1e6,
            "system/system_memory_usage_percentage": host.memory_used_bytes / host.memory_total_bytes * 100
            if host.memory_total_bytes
            else 0.0,
            "system/network_receive_megabytes": host.network_received_bytes / 1e6,
            "system/network_transmit_megabytes": host.network_transmitted_bytes / 1e6,
        }
    for gpu in gpus:
        prefix = f"system/gpu_{gpu.gpu}_"
        if gpu.utilization_ratio is not None:
            metrics[prefix + "utilization_percentage"] = gpu.utilization_ratio * 100
        if gpu.memory_used_bytes is not None:
            metrics[prefix + "memory_usage_megabytes"] = gpu.memory_used_bytes / 1e6
            if gpu.memory_total_bytes:
                metrics[prefix + "memory_usage_percentage"] = gpu.memory_used_bytes / gpu.memory_total_bytes * 100
        if gpu.power_watts is not None:
            metrics[prefix + "power_usage_watts"] = gpu.power_watts
    return metrics
