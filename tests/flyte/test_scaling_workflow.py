"""``scaling_benchmark``: the nodes its dynamic workflow compiles to, and a ``pyflyte run`` on the session's Ray
cluster."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from flytekit.models.task import Resources
from flytekit.types.directory import FlyteDirectory

from tasks.ray_config import WORKER_GROUP
from tasks.scaling_benchmark import scaling_report, torch_baseline
from tasks.train import train
from tasks.types import PreparedData
from tests.conftest import REPO_ROOT, VENV_BIN
from tests.helpers.flyte_compile import compile_dynamic
from training_core.config import TrainingConfig
from training_core.scaling_benchmark import point_config, scaling_preset
from workflows.scaling_benchmark import ray_point, scaling_benchmark

WORKFLOW = str(REPO_ROOT / "workflows" / "scaling_benchmark.py")
ResourceName = Resources.ResourceName


@pytest.fixture
def fresh_compiles():
    """Each test compiles from scratch and leaves ``train`` as it found it.

    A pod compiles a dynamic workflow once; in one test process flytekit would reuse the first compile, and
    a ``task_config`` override stays on the ``train`` task object."""
    saved_config = train._task_config
    for dynamic_task in (ray_point, scaling_benchmark):
        dynamic_task._wf = None
    yield
    train._task_config = saved_config
    for dynamic_task in (ray_point, scaling_benchmark):
        dynamic_task._wf = None


def test_each_worker_count_is_a_named_ray_node_and_a_torch_node_sized_to_it_run_one_after_another(fresh_compiles):
    config = scaling_preset()
    spec = compile_dynamic(
        scaling_benchmark,
        {"config": config, "worker_counts": [1, 2], "models": []},
        {"config": TrainingConfig, "worker_counts": list[int], "models": list[str]},
    )
    by_name = {node.metadata.name: node for node in spec.nodes}
    assert list(by_name) == [
        "prepare",
        "ray-small_cnn-1w",
        "torch-small_cnn-1w",
        "ray-small_cnn-2w",
        "torch-small_cnn-2w",
        "scaling_report",
    ]
    for n in (1, 2):
        resources = by_name[f"torch-small_cnn-{n}w"].task_node.overrides.resources
        assert {(e.name, e.value) for e in resources.requests} == {
            (ResourceName.CPU, str(n)),
            (ResourceName.MEMORY, f"{4096 * n}Mi"),
        }
        assert resources.limits == resources.requests
    points = [
        by_name[name] for name in ("ray-small_cnn-1w", "torch-small_cnn-1w", "ray-small_cnn-2w", "torch-small_cnn-2w")
    ]
    for before, after in zip(points, points[1:]):
        assert before.id in after.upstream_node_ids
    assert {p.id for p in points} <= set(by_name["scaling_report"].upstream_node_ids)


@pytest.mark.parametrize("num_workers", [2, 1])
def test_a_ray_point_gets_a_rayjob_with_as_many_worker_replicas_as_workers(fresh_compiles, num_workers):
    config = point_config(scaling_preset(), model="small_cnn", num_workers=num_workers)
    # A remote directory: the compile only references the data, it never reads it.
    data = PreparedData(
        directory=FlyteDirectory("s3://bucket/prepared"),
        dataset="synthetic",
        num_classes=10,
        input_shape=[3, 32, 32],
        split_counts={},
    )
    spec = compile_dynamic(
        ray_point, {"config": config, "data": data}, {"config": TrainingConfig, "data": PreparedData}
    )
    (node,) = spec.nodes
    assert node.metadata.name == f"train-small_cnn-{num_workers}w"
    (template,) = spec.tasks
    assert template.id.name == "tasks.train.train" and template.type == "ray"
    (group,) = template.custom["rayCluster"]["workerGroupSpec"]
    assert group["groupName"] == WORKER_GROUP
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == num_workers
    (container,) = group["k8sPod"]["podSpec"]["containers"]
    assert container["resources"]["requests"] == {"cpu": "1", "memory": "4096Mi"}


def test_every_input_of_the_scaling_entities_is_described_for_the_launch_form():
    for entity in (scaling_benchmark, ray_point, torch_baseline, scaling_report):
        for name, variable in entity.interface.inputs.items():
            assert len(variable.description) > 20, f"{entity.name}.{name} has no description"


def test_a_worker_count_that_does_not_divide_the_shards_fails_before_anything_runs(tmp_path, subprocess_env):
    subprocess_env.pop("RAY_ADDRESS", None)
    subprocess_env["COLUMNS"] = "400"
    result = subprocess.run(
        [str(VENV_BIN / "pyflyte"), "run", WORKFLOW, "scaling_benchmark", "--worker_counts", "[1, 2, 3]"],
        cwd=tmp_path,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = re.sub(r"[\s│]+", "", result.stdout + result.stderr)
    assert result.returncode != 0
    assert "data.num_shards=8isinvalidforworker_counts=[1,2,3]" in output and "useamultipleof6" in output
    assert "StartedalocalRayinstance" not in output and "RayTrainWorker" not in output


@pytest.mark.slow
def test_pyflyte_run_on_one_and_two_workers_reports_efficiency_parity_and_allreduce_share(
    ray_address, subprocess_env, session_root, tmp_path
):
    import pandas as pd

    tiny = scaling_preset().to_dict()
    tiny["data"].update(synthetic_num_samples=2048, synthetic_image_size=16)
    tiny["loop"].update(batch_size=32, max_steps=12)
    subprocess_env["RAY_ADDRESS"] = ray_address
    result = subprocess.run(
        [
            str(VENV_BIN / "pyflyte"),
            "run",
            WORKFLOW,
            "scaling_benchmark",
            "--config",
            json.dumps(tiny),
            "--worker_counts",
            "[1, 2]",
        ],
        cwd=tmp_path,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]

    table = pd.read_csv(re.search(r"scaling table\s*: (\S+)", output).group(1))
    assert table["num_workers"].tolist() == [1, 2] and table["model"].tolist() == ["small_cnn", "small_cnn"]
    one, two = table.iloc[0], table.iloc[1]
    assert one["ray_efficiency"] == 1.0 and one["torch_efficiency"] == 1.0
    for launcher in ("ray", "torch"):
        assert (table[f"{launcher}_samples_per_s"] > 0).all()
        assert (
            0 < table[f"{launcher}_step_time_p50_s"].min()
            and (table[f"{launcher}_step_time_p50_s"] <= table[f"{launcher}_step_time_p95_s"]).all()
        )
        assert one[f"{launcher}_allreduce_fraction"] == 0.0
        assert 0 < two[f"{launcher}_allreduce_fraction"] < 1
        assert two[f"{launcher}_efficiency"] == pytest.approx(
            two[f"{launcher}_samples_per_s"] / (2 * one[f"{launcher}_samples_per_s"])
        )
    assert (table["parity"] == table["ray_samples_per_s"] / table["torch_samples_per_s"]).all()

    page = Path(re.search(r"scaling report\s*: (\S+)", output).group(1)).read_text()
    assert "id='plots'" in page and "<img alt='plot' src='data:image/png;base64," in page
    assert any("id='plots'" in deck.read_text() for deck in session_root.rglob("deck.html"))
    # The Ray node of each point trained on a worker group of that size.
    assert re.search(r"Started training worker group of size 1", output) and re.search(
        r"Started training worker group of size 2", output
    )
