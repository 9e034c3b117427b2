"""The one schema layer for what training_core reads: pydantic 2 validates the package's dataclasses as they are.

:func:`check` runs a cached pydantic validator of a dataclass: unknown keys are refused, each field gets its type,
and the dataclass's own ``__post_init__`` checks run. Two modes:

- ``lax`` (config files and ``TRAINING_CORE__*`` overrides): numbers and booleans are read as the config always
  read them (a string ``"3"`` is an int, ``"yes"`` is true; ``1`` is not a boolean, ``2.5`` not an int, ``inf`` not a
  float, and ints stay within int64). Everything else is strict.
- strict (what we wrote to disk: checkpoint metadata, manifests): a string where an int belongs is refused.

A failure raises :class:`SchemaError` of :class:`Problem`\\ s, from which each reader words its message. pydantic is
imported only inside functions, so importing a module that uses this one stays light.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

from training_core.messages import clip

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Range of every int config field: counts, steps and sizes reach torch and numpy as int64."""


class Fix(ValueError):
    """A value rule's refusal: what to write instead. The layer adds the field and the value."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the input, as pydantic found it."""

    path: str
    """The field's dotted path (``loop.epochs``, ``scaling.gpu_tolerations[0].key``; ``""`` for the whole input)."""
    value: Any
    """The bad value (for an unknown key, its value)."""
    kind: str
    """pydantic's error type (``extra_forbidden``, ``missing``, ``string_type``, ``value_error``, ...)."""
    fix: str
    """What to write instead: a rule's :class:`Fix`, else pydantic's own words."""
    error: BaseException | None = None
    """The exception a dataclass's own check (``__post_init__``) raised: readers re-raise it as it is."""
    key: Any = None
    """The unknown key (``kind`` in :data:`UNKNOWN_KEY_KINDS`)."""
    fields: tuple[str, ...] = ()
    """For an unknown or missing key, or a value that is not an object: the fields its dataclass has."""
    loc: tuple = ()
    """pydantic's location of the problem (keys and indices), for readers that word the path their own way."""


class SchemaError(ValueError):
    """The input does not fit the schema: :attr:`problems`, in pydantic's order."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(problems[0].fix)
        self.problems = problems


@dataclass(frozen=True)
class Rule:
    """``Annotated`` metadata of a field whose check is more than its type (``Annotated[int, Rule(is_count, "an
    integer >= 0")]``): ``is_valid`` decides alone, and ``expected`` is what messages say the field holds. With
    ``keep_type`` the rule decides first and the type's own validation follows (``Annotated[list[Dim], Rule(...,
    keep_type=True)]`` checks the list, then each item). ``fix`` words a refusal that is not ``expected ...``."""

    is_valid: Callable[[Any], bool]
    expected: str
    fix: str = ""
    keep_type: bool = False

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        if self.keep_type:
            return core_schema.no_info_before_validator_function(self.checked, handler(source))
        return core_schema.no_info_plain_validator_function(self.checked)

    def checked(self, value: Any) -> Any:
        if not self.is_valid(value):
            raise Fix(self.fix or f"expected {self.expected}")
        return value


_SCALARS = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def describe(hint: Any) -> str:
    """What a value of the type ``hint`` is, in the words of a message: ``a list of strings``, ``a number or null``,
    a :class:`Rule`'s ``expected``."""
    rule = next((item for item in getattr(hint, "__metadata__", ()) if isinstance(item, Rule)), None)
    if rule is not None:
        return rule.expected
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return f"{describe(_options(hint)[0])} or null"
    if origin is list:
        return f"a list of {_plural(describe(args[0]))}"
    if origin is dict:
        return "a JSON object" if args[1] is Any else f"an object of {_plural(describe(args[1]))}"
    return _SCALARS.get(hint, f"a {getattr(hint, '__name__', hint)}")


def _plural(phrase: str) -> str:
    """``a string`` -> ``strings``, ``an integer >= 0`` -> ``integers >= 0``."""
    _, noun, *rest = phrase.split(" ")
    return " ".join([f"{noun}s", *rest])


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int read from JSON (not ``true``/``false``, which Python counts as ints)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: Any) -> bool:
    return is_int(value) and value >= 0


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_mapping(value: Any) -> bool:
    return isinstance(value, dict)


Count = typing.Annotated[int, Rule(is_count, "an integer >= 0")]
"""An int field read from disk that counts something: JSON's integers >= 0, never ``true``."""


def lax_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise Fix("expected true or false")


def lax_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise Fix("expected a number (int)")
    if isinstance(value, float) and not math.isfinite(value):
        raise Fix("expected a finite whole number (int)")
    try:
        number = int(value)
    except ValueError:
        raise Fix("expected a number (int)") from None
    if not isinstance(value, str) and number != value:
        raise Fix("expected a whole number")
    if not INT64_MIN <= number <= INT64_MAX:
        raise Fix("expected a whole number in [-2**63, 2**63 - 1] (int64)")
    return number


def lax_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise Fix("expected a number (float)")
    try:
        number = float(value)
    except ValueError:
        raise Fix("expected a number (float)") from None
    except OverflowError:  # an int beyond any float
        number = math.inf
    if not math.isfinite(number):
        raise Fix("expected a finite number (float), not inf or nan")
    return number


_LAX_RULES: dict[str, Callable[[Any], Any]] = {"bool": lax_bool, "int": lax_int, "float": lax_float}
_STRICT_TYPES = ("bool", "int", "float", "str", "list", "dict")
_NESTED_KEYS = ("schema", "items_schema", "keys_schema", "values_schema", "fields", "definitions", "choices")


def _rewritten(node: Any, *, lax: bool) -> Any:
    """pydantic's core schema ``node`` with unknown keys refused in every dataclass, every value strict and, when
    ``lax``, each bool, int and float read by the config's rule first (:data:`_LAX_RULES`)."""
    if isinstance(node, list):
        return [_rewritten(item, lax=lax) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _rewritten(value, lax=lax) if key in _NESTED_KEYS else value for key, value in node.items()}
    if node.get("type") == "dataclass-args":
        node["extra_behavior"] = "forbid"
    if node.get("type") in _STRICT_TYPES:  # strict per value: a strict dataclass would take only its instances
        node["strict"] = True
    if lax and node.get("type") in _LAX_RULES:
        rule = _LAX_RULES[node["type"]]
        return {"type": "function-before", "function": {"type": "no-info", "function": rule}, "schema": node}
    return node


@functools.cache
def validator(cls: type, *, lax: bool) -> Any:
    """The cached pydantic validator of ``cls`` (see :func:`_rewritten`)."""
    import pydantic
    import pydantic_core

    core_schema = pydantic.TypeAdapter(cls).core_schema
    return pydantic_core.SchemaValidator(_rewritten(core_schema, lax=lax))


def check(cls: type, raw: Any, *, lax: bool = False) -> Any:
    """``raw`` validated as ``cls`` (a dataclass, or a type such as ``dict[str, int]``), or :class:`SchemaError`."""
    import pydantic_core

    try:
        return validator(cls, lax=lax).validate_python(raw)
    except pydantic_core.ValidationError as exc:
        raise SchemaError([_problem(cls, error) for error in exc.errors()]) from None


UNKNOWN_KEY_KINDS = ("extra_forbidden", "unexpected_keyword_argument", "invalid_key")
"""pydantic's error types for a key the dataclass has no field for (``invalid_key``: a key that is not a string)."""


def _problem(cls: type, error: Any) -> Problem:
    loc, kind, value = tuple(error["loc"]), error["type"], error["input"]
    cause = (error.get("ctx") or {}).get("error")
    fix = str(cause) if isinstance(cause, Fix) else error["msg"]
    own_error = cause if isinstance(cause, BaseException) and not isinstance(cause, Fix) else None
    unknown = kind in UNKNOWN_KEY_KINDS
    path, owner = _resolve(cls, loc[:-1] if unknown or kind == "missing" else loc)  # a key: its dataclass
    fields = tuple(f.name for f in dataclasses.fields(owner)) if dataclasses.is_dataclass(owner) else ()
    if kind == "missing":
        path = _resolve(cls, loc)[0]  # the missing field's own path
    # A key that is not a string is the input itself (its location holds its text).
    key = (value if kind == "invalid_key" else loc[-1]) if unknown else None
    return Problem(path, value, kind, fix, own_error, key, fields, loc)


def _resolve(cls: type, loc: tuple) -> tuple[str, Any]:
    """pydantic's location ``loc`` in ``cls`` as the dotted path messages name (``a.b``, ``a.items[0]``,
    ``a.mapping[key]``, and ``a.mapping key`` for the key itself), and the type found there."""
    if loc[-1:] == ("[key]",):  # pydantic names the bad key twice: as the key, then as "[key]"
        loc = loc[:-2] + loc[-1:]
    path, hint = "", cls
    for part in loc:
        options = _options(hint)
        if len(options) > 1:  # a field of several types (``bool | str``): pydantic names the type it tried
            hint = Any
            continue
        hint = options[0]
        if part == "[key]":
            path += " key"
        elif dataclasses.is_dataclass(hint):
            path = f"{path}.{part}" if path else str(part)
            hint = typing.get_type_hints(hint).get(str(part), Any)
        else:
            path += f"[{clip(str(part), 60)}]"
            args = typing.get_args(hint)
            hint = args[-1] if args else Any
    return path, _options(hint)[0]


def _options(hint: Any) -> tuple:
    """The types ``hint`` allows besides None: ``int | None`` -> ``(int,)``, ``bool | str`` -> ``(bool, str)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(arg for arg in typing.get_args(hint) if arg is not type(None))
    return (hint,)
