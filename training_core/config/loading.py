"""Reading config input: safe YAML, ``TRAINING_CORE__SECTION__FIELD`` environment overrides, layering, and
building a config dataclass from a partial mapping through the schema layer (:mod:`training_core.schema`)."""

from __future__ import annotations

import functools
import os
import re
import typing
from typing import Any, Mapping

from training_core.messages import clip, invalid, quote
from training_core.schema import UNKNOWN_KEY_KINDS, SchemaError, check

AUTO = 0
"""How a field that takes ``auto`` (``loop.batch_size``) stores it."""
AUTO_FIELDS = frozenset({"loop.batch_size"})

ENV_PREFIX = "TRAINING_CORE__"


def build_dataclass(cls: type, raw: Mapping[str, Any]) -> Any:
    """``cls`` (a config dataclass) built from ``raw``, a partial nested mapping of config input, by the schema
    layer in lax mode (:mod:`training_core.schema`): ``"3"`` and ``"yes"`` read as they always did, unknown fields
    are refused, and each ``__post_init__`` runs."""
    return coerce("", _with_auto(raw), cls)


def coerce(path: str, value: Any, hint: type) -> Any:
    """``value`` read as the config field ``path`` of type ``hint`` (see :func:`build_dataclass`)."""
    if hint is int and path in AUTO_FIELDS and _is_auto(value):
        return AUTO
    try:
        return check(hint, value, lax=True)
    except SchemaError as exc:
        _raise_config_error(exc, path)


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _with_auto(raw: Any) -> Any:
    """``raw`` with ``auto`` in an :data:`AUTO_FIELDS` field stored as :data:`AUTO`, at any depth: a tuning config
    holds the training config as ``base``."""
    if not isinstance(raw, Mapping):
        return raw
    raw = {key: _with_auto(value) for key, value in raw.items()}
    for path in AUTO_FIELDS:
        section, name = path.split(".")
        fields = raw.get(section)
        if isinstance(fields, Mapping) and _is_auto(fields.get(name)):
            raw[section] = {**fields, name: AUTO}
    return raw


_CONFIG_FIXES = {
    "dataclass_type": "expected a mapping of field names to values",
    "string_type": "expected a string",
    "dict_type": "expected a mapping",
    "list_type": "expected a list",
}


def _raise_config_error(exc: SchemaError, base: str) -> typing.NoReturn:
    """The config error for the schema layer's ``exc``: the unknown fields of the shallowest
    section first, as the config always reported them, else the first problem."""
    unknown = sorted((p for p in exc.problems if p.kind in UNKNOWN_KEY_KINDS), key=lambda p: p.path.count("."))
    if unknown:
        keys = [p.key for p in unknown if p.path == unknown[0].path]
        _unknown_fields(_joined(base, unknown[0].path) or "config", keys, unknown[0].fields)
    problem = exc.problems[0]
    if problem.error is not None:
        raise problem.error
    invalid(_joined(base, problem.path) or "config", problem.value, _CONFIG_FIXES.get(problem.kind, problem.fix))


def _joined(base: str, path: str) -> str:
    if not base or not path or path[0] in "[ ":
        return base + path
    return f"{base}.{path}"


def _unknown_fields(where: str, unknown: list[Any], fields: tuple[str, ...]) -> typing.NoReturn:
    names = sorted(clip(key, 60) if isinstance(key, str) else f"{quote(key)} ({type(key).__name__})" for key in unknown)
    listed = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    strings = "" if all(isinstance(key, str) for key in unknown) else "field names are strings; "
    raise ValueError(f"{where} has unknown field(s) {listed}: {strings}valid fields are {', '.join(sorted(fields))}")


MAX_YAML_DEPTH = 32
"""Deepest nesting config input may have. The deepest config field is four levels down; refusing more keeps a
hostile document from exhausting Python's recursion limit."""

_YAML_INT = r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+"
_YAML_FLOAT = r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"
_YAML_BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}


def _construct_bool(loader, node) -> bool:
    """A ``!!bool`` scalar: only true/false (YAML 1.2 core schema)."""
    text = loader.construct_scalar(node)
    if text not in _YAML_BOOL:
        raise loader.refused(f"{quote(text)} is not a boolean: write true or false", node.start_mark)
    return _YAML_BOOL[text]


def _construct_int(loader, node) -> int:
    """A ``!!int`` scalar: decimal, ``0o`` octal or ``0x`` hex."""
    text = loader.construct_scalar(node)
    if not re.fullmatch(_YAML_INT, text):
        raise loader.refused(f"{quote(text)} is not an integer: write one in decimal digits", node.start_mark)
    base = {"0o": 8, "0x": 16}.get(text[:2], 10)
    try:
        return int(text[2:] if base != 10 else text, base)
    except ValueError:  # more digits than Python converts
        raise loader.refused(f"an integer of {len(text)} digits is out of range", node.start_mark) from None


def _construct_float(loader, node) -> float:
    """A ``!!float`` scalar, ``.inf`` and ``.nan`` included (``coerce`` refuses them for fields)."""
    text = loader.construct_scalar(node)
    if not re.fullmatch(_YAML_FLOAT, text):
        raise loader.refused(f"{quote(text)} is not a number: write one such as 0.5 or 1e-3", node.start_mark)
    special = text.lower().lstrip("+-") in (".inf", ".nan")  # Python spells them inf and nan
    return float(text.replace(".", "") if special else text)


def _construct_undefined(loader, node):
    """Any tag outside the core schema is refused."""
    tag = node.tag.replace("tag:yaml.org,2002:", "!!")
    raise loader.refused(
        f"the tag {quote(tag)} is not supported: config input holds strings, numbers, true/false, null, "
        "lists and mappings",
        node.start_mark,
    )


def _compose_node(loader: Any, parent: Any, index: Any) -> Any:
    """``compose_node`` of the config loader: anchors and aliases refused, nesting bounded."""
    import yaml
    from yaml.events import AliasEvent

    event = loader.peek_event()
    if isinstance(event, AliasEvent) or event.anchor is not None:
        sign = "*" if isinstance(event, AliasEvent) else "&"
        raise loader.refused(
            f"found {sign}{clip(event.anchor, 60)}: anchors and aliases are not supported in config input; "
            "write each value out in full",
            event.start_mark,
        )
    loader.depth = getattr(loader, "depth", 0) + 1
    try:
        if loader.depth > MAX_YAML_DEPTH:
            raise loader.refused(
                f"values nest deeper than {MAX_YAML_DEPTH} levels; config fields are at most four deep",
                event.start_mark,
            )
        return yaml.SafeLoader.compose_node(loader, parent, index)
    finally:
        loader.depth -= 1


def _construct_mapping(loader: Any, node: Any, deep: bool = False) -> dict:
    """``construct_mapping`` of the config loader: keys hashable, each key once."""
    import yaml

    if not isinstance(node, yaml.MappingNode):
        raise loader.refused(f"expected a mapping, found a {node.id}", node.start_mark)
    mapping: dict = {}
    first_lines: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise loader.refused(
                f"a {type(key).__name__} cannot be a key: field names are strings", key_node.start_mark
            ) from None
        if key in mapping:
            raise loader.refused(
                f"duplicate key {quote(key)} (first at line {first_lines[key]}): YAML would keep only the "
                "last one; write each key once, merging the two",
                key_node.start_mark,
            )
        first_lines[key] = key_node.start_mark.line + 1
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


@functools.cache
def _yaml_loader() -> type:
    """The ``yaml.SafeLoader`` all config input is read with.

    - Plain scalars follow the YAML 1.2 core schema: ``010`` is 10, ``1:30`` and ``yes``/``no``/``on``/``off`` stay
      strings, only ``true``/``false`` are booleans, and dates stay strings. YAML 1.1 (PyYAML's default) reads
      ``010`` as 8 and ``1:30`` as 90, which no one writing a config means.
    - Anchors and aliases are refused: a few hundred bytes of nested aliases expand to billions of values.
    - A key that appears twice in a mapping is refused (YAML 1.1 keeps the last and drops the first block).
    - Tags other than the core schema's (``!!timestamp``, ``!!binary``, ``!!set``, ...) are refused.
    """
    import yaml
    from yaml.constructor import ConstructorError

    class Refused(ConstructorError):
        """Input this loader refuses on purpose; its ``problem`` says what to write instead."""

        def __init__(self, problem: str, mark: Any) -> None:
            super().__init__(None, None, problem, mark)

    class ConfigLoader(yaml.SafeLoader):
        yaml_implicit_resolvers: dict = {}
        yaml_constructors: dict = {}
        yaml_multi_constructors: dict = {}
        refused = Refused
        compose_node = _compose_node
        construct_mapping = _construct_mapping

    safe = yaml.SafeLoader  # exactly the YAML 1.2 core schema's tags and implicit resolvers
    for tag, construct in (
        ("null", safe.construct_yaml_null),
        ("bool", _construct_bool),
        ("int", _construct_int),
        ("float", _construct_float),
        ("str", safe.construct_yaml_str),
        ("seq", safe.construct_yaml_seq),
        ("map", safe.construct_yaml_map),
    ):
        ConfigLoader.add_constructor(f"tag:yaml.org,2002:{tag}", construct)
    ConfigLoader.add_constructor(None, _construct_undefined)
    for tag, pattern, first in (
        ("bool", "|".join(_YAML_BOOL), "tTfF"),
        ("int", _YAML_INT, "-+0123456789"),
        ("float", _YAML_FLOAT, "-+0123456789."),
        ("null", "~|null|Null|NULL|", ["~", "n", "N", ""]),
    ):
        ConfigLoader.add_implicit_resolver(f"tag:yaml.org,2002:{tag}", re.compile(f"^(?:{pattern})$"), list(first))
    return ConfigLoader


def parse_yaml(text: str, *, where: str) -> Any:
    """The value of the YAML document ``text`` read by the config loader (see :func:`_yaml_loader`).

    ``where`` names the input (a file, an environment variable) in the ``ValueError`` that bad YAML raises, with
    the line and column."""
    import yaml

    loader = _yaml_loader()
    try:
        return yaml.load(text, Loader=loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        if isinstance(exc, loader.refused):
            problem = exc.problem
        else:
            context = f"{exc.context}: " if exc.context else ""
            problem = f"{context}{exc.problem}; fix the YAML there (quote a value to keep it as text)"
        raise ValueError(f"{where} is invalid: {at}{clip(problem, 1000)}") from None
    except yaml.reader.ReaderError as exc:
        char = f"U+{exc.character:04X}" if isinstance(exc.character, int) else repr(exc.character)
        raise ValueError(
            f"{where} is invalid: character {char} at position {exc.position} is not allowed in YAML; remove it"
        ) from None


MAX_CONFIG_BYTES = 16 * 2**20
"""Most bytes read from one config file: far beyond any config, so a large file named by mistake fails at once."""


def read_yaml_mapping(path: str | os.PathLike[str], *, setting: str = "config file") -> dict[str, Any]:
    """The mapping of fields in the YAML file at ``path`` (partial: only the fields it sets; empty file: none), read
    by the config loader (:func:`_yaml_loader`). ``setting`` names where the path came from (``--config``, ``config
    file``) in the error a missing file, bad YAML or a document that is not a mapping raises."""
    from training_core.files import UnreadableFile, read_regular_local

    where = f"{setting} {quote(os.fspath(path))}"
    if not os.path.lexists(path):
        raise ValueError(f"{where} is invalid: no file there")
    try:  # a FIFO, a device or a directory is refused without a blocking read; /dev/zero stops at the cap
        text = read_regular_local(os.fspath(path), max_bytes=MAX_CONFIG_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where} is invalid: byte {exc.start} is not UTF-8; save the file as UTF-8 text") from None
    except UnreadableFile as exc:
        raise ValueError(f"{where} is invalid: {exc}; give a readable YAML file") from None
    raw = parse_yaml(text, where=where)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} is invalid: it must hold a mapping of fields, got {type(raw).__name__}")
    return dict(raw)


def env_overrides(environ: Mapping[str, str], *, prefix: str = ENV_PREFIX) -> dict[str, Any]:
    """Nested overrides from ``<prefix>SECTION__FIELD=value`` variables (values parsed as YAML).

    A variable that sets a whole section (``<prefix>LOOP``) beside one that sets a field in it
    (``<prefix>LOOP__EPOCHS``), two variables for the same field (their names differ only in case), and a value that
    is not valid YAML each raise a ``ValueError`` naming the variable."""
    named: dict[tuple[str, ...], str] = {}
    for key in sorted(key for key in environ if key.startswith(prefix)):
        parts = tuple(p.lower() for p in key[len(prefix) :].split("__") if p)
        if not parts:
            continue
        if parts in named:
            raise ValueError(
                f"{clip(key)}={quote(environ[key])} is invalid: {clip(named[parts])} sets the same field "
                f"{clip('.'.join(parts))}; unset one of them"
            )
        named[parts] = key
    for parts, key in named.items():
        for depth in range(1, len(parts)):
            section = named.get(parts[:depth])
            if section is not None:
                raise ValueError(
                    f"{clip(section)}={quote(environ[section])} is invalid: it sets {clip('.'.join(parts[:depth]))} "
                    f"whole while {clip(key)} sets a field in it; unset {clip(section)} and set each field as "
                    f"{clip(section)}__<FIELD>"
                )
    overrides: dict[str, Any] = {}
    for parts, key in named.items():
        node = overrides
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = parse_yaml(environ[key], where=f"{clip(key)}={quote(environ[key])}")
    return overrides


def merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``top`` laid over it, section by section (a nested mapping merges, anything else replaces)."""
    merged = dict(base)
    for key, value in top.items():
        nested = isinstance(value, Mapping) and isinstance(merged.get(key), Mapping)
        merged[key] = merge(merged[key], value) if nested else value
    return merged


def load_layers(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
) -> dict[str, Any]:
    """The one way a config is read from outside: the YAML file at ``path`` (if given), overlaid by the
    ``<env_prefix>SECTION__FIELD`` environment variables. A partial mapping, for a config class's ``from_dict``."""
    raw = read_yaml_mapping(path) if path is not None else {}
    return merge(raw, env_overrides(os.environ if environ is None else environ, prefix=env_prefix))


def overlay(default: Any, fields: Mapping[str, Any]) -> Any:
    """The config dataclass ``default`` with ``fields`` (a partial nested mapping) on top, validated."""
    return type(default).from_dict(merge(default.to_dict(), fields))
