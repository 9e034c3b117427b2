"""Prep is keyed on what it reads, through ``pyflyte run`` subprocesses sharing one local Flyte cache: a user's
``.npz`` regenerated at the same path, then the user's ``prepare_data`` code edited, each prepare again, and the
model trains on the new samples; an unchanged run takes the prepared data from the cache, and every run says
which prepared data it used."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import REPO_ROOT, VENV_BIN
from tests.helpers.mlflow_db import seed_mlflow_db
from tests.helpers.pyflyte import pyflyte_run

WORKLOAD = "fp_user_data.workload:NpzMLP"
USER_CODE = '''"""A user's workload: the example's MLP on the features and labels of an .npz at data.path."""
import numpy as np

from examples.tabular_mlp.workload import TabularMLP
from training_core.data import ArraySpec, Manifest, split_samples, write_prepared

EVERY_NTH_SAMPLE = {every}


class NpzMLP(TabularMLP):
    def prepare_data(self, data, out_dir):
        with np.load(data.path) as stored:
            raw = {{"features": stored["features"][::EVERY_NTH_SAMPLE], "labels": stored["labels"][::EVERY_NTH_SAMPLE]}}
        splits = split_samples({{"train": raw}}, data, source="data.path")
        train = splits["train"]["features"].astype(np.float64)
        template = Manifest(
            dataset="npz", classes=["a", "b"], input_shape=[raw["features"].shape[1]], mean=train.mean(0).tolist(),
            std=np.maximum(train.std(0), 1e-6).tolist(), splits={{}}, workload=self.name,
            arrays={{"features": ArraySpec("float32", [raw["features"].shape[1]]),
                    "labels": ArraySpec("int64", [], max_value=1)}},
        )
        return write_prepared(out_dir, splits, template=template, num_shards=data.num_shards)
'''
DATA = {"path": "", "val_fraction": 0.1, "test_fraction": 0.2, "num_shards": 2}
PREPARED = re.compile(
    r"^prepared data    : train (\d+), test \d+, val \d+ samples \(tabular_mlp\) at (\S+); inputs fingerprint "
    r"([0-9a-f]{16}), created (\S+), (prepared by this run|from Flyte's cache \(prepared by an earlier run\))$",
    re.MULTILINE,
)
PREP_BODY_RAN = re.compile(r"INFO training_core\.data\.prepared: prepared npz")


def _write_samples(path: Path, count: int) -> None:
    """``count`` samples of 4 float32 features whose label is the sign of their sum."""
    features = np.random.default_rng(count).normal(size=(count, 4)).astype(np.float32)
    np.savez(path, features=features, labels=(features.sum(axis=1) > 0).astype(np.int64))


def _write_code(package: Path, every: int) -> None:
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "workload.py").write_text(USER_CODE.format(every=every))


def _prepared(output: str) -> tuple[int, str, str, str, bool]:
    """The run's ``prepared data`` line: training samples, directory, fingerprint, created, cache hit."""
    (found,) = PREPARED.findall(output)
    train, directory, fingerprint, created, reuse = found
    return int(train), directory, fingerprint, created, reuse.startswith("from Flyte's cache")


@pytest.fixture(scope="module")
def user_project(ray_address, tmp_path_factory):
    """A user's package and ``.npz`` outside the repository, a config naming them, and one HOME (one local Flyte
    cache) for every run."""
    workdir = tmp_path_factory.mktemp("prep-fingerprint")
    for name in ("home", "tmp", "code"):
        (workdir / name).mkdir()
    _write_code(workdir / "code" / "fp_user_data", every=1)
    # The Ray workers get the folders the named user modules came from on their sys.path: the example package the
    # user's module builds on is beside it there.
    (workdir / "code" / "examples").symlink_to(REPO_ROOT / "examples")
    data = dict(DATA, path=str(workdir / "samples.npz"))
    config = {
        "workload": {"name": WORKLOAD},
        "data": data,
        "model": {"name": "mlp", "hidden_size": 8, "num_layers": 1},
        "loop": {"epochs": 1, "batch_size": 16, "log_interval_steps": 1},
        "scaling": {"num_workers": 1, "cpus_per_worker": 1, "memory_per_worker_gib": 1},
        "tracking": {"tracking_uri": seed_mlflow_db(workdir / "mlflow.db"), "experiment_name": "fingerprint"},
    }
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    env = dict(
        os.environ,
        HOME=str(workdir / "home"),
        TMPDIR=str(workdir / "tmp"),
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",  # the edited module is read from its source, whatever its size and mtime
        RAY_ADDRESS=ray_address,
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(workdir / "code")]),
    )
    return workdir, data, env


def _prep_only(workdir: Path, data: dict, env: dict) -> str:
    """``pyflyte run`` of the ``prepare`` node alone, with the data and workload the pipeline's config gives it."""
    result = subprocess.run(
        [
            str(VENV_BIN / "pyflyte"),
            "run",
            str(REPO_ROOT / "tasks" / "data.py"),
            "prepare",
            "--config",
            json.dumps(data),
            "--workload",
            json.dumps({"name": WORKLOAD}),
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    return output


def _report_rows(output: str) -> dict[str, str]:
    report = Path(re.search(r"^training report\s*: (\S+)", output, re.MULTILINE).group(1)).read_text()
    return {
        html.unescape(k): html.unescape(v)
        for k, v in re.findall(r"<tr><th class='key'>([^<]*)</th><td>([^<]*)</td></tr>", report)
    }


@pytest.mark.slow
def test_replaced_data_and_edited_prep_code_prepare_again_and_train_on_the_new_samples_an_unchanged_run_hits(
    user_project,
):
    from training_core.data import Manifest

    workdir, data, env = user_project
    samples = workdir / "samples.npz"

    _write_samples(samples, 200)
    first = _prep_only(workdir, data, env)
    train_1, directory_1, fingerprint_1, _, hit_1 = _prepared(first)
    assert (train_1, hit_1) == (140, False) and PREP_BODY_RAN.search(first)
    assert Manifest.load(directory_1).split_counts()["train"] == 140

    # The user regenerates the file at the same path and runs the whole pipeline: prep runs again (the old data
    # would be 140 training samples, 8 steps of 16), the model trains on the new samples and is registered.
    _write_samples(samples, 120)
    result = pyflyte_run("--config", str(workdir / "config.yaml"), cwd=workdir, env=env, timeout_s=600)
    second = result.stdout + result.stderr
    assert result.returncode == 0, second[-6000:]
    train_2, directory_2, fingerprint_2, created_2, hit_2 = _prepared(second)
    assert (train_2, hit_2) == (84, False) and PREP_BODY_RAN.search(second)
    assert directory_2 != directory_1 and fingerprint_2 != fingerprint_1
    assert Manifest.load(directory_2).split_counts()["train"] == 84
    rows = _report_rows(second)
    assert rows["training samples"] == "84" and rows["optimizer steps"] == "5"  # 84 // 16
    assert rows["prepared data"] == directory_2
    assert rows["data provenance"] == f"inputs fingerprint {fingerprint_2}, created {created_2}, prepared by this run"
    assert re.search(r"registered model : \S+ version 1", second)

    # The user edits prepare_data (every second sample): prep runs again.
    _write_code(workdir / "code" / "fp_user_data", every=2)
    third = _prep_only(workdir, data, env)
    train_3, directory_3, fingerprint_3, created_3, hit_3 = _prepared(third)
    assert (train_3, hit_3) == (42, False) and PREP_BODY_RAN.search(third)
    assert fingerprint_3 != fingerprint_2 and Manifest.load(directory_3).split_counts()["train"] == 42

    # Nothing changed: the prepared data comes from the cache, and the run says so.
    fourth = _prep_only(workdir, data, env)
    assert _prepared(fourth) == (42, directory_3, fingerprint_3, created_3, True)
    assert not PREP_BODY_RAN.search(fourth)
