"""Metric sinks: the seam between the training loop and where numbers go.

A sink receives flat ``{name: float}`` dicts with a step. The loop only ever talks to one sink, built by
:func:`build_sink`: rank 0 gets the console (and MLflow when a run is given); every other rank gets
:class:`NullSink`, so side effects happen once.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from typing import Any, Mapping, Protocol, Sequence

from training_core.redact import redact


class MetricSink(Protocol):
    """Where the loop's numbers and config go. A sink that writes outside the process strips URL credentials
    from params and payloads (:func:`~training_core.redact.redact`); the caller passes the real config. The sinks
    below subclass it to inherit its methods, which drop everything, for what they do not log."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_dict(self, payload: Mapping[str, Any], name: str) -> None:
        """Store ``payload`` as a JSON artifact called ``name`` (for example the resolved config)."""

    def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class NullSink(MetricSink):
    """Drops everything: the sink of every rank but 0."""


class ConsoleSink(MetricSink):
    """One compact line per call on stderr."""

    def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        body = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        # Not print(): Ray Train V2 patches it into a logger that echoes every line twice on the driver.
        sys.stderr.write(f"[rank 0] step={step} {body}\n")
        sys.stderr.flush()


class MlflowSink(MetricSink):
    """Logs into an existing MLflow run with batched client calls (one request per ``log_metrics``). Params and
    dicts are redacted (keys and values) before they leave the process."""

    def __init__(self, *, tracking_uri: str, run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.run_id = run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(redact(key), redact(str(value))[:6000]) for key, value in params.items()]
        # The backend caps params per request; send them in slices.
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def log_dict(self, payload: Mapping[str, Any], name: str) -> None:
        self.client.log_dict(self.run_id, redact(dict(payload)), name)

    def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now_ms, step) for k, v in metrics.items()])


class FanOutSink(MetricSink):
    """Passes each call on to every one of ``sinks``, in order."""

    def __init__(self, sinks: Sequence[MetricSink]) -> None:
        self.sinks = list(sinks)

    def _each(self, method: str, *args: Any, **kwargs: Any) -> None:
        for sink in self.sinks:
            getattr(sink, method)(*args, **kwargs)

    log_params = functools.partialmethod(_each, "log_params")
    log_dict = functools.partialmethod(_each, "log_dict")
    log_metrics = functools.partialmethod(_each, "log_metrics")
    close = functools.partialmethod(_each, "close")


def build_sink(*, rank: int, tracking_uri: str | None, run_id: str | None) -> MetricSink:
    if rank != 0:
        return NullSink()
    sinks: list[MetricSink] = [ConsoleSink()]
    if tracking_uri and run_id:
        sinks.append(MlflowSink(tracking_uri=tracking_uri, run_id=run_id))
    return FanOutSink(sinks)


_PARAM_NAME = re.compile(r"[/\w.\- ]*")
"""The characters MLflow takes in a param's name (on every platform)."""


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``, for logging a config as params. A mapping with a key MLflow would
    refuse in a param's name (``optimizer.param_groups``' ``"bert.*"``) is one param, its JSON text."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and not all(_PARAM_NAME.fullmatch(str(k)) for k in value):
            flat[f"{prefix}{key}"] = json.dumps(value, sort_keys=True)
        elif isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
