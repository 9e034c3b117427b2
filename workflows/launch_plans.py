"""Launch plans: the schedules, defaults, fixed inputs and alerts around the workflows.

Each launch plan's variable name is also its Flyte name, so one name works everywhere:
``pyflyte run workflows/launch_plans.py nightly_training``, FlyteConsole, and
``python -m deployment.remote activate nightly_training``.

Values read from the environment are read when this module is imported, i.e. when the package is
built (``make package``) or registered, and are then baked into the registered launch plan:

- ``SCHEDULED_RUN_ALERT_EMAILS``: comma-separated recipients of the scheduled runs' failure alerts
  (default ``ml-platform-alerts@example.com``).
- ``TRAINING_CORE__<SECTION>__<FIELD>``: overrides of single fields of the nightly default config, the
  same variables :func:`training_core.config.load_config` reads (for example
  ``TRAINING_CORE__TRACKING__TRACKING_URI=http://mlflow.mlflow.svc:5000`` so the nightly registry is a
  shared MLflow server rather than a sqlite file inside the pod).
- ``TUNING__<FIELD>[__<FIELD>]``: the same for the weekly search's default ``TuningConfig``
  (:func:`training_core.tuning.load_tuning_config`), e.g. ``TUNING__BASE__TRACKING__TRACKING_URI``.

A schedule only fires once its launch plan is activated (``deployment.remote activate``): registering a
new version never starts or moves a schedule by itself.
"""

from __future__ import annotations

import os
from typing import Mapping

from flytekit import CronSchedule, Email, LaunchPlan, Workflow, WorkflowExecutionPhase
from flytekit.core.base_task import PythonTask

from training_core.config import load_config
from training_core.tuning import load_tuning_config
from workflows import scaling_benchmark as benchmark
from workflows.training import training_pipeline
from workflows.tuning import tuning_pipeline

ALERT_EMAILS_ENV = "SCHEDULED_RUN_ALERT_EMAILS"
DEFAULT_ALERT_EMAILS = ("ml-platform-alerts@example.com",)
ALERT_PHASES = (WorkflowExecutionPhase.FAILED, WorkflowExecutionPhase.TIMED_OUT, WorkflowExecutionPhase.ABORTED)
# 02:00 UTC (FlyteAdmin's scheduler runs in UTC): after the day's data lands, before people look at results.
NIGHTLY_CRON = "0 2 * * *"
# Saturdays 04:00 UTC: a search fans out many Ray jobs, so it runs when the cluster is otherwise idle and
# after that night's nightly_training has finished.
WEEKLY_CRON = "0 4 * * 6"


def alert_recipients(environ: Mapping[str, str] | None = None) -> list[str]:
    """Recipients from ``SCHEDULED_RUN_ALERT_EMAILS`` (comma-separated), else the documented default.

    :raises ValueError: when the variable is set but holds no address or something that is not an address.
    """
    raw = (os.environ if environ is None else environ).get(ALERT_EMAILS_ENV)
    if raw is None:
        return list(DEFAULT_ALERT_EMAILS)
    recipients = [address.strip() for address in raw.split(",") if address.strip()]
    bad = [address for address in recipients if "@" not in address or any(c.isspace() for c in address)]
    if not recipients or bad:
        raise ValueError(
            f"{ALERT_EMAILS_ENV}={raw!r} is invalid: set it to comma-separated email addresses "
            f"(e.g. 'a@corp.com,b@corp.com'), or unset it for the default {DEFAULT_ALERT_EMAILS[0]}"
            + (f"; not addresses: {', '.join(bad)}" if bad else "")
        )
    return recipients


def workflow_around(task: PythonTask, name: str) -> Workflow:
    """A one-node workflow with ``task``'s inputs and outputs: a launch plan must point at a workflow, and a
    ``@dynamic`` is a task. The interface is the task's own, so it cannot drift from it."""
    wrapper = Workflow(name=name)
    for input_name, python_type in task.python_interface.inputs.items():
        wrapper.add_workflow_input(input_name, python_type)
    node = wrapper.add_entity(
        task, **{input_name: wrapper.inputs[input_name] for input_name in task.python_interface.inputs}
    )
    for output_name in task.python_interface.outputs:
        wrapper.add_workflow_output(output_name, node.outputs[output_name])
    return wrapper


# Nightly retraining always starts from scratch on fresh data: continuing an earlier checkpoint is a
# deliberate, manual run of training_pipeline, so resume_from is fixed rather than defaulted.
nightly_training = LaunchPlan.get_or_create(
    training_pipeline,
    name="nightly_training",
    default_inputs={"config": load_config()},
    fixed_inputs={"resume_from": None},
    schedule=CronSchedule(schedule=NIGHTLY_CRON),
    notifications=[Email(phases=list(ALERT_PHASES), recipients_email=alert_recipients())],
)

weekly_tuning = LaunchPlan.get_or_create(
    tuning_pipeline,
    name="weekly_tuning",
    default_inputs={"config": load_tuning_config()},
    schedule=CronSchedule(schedule=WEEKLY_CRON),
    notifications=[Email(phases=list(ALERT_PHASES), recipients_email=alert_recipients())],
)

# On demand only: a benchmark measures the cluster when someone asks, with the task's own defaults.
scaling_benchmark_workflow = workflow_around(
    benchmark.scaling_benchmark, "workflows.launch_plans.scaling_benchmark_workflow"
)
scaling_benchmark = LaunchPlan.get_or_create(
    scaling_benchmark_workflow,
    name="scaling_benchmark",
    default_inputs=benchmark.scaling_benchmark.python_interface.default_inputs_as_kwargs,
)
