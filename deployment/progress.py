"""A remote execution's training progress for ``python -m deployment.remote wait``/``launch --wait``: steps done and
total, the recent step rate, the ETA to the end and to the next checkpoint of each training node, read from the
Prometheus that scrapes the workers' pushes (the series of ``training_core/telemetry/catalog.py``, rank 0's, whose
``execution`` label is the Flyte execution's name).

Contract. :func:`read_progress` asks Prometheus's HTTP query API once for every training node of one execution (the
newest attempt of each); :class:`ProgressWatch` turns repeated reads into report lines, one per node whose step moved
since its last line. Without a Prometheus (none configured, or it cannot be reached or answers no query) the watch
says so once and stays quiet: following the execution's phases goes on.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable

from training_core.redact import redact

PROMETHEUS_URL_ENV = "PROMETHEUS_URL"
"""Where ``wait`` reads progress when ``--prometheus-url`` is not given."""
PROGRESS_SERIES = {
    "training_global_step": "global_step",
    "training_total_steps": "total_steps",
    "training_steps_per_second": "steps_per_s",
    "training_eta_seconds": "eta_s",
    "training_eta_checkpoint_seconds": "eta_checkpoint_s",
}
"""The series read (rank 0's), by the :class:`NodeProgress` field each fills."""


@dataclass(frozen=True)
class NodeProgress:
    """Where one training node's newest attempt is, as its rank 0 last pushed it."""

    node: str
    attempt: str
    global_step: int
    total_steps: int
    steps_per_s: float
    eta_s: float | None
    """Seconds to the last step (validation and checkpoints included); None before the first log window."""
    eta_checkpoint_s: float | None
    """Seconds to the next checkpoint; None when none is due."""

    def line(self) -> str:
        total = f"/{self.total_steps}" if self.total_steps > 0 else ""
        share = f" ({self.global_step / self.total_steps:.0%})" if self.total_steps > 0 else ""
        parts = [f"  {self.node} attempt {self.attempt}: step {self.global_step}{total}{share}"]
        if self.steps_per_s > 0:
            parts.append(f"{self.steps_per_s:.3g} steps/s")
        if self.eta_s is not None:
            parts.append(f"ETA {duration(self.eta_s)}")
        if self.eta_checkpoint_s is not None:
            parts.append(f"next checkpoint in {duration(self.eta_checkpoint_s)}")
        return ", ".join(parts)


def duration(seconds: float) -> str:
    """``seconds`` as people read a countdown: 45s, 2m13s, 1h02m."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def read_progress(
    prometheus_url: str, execution: str, *, timeout_s: float = 5.0, at_unix: float | None = None
) -> list[NodeProgress]:
    """Each training node of ``execution``, its newest attempt (by node name), as Prometheus holds it now (or at
    ``at_unix``). Raises ``OSError`` when Prometheus cannot be reached and ``ValueError`` when it answers no query."""
    names = "|".join(PROGRESS_SERIES)
    params = {"query": f'{{__name__=~"{names}",execution="{_label_value(execution)}",rank="0"}}'}
    if at_unix is not None:
        params["time"] = f"{at_unix:.3f}"
    url = f"{prometheus_url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = json.loads(response.read(8 * 2**20))
        results = body["data"]["result"] if body.get("status") == "success" else None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        results = None
    if not isinstance(results, list):
        raise ValueError(f"{redact(prometheus_url)} is not a Prometheus query API (no result for {params['query']})")
    return _newest_attempts(results)


def _newest_attempts(results: list) -> list[NodeProgress]:
    values: dict[tuple[str, str], dict[str, float]] = {}
    for result in results:
        metric = result.get("metric", {})
        field = PROGRESS_SERIES.get(metric.get("__name__", ""))
        if field is not None:
            key = (str(metric.get("node", "")), str(metric.get("attempt", "")))
            values.setdefault(key, {})[field] = float(result["value"][1])
    newest: dict[str, NodeProgress] = {}
    for (node, attempt), found in sorted(values.items(), key=lambda item: (item[0][0], _attempt_order(item[0][1]))):
        if "global_step" in found:
            newest[node] = _node_progress(node, attempt, found)
    return [newest[node] for node in sorted(newest)]


def _attempt_order(attempt: str) -> tuple[int, str]:
    return (int(attempt), attempt) if attempt.isdigit() else (-1, attempt)


def _node_progress(node: str, attempt: str, found: dict[str, float]) -> NodeProgress:
    def finite(name: str) -> float | None:
        value = found.get(name)
        return value if value is not None and math.isfinite(value) and value >= 0 else None

    step = int(found["global_step"])
    eta_s = finite("eta_s")
    # Before its first window an attempt's ETA gauge still reads its initial 0, as does a run's last step.
    eta_s = eta_s if eta_s or step >= int(finite("total_steps") or 0) else None
    return NodeProgress(
        node=node,
        attempt=attempt,
        global_step=step,
        total_steps=int(finite("total_steps") or 0),
        steps_per_s=finite("steps_per_s") or 0.0,
        eta_s=eta_s,
        eta_checkpoint_s=finite("eta_checkpoint_s") if eta_s is not None else None,
    )


class ProgressWatch:
    """Report lines of one execution's training progress, polled with the phases (see the module docstring)."""

    def __init__(self, prometheus_url: str | None, report: Callable[[str], None]) -> None:
        self.prometheus_url = prometheus_url
        self.report = report
        self.seen: dict[str, tuple[str, int]] = {}
        self.told_unavailable = False

    def poll(self, execution: str) -> None:
        """Lines for the nodes whose step moved since the last poll."""
        if not self.prometheus_url:
            self._unavailable(f"no Prometheus to read it from: pass --prometheus-url or set {PROMETHEUS_URL_ENV}")
            return
        try:
            nodes = read_progress(self.prometheus_url, execution)
        except (OSError, ValueError) as exc:
            self._unavailable(f"Prometheus at {redact(self.prometheus_url)} cannot be read ({exc})")
            return
        for progress in nodes:
            position = (progress.attempt, progress.global_step)
            if self.seen.get(progress.node) != position:
                self.seen[progress.node] = position
                self.report(progress.line())

    def _unavailable(self, why: str) -> None:
        if not self.told_unavailable:
            self.told_unavailable = True
            self.report(f"training progress and ETA not shown: {why}; following the phases only")
