"""``deployment.registration`` and ``deployment.remote`` up to the network: what registration and a launch would
send to FlyteAdmin, and the error from one that refuses connections. No Flyte backend runs here."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tarfile
from collections import OrderedDict
from pathlib import Path

import pytest
from flyteidl.core import identifier_pb2

from deployment.registration import REMOTE_PACKAGE_PATH, default_version, hydrate, read_package
from deployment.remote import (
    TARGETS,
    input_literals,
    jsonable,
    local_launch_plan,
    parse_assignments,
    phase_changes,
    registered_default,
    typed_outputs,
)
from tests.conftest import REPO_ROOT
from training_core.config import overlay, read_yaml_mapping

IMAGE = "registry.example.com/ml/flyte-ray-training:remote-1"
PROJECT, DOMAIN, VERSION = "ml", "staging", "v42"
CODE_URI = "s3://flyte-code/ml/staging/fast0123.tar.gz"


@pytest.fixture(scope="module")
def fast_package(tmp_path_factory) -> Path:
    """``make package COPY=all``: entities plus the code, as for a cluster without an image per commit."""
    workdir = tmp_path_factory.mktemp("fast-package")
    (workdir / "home").mkdir()
    output = workdir / "flyte-package.tgz"
    result = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-o",
            ".venv/.installed-stamp",
            "package",
            f"IMAGE={IMAGE}",
            f"PACKAGE={output}",
            "COPY=all",
        ],
        cwd=REPO_ROOT,
        env=dict(os.environ, HOME=str(workdir / "home")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return output


@pytest.fixture(scope="module")
def registered(fast_package) -> dict[tuple[str, str], object]:
    """What ``register`` hands to ``FlyteRemote.raw_register``, by (model type, entity name), in order."""
    entities = hydrate(read_package(fast_package), project=PROJECT, domain=DOMAIN, version=VERSION, code_uri=CODE_URI)
    return OrderedDict(((type(e).__name__, _name(e)), e) for e in entities)


def _name(entity) -> str:
    return entity.id.name if type(entity).__name__ == "LaunchPlan" else entity.template.id.name


def _identifiers(message) -> list[identifier_pb2.Identifier]:
    found = []
    if isinstance(message, identifier_pb2.Identifier):
        return [message]
    for field, value in message.ListFields():
        if field.message_type is None or field.message_type.full_name.startswith("google.protobuf."):
            continue
        if field.message_type.GetOptions().map_entry:
            items = value.values() if field.message_type.fields_by_name["value"].message_type is not None else []
        else:
            items = value if field.is_repeated else [value]
        for item in items:
            found.extend(_identifiers(item))
    return found


def test_registration_fills_project_domain_and_version_into_every_identifier_and_reference(registered):
    names = {kind: {name for k, name in registered if k == kind} for kind in ("TaskSpec", "WorkflowSpec", "LaunchPlan")}
    position = {key: i for i, key in enumerate(registered)}
    num_references = 0
    for key, entity in registered.items():
        identifiers = _identifiers(entity.to_flyte_idl())
        assert identifiers, key
        for identifier in identifiers:
            assert (identifier.project, identifier.domain, identifier.version) == (PROJECT, DOMAIN, VERSION), (
                key,
                identifier,
            )
        own = entity.id if key[0] == "LaunchPlan" else entity.template.id
        for identifier in identifiers:
            if identifier.name == own.name and identifier.resource_type == own.resource_type:
                continue
            num_references += 1
            kind = {identifier_pb2.TASK: "TaskSpec", identifier_pb2.WORKFLOW: "WorkflowSpec"}[identifier.resource_type]
            # Everything referenced is in the package and registered before what references it.
            assert identifier.name in names[kind], (key, identifier.name)
            assert position[(kind, identifier.name)] < position[key], (key, identifier.name)
    assert num_references >= 10
    assert {t.launch_plan for t in TARGETS.values()} <= names["LaunchPlan"]


def test_fast_registered_tasks_run_the_uploaded_code(registered, fast_package):
    tasks = [e for (kind, _), e in registered.items() if kind == "TaskSpec"]
    assert len(tasks) >= 8
    for task in tasks:
        args = task.template.container.args
        assert args[args.index("--additional-distribution") + 1] == CODE_URI
        assert not any(REMOTE_PACKAGE_PATH in arg for arg in args)
        assert task.template.container.image == IMAGE
    with pytest.raises(ValueError, match=r"is fast-registered: upload fast\w*\.tar\.gz and pass its URI as code_uri"):
        hydrate(read_package(fast_package), project=PROJECT, domain=DOMAIN, version=VERSION)


def test_registered_entities_equal_what_flyteremote_serializes_from_the_code(registered):
    from flytekit.configuration import FastSerializationSettings, ImageConfig, SerializationSettings
    from flytekit.tools.translator import get_serializable

    from tasks.train import train
    from workflows.launch_plans import nightly_training
    from workflows.training import training_pipeline

    dest_dir = registered[("TaskSpec", "tasks.train.train")].template.container.args[4]
    settings = SerializationSettings(
        image_config=ImageConfig.from_images(IMAGE),
        project=PROJECT,
        domain=DOMAIN,
        version=VERSION,
        fast_serialization_settings=FastSerializationSettings(
            enabled=True, destination_dir=dest_dir, distribution_location=CODE_URI
        ),
    )

    def serialized(entity):
        return get_serializable(OrderedDict(), settings, entity).to_flyte_idl()

    assert serialized(train) == registered[("TaskSpec", "tasks.train.train")].to_flyte_idl()
    plan, expected = serialized(nightly_training), registered[("LaunchPlan", "nightly_training")].to_flyte_idl()
    assert plan.id == expected.id
    for field in ("workflow_id", "default_inputs", "fixed_inputs", "entity_metadata"):
        assert getattr(plan.spec, field) == getattr(expected.spec, field), field
    # Node order inside a workflow's upstream lists is a set's order; compare what the nodes reference.
    workflow, expected = (
        serialized(training_pipeline),
        registered[("WorkflowSpec", "workflows.training.training_pipeline")].to_flyte_idl(),
    )
    assert workflow.template.interface == expected.template.interface
    assert [(n.id, n.task_node.reference_id) for n in workflow.template.nodes] == [
        (n.id, n.task_node.reference_id) for n in expected.template.nodes
    ]


def test_default_version_names_the_entities_not_the_tarball(fast_package, tmp_path):
    package = read_package(fast_package)
    assert default_version(package) == f"pkg-{package.digest[:16]}"
    extracted = tmp_path / "x"
    with tarfile.open(fast_package) as tar:
        tar.extractall(extracted, filter="data")
    rebuilt = tmp_path / "rebuilt.tgz"
    with tarfile.open(rebuilt, "w:gz") as tar:  # other member order, other timestamps
        for path in sorted(extracted.iterdir(), reverse=True):
            os.utime(path, (0, 0))
            tar.add(path, arcname=path.name)
    assert default_version(read_package(rebuilt)) == default_version(package)
    changed = read_package(fast_package)
    changed.entities[0].template.metadata.retries.retries += 1
    assert default_version(changed) != default_version(package)


def test_a_launch_sends_the_registered_default_config_with_the_yaml_fields_on_top(registered, tmp_path):
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    from training_core.config import TrainingConfig

    plan = local_launch_plan("nightly_training")
    registered_plan = registered[("LaunchPlan", "nightly_training")]
    assert (registered_plan.id.name, registered_plan.id.project, registered_plan.id.domain) == (
        "nightly_training",
        PROJECT,
        DOMAIN,
    )
    variables = registered[("WorkflowSpec", "workflows.training.training_pipeline")].template.interface.inputs
    ctx = FlyteContextManager.current_context()
    default = registered_default(plan, registered_plan.spec.default_inputs, "config", ctx)
    assert default == plan.saved_inputs["config"]

    config_file = tmp_path / "run.yaml"
    config_file.write_text("model: {name: small_cnn}\nloop: {epochs: 2}\n")
    values = parse_assignments(plan, [], config_path=str(config_file))
    values["config"] = overlay(default, read_yaml_mapping(str(config_file), setting="--config"))
    literals = input_literals(plan, values, variables=variables, ctx=ctx)

    assert set(literals) == {"config"}  # resume_from is fixed: FlyteAdmin takes it from the launch plan
    assert literals["config"].scalar.binary.tag == "msgpack"
    sent = TypeEngine.to_python_value(ctx, literals["config"], TrainingConfig)
    assert sent == dataclasses.replace(
        default,
        model=dataclasses.replace(default.model, name="small_cnn"),
        loop=dataclasses.replace(default.loop, epochs=2),
    )


def test_launch_inputs_are_checked_before_flyte_is_contacted(tmp_path):
    nightly = local_launch_plan("nightly_training")
    with pytest.raises(
        ValueError,
        match=r"input 'resume_from' is fixed by launch plan 'nightly_training': launch training_pipeline to set it",
    ):
        parse_assignments(nightly, ["resume_from=s3://bucket/run/checkpoints/step-19"])
    pipeline = local_launch_plan("training_pipeline")
    with pytest.raises(
        ValueError,
        match=(
            r"input 'epochs' is invalid for 'workflows.training.training_pipeline': choose one of config, "
            r"resume_from"
        ),
    ):
        parse_assignments(pipeline, ["epochs=3"])
    with pytest.raises(ValueError, match=r"input 'config' is set with --config FILE"):
        parse_assignments(pipeline, ['config={"loop": {"epochs": 2}}'])
    with pytest.raises(ValueError, match=r"--input 'resume_from' is invalid: write NAME=VALUE"):
        parse_assignments(pipeline, ["resume_from"])
    with pytest.raises(ValueError, match=r"resume_from='/data/ckpt' is invalid: give a URI the cluster can read"):
        parse_assignments(pipeline, ["resume_from=/data/ckpt"])
    with pytest.raises(ValueError, match=r"--config '.*missing.yaml' is invalid: no file there"):
        read_yaml_mapping(str(tmp_path / "missing.yaml"), setting="--config")

    values = parse_assignments(pipeline, ["resume_from=s3://bucket/run/checkpoints/step-19"])
    literal = input_literals(pipeline, values)["resume_from"]
    assert literal.scalar.union.value.scalar.blob.uri == "s3://bucket/run/checkpoints/step-19"

    scaling = local_launch_plan("scaling_benchmark")
    values = parse_assignments(scaling, ["worker_counts=[1,2,4,8]", 'models=["small_cnn","resnet18"]'])
    assert values == {"worker_counts": [1, 2, 4, 8], "models": ["small_cnn", "resnet18"]}
    literals = input_literals(scaling, values)
    assert [lit.scalar.primitive.integer for lit in literals["worker_counts"].collection.literals] == [1, 2, 4, 8]
    with pytest.raises(ValueError, match=r"worker_counts='4' is invalid: write a JSON array"):
        parse_assignments(scaling, ["worker_counts=4"])


def test_outputs_come_back_typed_and_reading_them_moves_no_data():
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Literal, Scalar, StructuredDataset, StructuredDatasetMetadata
    from flytekit.models.types import StructuredDatasetType

    from tasks.types import Registration
    from training_core.tracking import Promotion

    ctx = FlyteContextManager.current_context()
    registration = Registration(
        promotion=Promotion(
            model_name="digits-classifier",
            version=3,
            alias="champion",
            promoted=True,
            reason="0.98 beats v2's 0.97",
            metric="test_accuracy",
            mode="max",
            test_value=0.98,
            previous_champion_version=2,
            previous_champion_value=0.97,
        ),
        tracking_uri="http://mlflow.mlflow.svc:5000",
        reports=["s3://flyte/raw/ab/training_report.html"],
    )
    table = Literal(
        scalar=Scalar(
            structured_dataset=StructuredDataset(
                uri="s3://flyte/raw/cd/trials.parquet",
                metadata=StructuredDatasetMetadata(StructuredDatasetType(format="parquet")),
            )
        )
    )
    literals = {
        "o0": TypeEngine.to_literal(ctx, registration, Registration, TypeEngine.to_literal_type(Registration)),
        "o1": table,
    }
    outputs = typed_outputs(literals, {"o0": Registration, "o1": object}, ctx)
    assert outputs == {"o0": registration, "o1": "s3://flyte/raw/cd/trials.parquet"}
    printed = json.loads(json.dumps(jsonable(outputs)))
    assert printed["o0"]["promotion"]["version"] == 3 and printed["o0"]["promotion"]["promoted"] is True


def test_progress_reports_each_phase_change_once():
    seen: dict[str, str] = {}
    assert phase_changes(seen, {"execution": "RUNNING", "  prepare_data": "RUNNING"}) == [
        "execution: RUNNING",
        "  prepare_data: RUNNING",
    ]
    assert phase_changes(seen, {"execution": "RUNNING", "  prepare_data": "SUCCEEDED", "  train": "QUEUED"}) == [
        "  prepare_data: SUCCEEDED",
        "  train: QUEUED",
    ]
    assert phase_changes(seen, {"execution": "RUNNING", "  prepare_data": "SUCCEEDED", "  train": "QUEUED"}) == []


def _refused_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


@pytest.mark.parametrize(
    "command",
    [
        ["register", "{package}"],
        ["launch", "training_pipeline", "--config", "{config}"],
        ["activate", "nightly_training"],
        ["watch", "f3a9c2e1b0"],
    ],
    ids=["register", "launch", "activate", "watch"],
)
def test_cli_reads_the_endpoint_from_flytekit_config_and_says_clearly_when_flyteadmin_is_unreachable(
    command, fast_package, tmp_path, subprocess_env
):
    endpoint = _refused_endpoint()
    config = tmp_path / "run.yaml"
    config.write_text("loop: {epochs: 1}\n")
    subprocess_env.update(
        {
            "FLYTE_PLATFORM_URL": endpoint,
            "FLYTE_PLATFORM_INSECURE": "True",
            "FLYTE_DEFAULT_PROJECT": PROJECT,
            "FLYTE_DEFAULT_DOMAIN": DOMAIN,
        }
    )
    args = [a.format(package=fast_package, config=config) for a in command]
    result = subprocess.run(
        [sys.executable, "-m", "deployment.remote", *args],
        cwd=REPO_ROOT,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"error: FlyteAdmin at {endpoint} (insecure) is unreachable" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_rejects_a_bad_input_before_contacting_flyteadmin(tmp_path, subprocess_env):
    subprocess_env.update({"FLYTE_PLATFORM_URL": _refused_endpoint(), "FLYTE_PLATFORM_INSECURE": "True"})
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "deployment.remote",
            "launch",
            "training_pipeline",
            "--input",
            f"resume_from={tmp_path}",
        ],
        cwd=REPO_ROOT,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    # Exit 2, not 3: the refusing endpoint was never tried.
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"error: resume_from='{tmp_path}' is invalid: give a URI the cluster can read" in result.stderr
