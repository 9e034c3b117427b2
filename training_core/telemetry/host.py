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
    """One read; the exporter sets each field into ``training_host_<field>`` (a counter's name adds ``_total``)."""

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
        self._start = self._io_bytes()

    def _io_bytes(self) -> list[float]:
        """Bytes received, sent, read and written so far (0.0 where a counter is missing)."""
        net, disk = self.psutil.net_io_counters(), self.psutil.disk_io_counters()  # disk: None in some containers
        return [
            *((float(net.bytes_recv), float(net.bytes_sent)) if net else (0.0, 0.0)),
            *((float(disk.read_bytes), float(disk.write_bytes)) if disk else (0.0, 0.0)),
        ]

    def read(self) -> HostReading:
        memory = self.psutil.virtual_memory()
        io_bytes = [max(0.0, now - start) for now, start in zip(self._io_bytes(), self._start)]
        return HostReading(
            self.psutil.cpu_percent(interval=None) / 100.0, float(memory.used), float(memory.total), *io_bytes
        )
