"""Hyperparameter search: the typed search space and the decisions of each search algorithm.

Everything here is pure Python (Optuna is imported only by the Bayesian search), so the same decisions
drive both strategies: Flyte fan-out, where every trial is a node of the execution graph, and Ray Tune.

- ``random`` and ``grid`` sample every trial up front and train each to ``base.loop.epochs``.
- ``bayesian`` runs rounds: each round's trials are suggested by Optuna's TPE from the finished ones
  (ask/tell; the study is rebuilt from the trials each round, so no study storage is needed).
- ``asha`` is successive halving over rungs of growing epoch budgets (:func:`asha_rungs`): every rung
  trains the survivors of the previous one further, resuming from their own checkpoints, and keeps the
  top ``1/eta``.
- ``pbt`` trains all trials in slices of ``pbt.interval_epochs``; between slices the bottom quantile copies
  the checkpoint of a top trial and perturbs its hyperparameters (:func:`pbt_exploit`, :func:`perturb`).

After each round, :func:`decide_round` turns the trials' scores into a :class:`RoundDecision`: which trials
continue, which stop, which copy whom with what params, and which new ones start.

A trial's config is ``base`` with the trial's params applied by dotted path (:func:`apply_params`); the
params are kept as text (``"0.003"``, ``"adamw"``) and converted to the field's type by the config tree.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, get_args, get_origin, get_type_hints

from training_core.config import (
    METRIC_DIRECTIONS,
    CheckpointConfig,
    DataConfig,
    LoopConfig,
    ModelConfig,
    ScalingConfig,
    TrackingConfig,
    TrainingConfig,
    WorkloadConfig,
    build_dataclass,
    coerce,
    load_layers,
    merge,
    parse_yaml,
)
from training_core.messages import invalid

ALGORITHMS = ("random", "grid", "bayesian", "asha", "pbt")
STRATEGIES = ("flyte", "ray_tune")
KINDS = ("log_uniform", "uniform", "int", "choice")
TUNING_ENV_PREFIX = "TUNING__"

Params = dict[str, str]
"""A trial's hyperparameters: dotted config path -> value as text."""


@dataclass
class ParamSpec:
    """One searched hyperparameter."""

    path: str
    """Dotted path of a ``TrainingConfig`` field, e.g. ``optimizer.lr`` or ``loop.batch_size``, or of one of the
    user's own hyperparameters, ``workload.params.<name>`` (a trial's value is read as YAML: ``"5"`` is 5)."""

    kind: str
    """``log_uniform`` (floats, sampled uniformly in log space), ``uniform``, ``int`` (whole numbers in
    ``[low, high]``) or ``choice`` (one of ``choices``)."""

    low: float = 0.0
    """Lower bound for ``log_uniform``, ``uniform`` and ``int`` (inclusive)."""

    high: float = 0.0
    """Upper bound for ``log_uniform``, ``uniform`` and ``int`` (inclusive)."""

    choices: list[str] = field(default_factory=list)
    """The values of a ``choice``, as text; each is converted to the field's type (``"64"`` -> 64)."""

    grid_points: int = 3
    """Points a ``grid`` search takes on a numeric range: log-spaced for ``log_uniform``, evenly spaced
    otherwise (an ``int`` range with fewer values takes them all)."""

    def __post_init__(self) -> None:
        where = f"search_space[{self.path}]"
        if self.kind not in KINDS:
            invalid(f"{where}.kind", self.kind, f"choose one of {', '.join(KINDS)}")
        field_type = _field_type(self.path)
        if self.kind == "choice":
            if not self.choices:
                invalid(f"{where}.choices", self.choices, "a choice needs at least one value")
            for value in self.choices:
                coerce(self.path, value, field_type)  # each value must have the field's type
        else:
            if not self.low < self.high:
                invalid(f"{where}.low", self.low, f"it must be below high={self.high}")
            if self.kind == "log_uniform" and not self.low > 0:
                invalid(f"{where}.low", self.low, "a log_uniform range must be above 0")
            if self.kind == "int" and (self.low != int(self.low) or self.high != int(self.high)):
                invalid(f"{where}.low", (self.low, self.high), "an int range needs whole-number bounds")
        if self.grid_points < 1:
            invalid(f"{where}.grid_points", self.grid_points, "it must be >= 1")

    @property
    def numeric(self) -> bool:
        return self.kind != "choice"


def default_search_space() -> list[ParamSpec]:
    return [
        ParamSpec("optimizer.lr", "log_uniform", low=3e-4, high=3e-2),
        ParamSpec("loop.batch_size", "choice", choices=["16", "32", "64"]),
        ParamSpec("optimizer.name", "choice", choices=["adamw", "sgd"]),
        ParamSpec("optimizer.weight_decay", "log_uniform", low=1e-5, high=1e-1),
        ParamSpec("schedule.warmup_steps", "int", low=0, high=40),
    ]


def default_base() -> TrainingConfig:
    """A small trial: the compact CNN on digits, one worker, 4 epochs (the largest ASHA rung)."""
    return TrainingConfig(
        data=DataConfig(num_shards=2),
        model=ModelConfig(name="small_cnn"),
        loop=LoopConfig(epochs=4, log_interval_steps=10),
        scaling=ScalingConfig(num_workers=1, cpus_per_worker=1.0, memory_per_worker_gib=2.0, head_memory_gib=2.0),
        checkpoint=CheckpointConfig(keep_last=1),
        tracking=TrackingConfig(experiment_name="tuning", promotion_threshold=0.9),
    )


@dataclass
class AshaConfig:
    min_epochs: int = 1
    """Epoch budget of the first rung. Rung ``k`` trains to ``min_epochs * eta**k`` epochs, and the last
    rung to ``base.loop.epochs``."""

    eta: int = 2
    """Reduction factor: each rung keeps the top ``1/eta`` of the trials it trained (at least one)."""

    def __post_init__(self) -> None:
        if self.min_epochs < 1:
            invalid("asha.min_epochs", self.min_epochs, "it must be >= 1")
        if self.eta < 2:
            invalid("asha.eta", self.eta, "it must be >= 2 (2 halves the trials per rung, 3 keeps a third)")


@dataclass
class PbtConfig:
    interval_epochs: int = 1
    """Epochs each trial trains between two exploit/explore steps."""

    quantile: float = 0.25
    """Fraction of trials in the bottom group (which copy a top trial) and in the top group."""

    perturbation_factors: list[float] = field(default_factory=lambda: [0.8, 1.25])
    """A copied numeric hyperparameter is multiplied by one of these, then clipped to its range."""

    resample_probability: float = 0.25
    """Chance that a copied numeric hyperparameter is drawn afresh from its range instead of perturbed.
    ``choice`` hyperparameters (the optimizer, the batch size) are always inherited with the checkpoint."""

    def __post_init__(self) -> None:
        if not 0 < self.quantile <= 0.5:
            invalid("pbt.quantile", self.quantile, "it must be in (0, 0.5]")
        if self.interval_epochs < 1:
            invalid("pbt.interval_epochs", self.interval_epochs, "it must be >= 1")
        if not self.perturbation_factors or any(f <= 0 for f in self.perturbation_factors):
            invalid(
                "pbt.perturbation_factors", self.perturbation_factors, "give one or more factors > 0, e.g. [0.8, 1.25]"
            )
        if not 0 <= self.resample_probability <= 1:
            invalid("pbt.resample_probability", self.resample_probability, "it must be in [0, 1]")


@dataclass
class BayesianConfig:
    num_rounds: int = 2
    """Rounds of suggestions; ``num_trials`` is split evenly over them. The first round samples at random
    (TPE has nothing to model yet); each later round is suggested from all finished trials."""

    def __post_init__(self) -> None:
        if self.num_rounds < 1:
            invalid("bayesian.num_rounds", self.num_rounds, "it must be >= 1")


@dataclass
class TuningConfig:
    """A whole hyperparameter search: the base run, what is searched, how, and how wide."""

    base: TrainingConfig = field(default_factory=default_base)
    """The run every trial starts from; ``base.loop.epochs`` is a trial's full budget."""

    search_space: list[ParamSpec] = field(default_factory=default_search_space)
    """The searched fields. Defaults: lr (log-uniform), batch size, optimizer, weight decay (log-uniform)
    and warmup steps (int range)."""

    algorithm: str = "asha"
    """``random``, ``grid``, ``bayesian`` (Optuna TPE), ``asha`` (successive halving) or ``pbt``."""

    strategy: str = "flyte"
    """``flyte``: every trial (and every rung or round of it) is a cached, retried node of the workflow.
    ``ray_tune``: one Ray task runs Ray Tune's ``Tuner`` (ASHA, PBT or OptunaSearch) on one RayCluster."""

    num_trials: int = 8
    """Trials to run (``grid``: the most grid points allowed)."""

    max_concurrency: int = 2
    """Trials training at the same time."""

    metric: str = "val_accuracy"
    """What ranks trials: ``val_<name>`` of any metric the workload reports, in the workload's direction:
    ``val_accuracy`` and ``val_loss``, ``val_perplexity`` (language models), ``val_<primary_metric>`` in its
    ``primary_mode``, or a metric the workload declares a direction for in ``metric_modes`` (e.g.
    ``{"f1": "max"}``)."""

    seed: int = 0
    """Seed of the sampling, the suggestions and PBT's choices; the same seed gives the same trials."""

    asha: AshaConfig = field(default_factory=AshaConfig)
    """Successive halving settings."""

    pbt: PbtConfig = field(default_factory=PbtConfig)
    """Population based training settings."""

    bayesian: BayesianConfig = field(default_factory=BayesianConfig)
    """Bayesian (TPE) settings."""

    def __post_init__(self) -> None:
        self._check_strategy()
        if self.num_trials < 1:
            invalid("num_trials", self.num_trials, "it must be >= 1")
        if self.max_concurrency < 1:
            invalid("max_concurrency", self.max_concurrency, "it must be >= 1")
        if not self.search_space:
            invalid("search_space", self.search_space, "name at least one field to search")
        self._check_search_space()
        self._check_budget()

    def _check_strategy(self) -> None:
        """``algorithm``, ``strategy`` and ``metric``, and that the strategy runs the algorithm and ranks the metric;
        sets ``metric_mode``."""
        if self.algorithm not in ALGORITHMS:
            invalid("algorithm", self.algorithm, f"choose one of {', '.join(ALGORITHMS)}")
        if self.strategy not in STRATEGIES:
            invalid("strategy", self.strategy, f"choose one of {', '.join(STRATEGIES)}")
        if self.strategy == "ray_tune" and self.algorithm == "grid":
            invalid(
                "algorithm",
                self.algorithm,
                "strategy='ray_tune' runs random, bayesian, asha or pbt; use strategy='flyte' for grid",
            )
        # Resolved once, not a field: a workload's own metric asks the user's workload for its direction.
        self.metric_mode = metric_mode(self.metric, self.base.workload)
        if self.metric not in METRIC_DIRECTIONS and self.strategy == "ray_tune":
            invalid(
                "metric",
                self.metric,
                f"strategy='ray_tune' ranks on {', '.join(METRIC_DIRECTIONS)}; use strategy='flyte' to rank on a "
                "workload's own metric",
            )

    def _check_search_space(self) -> None:
        """Each path once, none of ``scaling``, and every value a trial can take a valid config on ``base``."""
        paths = [p.path for p in self.search_space]
        sized = [path for path in paths if path.startswith("scaling.")]
        if sized:
            # flytekit applies a node's task_config override to the shared task object, so every trial node of
            # a round would get the RayJob shape of the last one: the cluster shape is one per search.
            invalid(
                "search_space.path",
                sized[0],
                "the RayJob shape is one per search: set base.scaling instead of searching it",
            )
        if len(set(paths)) != len(paths):
            invalid("search_space", paths, "each path may appear once")
        for spec in self.search_space:
            # Every value a trial can take must make a valid config on this base, so a bad range fails here
            # rather than in the middle of a search.
            values = (
                spec.choices if spec.kind == "choice" else [format_param(spec.low, spec), format_param(spec.high, spec)]
            )
            for value in values:
                trial = apply_params(self.base, {spec.path: value})
                if spec.path.startswith(PARAMS_PREFIX):
                    from training_core.workloads import check_params

                    check_params(trial.workload)  # the user's params_type refuses the value before any trial

    def _check_budget(self) -> None:
        """The algorithm's budget: the grid within ``num_trials``, epochs for ASHA and PBT, PBT's population."""
        size = len(grid_points(self.search_space)) if self.algorithm == "grid" else 0
        if size > self.num_trials:
            invalid(
                "num_trials",
                self.num_trials,
                f"the grid has {size} points: raise num_trials to {size} or use fewer grid_points/choices",
            )
        if self.algorithm == "asha" and self.asha.min_epochs > self.base.loop.epochs:
            invalid("asha.min_epochs", self.asha.min_epochs, f"it must be <= base.loop.epochs={self.base.loop.epochs}")
        if self.algorithm in ("asha", "pbt") and self.base.loop.max_steps:
            invalid(
                "base.loop.max_steps",
                self.base.loop.max_steps,
                f"{self.algorithm} budgets trials in epochs; set it to 0",
            )
        if self.strategy == "ray_tune" and self.algorithm == "pbt" and len(set(self.pbt.perturbation_factors)) != 2:
            invalid(
                "pbt.perturbation_factors",
                self.pbt.perturbation_factors,
                "Ray Tune's PBT takes exactly two factors, e.g. [0.8, 1.25]",
            )
        if self.algorithm == "pbt" and self.num_trials < 2:
            invalid("num_trials", self.num_trials, "pbt needs a population of at least 2")

    @property
    def mode(self) -> str:
        """``max`` or ``min``: which way ``metric`` improves."""
        return self.metric_mode

    @classmethod
    def from_json(cls, text: str) -> "TuningConfig":
        """Build from JSON text of a (possibly partial) config, as :meth:`from_dict`: what ``pyflyte run``'s
        ``--config`` calls with the JSON or YAML it was given, so a partial file overlays the tuning defaults (a
        partial ``base`` too) rather than the dataclass defaults. Flyte's own transport does not call it."""
        import json

        return cls.from_dict(json.loads(text))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "TuningConfig":
        """Build from a (possibly partial) nested mapping, e.g. a YAML file; ``choices`` may be numbers."""
        raw = dict(raw)
        if "search_space" in raw and isinstance(raw["search_space"], Sequence):
            raw["search_space"] = [
                {**spec, "choices": [str(c) for c in spec.get("choices", [])]} if isinstance(spec, Mapping) else spec
                for spec in raw["search_space"]
            ]
        if "base" in raw:
            # A partial base overrides the tuning defaults (small trials), not the pipeline's.
            if not isinstance(raw["base"], Mapping):
                invalid("base", raw["base"], "expected a mapping of TrainingConfig sections")
            raw["base"] = merge(default_base().to_dict(), raw["base"])
        return build_dataclass(cls, raw)


def load_tuning_config(path: str | None = None, *, environ: Mapping[str, str] | None = None) -> TuningConfig:
    """Defaults, overlaid by the YAML file at ``path``, overlaid by ``TUNING__<FIELD>[__<FIELD>]`` variables."""
    return TuningConfig.from_dict(load_layers(path, environ=environ, env_prefix=TUNING_ENV_PREFIX))


def metric_mode(metric: str, workload: WorkloadConfig) -> str:
    """Which way ``metric`` (``val_<name>``) improves: ``METRIC_DIRECTIONS`` for the figures every workload has,
    else what the workload ``workload`` names says (imported and built here, so this fails before any trial):
    ``primary_mode`` for ``val_<primary_metric>``, or its ``metric_modes[name]``."""
    if metric in METRIC_DIRECTIONS:
        return METRIC_DIRECTIONS[metric]
    name = metric.removeprefix("val_")
    if not metric.startswith("val_") or not name.isidentifier():
        invalid("metric", metric, f"name a validation metric as val_<name>, e.g. {', '.join(METRIC_DIRECTIONS)}")
    from training_core.workloads import resolve_workload

    found = resolve_workload(workload)
    declared = getattr(found, "metric_modes", None) or {}
    if name == found.primary_metric:
        return found.primary_mode
    if isinstance(declared, Mapping) and declared.get(name) in ("max", "min"):
        return declared[name]
    invalid(
        "metric",
        metric,
        f"the workload base.workload.name={workload.name!r} does not say which way {name!r} improves: rank on "
        f"val_{found.primary_metric} (its primary_metric) or val_loss, or declare metric_modes = {{{name!r}: 'max'}} "
        "(or 'min') on the workload",
    )


PARAMS_PREFIX = "workload.params."
"""Search-space paths under it name the user's own hyperparameters (``WorkloadConfig.params``)."""


def _field_type(path: str) -> type:
    """The type of the ``TrainingConfig`` leaf at dotted ``path``; ValueError if there is none. A user
    hyperparameter (``workload.params.<name>``) takes any JSON value: its type is the workload's to check."""
    if path.startswith(PARAMS_PREFIX):
        name = path.removeprefix(PARAMS_PREFIX)
        if not name.isidentifier():
            invalid(
                "search_space.path",
                path,
                "name one hyperparameter as workload.params.<name>, e.g. workload.params.kernel_size",
            )
        return Any
    node: Any = TrainingConfig
    parts = path.split(".")
    for i, part in enumerate(parts):
        if _is_typed_mapping(node):  # a mapping field (optimizer.param_groups): the rest of the path is one key
            return get_args(node)[1]
        hints = get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        if part not in hints:
            valid = ", ".join(sorted(hints)) if hints else "(none: the path ends at a value)"
            invalid(
                "search_space.path", path, f"{'.'.join(parts[: i + 1])!r} is not a config field; fields here: {valid}"
            )
        node = hints[part]
    if dataclasses.is_dataclass(node):
        invalid("search_space.path", path, "it names a section; name one of its fields")
    return node


def apply_params(base: TrainingConfig, params: Mapping[str, str]) -> TrainingConfig:
    """``base`` with each dotted-path param set (converted to the field's type and validated)."""
    tree = base.to_dict()
    for path, value in params.items():
        node, leaf = _parent(tree, path)
        node[leaf] = parse_yaml(value, where=f"{path}={value!r}") if path.startswith(PARAMS_PREFIX) else value
    return TrainingConfig.from_dict(tree)


def _parent(tree: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The mapping of ``tree`` (a config as a dict) that holds dotted ``path``'s value, and its key there. Below a
    mapping field (``optimizer.param_groups``) the rest of the path is one key: a name pattern may hold dots."""
    node, kind, parts = tree, TrainingConfig, path.split(".")
    for i, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        kind = get_type_hints(kind).get(part) if dataclasses.is_dataclass(kind) else None
        if _is_typed_mapping(kind):
            return node, ".".join(parts[i + 1 :])
    return node, parts[-1]


def _is_typed_mapping(kind: Any) -> bool:
    """Whether a config field's type is a mapping of name to a typed value (``dict[str, float]``), whose keys a
    search-space path may name; not a free-form JSON mapping (``dict[str, Any]``)."""
    return get_origin(kind) is dict and get_args(kind)[1] is not Any


def format_param(value: Any, spec: ParamSpec) -> str:
    """A value as param text: a choice as its text, ints as ints, floats to 4 significant digits unless that would
    leave the range (a narrow range keeps full precision), so every text lies in ``[low, high]``."""
    if spec.kind == "choice":
        return str(value)
    if spec.kind == "int":
        return str(min(int(spec.high), max(int(spec.low), int(round(value)))))
    short = f"{float(value):.4g}"
    return short if spec.low <= float(short) <= spec.high else repr(min(spec.high, max(spec.low, float(value))))


def sample(space: Sequence[ParamSpec], rng: random.Random) -> Params:
    """One random point of the space."""
    params: Params = {}
    for spec in space:
        if spec.kind == "choice":
            params[spec.path] = rng.choice(spec.choices)
        elif spec.kind == "log_uniform":
            params[spec.path] = format_param(math.exp(rng.uniform(math.log(spec.low), math.log(spec.high))), spec)
        elif spec.kind == "uniform":
            params[spec.path] = format_param(rng.uniform(spec.low, spec.high), spec)
        else:
            params[spec.path] = str(rng.randint(int(spec.low), int(spec.high)))
    return params


def _axis(spec: ParamSpec) -> list[str]:
    if spec.kind == "choice":
        return list(spec.choices)
    n = spec.grid_points
    if spec.kind == "int":
        values = range(int(spec.low), int(spec.high) + 1)
        if len(values) <= n:
            return [str(v) for v in values]
    if n == 1:
        points = [math.sqrt(spec.low * spec.high) if spec.kind == "log_uniform" else (spec.low + spec.high) / 2]
    elif spec.kind == "log_uniform":
        ratio = (spec.high / spec.low) ** (1 / (n - 1))
        points = [spec.low * ratio**i for i in range(n)]
    else:
        points = [spec.low + (spec.high - spec.low) * i / (n - 1) for i in range(n)]
    return list(dict.fromkeys(format_param(p, spec) for p in points))


def grid_points(space: Sequence[ParamSpec]) -> list[Params]:
    """Every point of the grid (the cartesian product of each field's axis), in a stable order."""
    axes = [_axis(spec) for spec in space]
    return [dict(zip((s.path for s in space), combo)) for combo in itertools.product(*axes)]


def initial_params(cfg: TuningConfig) -> list[Params]:
    """The trials a search starts with: all of them for random, grid, asha and pbt; the first round of a
    bayesian search."""
    if cfg.algorithm == "grid":
        return grid_points(cfg.search_space)
    if cfg.algorithm == "bayesian":
        return suggest(cfg, finished=[], count=bayesian_round_sizes(cfg)[0], round_index=0)
    rng = random.Random(cfg.seed)
    return [sample(cfg.search_space, rng) for _ in range(cfg.num_trials)]


def bayesian_round_sizes(cfg: TuningConfig) -> list[int]:
    rounds = min(cfg.bayesian.num_rounds, cfg.num_trials)
    return [cfg.num_trials // rounds + (1 if i < cfg.num_trials % rounds else 0) for i in range(rounds)]


def _distributions(space: Sequence[ParamSpec]) -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for spec in space:
        if spec.kind == "choice":
            out[spec.path] = CategoricalDistribution(list(spec.choices))
        elif spec.kind == "int":
            out[spec.path] = IntDistribution(int(spec.low), int(spec.high))
        else:
            out[spec.path] = FloatDistribution(spec.low, spec.high, log=spec.kind == "log_uniform")
    return out


def suggest(
    cfg: TuningConfig, *, finished: Sequence[tuple[Params, float]], count: int, round_index: int
) -> list[Params]:
    """``count`` new points from Optuna's TPE, told every finished ``(params, metric)`` first: the study is rebuilt
    from ``finished`` on each call (rounds run in different processes share no study storage); the seed and round
    index make the suggestions reproducible."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    distributions = _distributions(cfg.search_space)
    sampler = optuna.samplers.TPESampler(
        seed=cfg.seed * 1000 + round_index,
        n_startup_trials=bayesian_round_sizes(cfg)[0],
        constant_liar=True,
    )
    study = optuna.create_study(direction="maximize" if cfg.mode == "max" else "minimize", sampler=sampler)
    as_value = {"choice": str, "int": int}  # the param texts as Optuna's distributions hold them; else float
    for params, value in finished:
        typed = {spec.path: as_value.get(spec.kind, float)(params[spec.path]) for spec in cfg.search_space}
        study.add_trial(optuna.trial.create_trial(params=typed, distributions=distributions, value=value))
    trials = [study.ask(distributions) for _ in range(count)]
    return [{spec.path: format_param(trial.params[spec.path], spec) for spec in cfg.search_space} for trial in trials]


def ray_tune_scaling(cfg: TuningConfig) -> ScalingConfig:
    """The ``ray_tune`` strategy's RayCluster: room for ``max_concurrency`` trials of ``base.scaling`` each."""
    return dataclasses.replace(cfg.base.scaling, num_workers=cfg.max_concurrency * cfg.base.scaling.num_workers)


def asha_rungs(max_epochs: int, *, min_epochs: int, eta: int) -> list[int]:
    """Epoch budgets of the rungs: ``min_epochs * eta**k`` below ``max_epochs``, then ``max_epochs``."""
    budgets = (min_epochs * eta**k for k in itertools.count())
    return [*itertools.takewhile(lambda budget: budget < max_epochs, budgets), max_epochs]


def num_rounds(cfg: TuningConfig) -> int:
    """How many rounds (Flyte: dynamic-workflow levels) the search takes."""
    if cfg.algorithm == "asha":
        return len(asha_rungs(cfg.base.loop.epochs, min_epochs=cfg.asha.min_epochs, eta=cfg.asha.eta))
    if cfg.algorithm == "pbt":
        return math.ceil(cfg.base.loop.epochs / cfg.pbt.interval_epochs)
    if cfg.algorithm == "bayesian":
        return len(bayesian_round_sizes(cfg))
    return 1


def round_stop_epoch(cfg: TuningConfig, round_index: int) -> int:
    """Epoch the trials of ``round_index`` train to."""
    if cfg.algorithm == "asha":
        return asha_rungs(cfg.base.loop.epochs, min_epochs=cfg.asha.min_epochs, eta=cfg.asha.eta)[round_index]
    if cfg.algorithm == "pbt":
        return min(cfg.base.loop.epochs, (round_index + 1) * cfg.pbt.interval_epochs)
    return cfg.base.loop.epochs


def rank(scores: Sequence[float], mode: str) -> list[int]:
    """Indices from best to worst (ties: lower index first)."""
    sign = -1.0 if mode == "max" else 1.0
    return sorted(range(len(scores)), key=lambda i: (sign * scores[i], i))


def successive_halving_keep(scores: Sequence[float], *, eta: int, mode: str) -> list[int]:
    """Indices of the top ``1/eta`` of ``scores`` (at least one), best first."""
    return rank(scores, mode)[: max(1, len(scores) // eta)]


def pbt_exploit(scores: Sequence[float], *, quantile: float, mode: str, rng: random.Random) -> dict[int, int]:
    """``{bottom trial: top trial it copies}``: each trial of the bottom quantile copies a random one of
    the top quantile (both groups hold ``max(1, floor(quantile * n))`` trials)."""
    order = rank(scores, mode)
    group = max(1, int(quantile * len(scores)))
    top, bottom = order[:group], order[-group:]
    return {loser: rng.choice(top) for loser in bottom if loser not in top}


def perturb(
    params: Params,
    space: Sequence[ParamSpec],
    *,
    factors: Sequence[float],
    resample_probability: float,
    rng: random.Random,
) -> Params:
    """PBT's explore step: numeric params are resampled (with ``resample_probability``) or multiplied by
    a random factor and clipped to their range (an ``int`` that the factor would round back to itself moves by one
    its way); ``choice`` params are kept, since the copied optimizer state and data position belong to them."""
    out = dict(params)
    for spec in space:
        if not spec.numeric:
            continue
        if rng.random() < resample_probability:
            out[spec.path] = sample([spec], rng)[spec.path]
            continue
        old, factor = float(params[spec.path]), rng.choice(list(factors))
        new = format_param(min(spec.high, max(spec.low, old * factor)), spec)
        if spec.kind == "int" and float(new) == old:  # 2 x 1.25 rounds to 2: small ints would never move
            new = format_param(old + (1 if factor > 1 else -1), spec)
        out[spec.path] = new
    return out


@dataclass
class ScoredTrial:
    """A trial as the decisions between rounds see it."""

    trial_id: int
    params: Params
    score: float
    """The search metric after the trial's latest slice."""


@dataclass
class PbtCopy:
    """PBT's exploit and explore for one trial of the bottom quantile."""

    trial_id: int
    """The trial that drops its own checkpoint and hyperparameters."""
    source_trial_id: int
    """The top trial whose checkpoint it continues from."""
    params: Params
    """The source's params, perturbed: the copy's params from now on."""


@dataclass
class RoundDecision:
    """What a search does after a round. Trials of the round named nowhere here are done."""

    continuing: list[int] = field(default_factory=list)
    """Trials of the round that train in the next one (ASHA's survivors, every PBT trial), in the round's order."""
    stopped: list[int] = field(default_factory=list)
    """Trials of the round that successive halving prunes."""
    copies: list[PbtCopy] = field(default_factory=list)
    """PBT: bottom trials that continue from a top trial's checkpoint with perturbed params."""
    new_params: list[Params] = field(default_factory=list)
    """Bayesian: the points of the next round's new trials."""


def decide_round(
    cfg: TuningConfig, *, round_index: int, trained: Sequence[ScoredTrial], finished: Sequence[ScoredTrial]
) -> RoundDecision:
    """The decision after round ``round_index``: ``trained`` are the trials it trained, ``finished`` every
    trial of the search scored so far (TPE learns from all of them). After the last round nobody continues.

    PBT's choices are seeded by ``cfg.seed`` and the round, so a re-run of a search makes the same copies.
    """
    next_round = round_index + 1
    if next_round >= num_rounds(cfg):
        return RoundDecision()
    if cfg.algorithm == "asha":  # the top ``1/eta`` of the rung's trials train on to the next rung, the rest stop
        keep = set(successive_halving_keep([t.score for t in trained], eta=cfg.asha.eta, mode=cfg.mode))
        return RoundDecision(
            continuing=[t.trial_id for i, t in enumerate(trained) if i in keep],
            stopped=[t.trial_id for i, t in enumerate(trained) if i not in keep],
        )
    if cfg.algorithm == "pbt":
        return pbt_decision(cfg, trained, rng=random.Random(cfg.seed * 7919 + round_index))
    if cfg.algorithm == "bayesian":  # the next round's new trials, suggested by TPE from every finished one
        finished_points = [(t.params, t.score) for t in finished]
        count = bayesian_round_sizes(cfg)[next_round]
        return RoundDecision(new_params=suggest(cfg, finished=finished_points, count=count, round_index=next_round))
    return RoundDecision()


def pbt_decision(cfg: TuningConfig, trained: Sequence[ScoredTrial], *, rng: random.Random) -> RoundDecision:
    """PBT: every trial trains on; each of the bottom quantile first copies a random top trial (exploit) and
    perturbs that trial's params (explore)."""
    sources = pbt_exploit([t.score for t in trained], quantile=cfg.pbt.quantile, mode=cfg.mode, rng=rng)
    copies = [
        PbtCopy(
            trial_id=trained[loser].trial_id,
            source_trial_id=trained[winner].trial_id,
            params=perturb(
                trained[winner].params,
                cfg.search_space,
                factors=cfg.pbt.perturbation_factors,
                resample_probability=cfg.pbt.resample_probability,
                rng=rng,
            ),
        )
        for loser, winner in sources.items()
    ]
    return RoundDecision(continuing=[t.trial_id for t in trained], copies=copies)
