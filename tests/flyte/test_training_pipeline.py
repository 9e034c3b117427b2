"""``pyflyte run`` of the training pipeline in a subprocess, against the session's Ray cluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.conftest import VENV_BIN
from tests.helpers.pyflyte import flat, pyflyte_run, squashed

MODEL_NAME = "digits-classifier"


@pytest.fixture(scope="module")
def default_run(ray_address, tmp_path_factory):
    """One run with no flags at all, shared by the tests below (it takes a couple of minutes)."""
    import os

    workdir = tmp_path_factory.mktemp("pipeline")
    home = workdir / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), PYTHONUNBUFFERED="1", RAY_ADDRESS=ray_address)
    result = pyflyte_run(cwd=workdir, env=env)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return workdir, env, result.stdout + result.stderr


@pytest.mark.slow
def test_default_run_reaches_95_percent_and_registers_a_loadable_champion(default_run, session_root):
    import mlflow
    import torch

    from training_core.config import DataConfig
    from training_core.data import ShardStream, prepare
    from training_core.workloads.image import Normalizer

    workdir, _, output = default_run
    accuracy = float(re.search(r"test metrics\s*:.*\baccuracy ([0-9.]+)", output).group(1))
    goodput_line = re.search(r"^goodput\s*: ([0-9.]+)% of the worker-seconds productive over 1 attempt", output, re.M)
    goodput = float(goodput_line.group(1))
    assert 0 < goodput < 100
    # Its categories add up to the workers x wall time of the run's one attempt, as the final checkpoint records it.
    from training_core import checkpoint as ckpt
    from training_core.config import TrainingConfig
    from training_core.telemetry.goodput import ExecutionGoodput

    final_step = ckpt.step_name(TrainingConfig().loop.epochs * 19)  # 19 steps an epoch on 2 workers
    finals = [p for p in session_root.rglob(final_step) if (p / ckpt.MANIFEST_FILE).exists()]
    executions = [ExecutionGoodput.from_summary(ckpt.load_meta(str(p)).telemetry["goodput"]) for p in finals]
    assert any(e.goodput * 100 == pytest.approx(goodput, abs=0.1) for e in executions), (goodput, executions)
    for execution in executions:
        assert len(execution.attempts) == 1 and 0.98 <= execution.attributed_fraction <= 1.02, execution
    assert accuracy >= 0.95
    assert re.search(rf"registered model : {MODEL_NAME} version 1 \(alias 'champion' -> v1\)", output)
    tracking_uri = f"sqlite:///{workdir / 'mlflow.db'}"
    assert f"mlflow tracking  : {tracking_uri}" in output
    assert f"mlflow ui --backend-store-uri {tracking_uri}" in output
    for name in ("training", "evaluation"):
        path = Path(re.search(rf"{name} report\s*: (\S+)", output).group(1))
        assert path.is_file() and "<img alt='plot' src='data:image/png;base64," in path.read_text()

    mlflow.set_tracking_uri(tracking_uri)
    model = mlflow.pytorch.load_model(f"models:/{MODEL_NAME}@champion")
    manifest = prepare(DataConfig(), str(workdir / "data"))  # same split seed -> the same test split
    normalize = Normalizer(manifest, torch.device("cpu"))
    correct = total = 0
    for batch in ShardStream(manifest, "test", rank=0, world_size=1).eval_batches(batch_size=128):
        x, y = normalize(batch)
        with torch.no_grad():
            correct += int((model(x).argmax(dim=1) == y).sum())
        total += len(y)
    assert total == 359
    assert correct / total == pytest.approx(accuracy, abs=5e-5)  # printed with 4 decimals


@pytest.mark.slow
def test_default_run_logs_params_metrics_config_and_model_to_mlflow(default_run):
    from mlflow.tracking import MlflowClient

    workdir, _, _ = default_run
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("training-pipeline")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["model.name"] == "resnet18" and run.data.params["world_size"] == "2"
    for key in (
        "train_loss",
        "train_accuracy",
        "lr",
        "grad_norm",
        "samples_per_s",
        "data_wait_s",
        "step_time_s",
        "val_accuracy",
        "test_accuracy",
        "eta_s",  # each window's ETA; the execution's goodput at each checkpoint
        "goodput",
        "goodput_productive_s",
        "goodput_startup_s",
    ):
        assert key in run.data.metrics, key
    assert 0 < run.data.metrics["goodput"] < 1
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert len(history) >= 20 and history[-1].value < history[0].value
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "config.json" in artifacts
    config_path = client.download_artifacts(run.info.run_id, "config.json", str(workdir))
    from training_core.config import TrainingConfig

    assert TrainingConfig.from_dict(json.loads(Path(config_path).read_text())) == TrainingConfig()
    (logged,) = client.search_logged_models(experiment_ids=[experiment.experiment_id])
    assert logged.source_run_id == run.info.run_id


SECTIONS = {
    "training": ["summary", "loss", "accuracy", "learning-rate", "throughput", "gpu", "cost", "goodput", "ranks"],
    # The validation curve comes from the trained model's epoch records, which a pipeline run always has.
    "evaluation": ["metrics", "validation", "confusion", "per-class"],
}


@pytest.mark.slow
def test_the_pipeline_prints_each_tasks_deck_and_report_and_every_printed_file_shows_its_sections(default_run):
    _, _, output = default_run
    decks = {}
    for name, ids in SECTIONS.items():
        report = Path(re.search(rf"^{name} report\s*: (\S+)", output, re.MULTILINE).group(1))
        deck = decks[name] = Path(re.search(rf"^{name} deck\s*: (\S+)", output, re.MULTILINE).group(1))
        assert deck.name == "deck.html"
        for path in (report, deck):
            text = path.read_text(encoding="utf-8")
            assert text.lstrip().lower().startswith("<!doctype html>"), path
            assert set(ids) <= set(re.findall(r"<section id='([^']+)'>", text)), path
        assert re.findall(r"<section id='([^']+)'>", report.read_text(encoding="utf-8")) == ids
        # The Deck carries the report it shows; the standalone page loads nothing from the network.
        assert f"data-report='{report}'" in deck.read_text(encoding="utf-8")
        assert not re.search(r"(src|href)=['\"]?https?://", report.read_text(encoding="utf-8"))
    # A local run shares one list of Decks across its tasks, so evaluate's deck.html shows train's report
    # too; the printed training deck is train's own, written before evaluate ran.
    assert decks["training"] != decks["evaluation"]
    assert "id='confusion'" not in decks["training"].read_text(encoding="utf-8")


@pytest.mark.slow
def test_a_worse_second_run_from_a_yaml_file_does_not_move_the_champion(default_run):
    workdir, env, _ = default_run
    worse = workdir / "worse.yaml"
    # Gate at 0 so only "must beat the champion" can refuse it.
    worse.write_text(
        "model:\n  name: small_cnn\nloop:\n  max_steps: 3\n  epochs: 1\ntracking:\n  promotion_threshold: 0.0\n"
    )
    result = pyflyte_run("--config", str(worse), cwd=workdir, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert re.search(rf"registered model : {MODEL_NAME} version 2 \(alias 'champion' unchanged\)", output)
    assert "does not beat 'champion' version 1" in flat(output)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    assert int(client.get_model_version_by_alias(MODEL_NAME, "champion").version) == 1
    experiment = client.get_experiment_by_name("training-pipeline")
    (short_run,) = client.search_runs([experiment.experiment_id], "params.`loop.max_steps` = '3'")
    assert max(m.step for m in client.get_metric_history(short_run.info.run_id, "train_loss")) == 3


def _cifar_lookalike(path: Path) -> None:
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())


BAD_INPUTS = pytest.mark.parametrize(
    ("config", "expected"),
    [
        ('{"model": {"name": "resnet9000"}}', "model.name='resnet9000' is invalid: choose one of small_cnn, resnet18"),
        ('{"loop": {"batch_size": 0}}', "loop.batch_size=0 is invalid: auto (or 0) sizes the micro-batch"),
        ('{"scaling": {"num_workers": 0}}', "scaling.num_workers=0 is invalid: it must be > 0"),
        ('{"optimizer": {"name": "lion"}}', "optimizer.name='lion' is invalid: choose one of sgd, adam, adamw"),
        ('{"optimizer": {"lr": -0.1}}', "optimizer.lr=-0.1 is invalid: it must be > 0"),
        (
            '{"data": {"dataset": "mnist"}}',
            "data.dataset='mnist' is invalid: choose one of digits, synthetic, cifar10, image_folder",
        ),
        (
            '{"data": {"dataset": "cifar10", "path": "{tmp}/missing.tar.gz"}}',
            "data.path='{tmp}/missing.tar.gz' is invalid: nothing exists there",
        ),
        (
            '{"data": {"dataset": "cifar10", "path": "{tmp}/cifar-10-python.tar.gz"}}',
            "data.path='{tmp}/cifar-10-python.tar.gz' is invalid: not a tar archive",
        ),
        (
            '{"workload": {"name": "causal_lm"}, "model": {"name": "gpt2-tiny"}, "data": {"dataset": "stdlib", '
            '"max_text_bytes": 200000, "tokenizer": "{tmp}/cifar-10-python.tar.gz"}}',
            "data.tokenizer='{tmp}/cifar-10-python.tar.gz' is invalid: it is not a tokenizer.json",
        ),
        (
            '{"workload": {"name": "causal_lm"}, "model": {"name": "gpt2-tiny", "context_length": 32}, '
            '"data": {"dataset": "stdlib", "max_text_bytes": 200000, "seq_len": 64}}',
            "data.seq_len=64 is invalid: model.name='gpt2-tiny' attends over 32 positions",
        ),
        (
            '{"workload": {"name": "causal_lm"}, "model": {"name": "gpt2-tiny"}, '
            '"data": {"dataset": "text", "path": "{tmp}/corpus.parquet"}}',
            "data.text_field='text' is invalid: Parquet file 'corpus.parquet' under "
            "data.path='{tmp}/corpus.parquet' has no such column (it has body); set data.text_field to the column",
        ),
    ],
    ids=[
        "unknown-model",
        "zero-batch",
        "zero-workers",
        "unknown-optimizer",
        "negative-lr",
        "unknown-dataset",
        "missing-path",
        "not-a-tarball",
        "lm-not-a-tokenizer",
        "lm-sequence-above-context",
        "lm-parquet-column-missing",
    ],
)
BAD_INPUT_TEST = "test_bad_input_fails_before_any_ray_worker_starts"
CONCURRENT_BAD_INPUT_RUNS = 3
"""Each bad-input run fails within seconds, most of them pyflyte's start-up (imports, one core each): the selected
cases run this many at a time, started by the first case's test, so the 2 cores overlap them."""


def _bad_input_run(config: str, workdir: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """``pyflyte run`` with one bad ``--config`` in ``workdir`` (holding a CIFAR look-alike and a Parquet corpus),
    with no Ray cluster to attach to."""
    _cifar_lookalike(workdir / "cifar-10-python.tar.gz")
    pd.DataFrame({"body": ["some text " * 40] * 8}).to_parquet(workdir / "corpus.parquet")
    (workdir / "home").mkdir()
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(HOME=str(workdir / "home"), PYTHONUNBUFFERED="1", COLUMNS="400")
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return workdir, pyflyte_run("--config", config.replace("{tmp}", str(workdir)), cwd=workdir, env=env, timeout_s=300)


@pytest.fixture(scope="module")
def bad_input_runs(request, tmp_path_factory):
    """The bad-input runs of the cases this session selected, by case id: futures of (workdir, completed process)."""
    cases = {
        item.callspec.id: (item.callspec.params["config"], tmp_path_factory.mktemp(f"bad-{item.callspec.id}"))
        for item in request.session.items
        if item.module is request.module and item.originalname == BAD_INPUT_TEST
    }
    with ThreadPoolExecutor(max_workers=CONCURRENT_BAD_INPUT_RUNS) as pool:
        runs = {case: pool.submit(_bad_input_run, config, workdir) for case, (config, workdir) in cases.items()}
        yield runs
        for run in runs.values():
            run.cancel()


@BAD_INPUTS
def test_bad_input_fails_before_any_ray_worker_starts(config, expected, bad_input_runs, request):
    tmp_path, result = bad_input_runs[request.node.callspec.id].result()
    output = flat(result.stdout + result.stderr)
    assert result.returncode != 0
    assert squashed(expected.replace("{tmp}", str(tmp_path))) in squashed(output)
    # A model that does not fit the data is found by the train task's preflight: inside the Ray task, whose
    # plugin starts the local Ray instance first, but before Ray Train starts a controller or any worker.
    found_in_train_task = request.node.callspec.id in ("lm-sequence-above-context",)
    signs_of_ray = ("RayTrainWorker", "TrainController") + (
        () if found_in_train_task else ("Started a local Ray instance",)
    )
    for sign_of_ray in signs_of_ray:
        assert sign_of_ray not in output


@pytest.mark.slow
def test_resume_from_an_earlier_checkpoint_continues_training_instead_of_starting_over(default_run, session_root):
    from training_core import checkpoint as ckpt
    from training_core.config import TrainingConfig

    workdir, env, _ = default_run
    steps_per_epoch = 19
    default_epochs = TrainingConfig().loop.epochs
    (earlier,) = [
        p
        for p in session_root.rglob(ckpt.step_name(default_epochs * steps_per_epoch))
        if (p / ckpt.MANIFEST_FILE).exists()
    ]
    result = pyflyte_run(
        "--config",
        json.dumps({"loop": {"epochs": default_epochs + 2}}),
        "--resume_from",
        str(earlier),
        cwd=workdir,
        env=env,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert f"resumed from {earlier}" in flat(output)
    (final,) = [
        p
        for p in session_root.rglob(ckpt.step_name((default_epochs + 2) * steps_per_epoch))
        if (p / ckpt.MANIFEST_FILE).exists()
    ]
    meta = ckpt.load_meta(str(final))
    assert meta.resumed_from_steps == [default_epochs * steps_per_epoch]
    assert [r.epoch for r in meta.history] == list(range(1, default_epochs + 3))
