"""The job-start network checks: the all-reduce probe's bus bandwidth against ``scaling.min_allreduce_gbps``, and
the network NCCL chose against the one the environment asked for."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import KW_ONLY, asdict, dataclass
from typing import TYPE_CHECKING, Any

from training_core.parallel import nccl_network
from training_core.parallel.distributed import AllReduceProbe, probe_allreduce

if TYPE_CHECKING:
    import torch

    from training_core.config import ScalingConfig
    from training_core.metrics import MetricSink
    from training_core.parallel.distributed import WorkerRuntime

log = logging.getLogger("training_core")


@dataclass
class NetworkChecks:
    """What the job-start all-reduce measured (None on one rank) and the network NCCL chose on this rank (None off
    GPUs, or with NCCL's log off)."""

    probe: AllReduceProbe | None
    nccl: nccl_network.NcclNetwork | None
    _: KW_ONLY
    rank: int
    world_size: int
    min_allreduce_gbps: float

    @classmethod
    def run(cls, runtime: WorkerRuntime, *, min_allreduce_gbps: float) -> NetworkChecks:
        """Measure the all-reduce (a collective), then read NCCL's choice (its communicator is up after it)."""
        probe = probe_allreduce(runtime.device, runtime.world_size)
        nccl = read_nccl_network(runtime, device=runtime.device, rank=runtime.rank)
        return cls(probe, nccl, rank=runtime.rank, world_size=runtime.world_size, min_allreduce_gbps=min_allreduce_gbps)

    def tell(self, telemetry: Any) -> None:
        """The all-reduce check's figures to this rank's telemetry (nothing on one rank)."""
        if self.probe is not None:
            telemetry.allreduce_probe(
                bus_bandwidth_bytes_per_s=self.probe.bus_bandwidth_bytes_per_s, latency_s=self.probe.latency_s
            )

    def report(self, sink: MetricSink, *, global_step: int) -> None:
        """Rank 0: the all-reduce check to MLflow (at the step training starts from), and a warning when its bus
        bandwidth is below ``scaling.min_allreduce_gbps``."""
        probe = self.probe
        if probe is None or self.rank != 0:
            return
        gbps = probe.bus_bandwidth_bytes_per_s * 8 / 1e9
        if self.nccl is not None:
            mismatch = nccl_network.mismatch(self.nccl, os.environ) or ""
            sink.log_dict(asdict(self.nccl) | {"mismatch": mismatch}, f"nccl_network/step-{global_step}.json")
        sink.log_metrics(
            {"allreduce_bus_bandwidth_gbps": gbps, "allreduce_latency_s": probe.latency_s}, step=global_step
        )
        log.info(
            "all-reduce check over %d ranks: bus bandwidth %.2f Gbit/s (%d MiB buffer), latency %.3f ms",
            self.world_size,
            gbps,
            probe.size_bytes // 2**20,
            probe.latency_s * 1e3,
        )
        if gbps < self.min_allreduce_gbps:
            log.warning(
                "all-reduce bus bandwidth %.2f Gbit/s is below scaling.min_allreduce_gbps=%g: check the network "
                "interface the collectives use (NCCL_SOCKET_IFNAME, NCCL_DEBUG=INFO shows whether NCCL fell back to "
                "TCP sockets)",
                gbps,
                self.min_allreduce_gbps,
            )


def read_nccl_network(runtime: Any, *, device: torch.device, rank: int) -> nccl_network.NcclNetwork | None:
    """After the job-start all-reduce (NCCL's communicator is up): the network NCCL chose on this rank, from its
    log, with a warning naming the variable when it is not the one the environment asked for (a silent fallback to
    TCP sockets). None off GPUs, or with NCCL's log off (a user's own ``NCCL_DEBUG``)."""
    directory = getattr(runtime, "nccl_debug_dir", None)
    if directory is None or device.type != "cuda":
        return None
    found = nccl_network.read(directory)
    if found is None:
        return None
    reason = nccl_network.mismatch(found, os.environ)
    if reason is not None:
        log.warning("rank %d: NCCL is not on the network it was told to use: %s", rank, reason)
    elif rank == 0:
        log.info("NCCL network: %s", found.describe())
    return found


def prepare_nccl_env(scaling: ScalingConfig) -> str | None:
    """``scaling.nccl_env`` into this process's environment, before the first collective creates NCCL's communicators,
    and on GPUs NCCL's INFO log (the network it chooses) into a file read after the job-start all-reduce. Returns
    that file's directory; None off GPUs or when a user's own ``NCCL_DEBUG`` wins (the check is then off)."""
    os.environ.update(scaling.nccl_env)
    if not scaling.use_gpu or "NCCL_DEBUG" in os.environ:
        return None
    directory = tempfile.mkdtemp(prefix="nccl-")
    os.environ.update(nccl_network.debug_env(directory))
    return directory
