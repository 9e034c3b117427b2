"""A checkpoint's ``meta.json``: :class:`CheckpointMeta`, and its check when read back."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable

from training_core.checkpoint.layout import (
    MAX_REASON_CHARS,
    META_FILE,
    SHA256_HEX,
    STEP_LOG_CAPACITY,
    CheckpointError,
    is_count,
    is_int,
    is_mapping,
    is_number,
    parse_json,
)
from training_core.messages import clip, listed, quote
from training_core.records import EpochRecord, StepLog, StepRecord
from training_core.schema import UNKNOWN_KEY_KINDS, Count, Problem, Rule, SchemaError, check, describe

_RNG_STATES = "an object of per-rank 'python' and 'numpy' RNG states"
_INTERVALS = "a list of [start, stop] pairs of integers >= 0"
_DESCRIPTION = "a JSON object (the prepared data's description)"


@dataclass
class CheckpointMeta:
    model_name: str
    classes: list[str]
    input_shape: list[Count]
    mean: list[float]
    std: list[float]
    epoch: Count
    """Epoch the run is in (0-based); with ``step_in_epoch == 0`` it has not started yet."""
    global_step: Count
    """Optimizer steps completed."""
    config: Annotated[dict[str, Any], Rule(is_mapping, "a JSON object (the resolved config)")]
    step_in_epoch: Count = 0
    """Optimizer steps of ``epoch`` already taken: a resume skips exactly these batches."""
    best_metric: float | None = None
    """Best value so far of the metric that ranks checkpoints (see ``CheckpointConfig``)."""
    metric: float | None = None
    """This checkpoint's value of that metric, when it was measured here."""
    history: Annotated[
        list[EpochRecord], Rule(_list_of(_record_of(EpochRecord)), "a list of epoch records (objects of numbers)")
    ] = field(default_factory=list)
    """One record per completed epoch: train/val loss and accuracy, LR, throughput."""
    step_log: Annotated[
        list[StepRecord], Rule(_list_of(_record_of(StepRecord)), "a list of step records (objects of numbers)")
    ] = field(default_factory=list)
    """Logged step windows (loss, accuracy, LR, grad norm, samples/s), at most ``STEP_LOG_CAPACITY``: once full,
    adjacent windows are merged (see :class:`~training_core.records.StepLog`), so the file's size does not grow
    with the run's length. Every window is in MLflow at full resolution."""
    rng: Annotated[dict[str, Any], Rule(_is_rng_states, _RNG_STATES)] = field(default_factory=dict)
    """Python and numpy RNG states per rank (JSON-safe); torch states live in ``trainer_state.pt``."""
    resumed_from_steps: list[Count] = field(default_factory=list)
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
    num_parameters: Count = 0
    """The model's parameter count (0 in checkpoints written before it): where it can be evaluated, without loading
    it (:func:`~training_core.evaluation.evaluation_placement`)."""
    saved_unix: Annotated[float, Rule(is_number, "a number (Unix time)")] = 0.0
    """Unix time this metadata was written (0 in checkpoints written before it)."""
    preempted: bool = False
    """Written just in time because a worker was told to stop (SIGTERM): the run stopped at this very step, so
    a resume from it recomputes nothing."""
    data_remaining: Annotated[list[list[int]], Rule(_list_of(_is_interval), _INTERVALS)] = field(default_factory=list)
    """Positions of ``epoch``'s global sample order not trained yet, as ``[start, stop)`` intervals
    (:mod:`training_core.data.loader`); empty at an epoch's start and in checkpoints written before it (which resume
    on the same number of workers only)."""
    data_exhausted: bool = False
    """Every sample of ``epoch``'s order was trained (``data_remaining`` is empty because nothing is left, not
    because the field predates it): written when a worker is told to stop at an epoch's last step, before its
    validation. A resume, on any number of workers, trains no more of that epoch."""
    data: Annotated[dict[str, Any], Rule(is_mapping, _DESCRIPTION)] = field(default_factory=dict)
    """The prepared data's description (:meth:`~training_core.data.Manifest.description`: workload, arrays, spec)
    that rebuilds the model; empty in checkpoints written before workloads (image classification)."""
    frozen_base_sha256: Annotated[str, Rule(_is_sha256_or_empty, "a sha256 (64 lowercase hex digits) or empty")] = ""
    """With frozen parameters (``model.lora``, ``model.freeze``): the checkpoint holds only the trainable ones, and
    this is the sha256 of the frozen base it needs (:mod:`~training_core.checkpoint.partial`); a model whose frozen
    parameters differ refuses it. Empty: the checkpoint holds the whole model (and in checkpoints written before)."""
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
        try:
            return check(cls, raw)
        except SchemaError as exc:
            raise _meta_error(exc.problems, raw, where=where) from None


def _meta_error(problems: list[Problem], raw: dict[str, Any], *, where: str) -> Exception:
    """The message of the first of the schema layer's ``problems`` with ``raw``: unknown fields first, then missing
    ones, then a field's value; a record's own check (``__post_init__``) as it raised."""
    unknown = [p.key for p in problems if p.kind in UNKNOWN_KEY_KINDS]
    if unknown:
        return ValueError(
            f"{where} has unknown field(s) {listed(unknown)}: it was not written by this module; "
            f"valid fields are {', '.join(f.name for f in dataclasses.fields(CheckpointMeta))}"
        )
    missing = [p.path for p in problems if p.kind == "missing"]
    if missing:
        return ValueError(f"{where} lacks the required field(s) {', '.join(missing)}")
    if problems[0].error is not None:
        return problems[0].error
    key = problems[0].loc[0]
    expected = describe(typing.get_type_hints(CheckpointMeta, include_extras=True)[key])
    return ValueError(f"{where} field {key}={quote(raw[key])} is invalid: expected {expected}")


def _list_of(is_item: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(is_item(v) for v in value)


def _record_of(cls: type) -> Callable[[Any], bool]:
    """Whether a value is one record of ``cls`` as JSON holds it: its required fields present, its fields numbers
    (integral where the field is an int; JSON stores them as floats). Other keys are left to ``cls.from_dict``."""
    fields = dataclasses.fields(cls)
    required = {f.name for f in fields if f.default is dataclasses.MISSING}
    integral = {f.name for f in fields if f.type == "int"}
    names = {f.name for f in fields}

    def is_record(value: Any) -> bool:
        if not isinstance(value, dict) or not required <= value.keys():
            return False
        known = [(name, value[name]) for name in names & value.keys()]
        return all(is_number(v) and (name not in integral or float(v).is_integer()) for name, v in known)

    return is_record


def _is_rng_states(value: Any) -> bool:
    """Whether a value is the per-rank python/numpy RNG states :func:`training_core.train.rng.restore_rng` takes."""
    if not isinstance(value, dict):
        return False
    for rank, states in value.items():
        if not (isinstance(rank, str) and rank.isdigit() and isinstance(states, dict)):
            return False
        for name, length in (("python", 3), ("numpy", 5)):  # random.getstate() and np.random.get_state()
            state = states.get(name)
            if not (isinstance(state, list) and len(state) == length and _list_of(is_int)(state[1])):
                return False
    return True


def _is_sha256_or_empty(value: Any) -> bool:
    return isinstance(value, str) and (value == "" or SHA256_HEX.fullmatch(value) is not None)


def _is_interval(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(is_count(x) for x in value)


def decode_meta(data: bytes, *, where: str) -> CheckpointMeta:
    raw = parse_json(data, where=where)
    try:
        return CheckpointMeta.from_dict(raw, where=where)
    except (ValueError, TypeError, ArithmeticError) as exc:  # the records' own checks, past the schema
        raise CheckpointError(clip(str(exc), 2 * MAX_REASON_CHARS)) from None
