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
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from training_core.config import ObservabilityConfig, ScalingConfig
from training_core.telemetry.catalog import JOB_LABELS, METRICS, PUSHGATEWAY_JOB

log = logging.getLogger("training_core")

# NVML's clock-event reason bits, as ``training_gpu_throttled{reason=...}`` label values.
THROTTLE_REASONS: tuple[tuple[str, str], ...] = (
    ("gpu_idle", "nvmlClocksEventReasonGpuIdle"),
    ("applications_clocks_setting", "nvmlClocksEventReasonApplicationsClocksSetting"),
    ("sw_power_cap", "nvmlClocksEventReasonSwPowerCap"),
    ("hw_slowdown", "nvmlClocksEventReasonHwSlowdown"),
    ("sync_boost", "nvmlClocksEventReasonSyncBoost"),
    ("sw_thermal_slowdown", "nvmlClocksEventReasonSwThermalSlowdown"),
    ("hw_thermal_slowdown", "nvmlClocksEventReasonHwThermalSlowdown"),
    ("hw_power_brake_slowdown", "nvmlClocksEventReasonHwPowerBrakeSlowdown"),
)

PUSH_WARNING_INTERVAL_S = 60.0
"""At most one push-failure warning per this many seconds (the others are counted into the next one)."""


@dataclass(frozen=True)
class JobLabels:
    """The labels on every series: which Flyte execution, node and attempt, which rank and model."""

    execution: str = "local"
    node: str = "local"
    attempt: str = "0"
    rank: str = "0"
    model: str = ""

    def as_dict(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in JOB_LABELS}

    def grouping_key(self) -> dict[str, str]:
        """The Pushgateway group of this rank's metrics: one per execution, node, attempt and rank."""
        return {name: getattr(self, name) for name in ("execution", "node", "attempt", "rank")}


# --- GPUs (NVML) ---


@dataclass
class GpuReading:
    """One GPU at one moment; a field NVML could not give (not supported, an error) is ``None``."""

    gpu: str
    """Label of the GPU: its NVML (physical) index."""
    utilization_ratio: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    throttled: dict[str, bool] = field(default_factory=dict)
    """Clock-event reason -> active, for the reasons in :data:`THROTTLE_REASONS`."""


def _import_pynvml():
    with warnings.catch_warnings():
        # pynvml 13 is a shim over nvidia-ml-py and warns about it on import; the API is the same.
        warnings.simplefilter("ignore", FutureWarning)
        import pynvml
    return pynvml


class NvmlGpus:
    """The GPUs this process may use, read through NVML.

    :meth:`open` returns ``None`` (after one info log) where NVML is unusable: no library, no driver, no GPU.
    Every read guards each NVML call on its own, so a field a GPU does not support (power on some boards,
    XID events on others) is left out without losing the rest. ``nvml`` is the pynvml module; a test hands
    handles to a real, uninitialised pynvml to walk every call path through NVML's error returns.
    """

    def __init__(self, nvml: Any, handles: Mapping[str, Any]) -> None:
        self.nvml = nvml
        self.handles = dict(handles)
        self._events = None
        self._failed_calls: set[str] = set()

    @classmethod
    def open(cls) -> "NvmlGpus | None":
        try:
            nvml = _import_pynvml()
        except ImportError as exc:
            log.info("GPU metrics off: the NVML bindings (pynvml) are not installed (%s)", exc)
            return None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            log.info("GPU metrics off: NVML is not available on this machine (%s)", exc)
            return None
        try:
            handles = cls._visible_handles(nvml)
        except nvml.NVMLError as exc:
            log.info("GPU metrics off: NVML could not list the GPUs (%s)", exc)
            nvml.nvmlShutdown()
            return None
        if not handles:
            log.info("GPU metrics off: NVML sees no GPU this process may use")
            nvml.nvmlShutdown()
            return None
        gpus = cls(nvml, handles)
        gpus.watch_xid_errors()
        return gpus

    @staticmethod
    def _visible_handles(nvml: Any) -> dict[str, Any]:
        """NVML sees every GPU of the node; keep those ``CUDA_VISIBLE_DEVICES`` gives this process (as Ray
        and Kubernetes set it), so ranks sharing a node do not report each other's GPUs."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        else:
            entries = [e.strip() for e in visible.split(",") if e.strip() and e.strip() != "-1"]
            handles = [
                nvml.nvmlDeviceGetHandleByUUID(e)
                if e.startswith(("GPU-", "MIG-"))
                else nvml.nvmlDeviceGetHandleByIndex(int(e))
                for e in entries
            ]
        return {str(nvml.nvmlDeviceGetIndex(h)): h for h in handles}

    def _call(self, name: str, *args: Any) -> Any:
        """``nvml.<name>(*args)``, or ``None`` on an NVML error (logged once per function)."""
        try:
            return getattr(self.nvml, name)(*args)
        except self.nvml.NVMLError as exc:
            if name not in self._failed_calls:
                self._failed_calls.add(name)
                log.info("NVML %s unavailable (%s): that GPU figure is left out", name, exc)
            return None

    def read(self) -> list[GpuReading]:
        readings = []
        for gpu, handle in self.handles.items():
            reading = GpuReading(gpu=gpu)
            utilization = self._call("nvmlDeviceGetUtilizationRates", handle)
            if utilization is not None:
                reading.utilization_ratio = utilization.gpu / 100.0
            memory = self._call("nvmlDeviceGetMemoryInfo", handle)
            if memory is not None:
                reading.memory_used_bytes, reading.memory_total_bytes = float(memory.used), float(memory.total)
            temperature = self._call("nvmlDeviceGetTemperature", handle, self.nvml.NVML_TEMPERATURE_GPU)
            if temperature is not None:
                reading.temperature_celsius = float(temperature)
            power_mw = self._call("nvmlDeviceGetPowerUsage", handle)
            if power_mw is not None:
                reading.power_watts = power_mw / 1000.0
            reasons = self._call("nvmlDeviceGetCurrentClocksEventReasons", handle)
            if reasons is not None:
                reading.throttled = {label: bool(reasons & getattr(self.nvml, bit)) for label, bit in THROTTLE_REASONS}
            readings.append(reading)
        return readings

    def watch_xid_errors(self) -> None:
        """Register for critical XID events on every GPU that supports them (many do not: then none are counted)."""
        events = self._call("nvmlEventSetCreate")
        if events is None:
            return
        registered = False
        for gpu, handle in self.handles.items():
            try:
                self.nvml.nvmlDeviceRegisterEvents(handle, self.nvml.nvmlEventTypeXidCriticalError, events)
                registered = True
            except self.nvml.NVMLError as exc:
                log.info("GPU %s: NVML XID events unavailable (%s); its XID errors are not counted", gpu, exc)
        if registered:
            self._events = events
        else:
            self._call("nvmlEventSetFree", events)

    def take_xid_errors(self) -> dict[str, int]:
        """Critical XID events since the previous call, per GPU label (never blocks)."""
        counts: dict[str, int] = {}
        if self._events is None:
            return counts
        while True:
            try:
                data = self.nvml.nvmlEventSetWait(self._events, 0)
            except self.nvml.NVMLError_Timeout:
                return counts
            except self.nvml.NVMLError as exc:
                log.info("NVML XID event wait failed (%s): XID errors are no longer counted", exc)
                self._events = None
                return counts
            index = self._call("nvmlDeviceGetIndex", data.device)
            gpu = str(index) if index is not None else "unknown"
            log.warning("GPU %s reported critical XID error %s", gpu, data.eventData)
            counts[gpu] = counts.get(gpu, 0) + 1

    def close(self) -> None:
        if self._events is not None:
            self._call("nvmlEventSetFree", self._events)
            self._events = None
        self._call("nvmlShutdown")


# --- host (psutil) ---


@dataclass
class HostReading:
    cpu_utilization_ratio: float
    memory_used_bytes: float
    memory_total_bytes: float
    network_received_bytes: float
    """Bytes received on all interfaces since the sampler started (likewise the three below)."""
    network_transmitted_bytes: float
    disk_read_bytes: float
    disk_written_bytes: float


class HostSampler:
    """CPU, memory, network and disk I/O of the host, as deltas since construction for the byte counters."""

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement period
        self._start_net = self._net()
        self._start_disk = self._disk()

    def _net(self) -> tuple[float, float]:
        counters = self.psutil.net_io_counters()
        return (float(counters.bytes_recv), float(counters.bytes_sent)) if counters else (0.0, 0.0)

    def _disk(self) -> tuple[float, float]:
        counters = self.psutil.disk_io_counters()  # None in some containers
        return (float(counters.read_bytes), float(counters.write_bytes)) if counters else (0.0, 0.0)

    def read(self) -> HostReading:
        memory = self.psutil.virtual_memory()
        net, disk = self._net(), self._disk()
        return HostReading(
            cpu_utilization_ratio=self.psutil.cpu_percent(interval=None) / 100.0,
            memory_used_bytes=float(memory.used),
            memory_total_bytes=float(memory.total),
            network_received_bytes=max(0.0, net[0] - self._start_net[0]),
            network_transmitted_bytes=max(0.0, net[1] - self._start_net[1]),
            disk_read_bytes=max(0.0, disk[0] - self._start_disk[0]),
            disk_written_bytes=max(0.0, disk[1] - self._start_disk[1]),
        )


# --- cost ---


@dataclass(frozen=True)
class JobCost:
    gpu_seconds: float
    cpu_seconds: float
    gpu_hour_usd: float
    cpu_hour_usd: float

    @property
    def cost_usd(self) -> float:
        return self.gpu_seconds / 3600 * self.gpu_hour_usd + self.cpu_seconds / 3600 * self.cpu_hour_usd

    def summary(self) -> dict[str, float]:
        """The ``cost`` entry of the checkpoint's ``meta.telemetry`` (what the Deck shows)."""
        return {
            "gpu_hours": self.gpu_seconds / 3600,
            "cpu_hours": self.cpu_seconds / 3600,
            "cost_usd": self.cost_usd,
            "gpu_hour_usd": self.gpu_hour_usd,
            "cpu_hour_usd": self.cpu_hour_usd,
        }


def job_cost(
    scaling: ScalingConfig, prices: ObservabilityConfig, *, wall_s: float, prior: Mapping[str, float] | None = None
) -> JobCost:
    """What the job's workers held over ``wall_s`` seconds, plus ``prior`` (the ``cost`` summary of earlier
    attempts and restarts): world size x GPUs (or CPUs) per worker x wall time, at the configured prices."""
    prior = prior or {}
    gpus = scaling.num_workers * scaling.gpus_per_worker if scaling.use_gpu else 0
    cpus = scaling.num_workers * scaling.cpus_per_worker
    return JobCost(
        gpu_seconds=float(prior.get("gpu_hours", 0.0)) * 3600 + gpus * wall_s,
        cpu_seconds=float(prior.get("cpu_hours", 0.0)) * 3600 + cpus * wall_s,
        gpu_hour_usd=prices.gpu_hour_usd,
        cpu_hour_usd=prices.cpu_hour_usd,
    )


# --- the exporter ---


class Telemetry(Protocol):
    """What the training loop and the checkpointer tell telemetry. :class:`NullTelemetry` ignores it all."""

    def step(self, *, duration_s: float, num_samples: int, data_wait_s: float, comm_s: float) -> None: ...

    def window(self, record: Mapping[str, float], *, global_step: int) -> None: ...

    def validation(self, *, loss: float, accuracy: float) -> None: ...

    def resumed(self, saved: Mapping[str, Any], *, global_step: int, elapsed_s: float, num_restarts: int) -> None: ...

    def gpu_oom(self) -> None: ...

    def checkpoint_saved(self, *, duration_s: float, bytes_written: int) -> None: ...

    def checkpoint_failed(self) -> None: ...

    def snapshot(self) -> dict[str, Any]: ...

    def close(self, *, finished: bool) -> None: ...


class NullTelemetry:
    """Observability off: every call returns at once."""

    def step(self, *, duration_s: float, num_samples: int, data_wait_s: float, comm_s: float) -> None:
        pass

    def window(self, record: Mapping[str, float], *, global_step: int) -> None:
        pass

    def validation(self, *, loss: float, accuracy: float) -> None:
        pass

    def resumed(self, saved: Mapping[str, Any], *, global_step: int, elapsed_s: float, num_restarts: int) -> None:
        pass

    def gpu_oom(self) -> None:
        pass

    def checkpoint_saved(self, *, duration_s: float, bytes_written: int) -> None:
        pass

    def checkpoint_failed(self) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        return {}

    def close(self, *, finished: bool) -> None:
        pass


class SystemMetricsSink(Protocol):
    """Where rank 0's samples go as MLflow system metrics (a :class:`training_core.metrics.MlflowSink`)."""

    def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None: ...


class _WithoutCreated:
    """The registry's families without prometheus_client's ``*_created`` samples, which are not in the
    catalogue (turning them off process-wide would also change other libraries' metrics)."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def mlflow_system_metrics(host: HostReading | None, gpus: list[GpuReading]) -> dict[str, float]:
    """A sample under MLflow's own system-metric names (those of ``mlflow.system_metrics``), so it shows in
    the run's System Metrics tab next to what MLflow's monitor would log."""
    metrics: dict[str, float] = {}
    if host is not None:
        metrics.update(
            {
                "system/cpu_utilization_percentage": host.cpu_utilization_ratio * 100,
                "system/system_memory_usage_megabytes": host.memory_used_bytes / 1e6,
                "system/system_memory_usage_percentage": host.memory_used_bytes / host.memory_total_bytes * 100
                if host.memory_total_bytes
                else 0.0,
                "system/network_receive_megabytes": host.network_received_bytes / 1e6,
                "system/network_transmit_megabytes": host.network_transmitted_bytes / 1e6,
            }
        )
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


class Timeline:
    """At most ``max_samples`` readings for the Deck; when full, every other one is dropped, so the whole run
    stays covered at a coarser interval."""

    def __init__(self, max_samples: int, samples: list[dict[str, Any]] | None = None) -> None:
        self.max_samples = max_samples
        self.samples: list[dict[str, Any]] = list(samples or [])
        self._stride = 1
        self._skipped = 0

    def add(self, sample: dict[str, Any]) -> None:
        self._skipped += 1
        if self._skipped < self._stride:
            return
        self._skipped = 0
        self.samples.append(sample)
        if len(self.samples) >= self.max_samples:
            self.samples = self.samples[::2]
            self._stride *= 2


class PrometheusTelemetry:
    """The exporter of one rank (see the module docstring). Thread-safe: the loop, the checkpoint writer and
    the sampler thread all record into it."""

    def __init__(
        self,
        cfg: ObservabilityConfig,
        *,
        scaling: ScalingConfig,
        labels: JobLabels,
        world_size: int,
        system_sink: SystemMetricsSink | None = None,
        start_threads: bool = True,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.cfg, self.scaling, self.labels = cfg, scaling, labels
        self.is_rank0 = labels.rank == "0"
        self.system_sink = system_sink if self.is_rank0 else None
        self._metrics_registry = CollectorRegistry(auto_describe=False)
        self.registry = CollectorRegistry(auto_describe=False)
        """What is exported: the catalogue's metrics, nothing else."""
        self.registry.register(_WithoutCreated(self._metrics_registry))
        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        self._families: dict[str, Any] = {}
        for spec in METRICS:
            kwargs: dict[str, Any] = {
                "registry": self._metrics_registry,
                "labelnames": (*JOB_LABELS, *spec.extra_labels),
            }
            if spec.kind == "histogram":
                kwargs["buckets"] = spec.buckets
            # prometheus_client appends "_total" to counters itself.
            name = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
            self._families[spec.name] = kinds[spec.kind](name, spec.help, **kwargs)
        job = labels.as_dict()
        # Series with only the job labels exist from the start (counters at 0); children bound once here keep
        # the per-step path free of label lookups.
        self._m = {spec.name: self._families[spec.name].labels(**job) for spec in METRICS if not spec.extra_labels}
        self._job = job
        self._m["training_world_size"].set(world_size)
        self._m["training_run_finished"].set(0)
        # Until the first logged step the clock reads the start: a rank stuck before any step (a hung collective,
        # unreadable data) then trips TrainingStalled like one stuck later.
        self._m["training_last_step_timestamp_seconds"].set(time.time())

        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._elapsed_offset_s = 0.0
        self._prior_cost: Mapping[str, float] = {}
        self._cost_reported = JobCost(0.0, 0.0, cfg.gpu_hour_usd, cfg.cpu_hour_usd)
        self.timeline = Timeline(cfg.timeline_max_samples)
        self._sample_index = 0
        self._push_failures = 0
        self._last_push_warning = -float("inf")
        self._http_server = None
        self._host_totals: dict[str, float] = {}
        self._global_step = 0

        self.gpus = NvmlGpus.open() if cfg.nvml else None
        self._m["training_gpus"].set(len(self.gpus.handles) if self.gpus else 0)
        self.host = HostSampler() if cfg.host else None
        if cfg.http_port:
            self._serve_http(cfg.http_port + int(labels.rank))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start_threads:
            self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
            self._thread.start()

    # --- from the loop (training thread) ---

    def step(self, *, duration_s: float, num_samples: int, data_wait_s: float, comm_s: float) -> None:
        m = self._m
        m["training_step_duration_seconds"].observe(duration_s)
        m["training_steps_total"].inc()
        m["training_samples_total"].inc(num_samples)
        m["training_data_wait_seconds_total"].inc(data_wait_s)
        m["training_communication_seconds_total"].inc(comm_s)

    def window(self, record: Mapping[str, float], *, global_step: int) -> None:
        """A log window's record (see the loop): losses, LR, gradient norm, throughput and time shares."""
        m = self._m
        self._families["training_loss"].labels(**self._job, split="train").set(record["train_loss"])
        self._families["training_accuracy"].labels(**self._job, split="train").set(record["train_accuracy"])
        m["training_learning_rate"].set(record["lr"])
        m["training_grad_norm"].set(record["grad_norm"])
        m["training_samples_per_second"].set(record["samples_per_s"])
        m["training_communication_ratio"].set(record["allreduce_fraction"])
        step_time_s = record["step_time_s"]
        m["training_data_wait_ratio"].set(record["data_wait_s"] / step_time_s if step_time_s else 0.0)
        m["training_epoch"].set(record["epoch"])
        m["training_global_step"].set(global_step)
        m["training_last_step_timestamp_seconds"].set(time.time())
        self._global_step = global_step

    def validation(self, *, loss: float, accuracy: float) -> None:
        self._families["training_loss"].labels(**self._job, split="val").set(loss)
        self._families["training_accuracy"].labels(**self._job, split="val").set(accuracy)

    def resumed(self, saved: Mapping[str, Any], *, global_step: int, elapsed_s: float, num_restarts: int) -> None:
        """Continue from a checkpoint: its ``meta.telemetry`` (``saved``), the steps taken before it, the
        run's seconds so far, and how many times the run has resumed (restarts and retries)."""
        self._m["training_steps_total"].inc(global_step)
        self._m["training_global_step"].set(global_step)
        self._global_step = global_step
        self._m["training_worker_restarts_total"].inc(num_restarts)
        with self._lock:
            self._elapsed_offset_s = elapsed_s - (time.monotonic() - self._started)
            if self.is_rank0:
                self._prior_cost = dict(saved.get("cost") or {})
                self.timeline = Timeline(self.cfg.timeline_max_samples, saved.get("samples") or [])
                cost = job_cost(self.scaling, self.cfg, wall_s=0.0, prior=self._prior_cost)
                self._report_cost(cost)

    def gpu_oom(self) -> None:
        self._m["training_gpu_oom_total"].inc()

    # --- from the checkpoint writer thread ---

    def checkpoint_saved(self, *, duration_s: float, bytes_written: int) -> None:
        self._m["training_checkpoint_save_duration_seconds"].observe(duration_s)
        self._m["training_checkpoint_saves_total"].inc()
        self._m["training_checkpoint_written_bytes_total"].inc(bytes_written)

    def checkpoint_failed(self) -> None:
        self._m["training_checkpoint_save_failures_total"].inc()

    # --- state for the checkpoint ---

    def snapshot(self) -> dict[str, Any]:
        """``meta.telemetry`` of a checkpoint written now (rank 0): the timeline and the cost so far."""
        if not self.is_rank0:
            return {}
        with self._lock:
            return {"samples": [dict(s) for s in self.timeline.samples], "cost": self._cost().summary()}

    # --- sampling and delivery ---

    def _cost(self) -> JobCost:
        wall_s = time.monotonic() - self._started
        return job_cost(self.scaling, self.cfg, wall_s=wall_s, prior=self._prior_cost)

    def _report_cost(self, cost: JobCost) -> None:
        """Counters only go up: add what accrued since the last report."""
        self._m["training_job_gpu_seconds_total"].inc(max(0.0, cost.gpu_seconds - self._cost_reported.gpu_seconds))
        self._m["training_job_cpu_seconds_total"].inc(max(0.0, cost.cpu_seconds - self._cost_reported.cpu_seconds))
        self._m["training_job_cost_usd"].set(cost.cost_usd)
        self._cost_reported = cost

    def sample(self) -> None:
        """Read the GPUs and the host once into the metrics (and, on rank 0, the timeline, MLflow and cost)."""
        gpus = self.gpus.read() if self.gpus else []
        for reading in gpus:
            self._set_gpu(reading)
        if self.gpus:
            for gpu, count in self.gpus.take_xid_errors().items():
                self._families["training_gpu_xid_errors_total"].labels(**self._job, gpu=gpu).inc(count)
        host = self.host.read() if self.host else None
        if host is not None:
            self._set_host(host)
        if not self.is_rank0:
            return
        with self._lock:
            self._report_cost(self._cost())
            elapsed_s = self._elapsed_offset_s + time.monotonic() - self._started
            self.timeline.add(
                {
                    "elapsed_s": elapsed_s,
                    "cpu_utilization": host.cpu_utilization_ratio if host else 0.0,
                    "memory_used_bytes": host.memory_used_bytes if host else 0.0,
                    "gpu_utilization": {g.gpu: g.utilization_ratio for g in gpus if g.utilization_ratio is not None},
                    "gpu_memory_used_bytes": {
                        g.gpu: g.memory_used_bytes for g in gpus if g.memory_used_bytes is not None
                    },
                }
            )
            self._sample_index += 1
            step = self._sample_index
        if self.system_sink is not None and self.cfg.mlflow_system_metrics:
            metrics = mlflow_system_metrics(host, gpus)
            if metrics:
                try:
                    self.system_sink.log_metrics(metrics, step=step)
                except Exception as exc:  # noqa: BLE001 - a tracking hiccup must not stop sampling
                    log.warning("logging system metrics to MLflow failed: %s", exc)

    def _set_gpu(self, reading: GpuReading) -> None:
        labels = {**self._job, "gpu": reading.gpu}
        for name, value in (
            ("training_gpu_utilization_ratio", reading.utilization_ratio),
            ("training_gpu_memory_used_bytes", reading.memory_used_bytes),
            ("training_gpu_memory_total_bytes", reading.memory_total_bytes),
            ("training_gpu_temperature_celsius", reading.temperature_celsius),
            ("training_gpu_power_watts", reading.power_watts),
        ):
            if value is not None:
                self._families[name].labels(**labels).set(value)
        for reason, active in reading.throttled.items():
            self._families["training_gpu_throttled"].labels(**labels, reason=reason).set(1 if active else 0)

    def _set_host(self, host: HostReading) -> None:
        m = self._m
        m["training_host_cpu_utilization_ratio"].set(host.cpu_utilization_ratio)
        m["training_host_memory_used_bytes"].set(host.memory_used_bytes)
        m["training_host_memory_total_bytes"].set(host.memory_total_bytes)
        # The readings are totals since start; the counters take the difference to what they already hold.
        for name, total in (
            ("training_host_network_received_bytes_total", host.network_received_bytes),
            ("training_host_network_transmitted_bytes_total", host.network_transmitted_bytes),
            ("training_host_disk_read_bytes_total", host.disk_read_bytes),
            ("training_host_disk_written_bytes_total", host.disk_written_bytes),
        ):
            delta = total - self._host_totals.get(name, 0.0)
            if delta > 0:
                m[name].inc(delta)
                self._host_totals[name] = total

    def push(self) -> bool:
        """Push the registry to the Pushgateway (replacing this rank's group); False when it failed or no URL
        is configured. Never raises."""
        if not self.cfg.pushgateway_url:
            return False
        from prometheus_client import push_to_gateway

        self._m["training_last_push_timestamp_seconds"].set(time.time())
        try:
            push_to_gateway(
                self.cfg.pushgateway_url,
                job=PUSHGATEWAY_JOB,
                registry=self.registry,
                grouping_key=self.labels.grouping_key(),
                timeout=self.cfg.push_timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - URLError, HTTP errors, timeouts: metrics never fail training
            self._push_failures += 1
            now = time.monotonic()
            if now - self._last_push_warning >= PUSH_WARNING_INTERVAL_S:
                log.warning(
                    "pushing metrics to %s failed (%d failure(s) since the last warning): %s; training goes on",
                    self.cfg.pushgateway_url,
                    self._push_failures,
                    exc,
                )
                self._last_push_warning, self._push_failures = now, 0
            return False
        return True

    def _serve_http(self, port: int) -> None:
        from prometheus_client import start_http_server

        try:
            self._http_server, _ = start_http_server(port, registry=self.registry)
        except OSError as exc:
            log.warning(
                "observability.http_port: cannot serve metrics on port %d (%s); they are only pushed", port, exc
            )
        else:
            log.info("serving metrics on http://0.0.0.0:%d/metrics", port)

    def _run(self) -> None:
        """The background thread: sample every ``sample_interval_s``, push every ``push_interval_s``."""
        next_sample = next_push = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_sample:
                    self.sample()
                    next_sample = now + self.cfg.sample_interval_s
                if now >= next_push and self.cfg.pushgateway_url:
                    self.push()
                    next_push = now + self.cfg.push_interval_s
                elif self._http_server is not None:
                    self._m["training_last_push_timestamp_seconds"].set(time.time())
            except Exception:  # noqa: BLE001 - the sampler must outlive any one bad reading
                log.exception("telemetry sampling failed; retrying at the next interval")
            wake = min(next_sample, next_push if self.cfg.pushgateway_url else next_sample)
            self._stop.wait(max(0.0, wake - time.monotonic()))

    def close(self, *, finished: bool) -> None:
        """Stop the thread, take a last sample, log the cost (rank 0), and push once more. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.sample()
        except Exception:  # noqa: BLE001
            log.exception("final telemetry sample failed")
        self._m["training_run_finished"].set(1 if finished else 0)
        if self.is_rank0 and self.system_sink is not None and finished:
            summary = self._cost_reported.summary()
            try:
                self.system_sink.log_metrics(
                    {
                        "cost_usd": summary["cost_usd"],
                        "gpu_hours": summary["gpu_hours"],
                        "cpu_hours": summary["cpu_hours"],
                    },
                    step=self._global_step,
                )
            except Exception as exc:  # noqa: BLE001
                log.warning("logging the job's cost to MLflow failed: %s", exc)
        self.push()
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
        if self.gpus is not None:
            self.gpus.close()


def build_telemetry(
    cfg: ObservabilityConfig,
    *,
    scaling: ScalingConfig,
    labels: JobLabels,
    world_size: int,
    system_sink: SystemMetricsSink | None = None,
) -> Telemetry:
    """The exporter of this rank, or a :class:`NullTelemetry` when ``cfg.enabled`` is false."""
    if not cfg.enabled:
        return NullTelemetry()
    return PrometheusTelemetry(cfg, scaling=scaling, labels=labels, world_size=world_size, system_sink=system_sink)
