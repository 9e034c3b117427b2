"""Hostile config input: every defect of issue 16's "Config input" fails as a ``ValueError`` that names the field
(or the file or environment variable), the value quoted bounded in size, and the fix."""

import dataclasses
import functools
import math
import os
import re
import types
import typing

import hypothesis
import pytest

from training_core.config import TrainingConfig, load_config, read_yaml_mapping, sections
from training_core.config.loading import MAX_CONFIG_BYTES
from training_core.tuning import load_tuning_config

MAX_MESSAGE_CHARS = 4096


def _error(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as excinfo:
        call(*args, **kwargs)
    message = str(excinfo.value)
    assert len(message) < MAX_MESSAGE_CHARS, message[:500]
    return message


def test_a_value_of_a_billion_items_is_quoted_in_a_few_hundred_characters():
    # Ten levels of nine shared references: 9**10 strings, a repr() of some 24 GB.
    bomb = ["lol"] * 9
    for _ in range(9):
        bomb = [bomb] * 9
    message = _error(TrainingConfig.from_dict, {"model": {"name": bomb}})
    assert message.startswith("model.name=[[[[...], [...], ")
    assert message.endswith("is invalid: expected a string")
    assert len(message) < 300


def test_a_huge_string_or_integer_is_quoted_by_its_ends_or_its_size():
    message = _error(TrainingConfig.from_dict, {"model": {"name": "resnet" + "x" * 1_000_000}})
    assert message.startswith("model.name='resnetxxx") and "..." in message and "choose one of small_cnn" in message
    message = _error(TrainingConfig.from_dict, {"tracking": {"experiment_name": 10**5000}})
    assert message == "tracking.experiment_name=<int of about 5001 digits> is invalid: expected a string"


@pytest.mark.parametrize(
    ("raw", "where", "key"),
    [
        ({1: 2}, "config", "1 (int)"),
        ({"loop": {5: 1}}, "loop", "5 (int)"),
        ({"loop": {None: 1, "epochs": 2}}, "loop", "None (NoneType)"),
        ({"scaling": {(1, 2): 1}}, "scaling", "(1, 2) (tuple)"),
    ],
)
def test_a_key_that_is_not_a_string_is_named_with_its_section_and_the_valid_fields(raw, where, key):
    message = _error(TrainingConfig.from_dict, raw)
    assert message.startswith(f"{where} has unknown field(s) {key}: field names are strings; valid fields are ")


def test_many_unknown_fields_are_listed_up_to_ten_each_clipped():
    raw = {"loop": {f"field_{i:03d}_" + "y" * 1000: 1 for i in range(500)}}
    message = _error(TrainingConfig.from_dict, raw)
    assert message.startswith("loop has unknown field(s) field_000_yyy")
    assert "and 490 more: valid fields are batch_size, epochs," in message


def _alias_bomb() -> str:
    """The "billion laughs": ten levels of nine aliases to the level below, 9**10 strings once expanded."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return "\n".join(lines) + "\nmodel:\n  name: *a9\n"


def test_a_yaml_alias_bomb_is_refused_at_its_first_anchor_naming_the_file_and_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    assert path.stat().st_size < 600
    message = _error(load_config, path, environ={})
    assert message == (
        f"config file {str(path)!r} is invalid: line 1, column 5: found &a0: anchors and aliases are not supported in "
        "config input; write each value out in full"
    )
    anchored = tmp_path / "anchor.yaml"
    anchored.write_text("loop: &defaults {epochs: 3}\n")
    assert "line 1, column 7: found &defaults: anchors and aliases" in _error(load_config, anchored, environ={})


def test_a_duplicate_key_is_refused_naming_the_key_both_lines_and_the_file(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("loop:\n  epochs: 3\nmodel:\n  name: small_cnn\nloop:\n  seed: 7\n")
    message = _error(read_yaml_mapping, path, setting="--config")
    assert message == (
        f"--config {str(path)!r} is invalid: line 5, column 1: duplicate key 'loop' (first at line 1): YAML would "
        "keep only the last one; write each key once, merging the two"
    )
    nested = tmp_path / "nested.yaml"
    nested.write_text("loop:\n  epochs: 3\n  epochs: 4\n")
    assert "line 3, column 3: duplicate key 'epochs' (first at line 2)" in _error(load_config, nested, environ={})


def test_a_config_file_that_is_a_fifo_a_device_a_directory_or_too_large_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)  # no writer: a plain open() would wait here forever
    message = _error(load_config, fifo, environ={})
    assert message.startswith(f"config file {str(fifo)!r} is invalid: ") and "is a FIFO, not a regular file" in message
    assert message.endswith("give a readable YAML file")
    assert "is a character device" in _error(read_yaml_mapping, "/dev/zero", setting="--config")
    assert "is a directory" in _error(read_yaml_mapping, tmp_path)
    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    assert "holds more than 16 MiB" in _error(load_config, huge, environ={})
    dangling = tmp_path / "dangling.yaml"
    dangling.symlink_to(tmp_path / "gone.yaml")
    assert "does not exist (a dangling symlink" in _error(load_config, dangling, environ={})
    assert _error(load_config, tmp_path / "missing.yaml", environ={}).endswith("is invalid: no file there")


def test_yaml_numbers_and_booleans_follow_yaml_1_2(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "loop: {epochs: 010, seed: 0x10, max_steps: 1e3}\n"
        "tracking: {experiment_name: no, champion_alias: 2024-01-01}\n"
        "scaling: {use_gpu: false}\n"
        "checkpoint: {at_epoch_end: TRUE}\n"
    )
    cfg = load_config(path, environ={})
    assert (cfg.loop.epochs, cfg.loop.seed, cfg.loop.max_steps) == (10, 16, 1000)
    assert (cfg.tracking.experiment_name, cfg.tracking.champion_alias) == ("no", "2024-01-01")
    assert cfg.scaling.use_gpu is False and cfg.checkpoint.at_epoch_end is True

    path.write_text("loop:\n  epochs: 1:30\n")
    assert _error(load_config, path, environ={}) == "loop.epochs='1:30' is invalid: expected a number (int)"
    path.write_text("scaling:\n  use_gpu: on\n")
    assert _error(load_config, path, environ={}) == "scaling.use_gpu='on' is invalid: expected true or false"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("loop: !!timestamp 2024-01-01\n", "line 1, column 7: the tag '!!timestamp' is not supported"),
        ("loop: !!python/object:os.system {}\n", "the tag '!!python/object:os.system' is not supported"),
        ("loop: !!bool yes\n", "line 1, column 7: 'yes' is not a boolean: write true or false"),
        ("? [loop]\n: 1\n", "line 1, column 3: a list cannot be a key: field names are strings"),
        ("loop: " + "[" * 40 + "]" * 40 + "\n", "values nest deeper than 32 levels"),
        ("loop: " + "9" * 5000 + "\n", "line 1, column 7: an integer of 5000 digits is out of range"),
        ("loop: [1\n", "while parsing a flow sequence: expected ',' or ']'"),
        ("loop: \x00\n", "character U+0000 at position 6 is not allowed in YAML; remove it"),
    ],
)
def test_other_yaml_the_config_loader_refuses_names_the_file_and_the_problem(tmp_path, text, problem):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    message = _error(load_config, path, environ={})
    assert message.startswith(f"config file {str(path)!r} is invalid: ") and problem in message


def test_a_section_variable_beside_a_field_variable_is_refused_naming_both():
    env = {"TRAINING_CORE__LOOP": "5", "TRAINING_CORE__LOOP__EPOCHS": "3"}
    assert _error(load_config, environ=env) == (
        "TRAINING_CORE__LOOP='5' is invalid: it sets loop whole while TRAINING_CORE__LOOP__EPOCHS sets a field in "
        "it; unset TRAINING_CORE__LOOP and set each field as TRAINING_CORE__LOOP__<FIELD>"
    )
    twice = {"TRAINING_CORE__LOOP__EPOCHS": "3", "TRAINING_CORE__loop__epochs": "4"}
    assert _error(load_config, environ=twice) == (
        "TRAINING_CORE__loop__epochs='4' is invalid: TRAINING_CORE__LOOP__EPOCHS sets the same field loop.epochs; "
        "unset one of them"
    )
    # A whole section as one YAML mapping still works, as does each field on its own.
    assert load_config(environ={"TRAINING_CORE__LOOP": "{epochs: 3, seed: 7}"}).loop.seed == 7


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("TRAINING_CORE__LOOP", "{epochs: 3", "line 1, column 11: while parsing a flow mapping: expected ',' or '}'"),
        ("TRAINING_CORE__DATA__PATH", "a: b: c", "line 1, column 5: mapping values are not allowed here"),
        ("TRAINING_CORE__LOOP__EPOCHS", "&n 3", "line 1, column 1: found &n: anchors and aliases are not supported"),
        ("TRAINING_CORE__LOOP", "{epochs: 3, epochs: 4}", "line 1, column 13: duplicate key 'epochs'"),
    ],
)
def test_malformed_yaml_in_an_environment_variable_names_the_variable_and_its_value(name, value, problem):
    message = _error(load_config, environ={name: value})
    assert message.startswith(f"{name}={value!r} is invalid: ") and problem in message


def test_the_tuning_config_reads_its_variables_through_the_same_checks():
    env = {"TUNING__ASHA": "{eta: 3}", "TUNING__ASHA__ETA": "4"}
    assert _error(load_tuning_config, environ=env).startswith(
        "TUNING__ASHA='{eta: 3}' is invalid: it sets asha whole while TUNING__ASHA__ETA sets a field in it"
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"optimizer": {"lr": math.inf}},
            "optimizer.lr=inf is invalid: expected a finite number (float), not inf or nan",
        ),
        ({"optimizer": {"weight_decay": "nan"}}, "optimizer.weight_decay='nan' is invalid: expected a finite number"),
        ({"optimizer": {"max_grad_norm": 10**400}}, "optimizer.max_grad_norm=<int of about 401 digits> is invalid"),
        ({"scaling": {"cpus_per_worker": "inf"}}, "scaling.cpus_per_worker='inf' is invalid: expected a finite number"),
        (
            {"scaling": {"cpus_per_worker": 1e-4}},
            "scaling.cpus_per_worker=0.0001 is invalid: it must be in [0.001, 1024]: a millicore (0.001) is the least",
        ),
        ({"scaling": {"head_cpus": 4096}}, "scaling.head_cpus=4096.0 is invalid: it must be in [0.001, 1024]"),
        (
            {"scaling": {"memory_per_worker_gib": 1e-9}},
            "scaling.memory_per_worker_gib=1e-09 is invalid: it must be in [0.25, 32768] GiB: a pod's memory is "
            "written in whole MiB, and a Ray node needs at least 256 MiB",
        ),
        ({"scaling": {"head_memory_gib": 0.1}}, "scaling.head_memory_gib=0.1 is invalid: it must be in [0.25, 32768]"),
        (
            {"scaling": {"shm_per_worker_gib": 8, "memory_per_worker_gib": 4}},
            "scaling.shm_per_worker_gib=8.0 is invalid: it must be 0 (30% of the pod's memory) or in [0.0625, "
            "scaling.memory_per_worker_gib=4]",
        ),
        (
            {"scaling": {"gpu_node_selector": {"gpu type": "h100"}}},
            "scaling.gpu_node_selector='gpu type' is invalid: use a Kubernetes label key",
        ),
        (
            {"scaling": {"gpu_node_selector": {"gpu": "h100 80gb"}}},
            "scaling.gpu_node_selector[gpu]='h100 80gb' is invalid: use a Kubernetes label value",
        ),
        (
            {"scaling": {"gpu_tolerations": [{"key": "spot", "value": "true"}]}},
            "scaling.gpu_tolerations[].value='true' is invalid: operator Exists takes no value; use Equal",
        ),
        (
            {"scaling": {"gpu_tolerations": [{"effect": "NoRun"}]}},
            "scaling.gpu_tolerations[].effect='NoRun' is invalid: choose NoSchedule, PreferNoSchedule, NoExecute, or "
            "''",
        ),
        ({"loop": {"epochs": math.inf}}, "loop.epochs=inf is invalid: expected a finite whole number (int)"),
        (
            {"loop": {"epochs": 10**400}},
            "loop.epochs=<int of about 401 digits> is invalid: expected a whole number in [-2**63, 2**63 - 1] (int64)",
        ),
        ({"loop": {"epochs": 2_000_000}}, "loop.epochs=2000000 is invalid: it must be in [1, 1_000_000]"),
        ({"loop": {"seed": -1}}, "loop.seed=-1 is invalid: use a seed in [0, 4294967295] (2**32 - 1)"),
        ({"loop": {"seed": 2**33}}, "loop.seed=8589934592 is invalid: use a seed in [0, 4294967295]"),
        ({"loop": {"seed": 2**64}}, "loop.seed=18446744073709551616 is invalid: expected a whole number in [-2**63"),
        ({"data": {"split_seed": -5}}, "data.split_seed=-5 is invalid: use a seed in [0, 4294967295]"),
        ({"loop": {"max_steps": 2**63}}, "loop.max_steps=9223372036854775808 is invalid: expected a whole number in"),
        ({"loop": {"batch_size": [1]}}, "loop.batch_size=[1] is invalid: expected a number (int)"),
    ],
)
def test_numbers_must_be_finite_and_in_range_naming_field_value_and_fix(raw, message):
    assert _error(TrainingConfig.from_dict, raw).startswith(message)


def test_inf_written_in_a_yaml_file_is_refused_and_the_smallest_sizes_still_load(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  lr: .inf\n")
    assert _error(load_config, path, environ={}).startswith("optimizer.lr=inf is invalid: expected a finite number")
    path.write_text("scaling: {cpus_per_worker: 0.001, memory_per_worker_gib: 0.25, head_cpus: 1024}\n")
    env = {"TRAINING_CORE__LOOP__EPOCHS": "1000000", "TRAINING_CORE__LOOP__SEED": "4294967295"}
    cfg = load_config(path, environ=env)
    assert (cfg.scaling.cpus_per_worker, cfg.scaling.memory_per_worker_gib, cfg.scaling.head_cpus) == (
        0.001,
        0.25,
        1024,
    )
    assert (cfg.loop.epochs, cfg.loop.seed) == (1_000_000, 2**32 - 1)


def _leaf_fields(cls=TrainingConfig, prefix=()):
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _leaf_fields(hint, (*prefix, f.name))
        else:
            yield (*prefix, f.name), hint


HOSTILE = [
    math.inf,
    -math.inf,
    math.nan,
    10**400,
    -(10**400),
    2**64,
    -1,
    0,
    1e-300,
    "1:30",
    "010",
    "",
    "x" * 100_000,
    None,
    True,
    [],
    {},
    {1: 2},
    [[[["deep"]]]],
    b"bytes",
]


@pytest.mark.parametrize(("path", "hint"), list(_leaf_fields()), ids=[".".join(path) for path, _ in _leaf_fields()])
def test_every_field_takes_a_hostile_value_or_refuses_it_by_name(path, hint):
    dotted = ".".join(path)
    for value in HOSTILE:
        raw: dict = {}
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        try:
            cfg = TrainingConfig.from_dict(raw)
        except ValueError as exc:
            assert str(exc).startswith(dotted) or "data.num_shards" in str(exc), str(exc)[:300]
            assert len(str(exc)) < MAX_MESSAGE_CHARS
            continue
        kept = functools.reduce(getattr, path, cfg)
        if isinstance(hint, types.UnionType):  # a field of several types (model.new_head: bool | str) holds one
            assert type(kept) in typing.get_args(hint), (dotted, value)
        else:
            assert type(kept) is (typing.get_origin(hint) or hint), (dotted, value)
        if hint is float:
            assert math.isfinite(kept), (dotted, value)
        if hint is int:
            assert -(2**63) <= kept < 2**63, (dotted, value)


def _mutated_configs(st):
    """Valid config dicts with a few random edits: a field, a section or a top-level key set to a random value of
    mixed type (numbers of any size, inf and nan, text, None, nested lists and mappings with non-string keys), or
    a field dropped."""
    keys = st.one_of(
        st.sampled_from([f.name for f in dataclasses.fields(TrainingConfig)] + ["epochs", "lr", "seed", "name"]),
        st.text(max_size=12),
        st.integers(),
        st.none(),
        st.booleans(),
    )
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-3, max_value=100),
        st.floats(min_value=0, max_value=1),
        st.integers(),
        st.integers(min_value=-(10**500), max_value=10**500),
        st.floats(),
        st.text(max_size=30),
        st.sampled_from(["inf", "nan", "1:30", "010", "1e400", "yes", "on", "digits", "small_cnn", "adamw", "fp16"]),
    )
    values = st.recursive(
        scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4), max_leaves=12
    )

    @st.composite
    def mutated(draw):
        raw = TrainingConfig().to_dict()
        fields = {section: sorted(raw[section]) for section in raw}
        for _ in range(draw(st.integers(min_value=1, max_value=3))):
            edit = draw(st.sampled_from(["field"] * 6 + ["unknown field", "section", "top-level key", "drop"]))
            section = draw(st.sampled_from(sorted(fields)))
            if edit == "top-level key":
                raw[draw(keys)] = draw(values)
            elif edit == "section" or not isinstance(raw[section], dict):
                raw[section] = draw(values)
            elif edit == "drop":
                raw[section].pop(draw(st.sampled_from(fields[section])), None)
            elif edit == "unknown field":
                raw[section][draw(keys)] = draw(values)
            else:
                raw[section][draw(st.sampled_from(fields[section]))] = draw(values)
        return raw

    return mutated()


def test_a_mutated_config_loads_or_raises_a_short_value_error_from_a_dict_and_from_yaml():
    import yaml

    from training_core.config import parse_yaml

    cases = []

    @hypothesis.settings(max_examples=400, deadline=None, database=None, derandomize=True)
    @hypothesis.given(_mutated_configs(hypothesis.strategies))
    def check(raw):
        cases.append(raw)
        for load in (lambda: raw, lambda: parse_yaml(yaml.safe_dump(raw), where="document")):
            try:
                TrainingConfig.from_dict(load())
            except ValueError as exc:
                assert len(str(exc)) < MAX_MESSAGE_CHARS, str(exc)[:500]

    check()
    print(f"hypothesis: {len(cases)} mutated configs, each from a dict and from YAML")


@pytest.mark.parametrize(
    ("build", "field_path"),
    [
        (lambda: sections.OptimizerConfig(param_groups="head.*"), "optimizer.param_groups"),
        (lambda: sections.OptimizerConfig(param_groups={"head.*": True}), "optimizer.param_groups['head.*']"),
        (lambda: sections.OptimizerConfig(param_groups={"head.*": "fast"}), "optimizer.param_groups['head.*']"),
        (lambda: sections.ModelConfig(freeze="bert.*"), "model.freeze"),
        (lambda: sections.ModelConfig(freeze=[3]), "model.freeze"),
        (lambda: sections.WorkloadConfig(params=["width", 64]), "workload.params"),
    ],
    ids=["groups-not-a-mapping", "rate-a-bool", "rate-a-string", "freeze-a-string", "pattern-a-number", "params-list"],
)
def test_a_section_built_in_python_with_a_value_of_the_wrong_type_names_the_field(build, field_path):
    # Built in Python (a notebook, a FlyteRemote launch script), a section never went through the schema layer:
    # its own check names the field instead of an AttributeError or TypeError from deep inside.
    with pytest.raises(ValueError, match=re.escape(f"{field_path}=")):
        build()
