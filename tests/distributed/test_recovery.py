"""Worker loss inside a Ray Train job: a real SIGKILL, an automatic restart, an exact resume."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import session_train_workers
from tests.helpers.mlflow_db import seed_mlflow_db
from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.data import Manifest, prepare
from training_core.records import MlflowRun
from training_core.runners.ray_train import checkpoint_root, fit
from training_core.telemetry.goodput import ExecutionGoodput
from training_core.train.accounting import ProgressLog

INTERVAL_STEPS = 5


# A GPT sharded by FSDP (2 blocks), on 34 steps of text per epoch: its checkpoints are sharded ones. It trains LoRA
# adapters on its attention and MLP layers: the checkpoints hold only them, over a frozen base rebuilt from the seed.
GPT_FSDP = {
    "workload": {"name": "causal_lm"},
    "data": {"dataset": "stdlib", "max_text_bytes": 60_000, "seq_len": 32, "num_shards": 2},
    "model": {
        "name": "gpt2-tiny",
        "num_layers": 2,
        "lora": {"enabled": True, "rank": 4, "target_modules": ["c_attn", "c_fc"]},
    },
    "scaling": {"strategy": "fsdp"},
    "loop": {"epochs": 1},
}


def _config(strategy: str = "ddp") -> TrainingConfig:
    # DDP: a small CNN on digits, 39 steps per epoch. No dropout or BatchNorm, so CPU results are bit-reproducible.
    # Checkpoints every 5 steps land mid-epoch, and the kill comes right after step 15.
    sections = GPT_FSDP if strategy == "fsdp" else {"model": {"name": "small_cnn"}, "loop": {"epochs": 3}}
    return TrainingConfig.from_dict(
        {
            **sections,
            # A log step every step: a SIGTERM'd worker's just-in-time checkpoint comes at the next step.
            "loop": {**sections["loop"], "batch_size": 16, "log_interval_steps": 1},
            "checkpoint": {"interval_steps": INTERVAL_STEPS, "keep_last": 3, "max_worker_restarts": 2},
        }
    )


@pytest.fixture(scope="module")
def gpt_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("gpt")
    cfg = _config("fsdp")
    prepare(cfg.data, str(out), workload=cfg.workload)
    return str(out)


class References:
    """``references(strategy)``: the uninterrupted run every interrupted one must end bit-identical to, run once on
    first use. The FSDP one logs its model to an MLflow run (``tracking_uri``): an FSDP + LoRA run's registered model,
    gathered from the shards and merged (``ModelExport``), at no extra Ray run."""

    def __init__(self, digits_dir: str, gpt_dir: str, tmp_path_factory) -> None:
        self.data_dirs = {"ddp": digits_dir, "fsdp": gpt_dir}
        self.tmp_path_factory = tmp_path_factory
        self.runs: dict[str, object] = {}
        self.tracking_uri = ""

    def __call__(self, strategy: str):
        if strategy not in self.runs:
            tmp = self.tmp_path_factory.mktemp(f"reference-{strategy}")
            mlflow_run = None
            if strategy == "fsdp":  # artifacts under tmp, not the working directory's mlruns/
                from mlflow.tracking import MlflowClient

                self.tracking_uri = seed_mlflow_db(tmp / "mlflow.db")
                client = MlflowClient(tracking_uri=self.tracking_uri)
                experiment = client.create_experiment("fsdp-lora", artifact_location=(tmp / "artifacts").as_uri())
                mlflow_run = MlflowRun(self.tracking_uri, client.create_run(experiment).info.run_id)
            self.runs[strategy] = fit(
                _config(strategy),
                data_dir=self.data_dirs[strategy],
                checkpoint_dir=str(tmp / "ref-final"),
                run_name="reference",
                storage_path=str(tmp / "ref"),
                mlflow_run=mlflow_run,
            )
        return self.runs[strategy]


@pytest.fixture(scope="module")
def references(ray_session, digits_dir, gpt_dir, tmp_path_factory) -> References:
    return References(digits_dir, gpt_dir, tmp_path_factory)


def _final_state(checkpoint_dir: str, scratch: Path) -> dict:
    """The model and optimizer state of a final checkpoint, whole: a full checkpoint's files, or a sharded one's
    shards joined into one file by ``torch.distributed.checkpoint``."""
    root = Path(checkpoint_dir)
    if (root / "shards").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        joined = scratch / f"{root.name}-joined.pt"
        dcp_to_torch_save(str(root / "shards"), str(joined))
        return torch.load(joined, weights_only=False)  # written by the line above from a test run's own shards
    trainer = torch.load(root / ckpt.TRAINER_STATE_FILE, weights_only=True)
    return {"model": torch.load(root / ckpt.MODEL_FILE, weights_only=True), "optimizer": trainer["optimizer"]}


def _assert_equal(got, expected, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(torch.as_tensor(got), expected), f"{where} differs after the resume"
    elif isinstance(expected, dict):
        assert set(got) == set(expected), where
        for key, value in expected.items():
            _assert_equal(got[key], value, f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for index, value in enumerate(expected):
            _assert_equal(got[index], value, f"{where}[{index}]")
    else:
        assert got == expected, where


def _assert_settled_from_the_progress_record(first, second, meta, resumed_from: int, stop_signal) -> None:
    """The interrupted attempt's progress record (its last logged step, and its end when a rank saw the failure) split
    its time after the checkpoint: its steps kept productive (none recomputed by it), the wait to its end hung, the
    rest start-up; the resumed attempt counts as recomputed the steps it trains again, up to the recorded one, and
    no more."""
    reached = first.last_progress
    print(f"interrupted attempt: {reached}, resumed from step {resumed_from}; first {first.seconds}; second {second}")
    assert reached is not None and reached.global_step >= resumed_from
    assert first.seconds.recomputed == 0 and first.seconds.productive > 0 and second.seconds.startup > 0
    assert first.seconds.hung <= 2 * (reached.ended_unix - reached.step_unix) + 1e-6
    if stop_signal == signal.SIGSTOP:  # the peer waited for the stopped rank until its collective timed out
        assert reached.end_unix is not None and first.seconds.hung >= 2 * (HANG_TIMEOUT_S - 1)
    if reached.global_step == resumed_from:  # a checkpoint of the recorded step was written before the group stopped
        assert second.seconds.recomputed == 0
        return
    # The steps after the checkpoint up to the recorded one, trained again: within the time the resumed attempt took
    # from its restore to that step's window (its step log's clock continues the checkpoint's).
    before = max(r.elapsed_s for r in meta.step_log if r.step <= resumed_from)
    through = min(r.elapsed_s for r in meta.step_log if r.step >= reached.global_step)
    assert 0 < second.seconds.recomputed <= 2 * (through - before)
    assert second.seconds.productive > 0


HANG_TIMEOUT_S = 15
"""``scaling.collective_timeout_s`` of the stalled run: what a hung peer costs before the job restarts."""


# SIGKILL under FSDP (sharded checkpoints, async saves on their own process group), SIGTERM and SIGSTOP under DDP.
# The restart path after a failure is the same for both strategies; what differs is the checkpoint, so each
# strategy is killed once and the suite runs no fourth pair of Ray runs.
@pytest.mark.parametrize(
    ("stop_signal", "strategy"),
    [(signal.SIGKILL, "fsdp"), (signal.SIGTERM, "ddp"), (signal.SIGSTOP, "ddp")],
    ids=["sigkill-fsdp-lora", "sigterm", "sigstop"],
)
def test_a_worker_killed_or_told_to_stop_mid_epoch_resumes_bit_identical(
    ray_session, digits_dir, gpt_dir, references, stop_signal, strategy, tmp_path
):
    """SIGKILL (a lost node): the resume loses at most one checkpoint interval. SIGTERM (an eviction, a spot
    reclaim): the worker writes a just-in-time checkpoint at its current step first, so nothing is recomputed.
    SIGSTOP (a hung rank): its peer's collective times out after ``scaling.collective_timeout_s``, and the job
    restarts from the latest checkpoint within that timeout plus a margin, not at the task's time limit."""
    cfg = _config(strategy)
    data_dir = gpt_dir if strategy == "fsdp" else digits_dir
    reference = references(strategy)
    if stop_signal == signal.SIGSTOP:  # the timeout changes no number the run computes
        cfg = dataclasses.replace(cfg, scaling=dataclasses.replace(cfg.scaling, collective_timeout_s=HANG_TIMEOUT_S))
    steps_per_epoch = Manifest.load(data_dir).steps_per_epoch(
        world_size=cfg.scaling.num_workers, batch_size=cfg.loop.batch_size, grad_accum_steps=1
    )
    assert steps_per_epoch > 3 * INTERVAL_STEPS + 1, "the kill must come mid-epoch"

    storage = ckpt.CheckpointStorage(checkpoint_root(str(tmp_path / "killed"), "killed"))
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = fit(
                cfg,
                data_dir=data_dir,
                checkpoint_dir=str(tmp_path / "killed-final"),
                run_name="killed",
                storage_path=str(tmp_path / "killed"),
            )
        except BaseException as exc:  # surfaced by the assertion below
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 300

    def complete_steps() -> list[int]:
        # Written in full: the manifest comes last (a sharded save is still writing in the background before it).
        names = storage.list_steps()
        return [int(n.split("-")[1]) for n in names if os.path.exists(f"{storage.path}/{n}/{ckpt.MANIFEST_FILE}")]

    def recorded_step() -> int:
        # Rank 0's progress record beside the checkpoints, replaced at every log window.
        record = ProgressLog(storage).read()
        return record.global_step if record is not None else 0

    # Killed after a step past its latest checkpoint was recorded: the resume trains that step again.
    while not (
        [step for step in complete_steps() if step >= 3 * INTERVAL_STEPS] and recorded_step() > complete_steps()[-1]
    ):
        assert thread.is_alive() and time.monotonic() < deadline, "training ended or stalled before the kill"
        time.sleep(0.05)
    pids = session_train_workers()
    assert len(pids) == 2, f"expected the 2 Ray Train workers, found {pids}"
    latest_before_kill = complete_steps()[-1]
    os.kill(max(pids), stop_signal)
    stalled_unix = time.time()
    thread.join(timeout=600)
    assert "error" not in outcome, f"training did not recover: {outcome.get('error')!r}"

    result = outcome["result"]
    (resumed_from,) = result.meta.resumed_from_steps
    # The resume used the newest checkpoint that existed when the worker died (or a newer one written in
    # the moment before the group stopped), so at most one interval of steps was recomputed. Told to stop, the
    # workers saved the step they were at and stopped there: the resume recomputes nothing.
    assert latest_before_kill <= resumed_from
    assert result.meta.resume_timings[-1]["preempted"] == float(stop_signal == signal.SIGTERM)
    # Goodput across the restart: the interrupted attempt's time after its last checkpoint settled by the resume
    # (lost to the preemption after a SIGTERM, else work recomputed), the restarted one's start-up (or, after a
    # preemption, the preemption's) before its first step; every worker-second of both attributed.
    first, second = ExecutionGoodput.from_summary(result.meta.telemetry["goodput"]).attempts
    if stop_signal == signal.SIGTERM:
        assert first.seconds.preempted > 0 and second.seconds.preempted > 0 and first.seconds.recomputed == 0
    else:
        _assert_settled_from_the_progress_record(first, second, result.meta, resumed_from, stop_signal)
    assert first.end_unix == second.start_unix and second.outcome == "finished"
    assert 0.98 <= ExecutionGoodput((first, second)).attributed_fraction <= 1.02
    if stop_signal == signal.SIGSTOP:
        # Detected by the peer's collective timeout; that rank kills the hung one's worker (SIGKILL after
        # RAY_kill_worker_timeout_milliseconds, 1 s), so the group restarts at once: starting and importing 2 workers
        # and restoring took ~8 s on an idle 2-core machine (38 s with a 30 s timeout, benchmarks/recovery.py), up to
        # 20 s on a loaded one. Before, the restart waited for the hung rank's answers: 20-45 s.
        stall_to_resume_s = result.meta.resume_timings[-1]["restored_unix"] - stalled_unix
        print(f"stall to resume: {stall_to_resume_s:.1f} s (collective timeout {HANG_TIMEOUT_S} s)")
        assert HANG_TIMEOUT_S <= stall_to_resume_s <= HANG_TIMEOUT_S + 30
    if stop_signal == signal.SIGTERM:
        assert latest_before_kill < resumed_from
        # What the preemption cost: the resumed attempt's start-up (its first step came after it), split out of the
        # job's cost for the 2 one-CPU workers, and part of it.
        timing, cost = result.meta.resume_timings[-1], result.meta.telemetry["cost"]
        assert 0 < timing["lost_s"] < timing["first_step_unix"] - stalled_unix
        assert cost["preemption_cpu_hours"] * 3600 == pytest.approx(2 * timing["lost_s"], rel=1e-6)
        assert cost["preemption_cpu_hours"] < cost["cpu_hours"] and cost["preemption_gpu_hours"] == 0
    assert resumed_from % steps_per_epoch != 0, f"the resume point (step {resumed_from}) should be mid-epoch"
    assert result.meta.global_step == reference.meta.global_step == cfg.loop.epochs * steps_per_epoch

    assert (Path(result.checkpoint_dir) / "shards").is_dir() == (strategy == "fsdp")
    expected = _final_state(reference.checkpoint_dir, tmp_path)
    got = _final_state(result.checkpoint_dir, tmp_path)
    _assert_equal(got["model"], expected["model"], "model")
    _assert_equal(got["optimizer"]["state"], expected["optimizer"]["state"], "optimizer")
    if strategy == "fsdp":  # LoRA: the checkpoints hold the adapters, not the frozen base they adapt
        assert any(".lora_A." in name for name in got["model"]) and not any("base_layer" in n for n in got["model"])
    # The resumed epoch's record is the same as the uninterrupted one's, too, the workload's figures (the
    # epoch's correct count, saved mid-epoch in the checkpoint) included.
    assert [(r.train_loss, r.train_accuracy, r.val_loss, r.val_accuracy) for r in result.meta.history] == [
        (r.train_loss, r.train_accuracy, r.val_loss, r.val_accuracy) for r in reference.meta.history
    ]


def test_a_sharded_model_is_evaluated_on_ray_workers_holding_its_shards_as_in_one_process(
    references, gpt_dir, tmp_path
):
    """``evaluate_on_ray`` (the evaluate task for a model too large for one process): 2 Ray Train workers each load
    their shards of the FSDP run's sharded checkpoint (no process gathers the model) and evaluate their shards of
    the test split; the figures, logged to the run's MLflow run, equal ``evaluate``'s in one process."""
    from flytekit import FlyteFile
    from flytekit.types.directory import FlyteDirectory
    from mlflow.tracking import MlflowClient

    from tasks.evaluate import evaluate, evaluate_on_ray
    from tasks.types import PreparedData, TrainedModel, TrainMetrics

    reference = references("fsdp")
    assert (Path(reference.checkpoint_dir) / "shards").is_dir()
    tracking_uri = seed_mlflow_db(tmp_path / "mlflow.db")
    client = MlflowClient(tracking_uri=tracking_uri)
    runs = {name: client.create_run(client.create_experiment(name)).info.run_id for name in ("ray", "process")}
    (tmp_path / "report.html").write_text("<html></html>")
    manifest = Manifest.load(gpt_dir)
    data = PreparedData(
        directory=FlyteDirectory(gpt_dir),
        dataset=manifest.dataset,
        num_classes=len(manifest.classes),
        input_shape=list(manifest.input_shape),
        split_counts={},
    )

    def trained(run_id: str) -> TrainedModel:
        return TrainedModel(
            checkpoint=FlyteDirectory(reference.checkpoint_dir),
            model_name=reference.meta.model_name,
            metrics=TrainMetrics(**{f.name: 0 for f in dataclasses.fields(TrainMetrics)}),
            tracking_uri=tracking_uri,
            mlflow_run_id=run_id,
            mlflow_model_uri="",
            report=FlyteFile(str(tmp_path / "report.html")),
        )

    on_ray = evaluate_on_ray(config=_config("fsdp"), data=data, model=trained(runs["ray"])).metrics
    in_process = evaluate(data=data, model=trained(runs["process"])).metrics
    assert on_ray.num_samples == in_process.num_samples == manifest.splits["test"].num_samples
    assert on_ray.metrics.keys() == in_process.metrics.keys() and "perplexity" in on_ray.metrics
    for name, value in in_process.metrics.items():
        assert on_ray.metrics[name] == pytest.approx(value, rel=1e-5), name
    assert on_ray.continuations == in_process.continuations
    logged = client.get_run(runs["ray"]).data.metrics
    assert logged["test_loss"] == pytest.approx(on_ray.metrics["loss"])


def test_an_fsdp_lora_run_registers_its_merged_model_which_predicts_without_peft_as_the_trained_adapters_do(
    references, gpt_dir
):
    """``ModelExport.gathered``: rank 0 gathers the FSDP shards, rebuilds the model with its adapters and logs it
    merged. MLflow's model holds no peft layer and no adapter or ``base_layer`` tensor, and it predicts what the final
    checkpoint's adapted model (frozen base from the seed, trained adapters) predicts."""
    import mlflow
    from mlflow.tracking import MlflowClient

    reference = references("fsdp")
    assert reference.meta.mlflow_model_uri, "the FSDP run logged no model"
    model_id = reference.meta.mlflow_model_uri.removeprefix("models:/")
    logged = MlflowClient(tracking_uri=references.tracking_uri).get_logged_model(model_id)
    registered = mlflow.pytorch.load_model(logged.artifact_location)
    names = list(registered.state_dict())
    assert names and not any("lora" in name or "base_layer" in name for name in names), names
    assert not any(type(module).__module__.startswith("peft") for module in registered.modules())
    adapted, _, _ = ckpt.load_model(reference.checkpoint_dir)
    trained = [name for name in adapted.state_dict() if ".lora_B." in name]
    assert trained and all(adapted.state_dict()[name].abs().sum() > 0 for name in trained)  # B starts at zero
    manifest = Manifest.load(gpt_dir)
    tokens = torch.randint(manifest.spec["vocab_size"], (3, manifest.input_shape[0]),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(registered(tokens), adapted.eval()(tokens), rtol=1e-5, atol=1e-5)
