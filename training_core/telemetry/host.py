"""The host's CPU, memory, network and disk I/O, read through psutil.

Contract: a :class:`HostSampler` imports psutil when it is constructed, not when this module is. Each
:meth:`HostSampler.read` gives a :class:`HostReading`: CPU utilisation (0 to 1, over the time since the previous read),
memory used and total, and the bytes received, sent, read and written since the sampler was constructed (never
negative; 0 where the host has no such counters, as for disks in some containers).
"""

from __future__ import annotations

from dataclasses import dataclass


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
