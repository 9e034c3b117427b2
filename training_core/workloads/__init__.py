"""The workload seam: what varies between a ResNet on images, a GPT on text and a user's MLP on a table.

A :class:`Workload` prepares its data into shards (:func:`training_core.data.write_prepared`), builds the model
for the prepared data, turns raw samples into device tensors, turns a batch into a loss plus additive sums, and
names its metrics with one primary metric and its direction. Everything else (the loop, DDP, AMP, accumulation,
clipping, schedules, checkpoints and exact resume, telemetry, MLflow, the Flyte tasks, tuning and scaling) is
shared by every workload.

``workload.name`` in the config selects one: a built-in name (:data:`BUILT_IN`) or the import path
``package.module:attribute`` of a callable that takes no arguments and returns a workload (a class is one). A
built-in workload also takes a user model factory (``workload.model_factory``) or dataset source
(``workload.dataset_source``). :func:`resolve_workload` imports and checks all of them, so a bad path fails in the
driver before any worker starts, naming the field, the value and the fix; :func:`preflight` then runs a user
workload once on a batch there. Inside the workers, what user code raises is a
:class:`~training_core.failures.UserCodeError` naming it, which neither Ray Train nor Flyte retries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn, Protocol, runtime_checkable

from training_core.config import IMPORT_PATH_FIX, DataConfig, TrainingConfig, WorkloadConfig, is_import_path
from training_core.failures import UserCodeError, blames_user_code
from training_core.messages import clip, invalid, quote

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn

    from training_core.prepared import Manifest

BUILT_IN = ("image_classification", "causal_lm")
PREFLIGHT_BATCH_SAMPLES = 8
"""At most this many samples make the batch :func:`preflight` runs a user workload on, on the driver's CPU: enough
for batch statistics, small enough for the driver pod's CPU and memory."""
EXIT_FIX = (
    "exit the process and parse the command line (argparse) only under `if __name__ == '__main__':`, never at import "
    "or in code the platform calls"
)
ENCODED_SOURCES = ("cifar10", "image_folder")
"""Sources prepared as encoded images in Parquet shards by Ray tasks (:mod:`training_core.image_shards`)."""


def prep_uses_ray(data: DataConfig, workload: WorkloadConfig) -> bool:
    """Whether prep of ``data`` runs on a Ray cluster: the built-in image workload on an encoded source (a Ray
    task per shard) and the built-in ``causal_lm`` on its text sources (tokenised in Ray tasks). A user's
    ``workload.dataset_source``, ``digits`` and ``synthetic`` prepare in their own process."""
    if workload.dataset_source:
        return False
    if workload.name == "image_classification":
        return data.dataset in ENCODED_SOURCES
    return workload.name == "causal_lm"


@dataclass
class LossOutput:
    """What a workload makes of one training batch."""

    loss: torch.Tensor
    """0-dim mean loss over the batch's units (samples, tokens): what ``backward`` runs on."""
    sums: dict[str, torch.Tensor]
    """Additive 0-dim figures of the batch (``correct``, ``samples``, ``tokens``...), summed over micro-batches,
    steps and ranks by the loop and turned into metrics by :meth:`Workload.metrics`."""
    num_samples: int
    """Samples in the batch (what samples/s counts)."""
    num_tokens: int = 0
    """Tokens in the batch (what tokens/s counts); 0 for a workload without tokens. Known on the host, so counting
    it never waits for the device."""


@runtime_checkable
class Workload(Protocol):
    """A model family with its data and objective. Methods run on every rank; none may keep per-batch state."""

    name: str
    """Shown in logs, records and checkpoints."""
    primary_metric: str
    """The evaluation metric that ranks models and gates registration: a key of :meth:`metrics`."""
    primary_mode: str
    """``max`` when higher ``primary_metric`` is better (accuracy), ``min`` when lower is (perplexity, loss)."""

    def prepare_data(self, data: DataConfig, out_dir: str) -> Manifest:
        """Read the raw data ``data`` names, split it, and write shards and the manifest to ``out_dir`` (through
        :func:`training_core.data.write_prepared`)."""
        ...

    def check(self, config: TrainingConfig, manifest: Manifest) -> None:
        """Raise ``ValueError`` naming the field when ``config`` cannot train on ``manifest`` (runs in the driver,
        before any worker starts)."""
        ...

    def build_model(self, config: TrainingConfig, manifest: Manifest) -> nn.Module:
        """A randomly initialised model for the prepared data (the loop seeds the RNGs first)."""
        ...

    def to_device(self, manifest: Manifest, device: torch.device) -> Callable[[Mapping[str, np.ndarray]], Any]:
        """A function from a batch of stored arrays (name -> array, first axis the samples) to what
        :meth:`loss` and :meth:`eval_sums` take, on ``device``."""
        ...

    def loss(self, model: nn.Module, batch: Any) -> LossOutput:
        """Forward ``batch`` through ``model`` (possibly a DDP wrapper: call it, not its ``module``)."""
        ...

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Additive evaluation figures of one batch (any shape: a confusion matrix is one), under ``no_grad``.
        Must include ``loss_sum`` and the count the loss is averaged over."""
        ...

    def metrics(self, sums: Mapping[str, Any]) -> dict[str, float]:
        """Metrics from summed figures: those of :meth:`loss` (a training window) or of :meth:`eval_sums`
        (always with ``loss`` and ``primary_metric``). ``accuracy``, when there is one, is what records call
        accuracy."""
        ...

    def example_input(self, manifest: Manifest) -> np.ndarray:
        """A small batch of model input, for the MLflow signature."""
        ...


def load_attribute(field: str, path: str) -> Any:
    """The object ``package.module:attribute`` names, or ``ValueError`` naming ``field``, ``path`` and the fix: a
    :class:`~training_core.failures.UserCodeError` when the module does not import or lacks the attribute (in a
    worker whose image lacks the package, too, a restart would meet it again)."""
    if not is_import_path(path):
        invalid(field, path, IMPORT_PATH_FIX)
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (SystemExit, KeyboardInterrupt) as exc:  # raised by the module: the user's, like any other error
        raise UserCodeError(
            f"{field}={quote(path)} is invalid: module {module_name!r} raised {raised(exc)} at import; {EXIT_FIX}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any import failure of user code is the user's to fix
        raise UserCodeError(
            f"{field}={quote(path)} is invalid: module {module_name!r} does not import ({type(exc).__name__}: "
            f"{clip(str(exc))}); make the package importable where the task runs (installed in the image, in the "
            f"fast-registration tarball, or on PYTHONPATH; sys.path starts {clip(str(sys.path[:3]))})"
        ) from None
    if not hasattr(module, attribute):
        public = sorted(name for name in vars(module) if not name.startswith("_"))
        raise UserCodeError(
            f"{field}={quote(path)} is invalid: module {module_name!r} has no attribute {attribute!r}; name one it "
            f"has after the ':' ({clip(', '.join(public) or 'it has no public names')})"
        )
    found = getattr(module, attribute)
    if not callable(found):
        invalid(field, path, f"{module_name}.{attribute} is a {type(found).__name__}, not callable; name a factory")
    return found


def load_optional(field: str, path: str) -> Any:
    """:func:`load_attribute` of ``path``, or ``None`` when it is empty (the built-in is used)."""
    return load_attribute(field, path) if path else None


_PROTOCOL_METHODS = ("prepare_data", "check", "build_model", "to_device", "loss", "eval_sums", "metrics")
_PROTOCOL_ATTRIBUTES = ("name", "primary_metric", "primary_mode")


def check_workload(field: str, path: str, workload: Any) -> Workload:
    """``workload`` when it has every attribute and method of :class:`Workload`, else ``ValueError`` naming what
    is missing."""
    missing = [a for a in _PROTOCOL_ATTRIBUTES if not hasattr(workload, a)]
    missing += [f"{m}()" for m in (*_PROTOCOL_METHODS, "example_input") if not callable(getattr(workload, m, None))]
    if missing:
        raise ValueError(
            f"{field}={quote(path)} is invalid: it returned a {type(workload).__name__}, which is not a workload: it "
            f"lacks {', '.join(missing)}; implement the training_core.workloads.Workload protocol"
        )
    if getattr(workload, "primary_mode", None) not in ("max", "min"):
        invalid(f"{field} (its primary_mode)", workload.primary_mode, "it must be 'max' or 'min'")
    if not isinstance(workload.primary_metric, str) or not workload.primary_metric:
        invalid(f"{field} (its primary_metric)", workload.primary_metric, "it must name a metric, e.g. 'accuracy'")
    return workload


def resolve_workload(selected: WorkloadConfig) -> Workload:
    """The workload ``selected`` (a config's ``workload``) names, built and checked. User code is imported here:
    the drivers call it before any worker starts."""
    if selected.name == "image_classification":
        from training_core.workloads.image import ImageClassification

        return ImageClassification(selected)
    if selected.name == "causal_lm":
        from training_core.workloads.causal_lm import CausalLM

        return CausalLM(selected)
    factory = load_attribute("workload.name", selected.name)
    if not signature_accepts(factory, 0) and not takes_params(factory):
        invalid("workload.name", selected.name, "it must be callable with no arguments (a class or a factory)")
    params = factory_params(selected, factory)
    workload = call_with_params("workload.name", selected.name, factory, params)
    if getattr(factory, "params_type", None) is None and getattr(workload, "params_type", None) is not None:
        params = typed_params(selected, workload.params_type)  # declared by the instance a factory function built
    workload = check_workload("workload.name", selected.name, workload)
    try:
        workload.params = params
    except AttributeError as exc:  # a read-only property or __slots__ without it
        invalid("workload.name", selected.name, f"its workload cannot take a params attribute ({exc}); let it")
    return UserWorkload(workload, selected.name)


def check_params(selected: WorkloadConfig) -> None:
    """Check ``workload.params`` against every ``params_type`` the user code ``selected`` names declares (the
    workload's, the model factory's, the dataset source's): ``ValueError`` naming the field, the value and the fix."""
    resolve_workload(selected)
    for field, path in (
        ("workload.model_factory", selected.model_factory),
        ("workload.dataset_source", selected.dataset_source),
    ):
        if path:
            factory_params(selected, load_attribute(field, path))


def takes_params(factory: Callable[..., Any]) -> bool:
    """Whether ``factory`` has a parameter named ``params`` that can be passed by keyword: such a factory is given
    ``workload.params`` (the others keep the signature they had before params existed)."""
    try:
        parameter = inspect.signature(factory).parameters.get("params")
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def call_with_params(field: str, path: str, factory: Callable[..., Any], params: Any, *args: Any) -> Any:
    """:func:`call_user` of ``factory(*args)``, with ``params=params`` when it takes them (:func:`takes_params`)."""
    if takes_params(factory):
        return call_user(field, path, functools.partial(factory, params=params), *args)
    return call_user(field, path, factory, *args)


def factory_params(selected: WorkloadConfig, factory: Any) -> Any:
    """``workload.params`` as ``factory`` takes them: an instance of the dataclass it declares as ``params_type``
    (a class attribute, or an attribute of a factory function), else the mapping."""
    params_type = getattr(factory, "params_type", None)
    return dict(selected.params) if params_type is None else typed_params(selected, params_type)


def typed_params(selected: WorkloadConfig, params_type: Any) -> Any:
    """``workload.params`` as an instance of the user's dataclass ``params_type``: each name must be one of its
    fields, each value of the field's type (an int where a float is declared is taken as a float), and what the
    dataclass itself refuses (a ``ValueError``, ``TypeError`` or ``AssertionError`` of its ``__post_init__``)
    is reported as a config error: the field, the value and the fix, before any worker starts."""
    where = f"{selected.name} (its params_type)"
    if not isinstance(params_type, type) or not dataclasses.is_dataclass(params_type):
        invalid(where, params_type, "name a dataclass (the class itself) as params_type, or none for a plain mapping")
    kind = params_type.__name__
    fields = {f.name: f for f in dataclasses.fields(params_type) if f.init}
    hints = user_type_hints(where, params_type)
    values = {}
    for key, value in selected.params.items():
        if key not in fields:
            invalid(
                f"workload.params.{key}",
                value,
                f"{kind} has no field {key!r}; use one of its fields ({clip(', '.join(fields) or 'none')}) or add it",
            )
        values[key] = param_value(f"workload.params.{key}", value, hints.get(key, Any), f"{kind}.{key}")
    required = [
        name
        for name, f in fields.items()
        if name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if required:
        invalid(
            "workload.params",
            selected.params,
            f"{kind} requires {', '.join(required)}: set workload.params.{required[0]}",
        )
    try:
        return params_type(**values)
    except (ValueError, TypeError, AssertionError) as exc:
        invalid("workload.params", selected.params, f"{kind} refused it ({raised(exc)}); fix the value it names")
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 - user code: name it
        if not blames_user_code(exc):
            raise
        raise UserCodeError(f"workload.params: building {kind} raised {raised(exc)}; fix {kind}") from None


def user_type_hints(where: str, params_type: type) -> dict[str, Any]:
    """The resolved annotations of the user's ``params_type``; ``ValueError`` naming it when they do not resolve."""
    import typing

    try:
        return typing.get_type_hints(params_type)
    except Exception as exc:  # noqa: BLE001 - an annotation naming what its module lacks is the user's to fix
        invalid(where, params_type, f"its annotations do not resolve ({raised(exc)}); import what they name")


def param_value(path: str, value: Any, hint: Any, declared: str) -> Any:
    """``value`` when it has the declared ``hint`` (bool, int, float, str, list, dict, ``X | None``; other hints
    are the dataclass's to check), else ``ValueError`` naming ``path``, the value and the declared type."""
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return param_value(path, value, options[0], declared)
        return value
    simple = {bool: (bool,), int: (int,), float: (int, float), str: (str,), list: (list,), dict: (dict,)}
    expected = simple.get(origin or hint)
    if expected is None:
        return value
    if not isinstance(value, expected) or (hint is not bool and isinstance(value, bool)):
        name = getattr(hint, "__name__", None) if origin is None else str(hint)
        invalid(path, value, f"{declared} is declared {name or hint}: give a value of that type")
    return float(value) if hint is float else value


def preflight(config: TrainingConfig, data_dir: str) -> Workload:
    """Resolve the workload and check ``config`` against the prepared data in ``data_dir``: what the drivers run
    before any worker starts, so user code that does not import, a model that does not fit the data or a bad
    field fails here, in seconds, naming the field."""
    from training_core.prepared import Manifest

    workload = resolve_workload(config.workload)
    manifest = Manifest.load(data_dir)
    if manifest.workload != workload.name and manifest.workload in BUILT_IN + (config.workload.name,):
        raise ValueError(
            f"workload.name={quote(config.workload.name)} trains a {workload.name} workload, but the data at "
            f"{quote(data_dir)} was prepared by {manifest.workload!r}; prepare the data with the same workload"
        )
    workload.check(config, manifest)
    if config.scaling.strategy == "fsdp":
        from training_core.sharding import require_blocks

        require_blocks(config, manifest, workload)
    elif isinstance(workload, UserWorkload):  # an FSDP model is one too large for this process: built on meta above
        run_on_a_batch(config, manifest, workload)
    return workload


def run_on_a_batch(config: TrainingConfig, manifest: Manifest, workload: UserWorkload) -> None:
    """Run a user workload once, in this process on the CPU, on one small batch of the prepared training split (at
    most :data:`PREFLIGHT_BATCH_SAMPLES` samples), as a worker's step and validation do: ``build_model``,
    ``to_device``, ``loss`` and ``eval_sums``, then ``metrics`` of the evaluation figures. An error of its code or a
    result that breaks the protocol (a ``loss`` that returns a float, a ``build_model`` that returns ``None``) raises
    :class:`~training_core.failures.UserCodeError` naming the field here, before any worker starts, rather than on
    every rank. No backward pass and no optimizer step: the batch costs the driver a forward or two."""
    import torch

    from training_core.eval_sums import evaluate
    from training_core.prepared import ShardStream

    cpu = torch.device("cpu")
    size = min(PREFLIGHT_BATCH_SAMPLES, config.loop.batch_size or PREFLIGHT_BATCH_SAMPLES)
    stream = ShardStream(manifest, "train", rank=0, world_size=1, data=config.data)
    with contextlib.closing(stream.eval_batches(batch_size=size)) as batches:
        arrays = next(batches)
    model = workload.build_model(config, manifest).train()
    to_device = workload.to_device(manifest, cpu)
    workload.loss(model, to_device(arrays))
    metrics = evaluate(model, [arrays], workload=workload, to_device=to_device, device=cpu).metrics
    missing = [name for name in ("loss", workload.primary_metric) if name not in metrics]
    if missing:
        workload.wrong(
            "metrics",
            metrics,
            f"which lacks {', '.join(map(repr, missing))} of the evaluation figures: it must have "
            "'loss' and the primary_metric",
        )


def code_paths(selected: WorkloadConfig) -> list[str]:
    """The ``sys.path`` entries the user modules ``selected`` names were imported from (after
    :func:`resolve_workload` imported them); empty for built-ins."""
    found = []
    for path in (selected.name, selected.model_factory, selected.dataset_source):
        if not path or path in BUILT_IN:
            continue
        module_name = path.partition(":")[0]
        module = sys.modules.get(module_name)
        file = getattr(module, "__file__", None)
        if not file:
            continue
        root = os.path.dirname(os.path.abspath(file))
        for _ in range(module_name.count(".") + (1 if os.path.basename(file) == "__init__.py" else 0)):
            root = os.path.dirname(root)
        if root not in found:
            found.append(root)
    return found


def call_user(field: str, path: str, factory: Callable[..., Any], *args: Any) -> Any:
    """Call a user factory; what its code raises (``SystemExit`` too) becomes a
    :class:`~training_core.failures.UserCodeError` naming the field and its value, except a ``ValueError``, which
    keeps its message (it names what is wrong). Infrastructure failures and running out of memory pass through
    (:func:`~training_core.failures.blames_user_code`)."""
    try:
        return factory(*args)
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 - user code: name it and what it raised
        if not blames_user_code(exc):
            raise
        if isinstance(exc, ValueError):
            raise UserCodeError(str(exc)) from exc
        raise UserCodeError(f"{field}={quote(path)} raised {raised(exc)}; fix the factory") from None


def raised(exc: BaseException) -> str:
    """What user code raised, for a message: its type and message, or for a ``SystemExit`` its code and why."""
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}): it exits the process (sys.exit(), or an argparse parser's error)"
    return f"{type(exc).__name__}: {clip(str(exc))}"


class UserWorkload:
    """A user's workload (``workload.name`` an import path), each call of its protocol's methods named: what its code
    raises, and a result that breaks the protocol, become a :class:`~training_core.failures.UserCodeError` naming the
    field, the method and the fix (in a worker, neither Ray Train nor Flyte retries one). Infrastructure failures met
    inside it and out-of-memory errors pass through (:func:`~training_core.failures.blames_user_code`), and so do the
    ``ValueError`` its ``prepare_data`` and ``check`` raise (they name the field). Anything else, ``name``,
    ``blocks(model)``..., is the workload's own."""

    def __init__(self, workload: Workload, path: str) -> None:
        self.workload = workload
        self.path = path
        """The ``workload.name`` that names it."""

    def __getattr__(self, name: str) -> Any:
        if name in ("workload", "path"):  # not set yet: an instance being copied or unpickled
            raise AttributeError(name)
        return getattr(self.workload, name)

    def call(self, method: str, function: Callable[..., Any], *args: Any, keep_value_errors: bool = False) -> Any:
        """``function(*args)``, what it raises named as ``method``'s."""
        try:
            return function(*args)
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 - user code: name it
            if not blames_user_code(exc) or (keep_value_errors and isinstance(exc, ValueError)):
                raise
            raise UserCodeError(
                f"workload.name={quote(self.path)} failed in its {method}: {raised(exc)}; fix the workload's {method}"
            ) from exc

    def wrong(self, method: str, result: Any, problem: str) -> NoReturn:
        """Raise the error of ``method`` returning ``result``, which breaks the protocol as ``problem`` says."""
        raise UserCodeError(
            f"workload.name={quote(self.path)}: its {method}() returned a {type(result).__name__}, {problem}; see the "
            f"training_core.workloads.Workload protocol"
        )

    def prepare_data(self, data: DataConfig, out_dir: str) -> Manifest:
        return self.call("prepare_data()", self.workload.prepare_data, data, out_dir, keep_value_errors=True)

    def check(self, config: TrainingConfig, manifest: Manifest) -> None:
        self.call("check()", self.workload.check, config, manifest, keep_value_errors=True)

    def build_model(self, config: TrainingConfig, manifest: Manifest) -> nn.Module:
        from torch import nn

        model = self.call("build_model()", self.workload.build_model, config, manifest)
        if not isinstance(model, nn.Module):
            self.wrong("build_model", model, "not a torch.nn.Module")
        if next(model.parameters(), None) is None:
            self.wrong("build_model", model, "a module without parameters: there is nothing to train")
        return model

    def to_device(self, manifest: Manifest, device: torch.device) -> Callable[[Mapping[str, np.ndarray]], Any]:
        convert = self.call("to_device()", self.workload.to_device, manifest, device)
        if not callable(convert):
            self.wrong("to_device", convert, "not a function from a batch of arrays to what loss() takes")
        return lambda arrays: self.call("to_device()'s function", convert, arrays)

    def loss(self, model: nn.Module, batch: Any) -> LossOutput:
        import torch

        output = self.call("loss()", self.workload.loss, model, batch)
        if not all(hasattr(output, name) for name in ("loss", "sums", "num_samples")):
            self.wrong("loss", output, "not a training_core.workloads.LossOutput")
        loss = output.loss
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            found = (
                f"a {tuple(loss.shape)} tensor of {loss.dtype}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
            self.wrong("loss", output, f"whose loss is {found}: it must be a 0-dim floating-point tensor")
        if not loss.requires_grad:
            self.wrong(
                "loss", output, "whose loss does not require grad: compute it from the model's output, not detached"
            )
        self.require_tensors("loss", output, output.sums, "whose sums")
        return output

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        sums = self.call("eval_sums()", self.workload.eval_sums, model, batch)
        self.require_tensors("eval_sums", sums, sums, "which")
        if "loss_sum" not in sums:
            self.wrong("eval_sums", sums, "without 'loss_sum': it must include the summed loss and its count")
        return sums

    def require_tensors(self, method: str, result: Any, sums: Any, which: str) -> None:
        import torch

        if not isinstance(sums, Mapping) or not all(isinstance(v, torch.Tensor) for v in sums.values()):
            self.wrong(method, result, f"{which} must map names to tensors")

    def metrics(self, sums: Mapping[str, Any]) -> dict[str, float]:
        return self.call("metrics()", self.workload.metrics, sums)

    def example_input(self, manifest: Manifest) -> np.ndarray:
        return self.call("example_input()", self.workload.example_input, manifest)


def signature_accepts(factory: Callable[..., Any], count: int) -> bool:
    """Whether ``factory`` can be called with ``count`` positional arguments."""
    try:
        inspect.signature(factory).bind(*range(count))
    except TypeError:
        return False
    except ValueError:  # builtins without a signature
        return True
    return True


def to_device_async(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device``. On a GPU the host copy is pinned first, so the copy is asynchronous and overlaps the
    step's kernels (a copy from pageable memory blocks); elsewhere it is a zero-copy view."""
    import torch

    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def mean_of(sums: Mapping[str, Any], numerator: str, denominator: str) -> float:
    """``sums[numerator] / sums[denominator]``, NaN when either is missing or the count is 0."""
    if numerator not in sums or denominator not in sums or not float(sums[denominator]):
        return math.nan
    return float(sums[numerator]) / float(sums[denominator])
