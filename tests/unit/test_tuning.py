"""The search space, its validation, and the decisions of each search algorithm (no Ray, no Flyte)."""

from __future__ import annotations

import math
import random

import pytest

from training_core.config import TrainingConfig
from training_core.tuning import (
    ParamSpec,
    PbtCopy,
    RoundDecision,
    ScoredTrial,
    TuningConfig,
    apply_params,
    asha_rungs,
    bayesian_round_sizes,
    decide_round,
    default_base,
    grid_points,
    initial_params,
    load_tuning_config,
    num_rounds,
    pbt_decision,
    pbt_exploit,
    perturb,
    round_stop_epoch,
    sample,
    successive_halving_keep,
    suggest,
)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: ParamSpec("optimizer.lrr", "log_uniform", low=1e-4, high=1e-2),
            "search_space.path='optimizer.lrr' is invalid: 'optimizer.lrr' is not a config field; fields here: fused, "
            "lr, max_grad_norm, momentum, name, param_groups, weight_decay",
        ),
        (
            lambda: ParamSpec("optimizer", "uniform", low=0, high=1),
            "search_space.path='optimizer' is invalid: it names a section; name one of its fields",
        ),
        (
            lambda: ParamSpec("optimizer.lr", "normal", low=1e-4, high=1e-2),
            "search_space[optimizer.lr].kind='normal' is invalid: choose one of log_uniform, uniform, int, choice",
        ),
        (
            lambda: ParamSpec("optimizer.lr", "uniform", low=0.1, high=0.01),
            "search_space[optimizer.lr].low=0.1 is invalid: it must be below high=0.01",
        ),
        (
            lambda: ParamSpec("optimizer.lr", "uniform", low=0.1, high=0.1),
            "search_space[optimizer.lr].low=0.1 is invalid: it must be below high=0.1",
        ),
        (
            lambda: ParamSpec("optimizer.weight_decay", "log_uniform", low=0.0, high=0.1),
            "search_space[optimizer.weight_decay].low=0.0 is invalid: a log_uniform range must be above 0",
        ),
        (
            lambda: ParamSpec("schedule.warmup_steps", "int", low=0.5, high=10),
            "search_space[schedule.warmup_steps].low=(0.5, 10) is invalid: an int range needs whole-number bounds",
        ),
        (
            lambda: TuningConfig(search_space=[ParamSpec("loop.batch_size", "choice", choices=["16", "0"])]),
            "loop.batch_size=0 is invalid: auto (or 0) sizes the micro-batch",
        ),
        (
            lambda: ParamSpec("loop.batch_size", "choice", choices=["16", "big"]),
            "loop.batch_size='big' is invalid: expected a number (int)",
        ),
        (
            lambda: TuningConfig(search_space=[ParamSpec("optimizer.name", "choice", choices=["adamw", "lion"])]),
            "optimizer.name='lion' is invalid: choose one of sgd, adam, adamw",
        ),
        (
            lambda: ParamSpec("optimizer.name", "choice", choices=[]),
            "search_space[optimizer.name].choices=[] is invalid: a choice needs at least one value",
        ),
        (
            lambda: TuningConfig.from_dict({"algorithm": "grid", "num_trials": 4}),
            "num_trials=4 is invalid: the grid has 162 points: raise num_trials to 162 or use fewer "
            "grid_points/choices",
        ),
        (
            lambda: TuningConfig.from_dict({"algorithm": "asha", "asha": {"min_epochs": 5}}),
            "asha.min_epochs=5 is invalid: it must be <= base.loop.epochs=4",
        ),
        (
            lambda: TuningConfig.from_dict({"algorithm": "pbt", "num_trials": 1}),
            "num_trials=1 is invalid: pbt needs a population of at least 2",
        ),
        (
            lambda: TuningConfig.from_dict({"algorithm": "grid", "strategy": "ray_tune", "num_trials": 200}),
            "algorithm='grid' is invalid: strategy='ray_tune' runs random, bayesian, asha or pbt; use "
            "strategy='flyte' for grid",
        ),
        (
            lambda: TuningConfig.from_dict({"algorithm": "hyperband"}),
            "algorithm='hyperband' is invalid: choose one of random, grid, bayesian, asha, pbt",
        ),
        (
            lambda: TuningConfig.from_dict({"metric": "val_f1"}),
            "metric='val_f1' is invalid: the workload base.workload.name='image_classification' does not say which "
            "way 'f1' improves: rank on val_accuracy (its primary_metric) or val_loss, or declare metric_modes = "
            "{'f1': 'max'} (or 'min') on the workload",
        ),
        (lambda: TuningConfig.from_dict({"asha": {"eta": 1}}), "asha.eta=1 is invalid: it must be >= 2"),
        (
            lambda: TuningConfig.from_dict({"algorithm": "asha", "base": {"loop": {"max_steps": 10}}}),
            "base.loop.max_steps=10 is invalid: asha budgets trials in epochs; set it to 0",
        ),
        (
            lambda: TuningConfig.from_dict(
                {"search_space": [{"path": "optimizer.lr", "kind": "uniform", "low": 0.1, "high": 0.2}] * 2}
            ),
            "search_space=['optimizer.lr', 'optimizer.lr'] is invalid: each path may appear once",
        ),
    ],
    ids=[
        "unknown-path",
        "section-path",
        "bad-kind",
        "low-above-high",
        "empty-range",
        "log-range-at-zero",
        "fractional-int-range",
        "zero-batch-choice",
        "text-batch-choice",
        "unknown-optimizer-choice",
        "no-choices",
        "grid-above-num-trials",
        "asha-min-epochs-above-epochs",
        "pbt-single-trial",
        "ray-tune-grid",
        "unknown-algorithm",
        "unknown-metric",
        "asha-eta-1",
        "asha-with-max-steps",
        "duplicate-path",
    ],
)
def test_invalid_search_names_the_field_the_value_and_the_fix(build, message):
    with pytest.raises(ValueError) as excinfo:
        build()
    assert message in str(excinfo.value)


def test_asha_min_epochs_is_checked_against_the_given_base_not_the_default_one():
    cfg = TuningConfig.from_dict(
        {"algorithm": "asha", "asha": {"min_epochs": 5, "eta": 2}, "base": {"loop": {"epochs": 10}}}
    )
    assert asha_rungs(cfg.base.loop.epochs, min_epochs=cfg.asha.min_epochs, eta=cfg.asha.eta) == [5, 10]


def test_values_that_no_trial_of_this_base_could_run_fail_before_the_search():
    # A batch size of 0 at the low end of an int range would fail the trials that draw it.
    with pytest.raises(ValueError, match=r"loop.batch_size=0 is invalid"):
        TuningConfig.from_dict(
            {"algorithm": "random", "search_space": [{"path": "loop.batch_size", "kind": "int", "low": 0, "high": 64}]}
        )
    with pytest.raises(ValueError, match=r"optimizer.momentum=1.5 is invalid"):
        TuningConfig.from_dict(
            {
                "algorithm": "random",
                "search_space": [{"path": "optimizer.momentum", "kind": "uniform", "low": 0.5, "high": 1.5}],
            }
        )


def test_suggest_accepts_finished_trials_sampled_from_a_narrow_range():
    cfg = TuningConfig.from_dict(
        {
            "algorithm": "bayesian",
            "num_trials": 4,
            "search_space": [{"path": "optimizer.momentum", "kind": "uniform", "low": 0.123412, "high": 0.123419}],
        }
    )
    first = initial_params(cfg)
    assert all(0.123412 <= float(p["optimizer.momentum"]) <= 0.123419 for p in first)
    assert len(suggest(cfg, finished=[(p, 0.5) for p in first], count=2, round_index=1)) == 2


def test_yaml_file_overlays_the_tuning_defaults_and_environment_overrides_win(tmp_path):
    path = tmp_path / "search.yaml"
    path.write_text(
        "algorithm: random\n"
        "num_trials: 6\n"
        "seed: 3\n"
        "search_space:\n"
        "  - {path: optimizer.lr, kind: log_uniform, low: 0.001, high: 0.1}\n"
        "  - {path: loop.batch_size, kind: choice, choices: [16, 64]}\n"
        "  - {path: optimizer.momentum, kind: choice, choices: [0.5, 0.9]}\n"
        "base:\n"
        "  loop: {epochs: 3}\n"
        "  optimizer: {name: sgd}\n"
    )
    env = {
        "TUNING__NUM_TRIALS": "5",
        "TUNING__BASE__OPTIMIZER__LR": "0.05",
        "TUNING__ASHA__ETA": "3",
        "TRAINING_CORE__LOOP__EPOCHS": "99",
    }
    cfg = load_tuning_config(str(path), environ=env)

    assert (cfg.algorithm, cfg.num_trials, cfg.seed, cfg.asha.eta) == ("random", 5, 3, 3)
    assert [s.path for s in cfg.search_space] == ["optimizer.lr", "loop.batch_size", "optimizer.momentum"]
    assert cfg.search_space[1].choices == ["16", "64"]  # numbers in YAML become text
    assert cfg.search_space[2].choices == ["0.5", "0.9"]
    assert cfg.search_space[0].low == pytest.approx(0.001) and cfg.search_space[0].high == pytest.approx(0.1)
    # The partial base lands on the tuning defaults (small_cnn, 1 worker), not the training pipeline's.
    defaults = default_base()
    assert (
        cfg.base.loop.epochs == 3 and cfg.base.optimizer.name == "sgd" and cfg.base.optimizer.lr == pytest.approx(0.05)
    )
    assert cfg.base.model.name == defaults.model.name == "small_cnn"
    assert cfg.base.scaling == defaults.scaling and cfg.base.scaling.num_workers == 1
    assert cfg.base.data.num_shards == 2 and cfg.base.tracking.experiment_name == "tuning"
    assert cfg.base.loop.log_interval_steps == defaults.loop.log_interval_steps
    # TRAINING_CORE__ variables belong to the training pipeline, not to a search.
    assert cfg.base.loop.epochs != 99
    assert TuningConfig.from_dict(cfg.to_dict()) == cfg


def test_a_search_base_sizes_its_micro_batch_with_auto_from_its_file_or_the_environment(tmp_path):
    from training_core.config import AUTO

    path = tmp_path / "tuning.yaml"
    lr_only = "search_space:\n  - {path: optimizer.lr, kind: log_uniform, low: 0.001, high: 0.1}\n"
    path.write_text(lr_only + "base:\n  loop: {batch_size: auto, global_batch_size: 64}\n")
    assert load_tuning_config(str(path), environ={}).base.loop.batch_size == AUTO
    path.write_text(lr_only)
    env = {"TUNING__BASE__LOOP__BATCH_SIZE": "Auto", "TUNING__BASE__LOOP__GLOBAL_BATCH_SIZE": "32"}
    cfg = load_tuning_config(str(path), environ=env)
    assert (cfg.base.loop.batch_size, cfg.base.loop.global_batch_size) == (AUTO, 32)
    assert TuningConfig.from_dict(cfg.to_dict()) == cfg


def test_no_file_and_no_environment_gives_the_default_search():
    cfg = load_tuning_config(environ={})
    assert cfg == TuningConfig()
    assert (cfg.algorithm, cfg.num_trials, cfg.base.loop.epochs) == ("asha", 8, 4)
    assert asha_rungs(cfg.base.loop.epochs, min_epochs=cfg.asha.min_epochs, eta=cfg.asha.eta) == [1, 2, 4]


def test_apply_params_converts_text_to_each_fields_type_and_leaves_the_base_alone():
    base = default_base()
    cfg = apply_params(
        base,
        {
            "optimizer.lr": "0.003",
            "loop.batch_size": "64",
            "optimizer.name": "sgd",
            "schedule.warmup_steps": "7",
            "model.sync_batchnorm": "false",
        },
    )
    assert cfg.optimizer.lr == 0.003 and type(cfg.optimizer.lr) is float
    assert cfg.loop.batch_size == 64 and type(cfg.loop.batch_size) is int
    assert cfg.schedule.warmup_steps == 7 and type(cfg.schedule.warmup_steps) is int
    assert cfg.optimizer.name == "sgd" and cfg.model.sync_batchnorm is False
    assert cfg.model == base.model and cfg.scaling == base.scaling and cfg.data == base.data
    assert base == default_base()
    with pytest.raises(ValueError, match=r"loop.batch_size='2.5' is invalid: expected a number \(int\)"):
        apply_params(base, {"loop.batch_size": "2.5"})


def test_sample_stays_in_range_is_log_uniform_and_reproducible_by_seed():
    space = [
        ParamSpec("optimizer.lr", "log_uniform", low=1e-4, high=1e-1),
        ParamSpec("optimizer.momentum", "uniform", low=0.5, high=0.9),
        ParamSpec("schedule.warmup_steps", "int", low=0, high=4),
        ParamSpec("optimizer.name", "choice", choices=["adamw", "sgd"]),
    ]
    rng = random.Random(0)
    draws = [sample(space, rng) for _ in range(2000)]
    lrs = [float(d["optimizer.lr"]) for d in draws]
    assert all(1e-4 <= lr <= 1e-1 for lr in lrs)
    # Log-uniform: each decade holds about a third of the draws (uniform would put 90% in the top one).
    for low in (1e-4, 1e-3, 1e-2):
        share = sum(low <= lr < 10 * low for lr in lrs) / len(lrs)
        assert 0.28 < share < 0.39, (low, share)
    assert all(0.5 <= float(d["optimizer.momentum"]) <= 0.9 for d in draws)
    warmups = [d["schedule.warmup_steps"] for d in draws]
    assert set(warmups) == {"0", "1", "2", "3", "4"}  # both ends included
    assert {d["optimizer.name"] for d in draws} == {"adamw", "sgd"}
    for d in draws[:50]:
        apply_params(TrainingConfig(), d)  # every draw is a valid config

    again = random.Random(0)
    assert [sample(space, again) for _ in range(2000)] == draws
    other = random.Random(1)
    assert [sample(space, other) for _ in range(20)] != draws[:20]


def test_grid_points_spacing_size_and_stable_order():
    lr = ParamSpec("optimizer.lr", "log_uniform", low=1e-4, high=1e-2, grid_points=3)
    momentum = ParamSpec("optimizer.momentum", "uniform", low=0.5, high=0.9, grid_points=3)
    few_ints = ParamSpec("schedule.warmup_steps", "int", low=0, high=2, grid_points=5)
    many_ints = ParamSpec("loop.epochs", "int", low=1, high=9, grid_points=3)
    name = ParamSpec("optimizer.name", "choice", choices=["adamw", "sgd"])

    assert [p["optimizer.lr"] for p in grid_points([lr])] == ["0.0001", "0.001", "0.01"]
    assert [p["optimizer.momentum"] for p in grid_points([momentum])] == ["0.5", "0.7", "0.9"]
    assert [p["schedule.warmup_steps"] for p in grid_points([few_ints])] == [
        "0",
        "1",
        "2",
    ]  # an int range smaller than the grid: all of it
    assert [p["loop.epochs"] for p in grid_points([many_ints])] == ["1", "5", "9"]
    single = ParamSpec("optimizer.lr", "log_uniform", low=1e-4, high=1e-2, grid_points=1)
    assert grid_points([single]) == [{"optimizer.lr": "0.001"}]  # the geometric middle

    grid = grid_points([lr, few_ints, name])
    assert len(grid) == 3 * 3 * 2
    assert len({tuple(sorted(p.items())) for p in grid}) == len(grid)
    assert grid[:3] == [
        {"optimizer.lr": "0.0001", "schedule.warmup_steps": "0", "optimizer.name": "adamw"},
        {"optimizer.lr": "0.0001", "schedule.warmup_steps": "0", "optimizer.name": "sgd"},
        {"optimizer.lr": "0.0001", "schedule.warmup_steps": "1", "optimizer.name": "adamw"},
    ]
    assert grid == grid_points([lr, few_ints, name])

    cfg = TuningConfig(algorithm="grid", num_trials=18, search_space=[lr, few_ints, name])
    assert initial_params(cfg) == grid and num_rounds(cfg) == 1


@pytest.mark.parametrize(
    ("max_epochs", "min_epochs", "eta", "rungs"),
    [(4, 1, 2, [1, 2, 4]), (9, 1, 3, [1, 3, 9]), (5, 1, 2, [1, 2, 4, 5]), (12, 2, 2, [2, 4, 8, 12]), (3, 3, 2, [3])],
)
def test_asha_rungs_grow_by_eta_and_end_at_the_full_budget(max_epochs, min_epochs, eta, rungs):
    assert asha_rungs(max_epochs, min_epochs=min_epochs, eta=eta) == rungs


def test_asha_rounds_train_to_each_rung_and_pbt_to_each_interval():
    asha = TuningConfig.from_dict(
        {"algorithm": "asha", "asha": {"min_epochs": 1, "eta": 3}, "base": {"loop": {"epochs": 4}}}
    )
    assert num_rounds(asha) == 3 and [round_stop_epoch(asha, i) for i in range(3)] == [1, 3, 4]
    pbt = TuningConfig.from_dict({"algorithm": "pbt", "pbt": {"interval_epochs": 3}, "base": {"loop": {"epochs": 4}}})
    assert num_rounds(pbt) == 2 and [round_stop_epoch(pbt, i) for i in range(2)] == [3, 4]
    rand = TuningConfig.from_dict({"algorithm": "random"})
    assert num_rounds(rand) == 1 and round_stop_epoch(rand, 0) == rand.base.loop.epochs


def test_successive_halving_keeps_the_best_fraction_in_either_direction():
    scores = [0.5, 0.9, 0.7, 0.8, 0.6, 0.85]
    assert successive_halving_keep(scores, eta=2, mode="max") == [1, 5, 3]
    assert successive_halving_keep(scores, eta=3, mode="max") == [1, 5]
    assert successive_halving_keep(scores, eta=2, mode="min") == [0, 4, 2]
    assert successive_halving_keep([0.3, 0.2], eta=3, mode="max") == [0]  # at least one survives
    assert successive_halving_keep([0.4, 0.4, 0.1, 0.4], eta=2, mode="max") == [0, 1]  # ties: lower index first


def test_pbt_bottom_quantile_copies_from_the_top_quantile_never_from_itself():
    scores = [0.61, 0.95, 0.40, 0.88, 0.72, 0.30, 0.90, 0.55]  # top two: 1, 6; bottom two: 5, 2
    seen_sources = set()
    for seed in range(50):
        copies = pbt_exploit(scores, quantile=0.25, mode="max", rng=random.Random(seed))
        assert set(copies) == {5, 2}
        assert set(copies.values()) <= {1, 6}
        assert all(loser != winner for loser, winner in copies.items())
        seen_sources |= set(copies.values())
    assert seen_sources == {1, 6}
    losses = [1 - s for s in scores]
    assert set(pbt_exploit(losses, quantile=0.25, mode="min", rng=random.Random(0))) == {5, 2}
    assert pbt_exploit([0.2, 0.9], quantile=0.25, mode="max", rng=random.Random(0)) == {0: 1}
    assert pbt_exploit([0.5, 0.5, 0.5], quantile=0.5, mode="max", rng=random.Random(0)) == {2: 0}


def test_perturb_scales_and_clips_numeric_params_and_keeps_choices():
    space = [
        ParamSpec("optimizer.lr", "log_uniform", low=3e-4, high=3e-2),
        ParamSpec("schedule.warmup_steps", "int", low=0, high=40),
        ParamSpec("optimizer.name", "choice", choices=["adamw", "sgd"]),
    ]
    top = {"optimizer.lr": "0.03", "schedule.warmup_steps": "40", "optimizer.name": "sgd"}
    up = perturb(top, space, factors=[1.25], resample_probability=0.0, rng=random.Random(0))
    assert up == {"optimizer.lr": "0.03", "schedule.warmup_steps": "40", "optimizer.name": "sgd"}  # clipped at high
    bottom = {"optimizer.lr": "0.0003", "schedule.warmup_steps": "10", "optimizer.name": "adamw"}
    down = perturb(bottom, space, factors=[0.8], resample_probability=0.0, rng=random.Random(0))
    assert down == {"optimizer.lr": "0.0003", "schedule.warmup_steps": "8", "optimizer.name": "adamw"}
    middle = {"optimizer.lr": "0.001", "schedule.warmup_steps": "20", "optimizer.name": "sgd"}
    scaled = perturb(middle, space, factors=[0.8, 1.25], resample_probability=0.0, rng=random.Random(3))
    assert scaled["optimizer.lr"] in ("0.0008", "0.00125") and scaled["schedule.warmup_steps"] in ("16", "25")
    assert middle == {"optimizer.lr": "0.001", "schedule.warmup_steps": "20", "optimizer.name": "sgd"}
    for seed in range(30):
        fresh = perturb(middle, space, factors=[0.8, 1.25], resample_probability=1.0, rng=random.Random(seed))
        assert 3e-4 <= float(fresh["optimizer.lr"]) <= 3e-2 and 0 <= int(fresh["schedule.warmup_steps"]) <= 40
        assert fresh["optimizer.name"] == "sgd"


def test_perturb_moves_a_small_int_param_that_its_factor_would_round_back_to_itself():
    # 2 x 1.25 = 2.5 and 2 x 0.8 = 1.6 both round to 2: warmup_steps=2 never changed unless resampled.
    space = [ParamSpec("schedule.warmup_steps", "int", low=0, high=40)]
    seen = {
        perturb({"schedule.warmup_steps": "2"}, space, factors=[0.8, 1.25], resample_probability=0.0,
                rng=random.Random(seed))["schedule.warmup_steps"]
        for seed in range(20)
    }  # fmt: skip
    assert seen == {"1", "3"}
    at_low = perturb({"schedule.warmup_steps": "0"}, space, factors=[0.8], resample_probability=0, rng=random.Random())
    assert at_low == {"schedule.warmup_steps": "0"}  # clipped to the range, as before


def _lr_search(**overrides) -> TuningConfig:
    return TuningConfig.from_dict(
        {
            "algorithm": "bayesian",
            "num_trials": 60,
            "bayesian": {"num_rounds": 3},
            "seed": 7,
            "search_space": [{"path": "optimizer.lr", "kind": "log_uniform", "low": 1e-4, "high": 1.0}],
            **overrides,
        }
    )


def _lr_score(params: dict[str, str]) -> float:
    """A clear landscape: accuracy rises with log10(lr), from 0.2 at 1e-4 to 0.96 at 1."""
    return 0.96 + 0.19 * math.log10(float(params["optimizer.lr"]))


def test_suggest_is_reproducible_and_stays_in_the_space():
    cfg = TuningConfig.from_dict({"algorithm": "bayesian", "num_trials": 8, "seed": 5})
    finished = [(p, 0.5 + 0.01 * i) for i, p in enumerate(initial_params(cfg))]
    first = suggest(cfg, finished=finished, count=4, round_index=1)
    assert first == suggest(cfg, finished=finished, count=4, round_index=1)
    assert first != suggest(cfg, finished=finished, count=4, round_index=2)
    specs = {s.path: s for s in cfg.search_space}
    for params in first:
        assert set(params) == set(specs)
        for path, value in params.items():
            spec = specs[path]
            if spec.kind == "choice":
                assert value in spec.choices
            else:
                assert spec.low <= float(value) <= spec.high
        apply_params(cfg.base, params)


def test_suggest_concentrates_where_finished_trials_scored_best():
    cfg = _lr_search()
    startup = bayesian_round_sizes(cfg)[0]
    assert startup == 20
    rng = random.Random(0)
    finished = [(p, _lr_score(p)) for p in (sample(cfg.search_space, rng) for _ in range(2 * startup))]
    suggested = suggest(cfg, finished=finished, count=20, round_index=2)
    randomly = [sample(cfg.search_space, random.Random(100 + i)) for i in range(200)]

    def top_decade_share(points):  # lr in [0.1, 1]: the best quarter of the log range
        return sum(float(p["optimizer.lr"]) >= 0.1 for p in points) / len(points)

    assert top_decade_share(randomly) == pytest.approx(0.25, abs=0.08)
    assert top_decade_share(suggested) >= 0.6
    mean = lambda points: sum(_lr_score(p) for p in points) / len(points)  # noqa: E731
    assert mean(suggested) > mean(randomly) + 0.1
    # Told the opposite landscape, it goes the other way: the trials drive it, not a fixed bias.
    flipped = [(p, -s) for p, s in finished]
    assert top_decade_share(suggest(cfg, finished=flipped, count=20, round_index=2)) < 0.25


def test_random_and_asha_with_the_same_seed_start_with_the_same_trials():
    raw = {"num_trials": 9, "seed": 4, "asha": {"min_epochs": 1, "eta": 3}, "base": {"loop": {"epochs": 4}}}
    asha = TuningConfig.from_dict({**raw, "algorithm": "asha"})
    rand = TuningConfig.from_dict({**raw, "algorithm": "random"})
    pbt = TuningConfig.from_dict({**raw, "algorithm": "pbt"})
    trials = initial_params(asha)
    assert len(trials) == 9 and len({tuple(sorted(t.items())) for t in trials}) == 9
    assert initial_params(rand) == trials == initial_params(pbt)
    assert initial_params(TuningConfig.from_dict({**raw, "algorithm": "random", "seed": 5})) != trials


def test_bayesian_first_round_is_random_and_its_size_follows_the_round_split():
    cfg = TuningConfig.from_dict({"algorithm": "bayesian", "num_trials": 7, "bayesian": {"num_rounds": 3}, "seed": 2})
    assert bayesian_round_sizes(cfg) == [3, 2, 2] and num_rounds(cfg) == 3
    first = initial_params(cfg)
    assert len(first) == 3 and first == initial_params(cfg)
    assert bayesian_round_sizes(
        TuningConfig.from_dict({"algorithm": "bayesian", "num_trials": 1, "bayesian": {"num_rounds": 3}})
    ) == [1]


def _scored(params: list[dict[str, str]], scores: list[float], trial_ids: list[int] | None = None) -> list[ScoredTrial]:
    ids = range(len(scores)) if trial_ids is None else trial_ids
    return [ScoredTrial(trial_id=i, params=p, score=s) for i, p, s in zip(ids, params, scores, strict=True)]


def test_asha_rounds_continue_the_top_trials_of_each_rung_and_stop_the_rest():
    cfg = TuningConfig.from_dict(
        {"algorithm": "asha", "num_trials": 6, "asha": {"min_epochs": 1, "eta": 2}, "base": {"loop": {"epochs": 4}}}
    )
    params = initial_params(cfg)
    first = _scored(params, [0.5, 0.9, 0.7, 0.8, 0.6, 0.85])
    assert decide_round(cfg, round_index=0, trained=first, finished=first) == RoundDecision(
        continuing=[1, 3, 5], stopped=[0, 2, 4]
    )
    # Rung 2 trains the survivors only; the decision names them by trial id, not by place in the round.
    second = _scored([params[i] for i in (1, 3, 5)], [0.91, 0.84, 0.93], trial_ids=[1, 3, 5])
    assert decide_round(cfg, round_index=1, trained=second, finished=second) == RoundDecision(
        continuing=[5], stopped=[1, 3]
    )
    # The last rung decides nothing: its trials are done.
    last = _scored([params[5]], [0.95], trial_ids=[5])
    assert decide_round(cfg, round_index=2, trained=last, finished=last) == RoundDecision()

    by_loss = TuningConfig.from_dict({**cfg.to_dict(), "metric": "val_loss"})
    assert decide_round(by_loss, round_index=0, trained=first, finished=first).continuing == [0, 2, 4]


def _pbt(**pbt) -> TuningConfig:
    return TuningConfig.from_dict(
        {
            "algorithm": "pbt",
            "num_trials": 4,
            "base": {"loop": {"epochs": 2}},
            "pbt": {"interval_epochs": 1, "quantile": 0.25, **pbt},
            "search_space": [
                {"path": "optimizer.lr", "kind": "log_uniform", "low": 1e-4, "high": 1e-1},
                {"path": "schedule.warmup_steps", "kind": "int", "low": 0, "high": 40},
                {"path": "optimizer.name", "kind": "choice", "choices": ["adamw", "sgd"]},
            ],
        }
    )


def test_pbt_round_copies_the_worst_trial_from_the_best_with_its_params_perturbed_and_clipped():
    cfg = _pbt(perturbation_factors=[1.25], resample_probability=0.0)
    params = [
        {"optimizer.lr": "0.001", "schedule.warmup_steps": "10", "optimizer.name": "sgd"},
        {"optimizer.lr": "0.004", "schedule.warmup_steps": "36", "optimizer.name": "adamw"},
        {"optimizer.lr": "0.0002", "schedule.warmup_steps": "0", "optimizer.name": "sgd"},
        {"optimizer.lr": "0.01", "schedule.warmup_steps": "20", "optimizer.name": "adamw"},
    ]
    trained = _scored(params, [0.5, 0.9, 0.2, 0.7])
    decision = decide_round(cfg, round_index=0, trained=trained, finished=trained)
    # One trial per quantile of four: trial 2 (the worst) continues from trial 1 (the best); everyone trains on.
    # The copy's lr is 1.25 times the source's, its warmup 36 * 1.25 clipped to the range's 40, its optimizer kept.
    assert decision == RoundDecision(
        continuing=[0, 1, 2, 3],
        copies=[
            PbtCopy(
                trial_id=2,
                source_trial_id=1,
                params={"optimizer.lr": "0.005", "schedule.warmup_steps": "40", "optimizer.name": "adamw"},
            )
        ],
    )
    assert params[1] == {"optimizer.lr": "0.004", "schedule.warmup_steps": "36", "optimizer.name": "adamw"}
    assert decide_round(cfg, round_index=1, trained=trained, finished=trained) == RoundDecision()  # the last slice


def test_pbt_copies_come_from_the_top_quantile_scaled_by_a_seeded_choice_of_factor():
    cfg = TuningConfig.from_dict(
        {**_pbt(perturbation_factors=[0.8, 1.25], resample_probability=0.0).to_dict(), "num_trials": 8}
    )
    lrs = ["0.001", "0.002", "0.003", "0.004", "0.005", "0.006", "0.007", "0.008"]
    params = [
        {"optimizer.lr": lr, "schedule.warmup_steps": "20", "optimizer.name": "sgd" if i % 2 else "adamw"}
        for i, lr in enumerate(lrs)
    ]
    trained = _scored(params, [0.61, 0.95, 0.40, 0.88, 0.72, 0.30, 0.90, 0.55])  # top: 1, 6; bottom: 5, 2
    sources = set()
    for seed in range(20):
        decision = pbt_decision(cfg, trained, rng=random.Random(seed))
        assert decision == pbt_decision(cfg, trained, rng=random.Random(seed)), "the same seed, the same copies"
        assert decision.continuing == list(range(8)) and not decision.stopped and not decision.new_params
        assert sorted(c.trial_id for c in decision.copies) == [2, 5]
        for copy in decision.copies:
            assert copy.source_trial_id in (1, 6)
            source = params[copy.source_trial_id]
            ratio = float(copy.params["optimizer.lr"]) / float(source["optimizer.lr"])
            assert ratio == pytest.approx(0.8) or ratio == pytest.approx(1.25), (seed, ratio)
            assert copy.params["schedule.warmup_steps"] in ("16", "25")
            assert copy.params["optimizer.name"] == source["optimizer.name"]
            sources.add(copy.source_trial_id)
    assert sources == {1, 6}
    # decide_round seeds PBT by the search's seed and the round: a re-run of the search makes the same copies.
    assert decide_round(cfg, round_index=0, trained=trained, finished=trained) == decide_round(
        cfg, round_index=0, trained=trained, finished=trained
    )


def test_pbt_resampling_draws_a_copys_numeric_params_from_the_whole_range():
    cfg = TuningConfig.from_dict({**_pbt(resample_probability=1.0).to_dict(), "num_trials": 8})
    params = [{"optimizer.lr": "0.001", "schedule.warmup_steps": "20", "optimizer.name": "sgd"} for _ in range(8)]
    trained = _scored(params, [0.61, 0.95, 0.40, 0.88, 0.72, 0.30, 0.90, 0.55])
    drawn = [copy.params for seed in range(10) for copy in pbt_decision(cfg, trained, rng=random.Random(seed)).copies]
    assert len(drawn) == 20
    assert all(1e-4 <= float(p["optimizer.lr"]) <= 1e-1 and 0 <= int(p["schedule.warmup_steps"]) <= 40 for p in drawn)
    assert all(p["optimizer.name"] == "sgd" for p in drawn)
    assert {p["optimizer.lr"] for p in drawn} - {"0.0008", "0.00125"}, "resampled, not scaled"


def test_bayesian_round_adds_the_trials_tpe_suggests_from_every_finished_trial():
    cfg = TuningConfig.from_dict({"algorithm": "bayesian", "num_trials": 5, "bayesian": {"num_rounds": 2}, "seed": 3})
    first = initial_params(cfg)
    finished = _scored(first, [0.3, 0.6, 0.9])
    decision = decide_round(cfg, round_index=0, trained=finished, finished=finished)
    expected = suggest(cfg, finished=[(p, s) for p, s in zip(first, [0.3, 0.6, 0.9])], count=2, round_index=1)
    assert decision == RoundDecision(new_params=expected)  # the round's own trials are done
    # TPE learns from every finished trial of the search, not only from the round's.
    assert decide_round(cfg, round_index=0, trained=finished[2:], finished=finished) == decision
    assert decide_round(cfg, round_index=1, trained=finished, finished=finished) == RoundDecision()


@pytest.mark.parametrize("algorithm", ["random", "grid"])
def test_single_round_searches_continue_no_trial(algorithm):
    cfg = TuningConfig.from_dict(
        {
            "algorithm": algorithm,
            "num_trials": 4,
            "search_space": [{"path": "optimizer.name", "kind": "choice", "choices": ["adamw", "sgd"]}],
        }
    )
    trained = _scored(initial_params(cfg)[:2], [0.4, 0.8])
    assert decide_round(cfg, round_index=0, trained=trained, finished=trained) == RoundDecision()


# --- the user's own hyperparameters and metrics ------------------------------------------------------------------

CNN = "examples.cnn_params.workload:DigitsCNN"


def test_a_search_over_a_users_own_hyperparameter_gives_each_trial_its_value_as_json():
    cfg = TuningConfig.from_dict(
        {
            "algorithm": "grid",
            "num_trials": 3,
            "search_space": [{"path": "workload.params.kernel_size", "kind": "choice", "choices": [1, 3, 5]}],
            "base": {"workload": {"name": CNN, "params": {"kernel_size": 3, "channels": 8}}},
        }
    )
    trials = [apply_params(cfg.base, params) for params in initial_params(cfg)]
    assert [t.workload.params for t in trials] == [{"channels": 8, "kernel_size": k} for k in (1, 3, 5)]
    assert all(type(t.workload.params["kernel_size"]) is int for t in trials)
    ranged = TuningConfig.from_dict(
        {
            "algorithm": "random",
            "search_space": [{"path": "workload.params.dropout", "kind": "uniform", "low": 0.1, "high": 0.5}],
        }
    )
    (first, *_) = [apply_params(ranged.base, params) for params in initial_params(ranged)]
    assert 0.1 <= first.workload.params["dropout"] <= 0.5 and type(first.workload.params["dropout"]) is float


def test_a_users_hyperparameter_path_must_name_one_identifier():
    with pytest.raises(ValueError) as caught:
        ParamSpec("workload.params.head.width", "int", low=1, high=4)
    assert str(caught.value).startswith(
        "search_space.path='workload.params.head.width' is invalid: name one hyperparameter as workload.params.<name>"
    )


def test_a_workloads_primary_metric_ranks_trials_in_its_primary_mode():
    cfg = TuningConfig.from_dict({"metric": "val_f1", "asha": {"eta": 2}, "base": {"workload": {"name": CNN}}})
    assert cfg.mode == "max"  # DigitsCNN: primary_metric f1, primary_mode max
    trained = [ScoredTrial(trial_id=i, params={}, score=f1) for i, f1 in enumerate([0.2, 0.9, 0.5, 0.7])]
    decision = decide_round(cfg, round_index=0, trained=trained, finished=trained)
    assert decision.continuing == [1, 3] and decision.stopped == [0, 2]


def test_a_metric_the_workload_declares_a_direction_for_ranks_in_that_direction(tmp_path, monkeypatch):
    (tmp_path / "declared_modes.py").write_text(
        "from examples.cnn_params.workload import DigitsCNN\n\n"
        "class Calibrated(DigitsCNN):\n"
        "    metric_modes = {'calibration_error': 'min'}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TuningConfig.from_dict(
        {"metric": "val_calibration_error", "base": {"workload": {"name": "declared_modes:Calibrated"}}}
    )
    assert cfg.mode == "min"
    with pytest.raises(ValueError, match=r"metric='val_f1' is invalid: strategy='ray_tune' ranks on val_accuracy"):
        TuningConfig.from_dict(
            {"metric": "val_f1", "strategy": "ray_tune", "algorithm": "random", "base": {"workload": {"name": CNN}}}
        )


def test_pyflyte_reads_a_partial_tuning_yaml_onto_the_tuning_defaults(tmp_path):
    from flytekit.interaction.click_types import JsonParamType

    path = tmp_path / "search.yaml"
    path.write_text(
        "algorithm: random\n"
        "metric: val_f1\n"
        "search_space:\n"
        "  - {path: workload.params.kernel_size, kind: choice, choices: [3, 5]}\n"
        "base:\n"
        "  workload: {name: " + CNN + "}\n"
        "  loop: {epochs: 2}\n"
    )
    cfg = JsonParamType(TuningConfig).convert(str(path), None, None)  # what `pyflyte run --config` does with it
    defaults = default_base()
    assert cfg.base.scaling == defaults.scaling and cfg.base.model.name == "small_cnn"  # not TrainingConfig()'s
    assert cfg.base.loop.epochs == 2 and cfg.base.loop.log_interval_steps == defaults.loop.log_interval_steps
    assert cfg.search_space[0].choices == ["3", "5"] and cfg.mode == "max"
    assert cfg == load_tuning_config(str(path), environ={})


def test_a_value_of_the_search_that_the_workloads_params_type_refuses_fails_before_the_search():
    with pytest.raises(ValueError) as caught:
        TuningConfig.from_dict(
            {
                "algorithm": "random",
                "search_space": [{"path": "workload.params.kernel_size", "kind": "choice", "choices": [3, 4]}],
                "base": {"workload": {"name": CNN}},
            }
        )
    assert str(caught.value) == (
        "workload.params={'kernel_size': 4} is invalid: CNNParams refused it (ValueError: kernel_size=4 must be an odd "
        "number >= 1, e.g. 3 or 5); fix the value it names"
    )
