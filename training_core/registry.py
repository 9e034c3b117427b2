"""The registries of what users and contributors add: built-in workloads, dataset sources and named models.

Each name is written here once, with the import path (``package.module:attribute``) of the code behind it, and
everything else reads it from here: the config's choices and error messages, data prep, the model builders. So
adding a dataset source or a named model is one entry (:func:`register_dataset_source`, :func:`register_model`, or
a line in the tables below) beside the function it names. The entries are names, paths and plain metadata: importing
this module imports neither torch nor ray, and :func:`load` imports the code an entry names only when it is used.
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from typing import Any

WORKLOADS = {
    "image_classification": "training_core.workloads.image:ImageClassification",
    "causal_lm": "training_core.workloads.causal_lm:CausalLM",
    "array_classification": "training_core.workloads.simple:ArrayClassification",
    "array_regression": "training_core.workloads.simple:ArrayRegression",
    "sequence_classification": "training_core.workloads.sequence_classification:SequenceClassification",
    "masked_lm": "training_core.workloads.masked_lm:MaskedLM",
}
"""Built-in ``workload.name`` -> the class that implements it (called with the config's ``workload`` section)."""

SOURCE_CHECKS = {
    "image_classification": "training_core.data.image_shards:check_source",
    "causal_lm": "training_core.data.text:check_text_source",
    "sequence_classification": "training_core.workloads.sequence_classification:check_source",
    "masked_lm": "training_core.workloads.masked_lm:check_source",
}
"""Built-in ``workload.name`` whose prep runs on Ray -> ``package.module:function`` of ``(DataConfig) -> None``:
raises the ``ValueError`` its prep would raise on a source it cannot read, before a RayJob starts for it."""

SHARED_SOURCES = {"masked_lm": "causal_lm"}
"""A built-in ``workload.name`` -> the built-in whose ``data.dataset`` sources it reads (through the same text
pipeline): :func:`dataset_names` lists that one's."""

ARRAY_WORKLOADS = ("array_classification", "array_regression")
"""The built-ins of a user's own arrays: they read no ``data.dataset`` but the ``.npz`` file ``data.path`` or what
``workload.dataset_source`` returns, and train the model ``workload.model_factory`` builds."""


@dataclass(frozen=True)
class DatasetSource:
    """A ``data.dataset`` a built-in workload reads."""

    workload: str
    """The key of :data:`WORKLOADS` that reads it."""
    read: str = ""
    """``package.module:function`` reading it whole: ``(DataConfig) -> RawDataset`` for ``image_classification``,
    ``(DataConfig, SourceStats) -> Iterator[Document]`` for ``causal_lm`` and ``sequence_classification`` (whose
    documents carry their ``label``)."""
    list_images: str = ""
    """For an encoded image source: ``package.module:function`` of ``(DataConfig) -> ImageListing``; prep then
    writes its images as encoded Parquet shards in Ray tasks (:mod:`training_core.data.image_shards`) instead of
    calling :attr:`read`."""
    check_images: str = ""
    """For an encoded image source: ``(DataConfig) -> None`` raising ``ValueError`` for a location it cannot read,
    without listing it (runs before any Ray cluster starts)."""
    layout: str = ""
    """For an encoded image source: where a listed item's bytes are, ``files`` (a path under ``data.path``) or
    ``cifar_batches`` (``member#row`` of a tarball of CIFAR-10 python batches)."""
    needs_path: bool = False
    """Whether ``data.path`` must name its location (prep's fingerprint then reads what is there)."""
    needs_image_size: bool = False
    """Whether its images come in many sizes, so ``data.image_size`` must fix one."""


DATASET_SOURCES: dict[str, DatasetSource] = {
    "digits": DatasetSource("image_classification", read="training_core.data.sources:read_digits"),
    "synthetic": DatasetSource("image_classification", read="training_core.data.sources:read_synthetic"),
    "cifar10": DatasetSource(
        "image_classification",
        read="training_core.data.sources:read_cifar10",
        list_images="training_core.data.image_shards:list_cifar10",
        check_images="training_core.data.image_shards:check_cifar10",
        layout="cifar_batches",
        needs_path=True,
    ),
    "image_folder": DatasetSource(
        "image_classification",
        list_images="training_core.data.image_shards:list_image_folder",
        check_images="training_core.data.image_shards:check_image_folder",
        layout="files",
        needs_path=True,
        needs_image_size=True,
    ),
    "stdlib": DatasetSource("causal_lm", read="training_core.data.text:stdlib_source"),
    "text": DatasetSource("causal_lm", read="training_core.data.text:path_source", needs_path=True),
    "labeled_text": DatasetSource(
        "sequence_classification", read="training_core.data.text:labeled_source", needs_path=True
    ),
}
"""``data.dataset`` -> its source, in the order the config lists the choices."""

IMAGE_MODELS = {
    "small_cnn": "training_core.models:small_cnn",
    "resnet18": "training_core.models:resnet",
    "resnet34": "training_core.models:resnet",
    "resnet50": "training_core.models:resnet",
    "resnet101": "training_core.models:resnet",
    "resnet152": "training_core.models:resnet",
    "vit_b_16": "training_core.models:vit_b_16",
}
"""``model.name`` of ``image_classification`` -> ``package.module:function`` of
``(name, *, in_channels, num_classes, side) -> torch.nn.Module`` (randomly initialised; ``name`` is the key, so one
function can build a family)."""


@dataclass(frozen=True)
class LMSize:
    """A named transformer size: a GPT-2 size of ``causal_lm``, a BERT size of ``sequence_classification`` and
    ``masked_lm``."""

    num_layers: int
    hidden_size: int
    num_heads: int
    context_length: int


LM_SIZES = {
    "gpt2-tiny": LMSize(num_layers=2, hidden_size=64, num_heads=2, context_length=256),
    "gpt2-mini": LMSize(num_layers=4, hidden_size=256, num_heads=4, context_length=512),
    "gpt2": LMSize(num_layers=12, hidden_size=768, num_heads=12, context_length=1024),
    "gpt2-medium": LMSize(num_layers=24, hidden_size=1024, num_heads=16, context_length=1024),
    "gpt2-large": LMSize(num_layers=36, hidden_size=1280, num_heads=20, context_length=1024),
    "gpt2-xl": LMSize(num_layers=48, hidden_size=1600, num_heads=25, context_length=1024),
}
"""``model.name`` of ``causal_lm``'s GPT-2 sizes: OpenAI's four (124 M to 1.5 B parameters with their 50 257-token
vocabulary) and two small ones for tests and quick runs (:mod:`training_core.workloads.causal_lm` builds them)."""


ENCODER_SIZES = {
    "bert-tiny": LMSize(num_layers=2, hidden_size=128, num_heads=2, context_length=512),
    "bert-mini": LMSize(num_layers=4, hidden_size=256, num_heads=4, context_length=512),
    "bert-small": LMSize(num_layers=4, hidden_size=512, num_heads=8, context_length=512),
    "bert-medium": LMSize(num_layers=8, hidden_size=512, num_heads=8, context_length=512),
    "bert-base": LMSize(num_layers=12, hidden_size=768, num_heads=12, context_length=512),
    "bert-large": LMSize(num_layers=24, hidden_size=1024, num_heads=16, context_length=512),
}
"""``model.name`` of the BERT sizes of ``sequence_classification`` and ``masked_lm`` (randomly initialised): Google's
BERT-Base and -Large and its four smaller ones (Turc et al. 2019), each with an MLP 4x its width; the vocabulary is
the prepared data's tokenizer's (:mod:`training_core.workloads.sequence_classification` builds them)."""

PRIMARY_METRICS = {"sequence_classification": ("accuracy", "macro_f1")}
"""The ``workload.primary_metric`` choices of a built-in workload that lets the config choose (the first is its
default); the others rank on their own."""


def register_dataset_source(name: str, source: DatasetSource) -> None:
    """Add ``data.dataset`` ``name`` in this process: its config accepts it from now on and prep reads it through
    ``source``. Other processes (Ray workers) know only the entries of this module."""
    assert source.workload in WORKLOADS, f"{source.workload!r} is not a built-in workload"
    assert bool(source.read) or bool(source.list_images), "a source names its reader"
    DATASET_SOURCES[name] = source


def register_model(name: str, builder: str) -> None:
    """Add ``model.name`` ``name`` of ``image_classification`` in this process, built by the function ``builder``
    names. Other processes (Ray workers) know only the entries of this module."""
    assert ":" in builder, "name the builder as package.module:function"
    IMAGE_MODELS[name] = builder


def dataset_names(workload: str = "") -> tuple[str, ...]:
    """The registered ``data.dataset`` names (those ``workload`` reads, when given), in registration order."""
    reader = SHARED_SOURCES.get(workload, workload)
    return tuple(name for name, source in DATASET_SOURCES.items() if not workload or source.workload == reader)


def load(path: str) -> Any:
    """The object a registry entry's ``package.module:attribute`` names, imported now."""
    return pkgutil.resolve_name(path)
