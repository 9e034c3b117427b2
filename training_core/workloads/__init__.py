"""The workload seam: what varies between a ResNet on images, a GPT on text and a user's MLP on a table.

A :class:`Workload` prepares its data into shards (:func:`training_core.data.write_prepared`), builds the model
for the prepared data, turns raw samples into device tensors, turns a batch into a loss plus additive sums, and
names its metrics with one primary metric and its direction. Everything else (the loop, DDP, AMP, accumulation,
clipping, schedules, checkpoints and exact resume, telemetry, MLflow, the Flyte tasks, tuning and scaling) is
shared by every workload.

``workload.name`` in the config selects one: a built-in name (:data:`training_core.registry.WORKLOADS`) or the import
path ``package.module:attribute`` of a callable that takes no arguments and returns a workload (a class is one). A
built-in workload also takes a user model factory (``workload.model_factory``) or dataset source
(``workload.dataset_source``). :func:`resolve_workload` imports and checks all of them, so a bad path fails in the
driver before any worker starts, naming the field, the value and the fix; :func:`preflight` then runs a user
workload once on a batch there. Inside the workers, what user code raises is a
:class:`~training_core.train.failures.UserCodeError` naming it, which neither Ray Train nor Flyte retries.

This package's names live in :mod:`~training_core.workloads.protocol` (the protocol and what it returns),
:mod:`~training_core.workloads.user_code` (calling user code) and :mod:`~training_core.workloads.resolve` (choosing
and checking the workload); those that users and the platform import are re-exported here, the path to import them
from.
"""

from training_core.workloads.protocol import LossOutput, Workload, mean_of, to_device_async
from training_core.workloads.resolve import check_params, code_paths, preflight, prep_uses_ray, resolve_workload
from training_core.workloads.user_code import UserWorkload

__all__ = [
    "LossOutput",
    "UserWorkload",
    "Workload",
    "check_params",
    "code_paths",
    "mean_of",
    "preflight",
    "prep_uses_ray",
    "resolve_workload",
    "to_device_async",
]
