"""Credentials never leave the process: the one function that strips them from anything recorded or logged.

A URL may carry a user and password (``http://user:password@host``, ``s3://KEY:SECRET@bucket``). Every place
that writes config or an error somewhere a person or a system can read it (MLflow params, tags and artifacts,
checkpoint metadata, log lines, error messages) passes the text through :func:`redact` first. The process
itself keeps the real value: it still needs it to connect.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
"""What the userinfo part of a URL becomes."""

# scheme://userinfo@ : the userinfo runs from after "//" to the last "@" before the host, and never crosses a
# path, query, fragment, whitespace or quote (so two URLs in one JSON or log line stay apart).
_USERINFO = re.compile(r"""(?i)\b([a-z][a-z0-9+.\-]*://)[^/?#\s"'<>]*@""")


def redact(value: Any) -> Any:
    """``value`` with the userinfo of every URL in it replaced by ``***``.

    Strings are rewritten; mappings, lists and tuples are copied with every key and item redacted; anything
    else is returned as it is. The input is never changed in place."""
    if isinstance(value, str):
        return _USERINFO.sub(rf"\g<1>{REDACTED}@", value) if "@" in value else value
    if isinstance(value, dict):
        return {redact(k): redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value
