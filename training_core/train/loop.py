"""The training loop that runs on every rank: under Ray Train
(:func:`training_core.runners.ray_train.train_loop_per_worker`), or the plain ``torch.distributed`` launcher
(:mod:`training_core.runners.launch`).

:func:`run_worker` reads top to bottom: set up (:meth:`Trainer.setup`), resume (:meth:`Trainer.resume`),
train epoch by epoch (:meth:`Trainer.train`), finish. The :class:`Trainer` keeps the loop and hands every other job
to a part of :mod:`training_core.train`; the save policy is
:meth:`Checkpointer.should_save <training_core.checkpoint.Checkpointer.should_save>`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch

from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.data import Manifest, ShardStream
from training_core.evaluation import evaluate
from training_core.metrics import MetricSink, MlflowSink, build_sink, flatten
from training_core.parallel import sharding
from training_core.parallel.distributed import CommTimer, WorkerRuntime, broadcast_buffers_from_rank0
from training_core.records import EpochRecord, WorkerArgs
from training_core.telemetry import JobLabels, build_telemetry
from training_core.train import preemption
from training_core.train.accounting import RunAccounting
from training_core.train.batch_size import BatchPlanner
from training_core.train.epoch_data import EpochData, run_length
from training_core.train.guards import DivergenceGuard, OomRetry, PreemptionWatch
from training_core.train.local_sgd import LocalSgd
from training_core.train.meter import Reporter, StepMeter
from training_core.train.model import ModelExport, build_held_model
from training_core.train.network_checks import NetworkChecks
from training_core.train.optim import apply_hyperparameters, build_optimizer, build_scheduler, param_groups
from training_core.train.rng import gather_rng_states, restore_rng, seed_everything
from training_core.train.run_state import CheckpointWrites, RunState, choose_checkpoint
from training_core.train.step import StepResult, resolve_precision, train_step
from training_core.workloads import resolve_workload

log = logging.getLogger("training_core")


class Trainer:
    """One rank's training run: the stateful objects, the streams, and where results go.

    Every rank runs the same calls in the same order (collectives inside); rank 0 alone writes checkpoints,
    logs to the metric sink and logs the model.
    """

    def __init__(self, args: WorkerArgs, runtime: WorkerRuntime) -> None:
        self.args, self.cfg, self.runtime = args, args.config, runtime
        self.rank, self.world_size, self.device = runtime.rank, runtime.world_size, runtime.device
        self.accounting: RunAccounting | None = None
        """Goodput, stragglers and ETA, from :meth:`connect_outputs` on."""

    def setup(self) -> None:
        """Build the model, optimizer, schedule and streams from the config and the prepared data."""
        cfg, device = self.cfg, self.device
        torch.set_num_threads(cfg.scaling.torch_threads_per_worker)
        seed_everything(cfg.loop.seed)
        self.sharded = cfg.scaling.strategy == "fsdp"
        if self.sharded and device.type == "cpu":
            sharding.return_freed_host_memory()
        self.autocast_dtype, use_scaler = resolve_precision(cfg.precision.mode, device)
        self.manifest = manifest = Manifest.load(self.args.data_dir)
        self.workload = resolve_workload(cfg.workload)
        held, self.num_parameters, self.frozen_base_sha256 = build_held_model(
            cfg, self.workload, manifest, self.runtime, param_dtype=self.autocast_dtype
        )
        self.model, self.checkpoint_group = held.model, held.checkpoint_group
        self.comm_timer = CommTimer()
        if hasattr(self.model, "register_comm_hook"):
            self.comm_timer.install(self.model)
        self.optimizer = build_optimizer(cfg.optimizer, param_groups(cfg.optimizer, self.model))
        planner = BatchPlanner(self.model, self.workload, manifest, self.runtime, sharded=self.sharded)
        self.cfg = cfg = planner.plan(cfg)
        self.steps_per_epoch, self.total_steps, self.end_epoch = run_length(
            manifest, cfg.loop, world_size=self.world_size
        )
        self.scheduler = build_scheduler(cfg.schedule, self.optimizer, total_steps=self.total_steps)
        self.preemption = PreemptionWatch(cfg.checkpoint.preemption_grace_s, self.runtime)
        self.scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
        # What a checkpoint saves and a resume restores of the training's stateful objects.
        self.objects = dict(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler)
        self.local_sgd = LocalSgd(cfg.sync, rank=self.rank, world_size=self.world_size)
        self.to_device = self.workload.to_device(manifest, device)
        if held.channels_last:
            self.to_device = sharding.channels_last_inputs(self.to_device)
        train_stream = ShardStream(manifest, "train", rank=self.rank, world_size=self.world_size, data=cfg.data)
        self.val_stream = ShardStream(manifest, "val", rank=self.rank, world_size=self.world_size, data=cfg.data)
        self.epoch_data = EpochData(
            train_stream, cfg.loop, world_size=self.world_size, steps_per_epoch=self.steps_per_epoch
        )
        self.export = ModelExport(
            self.args.mlflow, cfg, manifest=manifest, workload=self.workload, rank=self.rank, sharded=self.sharded
        )
        warmup = self.args.warmup_steps_excluded
        self.meter = StepMeter(
            world_size=self.world_size,
            device=device,
            global_batch=cfg.loop.batch_size * cfg.loop.grad_accum_steps * self.world_size,
            warmup_steps_excluded=min(5, self.total_steps // 4) if warmup is None else warmup,
            metrics=self.workload.metrics,
        )
        self.network = NetworkChecks.run(self.runtime, min_allreduce_gbps=cfg.scaling.min_allreduce_gbps)
        self.telemetry = self.start_telemetry(cfg)
        self.oom = OomRetry(cfg.loop, rank=self.rank, telemetry=self.telemetry)

    def start_telemetry(self, cfg: TrainingConfig) -> Any:
        """This rank's telemetry (``observability``), told the job-start all-reduce check's figures."""
        mlflow = self.args.mlflow
        telemetry = build_telemetry(
            cfg.observability,
            scaling=cfg.scaling,
            world_size=self.world_size,
            labels=JobLabels(**self.args.job_labels, rank=str(self.rank), model=cfg.model.name),
            system_sink=MlflowSink(tracking_uri=mlflow.tracking_uri, run_id=mlflow.run_id)
            if self.rank == 0 and mlflow
            else None,
        )
        self.network.tell(telemetry)
        return telemetry

    def connect_outputs(self) -> None:
        """Checkpoint storage and the metric sink (after telemetry: the checkpointer reports to it)."""
        cfg, mlflow = self.cfg, self.args.mlflow
        self.writes = CheckpointWrites(
            self.args.checkpoint_root, cfg.checkpoint, objects=self.objects, observer=self.telemetry, rank=self.rank,
            sharded=self.sharded, process_group=self.checkpoint_group,
        )  # fmt: skip
        self.checkpointer = self.writes.checkpointer
        self.sink: MetricSink = build_sink(
            rank=self.rank,
            tracking_uri=mlflow.tracking_uri if mlflow else None,
            run_id=mlflow.run_id if mlflow else None,
        )
        self.guard = DivergenceGuard(cfg, self.runtime, telemetry=self.telemetry, checkpointer=self.checkpointer)
        self.accounting = RunAccounting.for_run(
            cfg, self.runtime, total_steps=self.total_steps, end_epoch=self.end_epoch, storage=self.checkpointer.storage
        )
        self.report = Reporter(
            self.meter, telemetry=self.telemetry, sink=self.sink, comm_timer=self.comm_timer, guard=self.guard,
            accounting=self.accounting,
        )  # fmt: skip

    def resume(self) -> None:
        """Restore the newest valid checkpoint of this run (a worker restart or a task retry), else the
        ``resume_from`` checkpoint (a fine-tune, the next slice of a trial), else start fresh."""
        cfg = self.cfg
        loaded, same_run = choose_checkpoint(
            self.checkpointer.storage, resume_from=self.args.resume_from, model=self.model, runtime=self.runtime
        )
        self.awaiting_first_step = loaded is not None
        self.state = RunState() if loaded is None else self.restore(loaded, same_run=same_run)
        if self.state.epoch >= self.end_epoch:  # this run's own: a retry after its last epoch trains nothing
            stop = "loop.stop_at_epoch" if cfg.loop.stop_at_epoch else "loop.epochs"
            if not same_run:
                raise ValueError(f"{stop}={self.end_epoch} is not past the checkpoint's epoch {self.state.epoch}: "
                                 f"there is nothing to train; raise {stop}")  # fmt: skip
            log.info("this run's checkpoint is at epoch %d, %s=%d: nothing is left to train", self.state.epoch, stop,
                     self.end_epoch)  # fmt: skip
        self.network.report(self.sink, global_step=self.state.global_step)
        if self.args.log_params if self.args.log_params is not None else loaded is None:
            extra = {"world_size": self.world_size, "steps_per_epoch": self.steps_per_epoch, "device": self.device.type}
            self.sink.log_params(flatten(cfg.to_dict()) | extra)
            self.sink.log_dict(cfg.to_dict(), "config.json")

    def restore(self, loaded: ckpt.LoadedCheckpoint, *, same_run: bool) -> RunState:
        """The stateful objects, the epoch's sums, the telemetry and the RNG from ``loaded``; returns its run state."""
        ckpt.restore(loaded, **self.objects)
        self.local_sgd.restore_replica(loaded, self.model, self.optimizer)
        apply_hyperparameters(self.cfg, self.optimizer, self.scheduler)
        state = RunState.resumed(loaded.meta, same_run=same_run)
        state.resume_timings[-1]["num_workers"] = float(self.world_size)  # an elastic run's shrink or growth
        self.meter.restore_epoch_sums(loaded.meta.epoch_partial)
        if same_run:  # a fine-tune from another run starts its own clock, cost and restart count
            state.resume_telemetry(self.telemetry, loaded, runtime=self.runtime, accounting=self.report.accounting)
        restore_rng(self.rank, loaded.meta.rng, loaded.trainer.get("rng", {}))
        if self.rank == 0:
            state.log_resumed(loaded.uri)
        return state

    def train(self) -> None:
        """Epochs from the resumed position to ``end_epoch`` (or ``total_steps``), each followed by validation,
        a checkpoint when the policy asks, and the epoch's report."""
        state = self.state
        for epoch in range(state.epoch, self.end_epoch):
            if state.global_step >= self.total_steps:
                break
            steps_this_epoch = self.train_epoch(epoch)
            if self.finish_epoch(epoch, steps_this_epoch):
                break

    def train_epoch(self, epoch: int) -> int:
        """The epoch's steps from the resumed position, with the log windows, interval checkpoints and a preemption
        stop they call for; returns the epoch's step it stopped at."""
        cfg, state, accum = self.cfg, self.state, self.cfg.loop.grad_accum_steps
        first_step = state.step_in_epoch
        steps_this_epoch, batches = self.epoch_data.open(
            epoch, first_step=first_step, remaining=state.data_remaining, max_steps=self.total_steps - state.global_step
        )
        # A step's wall time runs from the previous step's end, so logging and metric all-reduces count
        # against throughput; only the epoch boundary (validation, checkpoint) and checkpoint stalls do not.
        last_step_end = time.perf_counter()
        for step_in_epoch in range(first_step, steps_this_epoch):
            step_start = time.perf_counter()
            micro_batches = [self.to_device(next(batches)) for _ in range(accum)]
            data_wait_s = time.perf_counter() - step_start
            result, lr = self.optimizer_step(micro_batches)
            state.global_step, state.step_in_epoch = state.global_step + 1, step_in_epoch + 1
            is_epoch_end = step_in_epoch == steps_this_epoch - 1
            save_now = not is_epoch_end and self.checkpointer.should_save(state.global_step, epoch_end=False)
            # Reading the loss synchronises with the device: on GPU once per log window only. An epoch's
            # last step and a checkpoint step close the window, so a checkpoint never holds half a window.
            is_log_step = state.global_step % cfg.loop.log_interval_steps == 0 or is_epoch_end or save_now
            if self.device.type == "cuda" and is_log_step:
                torch.cuda.synchronize()  # queued kernels belong to this window's time, not the next one's
            step_end = time.perf_counter()
            step_time_s, last_step_end = step_end - last_step_end, step_end
            self.report.step(result, state, step_time_s=step_time_s, data_wait_s=data_wait_s)
            preempted = False
            if is_log_step:
                self.report.close_window(state, epoch=epoch, lr=lr)
                preempted = self.preemption.requested()
            if save_now or preempted:
                self.save_checkpoint(preempted=preempted)
                last_step_end = time.perf_counter()  # the stall is measured on its own, not as step time
            if preempted:
                self.preemption.stop(state.global_step, self.checkpointer)
        batches.close()  # the epoch's loader processes end now, not beside validation's
        return steps_this_epoch

    def finish_epoch(self, epoch: int, steps_this_epoch: int) -> bool:
        """Validation, a checkpoint when the policy asks (always after the last epoch), and the epoch's report;
        returns whether the run is done."""
        state, step, best_metric = self.state, self.state.global_step, self.cfg.checkpoint.best_metric
        self.local_sgd.at_epoch_end(self.model, step)
        record = self.validate(epoch=epoch, steps_in_epoch=steps_this_epoch)
        state.epoch, state.step_in_epoch, state.data_remaining = epoch + 1, 0, None
        done = step >= self.total_steps or epoch == self.end_epoch - 1
        if done:  # rank 0 logs the model to MLflow when the run trained its full budget (a collective)
            full_budget = step >= self.total_steps or epoch == self.cfg.loop.epochs - 1
            model_uri = self.export.log_checked(self.model, self.guard, full_budget=full_budget, global_step=step)
            self.save_checkpoint(metric=record.metric(best_metric), model_uri=model_uri)
            self.checkpointer.wait()  # the final checkpoint is the task's output: it must be on storage
        elif self.checkpointer.should_save(step, epoch_end=True):
            self.save_checkpoint(metric=record.metric(best_metric))
        self.runtime.report(record.to_dict())
        return done

    def optimizer_step(self, batches: Sequence[Any]) -> tuple[StepResult, float]:
        """:func:`train_step` over ``batches`` (as :class:`~training_core.train.guards.OomRetry` splits and retries
        it), the schedule's step and local SGD's averaging; returns the step's result and the LR it used."""
        result = self.oom.run(self.train_step, batches, optimizer=self.optimizer, global_step=self.state.global_step)
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        if self.awaiting_first_step:
            self.state.first_step_taken(self.telemetry)
            self.awaiting_first_step = False
        self.local_sgd.after_update(self.model, self.state.global_step)
        return result, lr

    def train_step(self, micro_batches: Sequence[Any]) -> StepResult:
        return train_step(
            model=self.model,
            optimizer=self.optimizer,
            scaler=self.scaler,
            micro_batches=micro_batches,
            autocast_dtype=self.autocast_dtype,
            max_grad_norm=self.cfg.optimizer.max_grad_norm,
            skip_nonfinite=self.cfg.loop.nonfinite_policy == "skip_step",
            loss_fn=self.workload.loss,
            sync_gradients=self.local_sgd.syncs_gradients(self.state.global_step),
        )

    def validate(self, *, epoch: int, steps_in_epoch: int) -> EpochRecord:
        """Validation on every rank's share of the split, the epoch's record, and the best metric so far."""
        broadcast_buffers_from_rank0(self.model)
        val = evaluate(
            self.model,
            self.val_stream.eval_batches(batch_size=min(256, self.cfg.loop.batch_size * 4)),
            workload=self.workload,
            to_device=self.to_device,
            device=self.device,
            autocast_dtype=self.autocast_dtype,
            all_reduce=True,
            lockstep=self.sharded,
        ).metrics
        lr, best_metric = self.optimizer.param_groups[0]["lr"], self.cfg.checkpoint.best_metric
        return self.report.close_epoch(
            val, self.state, epoch=epoch, steps_in_epoch=steps_in_epoch, lr=lr, best_metric=best_metric
        )

    def save_checkpoint(self, *, metric: float | None = None, model_uri: str = "", preempted: bool = False) -> None:
        """Every rank calls this at the same steps (the weight check and the RNG gather are collectives); rank 0
        writes, with the checkpoint's ``meta.json`` (what it records of this run now)."""
        step = self.state.global_step
        self.guard.require_finite_weights(self.model, f"the checkpoint of step {step}", global_step=step)
        json_rng, torch_rng = gather_rng_states(self.world_size)
        self.report.sync_goodput(self.state)
        replicas = self.local_sgd.gather_replicas(self.model, self.optimizer, step)
        started = time.perf_counter()
        meta = None
        if self.rank == 0:
            meta = self.state.checkpoint_meta(
                self.cfg,
                self.manifest,
                data_left=self.epoch_data.left(self.state.step_in_epoch),
                preempted=preempted,
                epoch_partial=self.meter.epoch_sums(),
                telemetry=self.report.telemetry_snapshot(),
                mlflow_run_id=self.args.mlflow.run_id if self.args.mlflow else "",
                mlflow_model_uri=model_uri,
                metric=metric,
                rng=json_rng,
                num_parameters=self.num_parameters,
                frozen_base_sha256=self.frozen_base_sha256,
            )
        self.writes.write(step, meta=meta, metric=metric, torch_rng=torch_rng, replicas=replicas)
        self.report.checkpoint_stall(time.perf_counter() - started, global_step=step)


def run_worker(args: WorkerArgs, runtime: WorkerRuntime) -> None:
    """The training run of one rank: set up, resume, train, finish."""
    trainer = Trainer(args, runtime)
    trainer.setup()
    finished = False
    # The telemetry threads stop, and the last push says whether training finished, however the run ends.
    try:
        trainer.connect_outputs()
        trainer.resume()
        trainer.train()
        trainer.checkpointer.wait()
        trainer.sink.close()
        finished = True
    finally:
        if trainer.accounting is not None:  # a failure this rank sees: its end goes into the progress record
            trainer.accounting.end(failed=not finished)
        trainer.telemetry.close(finished=finished)
        preemption.disarm()
