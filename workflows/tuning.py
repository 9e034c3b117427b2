"""``tuning_pipeline``: prepare data -> search (trials as cached workflow nodes) -> evaluate the best -> register.

Every trial slice is a ``train_trial`` node of the execution graph with its own typed config. Rounds
(rungs of successive halving, PBT intervals, Bayesian rounds) are nested dynamic workflows: a round can
only be planned once the previous one's results exist.
"""

from __future__ import annotations

import typing

import pandas as pd
from flytekit import Resources, dynamic, workflow

from tasks.data import prepare
from tasks.evaluate import evaluate
from tasks.ray_config import ray_job_config
from tasks.register import register_model
from tasks.tuning import (
    SearchState,
    TuningResult,
    finish_search,
    plan_round,
    record_round,
    start_search,
    train_trial,
    tune_with_ray,
)
from tasks.types import PreparedData, Registration
from training_core import tuning
from training_core.tuning import TuningConfig

SearchOutputs = typing.NamedTuple("SearchOutputs", [("result", TuningResult), ("trials", pd.DataFrame)])


@dynamic(requests=Resources(cpu="500m", mem="1Gi"))
def search_round(config: TuningConfig, data: PreparedData, state: SearchState) -> SearchOutputs:
    """Train this round's trials, at most ``config.max_concurrency`` at a time, then record them and go on
    to the next round (or finish)."""
    if config.strategy == "ray_tune":
        return tune_with_ray(config=config, data=data, state=state).with_overrides(
            task_config=ray_job_config(tuning.ray_tune_scaling(config))
        )
    slices = plan_round(config, state)
    # Trials are keyed on the data as prep cached it: a re-run whose prep hit the cache reuses their results.
    trial_data = data.as_cached()
    models = []
    for index, planned in enumerate(slices):
        node = train_trial(config=planned.config, data=trial_data, resume_from=planned.resume_from).with_overrides(
            name=f"round-{state.round_index}-trial-{planned.trial_id}",
            task_config=ray_job_config(planned.config.scaling),
        )
        # Lanes of max_concurrency nodes: each node starts after the one max_concurrency places before it.
        if index >= config.max_concurrency:
            models[index - config.max_concurrency] >> node
        models.append(node)
    recorded = record_round(config=config, state=state, trial_ids=[s.trial_id for s in slices], models=models)
    if state.round_index + 1 < tuning.num_rounds(config):
        return search_round(config=config, data=data, state=recorded)
    return finish_search(config=config, state=recorded)


@workflow
def tuning_pipeline(config: TuningConfig = TuningConfig()) -> tuple[TuningResult, pd.DataFrame, Registration]:
    """Search hyperparameters, then evaluate the best trial on the test split and register it.

    :param config: ``base`` (the trial run; ``base.loop.epochs`` is the full budget), ``search_space``
        (dotted config paths: log_uniform, uniform, int or choice), ``algorithm`` (random, grid, bayesian,
        asha, pbt), ``strategy`` (flyte: trials as nodes; ray_tune: Ray Tune on one RayCluster),
        ``num_trials``, ``max_concurrency``, ``metric`` (``val_<name>`` of any metric the workload reports) and the
        asha/pbt/bayesian settings. A partial JSON or YAML ``--config`` overlays these defaults (a partial ``base``
        too): ASHA over 8 trials of a small CNN on digits, rungs of 1, 2 and 4 epochs.
    :return: The best trial (config, checkpoint, metric), the trial table, and its registration.
    """
    data = prepare(config=config.base.data, workload=config.base.workload)
    state = start_search(config=config)
    result, trials = search_round(config=config, data=data, state=state)
    evaluation = evaluate(data=data, model=result.best_model)
    registration = register_model(tracking=config.base.tracking, model=result.best_model, evaluation=evaluation)
    return result, trials, registration
