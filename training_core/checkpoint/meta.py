"""A checkpoint's ``meta.json``: :class:`CheckpointMeta`, and its check when read back."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from training_core.checkpoint.layout import (
    MAX_REASON_CHARS,
    META_FILE,
    STEP_LOG_CAPACITY,
    CheckpointError,
    is_count,
    is_int,
    is_mapping,
    is_number,
    listed,
    parse_json,
)
from training_core.messages import clip, quote
from training_core.records import EpochRecord, StepLog, StepRecord


@dataclass
class CheckpointMeta:
    model_name: str
    classes: list[str]
    input_shape: list[int]
    mean: list[float]
    std: list[float]
    epoch: int
    """Epoch the run is in (0-based); with ``step_in_epoch == 0`` it has not started yet."""
    global_step: int
    """Optimizer steps completed."""
    config: dict[str, Any]
    step_in_epoch: int = 0
    """Optimizer steps of ``epoch`` already taken: a resume skips exactly these batches."""
    best_metric: float | None = None
    """Best value so far of the metric that ranks checkpoints (see ``CheckpointConfig``)."""
    metric: float | None = None
    """This checkpoint's value of that metric, when it was measured here."""
    history: list[EpochRecord] = field(default_factory=list)
    """One record per completed epoch: train/val loss and accuracy, LR, throughput."""
    step_log: list[StepRecord] = field(default_factory=list)
    """Logged step windows (loss, accuracy, LR, grad norm, samples/s), at most ``STEP_LOG_CAPACITY``: once full,
    adjacent windows are merged (see :class:`~training_core.records.StepLog`), so the file's size does not grow
    with the run's length. Every window is in MLflow at full resolution."""
    rng: dict[str, Any] = field(default_factory=dict)
    """Python and numpy RNG states per rank (JSON-safe); torch states live in ``trainer_state.pt``."""
    resumed_from_steps: list[int] = field(default_factory=list)
    """Global step each resume of this run started from (worker restarts, task retries)."""
    resume_timings: list[dict[str, float]] = field(default_factory=list)
    """Per resume: ``from_step``, ``restored_unix`` (state loaded), ``first_step_unix`` (first step done),
    ``num_workers`` (the world size it resumed on), ``preempted`` (1: resumed from a preemption checkpoint) and then
    ``lost_s``, the attempt's seconds from its start to that first step (counted in the cost as lost to the
    preemption; 0 with observability off)."""
    epoch_partial: dict[str, float] = field(default_factory=dict)
    """Loss, correct and sample sums of ``epoch`` so far, so a resumed epoch reports the same record."""
    mlflow_model_uri: str = ""
    mlflow_run_id: str = ""
    elapsed_s: float = 0.0
    """Seconds the run has trained so far, across resumes (the clock of ``step_log``'s ``elapsed_s``)."""
    num_parameters: int = 0
    """The model's parameter count (0 in checkpoints written before it): where it can be evaluated, without loading
    it (:func:`~training_core.evaluation.evaluation_placement`)."""
    saved_unix: float = 0.0
    """Unix time this metadata was written (0 in checkpoints written before it)."""
    preempted: bool = False
    """Written just in time because a worker was told to stop (SIGTERM): the run stopped at this very step, so
    a resume from it recomputes nothing."""
    data_remaining: list[list[int]] = field(default_factory=list)
    """Positions of ``epoch``'s global sample order not trained yet, as ``[start, stop)`` intervals
    (:mod:`training_core.loader`); empty at an epoch's start and in checkpoints written before it (which resume
    on the same number of workers only)."""
    data_exhausted: bool = False
    """Every sample of ``epoch``'s order was trained (``data_remaining`` is empty because nothing is left, not
    because the field predates it): written when a worker is told to stop at an epoch's last step, before its
    validation. A resume, on any number of workers, trains no more of that epoch."""
    data: dict[str, Any] = field(default_factory=dict)
    """The prepared data's description (:meth:`~training_core.data.Manifest.description`: workload, arrays, spec)
    that rebuilds the model; empty in checkpoints written before workloads (image classification)."""
    telemetry: dict[str, Any] = field(default_factory=dict)
    """Rank 0's telemetry for the Deck: ``samples`` (a bounded timeline of ``elapsed_s``, ``cpu_utilization``
    and ``gpu_utilization`` per GPU as ratios 0-1, ``memory_used_bytes`` and ``gpu_memory_used_bytes`` per GPU)
    and ``cost`` (``gpu_hours``, ``cpu_hours``, ``cost_usd`` and the prices). Empty with observability off."""

    def __post_init__(self) -> None:
        # From JSON the records arrive as mappings; a checkpoint written before the step log was bounded holds
        # every window, merged down here to the bound.
        self.history = [r if isinstance(r, EpochRecord) else EpochRecord.from_dict(r) for r in self.history]
        self.step_log = StepLog.from_list(self.step_log, capacity=STEP_LOG_CAPACITY).records

    @classmethod
    def from_dict(cls, raw: Any, *, where: str = META_FILE) -> CheckpointMeta:
        """The metadata in ``raw`` (the parsed ``meta.json``), checked before use.

        ``raw`` must be a JSON object with every required field, no unknown field, and each field of the type this
        module writes (records must hold their required figures as numbers). Fields added later take their
        defaults, so metadata written by earlier versions loads. Raises ``ValueError`` naming ``where``, the field,
        its value (quoted bounded in size) and what was expected."""
        if not isinstance(raw, dict):
            raise ValueError(f"{where} holds {quote(raw)}: expected a JSON object of checkpoint metadata")
        fields = dataclasses.fields(cls)
        unknown = [key for key in raw if key not in _META_FIELD_TYPES]
        if unknown:
            raise ValueError(
                f"{where} has unknown field(s) {listed(unknown)}: it was not written by this module; "
                f"valid fields are {', '.join(f.name for f in fields)}"
            )
        required = [
            f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in raw]
        if missing:
            raise ValueError(f"{where} lacks the required field(s) {', '.join(missing)}")
        for key, value in raw.items():
            is_valid, expected = _META_FIELD_TYPES[key]
            if not is_valid(value):
                raise ValueError(f"{where} field {key}={quote(value)} is invalid: expected {expected}")
        return cls(**raw)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _list_of(is_item: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(is_item(v) for v in value)


def _numbers_by_name(value: Any) -> bool:
    return isinstance(value, dict) and all(is_number(v) for v in value.values())


def _record_of(cls: type) -> Callable[[Any], bool]:
    """Whether a value is one record of ``cls`` as JSON holds it: its required fields present, its fields numbers
    (integral where the field is an int; JSON stores them as floats). Other keys are left to ``cls.from_dict``."""
    fields = dataclasses.fields(cls)
    required = {f.name for f in fields if f.default is dataclasses.MISSING}
    integral = {f.name for f in fields if f.type == "int"}
    numeric = {f.name for f in fields}

    def is_record(value: Any) -> bool:
        if not isinstance(value, dict) or not required <= value.keys():
            return False
        for key in numeric & value.keys():
            number = value[key]
            if not is_number(number) or (key in integral and not float(number).is_integer()):
                return False
        return True

    return is_record


def _is_rng_states(value: Any) -> bool:
    """Whether a value is the per-rank python/numpy RNG states :func:`training_core.rng.restore_rng` takes."""
    if not isinstance(value, dict):
        return False
    for rank, states in value.items():
        if not (isinstance(rank, str) and rank.isdigit() and isinstance(states, dict)):
            return False
        python, numpy = states.get("python"), states.get("numpy")
        if not (isinstance(python, list) and len(python) == 3 and _list_of(is_int)(python[1])):
            return False
        if not (isinstance(numpy, list) and len(numpy) == 5 and _list_of(is_int)(numpy[1])):
            return False
    return True


_META_FIELD_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model_name": (_is_str, "a string"),
    "classes": (_list_of(_is_str), "a list of strings"),
    "input_shape": (_list_of(is_count), "a list of integers >= 0"),
    "mean": (_list_of(is_number), "a list of numbers"),
    "std": (_list_of(is_number), "a list of numbers"),
    "epoch": (is_count, "an integer >= 0"),
    "global_step": (is_count, "an integer >= 0"),
    "config": (is_mapping, "a JSON object (the resolved config)"),
    "step_in_epoch": (is_count, "an integer >= 0"),
    "best_metric": (lambda v: v is None or is_number(v), "a number or null"),
    "metric": (lambda v: v is None or is_number(v), "a number or null"),
    "history": (_list_of(_record_of(EpochRecord)), "a list of epoch records (objects of numbers)"),
    "step_log": (_list_of(_record_of(StepRecord)), "a list of step records (objects of numbers)"),
    "rng": (_is_rng_states, "an object of per-rank 'python' and 'numpy' RNG states"),
    "resumed_from_steps": (_list_of(is_count), "a list of integers >= 0"),
    "resume_timings": (_list_of(_numbers_by_name), "a list of objects of numbers"),
    "epoch_partial": (_numbers_by_name, "an object of numbers"),
    "mlflow_model_uri": (_is_str, "a string"),
    "mlflow_run_id": (_is_str, "a string"),
    "elapsed_s": (is_number, "a number"),
    "telemetry": (is_mapping, "a JSON object"),
    "data_remaining": (
        _list_of(lambda v: isinstance(v, list) and len(v) == 2 and all(is_count(x) for x in v)),
        "a list of [start, stop] pairs of integers >= 0",
    ),
    "data_exhausted": (lambda v: isinstance(v, bool), "true or false"),
    "data": (is_mapping, "a JSON object (the prepared data's description)"),
    "preempted": (lambda v: isinstance(v, bool), "true or false"),
    "num_parameters": (is_count, "an integer >= 0"),
    "saved_unix": (is_number, "a number (Unix time)"),
}
"""How each field of :class:`CheckpointMeta` is checked when read from JSON, and what the message says it expects."""


def decode_meta(data: bytes, *, where: str) -> CheckpointMeta:
    raw = parse_json(data, where=where)
    try:
        return CheckpointMeta.from_dict(raw, where=where)
    except (ValueError, TypeError, ArithmeticError) as exc:  # the records' own checks, past the schema
        raise CheckpointError(clip(str(exc), 2 * MAX_REASON_CHARS)) from None
