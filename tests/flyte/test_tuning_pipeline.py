"""The tuning pipeline: its dynamic graph, ASHA against full trials through ``pyflyte run``, caching, and
the Ray Tune strategy."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import REPO_ROOT
from tests.helpers.mlflow_db import seed_mlflow_db
from tests.helpers.pyflyte import pyflyte_run_entity, squashed
from training_core.tuning import TuningConfig

WORKFLOW = str(REPO_ROOT / "workflows" / "tuning.py")

# 4 trials of a small CNN on digits, 1 worker each (the tuning base's default); ASHA rungs of 1, 2 and 4 epochs,
# keeping half.
SEARCH = {
    "num_trials": 4,
    "max_concurrency": 2,
    "seed": 3,
    "base": {"loop": {"epochs": 4}, "data": {"num_shards": 2}},
    "asha": {"min_epochs": 1, "eta": 2},
}


def _config(**overrides) -> str:
    # pyflyte fills fields missing from a JSON dataclass with the dataclass defaults, not the tuning
    # defaults: always pass the whole tree.
    return json.dumps(TuningConfig.from_dict({**SEARCH, **overrides}).to_dict())


def _run(config_json: str, *, cwd: Path, env: dict[str, str]) -> str:
    result = pyflyte_run_entity(WORKFLOW, "tuning_pipeline", "--config", config_json, cwd=cwd, env=env, timeout_s=1500)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


def _table(output: str) -> pd.DataFrame:
    """The trial table CSV the run's TuningResult points at (rich wraps long paths: squash whitespace)."""
    return pd.read_csv(re.search(r"table=(/[^,)]+?trials\.csv)", squashed(output)).group(1))


def _children(tracking_uri: str, parent_run_id: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("tuning")
    return client.search_runs([experiment.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")


def _search_parent_runs(client) -> list:
    """The MLflow parent runs of the searches, one per search (``start_search`` tags them with ``search.key``)."""
    return [
        r
        for r in client.search_runs([client.get_experiment_by_name("tuning").experiment_id])
        if "search.key" in r.data.tags
    ]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_asha_uses_half_the_epochs_of_full_trials_finds_their_best_and_reuses_cached_trials(ray_address, tmp_path):
    def workdir(name: str) -> tuple[Path, dict[str, str]]:
        # Each search in a directory and a HOME of its own (its MLflow database and flytekit's local cache).
        cwd = tmp_path / name
        (cwd / "home").mkdir(parents=True)
        seed_mlflow_db(cwd / "mlflow.db")  # the searches' relative tracking URI, in the runs' directory
        return cwd, dict(os.environ, HOME=str(cwd / "home"), PYTHONUNBUFFERED="1", RAY_ADDRESS=ray_address,
                         COLUMNS="400")  # fmt: skip

    (asha_dir, asha_env), (full_dir, full_env) = workdir("asha"), workdir("full")
    # Rungs of 1 and 4 epochs, keeping a quarter: 5 trial slices instead of the 7 of rungs 1, 2 and 4 (a slice costs
    # ~15 s, mostly its Ray Train start). A trial stopped at a middle rung is decided in
    # tests/unit/test_tuning.py::test_asha_rounds_continue_the_top_trials_of_each_rung_and_stop_the_rest.
    asha_config = _config(algorithm="asha", asha={"min_epochs": 1, "eta": 4})
    # The two searches share nothing but the Ray cluster: run side by side (108-113 s for the test against 142 s one
    # after the other; their trials are 1-worker runs, so both fit on the session's 4 CPUs).
    with ThreadPoolExecutor(max_workers=2) as pool:
        asha_run = pool.submit(_run, asha_config, cwd=asha_dir, env=asha_env)
        full_run = pool.submit(_run, _config(algorithm="random"), cwd=full_dir, env=full_env)
        asha_output, full_output = asha_run.result(), full_run.result()
    asha, full = _table(asha_output), _table(full_output)

    # The same seed draws the same 4 trials for both algorithms.
    params = ["optimizer.lr", "loop.batch_size", "optimizer.name", "optimizer.weight_decay", "schedule.warmup_steps"]
    assert len(asha) == len(full) == 4
    pd.testing.assert_frame_equal(asha[params], full[params])
    # Rungs 1, 4: 4 trials train 1 epoch, the best goes on to 4 from its checkpoint; nothing is retrained.
    assert sorted(asha["epochs_trained"].tolist()) == [1, 1, 1, 4]
    assert asha["epochs_used"].sum() == 4 * 1 + 1 * 3 == 7
    assert full["epochs_used"].sum() == 4 * 4
    assert asha["epochs_used"].sum() / full["epochs_used"].sum() <= 0.5
    assert set(asha["status"]) == {"stopped", "done"} and set(full["status"]) == {"done"}
    # A slice resumes its trial exactly, so a trial ASHA trains to 4 epochs scores what its full run did.
    finished = asha[asha["epochs_trained"] == 4].set_index("trial")
    for trial, row in finished.iterrows():
        assert row["final_val_accuracy"] == pytest.approx(
            full.set_index("trial").loc[trial, "final_val_accuracy"], abs=1e-12
        )
    assert finished["final_val_accuracy"].max() >= full["final_val_accuracy"].max() - 0.01

    # MLflow: one parent run per search, one child run per trial (continued by its later rungs).
    from mlflow.tracking import MlflowClient

    tracking_uri = f"sqlite:///{asha_dir / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=tracking_uri)
    parents = _search_parent_runs(client)
    (asha_parent,) = parents
    assert asha_parent.data.params["algorithm"] == "asha"
    (full_parent,) = _search_parent_runs(MlflowClient(tracking_uri=f"sqlite:///{full_dir / 'mlflow.db'}"))
    assert full_parent.data.params["algorithm"] == "random"
    children = _children(tracking_uri, asha_parent.info.run_id)
    assert sorted(c.info.run_id for c in children) == sorted(asha["mlflow_run_id"])
    by_run = {c.info.run_id: c for c in children}
    for _, row in asha.iterrows():
        history = client.get_metric_history(row["mlflow_run_id"], "val_accuracy")
        assert len(history) == row["epochs_trained"], "each epoch of each rung lands in the trial's one run"
        assert by_run[row["mlflow_run_id"]].data.params["optimizer.name"] == row["optimizer.name"]
    assert asha_parent.data.metrics["epochs_used"] == 7
    # The best trial went through evaluate and register_model.
    assert re.search(r"registered model : digits-classifier version \d", asha_output)

    # The same search again: every trial slice comes from the cache, in the same MLflow parent run. Only
    # train_trial logs val_accuracy to a trial's run, so a slice that ran again would add a child run (first
    # rung) or epochs to its trial's run (later rungs).
    again = _table(_run(asha_config, cwd=asha_dir, env=asha_env))
    pd.testing.assert_frame_equal(again, asha)
    assert sorted(r.info.run_id for r in _search_parent_runs(client)) == sorted(r.info.run_id for r in parents)
    children = _children(tracking_uri, asha_parent.info.run_id)
    assert sorted(c.info.run_id for c in children) == sorted(asha["mlflow_run_id"]), "a cached trial starts no new run"
    for _, row in asha.iterrows():
        history = client.get_metric_history(row["mlflow_run_id"], "val_accuracy")
        assert len(history) == row["epochs_trained"], (
            f"trial {row['trial']} trained again instead of coming from the cache"
        )


def test_dynamic_round_is_one_node_per_trial_in_lanes_of_max_concurrency_with_its_own_rayjob(tmp_path):
    """Compile one round of the search the way Flyte does on a cluster and inspect the nodes it yields."""
    from flytekit.types.directory import FlyteDirectory

    from tasks.tuning import SearchState, Trial
    from tasks.types import PreparedData
    from tests.helpers.flyte_compile import compile_dynamic, rayjob_shape
    from workflows.tuning import search_round

    config = TuningConfig.from_dict(
        {**SEARCH, "num_trials": 5, "max_concurrency": 2, "base": {**SEARCH["base"], "scaling": {"num_workers": 2}}}
    )
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    data = PreparedData(
        directory=FlyteDirectory(str(data_dir)),
        dataset="digits",
        num_classes=10,
        input_shape=[1, 8, 8],
        split_counts={"train": 1},
    )
    state = SearchState(
        round_index=0,
        trials=[
            Trial(trial_id=i, params=p)
            for i, p in enumerate(
                __import__("training_core.tuning", fromlist=["initial_params"]).initial_params(config)
            )
        ],
        tracking_uri="sqlite:///x.db",
        parent_run_id="parent",
    )

    spec = compile_dynamic(search_round, {"config": config, "data": data, "state": state})

    trial_nodes = [n for n in spec.nodes if n.metadata.name.startswith("round-0-trial-")]
    assert [n.metadata.name for n in trial_nodes] == [f"round-0-trial-{i}" for i in range(5)]
    ids = [n.id for n in trial_nodes]
    # Lanes: node i waits for node i - max_concurrency, so at most 2 train at once.
    for index, node in enumerate(trial_nodes):
        expected = {ids[index - 2]} if index >= 2 else set()
        assert set(node.upstream_node_ids) & set(ids) == expected, node.metadata.name
    # Each node's RayJob has the trial's worker count.
    tasks = {t.id.name: t for t in spec.tasks}
    for node in trial_nodes:
        task = tasks[node.task_node.reference_id.name]
        assert task.type == "ray"
        shape = rayjob_shape(task.custom)
        assert shape.replicas == (2, 2, 2) and shape.group_name == "train-workers"
    # The round is recorded after all its trials, then the next round (a nested dynamic) follows.
    record = next(n for n in spec.nodes if "record_round" in n.task_node.reference_id.name)
    assert set(ids) <= set(record.upstream_node_ids)
    assert any("search_round" in n.task_node.reference_id.name for n in spec.nodes)


# A tiny GPT on a slice of the standard library: the same search over learning rate and warmup, for a language model.
LM_BASE = {
    "workload": {"name": "causal_lm"},
    "model": {"name": "gpt2-tiny"},
    "data": {"dataset": "stdlib", "max_text_bytes": 120_000, "seq_len": 32, "num_shards": 2},
    "checkpoint": {"best_metric": "val_perplexity"},
}


# The language model: the search, its MLflow children and the winner's checkpoint are the same code for every
# workload, and the image workload's trials are searched by ASHA above.
@pytest.mark.parametrize("workload", ["causal_lm"])
def test_ray_tune_strategy_runs_asha_on_one_cluster_with_mlflow_children(workload, ray_session, tmp_path):
    from mlflow.tracking import MlflowClient

    from training_core import tracking
    from training_core.data import prepare
    from training_core.runners.ray_tune import run_search

    base = SEARCH["base"] if workload == "image_classification" else LM_BASE
    config = TuningConfig.from_dict(
        {
            **SEARCH,
            "strategy": "ray_tune",
            "num_trials": 2,
            "max_concurrency": 2,
            "base": {
                **base,
                "loop": {"epochs": 2},
                "tracking": {"tracking_uri": seed_mlflow_db(tmp_path / "mlflow.db"), "experiment_name": "tuning"},
            },
        }
    )
    # The default search space holds the learning rate and the warmup (and batch size, optimizer, weight decay).
    assert {"optimizer.lr", "schedule.warmup_steps"} <= {spec.path for spec in config.search_space}
    prepare(config.base.data, str(tmp_path / "data"), workload=config.base.workload)
    tracking_uri, parent = tracking.create_run(config.base.tracking, run_name="parent")
    outcomes = run_search(
        config,
        data_dir=str(tmp_path / "data"),
        storage_path=str(tmp_path / "runs"),
        run_name="tune",
        parent_run_id=parent,
    )

    assert len(outcomes) == 2 and not [o.error for o in outcomes if o.error]
    for outcome in outcomes:
        assert outcome.score_epochs == list(range(1, outcome.epochs_trained + 1)), "ASHA sees a score after every epoch"
        assert outcome.epochs_used == outcome.epochs_trained and 0 <= outcome.scores[-1] <= 1
        assert (Path(outcome.checkpoint_uri) / "meta.json").is_file()
    assert any(o.status == "done" for o in outcomes)
    children = MlflowClient(tracking_uri).search_runs(
        [MlflowClient(tracking_uri).get_experiment_by_name("tuning").experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent}'",
    )
    assert sorted(c.info.run_id for c in children) == sorted(o.mlflow_run_id for o in outcomes)


def _trained(tmp_path: Path, trial_id: int, epochs: int, accuracy: float):
    """A real ``TrainedModel`` value (its files exist) with the given figures, as a trial node returns it."""
    from flytekit.types.directory import FlyteDirectory
    from flytekit.types.file import FlyteFile

    from tasks.types import TrainedModel, TrainMetrics

    checkpoint = tmp_path / f"ckpt-{trial_id}-{epochs}"
    checkpoint.mkdir()
    (checkpoint / "meta.json").write_text("{}")
    report = tmp_path / f"report-{trial_id}-{epochs}.html"
    report.write_text("<html></html>")
    metrics = TrainMetrics(
        epochs=epochs,
        global_step=10 * epochs,
        train_loss=1.0,
        train_accuracy=accuracy,
        val_loss=1.0 - accuracy,
        val_accuracy=accuracy,
        samples_per_s=100.0,
    )
    return TrainedModel(
        checkpoint=FlyteDirectory(str(checkpoint)),
        model_name="small_cnn",
        metrics=metrics,
        tracking_uri="sqlite:///m.db",
        mlflow_run_id=f"run-{trial_id}",
        mlflow_model_uri="",
        report=FlyteFile(str(report)),
    )


def test_pbt_round_copies_the_top_trials_checkpoint_into_the_bottom_one_with_perturbed_params(tmp_path):
    """``record_round`` (run as a Flyte task, in process) makes PBT's exploit/explore decision, and the next
    round's plan resumes the copy from the winner's checkpoint in a new MLflow run."""
    from tasks.tuning import SearchState, Trial, plan_round, record_round
    from training_core import tuning

    config = TuningConfig.from_dict(
        {
            **SEARCH,
            "algorithm": "pbt",
            "num_trials": 4,
            "base": {**SEARCH["base"], "loop": {"epochs": 2}},
            "pbt": {"interval_epochs": 1, "quantile": 0.25, "resample_probability": 0.0},
        }
    )
    trials = [Trial(trial_id=i, params=p) for i, p in enumerate(tuning.initial_params(config))]
    state = SearchState(round_index=0, trials=trials, tracking_uri="sqlite:///m.db", parent_run_id="parent")
    assert [s.config.loop.stop_at_epoch for s in plan_round(config, state)] == [1, 1, 1, 1]
    accuracies = [0.5, 0.9, 0.2, 0.7]
    state = record_round(
        config=config,
        state=state,
        trial_ids=[0, 1, 2, 3],
        models=[_trained(tmp_path, i, 1, a) for i, a in enumerate(accuracies)],
    )
    loser, winner = state.trials[2], state.trials[1]
    assert loser.lineage == [1] and all(not t.lineage for t in state.trials if t.trial_id != 2)
    assert loser.checkpoint.path == winner.checkpoint.path and loser.mlflow_run_id == ""
    ratio = float(loser.params["optimizer.lr"]) / float(winner.params["optimizer.lr"])
    assert ratio == pytest.approx(0.8, rel=1e-3) or ratio == pytest.approx(1.25, rel=1e-3)
    assert {k: v for k, v in loser.params.items() if k in ("optimizer.name", "loop.batch_size")} == {
        k: v for k, v in winner.params.items() if k in ("optimizer.name", "loop.batch_size")
    }
    plan = {s.trial_id: s for s in plan_round(config, state)}
    assert len(plan) == 4 and all(s.config.loop.stop_at_epoch == 0 for s in plan.values())  # round 2 ends at the budget
    assert plan[2].resume_from.path == winner.checkpoint.path and plan[2].config.tracking.run_id == ""
    assert plan[1].config.tracking.run_id == "run-1" and plan[1].config.tracking.parent_run_id == "parent"
    assert plan[2].config.optimizer.lr == pytest.approx(float(loser.params["optimizer.lr"]))


def test_bayesian_round_two_is_what_tpe_suggests_from_round_one(tmp_path):
    from tasks.tuning import SearchState, Trial, plan_round, record_round
    from training_core import tuning

    config = TuningConfig.from_dict({**SEARCH, "algorithm": "bayesian", "num_trials": 5, "bayesian": {"num_rounds": 2}})
    first = tuning.initial_params(config)
    assert len(first) == 3  # 5 trials over 2 rounds: 3 then 2
    state = SearchState(
        round_index=0,
        trials=[Trial(trial_id=i, params=p) for i, p in enumerate(first)],
        tracking_uri="sqlite:///m.db",
        parent_run_id="p",
    )
    state = record_round(
        config=config,
        state=state,
        trial_ids=[0, 1, 2],
        models=[_trained(tmp_path, i, 4, 0.3 * (i + 1)) for i in range(3)],
    )
    expected = tuning.suggest(
        config, finished=[(p, 0.3 * (i + 1)) for i, p in enumerate(first)], count=2, round_index=1
    )
    assert [t.params for t in state.trials[3:]] == expected
    assert [s.trial_id for s in plan_round(config, state)] == [3, 4], "only the new trials train in round 2"
