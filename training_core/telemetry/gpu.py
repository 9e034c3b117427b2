"""The GPUs this process may use, read through NVML (pynvml).

Contract: :meth:`NvmlGpus.open` returns ``None`` (after one info log) where NVML is unusable (no bindings, no driver,
no GPU), so "no GPU metrics" is a normal state for the caller. Otherwise :meth:`NvmlGpus.read` gives one
:class:`GpuReading` per GPU that ``CUDA_VISIBLE_DEVICES`` gives this process, labelled with its NVML index, each
figure NVML could not give left ``None``; :meth:`NvmlGpus.take_xid_errors` counts the critical XID events since the
previous call without blocking. An NVML error is logged (once per function), never raised to the caller. pynvml is
imported by :meth:`NvmlGpus.open`, not when this module is.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

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


@dataclass
class GpuReading:
    """One GPU at one moment (each figure the exporter's ``training_gpu_<field>``); a field NVML could not give (not
    supported, an error) is ``None``."""

    gpu: str
    """Label of the GPU: its NVML (physical) index."""
    utilization_ratio: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    throttled: dict[str, bool] = field(default_factory=dict)
    """Clock-event reason -> active, for the reasons in :data:`THROTTLE_REASONS`."""


class NvmlGpus:
    """The GPUs this process may use, read through NVML (see the module docstring). Every read guards each NVML call
    on its own, so a field a GPU does not support (power on some boards, XID events on others) is left out without
    losing the rest. ``nvml`` is the pynvml module; a test hands handles to a real, uninitialised pynvml to walk every
    call path through NVML's error returns."""

    def __init__(self, nvml: Any, handles: Mapping[str, Any]) -> None:
        self.nvml = nvml
        self.handles = dict(handles)
        self._events = None
        self._failed_calls: set[str] = set()

    @classmethod
    def open(cls) -> "NvmlGpus | None":
        try:
            # NVIDIA's binding (nvidia-ml-py) provides the module; the deprecated `pynvml` shim package, which warned
            # in every process that imports torch, is not a dependency.
            import pynvml as nvml
        except ImportError as exc:
            log.info("GPU metrics off: the NVML bindings (nvidia-ml-py) are not installed (%s)", exc)
            return None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            log.info("GPU metrics off: NVML is not available on this machine (%s)", exc)
            return None
        try:
            handles = cls._visible_handles(nvml)
            problem = "" if handles else "NVML sees no GPU this process may use"
        except nvml.NVMLError as exc:
            problem = f"NVML could not list the GPUs ({exc})"
        if problem:
            log.info("GPU metrics off: %s", problem)
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
