"""Typed records that cross module boundaries: what a worker is asked to do (:class:`WorkerArgs`, built once by
:meth:`WorkerArgs.build` for Ray Train and the plain ``torch.distributed`` launcher) and what it reports
(:class:`StepRecord`, :class:`EpochRecord`, and the bounded :class:`StepLog` a checkpoint keeps).

Plain dataclasses of numbers and strings: importing this module loads neither torch nor Ray.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Self

from training_core.config import TrainingConfig


class _Record:
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Self:
        """The record of ``raw``'s entries that are fields of it, converted to the field's type (JSON stores ints as
        floats); any other entry is dropped."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        return cls(**{k: int(v) if types[k] == "int" else v for k, v in raw.items() if k in types})


@dataclass
class StepRecord(_Record):
    """The mean figures of one logged window of optimizer steps, over all ranks."""

    step: int
    """Global step that closed the window."""
    epoch: int
    """Epoch the window belongs to (0-based)."""
    train_loss: float
    train_accuracy: float
    lr: float
    """Learning rate the window's last step used."""
    grad_norm: float
    """Global gradient norm of the window's last step, before clipping."""
    samples_per_s: float
    """Samples of all ranks over the window's wall time."""
    step_time_s: float
    """Mean wall time of one step in the window."""
    data_wait_s: float
    """Mean time one step waited for its batches."""
    allreduce_fraction: float
    """Share of the window's time during which gradient all-reduces were in flight."""
    elapsed_s: float = 0.0
    """Seconds the run had trained when the window closed, across resumes."""
    num_steps: int = 0
    """Optimizer steps in the window (0 in records written before it was recorded)."""
    tokens_per_s: float = 0.0
    """Tokens of all ranks over the window's wall time (language models; 0 for workloads without tokens)."""

    def metrics(self) -> dict[str, float]:
        """The figures logged per window (MLflow, console), keyed by metric name; tokens/s only where it applies."""
        skipped = ("step", "elapsed_s", "num_steps") + (() if self.tokens_per_s else ("tokens_per_s",))
        return {k: float(v) for k, v in dataclasses.asdict(self).items() if k not in skipped}


@dataclass
class EpochRecord(_Record):
    """One finished epoch: train figures over all ranks, validation, and the steady-state throughput."""

    epoch: int
    """Epochs completed (1-based)."""
    global_step: int
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float
    lr: float
    """Learning rate after the epoch's last step."""
    samples_per_s: float
    """Samples of all ranks over the epoch's step time (this run's part of the epoch when it resumed mid-epoch)."""
    steady_samples_per_s: float = 0.0
    """Throughput since the run (or its resume) started, warm-up steps excluded."""
    steady_steps: int = 0
    step_time_p50_s: float = 0.0
    step_time_p95_s: float = 0.0
    allreduce_fraction: float = 0.0
    """Share of the steady-state step time during which gradient all-reduces were in flight."""
    val_perplexity: float = math.nan
    """Language models: ``exp(val_loss)`` per token; NaN for other workloads."""
    tokens_per_s: float = 0.0
    """Tokens of all ranks over the epoch's step time (language models; 0 otherwise)."""

    def metric(self, name: str) -> float:
        """The value of a ranking metric (``val_accuracy``, ``val_loss``, see ``config.METRIC_DIRECTIONS``)."""
        return float(getattr(self, name))

    def to_dict(self) -> dict[str, float]:
        """Numbers only, as ``ray.train.report`` and the checkpoint's JSON take them."""
        return {k: float(v) for k, v in dataclasses.asdict(self).items()}


@dataclass
class StepLog:
    """Step records in step order, at most ``capacity`` of them.

    Once full, each new record first merges the two adjacent records that cover the fewest steps together
    (their figures averaged, weighted by steps): the log keeps a point every few steps over the whole run,
    and its size stops growing after ``capacity`` windows. The newest record is never merged away.
    """

    capacity: int = 64
    records: list[StepRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.capacity >= 2, "a step log needs room to merge"
        while len(self.records) > self.capacity:
            self._merge_narrowest()

    def append(self, record: StepRecord) -> None:
        self.records.append(record)
        if len(self.records) > self.capacity:
            self._merge_narrowest()

    def _span(self, index: int) -> int:
        """Steps covered by record ``index`` (from the previous record's step)."""
        return self.records[index].step - self.records[index - 1].step if index else max(1, self.records[0].num_steps)

    def _merge_narrowest(self) -> None:
        spans = [self._span(i) for i in range(len(self.records))]
        # The narrowest pair (i, i + 1), never the newest record's pair: the run's last figures stay as logged.
        i = min(range(len(self.records) - 2), key=lambda j: spans[j] + spans[j + 1])
        a, b = self.records[i], self.records[i + 1]
        na, nb = max(1, spans[i]), max(1, spans[i + 1])
        self.records[i : i + 2] = [_merged(a, b, na, nb)]

    @classmethod
    def from_list(cls, raw: Iterable[Mapping[str, Any] | StepRecord], *, capacity: int = 64) -> StepLog:
        records = [r if isinstance(r, StepRecord) else StepRecord.from_dict(r) for r in raw]
        return cls(capacity=capacity, records=records)


def _merged(a: StepRecord, b: StepRecord, na: int, nb: int) -> StepRecord:
    """One record for two adjacent windows of ``na`` and ``nb`` steps: step-weighted means, the rest as ``b`` has it."""
    total_time_s = a.step_time_s * na + b.step_time_s * nb

    def mean(x: float, y: float) -> float:
        return (x * na + y * nb) / (na + nb)

    def time_mean(x: float, y: float) -> float:
        return (x * a.step_time_s * na + y * b.step_time_s * nb) / total_time_s if total_time_s else 0.0

    return dataclasses.replace(
        b,
        train_loss=mean(a.train_loss, b.train_loss),
        train_accuracy=mean(a.train_accuracy, b.train_accuracy),
        samples_per_s=time_mean(a.samples_per_s, b.samples_per_s),
        tokens_per_s=time_mean(a.tokens_per_s, b.tokens_per_s),
        step_time_s=total_time_s / (na + nb),
        data_wait_s=mean(a.data_wait_s, b.data_wait_s),
        allreduce_fraction=time_mean(a.allreduce_fraction, b.allreduce_fraction),
        num_steps=na + nb,
    )


@dataclass
class MlflowRun:
    """The MLflow run a training run logs into."""

    tracking_uri: str
    run_id: str


@dataclass
class WorkerArgs:
    """What every rank's loop receives (:func:`training_core.train.loop.run_worker`)."""

    config: TrainingConfig
    data_dir: str
    """The prepared data (see :mod:`training_core.data`)."""
    checkpoint_root: str
    """Where this run's checkpoints live; the loop resumes from the newest valid one there."""
    job_labels: dict[str, str]
    """``execution``, ``node`` and ``attempt`` of the job, for the metrics' labels."""
    resume_from: str = ""
    """A checkpoint directory to continue from when ``checkpoint_root`` holds none (fine-tune, next slice)."""
    mlflow: MlflowRun | None = None
    log_params: bool | None = None
    """Log the config as MLflow params; ``None``: when the run does not resume."""
    warmup_steps_excluded: int | None = None
    """Steps left out of steady-state throughput and step-time percentiles; ``None``: min(5, total / 4)."""
    code_paths: list[str] = field(default_factory=list)
    """Directories the driver imported user code from (``workload.*`` import paths), put on each worker's
    ``sys.path`` before the workload is resolved, so user packages that are not installed travel too."""

    @classmethod
    def build(
        cls,
        cfg: TrainingConfig,
        *,
        data_dir: str,
        checkpoint_root: str,
        run_name: str,
        job_labels: Mapping[str, str] | None = None,
        **options: Any,
    ) -> WorkerArgs:
        """The one place worker arguments are made: on the driver, which resolves the Pushgateway URL for them."""
        cfg = dataclasses.replace(cfg, observability=cfg.observability.resolved())
        return cls(
            config=cfg,
            data_dir=data_dir,
            checkpoint_root=checkpoint_root,
            job_labels=worker_job_labels(run_name, job_labels),
            **options,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe, for Ray Train's ``train_loop_config``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> WorkerArgs:
        raw = dict(raw)
        raw["config"] = TrainingConfig.from_dict(raw["config"])
        raw["mlflow"] = MlflowRun(**raw["mlflow"]) if raw.get("mlflow") else None
        return cls(**raw)


def worker_job_labels(run_name: str, job_labels: Mapping[str, str] | None) -> dict[str, str]:
    """``execution``, ``node`` and ``attempt`` for the workers' metrics: the caller's (the Flyte task knows
    them), else the run name as the execution, ``local`` and attempt 0 (tuning, benchmarks, tests)."""
    labels = {"execution": run_name, "node": "local", "attempt": "0"}
    labels.update({k: str(v) for k, v in (job_labels or {}).items() if k in labels and str(v)})
    return labels
