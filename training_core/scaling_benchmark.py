"""Scaling benchmark: its preset config, plan checks, and the efficiency and parity arithmetic.

A *point* is one measured run: a model trained on ``num_workers`` workers by one launcher, ``ray`` (Ray Train,
:func:`training_core.runners.ray_train.fit`) or ``torch`` (plain ``torch.distributed``,
:func:`training_core.runners.launch.launch`).
:func:`efficiency_table` turns points into one row per model and worker count:

- scaling efficiency of each launcher against the smallest worker count ``b`` (1 by default):
  ``efficiency_n = (throughput_n / n) / (throughput_b / b)``, which is ``throughput_n / (n * throughput_1)``
  when ``b == 1``;
- parity: Ray's throughput over plain ``torch.distributed``'s at the same worker count.

Everything here is pure; pandas is imported where the table is built.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from training_core.config import TrainingConfig
from training_core.messages import clip

if TYPE_CHECKING:
    import pandas as pd

LAUNCHERS = ("ray", "torch")
DEFAULT_WORKER_COUNTS = (1, 2)

LAUNCHER_FIGURES = ("samples_per_s", "efficiency", "step_time_p50_s", "step_time_p95_s", "allreduce_fraction")
"""The table's columns of each launcher, named ``<launcher>_<figure>`` (``ray_efficiency``)."""
TABLE_COLUMNS = (
    "model",
    "num_workers",
    *(f"{launcher}_{figure}" for launcher in LAUNCHERS for figure in LAUNCHER_FIGURES),
    "parity",
)


def scaling_preset() -> TrainingConfig:
    """Defaults of the scaling benchmark: compute-bound and short.

    A small CNN on 32x32 synthetic images at 64 samples per worker step keeps a single CPU thread busy
    ~0.1 s per step, while its ~30k parameters all-reduce in well under a millisecond, so the figures show
    the launchers and the loop, not the network. One thread and one CPU per worker; 8 shards split evenly
    over 1, 2, 4 or 8 workers; every worker count runs the same 40 optimizer steps (``loop.epochs`` is only
    a cap, high enough for 8 workers; epoch boundaries are not timed). MLflow runs go to their own experiment.
    """
    return TrainingConfig.from_dict(
        {
            "data": {
                "dataset": "synthetic",
                "synthetic_num_samples": 8192,
                "synthetic_image_size": 32,
                "num_shards": 8,
            },
            "model": {"name": "small_cnn"},
            "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0},
            "schedule": {"name": "constant", "warmup_steps": 0},
            "loop": {"epochs": 8, "batch_size": 64, "max_steps": 40, "log_interval_steps": 10},
            "scaling": {"num_workers": 1, "cpus_per_worker": 1.0, "torch_threads_per_worker": 1},
            "precision": {"mode": "fp32"},
            "tracking": {"experiment_name": "scaling-benchmark"},
        }
    )


def check_plan(config: TrainingConfig, worker_counts: Sequence[int], models: Sequence[str]) -> list[str]:
    """Validate a benchmark plan before anything runs; return the models to measure (``models``, or the
    config's model when empty). Errors name the input, the value and the fix."""
    if not worker_counts:
        raise ValueError("worker_counts=[] is invalid: list at least one worker count, e.g. [1, 2, 4, 8]")
    bad = [n for n in worker_counts if not isinstance(n, int) or isinstance(n, bool) or n < 1]
    if bad:
        raise ValueError(f"worker_counts={list(worker_counts)} is invalid: {bad} are not whole numbers >= 1")
    if len(set(worker_counts)) != len(worker_counts):
        raise ValueError(f"worker_counts={list(worker_counts)} is invalid: each count may appear once")
    for model in models:  # each point's config must be valid for the workload (image models, GPT sizes...)
        try:
            point_config(config, model=model, num_workers=worker_counts[0])
        except ValueError as exc:
            raise ValueError(f"models={clip(str(list(models)))} is invalid: {model!r}: {exc}") from None
    if len(set(models)) != len(models):
        raise ValueError(f"models={list(models)} is invalid: each model may appear once")
    # Uneven shards would make some ranks skip part of the epoch, and the counts would train on different data.
    needed = math.lcm(*worker_counts)
    if config.data.num_shards % needed:
        raise ValueError(
            f"data.num_shards={config.data.num_shards} is invalid for worker_counts={list(worker_counts)}: every "
            f"count must split the shards evenly; use a multiple of {needed}"
        )
    return list(models) or [config.model.name]


def point_config(config: TrainingConfig, *, model: str, num_workers: int) -> TrainingConfig:
    """``config`` with one point's model and worker count (validated again)."""
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, name=model),
        scaling=dataclasses.replace(config.scaling, num_workers=num_workers),
    )


def point_name(launcher: str, *, model: str, num_workers: int) -> str:
    """Readable node name of one point, e.g. ``ray-small_cnn-2w``."""
    return f"{launcher}-{model}-{num_workers}w"


@dataclass
class ScalingPoint:
    """One measured run (steady state: warm-up steps and epoch boundaries excluded)."""

    model: str
    num_workers: int
    launcher: str
    """``ray`` (Ray Train) or ``torch`` (plain ``torch.distributed``)."""
    samples_per_s: float
    """Training throughput summed over all workers."""
    step_time_p50_s: float
    """Median optimizer-step wall time on rank 0."""
    step_time_p95_s: float
    """95th percentile of the step wall time on rank 0."""
    allreduce_fraction: float
    """Share of the step time during which gradient all-reduces were in flight (0 on one worker)."""

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r} is invalid: choose one of {', '.join(LAUNCHERS)}")
        if not self.samples_per_s > 0:
            raise ValueError(
                f"samples_per_s={self.samples_per_s!r} of "
                f"{point_name(self.launcher, model=self.model, num_workers=self.num_workers)} "
                "is invalid: it must be > 0; run more steps than loop warm-up excludes"
            )


def efficiency_table(points: Sequence[ScalingPoint]) -> "pd.DataFrame":
    """One row per model and worker count (sorted), with the columns of ``TABLE_COLUMNS``.

    Every (model, worker count) needs exactly one point of each launcher.
    """
    import pandas as pd

    by_key: dict[tuple[str, int, str], ScalingPoint] = {}
    for p in points:
        key = (p.model, p.num_workers, p.launcher)
        if key in by_key:
            raise ValueError(
                f"points hold {point_name(p.launcher, model=p.model, num_workers=p.num_workers)} twice: measure each "
                "point once"
            )
        by_key[key] = p
    cells = sorted({(model, n) for model, n, _ in by_key})
    missing = [
        point_name(launcher, model=m, num_workers=n)
        for m, n in cells
        for launcher in LAUNCHERS
        if (m, n, launcher) not in by_key
    ]
    if missing:
        raise ValueError(f"points lack {', '.join(missing)}: every worker count needs a ray and a torch run")
    rows = []
    for model, n in cells:
        row: dict[str, object] = {"model": model, "num_workers": n}
        base = min(count for m, count in cells if m == model)
        for launcher in LAUNCHERS:
            p, b = by_key[(model, n, launcher)], by_key[(model, base, launcher)]
            figures = dataclasses.asdict(p) | {"efficiency": (p.samples_per_s / n) / (b.samples_per_s / base)}
            row.update({f"{launcher}_{figure}": figures[figure] for figure in LAUNCHER_FIGURES})
        row["parity"] = by_key[(model, n, "ray")].samples_per_s / by_key[(model, n, "torch")].samples_per_s
        rows.append(row)
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))
