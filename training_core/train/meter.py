"""A run's figures: the sums behind every record (:class:`StepMeter`: the open log window, the epoch so far, the
steady state, and the window's non-finite steps, counted on the device so no step waits for it), and where they go
(:class:`Reporter`: the step log, the metric sink, the telemetry)."""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
import torch

from training_core.config import is_better
from training_core.parallel.distributed import all_reduce_sum
from training_core.records import EpochRecord, StepRecord
from training_core.train.accounting import RunAccounting, WindowTimes, goodput_metrics
from training_core.train.step import StepResult

if TYPE_CHECKING:
    from training_core.metrics import MetricSink
    from training_core.parallel.distributed import CommTimer
    from training_core.train.guards import DivergenceGuard
    from training_core.train.run_state import RunState


# Per-step times kept for the step-time percentiles of one run (bounded: 8 bytes each).
MAX_STEP_TIMES_KEPT = 100_000
# A workload's epoch figures in a checkpoint's ``epoch_partial``, beside the loop's own sums.
EPOCH_FIGURE_PREFIX = "sum."


@dataclass
class Sums:
    """Additive figures of a span of steps. Loss, correct and samples of an open window stay on the device
    (tensors) until the window closes, so a step never waits for the device."""

    loss: Any = 0.0
    """Sum of the steps' mean losses, finite steps only: this rank's in a window; in an epoch, each step's mean over
    the ranks."""
    nonfinite: Any = 0.0
    """Steps whose loss or gradient norm was not finite: this rank's in a window; in an epoch, the steps' mean over
    the ranks (the ranks flag the same steps)."""
    samples: Any = 0.0
    tokens: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    """The workload's sums (:attr:`StepResult.sums`), by name."""
    time_s: float = 0.0
    data_s: float = 0.0
    comm_s: float = 0.0
    steps: int = 0


@dataclass
class NonFiniteSteps:
    """A closed window's steps whose loss or gradient norm was not finite."""

    num_steps: int
    """How many: the same on every rank (a reduced figure)."""
    first_step: int | None
    """Global step of this rank's first one; None when only other ranks had one."""
    loss: float
    """This rank's loss at ``first_step``."""
    grad_norm: float


class NonFiniteTally:
    """This rank's non-finite steps of the open window, counted on the device (no step waits for it): how many,
    how many steps came before the first, and the first one's loss and gradient norm; and the window's last
    finite gradient norm (what its record reports)."""

    def __init__(self, device: torch.device) -> None:
        self.count = torch.zeros((), dtype=torch.long, device=device)
        self.steps_before_first = torch.zeros((), dtype=torch.long, device=device)
        self.first = torch.full((2,), math.nan, dtype=torch.float64, device=device)
        self.last_finite_grad_norm = torch.full((), math.nan, dtype=torch.float64, device=device)

    def add(self, result: StepResult) -> None:
        is_first = result.nonfinite & (self.count == 0)
        values = torch.stack([result.loss.double(), result.grad_norm.double()])
        self.first = torch.where(is_first, values, self.first)
        self.count += result.nonfinite
        self.steps_before_first += self.count == 0
        self.last_finite_grad_norm = torch.where(result.nonfinite, self.last_finite_grad_norm, values[1])

    def read(self, *, num_steps: int, window_end_step: int, window_steps: int) -> NonFiniteSteps:
        """The window's figures, once its ``num_steps`` over all ranks are known (a host read: window end only)."""
        if not num_steps:
            return NonFiniteSteps(num_steps=0, first_step=None, loss=math.nan, grad_norm=math.nan)
        before, (loss, grad_norm) = int(self.steps_before_first), self.first.tolist()
        first_step = window_end_step - window_steps + before + 1 if int(self.count) else None
        return NonFiniteSteps(num_steps=num_steps, first_step=first_step, loss=loss, grad_norm=grad_norm)


class StepMeter:
    """The sums behind every record: the open log window, the epoch so far (across a resume: it is saved in
    checkpoints) and the steady state (this run's steps after warm-up)."""

    def __init__(
        self,
        *,
        world_size: int,
        device: torch.device,
        global_batch: int,
        warmup_steps_excluded: int,
        metrics: Callable[[Mapping[str, float]], dict[str, float]],
    ):
        self.world_size, self.device, self.metrics = world_size, device, metrics
        self.global_batch, self.warmup_steps_excluded = global_batch, warmup_steps_excluded
        self.window, self.epoch = Sums(), Sums()
        self.tally = NonFiniteTally(device)
        self.steady, self.steady_step_times_s = Sums(), []

    def step(self, result: StepResult, *, global_step: int, step_time_s: float, data_wait_s: float, comm_s: float):
        w = self.window
        w.loss += torch.where(result.nonfinite, 0.0, result.loss)
        w.nonfinite += result.nonfinite
        w.samples += result.num_samples
        w.tokens += result.num_tokens
        for name, value in result.sums.items():
            w.figures[name] = w.figures.get(name, 0.0) + value
        self.tally.add(result)
        w.time_s += step_time_s
        w.data_s += data_wait_s
        w.comm_s += comm_s
        w.steps += 1
        if global_step > self.warmup_steps_excluded:
            s = self.steady
            s.time_s, s.comm_s, s.steps = s.time_s + step_time_s, s.comm_s + comm_s, s.steps + 1
            if len(self.steady_step_times_s) < MAX_STEP_TIMES_KEPT:
                self.steady_step_times_s.append(step_time_s)

    def close_window(
        self, *, global_step: int, epoch: int, lr: float, elapsed_s: float
    ) -> tuple[StepRecord, NonFiniteSteps]:
        """The window's record over all ranks, and its non-finite steps (a collective: every rank calls it at the
        same steps, and all read the same count). Loss and gradient norm are over its finite steps (NaN if none)."""
        w, e = self.window, self.epoch
        names = sorted(w.figures)
        loss_sum, nonfinite, samples, tokens, *values = all_reduce_sum(
            [float(w.loss), float(w.nonfinite), float(w.samples), w.tokens, *(float(w.figures[n]) for n in names)],
            self.device,
        )
        figures = dict(zip(names, values))
        # The epoch keeps per-step means over the ranks (ranks train equal shares of each step's global batch): an
        # elastic run that resumes an epoch on another number of workers weighs every step alike, before and after.
        e.loss += loss_sum / self.world_size
        e.nonfinite += nonfinite / self.world_size
        e.samples += samples
        e.tokens += tokens
        e.time_s += w.time_s
        for name, value in figures.items():
            e.figures[name] = e.figures.get(name, 0.0) + value
        # Ranks flag the same steps (see train_step), so the mean over ranks is the window's count; rounded up,
        # a step flagged on one rank only still counts.
        found = self.tally.read(
            num_steps=math.ceil(nonfinite / self.world_size), window_end_step=global_step, window_steps=w.steps
        )
        grad_norm = float(self.tally.last_finite_grad_norm)
        self.window, self.tally = Sums(), NonFiniteTally(self.device)
        num_finite = w.steps * self.world_size - nonfinite
        record = StepRecord(
            step=global_step,
            epoch=epoch,
            train_loss=loss_sum / num_finite if num_finite > 0 else math.nan,
            train_accuracy=self.metrics(figures).get("accuracy", math.nan),
            lr=lr,
            grad_norm=grad_norm,
            samples_per_s=samples / w.time_s if w.time_s else 0.0,
            tokens_per_s=tokens / w.time_s if w.time_s else 0.0,
            step_time_s=w.time_s / w.steps,
            data_wait_s=w.data_s / w.steps,
            allreduce_fraction=w.comm_s / w.time_s if w.time_s else 0.0,
            elapsed_s=elapsed_s,
            num_steps=w.steps,
        )
        return record, found

    def close_epoch(
        self, *, epoch: int, global_step: int, steps_in_epoch: int, val: dict[str, float], lr: float
    ) -> EpochRecord:
        """The finished epoch's record (epoch sums already reduced), and a fresh epoch."""
        e, s = self.epoch, self.steady
        self.epoch = Sums()
        num_finite = steps_in_epoch - e.nonfinite
        return EpochRecord(
            epoch=epoch + 1,
            global_step=global_step,
            train_loss=e.loss / num_finite if num_finite > 0 else math.nan,
            train_accuracy=self.metrics(e.figures).get("accuracy", math.nan),
            val_loss=val["loss"],
            val_accuracy=val.get("accuracy", math.nan),
            val_perplexity=val.get("perplexity", math.nan),
            lr=lr,
            samples_per_s=e.samples / e.time_s if e.time_s else 0.0,
            tokens_per_s=e.tokens / e.time_s if e.time_s else 0.0,
            steady_samples_per_s=self.global_batch * s.steps / s.time_s if s.time_s else 0.0,
            steady_steps=s.steps,
            step_time_p50_s=_percentile(self.steady_step_times_s, 50),
            step_time_p95_s=_percentile(self.steady_step_times_s, 95),
            allreduce_fraction=s.comm_s / s.time_s if s.time_s else 0.0,
        )

    def epoch_sums(self) -> dict[str, float]:
        """The epoch's reduced sums, for a checkpoint (a resume mid-epoch reports the same epoch record): the sum of
        the steps' mean losses over the ranks and the count of non-finite steps, samples and time, and the
        workload's figures as ``sum.<name>``."""
        e = self.epoch
        saved = {
            "step_loss": float(e.loss),
            "nonfinite_steps": float(e.nonfinite),
            "samples": e.samples,
            "tokens": e.tokens,
            "time_s": e.time_s,
        }
        return saved | {f"{EPOCH_FIGURE_PREFIX}{name}": value for name, value in e.figures.items()}

    def restore_epoch_sums(self, saved: dict[str, float]) -> None:
        figures = {k[len(EPOCH_FIGURE_PREFIX) :]: v for k, v in saved.items() if k.startswith(EPOCH_FIGURE_PREFIX)}
        if "correct" in saved:  # written before workloads: image classification's count
            figures = {"correct": saved["correct"], "samples": saved.get("samples", 0.0)}
        if "step_loss" in saved:
            loss, nonfinite = saved["step_loss"], saved.get("nonfinite_steps", 0.0)
        else:  # written before elastic runs: sums over every rank's steps, of a run on this many workers
            loss, nonfinite = saved.get("loss", 0.0) / self.world_size, saved.get("nonfinite", 0.0) / self.world_size
        self.epoch = Sums(
            loss=loss,
            nonfinite=nonfinite,
            samples=saved.get("samples", 0.0),
            tokens=saved.get("tokens", 0.0),
            time_s=saved.get("time_s", 0.0),
            figures=figures,
        )


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


@dataclass
class Reporter:
    """Every rank reports at the same steps (closing a window or an epoch reduces over the ranks); the sink writes
    rank 0's."""

    meter: StepMeter
    _: KW_ONLY
    telemetry: Any
    sink: MetricSink
    comm_timer: CommTimer
    guard: DivergenceGuard
    accounting: RunAccounting
    """Goodput, stragglers and ETA (:mod:`training_core.train.accounting`)."""

    def step(self, result: StepResult, state: RunState, *, step_time_s: float, data_wait_s: float) -> None:
        """A finished step's times (and its all-reduce time) into the meter's sums and the telemetry."""
        comm_s = self.comm_timer.take_step_seconds()
        self.meter.step(
            result, global_step=state.global_step, step_time_s=step_time_s, data_wait_s=data_wait_s, comm_s=comm_s
        )
        self.accounting.step(
            global_step=state.global_step, step_time_s=step_time_s, data_wait_s=data_wait_s, comm_wait_s=comm_s
        )
        self.telemetry.step(
            duration_s=step_time_s,
            num_samples=result.num_samples,
            num_tokens=result.num_tokens,
            data_wait_s=data_wait_s,
            comm_s=comm_s,
        )

    def close_window(self, state: RunState, *, epoch: int, lr: float) -> None:
        """Close the log window: the accounting's verdicts go to the telemetry, its non-finite steps meet
        ``loop.nonfinite_policy`` (all ranks read the same reduced count, so all stop together, before anything
        non-finite is logged or saved), then its record is emitted unless no step of it was finite."""
        w = self.meter.window
        times = WindowTimes(steps=w.steps, step_s=w.time_s, data_wait_s=w.data_s, comm_wait_s=w.comm_s)
        record, nonfinite = self.meter.close_window(
            global_step=state.global_step, epoch=epoch, lr=lr, elapsed_s=state.elapsed_s
        )
        self.accounting.window(times, global_step=state.global_step)  # a collective
        self.telemetry.stragglers(self.accounting.own_causes())
        if self.accounting.progress is not None and self.accounting.progress.eta_s is not None:
            self.telemetry.progress(self.accounting.progress)
        self.telemetry.goodput(self.accounting.execution)
        if nonfinite.num_steps:
            self.guard.window(nonfinite, lr=lr, global_step=state.global_step)
        if math.isfinite(record.train_loss):  # to the step log, the metric sink and the telemetry
            state.step_log.append(record)
            self.sink.log_metrics(record.metrics() | self.accounting.progress_metrics(), step=record.step)
            self.telemetry.window(record.metrics(), global_step=record.step)

    def close_epoch(
        self, val: dict[str, float], state: RunState, *, epoch: int, steps_in_epoch: int, lr: float, best_metric: str
    ) -> EpochRecord:
        """The epoch's record from its sums and its validation figures ``val`` (finite: checked first), into the
        history, the telemetry and the sink; the run's best ``best_metric`` so far updated."""
        self.accounting.stall("evaluation")  # validation ran since the epoch's last step (or the stall after it)
        self.guard.require_finite_validation(val["loss"], global_step=state.global_step)
        record = self.meter.close_epoch(
            epoch=epoch, global_step=state.global_step, steps_in_epoch=steps_in_epoch, val=val, lr=lr
        )
        state.history.append(record)
        self.telemetry.validation(loss=val["loss"], accuracy=val.get("accuracy", math.nan))
        self.sink.log_metrics({f"val_{name}": value for name, value in val.items()}, step=state.global_step)
        if is_better(best_metric, record.metric(best_metric), state.best_metric):
            state.best_metric = record.metric(best_metric)
        return record

    def checkpoint_stall(self, seconds: float, *, global_step: int) -> None:
        """A checkpoint write held the loop for ``seconds``: into the sink and the accounting."""
        self.sink.log_metrics({"checkpoint_stall_s": seconds}, step=global_step)
        self.accounting.stall("checkpoint")

    def sync_goodput(self, state: RunState) -> None:
        """Before a checkpoint: the ranks' goodput summed (a collective) for its meta, the telemetry and the sink."""
        done = state.global_step >= self.accounting.total_steps or state.epoch >= self.accounting.end_epoch
        execution = self.accounting.sync(outcome="finished" if done else "running")
        self.telemetry.goodput(execution)
        self.sink.log_metrics(goodput_metrics(execution), step=state.global_step)

    def telemetry_snapshot(self) -> dict[str, Any]:
        """A checkpoint's ``meta.telemetry``: the telemetry's, and the accounting's goodput and rank table."""
        return self.telemetry.snapshot() | self.accounting.snapshot()
