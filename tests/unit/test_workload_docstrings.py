"""The ``workload.*`` docstrings (what FlyteConsole's launch form and the configuration page show) agree with the
code: each callable's signature a docstring states (``(config, manifest)``, ``(data_config)``, "called with no
arguments") and its ``params=`` is checked by calling the real paths (``resolve_workload``, ``prepare_data``,
``check``, ``build_model`` of both built-ins) with recording callables and comparing what they were given."""

from __future__ import annotations

import ast
import contextlib
import re
import sys
import textwrap

import pytest

from tests.conftest import REPO_ROOT
from training_core.config import DataConfig, TrainingConfig
from training_core.data import Manifest
from training_core.workloads import resolve_workload

ARGUMENT_TYPES = {"config": TrainingConfig, "data_config": DataConfig, "manifest": Manifest}
"""What a parameter named in a docstring's signature is, by its name there."""

RECORDER = """
import numpy as np
from torch import nn
from examples.tabular_mlp.workload import TabularMLP

CALLS = []

def record(field, args, kwargs):
    CALLS.append((field, tuple(type(a) for a in args), tuple(sorted(kwargs))))

def workload(*args, **kwargs):
    record("name", args, kwargs)
    return TabularMLP()

def workload_with_params(*args, params=None, **kwargs):
    record("name", args, {**kwargs, "params": params})
    return TabularMLP()

def model_factory(*args, params=None, **kwargs):
    record("model_factory", args, {**kwargs, "params": params} if params is not None else kwargs)
    return nn.Linear(2, 2)

def image_source(*args, params=None, **kwargs):
    from training_core.data.sources import RawDataset
    record("dataset_source", args, {**kwargs, "params": params} if params is not None else kwargs)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 1, 4, 4), dtype=np.uint8)
    return RawDataset(splits={"train": (images, np.arange(40, dtype=np.int64) % 2)}, classes=["a", "b"])

def array_source(*args, params=None, **kwargs):
    record("dataset_source", args, {**kwargs, "params": params} if params is not None else kwargs)
    return {"inputs": np.random.default_rng(0).random((40, 2)), "targets": np.arange(40) % 2}

def text_source(*args, params=None, **kwargs):
    record("dataset_source", args, {**kwargs, "params": params} if params is not None else kwargs)
    return {f"doc{i}": "some words of text " * 20 for i in range(20)}
"""


def field_docstrings(class_name: str) -> dict[str, str]:
    """Each field of the dataclass ``class_name`` in training_core/config/sections.py: its docstring, read from the
    source."""
    tree = ast.parse((REPO_ROOT / "training_core" / "config" / "sections.py").read_text())
    (found,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    docs = {}
    for field, doc in zip(found.body, found.body[1:]):
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


def stated_arguments(doc: str) -> tuple[type, ...]:
    """The argument types of the callable a docstring describes: "called with no arguments" or ``(a, b)``."""
    if "called with no arguments" in doc:
        return ()
    match = re.search(r"callable ``\(([a-z_, ]+)\)", doc)
    assert match, f"no signature stated in {doc!r}"
    return tuple(ARGUMENT_TYPES[name.strip()] for name in match.group(1).split(","))


BUILT_INS = ("image_classification", "causal_lm", "array_classification", "array_regression")


def stated_params(docs: dict[str, str], field: str, built_in: str = "") -> bool:
    """Whether the docstrings say ``field``'s callable (of ``built_in``) is given ``params=`` when it has that
    parameter: a sentence of its own docstring that mentions ``params=`` (and names ``built_in`` when it names a
    built-in), or a sentence of ``params``' that does and names ``field`` (preceded by ``built_in`` when preceded
    by a built-in's name)."""
    own = [s for s in docs[field].split(". ") if "params=" in s]
    if any(built_in in s or not any(b in s for b in BUILT_INS) for s in own):
        return True
    for sentence in (s for s in docs["params"].split(". ") if "params=" in s and f"``{field}``" in s):
        restricted = [b for b in BUILT_INS if f"``{b}`` ``{field}``" in sentence]
        if not restricted or built_in in restricted:
            return True
    return False


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    name = f"docstring_recorder_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(RECORDER))
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)
    yield name, sys.modules[name].CALLS
    sys.modules.pop(name, None)


def _config(**workload) -> TrainingConfig:
    text = workload["name"] == "causal_lm"
    return TrainingConfig.from_dict(
        {
            "workload": workload,
            "model": {"name": "gpt2-tiny" if text else "small_cnn"},
            "data": {"dataset": "stdlib" if text else "digits"},
        }
    )


def test_every_workload_callable_field_states_a_signature():
    docs = field_docstrings("WorkloadConfig")
    assert {name: stated_arguments(docs[name]) for name in ("name", "model_factory", "dataset_source")} == {
        "name": (),
        "model_factory": (TrainingConfig, Manifest),
        "dataset_source": (DataConfig,),
    }


def test_workload_name_is_called_as_its_docstring_says(recorder):
    module, calls = recorder
    docs = field_docstrings("WorkloadConfig")
    resolve_workload(_config(name=f"{module}:workload", params={"width": 3}).workload)
    resolve_workload(_config(name=f"{module}:workload_with_params", params={"width": 3}).workload)
    stated = stated_arguments(docs["name"])
    assert calls == [("name", stated, ()), ("name", stated, ("params",) if stated_params(docs, "name") else ())]


@pytest.mark.parametrize("built_in", ["image_classification", "causal_lm", "array_classification"])
def test_a_dataset_source_and_a_model_factory_are_called_as_their_docstrings_say(recorder, tmp_path, built_in):
    module, calls = recorder
    docs = field_docstrings("WorkloadConfig")
    source = {"image_classification": "image_source", "array_classification": "array_source"}.get(
        built_in, "text_source"
    )
    params = {"width": 3}
    # An array workload trains a model factory's model on a dataset source's arrays: its config names both.
    both = built_in == "array_classification"
    given = {"dataset_source": f"{module}:{source}", "model_factory": f"{module}:model_factory"}
    prep_fields = given if both else {"dataset_source": given["dataset_source"]}
    prep = resolve_workload(_config(name=built_in, **prep_fields, params=params).workload)
    data = DataConfig(num_shards=1, val_fraction=0.2, test_fraction=0.2, seq_len=16)
    manifest = prep.prepare_data(data, str(tmp_path))
    config = _config(name=built_in, **(given if both else {"model_factory": given["model_factory"]}), params=params)
    workload = resolve_workload(config.workload)
    with contextlib.suppress(ValueError):  # a Linear(2, 2) fits neither built-in's data: check() may say so
        workload.check(config, manifest)
    workload.build_model(config, manifest)

    def given_params(field: str) -> tuple[str, ...]:
        return ("params",) if stated_params(docs, field, built_in) else ()

    source_calls = [c for c in calls if c[0] == "dataset_source"]
    assert source_calls == [
        ("dataset_source", stated_arguments(docs["dataset_source"]), given_params("dataset_source"))
    ]
    factory_calls = [c for c in calls if c[0] == "model_factory"]
    stated = stated_arguments(docs["model_factory"])
    assert factory_calls and all(args == stated for _, args, _ in factory_calls), factory_calls
    # The model that trains is built with params= (check() may probe the factory without them, on the meta device).
    assert factory_calls[-1] == ("model_factory", stated, given_params("model_factory"))
