"""The exporter of one rank: its Prometheus registry, the sampler thread, and delivery (Pushgateway, HTTP).

Contract: :func:`build_telemetry` returns a :class:`Telemetry`: a :class:`PrometheusTelemetry`, or with
``observability.enabled`` false a :class:`NullTelemetry` whose every call returns at once. A
:class:`PrometheusTelemetry` owns a private ``CollectorRegistry`` holding exactly the metrics of
:mod:`training_core.telemetry.catalog` (without prometheus_client's ``*_created`` samples), every series labelled
with the rank's :class:`JobLabels`, and is thread-safe: the loop, the checkpoint writer and its own thread record
into it. That thread reads the GPUs (:mod:`~training_core.telemetry.gpu`) and the host
(:mod:`~training_core.telemetry.host`) every ``sample_interval_s`` and pushes the registry to the Pushgateway every
``push_interval_s``, one group per execution, node, attempt and rank (:meth:`JobLabels.grouping_key`);
``http_port`` + rank, when set, also serves it. On rank 0 each sample also goes to the
:class:`~training_core.telemetry.timeline.Timeline`, to MLflow when a system-metrics sink is given
(:mod:`~training_core.telemetry.mlflow_system`) and into the job's cost (:mod:`~training_core.telemetry.cost`).
Delivery never fails training:
:meth:`~PrometheusTelemetry.push` never raises, and a failed push is a warning at most every
:data:`PUSH_WARNING_INTERVAL_S`. :meth:`~PrometheusTelemetry.close` stops the thread, samples and pushes a last
time; it is idempotent.
prometheus_client is imported when an exporter is built, not when this module is.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from training_core.config import ObservabilityConfig, ScalingConfig
from training_core.metrics import MetricSink
from training_core.schema import is_count
from training_core.telemetry.catalog import JOB_LABELS, METRICS, PUSHGATEWAY_JOB
from training_core.telemetry.cost import JobCost, job_cost
from training_core.telemetry.eta import Progress
from training_core.telemetry.goodput import CATEGORIES as GOODPUT_CATEGORIES
from training_core.telemetry.goodput import ExecutionGoodput
from training_core.telemetry.gpu import GpuReading, NvmlGpus
from training_core.telemetry.host import HostReading, HostSampler
from training_core.telemetry.mlflow_system import mlflow_system_metrics
from training_core.telemetry.timeline import Timeline

log = logging.getLogger("training_core")

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


class Telemetry(Protocol):
    """What the training loop and the checkpointer tell telemetry. :class:`NullTelemetry` subclasses it, so these
    bodies are its no-ops: keep them empty."""

    def step(
        self, *, duration_s: float, num_samples: int, data_wait_s: float, comm_s: float, num_tokens: int = 0
    ) -> None: ...

    def window(self, record: Mapping[str, float], *, global_step: int) -> None: ...

    def validation(self, *, loss: float, accuracy: float) -> None: ...

    def resumed(
        self,
        saved: Mapping[str, Any],
        *,
        global_step: int,
        elapsed_s: float,
        num_restarts: int,
        num_preemptions: int = 0,
        attempt_start_unix: float | None = None,
    ) -> None: ...

    def preemption_recovered(self, *, first_step_unix: float) -> float: ...

    def gpu_oom(self) -> None: ...

    def oom_retried(self) -> None: ...

    def allreduce_probe(self, *, bus_bandwidth_bytes_per_s: float, latency_s: float) -> None: ...

    def nonfinite_steps(self, count: int) -> None: ...

    def stragglers(self, causes: Mapping[str, float]) -> None: ...

    def progress(self, progress: Progress) -> None: ...

    def goodput(self, execution: ExecutionGoodput) -> None: ...

    def checkpoint_saved(self, *, duration_s: float, bytes_written: int) -> None: ...

    def checkpoint_failed(self) -> None: ...

    def snapshot(self) -> dict[str, Any]: ...

    def close(self, *, finished: bool) -> None: ...


class NullTelemetry(Telemetry):
    """Observability off: every call returns at once (it inherits the protocol's empty methods)."""

    def preemption_recovered(self, *, first_step_unix: float) -> float:
        return 0.0

    def snapshot(self) -> dict[str, Any]:
        return {}


class _WithoutCreated:
    """The registry's families without prometheus_client's ``*_created`` samples, which are not in the
    catalogue (turning them off process-wide would also change other libraries' metrics)."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class PrometheusTelemetry:
    """The exporter of one rank (see the module docstring)."""

    def __init__(
        self,
        cfg: ObservabilityConfig,
        *,
        scaling: ScalingConfig,
        labels: JobLabels,
        world_size: int,
        system_sink: MetricSink | None = None,
        start_threads: bool = True,
    ) -> None:
        self.cfg, self.scaling, self.labels, self.world_size = cfg, scaling, labels, world_size
        self.is_rank0 = labels.rank == "0"
        self.system_sink = system_sink if self.is_rank0 else None
        self._register_metrics(labels)
        self._m["training_world_size"].set(world_size)
        # Until the first logged step the clock reads the start: a rank stuck before any step (a hung collective,
        # unreadable data) then trips TrainingStalled like one stuck later.
        self._m["training_last_step_timestamp_seconds"].set(time.time())

        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.started_unix = time.time()
        """When this attempt's telemetry started, the start of its cost clock."""
        self._lost_wall_s = 0.0
        self._elapsed_offset_s = 0.0
        self._prior_cost: Mapping[str, float] = {}
        self._cost_reported = JobCost(0.0, 0.0, cfg.gpu_hour_usd, cfg.cpu_hour_usd)
        self.timeline = Timeline(cfg.timeline_max_samples)
        self._sample_index = 0
        self._push_failures = 0
        self._last_push_warning = -float("inf")
        self._http_server = None
        self._totals: dict[str, float] = {}
        """The totals the host, cost and goodput counters last counted up to (:meth:`_count_up`)."""
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

    def _register_metrics(self, labels: JobLabels) -> None:
        """The catalogue's metric families in a registry of their own, exported through :attr:`registry`, and the
        series that carry only the job ``labels``."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self._metrics_registry = CollectorRegistry(auto_describe=False)
        self.registry = CollectorRegistry(auto_describe=False)
        """What is exported: the catalogue's metrics, nothing else."""
        self.registry.register(_WithoutCreated(self._metrics_registry))
        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        self._families: dict[str, Any] = {}
        for spec in METRICS:
            buckets = {"buckets": spec.buckets} if spec.kind == "histogram" else {}
            # prometheus_client appends "_total" to counters itself.
            name = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
            labelnames = (*JOB_LABELS, *spec.extra_labels)
            self._families[spec.name] = kinds[spec.kind](
                name, spec.help, labelnames, registry=self._metrics_registry, **buckets
            )
        job = labels.as_dict()
        # Series with only the job labels exist from the start (counters at 0); children bound once here keep
        # the per-step path free of label lookups.
        self._m = {spec.name: self._families[spec.name].labels(**job) for spec in METRICS if not spec.extra_labels}
        self._job = job
        for spec in METRICS:  # series whose extra label's values are known exist from the start too
            for value in spec.label_values:
                self._families[spec.name].labels(**job, **{spec.extra_labels[0]: value})

    # --- from the loop (training thread) ---

    def step(
        self, *, duration_s: float, num_samples: int, data_wait_s: float, comm_s: float, num_tokens: int = 0
    ) -> None:
        m = self._m
        m["training_step_duration_seconds"].observe(duration_s)
        m["training_steps_total"].inc()
        m["training_samples_total"].inc(num_samples)
        m["training_tokens_total"].inc(num_tokens)
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
        m["training_tokens_per_second"].set(record.get("tokens_per_s", 0.0))
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

    def resumed(
        self,
        saved: Mapping[str, Any],
        *,
        global_step: int,
        elapsed_s: float,
        num_restarts: int,
        num_preemptions: int = 0,
        attempt_start_unix: float | None = None,
    ) -> None:
        """Continue from a checkpoint: its ``meta.telemetry`` (``saved``), the steps taken before it, the
        run's seconds so far, how many times the run has resumed (restarts and retries), and how many of those
        resumes followed a preemption (a just-in-time checkpoint). ``attempt_start_unix``, when this attempt began
        (its worker process started, not before the checkpoint was written), moves the attempt's clock back to
        it: a restarted attempt's start-up (imports, joining the group, building the model) holds the GPUs too."""
        self._m["training_steps_total"].inc(global_step)
        self._m["training_global_step"].set(global_step)
        self._global_step = global_step
        self._m["training_worker_restarts_total"].inc(num_restarts)
        self._m["training_preemptions_total"].inc(num_preemptions)
        with self._lock:
            if attempt_start_unix is not None and attempt_start_unix < self.started_unix:
                self._started -= self.started_unix - attempt_start_unix
                self.started_unix = attempt_start_unix
            self._elapsed_offset_s = elapsed_s - (time.monotonic() - self._started)
            if self.is_rank0:
                self._prior_cost = dict(saved.get("cost") or {})
                # A checkpoint is data: a stride that is not a count from 1 to 2**40 restarts the thinning.
                stride = saved.get("sample_stride")
                stride = stride if is_count(stride) and 1 <= stride <= 2**40 else 1
                self.timeline = Timeline(self.cfg.timeline_max_samples, saved.get("samples") or [], stride)
                self._report_cost(self._cost(wall_s=0.0))

    def preemption_recovered(self, *, first_step_unix: float) -> float:
        """The first step after a resume from a preemption checkpoint is done: this attempt's seconds until then
        (start-up, restore) count as lost to the preemption in the cost (rank 0). Returns them."""
        lost_s = max(0.0, first_step_unix - self.started_unix)
        if self.is_rank0:
            with self._lock:
                self._lost_wall_s += lost_s
                self._report_cost(self._cost())
        return lost_s

    def gpu_oom(self) -> None:
        self._m["training_gpu_oom_total"].inc()

    def oom_retried(self) -> None:
        self._m["training_oom_retries_total"].inc()

    def allreduce_probe(self, *, bus_bandwidth_bytes_per_s: float, latency_s: float) -> None:
        """The job-start all-reduce check (:func:`~training_core.parallel.distributed.probe_allreduce`)."""
        self._m["training_allreduce_bus_bandwidth_bytes_per_second"].set(bus_bandwidth_bytes_per_s)
        self._m["training_allreduce_latency_seconds"].set(latency_s)

    def nonfinite_steps(self, count: int) -> None:
        """``count`` more steps had a non-finite loss or gradient norm (read at a log window's end)."""
        self._m["training_nonfinite_steps_total"].inc(count)

    def stragglers(self, causes: Mapping[str, float]) -> None:
        """This rank's straggler flags at a log window's end: 1 for the cause it is flagged for, else 0."""
        for cause, value in causes.items():
            self._families["training_straggler"].labels(**self._job, cause=cause).set(value)

    def progress(self, progress: Progress) -> None:
        """The run's progress and ETA at a log window's end (:mod:`~training_core.telemetry.eta`)."""
        m = self._m
        m["training_total_steps"].set(progress.total_steps)
        m["training_steps_per_second"].set(progress.steps_per_s)
        if progress.eta_s is not None:
            m["training_eta_seconds"].set(progress.eta_s)
        due = progress.eta_checkpoint_s
        m["training_eta_checkpoint_seconds"].set(float("nan") if due is None else due)

    def goodput(self, execution: ExecutionGoodput) -> None:
        """The execution's goodput so far, all ranks and attempts (rank 0): counters by their increase."""
        if not self.is_rank0:
            return
        family = self._families["training_job_goodput_seconds_total"]
        with self._lock:
            for name, total in zip(GOODPUT_CATEGORIES, execution.seconds.as_list()):
                self._count_up(family.labels(**self._job, category=name), f"goodput.{name}", total)
            self._m["training_goodput_ratio"].set(execution.goodput)

    def _count_up(self, counter: Any, key: str, total: float) -> None:
        """Counters only go up: ``counter`` gains what ``total`` grew past the last total seen for ``key``."""
        increase = total - self._totals.get(key, 0.0)
        if increase > 0:
            counter.inc(increase)
            self._totals[key] = total

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
            samples = [dict(s) for s in self.timeline.samples]
            return {"samples": samples, "sample_stride": self.timeline.stride, "cost": self._cost().summary()}

    # --- sampling and delivery ---

    def _cost(self, *, wall_s: float | None = None) -> JobCost:
        """The job's cost: the earlier attempts' and this attempt's ``wall_s`` (default: its time so far)."""
        return job_cost(
            self.scaling,
            self.cfg,
            wall_s=time.monotonic() - self._started if wall_s is None else wall_s,
            prior=self._prior_cost,
            num_workers=self.world_size,
            lost_wall_s=self._lost_wall_s,
        )

    def _report_cost(self, cost: JobCost) -> None:
        for field in ("gpu_seconds", "cpu_seconds", "preemption_gpu_seconds", "preemption_cpu_seconds"):
            name = f"training_job_{field}_total"  # training_job_gpu_seconds_total, ...
            self._count_up(self._m[name], name, getattr(cost, field))
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
        figures = ("utilization_ratio", "memory_used_bytes", "memory_total_bytes", "temperature_celsius", "power_watts")
        for field in figures:
            value = getattr(reading, field)
            if value is not None:  # training_gpu_utilization_ratio, ...
                self._families[f"training_gpu_{field}"].labels(**labels).set(value)
        for reason, active in reading.throttled.items():
            self._families["training_gpu_throttled"].labels(**labels, reason=reason).set(1 if active else 0)

    def _set_host(self, host: HostReading) -> None:
        """Each reading into ``training_host_<field>``: a gauge, or a counter (``_total``) that counts up to the
        reading, a total since start."""
        for field, value in dataclasses.asdict(host).items():
            name = f"training_host_{field}"
            if name in self._m:
                self._m[name].set(value)
            else:
                self._count_up(self._m[f"{name}_total"], name, value)

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
                from training_core.redact import redact

                log.warning(
                    "pushing metrics to %s failed (%d failure(s) since the last warning): %s; training goes on",
                    redact(self.cfg.pushgateway_url),
                    self._push_failures,
                    redact(str(exc)),
                )
                self._last_push_warning, self._push_failures = now, 0
            return False
        return True

    def _serve_http(self, port: int) -> None:
        from prometheus_client import start_http_server

        try:
            self._http_server, _ = start_http_server(port, registry=self.registry)
        except (OSError, OverflowError) as exc:  # OverflowError: a port past 65535
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
            # The cost figures, not the prices they were computed at.
            figures = {k: v for k, v in self._cost_reported.summary().items() if not k.endswith("_hour_usd")}
            try:
                self.system_sink.log_metrics(figures, step=self._global_step)
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
    system_sink: MetricSink | None = None,
) -> Telemetry:
    """The exporter of this rank, or a :class:`NullTelemetry` when ``cfg.enabled`` is false."""
    if not cfg.enabled:
        return NullTelemetry()
    return PrometheusTelemetry(cfg, scaling=scaling, labels=labels, world_size=world_size, system_sink=system_sink)
