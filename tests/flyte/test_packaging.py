"""``make package``: the registration tarball holds what FlyteAdmin will register, decoded from its protobufs."""

from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2
from flyteidl.plugins import ray_pb2
from google.protobuf import json_format

from tests.conftest import REPO_ROOT

IMAGE = "registry.example.com/ml/flyte-ray-training:test-7"
ALERT_EMAILS = "oncall@corp.example, ml-team@corp.example"
MLFLOW_URI = "http://mlflow.mlflow.svc:5000"
TRAINING_TASKS = (
    "tasks.data.prepare_data",
    "tasks.data.prepare_on_ray",
    "tasks.train.train",
    "tasks.evaluate.evaluate",
    "tasks.evaluate.evaluate_on_ray",
    "tasks.register.register_model",
)


FAST_ARCHIVE = re.compile(r"fast[0-9a-f]+\.tar\.gz")
"""The code archive ``pyflyte package --copy all`` adds beside the entities, unpacked into /root in the task pods."""


@dataclass
class Package:
    tasks: dict[str, task_pb2.TaskSpec]
    workflows: dict[str, workflow_pb2.WorkflowSpec]
    launch_plans: dict[str, launch_plan_pb2.LaunchPlan]


def decode_package(path: Path) -> Package:
    """Every ``.pb`` in the tarball by the entity name it registers; the file suffix gives the resource type
    (``_1`` task, ``_2`` workflow, ``_3`` launch plan, flyteidl's ResourceType numbers)."""
    tasks, workflows, launch_plans = {}, {}, {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()
            if member.name.endswith("_1.pb"):
                spec = task_pb2.TaskSpec.FromString(data)
                tasks[spec.template.id.name] = spec
            elif member.name.endswith("_2.pb"):
                spec = workflow_pb2.WorkflowSpec.FromString(data)
                workflows[spec.template.id.name] = spec
            elif member.name.endswith("_3.pb"):
                plan = launch_plan_pb2.LaunchPlan.FromString(data)
                launch_plans[plan.id.name] = plan
            elif FAST_ARCHIVE.fullmatch(member.name):
                continue  # the code of a fast-registration package (COPY=all), not an entity
            else:
                raise AssertionError(f"unexpected file in the package: {member.name}")
    return Package(tasks, workflows, launch_plans)


def build_package(tmp_path_factory, *make_args: str) -> Path:
    """``make package`` with the test image and the environment settings of a release, and ``make_args``."""
    workdir = tmp_path_factory.mktemp("package")
    (workdir / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINING_CORE__", "TUNING__"))}
    env.update(
        {
            "HOME": str(workdir / "home"),
            "SCHEDULED_RUN_ALERT_EMAILS": ALERT_EMAILS,
            "TRAINING_CORE__TRACKING__TRACKING_URI": MLFLOW_URI,
        }
    )
    output = workdir / "dist" / "flyte-package.tgz"
    # `-o` treats the venv stamp as up to date: the test runs inside that venv and must not reinstall it.
    result = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-o",
            ".venv/.installed-stamp",
            "package",
            f"IMAGE={IMAGE}",
            f"PACKAGE={output}",
            *make_args,
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return output


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Package:
    return decode_package(build_package(tmp_path_factory))


@pytest.fixture(scope="module")
def fast_package(tmp_path_factory) -> Path:
    """The fast-registration package: the code travels in the tarball (``make package COPY=all``)."""
    return build_package(tmp_path_factory, "COPY=all")


def _literal_value(literal_pb, python_type):
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Literal

    return TypeEngine.to_python_value(
        FlyteContextManager.current_context(), Literal.from_flyte_idl(literal_pb), python_type
    )


def _resources(container: dict) -> tuple[dict[str, str], dict[str, str]]:
    return container["resources"]["requests"], container["resources"]["limits"]


def test_package_holds_every_task_workflow_and_launch_plan_built_on_the_image_variable(package):
    assert set(TRAINING_TASKS) <= set(package.tasks)
    assert "workflows.training.training_pipeline" in package.workflows
    assert {"workflows.training.training_pipeline", "nightly_training", "weekly_tuning", "scaling_benchmark"} <= set(
        package.launch_plans
    )
    for name, spec in package.tasks.items():
        assert spec.template.container.image == IMAGE, name
        # Registration fills these in (flytectl or deployment.registration): the package is project-agnostic.
        assert (spec.template.id.project, spec.template.id.domain, spec.template.id.version) == ("", "", ""), name
    # Every task module is loaded, so tasks only a dynamic workflow calls at run time are registered too.
    assert "tasks.tuning.train_trial" in package.tasks


def test_train_is_a_ray_job_whose_groups_and_resources_come_from_the_default_scaling_config(package):
    from tasks.ray_config import RAYJOB_TTL_S, WORKER_GROUP, worker_resources
    from training_core.config import ScalingConfig

    template = package.tasks["tasks.train.train"].template
    assert template.type == "ray"
    job = json_format.ParseDict(json_format.MessageToDict(template.custom), ray_pb2.RayJob())
    scaling = ScalingConfig()
    (group,) = job.ray_cluster.worker_group_spec
    assert group.group_name == WORKER_GROUP == "train-workers"
    assert group.replicas == group.min_replicas == group.max_replicas == scaling.num_workers
    assert dict(job.ray_cluster.head_group_spec.ray_start_params) == {"num-cpus": "0", "num-gpus": "0"}
    assert job.shutdown_after_job_finishes and job.ttl_seconds_after_finished == RAYJOB_TTL_S

    expected_worker = {"cpu": worker_resources(scaling).cpu, "memory": worker_resources(scaling).mem}
    expected_head = {"cpu": f"{scaling.head_cpus:g}", "memory": f"{int(scaling.head_memory_gib * 1024)}Mi"}
    for pod, expected, container_name in (
        (group.k8s_pod, expected_worker, "ray-worker"),
        (job.ray_cluster.head_group_spec.k8s_pod, expected_head, "ray-head"),
    ):
        (container,) = json_format.MessageToDict(pod.pod_spec)["containers"]
        assert container["name"] == container_name
        requests, limits = _resources(container)
        assert requests == limits == expected, container_name
    # A CPU default config asks for no GPUs anywhere.
    assert "nvidia.com/gpu" not in json_format.MessageToJson(job)


@pytest.mark.parametrize(
    "task_name",
    ["tasks.train.train", "tasks.tuning.train_trial", "tasks.tuning.tune_with_ray", "tasks.data.prepare_on_ray"],
)
def test_every_pod_of_a_packaged_rayjob_carries_the_platforms_ray_settings(package, task_name):
    """``ray start`` in the head and worker containers, and every process it starts, inherit them: workers at nice 0
    and glibc's malloc keeping freed memory mapped (``training_core/parallel/ray_settings.py``); each container's
    ``postStart`` hook puts the pod's Ray daemons under SCHED_IDLE."""
    from training_core.parallel.ray_settings import POD_HOOK_COMMAND, PROCESS_ENV

    template = package.tasks[task_name].template
    job = json_format.ParseDict(json_format.MessageToDict(template.custom), ray_pb2.RayJob())
    (group,) = job.ray_cluster.worker_group_spec
    for pod in (job.ray_cluster.head_group_spec.k8s_pod, group.k8s_pod):
        (container,) = json_format.MessageToDict(pod.pod_spec)["containers"]
        assert {e["name"]: e["value"] for e in container["env"]} == PROCESS_ENV
        assert container["lifecycle"]["postStart"]["exec"]["command"] == POD_HOOK_COMMAND
    assert PROCESS_ENV["RAY_worker_niceness"] == "0"


def test_no_static_workflow_node_runs_a_ray_task_so_every_rayjob_is_sized_at_run_time(package):
    """A Ray task in a static workflow would run on the RayJob of the default config, whatever config a launch
    passes; reached through a dynamic workflow, its RayJob is compiled from the launched config (see
    test_rayjob_sizing.py for each dynamic's compile)."""
    ray_tasks = {name for name, spec in package.tasks.items() if spec.template.type == "ray"}
    assert {
        "tasks.train.train",
        "tasks.tuning.train_trial",
        "tasks.tuning.tune_with_ray",
        "tasks.data.prepare_on_ray",
    } <= ray_tasks

    def task_refs(nodes):
        for node in nodes:
            if node.HasField("task_node"):
                yield node.task_node.reference_id.name
            if node.HasField("branch_node"):
                branches = [node.branch_node.if_else.case, *node.branch_node.if_else.other]
                yield from task_refs([b.then_node for b in branches])
                if node.branch_node.if_else.HasField("else_node"):
                    yield from task_refs([node.branch_node.if_else.else_node])

    for name, spec in package.workflows.items():
        templates = [spec.template, *spec.sub_workflows]
        static_refs = {ref for template in templates for ref in task_refs(template.nodes)}
        assert not static_refs & ray_tasks, f"{name} runs {sorted(static_refs & ray_tasks)} on the default RayJob"
    assert {
        "workflows.training.train_on_ray",
        "tasks.data.prepare",
        "workflows.training.evaluate_where_it_fits",
    } <= set(task_refs(package.workflows["workflows.training.training_pipeline"].template.nodes))


def test_task_retries_in_the_package_match_the_declarations(package):
    from tasks.data import prepare_data, prepare_on_ray
    from tasks.evaluate import evaluate, evaluate_on_ray
    from tasks.register import register_model
    from tasks.train import train

    for task in (prepare_data, prepare_on_ray, train, evaluate, evaluate_on_ray, register_model):
        metadata = package.tasks[task.name].template.metadata
        assert metadata.retries.retries == task.metadata.retries >= 1, task.name
    # The workflow nodes carry the same retry budget FlyteAdmin will apply (prep's, train's and evaluate's nodes are
    # compiled at run time: test_rayjob_sizing.py checks them).
    nodes = {
        n.task_node.reference_id.name: n
        for n in package.workflows["workflows.training.training_pipeline"].template.nodes
    }
    assert nodes[register_model.name].metadata.retries.retries == register_model.metadata.retries


def test_train_and_trials_are_interruptible_with_a_timeout(package):
    from tasks.train import TRAIN_TIMEOUT

    for name in ("tasks.train.train", "tasks.tuning.train_trial"):
        metadata = package.tasks[name].template.metadata
        assert metadata.WhichOneof("interruptible_value") == "interruptible" and metadata.interruptible, name
        assert metadata.timeout.ToTimedelta() == TRAIN_TIMEOUT, name


def test_every_training_task_sets_a_timeout_and_an_explicit_interruptible_choice(package):
    missing = [
        name
        for name in TRAINING_TASKS
        if not package.tasks[name].template.metadata.HasField("timeout")
        or package.tasks[name].template.metadata.WhichOneof("interruptible_value") is None
    ]
    assert not missing, f"no timeout or no explicit interruptible: {missing}"


def test_only_data_prep_and_trials_are_cached_with_their_declared_versions(package):
    from tasks.data import PREPARE_DATA_CACHE_VERSION
    from tasks.tuning import TRIAL_CACHE_VERSION

    for name in ("tasks.data.prepare_data", "tasks.data.prepare_on_ray"):
        prepare = package.tasks[name].template.metadata
        assert prepare.discoverable and prepare.discovery_version == PREPARE_DATA_CACHE_VERSION == "7", name
        # The run's token says which run prepared the data; in the key, every run would miss the cache.
        assert list(prepare.cache_ignore_input_vars) == ["run_token"], name
    trial = package.tasks["tasks.tuning.train_trial"].template.metadata
    assert trial.discoverable and trial.discovery_version == TRIAL_CACHE_VERSION
    for name in (
        "tasks.train.train",
        "tasks.evaluate.evaluate",
        "tasks.evaluate.evaluate_on_ray",
        "tasks.register.register_model",
    ):
        assert not package.tasks[name].template.metadata.discoverable, name


def test_nightly_training_is_a_daily_cron_with_alerts_a_fixed_resume_from_and_the_registration_time_config(package):
    from flyteidl.core import execution_pb2

    from training_core.config import TrackingConfig, TrainingConfig
    from workflows.launch_plans import NIGHTLY_CRON

    spec = package.launch_plans["nightly_training"].spec
    assert spec.workflow_id.name == "workflows.training.training_pipeline"
    assert spec.entity_metadata.schedule.cron_schedule.schedule == NIGHTLY_CRON == "0 2 * * *"
    (notification,) = spec.entity_metadata.notifications
    assert list(notification.email.recipients_email) == ["oncall@corp.example", "ml-team@corp.example"]
    phase = execution_pb2.WorkflowExecution.Phase
    assert list(notification.phases) == [phase.FAILED, phase.TIMED_OUT, phase.ABORTED]

    assert set(spec.fixed_inputs.literals) == {"resume_from"}
    assert spec.fixed_inputs.literals["resume_from"].scalar.union.value.scalar.HasField("none_type")
    assert set(spec.default_inputs.parameters) == {"config"}
    config = _literal_value(spec.default_inputs.parameters["config"].default, TrainingConfig)
    # The environment at packaging time is baked in; everything else stays at the code's defaults.
    assert config.tracking == TrackingConfig(tracking_uri=MLFLOW_URI)
    assert config == TrainingConfig(tracking=TrackingConfig(tracking_uri=MLFLOW_URI))


def test_weekly_tuning_is_a_weekly_cron_over_the_tuning_pipeline_with_the_default_search(package):
    from training_core.tuning import TuningConfig
    from workflows.launch_plans import WEEKLY_CRON

    spec = package.launch_plans["weekly_tuning"].spec
    assert spec.workflow_id.name == "workflows.tuning.tuning_pipeline"
    assert spec.entity_metadata.schedule.cron_schedule.schedule == WEEKLY_CRON == "0 4 * * 6"
    assert list(spec.entity_metadata.notifications[0].email.recipients_email) == [
        "oncall@corp.example",
        "ml-team@corp.example",
    ]
    assert not spec.fixed_inputs.literals
    assert _literal_value(spec.default_inputs.parameters["config"].default, TuningConfig) == TuningConfig()


def test_scaling_benchmark_runs_on_demand_with_the_benchmark_task_defaults(package):
    from training_core.config import TrainingConfig
    from training_core.scaling_benchmark import DEFAULT_WORKER_COUNTS, scaling_preset

    spec = package.launch_plans["scaling_benchmark"].spec
    assert not spec.entity_metadata.HasField("schedule") and not spec.entity_metadata.notifications
    # A launch plan points at a workflow; the benchmark is a @dynamic task, so a one-node workflow wraps it.
    wrapper = package.workflows[spec.workflow_id.name].template
    (node,) = wrapper.nodes
    assert node.task_node.reference_id.name == "workflows.scaling_benchmark.scaling_benchmark"
    benchmark = package.tasks["workflows.scaling_benchmark.scaling_benchmark"].template
    for side in ("inputs", "outputs"):
        wrapped, own = getattr(wrapper.interface, side).variables, getattr(benchmark.interface, side).variables
        assert {k: v.type for k, v in wrapped.items()} == {k: v.type for k, v in own.items()}, side
    defaults = spec.default_inputs.parameters
    assert set(defaults) == {"config", "worker_counts", "models"} and not spec.fixed_inputs.literals
    assert _literal_value(defaults["config"].default, TrainingConfig) == scaling_preset()
    assert _literal_value(defaults["worker_counts"].default, list[int]) == list(DEFAULT_WORKER_COUNTS)
    assert _literal_value(defaults["models"].default, list[str]) == []


def test_default_launch_plans_have_no_schedule(package):
    for name in ("workflows.training.training_pipeline", "workflows.tuning.tuning_pipeline"):
        assert not package.launch_plans[name].spec.entity_metadata.HasField("schedule"), name


@pytest.mark.parametrize(
    ("workflow", "dynamic"),
    [
        ("workflows.tuning.tuning_pipeline", "workflows.tuning.search_round"),
        ("workflows.launch_plans.scaling_benchmark_workflow", "workflows.scaling_benchmark.scaling_benchmark"),
    ],
    ids=["tuning-rounds", "scaling-points"],
)
def test_fan_outs_are_dynamic_workflows_that_compile_their_nodes_on_the_registered_image(package, workflow, dynamic):
    from flytekit.configuration import SERIALIZED_CONTEXT_ENV_VAR, SerializationSettings

    referenced = {n.task_node.reference_id.name for n in package.workflows[workflow].template.nodes}
    assert dynamic in referenced
    template = package.tasks[dynamic].template
    # A dynamic workflow is a python task whose container gets the serialization settings it needs to
    # compile its nodes (Ray jobs shaped per trial or per point) at run time.
    assert template.type == "python-task"
    env = {e.key: e.value for e in template.container.env}
    settings = SerializationSettings.from_transport(env[SERIALIZED_CONTEXT_ENV_VAR])
    assert settings.image_config.default_image.full == IMAGE
    module, name = dynamic.rsplit(".", 1)
    assert list(template.container.args[-4:]) == ["task-module", module, "task-name", name]


def test_the_fast_registration_tarball_carries_the_user_code_examples_that_configs_name(fast_package):
    with tarfile.open(fast_package) as tar:
        (archive,) = [name for name in tar.getnames() if FAST_ARCHIVE.fullmatch(name)]
        code = tarfile.open(fileobj=io.BytesIO(tar.extractfile(archive).read()))
    files = set(code.getnames())
    example = "examples/tabular_mlp"
    # `workload.name: examples.tabular_mlp.workload:TabularMLP` imports from the unpacked tree: the packages, the
    # workload and its model, the table it trains on by default, and the configs.
    assert {
        "examples/__init__.py",
        f"{example}/__init__.py",
        f"{example}/workload.py",
        f"{example}/model.py",
        f"{example}/breast_cancer.csv",
        "examples/tabular_mlp.yaml",
        "examples/broken_workload/workload.py",
    } <= files
    for name in (f"{example}/workload.py", f"{example}/breast_cancer.csv"):
        assert code.extractfile(name).read() == (REPO_ROOT / name).read_bytes(), name
    assert "training_core/workloads/__init__.py" in files and "tasks/train.py" in files
    assert not [name for name in files if name.startswith(("tests/", ".venv/", ".git/")) or name.endswith(".db")]

    # Every task unpacks that archive into the image's source path (on its PYTHONPATH) before it runs; the train
    # task's Ray workers get the same tree as their working directory.
    package = decode_package(fast_package)
    for name in TRAINING_TASKS:
        args = list(package.tasks[name].template.container.args)
        assert args[: args.index("--")] == [
            "pyflyte-fast-execute",
            "--additional-distribution",
            "{{ .remote_package_path }}",
            "--dest-dir",
            "/root",
        ], name
