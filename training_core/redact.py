"""Credentials never leave the process: the one function that strips them from anything recorded or logged.

A URL may carry a user and password (``http://user:password@host``, ``s3://KEY:SECRET@bucket``). Every place
that writes config or an error somewhere a person or a system can read it (MLflow params, tags and artifacts,
checkpoint metadata, log lines, error messages) passes the text through :func:`redact` first; behind those call
sites, :func:`install_log_redaction` puts a :class:`RedactingFilter` on the project's loggers as a catch-all. The
process itself keeps the real value: it still needs it to connect.
"""

from __future__ import annotations

import logging
import re
from typing import Any

REDACTED = "***"
"""What the userinfo part of a URL becomes."""

# scheme://userinfo@ in two forms. The standard one: the userinfo runs from after "//" to the last "@" before the
# path, so a password may hold "@". The other catches what people paste unencoded, an S3 secret with "/" (or a
# password with "?" or "#"): "user:" then anything up to the first "@", unless what follows the colon reads as a
# port ("host:8080/path@x" stays as it is: the URL standard reads it that way too). Neither crosses whitespace, a
# quote, "<", ">" or "//", so two URLs in one JSON or log line stay apart. The scheme starts where a run of scheme
# characters starts (not only at a word boundary: "url_http://" is a URL too).
_USERINFO = re.compile(
    r"""(?i)(?<![a-z0-9+.\-])([a-z][a-z0-9+.\-]*://)"""
    r"""(?:[^/?#\s"'<>]*@"""
    r"""|[^/?#@\s"'<>\[\]:]*:(?!\d+(?:[/?#\s"'<>]|$))(?:[^\s"'<>@/]|/(?!/))*@)"""
)


_SEEN_USERINFO: dict[str, None] = {}
"""The ``user:password`` of every URL :func:`redact` has rewritten in this process (the newest 64), removed wherever
they appear again: libraries quote a URL without its scheme (fsspec strips ``s3://``, so botocore names the bucket
``KEY:SECRET@bucket``), where the pattern alone cannot tell a credential from text."""


def _remember(match: re.Match) -> str:
    userinfo = match.group(0)[len(match.group(1)) : -1]
    if ":" in userinfo and len(userinfo) >= 4:
        _SEEN_USERINFO.pop(userinfo, None)
        _SEEN_USERINFO[userinfo] = None
        while len(_SEEN_USERINFO) > 64:  # another thread may trim it too
            _SEEN_USERINFO.pop(next(iter(_SEEN_USERINFO), ""), None)
    return f"{match.group(1)}{REDACTED}@"


def redact(value: Any) -> Any:
    """``value`` with the userinfo of every URL in it replaced by ``***``, and any ``user:password`` seen in an
    earlier URL replaced wherever it appears.

    Strings are rewritten; mappings, lists and tuples are copied with every key and item redacted; anything
    else is returned as it is. The input is never changed in place."""
    if isinstance(value, str):
        if "@" in value:
            value = _USERINFO.sub(_remember, value)
        for userinfo in list(_SEEN_USERINFO):  # a copy: another thread may add one meanwhile
            value = value.replace(userinfo, REDACTED)
        return value
    if isinstance(value, dict):
        return {redact(k): redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


REDACTED_LOGGERS = ("training_core", "tasks")
"""Loggers :func:`install_log_redaction` covers, with every child logger that exists when it is called."""


class RedactingFilter(logging.Filter):
    """Rewrites each record it sees, before any handler formats it: the message with its arguments, the
    exception's traceback text and the stack text, each through :func:`redact`. It never drops a record.

    A catch-all behind the call sites, which redact what they log themselves: it also covers a URL inside the
    text of an exception raised by a library."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed call is the handler's to report (handleError), not ours
            return True
        redacted = redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            # What Formatter.format would write; set here so every handler prints the redacted text instead.
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def install_log_redaction() -> None:
    """Add one :class:`RedactingFilter` to each logger of :data:`REDACTED_LOGGERS` and to each of their child
    loggers that exist now (a logger's filters see only the records logged on it, not its children's).
    Idempotent; every process that logs for this project calls it at its entry point (the Flyte task bodies, the
    Ray Train and Ray Tune trial entry points, the processes of the plain ``torch.distributed`` launcher)."""
    existing = [name for name in list(logging.root.manager.loggerDict) if name.split(".")[0] in REDACTED_LOGGERS]
    for name in {*REDACTED_LOGGERS, *existing}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactingFilter) for f in logger.filters):
            logger.addFilter(RedactingFilter())
