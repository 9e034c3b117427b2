"""What a workload is: the :class:`Workload` protocol, the :class:`LossOutput` of a training batch, the check that an
object implements the protocol (:func:`check_workload`), and small helpers the built-in workloads share."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, runtime_checkable

from training_core.config import DataConfig, TrainingConfig
from training_core.messages import invalid, quote

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn

    from training_core.data.prepared import Manifest


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


_ATTRIBUTES = ("name", "primary_metric", "primary_mode")
_METHODS = ("prepare_data", "check", "build_model", "to_device", "loss", "eval_sums", "metrics", "example_input")


def check_workload(field: str, path: str, workload: Any) -> Workload:
    """``workload`` when it has every attribute and method of :class:`Workload`, else ``ValueError`` naming what
    is missing."""
    missing = [a for a in _ATTRIBUTES if not hasattr(workload, a)]
    missing += [f"{m}()" for m in _METHODS if not callable(getattr(workload, m, None))]
    if missing:
        raise ValueError(
            f"{field}={quote(path)} is invalid: it returned a {type(workload).__name__}, which is not a workload: it "
            f"lacks {', '.join(missing)}; implement the training_core.workloads.Workload protocol"
        )
    if workload.primary_mode not in ("max", "min"):
        invalid(f"{field} (its primary_mode)", workload.primary_mode, "it must be 'max' or 'min'")
    if not isinstance(workload.primary_metric, str) or not workload.primary_metric:
        invalid(f"{field} (its primary_metric)", workload.primary_metric, "it must name a metric, e.g. 'accuracy'")
    return workload


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


def sample_count(values: torch.Tensor) -> torch.Tensor:
    """How many ``values`` there are (along dim 0), as a 0-dim int64 tensor filled on their device: a sum the loop
    adds without a sync, and no host-to-device copy to wait on."""
    import torch

    return torch.full((), values.shape[0], dtype=torch.long, device=values.device)


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossOutput:
    """Cross-entropy of ``model(inputs)`` against ``targets``, with the correct and sample counts."""
    import torch.nn.functional as F

    inputs, targets = batch
    logits = model(inputs)
    loss = F.cross_entropy(logits, targets)
    correct = (logits.detach().argmax(dim=1) == targets).sum()
    return LossOutput(loss=loss, sums={"correct": correct, "samples": sample_count(targets)}, num_samples=len(targets))


def classification_sums(
    logits: torch.Tensor, labels: torch.Tensor, predicted: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The evaluation sums of a classifier's ``logits`` for ``labels``: ``loss_sum`` (cross-entropy), ``correct``,
    ``samples`` and ``confusion`` (``[true][predicted]`` counts), ``predicted`` the argmax unless given."""
    import torch
    import torch.nn.functional as F

    logits = logits.float()
    predicted, num_classes = logits.argmax(dim=1) if predicted is None else predicted, logits.shape[1]
    pairs = torch.bincount(labels * num_classes + predicted, minlength=num_classes**2)
    return {
        "loss_sum": F.cross_entropy(logits, labels, reduction="sum").double(),
        "correct": (predicted == labels).sum(),
        "samples": sample_count(labels),
        "confusion": pairs.view(num_classes, num_classes),
    }


class Classifier:
    """What the classification workloads share: class logits ``[N, classes]`` of the model for int64 labels,
    cross-entropy (:func:`classification_loss`), the evaluation sums of :func:`classification_sums` and their
    metrics."""

    f1_name = ""
    """The key of macro-F1 in :meth:`metrics`; none when empty."""

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossOutput:
        return classification_loss(model, batch)

    def eval_sums(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        return classification_sums(model(inputs), labels)

    def metrics(self, sums: Mapping[str, Any]) -> dict[str, float]:
        """``accuracy``; with the evaluation figures also ``loss`` (per sample) and, named :attr:`f1_name`, macro-F1
        (:func:`macro_f1`: the mean over classes of each one's F1; a class neither true nor predicted counts as 1)."""
        found = {"accuracy": mean_of(sums, "correct", "samples")}
        if "loss_sum" in sums:
            found["loss"] = mean_of(sums, "loss_sum", "samples")
        if self.f1_name and "confusion" in sums:
            found[self.f1_name] = macro_f1(sums["confusion"])
        return found


def check_prepared_by(name: str, what: str, manifest: Manifest, fits: bool = True) -> None:
    """``ValueError`` unless the workload ``name``, which trains on ``what``, wrote ``manifest`` (and it ``fits``)."""
    if manifest.workload != name or not fits:
        raise ValueError(
            f"workload.name={name!r} trains on {what}, but the prepared data at {quote(manifest.directory)} was "
            f"written by workload {manifest.workload!r}; prepare the data with the same workload"
        )


def macro_f1(confusion: Any) -> float:
    """The mean over classes of ``2 * tp / (2 * tp + fp + fn)`` of a confusion matrix (rows true, columns
    predicted); a class neither true nor predicted counts as 1."""
    import numpy as np

    counts = np.asarray(confusion, dtype=np.float64)
    denominators = counts.sum(axis=0) + counts.sum(axis=1)
    scores = np.where(denominators > 0, 2 * counts.diagonal() / np.maximum(denominators, 1), 1.0)
    return float(scores.mean()) if scores.size else math.nan


_DEFINE_LOCK = threading.Lock()


def lazy_class(namespace: dict[str, Any], name: str, define: Callable[[], type]) -> tuple[Callable[[], type], Any]:
    """``(get, __getattr__)`` for the class ``name`` of the module whose globals are ``namespace``, defined lazily
    (its base comes from a heavy import): ``get()`` makes it by ``define()`` on first use and keeps it as a module
    global, so pickle finds it by module and name like any other; ``__getattr__`` (PEP 562) serves it by name."""

    def get() -> type:
        with _DEFINE_LOCK:
            found = namespace.get(name)
            if found is None:
                namespace[name] = found = define()
                found.__qualname__ = name
        return found

    def module_getattr(attribute: str) -> Any:
        if attribute == name:
            return get()
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {attribute!r}")

    return get, module_getattr
