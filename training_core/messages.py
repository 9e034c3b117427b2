"""The package's message toolkit: error messages name the field, the bad value (bounded in size, credentials
redacted) and the fix. :mod:`training_core.config` re-exports these names."""

from __future__ import annotations

import math
import re
import reprlib
import typing
from typing import Any

from training_core.redact import redact

MAX_QUOTE_CHARS = 200
"""Longest quote of a value in an error message: the start of a long string or a big nested value is enough to
find it, and a message stays readable (and small) whatever the input holds."""


class _BoundedRepr(reprlib.Repr):
    """``repr`` that looks at a bounded part of a value: a few items of each container, a few levels deep, the
    two ends of a long string, and the size of a huge integer (whose full text Python refuses to write)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 6
        self.maxdict = 6
        self.maxstring = self.maxother = 120
        self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<int of about {int(x.bit_length() * math.log10(2)) + 1} digits>"
        return super().repr_int(x, level)


_bounded_repr = _BoundedRepr()


def clip(text: str, limit: int = MAX_QUOTE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, with ``...`` marking the cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quote(value: Any) -> str:
    """``repr(value)`` bounded in size (and in the work it takes), for error messages, with the credentials of
    any URL in it redacted (:func:`~training_core.redact.redact`)."""
    # A string is redacted whole first, so the cut of a long one cannot split a URL's userinfo from its "@";
    # containers are only redacted as their bounded repr, never walked (they may hold a billion items).
    if isinstance(value, str) and len(value) <= 1_000_000:
        value = redact(value)
    return clip(redact(_bounded_repr.repr(value)))


def listed(names: list[Any], limit: int = 10) -> str:
    """Up to ``limit`` names, each quoted bounded in size, and how many more there are."""
    shown = ", ".join(quote(n) for n in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


_PLAIN_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")


def is_plain_file_name(name: Any) -> bool:
    """Whether ``name``, read from a manifest, is a plain file name inside its directory: letters, digits, ``_``,
    ``-`` and ``.``, not starting with ``.``. So no separator, no ``..``, no hidden file, no ``:`` of a URI scheme or
    a drive: nothing a join could turn into a path out of the directory. The one rule for every manifest we read."""
    return isinstance(name, str) and _PLAIN_FILE_NAME.fullmatch(name) is not None


def invalid(path: str, value: Any, fix: str) -> typing.NoReturn:
    """Raise the one kind of config error: the dotted field, the bad value (:func:`quote`) and the fix, each bounded
    in size, so a message stays under a few kilobytes whatever the input."""
    raise ValueError(f"{clip(path)}={quote(value)} is invalid: {clip(fix, 2000)}")
