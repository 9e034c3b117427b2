"""Which metric names a PromQL expression reads, so tests can hold dashboards and alerts to the catalogue.

This is a lexical extractor, not a parser: it removes everything that cannot be a metric name (comments,
strings, Grafana variables, label matchers, range and subquery brackets, grouping label lists, numbers and
durations, keywords, function calls) and returns the identifiers left. Metric names given as a ``__name__``
matcher (``{__name__="x"}``) are returned as well.
"""

from __future__ import annotations

import re

# Binary-operator and modifier keywords: identifiers in PromQL that are never metric names.
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "offset",
        "bool",
        "atan2",
        "inf",
        "nan",
    }
)

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME_MATCHER = re.compile(r'__name__\s*=\s*"((?:[^"\\]|\\.)*)"|__name__\s*=\s*\'((?:[^\'\\]|\\.)*)\'')
# $var, ${var}, ${var:fmt} and the legacy [[var]] form.
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE)
# Longest alternatives first: a duration (5m, 1h30m, 10ms), a hex or decimal number, then an identifier.
_TOKEN = re.compile(
    r"(?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)(?![\w:])"
    r"|(?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<identifier>[A-Za-z_:][A-Za-z0-9_:]*)"
)
# Grafana's template-variable helpers: label_values([selector,] label) names a label last; query_result(expr).
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\(\s*(?:(?P<inner>.*),)?\s*[A-Za-z_]\w*\s*\)\s*$", re.DOTALL)
_QUERY_RESULT = re.compile(r"^\s*query_result\s*\((?P<inner>.*)\)\s*$", re.DOTALL)


def metric_names(expr: str) -> frozenset[str]:
    """Return the metric names ``expr`` reads.

    ``expr`` is PromQL, possibly with Grafana variables (``$execution``, ``${datasource}``,
    ``$__rate_interval``) or one of Grafana's Prometheus variable helpers (``label_values([selector,] label)``,
    ``query_result(expr)``).
    A function name is recognised by the ``(`` that follows it; grouping clauses (``by (...)``, ``on (...)``...)
    and label matchers never contribute names.
    """
    helper = _LABEL_VALUES.match(expr) or _QUERY_RESULT.match(expr)
    if helper is not None:
        expr = helper.group("inner") or ""
    text = _strip_comments(expr)
    names = {a or b for a, b in _NAME_MATCHER.findall(text)}
    text = _STRING.sub('""', text)
    text = _GRAFANA_VARIABLE.sub(" ", text)
    text = _remove_nested(_BRACES, text)
    text = _remove_nested(_BRACKETS, text)
    text = _LABEL_LIST.sub(" ", text)
    for match in _TOKEN.finditer(text):
        name = match.group("identifier")
        if name is None or name.lower() in _KEYWORDS:
            continue
        if text[match.end() :].lstrip().startswith("("):
            continue
        names.add(name)
    return frozenset(names)


def _strip_comments(expr: str) -> str:
    """Drop ``#`` comments, but not a ``#`` inside a string."""
    out: list[str] = []
    position = 0
    for match in re.finditer(_STRING.pattern + r"|#[^\n]*", expr):
        out.append(expr[position : match.start()])
        out.append("" if match.group().startswith("#") else match.group())
        position = match.end()
    out.append(expr[position:])
    return "".join(out)


def _remove_nested(pattern: re.Pattern[str], text: str) -> str:
    """Remove innermost matches until none is left (subqueries nest brackets)."""
    while True:
        reduced = pattern.sub(" ", text)
        if reduced == text:
            return text
        text = reduced
