"""The whole training loop (``run_worker``) in this process: one rank, no Ray, no process group.

Written before the loop was split into pieces, as the safety net of that refactor: what the loop reports, logs
and checkpoints, and that training in two calls (a resume mid-run) ends bit-identical to one call.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.runtime import InProcessRuntime
from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.data import prepare
from training_core.records import WorkerArgs
from training_core.telemetry.goodput import ExecutionGoodput
from training_core.train import preemption
from training_core.train.failures import WorkerPreempted, classify
from training_core.train.loop import run_worker


def _config(compile: bool = False, **loop) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "model": {"name": "small_cnn", "compile": compile},
            "optimizer": {"name": "adamw", "lr": 0.01},
            "loop": {"epochs": 2, "batch_size": 64, "log_interval_steps": 4, **loop},
            "checkpoint": {"interval_steps": 7, "keep_last": 3, "async_save": True},
            "scaling": {"num_workers": 1, "torch_threads_per_worker": 1},
            "observability": {"enabled": False},
        }
    )


def _run(cfg: TrainingConfig, *, data_dir: str, root: Path) -> InProcessRuntime:
    runtime = InProcessRuntime()
    args = WorkerArgs.build(cfg, data_dir=data_dir, checkpoint_root=str(root), run_name="unit")
    run_worker(args, runtime)
    return runtime


def _final(root: Path) -> ckpt.LoadedCheckpoint:
    loaded = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(root)))
    assert loaded is not None
    return loaded


def test_run_worker_reports_each_epoch_logs_windows_and_leaves_a_final_checkpoint(digits_dir, tmp_path, capsys):
    runtime = _run(_config(), data_dir=digits_dir, root=tmp_path / "ckpt")

    assert [r["epoch"] for r in runtime.reports] == [1.0, 2.0]
    steps_per_epoch = int(runtime.reports[0]["global_step"])
    assert steps_per_epoch > 7 and runtime.reports[1]["global_step"] == 2 * steps_per_epoch
    for record in runtime.reports:
        assert 0.0 < record["train_loss"] < 5 and 0.0 <= record["val_accuracy"] <= 1
        assert record["samples_per_s"] > 0
    assert runtime.reports[0]["lr"] > 0  # the cosine schedule ends at 0
    # The run learns: digits with a small CNN clear 80% validation accuracy within 2 epochs.
    assert runtime.reports[-1]["val_accuracy"] > 0.8
    assert runtime.reports[-1]["train_loss"] < runtime.reports[0]["train_loss"]

    final = _final(tmp_path / "ckpt")
    meta = final.meta
    assert meta.global_step == 2 * steps_per_epoch and meta.epoch == 2 and meta.step_in_epoch == 0
    assert [r.epoch for r in meta.history] == [1.0, 2.0]
    assert meta.history[-1].val_accuracy == runtime.reports[-1]["val_accuracy"]
    assert meta.best_metric == max(r["val_accuracy"] for r in runtime.reports)
    # Every logged window closes at a log step, an epoch end or a checkpoint step, in step order.
    logged_steps = [r.step for r in meta.step_log]
    assert logged_steps == sorted(logged_steps) and logged_steps[-1] == meta.global_step
    for step in logged_steps:
        assert step % 4 == 0 or step % 7 == 0 or step % steps_per_epoch == 0
    # Retention: the final checkpoint plus at most keep_last - 1 older ones.
    assert len(ckpt.CheckpointStorage(str(tmp_path / "ckpt")).list_steps()) <= 3
    # Where the seconds went: every one of the attempt attributed, to steps, checkpoints and validation.
    (attempt,) = ExecutionGoodput.from_summary(meta.telemetry["goodput"]).attempts
    assert attempt.outcome == "finished" and 0.98 <= attempt.attributed_fraction <= 1.02
    assert min(attempt.seconds.productive, attempt.seconds.checkpoint, attempt.seconds.evaluation) > 0
    # Each window's console line carries the progress and the ETA (0 at the last step).
    lines = [line for line in capsys.readouterr().err.splitlines() if "train_loss=" in line]
    assert len(lines) == len(meta.step_log) and all("eta_s=" in line for line in lines[1:])
    assert lines[-1].endswith("eta_s=0 progress=1")


def test_run_worker_in_two_calls_ends_bit_identical_to_one_call(digits_dir, tmp_path):
    _run(_config(), data_dir=digits_dir, root=tmp_path / "whole")
    # The first call stops after epoch 1 (a slice); the second resumes from its checkpoint in the same root.
    first = _run(_config(stop_at_epoch=1), data_dir=digits_dir, root=tmp_path / "sliced")
    second = _run(_config(), data_dir=digits_dir, root=tmp_path / "sliced")
    assert [r["epoch"] for r in first.reports] == [1.0] and [r["epoch"] for r in second.reports] == [2.0]

    whole, sliced = _final(tmp_path / "whole"), _final(tmp_path / "sliced")
    assert whole.meta.global_step == sliced.meta.global_step
    for name, tensor in whole.model.items():
        assert torch.equal(tensor, sliced.model[name]), name
    whole_moments = whole.trainer["optimizer"]["state"]
    for index, state in sliced.trainer["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg"], whole_moments[index]["exp_avg"])
    assert whole.meta.history[-1].val_loss == sliced.meta.history[-1].val_loss
    assert sliced.meta.resumed_from_steps == [whole.meta.global_step // 2]
    # A slice that ended where it was told to is a finished attempt: the time between the calls is no one's.
    first_slice, second_slice = ExecutionGoodput.from_summary(sliced.meta.telemetry["goodput"]).attempts
    assert first_slice.outcome == second_slice.outcome == "finished" and first_slice.seconds.recomputed == 0
    assert first_slice.end_unix < second_slice.start_unix and second_slice.seconds.startup > 0


def test_run_worker_resumes_mid_epoch_from_an_interval_checkpoint_bit_identical(digits_dir, tmp_path):
    cfg = _config(epochs=1)
    _run(cfg, data_dir=digits_dir, root=tmp_path / "whole")
    whole = _final(tmp_path / "whole")

    # Keep only the first interval checkpoint (step 7): the next call resumes mid-epoch from it, the way a
    # restarted worker group would after losing everything written later.
    storage = ckpt.CheckpointStorage(str(tmp_path / "whole"))
    mid = tmp_path / "mid"
    mid.mkdir()
    storage.download(ckpt.step_name(7), str(mid / ckpt.step_name(7)))
    runtime = _run(cfg, data_dir=digits_dir, root=mid)
    resumed = _final(mid)

    assert resumed.meta.resumed_from_steps == [7]
    # The interrupted attempt's work after its checkpoint is counted as recomputed, and the second attempt starts
    # with its own start-up; both attempts' seconds add up to workers x wall.
    first, second = ExecutionGoodput.from_summary(resumed.meta.telemetry["goodput"]).attempts
    assert first.outcome == "failed" and first.seconds.recomputed > 0 and first.end_unix == second.start_unix
    assert second.outcome == "finished" and second.seconds.startup > 0 and second.seconds.recomputed == 0
    assert 0.98 <= ExecutionGoodput((first, second)).attributed_fraction <= 1.02
    for name, tensor in whole.model.items():
        assert torch.equal(tensor, resumed.model[name]), name
    # The epoch's record counts the steps before the resume too.
    assert runtime.reports[-1]["train_loss"] == pytest.approx(whole.meta.history[-1].train_loss, rel=1e-9)
    for key in ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "global_step"):
        assert getattr(resumed.meta.history[-1], key) == getattr(whole.meta.history[-1], key), key


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_language_model_resumes_mid_epoch_from_an_interval_checkpoint_bit_identical(strategy, request, tmp_path):
    """The causal_lm workload through the same loop and checkpoints: a GPT resumed from a mid-epoch checkpoint
    (model, AdamW moments, RNG, data position) ends bit-identical to an uninterrupted run, with full checkpoints
    (ddp) and with sharded ones (fsdp, every block sharded and recomputed in the backward pass). Under Ray with a
    SIGKILLed worker, tests/distributed/test_recovery.py shows the same for images."""
    if strategy == "fsdp":
        request.getfixturevalue("process_group")
    cfg = TrainingConfig.from_dict(
        {
            "workload": {"name": "causal_lm"},
            "model": {"name": "gpt2-tiny", "activation_checkpointing": "full" if strategy == "fsdp" else "none"},
            "data": {"dataset": "stdlib", "max_text_bytes": 40_000, "seq_len": 32, "num_shards": 1},
            "loop": {"epochs": 1, "batch_size": 16, "log_interval_steps": 4},
            "checkpoint": {"interval_steps": 5, "keep_last": 5, "async_save": True},
            "scaling": {"num_workers": 1, "torch_threads_per_worker": 1, "strategy": strategy},
            "observability": {"enabled": False},
        }
    )
    data_dir = str(tmp_path / "data")
    manifest = prepare(cfg.data, data_dir, workload=cfg.workload)
    assert manifest.steps_per_epoch(world_size=1, batch_size=16, grad_accum_steps=1) > 7, "resume must be mid-epoch"
    _run(cfg, data_dir=data_dir, root=tmp_path / "whole")
    whole = _final(tmp_path / "whole")

    storage = ckpt.CheckpointStorage(str(tmp_path / "whole"))
    mid = tmp_path / "mid"
    mid.mkdir()
    storage.download(ckpt.step_name(5), str(mid / ckpt.step_name(5)))
    _run(cfg, data_dir=data_dir, root=mid)
    resumed = _final(mid)

    assert resumed.meta.resumed_from_steps == [5] and resumed.meta.global_step == whole.meta.global_step
    final = ckpt.step_name(whole.meta.global_step)
    assert (
        ckpt.CheckpointManifest.parse(
            storage.read(final, ckpt.MANIFEST_FILE, max_bytes=ckpt.MAX_MANIFEST_BYTES), where="manifest"
        ).format
        == {"ddp": "full", "fsdp": "sharded"}[strategy]
    )
    whole_weights = ckpt.load_model(str(tmp_path / "whole" / final))[0].state_dict()
    resumed_weights = ckpt.load_model(str(mid / final))[0].state_dict()
    for name, tensor in whole_weights.items():
        assert torch.equal(tensor, resumed_weights[name]), name
    assert resumed.meta.history[-1].val_perplexity == whole.meta.history[-1].val_perplexity
    assert resumed.meta.history[-1].train_loss == whole.meta.history[-1].train_loss


@dataclass
class SigtermAtStep(InProcessRuntime):
    """Sends this process a real SIGTERM during the forward pass of training step ``step`` (1-based)."""

    step: int = 0
    forwards: int = 0

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        def count(module, inputs, output):
            if module.training:
                self.forwards += 1
                if self.forwards == self.step:
                    os.kill(os.getpid(), signal.SIGTERM)

        model.register_forward_hook(count)
        return super().prepare_model(model)


def test_a_failed_attempts_progress_record_keeps_its_steps_after_the_checkpoint_and_the_resume_recomputes_them(
    digits_dir, tmp_path, monkeypatch
):
    """The first call fails at step 10 (an error the rank sees: it records its end); its checkpoint is step 7 and its
    last logged step 8. The second call settles it from that record: steps 8 and before kept productive, the rest of
    its time hung then start-up, and the resume counts step 8, trained again, as recomputed."""
    from training_core.train import loop

    cfg, real_train_step, calls = _config(epochs=1), loop.train_step, []

    def train_step_failing_at_the_tenth(**kwargs):
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("lost at step 10")
        return real_train_step(**kwargs)

    monkeypatch.setattr(loop, "train_step", train_step_failing_at_the_tenth)
    with pytest.raises(RuntimeError, match="lost at step 10"):
        _run(cfg, data_dir=digits_dir, root=tmp_path)
    monkeypatch.setattr(loop, "train_step", real_train_step)
    _run(cfg, data_dir=digits_dir, root=tmp_path)

    meta = _final(tmp_path).meta
    first, second = ExecutionGoodput.from_summary(meta.telemetry["goodput"]).attempts
    assert meta.resumed_from_steps == [7] and first.outcome == "failed"
    reached = first.last_progress
    assert reached is not None and reached.global_step == 8 and reached.end_unix is not None
    assert first.seconds.recomputed == 0 and first.seconds.hung == pytest.approx(reached.end_unix - reached.step_unix)
    assert second.seconds.recomputed > 0 and second.outcome == "finished"
    assert 0.98 <= ExecutionGoodput((first, second)).attributed_fraction <= 1.02


def test_a_sigterm_mid_interval_saves_that_step_stops_recoverably_and_the_resume_ends_bit_identical(
    digits_dir, tmp_path
):
    """A worker told to stop at step 10 (interval checkpoints at 7 and 14) writes a checkpoint of step 10 and
    stops with a recoverable error; the retry resumes there, recomputes no step, and ends bit-identical."""
    cfg = _config(epochs=1, log_interval_steps=1)
    _run(cfg, data_dir=digits_dir, root=tmp_path / "whole")
    whole = _final(tmp_path / "whole")

    previous = signal.getsignal(signal.SIGTERM)
    try:
        runtime = SigtermAtStep(step=10)
        args = WorkerArgs.build(cfg, data_dir=digits_dir, checkpoint_root=str(tmp_path / "told"), run_name="unit")
        with pytest.raises(WorkerPreempted, match="checkpoint of step 10 is saved"):
            run_worker(args, runtime)
        assert classify(WorkerPreempted("x")).retryable
        assert signal.getsignal(signal.SIGTERM) is previous  # the run gave the process its handler back
    finally:
        signal.signal(signal.SIGTERM, previous)
        preemption.clear()
    storage = ckpt.CheckpointStorage(str(tmp_path / "told"))
    assert storage.list_steps() == [ckpt.step_name(7), ckpt.step_name(10)]

    _run(cfg, data_dir=digits_dir, root=tmp_path / "told")
    resumed = _final(tmp_path / "told")
    assert resumed.meta.resumed_from_steps == [10]  # the step the signal came in: nothing is trained twice
    assert resumed.meta.resume_timings[-1]["preempted"] == 1.0
    for name, tensor in whole.model.items():
        assert torch.equal(tensor, resumed.model[name]), name
    assert resumed.meta.history[-1].train_loss == whole.meta.history[-1].train_loss


def test_told_to_stop_at_an_epochs_last_step_a_resume_with_another_global_batch_trains_none_of_it_again(tmp_path):
    """224 training samples, 14 steps of 16: a stop at step 14 leaves nothing of the epoch, and the checkpoint says
    so (``data_exhausted``); a resume with batches of 8 (as on another number of workers) trains no step of that
    epoch again. Recorded as no more than an empty position, it planned the epoch anew for batches of 8 and skipped
    only 14 of its 28 steps."""
    cfg = _synthetic_config(epochs=1, log_interval_steps=1)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, synthetic_num_samples=320))
    prepare(cfg.data, str(tmp_path / "data"))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        args = WorkerArgs.build(
            cfg, data_dir=str(tmp_path / "data"), checkpoint_root=str(tmp_path / "run"), run_name="unit"
        )
        with pytest.raises(WorkerPreempted, match="checkpoint of step 14 is saved"):
            run_worker(args, SigtermAtStep(step=14))
    finally:
        signal.signal(signal.SIGTERM, previous)
        preemption.clear()
    told = _final(tmp_path / "run").meta
    assert (told.step_in_epoch, told.data_remaining, told.data_exhausted) == (14, [], True)

    smaller = dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, batch_size=8))
    _run(smaller, data_dir=str(tmp_path / "data"), root=tmp_path / "run")
    resumed = _final(tmp_path / "run").meta
    assert resumed.resumed_from_steps == [14] and resumed.global_step == 14 and resumed.epoch == 1


FIXTURE_CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_before_typed_records"


def _synthetic_config(**loop) -> TrainingConfig:
    """The config the fixture checkpoint was trained with (by the loop as it was before typed records)."""
    return TrainingConfig.from_dict(
        {
            "data": {"dataset": "synthetic", "synthetic_num_samples": 256, "synthetic_image_size": 8, "num_shards": 1},
            "model": {"name": "small_cnn"},
            "loop": {"epochs": 2, "batch_size": 16, "log_interval_steps": 2, **loop},
            "checkpoint": {"interval_steps": 0, "keep_last": 1},
            "scaling": {"num_workers": 1, "torch_threads_per_worker": 1},
            "observability": {"enabled": False},
        }
    )


def test_a_checkpoint_written_before_typed_records_still_resumes_where_todays_loop_ends(tmp_path):
    """``tests/fixtures/checkpoint_before_typed_records`` was written by the previous loop (dict records, the
    whole step log in meta.json) after epoch 1 of 2. Resumed now, the run ends where a run of today's loop does.

    Float tolerance, not bit equality: the fixture's epoch 1 was computed on another machine, and CPUs with other
    vector units round the same sums differently in the last bit (bit-exact resume on one machine is the job
    of test_run_worker_resumes_mid_epoch_from_an_interval_checkpoint_bit_identical)."""
    import shutil

    cfg = _synthetic_config()
    data_dir = str(tmp_path / "data")
    prepare(cfg.data, data_dir)
    _run(cfg, data_dir=data_dir, root=tmp_path / "today")
    shutil.copytree(FIXTURE_CHECKPOINT, tmp_path / "old")
    old = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(tmp_path / "old")))
    assert old is not None and old.meta.global_step == 11 and len(old.meta.step_log) == 6
    assert old.meta.step_log[0].step == 2 and old.meta.history[0].epoch == 1

    runtime = _run(cfg, data_dir=data_dir, root=tmp_path / "old")
    today, resumed = _final(tmp_path / "today"), _final(tmp_path / "old")
    assert [r["epoch"] for r in runtime.reports] == [2.0] and resumed.meta.resumed_from_steps == [11]
    for name, tensor in today.model.items():
        torch.testing.assert_close(resumed.model[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert [r.val_loss for r in resumed.meta.history] == pytest.approx([r.val_loss for r in today.meta.history])
    assert [r.step for r in resumed.meta.step_log] == [r.step for r in today.meta.step_log]


def _meta_json_bytes(tmp_path: Path, num_windows: int) -> int:
    """Size of meta.json of a checkpoint saved by the Checkpointer after ``num_windows`` logged windows."""
    from training_core.records import EpochRecord, StepLog, StepRecord

    step_log = StepLog(capacity=ckpt.STEP_LOG_CAPACITY)
    for i in range(num_windows):
        # Full-precision floats, as the loop writes them: every record costs the same bytes.
        x = (i + 1) / 3
        step_log.append(StepRecord(i + 1, i // 50, x, x, x, x, x, x, x, x, elapsed_s=x, num_steps=1))
    meta = ckpt.CheckpointMeta(
        model_name="small_cnn",
        classes=["a", "b"],
        input_shape=[1, 8, 8],
        mean=[0.5],
        std=[0.2],
        epoch=0,
        global_step=num_windows,
        config=TrainingConfig().to_dict(),
        history=[EpochRecord(1, 50, 1.0, 0.5, 1.0, 0.5, 0.1, 100.0)],
        step_log=step_log.records,
    )
    root = tmp_path / f"windows-{num_windows}"
    checkpointer = ckpt.Checkpointer(ckpt.CheckpointStorage(str(root)), keep_last=1, async_save=False)
    checkpointer.save(num_windows, checkpointer.stage(model=torch.nn.Linear(2, 2), meta=meta))
    return (root / ckpt.step_name(num_windows) / ckpt.META_FILE).stat().st_size


def test_meta_json_is_the_same_size_after_100_and_after_10000_logged_steps(tmp_path):
    small, large = _meta_json_bytes(tmp_path, 100), _meta_json_bytes(tmp_path, 10_000)
    # The same number of records (the log is full after 64 windows); only the digits of step numbers differ.
    assert abs(large - small) < 64 * 30, (small, large)
    assert small < 40_000


def test_the_all_reduce_check_goes_to_mlflow_and_warns_below_the_configured_floor(caplog):
    """What rank 0 does with the job-start all-reduce check (measured on 2 gloo workers in
    tests/integration/test_prometheus.py): MLflow metrics at the starting step, and a warning naming the setting."""

    from training_core.parallel.distributed import AllReduceProbe, probe_allreduce
    from training_core.train.network_checks import NetworkChecks

    assert probe_allreduce(torch.device("cpu"), 1) is None  # one rank has nothing to measure

    class Sink:
        def __init__(self):
            self.logged = []

        def log_metrics(self, metrics, *, step):
            self.logged.append((dict(metrics), step))

        def log_dict(self, payload, name):
            self.logged.append((dict(payload), name))

    probe = AllReduceProbe(bus_bandwidth_bytes_per_s=1.25e8, latency_s=2e-4, size_bytes=4 * 2**20)  # 1 Gbit/s
    cfg = TrainingConfig.from_dict({"scaling": {"min_allreduce_gbps": 10}})
    sink = Sink()
    NetworkChecks(probe, None, rank=0, world_size=2, min_allreduce_gbps=cfg.scaling.min_allreduce_gbps).report(
        sink, global_step=3
    )
    assert sink.logged == [({"allreduce_bus_bandwidth_gbps": 1.0, "allreduce_latency_s": 2e-4}, 3)]
    assert "below scaling.min_allreduce_gbps=10" in caplog.text and "NCCL_SOCKET_IFNAME" in caplog.text
    caplog.clear()
    default_floor = TrainingConfig().scaling.min_allreduce_gbps
    NetworkChecks(probe, None, rank=0, world_size=2, min_allreduce_gbps=default_floor).report(Sink(), global_step=3)
    assert "below" not in caplog.text  # 0 (the default) never warns


def test_a_gpu_worker_reads_nccls_network_choice_and_names_the_variable_it_ignored(tmp_path, monkeypatch, caplog):
    """The Trainer's side of the NCCL network check, on this process's own debug file as NCCL writes it (the file
    after a real NCCL collective is tests/gpu/test_nccl_network_on_gpu.py): the warning on the rank, the MLflow
    record."""
    import os
    from types import SimpleNamespace

    from tests.helpers.nccl_logs import FALLBACK_LOG
    from training_core.parallel.distributed import AllReduceProbe
    from training_core.train.network_checks import NetworkChecks, read_nccl_network

    (tmp_path / f"nccl-debug.gpu01.{os.getpid()}.log").write_text(FALLBACK_LOG)
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0")
    runtime = SimpleNamespace(nccl_debug_dir=str(tmp_path))
    found = read_nccl_network(runtime, device=torch.device("cuda"), rank=1)
    assert found.network == "Socket" and found.devices == ["eth0"] and found.inter_node
    assert "rank 1: NCCL is not on the network it was told to use: NCCL_IB_HCA='mlx5_0'" in caplog.text
    # On CPU (gloo), or with the user's own NCCL_DEBUG (no directory): no verdict, no warning.
    caplog.clear()
    assert read_nccl_network(runtime, device=torch.device("cpu"), rank=1) is None
    assert read_nccl_network(SimpleNamespace(), device=torch.device("cuda"), rank=1) is None
    assert caplog.text == ""

    logged = []
    sink = SimpleNamespace(log_dict=lambda payload, name: logged.append((name, payload)), log_metrics=lambda m, step: 0)
    probe = AllReduceProbe(bus_bandwidth_bytes_per_s=1e9, latency_s=1e-4, size_bytes=64 * 2**20)
    NetworkChecks(probe, found, rank=0, world_size=2, min_allreduce_gbps=0.0).report(sink, global_step=7)
    ((name, payload),) = logged
    assert name == "nccl_network/step-7.json"
    assert payload["network"] == "Socket" and payload["mismatch"].startswith("NCCL_IB_HCA='mlx5_0'")


def _same_final_weights(a: Path, b: Path) -> None:
    first, second = _final(a), _final(b)
    assert first.meta.global_step == second.meta.global_step
    for name, tensor in first.model.items():
        assert torch.equal(tensor, second.model[name]), name


def test_an_auto_batch_size_takes_the_largest_micro_batch_the_budget_fits_and_keeps_the_global_batch(
    digits_dir, tmp_path, caplog
):
    """The budget is set between what micro-batches of 8 and 16 need (measured the way the loop measures): the
    loop takes 8 with 4 accumulation steps, and trains exactly as that explicit setting does."""
    from tests.helpers.memory import measured_step_memory

    fixed, per_sample = measured_step_memory(_config(epochs=1), digits_dir)
    assert fixed > 0 and per_sample > 0
    budget_gib = (fixed + 12 * per_sample) / 2**30  # fits 8, not 16
    auto = _config(epochs=1, batch_size="auto", global_batch_size=32, memory_budget_gib=budget_gib)
    with caplog.at_level(logging.WARNING, logger="training_core"):
        _run(auto, data_dir=digits_dir, root=tmp_path / "auto")
    assert "loop.batch_size=auto: micro-batch 8, 4 accumulation step(s) per optimizer step (global batch 32)" in (
        caplog.text
    )
    _run(_config(epochs=1, batch_size=8, grad_accum_steps=4), data_dir=digits_dir, root=tmp_path / "explicit")
    _same_final_weights(tmp_path / "auto", tmp_path / "explicit")


def test_an_auto_batch_size_on_a_split_of_one_sample_a_worker_trains_or_names_the_global_batch(tmp_path):
    """Measuring needs micro-batches of 1 and 2 of a rank's samples: a share of one sample is the only micro-batch
    there is, and a global batch larger than the split is refused naming it, before any step."""
    data = {"dataset": "synthetic", "synthetic_num_samples": 3, "synthetic_image_size": 8, "num_shards": 1}
    data.update(val_fraction=0.34, test_fraction=0.34)  # one sample each
    cfg = _synthetic_config(epochs=1, batch_size="auto", global_batch_size=1)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data))
    prepare(cfg.data, str(tmp_path / "data"))
    runtime = _run(cfg, data_dir=str(tmp_path / "data"), root=tmp_path / "one")
    assert [r["global_step"] for r in runtime.reports] == [1.0]
    too_large = dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, global_batch_size=2))
    with pytest.raises(ValueError, match=r"loop.global_batch_size=2 is too large: with 1 worker\(s\) each has 1 "):
        _run(too_large, data_dir=str(tmp_path / "data"), root=tmp_path / "two")


def test_an_elastic_job_on_fewer_workers_keeps_the_global_batch_by_accumulating(digits_dir, tmp_path, caplog):
    """``scaling.num_workers: 2, min_workers: 1`` running on 1 worker (a lost node): micro-batches of 16 with 2
    accumulation steps keep the global batch of 2 x 16, and the run trains exactly as that explicit 1-worker setting
    does."""
    elastic = _config(epochs=1, batch_size=16)
    elastic = dataclasses.replace(elastic, scaling=dataclasses.replace(elastic.scaling, num_workers=2, min_workers=1))
    with caplog.at_level(logging.WARNING, logger="training_core"):
        _run(elastic, data_dir=digits_dir, root=tmp_path / "elastic")
    assert "elastic: 1 of scaling.num_workers=2 workers; micro-batch 16, 2 accumulation step(s)" in caplog.text
    _run(_config(epochs=1, batch_size=16, grad_accum_steps=2), data_dir=digits_dir, root=tmp_path / "explicit")
    _same_final_weights(tmp_path / "elastic", tmp_path / "explicit")


@dataclass
class OutOfMemoryAbove(InProcessRuntime):
    """A device with room for ``max_batch`` samples: a training forward of more raises CUDA's out-of-memory error,
    as PyTorch raises it on a GPU (the loop's handling is the same; tests/gpu/test_batch_size_on_gpu.py measures a real
    GPU's memory)."""

    max_batch: int = 0
    raised: int = 0

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        def check(module, args):
            if module.training and len(args[0]) > self.max_batch:
                self.raised += 1
                raise torch.cuda.OutOfMemoryError(f"CUDA out of memory: {len(args[0])} samples")

        model.register_forward_pre_hook(check)
        return super().prepare_model(model)


def test_an_out_of_memory_step_is_retried_with_half_the_micro_batch_under_the_reduce_policy(digits_dir, tmp_path):
    runtime = OutOfMemoryAbove(max_batch=16)
    args = WorkerArgs.build(
        _config(epochs=1, batch_size=64, oom_policy="reduce"), data_dir=digits_dir, checkpoint_root=str(tmp_path / "a"),
        run_name="unit",
    )  # fmt: skip
    run_worker(args, runtime)
    assert runtime.raised == 2  # 64 -> 32 -> 16, once each, at the first step; the run keeps 16
    _run(_config(epochs=1, batch_size=16, grad_accum_steps=4), data_dir=digits_dir, root=tmp_path / "b")
    _same_final_weights(tmp_path / "a", tmp_path / "b")

    failing = WorkerArgs.build(
        _config(epochs=1, batch_size=64), data_dir=digits_dir, checkpoint_root=str(tmp_path / "c"), run_name="unit"
    )
    with pytest.raises(torch.cuda.OutOfMemoryError, match="64 samples"):
        run_worker(failing, OutOfMemoryAbove(max_batch=16))


def test_model_compile_compiles_the_module_in_place_so_checkpoints_keep_their_parameter_names(digits_dir, tmp_path):
    """``model.compile`` is ``nn.Module.compile`` on the model (block by block under FSDP) before any wrapper:
    compiled at its first call, with the same parameter names as the eager model."""
    from training_core.train.loop import Trainer

    trainer = Trainer(
        WorkerArgs.build(_config(compile=True), data_dir=digits_dir, checkpoint_root=str(tmp_path), run_name="unit"),
        InProcessRuntime(),
    )
    trainer.setup()
    assert trainer.model._compiled_call_impl is not None
    eager = Trainer(
        WorkerArgs.build(_config(), data_dir=digits_dir, checkpoint_root=str(tmp_path), run_name="unit"),
        InProcessRuntime(),
    )
    eager.setup()
    assert eager.model._compiled_call_impl is None
    assert list(trainer.model.state_dict()) == list(eager.model.state_dict())


# Successive halving and PBT train a trial in slices; tests/flyte/test_tuning_pipeline.py runs them through Ray and
# pyflyte. These two check the slices' arithmetic in process.
def _slice_run(cfg: TrainingConfig, *, data_dir: str, root: Path, resume_from: str = "") -> ckpt.LoadedCheckpoint:
    args = WorkerArgs.build(
        cfg, data_dir=data_dir, checkpoint_root=str(root), run_name="slice", resume_from=resume_from
    )
    run_worker(args, InProcessRuntime())
    return _final(root)


def test_training_in_slices_with_stop_at_epoch_equals_one_uninterrupted_run(digits_dir, tmp_path):
    """Each slice (``loop.stop_at_epoch``) resumes from the previous slice's checkpoint in a new run: the LR schedule
    spans ``loop.epochs`` throughout, so the slices add up to exactly the uninterrupted run, and no step is trained
    twice. A slice whose stop is not past its checkpoint has nothing to do, and ``fit`` says so before any worker
    starts."""
    from training_core.runners.ray_train import fit

    base = _config(epochs=2, batch_size=32)
    whole = _slice_run(base, data_dir=digits_dir, root=tmp_path / "whole")
    first = dataclasses.replace(base, loop=dataclasses.replace(base.loop, stop_at_epoch=1))
    slice_1 = _slice_run(first, data_dir=digits_dir, root=tmp_path / "s1")
    assert slice_1.meta.epoch == 1 and slice_1.meta.global_step * 2 == whole.meta.global_step
    slice_2 = _slice_run(base, data_dir=digits_dir, root=tmp_path / "s2", resume_from=slice_1.uri)
    assert slice_2.meta.resumed_from_steps == [slice_1.meta.global_step]
    assert slice_2.meta.global_step == whole.meta.global_step
    for name, tensor in whole.model.items():
        assert torch.equal(slice_2.model[name], tensor), f"{name} differs between sliced and whole training"
    assert [r.val_accuracy for r in slice_2.meta.history] == [r.val_accuracy for r in whole.meta.history]

    with pytest.raises(ValueError, match="stop_at_epoch"):
        fit(first, data_dir=digits_dir, checkpoint_dir=str(tmp_path / "s3"), run_name="slice-3",
            storage_path=str(tmp_path / "runs"), resume_from=slice_1.uri)  # fmt: skip
    # Without loop.stop_at_epoch the run ends at loop.epochs: the message names that field, not an unset one.
    one_epoch = dataclasses.replace(base, loop=dataclasses.replace(base.loop, epochs=1))
    with pytest.raises(ValueError, match=r"^loop\.epochs=1 is not past epoch 1 of resume_from="):
        fit(one_epoch, data_dir=digits_dir, checkpoint_dir=str(tmp_path / "s4"), run_name="slice-4",
            storage_path=str(tmp_path / "runs"), resume_from=slice_1.uri)  # fmt: skip


def test_a_retry_of_a_run_that_finished_its_epochs_trains_nothing_and_keeps_its_final_checkpoint(digits_dir, tmp_path):
    # A task retried after its training finished (its upload or registration failed) used to fail on every attempt:
    # "loop.stop_at_epoch=0 ... is not past the checkpoint's epoch", a worker error Ray Train restarts on.
    cfg = _config(stop_at_epoch=1)
    _run(cfg, data_dir=digits_dir, root=tmp_path / "run")
    finished = _final(tmp_path / "run")
    retry = _run(cfg, data_dir=digits_dir, root=tmp_path / "run")
    assert retry.reports == []
    again = _final(tmp_path / "run")
    assert again.name == finished.name and again.meta.global_step == finished.meta.global_step


def test_a_resumed_slice_follows_the_configs_new_learning_rate_and_weight_decay(digits_dir, tmp_path):
    """PBT continues a copied checkpoint with perturbed hyperparameters: the optimizer moments and the
    schedule position come from the checkpoint, the peak LR and weight decay from the new config."""
    from training_core.train.optim import lr_factor

    base = _config(epochs=2, batch_size=64, log_interval_steps=1, stop_at_epoch=1)
    base = dataclasses.replace(base, optimizer=dataclasses.replace(base.optimizer, lr=0.002, weight_decay=0.01))
    first = _slice_run(base, data_dir=digits_dir, root=tmp_path / "s1")
    perturbed = dataclasses.replace(
        base,
        optimizer=dataclasses.replace(base.optimizer, lr=0.005, weight_decay=0.05),
        loop=dataclasses.replace(base.loop, stop_at_epoch=0),
    )
    second = _slice_run(perturbed, data_dir=digits_dir, root=tmp_path / "s2", resume_from=first.uri)
    total_steps = second.meta.global_step
    resumed = [r for r in second.meta.step_log if r.step > first.meta.global_step]
    assert resumed, "the second slice logged its steps"
    for record in resumed:
        step = int(record.step) - 1  # the LR a step used is set before the scheduler advances
        assert record.lr == pytest.approx(
            0.005 * lr_factor(step, cfg=perturbed.schedule, total_steps=total_steps), rel=1e-9
        )
    assert {g["weight_decay"] for g in second.trainer["optimizer"]["param_groups"]} == {0.05}
    assert second.trainer["scheduler"]["base_lrs"] == [0.005]
