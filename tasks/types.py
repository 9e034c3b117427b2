"""Typed inputs and outputs passed between the pipeline's tasks.

Every artifact is a ``FlyteDirectory`` or ``FlyteFile`` so Flyte tracks it in the execution's raw-output
location; scalar results are plain typed fields so FlyteConsole shows them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from training_core.evaluation import EvalReport
from training_core.tracking import Promotion

if TYPE_CHECKING:
    from training_core.records import EpochRecord


@dataclass
class PrepProvenance:
    """Which prepared data a run uses: what it was prepared from, when, and whether this run prepared it."""

    inputs_fingerprint: str = ""
    """sha256 of what prep read (:mod:`training_core.data.fingerprint`: the data's files or objects, the tokenizer, the
    user code that prepares it), part of prep's cache key; empty for data prepared without one (a direct call)."""
    created_at: str = ""
    """When prep wrote the data: UTC, ISO 8601."""
    run_token: str = ""
    """The random token of the pipeline run whose prep wrote the data (kept out of prep's cache key)."""
    cache_hit: Optional[bool] = None
    """Whether this run took the data from Flyte's cache (prepared by an earlier run): set by ``note_prepared``;
    ``None`` where it is not known (prep's own output, or a record as cached tasks downstream are keyed)."""

    def describe(self) -> str:
        """The words for logs and reports: ``inputs fingerprint <16 hex>, created <when>, <who prepared it>``."""
        reuse = {
            True: "from Flyte's cache (prepared by an earlier run)",
            False: "prepared by this run",
            None: "cache hit not recorded",
        }[self.cache_hit]
        return f"inputs fingerprint {self.inputs_fingerprint[:16] or 'none'}, created {self.created_at}, {reuse}"


@dataclass
class PreparedData:
    """Output of data prep (``prepare_data`` or ``prepare_on_ray``): sharded splits plus their manifest."""

    directory: FlyteDirectory
    """Shards (``<split>-NNNNN-of-NNNNN.npz``, or ``.parquet`` of encoded images) and ``manifest.json``; for image
    sources, where prep wrote them (the raw-output location, s3:// on a cluster)."""
    dataset: str
    num_classes: int
    """0 for a workload without classes (a language model)."""
    input_shape: list[int]
    """One input sample's shape: channels, height, width for images; the sequence length for text."""
    split_counts: dict[str, int]
    """Samples per split (train, val, test)."""
    workload: str = "image_classification"
    """The workload that prepared the data."""
    provenance: PrepProvenance = field(default_factory=PrepProvenance)
    """What the data was prepared from, when, and whether this run prepared it or took it from Flyte's cache."""

    def as_cached(self) -> "PreparedData":
        """This record as prep's cache holds it, without whether this run took it from there: what a cached task
        downstream (a tuning trial) is keyed by, so a later run whose prep hit the cache reuses its results."""
        return dataclasses.replace(self, provenance=dataclasses.replace(self.provenance, cache_hit=None))


@dataclass
class TrainMetrics:
    """Last-epoch figures of a training run."""

    epochs: int
    global_step: int
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float
    samples_per_s: float
    """Steady-state training throughput over all workers, warm-up steps excluded."""
    step_time_p50_s: float = 0.0
    """Median optimizer-step wall time (rank 0), warm-up steps excluded."""
    step_time_p95_s: float = 0.0
    """95th percentile of the step wall time, warm-up steps excluded."""
    allreduce_fraction: float = 0.0
    """Share of the steady-state step time during which gradient all-reduces were in flight (0 on 1 worker)."""
    val_perplexity: float = 0.0
    """Language models: per-token validation perplexity; 0 for other workloads (Flyte's type schema cannot carry
    NaN, and FlyteConsole shows the default)."""
    tokens_per_s: float = 0.0
    """Language models: training tokens/s over all workers; 0 for other workloads."""

    @classmethod
    def from_record(cls, *, epochs: int, global_step: int, record: EpochRecord) -> "TrainMetrics":
        """The figures of a run's last epoch record (``training_core.records.EpochRecord``)."""
        return cls(
            epochs=epochs,
            global_step=global_step,
            train_loss=record.train_loss,
            train_accuracy=record.train_accuracy,
            val_loss=record.val_loss,
            val_accuracy=record.val_accuracy,
            # A slice too short to leave warm-up has no steady-state figure: its epoch throughput stands in.
            samples_per_s=record.steady_samples_per_s or record.samples_per_s,
            step_time_p50_s=record.step_time_p50_s,
            step_time_p95_s=record.step_time_p95_s,
            allreduce_fraction=record.allreduce_fraction,
            val_perplexity=record.val_perplexity if math.isfinite(record.val_perplexity) else 0.0,
            tokens_per_s=record.tokens_per_s,
        )


@dataclass
class TrainGoodput:
    """Where the job's worker-seconds went, summed over all workers and Flyte attempts (the categories of
    ``training_core.telemetry.goodput``); all 0 for a checkpoint written before goodput was recorded."""

    goodput: float = 0.0
    """Productive worker-seconds over all of them (0-1)."""
    attempts: int = 0
    """Run attempts (the first, then one per resume: Ray Train restarts and Flyte retries)."""
    productive_s: float = 0.0
    data_wait_s: float = 0.0
    communication_s: float = 0.0
    """Communication not hidden behind compute."""
    checkpoint_s: float = 0.0
    evaluation_s: float = 0.0
    startup_s: float = 0.0
    """Scheduling to the first step: workers, imports, joining the group, the restore."""
    recomputed_s: float = 0.0
    """Steps trained again after a failure, from the last checkpoint."""
    preempted_s: float = 0.0
    hung_s: float = 0.0
    idle_s: float = 0.0

    @classmethod
    def from_summary(cls, saved: Optional[dict]) -> "TrainGoodput":
        """The figures of a checkpoint's ``meta.telemetry["goodput"]`` (None: not recorded)."""
        from training_core.telemetry.goodput import CATEGORIES, ExecutionGoodput

        execution = ExecutionGoodput.from_summary(saved)
        seconds = dict(zip(CATEGORIES, execution.seconds.as_list()))
        return cls(
            goodput=execution.goodput,
            attempts=len(execution.attempts),
            **{f"{name}_s": value for name, value in seconds.items()},
        )


@dataclass
class TrainedModel:
    """Output of ``train``: the final checkpoint and where MLflow tracked it."""

    checkpoint: FlyteDirectory
    """Final checkpoint directory (model.pt, trainer_state.pt, meta.json; under FSDP shards/ instead of model.pt)."""
    model_name: str
    metrics: TrainMetrics
    tracking_uri: str
    mlflow_run_id: str
    mlflow_model_uri: str
    """``models:/m-...`` URI of the model logged with its signature."""
    report: FlyteFile
    """The training Deck as a standalone HTML page."""
    goodput: TrainGoodput = field(default_factory=TrainGoodput)
    """Where the job's worker-seconds went: goodput ratio and seconds per category, all workers and attempts."""


@dataclass
class Evaluation:
    """Output of ``evaluate``: test-split metrics and their report."""

    metrics: EvalReport
    """The workload's test-split metrics (loss and the primary metric; top-5 and the confusion matrix for images,
    perplexity and continuations for language models)."""
    report: FlyteFile
    """The evaluation Deck as a standalone HTML page."""


@dataclass
class Registration:
    """Output of ``register_model``: what happened in the Model Registry, and why."""

    promotion: Promotion
    """The new version, whether the champion alias moved to it, and the reason."""
    tracking_uri: str
    reports: list[str] = field(default_factory=list)
    """Where the training and evaluation reports (the Decks) are."""
