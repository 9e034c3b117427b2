"""Register, launch, watch and schedule the pipelines on a Flyte cluster through ``FlyteRemote``.

    python -m deployment.remote register dist/flyte-package.tgz       # the tarball of `make package`
    python -m deployment.remote launch training_pipeline --config my_run.yaml --wait
    python -m deployment.remote launch scaling_benchmark --input 'worker_counts=[1,2,4,8]'
    python -m deployment.remote wait <execution name> --prometheus-url http://prometheus:9090
    python -m deployment.remote activate nightly_training             # its schedule starts firing
    python -m deployment.remote deactivate nightly_training

The endpoint and its credentials come from flytekit's own configuration (``Config.auto``): ``--config-file``, else
``FLYTECTL_CONFIG``, else ``~/.flyte/config.yaml``; ``FLYTE_PLATFORM_URL`` and ``FLYTE_PLATFORM_INSECURE`` override
single settings. ``--project``/``--domain`` default to ``FLYTE_DEFAULT_PROJECT``/``FLYTE_DEFAULT_DOMAIN``, else to
flytekit's task defaults (``flytesnacks``/``development``), as for ``pyflyte``.

Exit codes: 0 done, 1 the execution did not succeed, 2 a bad argument or input, 3 FlyteAdmin unreachable,
4 still running when ``--timeout-s`` ran out (the execution goes on).

While it follows an execution, each training node's steps done and total, step rate and ETA (to the end and to the
next checkpoint) are printed as they move, read from the Prometheus that scrapes the workers (``--prometheus-url``,
else ``PROMETHEUS_URL``; :mod:`deployment.progress`).

Reading and registering the package is :mod:`deployment.registration`; this module is the command line, the
checking of launch inputs, and the following of executions.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
import typing
from typing import Any, Callable, Mapping, Sequence

from flytekit import LaunchPlan
from flytekit.configuration import Config, TaskConfig
from flytekit.core.context_manager import FlyteContext, FlyteContextManager
from flytekit.core.type_engine import TypeEngine
from flytekit.core.workflow import WorkflowBase
from flytekit.exceptions.system import FlyteSystemUnavailableException
from flytekit.models.core.execution import NodeExecutionPhase, WorkflowExecutionPhase
from flytekit.models.core.identifier import Identifier
from flytekit.models.literals import Literal
from flytekit.remote import FlyteRemote, FlyteWorkflowExecution
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from deployment.progress import PROMETHEUS_URL_ENV, ProgressWatch
from deployment.registration import register_package
from tasks.artifacts import artifact_location
from training_core.config import overlay, read_yaml_mapping
from training_core.redact import redact

Report = Callable[[str], None]

EXIT_NOT_SUCCEEDED, EXIT_BAD_INPUT, EXIT_UNREACHABLE, EXIT_TIMEOUT = 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class Target:
    """Something ``launch`` can start: the launch plan FlyteAdmin knows, and its Python definition here."""

    launch_plan: str
    """The registered launch plan's name (a workflow's default launch plan carries the workflow's name)."""
    module: str
    attribute: str
    """A ``LaunchPlan``, or a workflow launched through its default launch plan."""


TARGETS: dict[str, Target] = {
    "training_pipeline": Target("workflows.training.training_pipeline", "workflows.training", "training_pipeline"),
    "tuning_pipeline": Target("workflows.tuning.tuning_pipeline", "workflows.tuning", "tuning_pipeline"),
    "scaling_benchmark": Target("scaling_benchmark", "workflows.launch_plans", "scaling_benchmark"),
    "nightly_training": Target("nightly_training", "workflows.launch_plans", "nightly_training"),
    "weekly_tuning": Target("weekly_tuning", "workflows.launch_plans", "weekly_tuning"),
}


def target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"target={name!r} is invalid: choose one of {', '.join(TARGETS)}") from None


def local_launch_plan(name: str) -> LaunchPlan:
    """The launch plan this repo defines for target ``name`` (imports only that target's module)."""
    spec = target(name)
    entity = getattr(importlib.import_module(spec.module), spec.attribute)
    plan = LaunchPlan.get_or_create(entity) if isinstance(entity, WorkflowBase) else entity
    assert isinstance(plan, LaunchPlan) and plan.name == spec.launch_plan, (name, plan)
    return plan


def connect(*, config_file: str | None, project: str, domain: str) -> FlyteRemote:
    """A FlyteRemote on flytekit's configuration (file and ``FLYTE_*`` variables). Nothing is contacted yet."""
    return FlyteRemote(Config.auto(config_file=config_file), default_project=project, default_domain=domain)


def parse_value(name: str, text: str, hint: Any) -> Any:
    """The Python value of input ``name`` given on the command line as ``text``, for type ``hint``.

    Scalars as themselves, lists and dicts as JSON, files and directories as URIs the cluster can read (a local
    path would not be uploaded), ``none`` for an empty optional.
    """
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        if text.strip().lower() in ("", "none", "null"):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return parse_value(name, text, inner)
    if isinstance(hint, type) and issubclass(hint, (FlyteDirectory, FlyteFile)):
        if "://" not in text or text.startswith("file://"):
            raise ValueError(
                f"{name}={text!r} is invalid: give a URI the cluster can read (s3://..., gs://...), e.g. the "
                "checkpoint output of an earlier run; local paths are not uploaded"
            )
        return hint(text)
    if hint is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{name}={text!r} is invalid: write true or false")
        return text.lower() == "true"
    if hint in (int, float, str):
        try:
            return hint(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} is invalid: it must be a {hint.__name__}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}={text!r} is invalid: write it as JSON ({exc.msg})") from None
    origin = typing.get_origin(hint) or hint
    if origin in (list, dict) and not isinstance(raw, origin):
        raise ValueError(f"{name}={text!r} is invalid: write a JSON {'array' if origin is list else 'object'}")
    return raw


def _check_settable(plan: LaunchPlan, name: str) -> None:
    if name in plan.fixed_inputs.literals:
        raise ValueError(
            f"input {name!r} is fixed by launch plan {plan.name!r}: launch {plan.workflow.short_name} to set it"
        )
    settable = plan.parameters.parameters
    if name not in settable:
        raise ValueError(f"input {name!r} is invalid for {plan.name!r}: choose one of {', '.join(sorted(settable))}")


def parse_assignments(
    plan: LaunchPlan, assignments: Sequence[str], *, config_path: str | None = None
) -> dict[str, Any]:
    """Python values of the ``NAME=VALUE`` inputs of a launch of ``plan``, checked before anything is contacted.

    :param config_path: The ``--config`` file, if any: ``config`` must then be settable.
    :raises ValueError: for an input the plan fixes or does not have, ``config`` (it comes from a file), one given
        twice, or a malformed value.
    """
    hints = plan.python_interface.inputs
    values: dict[str, Any] = {}
    if config_path is not None:
        _check_settable(plan, "config")
    for assignment in assignments:
        name, sep, text = assignment.partition("=")
        if not sep:
            raise ValueError(
                f"--input {assignment!r} is invalid: write NAME=VALUE, e.g. --input 'worker_counts=[1,2,4]'"
            )
        _check_settable(plan, name)
        if name == "config":
            raise ValueError(
                "input 'config' is set with --config FILE: a YAML file of the fields to change in the launch plan's "
                "default"
            )
        if name in values:
            raise ValueError(f"input {name!r} is given twice: give it once")
        values[name] = parse_value(name, text, hints[name])
    return values


def registered_default(plan: LaunchPlan, parameters: Any, name: str, ctx: FlyteContext) -> Any:
    """The default of input ``name`` of a registered launch plan (its ``ParameterMap``), as a Python value."""
    return TypeEngine.to_python_value(ctx, parameters.parameters[name].default, plan.python_interface.inputs[name])


def input_literals(
    plan: LaunchPlan,
    values: Mapping[str, Any],
    *,
    variables: Mapping[str, Any] | None = None,
    ctx: FlyteContext | None = None,
) -> dict[str, Literal]:
    """``values`` as the literals of an execution request, converted as FlyteRemote converts inputs:
    ``TypeEngine.to_literal`` with this repo's Python type and the registered launch plan's Flyte type.

    :param variables: The registered launch plan's input variables; this repo's plan's when not given.
    """
    ctx = ctx or FlyteContextManager.current_context()
    variables = plan.interface.inputs if variables is None else variables
    literals = {}
    for name, value in values.items():
        if name not in variables:
            raise ValueError(
                f"input {name!r} is invalid for the registered {plan.name!r}: it has only "
                f"{', '.join(sorted(variables))}; "
                "register this code's package (or pass --version) to launch with it"
            )
        literals[name] = TypeEngine.to_literal(ctx, value, plan.python_interface.inputs[name], variables[name].type)
    return literals


def typed_outputs(
    literals: Mapping[str, Literal], types: Mapping[str, Any], ctx: FlyteContext | None = None
) -> dict[str, Any]:
    """Outputs as Python values of their declared types. DataFrames stay where they are (their URI), and files and
    directories are not downloaded, so reading a result moves no data."""
    ctx = ctx or FlyteContextManager.current_context()
    outputs: dict[str, Any] = {}
    for name, literal in literals.items():
        scalar = literal.scalar
        if scalar is not None and scalar.structured_dataset is not None:
            outputs[name] = scalar.structured_dataset.uri
        else:
            outputs[name] = TypeEngine.to_python_value(ctx, literal, types[name])
    return outputs


def jsonable(value: Any) -> Any:
    """A JSON-printable view of an output: dataclasses as objects, files and directories as their URI."""
    if isinstance(value, (FlyteFile, FlyteDirectory)):
        return artifact_location(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


def phase_changes(seen: dict[str, str], current: Mapping[str, str]) -> list[str]:
    """Lines for what changed since the last poll; ``seen`` is updated in place."""
    lines = [f"{key}: {phase}" for key, phase in current.items() if seen.get(key) != phase]
    seen.update(current)
    return lines


def _phases(execution: FlyteWorkflowExecution, node_names: Mapping[str, str]) -> dict[str, str]:
    phases = {"execution": WorkflowExecutionPhase.enum_to_string(execution.closure.phase)}
    for node_id, node in sorted(execution.node_executions.items()):
        if node_id not in ("start-node", "end-node"):
            phases[f"  {node_names.get(node_id, node_id)}"] = NodeExecutionPhase.enum_to_string(node.closure.phase)
    return phases


def wait_for(
    remote: FlyteRemote,
    execution: FlyteWorkflowExecution,
    *,
    node_names: Mapping[str, str],
    timeout_s: float,
    poll_s: float,
    report: Report,
    progress: ProgressWatch | None = None,
) -> FlyteWorkflowExecution:
    """Poll until the execution ends, reporting each phase change of it and of its nodes, and while it runs its
    training nodes' progress (``progress``).

    :raises TimeoutError: when it is still running after ``timeout_s``; the execution itself goes on.
    """
    deadline = time.monotonic() + timeout_s
    seen: dict[str, str] = {}
    while True:
        execution = remote.sync_execution(execution, sync_nodes=True)
        for line in phase_changes(seen, _phases(execution, node_names)):
            report(line)
        if execution.is_done:
            return execution
        if progress is not None and seen.get("execution") == "RUNNING":
            progress.poll(execution.id.name)
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"execution {execution.id.name} is still {seen['execution']} after {timeout_s:g} s and keeps running: "
                f"follow it with `python -m deployment.remote wait {execution.id.name}` or at "
                f"{remote.generate_console_url(execution)}"
            )
        time.sleep(poll_s)


def finish(remote: FlyteRemote, execution: FlyteWorkflowExecution, plan: LaunchPlan | None, report: Report) -> int:
    """Report how a finished execution ended and its typed outputs; the exit code."""
    phase = WorkflowExecutionPhase.enum_to_string(execution.closure.phase)
    if not execution.is_successful:
        error = execution.error
        report(f"execution {execution.id.name} {phase}" + (f": {error.message}" if error is not None else ""))
        return EXIT_NOT_SUCCEEDED
    literals = execution.outputs.literals if execution.outputs is not None else {}
    if plan is None:
        report(
            f"execution {execution.id.name} SUCCEEDED; outputs as literals (launched outside deployment.remote's "
            "targets):"
        )
        report(str(literals))
        return 0
    with remote.remote_context() as ctx:
        outputs = typed_outputs(literals, plan.python_interface.outputs, ctx)
    report(f"execution {execution.id.name} SUCCEEDED; outputs:")
    report(json.dumps(jsonable(outputs), indent=2, default=str))
    return 0


def _node_names(plan: LaunchPlan) -> dict[str, str]:
    return {node.id: node.metadata.name for node in getattr(plan.workflow, "nodes", [])}


def launch(
    remote: FlyteRemote,
    name: str,
    *,
    config_path: str | None,
    assignments: Sequence[str],
    project: str,
    domain: str,
    version: str | None,
    report: Report,
) -> FlyteWorkflowExecution:
    """Start target ``name``: its registered launch plan (the latest version unless ``version``), with the fields
    of the YAML file at ``config_path`` on top of that launch plan's default ``config``, and ``NAME=VALUE`` inputs.

    Inputs and the file are checked before FlyteAdmin is contacted.
    """
    plan = local_launch_plan(name)
    values = parse_assignments(plan, assignments, config_path=config_path)
    fields = read_yaml_mapping(config_path, setting="--config") if config_path is not None else None
    registered = remote.fetch_launch_plan(project, domain, plan.name, version)
    with remote.remote_context() as ctx:
        if fields is not None:
            values["config"] = overlay(registered_default(plan, registered.default_inputs, "config", ctx), fields)
        literals = input_literals(plan, values, variables=registered.interface.inputs, ctx=ctx)
    # Literals are passed through as they are: FlyteRemote converts only plain Python values.
    execution = remote.execute(registered, inputs=literals, project=project, domain=domain)
    report(f"launched {plan.name} version {registered.id.version} as {execution.id.name}")
    report(f"console: {remote.generate_console_url(execution)}")
    return execution


def set_active(
    remote: FlyteRemote, name: str, *, active: bool, project: str, domain: str, version: str | None, report: Report
) -> Identifier | None:
    """Activate a launch plan version (the latest unless ``version``), which deactivates the others and starts its
    schedule; or deactivate the given version, else the active one. Returns what changed, None if nothing was active."""
    if active or version is not None:
        plan = remote.fetch_launch_plan(project, domain, name, version)
    else:
        plan = remote.fetch_active_launchplan(project, domain, name)
        if plan is None:
            report(f"{name}: no version is active in {project}/{domain}; nothing to deactivate")
            return None
    if active:
        remote.activate_launchplan(plan.id)
    else:
        remote.deactivate_launchplan(plan.id)
    report(
        f"{name} version {plan.id.version}: {'ACTIVE' if active else 'INACTIVE'} "
        f"({remote.generate_console_url(plan.id)})"
    )
    return plan.id


def _parser() -> argparse.ArgumentParser:
    defaults = TaskConfig.auto()
    parser = argparse.ArgumentParser(prog="python -m deployment.remote", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config-file",
        "-c",
        default=None,
        help="flytekit/flytectl config file (default: FLYTECTL_CONFIG, ~/.flyte/config.yaml)",
    )
    parser.add_argument(
        "--project",
        "-p",
        default=os.getenv("FLYTE_DEFAULT_PROJECT") or defaults.project,
        help="default: FLYTE_DEFAULT_PROJECT or %(default)s",
    )
    parser.add_argument(
        "--domain",
        "-d",
        default=os.getenv("FLYTE_DEFAULT_DOMAIN") or defaults.domain,
        help="default: FLYTE_DEFAULT_DOMAIN or %(default)s",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    register = commands.add_parser("register", help="register a `make package` tarball")
    register.add_argument("package", help="e.g. dist/flyte-package.tgz")
    register.add_argument("--version", default=None, help="default: pkg-<digest of the package's entities>")

    waiting = argparse.ArgumentParser(add_help=False)
    waiting.add_argument(
        "--timeout-s", type=float, default=24 * 3600, help="stop waiting (not the execution) after this long"
    )
    waiting.add_argument("--poll-s", type=float, default=15.0)
    waiting.add_argument(
        "--prometheus-url",
        default=os.getenv(PROMETHEUS_URL_ENV) or None,
        help=f"Prometheus scraping the training metrics, for progress and ETA lines (default: {PROMETHEUS_URL_ENV})",
    )

    start = commands.add_parser("launch", parents=[waiting], help="start a pipeline or launch plan")
    start.add_argument("target", choices=sorted(TARGETS))
    start.add_argument(
        "--config", default=None, help="YAML file of `config` fields to change in the registered launch plan's default"
    )
    start.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other input; JSON for lists, dicts and dataclasses",
    )
    start.add_argument("--version", default=None, help="launch plan version (default: the latest registered)")
    start.add_argument("--wait", action="store_true", help="follow it to the end and print its typed outputs")

    follow = commands.add_parser(
        "wait", aliases=["watch"], parents=[waiting], help="follow an execution to the end and print its outputs"
    )
    follow.add_argument("execution")

    for verb in ("activate", "deactivate"):
        command = commands.add_parser(verb, help=f"{verb} a launch plan's schedule")
        command.add_argument("launch_plan", help="e.g. nightly_training, weekly_tuning")
        command.add_argument(
            "--version", default=None, help="default: the latest (activate) or the active one (deactivate)"
        )
    return parser


def _target_of(launch_plan_name: str) -> str | None:
    return next((name for name, spec in TARGETS.items() if spec.launch_plan == launch_plan_name), None)


def _run(args: argparse.Namespace, remote: FlyteRemote, report: Report) -> int:
    where = {"project": args.project, "domain": args.domain}
    if args.command == "register":
        register_package(remote, args.package, version=args.version, report=report, **where)
        return 0
    if args.command in ("activate", "deactivate"):
        set_active(
            remote, args.launch_plan, active=args.command == "activate", version=args.version, report=report, **where
        )
        return 0
    if args.command == "launch":
        plan = local_launch_plan(args.target)
        execution = launch(
            remote,
            args.target,
            config_path=args.config,
            assignments=args.input,
            version=args.version,
            report=report,
            **where,
        )
        if not args.wait:
            return 0
    else:
        execution = remote.fetch_execution(name=args.execution, **where)
        name = _target_of(execution.spec.launch_plan.name)
        plan = local_launch_plan(name) if name is not None else None
        report(f"console: {remote.generate_console_url(execution)}")
    node_names = _node_names(plan) if plan is not None else {}
    execution = wait_for(
        remote,
        execution,
        node_names=node_names,
        timeout_s=args.timeout_s,
        poll_s=args.poll_s,
        report=report,
        progress=ProgressWatch(args.prometheus_url, report),
    )
    return finish(remote, execution, plan, report)


def _unavailable_cause(exc: BaseException) -> FlyteSystemUnavailableException | None:
    """The "cluster unavailable" error behind ``exc``, if any: some FlyteRemote calls (uploads) wrap it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, FlyteSystemUnavailableException):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    remote = connect(config_file=args.config_file, project=args.project, domain=args.domain)

    # Everything the CLI prints goes through redact: outputs hold configs and URIs, errors quote what they name.
    def report(line: str) -> None:
        print(redact(line), flush=True)

    try:
        return _run(args, remote, report)
    except ValueError as exc:
        print(redact(f"error: {exc}"), file=sys.stderr)
        return EXIT_BAD_INPUT
    except TimeoutError as exc:
        print(redact(f"error: {exc}"), file=sys.stderr)
        return EXIT_TIMEOUT
    except Exception as exc:
        unavailable = _unavailable_cause(exc)
        if unavailable is None:
            raise
        platform = remote.config.platform
        print(
            redact(
                f"error: FlyteAdmin at {platform.endpoint} ({'insecure' if platform.insecure else 'TLS'}) is "
                f"unreachable: {unavailable}\n"
                "Point FLYTE_PLATFORM_URL (and FLYTE_PLATFORM_INSECURE) or --config-file at your cluster; for a local "
                "one, run `flytectl demo start` and use the config file it writes (~/.flyte/config-sandbox.yaml)."
            ),
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())
