"""The job's cost: the GPUs and CPUs its workers hold over wall time, at the configured prices.

Contract: :func:`job_cost` only computes: world size (the workers running now) x GPUs (or CPUs) per worker x this
attempt's wall seconds, plus ``prior``, the ``cost`` summary of earlier attempts and restarts as
:meth:`JobCost.summary` writes it into a checkpoint's ``meta.telemetry``, so the cost carries across restarts and
retries. It measures nothing; the exporter reports it (counters of GPU- and CPU-seconds, a gauge of dollars) and
logs the final one to MLflow.

The part lost to preemptions is split out of that total: after each resume from a just-in-time (preemption)
checkpoint, the wall seconds from the resumed attempt's start (its worker process's, under Ray Train) to its first
optimizer step (``lost_wall_s``) times what the workers hold. Those seconds are paid for and train nothing (imports,
joining the process group, the model built, the checkpoint read); the preempted attempt's steps up to its checkpoint
are kept, so no training is lost with them. Time between attempts, when no worker runs, is in neither figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from training_core.config import ObservabilityConfig, ScalingConfig


@dataclass(frozen=True)
class JobCost:
    gpu_seconds: float
    cpu_seconds: float
    gpu_hour_usd: float
    cpu_hour_usd: float
    preemption_gpu_seconds: float = 0.0
    """Of ``gpu_seconds``, those held without training after preemptions (see the module docstring)."""
    preemption_cpu_seconds: float = 0.0
    """Of ``cpu_seconds``, those held without training after preemptions."""

    @property
    def cost_usd(self) -> float:
        return self._usd(self.gpu_seconds, self.cpu_seconds)

    @property
    def preemption_cost_usd(self) -> float:
        return self._usd(self.preemption_gpu_seconds, self.preemption_cpu_seconds)

    def _usd(self, gpu_seconds: float, cpu_seconds: float) -> float:
        return gpu_seconds / 3600 * self.gpu_hour_usd + cpu_seconds / 3600 * self.cpu_hour_usd

    def summary(self) -> dict[str, float]:
        """The ``cost`` entry of the checkpoint's ``meta.telemetry`` (what the Deck shows)."""
        return {
            "gpu_hours": self.gpu_seconds / 3600,
            "cpu_hours": self.cpu_seconds / 3600,
            "cost_usd": self.cost_usd,
            "gpu_hour_usd": self.gpu_hour_usd,
            "cpu_hour_usd": self.cpu_hour_usd,
            "preemption_gpu_hours": self.preemption_gpu_seconds / 3600,
            "preemption_cpu_hours": self.preemption_cpu_seconds / 3600,
            "preemption_cost_usd": self.preemption_cost_usd,
        }


def job_cost(
    scaling: ScalingConfig,
    prices: ObservabilityConfig,
    *,
    wall_s: float,
    prior: Mapping[str, float] | None = None,
    num_workers: int | None = None,
    lost_wall_s: float = 0.0,
) -> JobCost:
    """What the job's workers held over ``wall_s`` seconds, plus ``prior`` (see the module docstring). The world size
    is ``num_workers``, the workers running now (default ``scaling.num_workers``): an elastic run that goes on after a
    lost node holds fewer. ``lost_wall_s``, of ``wall_s``, went to start-up after a preemption."""
    prior = prior or {}
    workers = scaling.num_workers if num_workers is None else num_workers
    gpus = workers * scaling.gpus_per_worker if scaling.use_gpu else 0
    cpus = workers * scaling.cpus_per_worker
    return JobCost(
        gpu_seconds=float(prior.get("gpu_hours", 0.0)) * 3600 + gpus * wall_s,
        cpu_seconds=float(prior.get("cpu_hours", 0.0)) * 3600 + cpus * wall_s,
        gpu_hour_usd=prices.gpu_hour_usd,
        cpu_hour_usd=prices.cpu_hour_usd,
        preemption_gpu_seconds=float(prior.get("preemption_gpu_hours", 0.0)) * 3600 + gpus * lost_wall_s,
        preemption_cpu_seconds=float(prior.get("preemption_cpu_hours", 0.0)) * 3600 + cpus * lost_wall_s,
    )
