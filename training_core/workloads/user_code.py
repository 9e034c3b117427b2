"""Calling user code: importing what ``package.module:attribute`` names (:func:`load_attribute`), calling it with
``workload.params`` typed by the ``params_type`` it declares (:func:`call_with_params`), and :class:`UserWorkload`,
which names each call of a user workload. What user code raises, or a result that breaks the protocol, becomes a
:class:`~training_core.train.failures.UserCodeError` naming the field, which neither Ray Train nor Flyte retries."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn

from training_core.config import IMPORT_PATH_FIX, DataConfig, TrainingConfig, WorkloadConfig, is_import_path
from training_core.messages import clip, invalid, quote
from training_core.train.failures import UserCodeError, blames_user_code
from training_core.workloads.protocol import LossOutput, Workload

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn

    from training_core.data.prepared import Manifest


def load_attribute(field: str, path: str) -> Any:
    """The object ``package.module:attribute`` names, or ``ValueError`` naming ``field``, ``path`` and the fix: a
    :class:`~training_core.train.failures.UserCodeError` when the module does not import or lacks the attribute (in a
    worker whose image lacks the package, too, a restart would meet it again)."""
    if not is_import_path(path):
        invalid(field, path, IMPORT_PATH_FIX)
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (SystemExit, KeyboardInterrupt) as exc:  # raised by the module: the user's, like any other error
        raise UserCodeError(
            f"{field}={quote(path)} is invalid: module {module_name!r} raised {raised(exc)} at import; exit the "
            "process and parse the command line (argparse) only under `if __name__ == '__main__':`, never at import "
            "or in code the platform calls"
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


def call_configured(selected: WorkloadConfig, field: str, factory: Callable[..., Any], *args: Any) -> Any:
    """:func:`call_with_params` of ``factory``, which ``selected``'s ``field`` (``model_factory`` or
    ``dataset_source``) names, with ``workload.params`` as it takes them (:func:`factory_params`)."""
    path = getattr(selected, field)
    return call_with_params(f"workload.{field}", path, factory, factory_params(selected, factory), *args)


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


def call_user(field: str, path: str, factory: Callable[..., Any], *args: Any) -> Any:
    """Call a user factory; what its code raises (``SystemExit`` too) becomes a
    :class:`~training_core.train.failures.UserCodeError` naming the field and its value, except a ``ValueError``, which
    keeps its message (it names what is wrong). Infrastructure failures and running out of memory pass through
    (:func:`~training_core.train.failures.blames_user_code`)."""
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
    """A user's workload (``workload.name`` an import path), each call of its protocol's methods named: the error
    (see the module docstring) names the method and the fix. Infrastructure failures and out-of-memory errors pass
    through (:func:`~training_core.train.failures.blames_user_code`), and so do the ``ValueError`` its
    ``prepare_data`` and ``check`` raise (they name the field). Anything else (``name``, ``blocks(model)``...) is the
    workload's own."""

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
