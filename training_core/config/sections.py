"""The one typed config tree for a training run: every section's dataclass, and :func:`load_config`.

Every setting of the pipeline lives here, documented in the field's docstring and validated in ``__post_init__``.
An invalid value raises ``ValueError`` naming the dotted field, the bad value and what to use instead, so a bad run
fails on the laptop, before any Ray worker starts.

The tree is plain dataclasses of str/int/float/bool, so flytekit can pass it as a typed task input and FlyteConsole
can render it. Load it from YAML with :func:`load_config`; environment variables named
``TRAINING_CORE__<SECTION>__<FIELD>`` override single fields.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, NoReturn

from training_core.config.loading import AUTO, MAX_YAML_DEPTH, build_dataclass, load_layers
from training_core.messages import clip, invalid
from training_core.redact import redact
from training_core.registry import (
    ARRAY_WORKLOADS,
    DATASET_SOURCES,
    ENCODER_SIZES,
    IMAGE_MODELS,
    LM_SIZES,
    PRIMARY_METRICS,
    WORKLOADS,
    dataset_names,
)
from training_core.schema import INT64_MAX, INT64_MIN

log = logging.getLogger(__name__)

IMPORT_PATH_FIX = "name user code as 'package.module:attribute' (e.g. 'examples.tabular_mlp.workload:build')"
_NCCL_VARIABLE = re.compile(r"NCCL_[A-Z0-9_]{1,100}")
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
"""A Kubernetes label or taint key: an optional DNS-subdomain prefix and ``/``, then a name of at most 63 chars."""
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")

METRIC_DIRECTIONS = {"val_accuracy": "max", "val_loss": "min", "val_perplexity": "min"}
"""Which way each metric that ranks checkpoints and trials improves: ``max`` or ``min``."""


MAX_EPOCHS = 1_000_000
"""Most ``loop.epochs``: far beyond any run, and it keeps epoch-based arithmetic (schedules, rungs) small."""

MAX_NONFINITE_STEPS = 1_000_000
"""Most ``loop.max_nonfinite_steps``: a run that skips more steps than this has stopped learning."""

MAX_SEED = 2**32 - 1

MIN_CPUS, MAX_CPUS = 0.001, 1024.0

MIN_MEMORY_GIB, MAX_MEMORY_GIB = 0.25, 32_768.0
"""Range of a pod's memory, GiB. It is written as whole MiB (``1e-9`` GiB would be ``0Mi``, no memory at all), and
a Ray node's raylet and worker process need a few hundred MiB to start, so 256 MiB is the floor; 32 TiB is more than
any machine has."""

MIN_SHM_GIB = 0.0625
"""Least ``/dev/shm`` a pod may be given, GiB: the 64 MiB a container runtime gives by default."""

SHM_SHARE = 0.3
"""Share of a pod's memory its ``/dev/shm`` may use unless ``scaling.shm_per_worker_gib`` says otherwise."""

DDP_DEFAULT_BUCKET_CAP_MB = 25
"""PyTorch DDP's gradient bucket size, MiB, when none is passed (its first bucket is then 1 MiB)."""


def is_better(metric: str, value: float, than: float | None) -> bool:
    """Whether ``value`` of ``metric`` beats ``than``: any number beats ``None`` and NaN (a diverged validation),
    NaN beats nothing."""
    if math.isnan(value):
        return False
    return than is None or math.isnan(than) or (value > than if METRIC_DIRECTIONS[metric] == "max" else value < than)


def _choice(path: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        invalid(path, value, f"choose one of {', '.join(choice or repr(choice) for choice in choices)}")


def _positive(path: str, value: float) -> None:
    if not value > 0:
        invalid(path, value, "it must be > 0")


def _non_negative(path: str, value: float) -> None:
    if not value >= 0:
        invalid(path, value, "it must be >= 0")


def _between(path: str, value: float, low: float, high: float, why: str = "") -> None:
    if not low <= value <= high:
        bounds = ", ".join(f"{bound:_}" if isinstance(bound, int) else f"{bound:g}" for bound in (low, high))
        invalid(path, value, f"it must be in [{bounds}]{why}")


def _seed(path: str, value: int) -> None:
    if not 0 <= value <= MAX_SEED:
        invalid(path, value, f"use a seed in [0, {MAX_SEED}] (2**32 - 1), the range numpy's seeding takes")


def _pod_memory_gib(path: str, value: float) -> None:
    why = " GiB: a pod's memory is written in whole MiB, and a Ray node needs at least 256 MiB to start"
    _between(path, value, MIN_MEMORY_GIB, MAX_MEMORY_GIB, why)


def _fraction(path: str, value: float) -> None:
    if not 0 <= value < 1:
        invalid(path, value, "it must be in [0, 1)")


class _Section:
    """A config section at the dotted ``path`` (its class keyword): :meth:`_refuse` names its fields by their path."""

    def __init_subclass__(cls, path: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._path = path

    def _refuse(self, name: str, fix: str) -> NoReturn:
        """Raise the config error of this section's field ``name``: its path, its value and ``fix``."""
        invalid(f"{self._path}.{name}", getattr(self, name), fix)


@dataclass
class DataConfig(_Section, path="data"):
    dataset: str = "digits"
    """Dataset source: ``digits`` (sklearn's 8x8 digits, shipped with scikit-learn), ``synthetic``
    (random images with learnable class templates, for benchmarks), ``cifar10`` (the python-version
    tarball ``cifar-10-python.tar.gz``) or ``image_folder`` (an ImageNet-style ``<split>/<class>/*.jpg``
    tree, or ``<class>/*.jpg`` which is split here); text: ``stdlib`` and ``text`` (``causal_lm`` and ``masked_lm``),
    ``labeled_text`` (``sequence_classification``: ``.csv``, ``.jsonl`` or ``.parquet`` records of text and label under
    ``data.path``)."""

    path: str = ""
    """Where the raw data is: a local path or an ``s3://`` URI. Required for ``cifar10`` (the tarball)
    and ``image_folder`` (the tree root); ignored for ``digits`` and ``synthetic``."""

    image_size: int = 0
    """Side in pixels that images are resized to at prep time; 0 keeps the dataset's native size
    (``image_folder`` needs a value, e.g. 64 or 224)."""

    val_fraction: float = 0.1
    """Fraction of the training samples held out for validation after each epoch."""

    test_fraction: float = 0.2
    """Fraction held out for the final test, for datasets without a test split (digits, synthetic,
    an unsplit image folder)."""

    num_shards: int = 4
    """Files each split is written as. Worker ``r`` of ``n`` streams shards ``r, r+n, ...``, so this must
    be >= ``scaling.num_workers``; a multiple of it balances the workers."""

    split_seed: int = 0
    """Seed of the train/val/test split and shard assignment, in [0, 2**32 - 1]; part of the prep cache key."""

    synthetic_num_samples: int = 4096
    """Number of samples the ``synthetic`` dataset generates."""

    synthetic_image_size: int = 32
    """Side in pixels of ``synthetic`` images."""

    synthetic_num_classes: int = 10
    """Number of classes of the ``synthetic`` dataset."""

    text_field: str = "text"
    """Text sources (``causal_lm``, ``sequence_classification``): the field of each ``.jsonl`` line, or the column
    of ``.parquet`` and ``.csv`` files, that holds the text (``.txt`` files are text whole)."""

    label_field: str = "label"
    """``labeled_text`` (``sequence_classification``): the field or column that holds each record's label, a string
    or an integer; the distinct labels are the classes (in the manifest, sorted: numerically when all are
    integers)."""

    seq_len: int = 128
    """Text sources: tokens per training sequence; must fit the model's context (``model.context_length``).
    ``sequence_classification``: the most tokens of a sample, its start and end tokens included (longer texts are
    cut, and counted in the manifest)."""

    tokenizer: str = "byte"
    """Text sources: ``byte`` (byte-level, 256 tokens, needs no file) or a Hugging Face ``tokenizer.json`` at a
    local path or ``s3://`` URI. Its vocabulary sets the model's. ``sequence_classification`` also takes a
    directory holding a ``tokenizer.json`` (a pretrained model's, the same as ``model.pretrained``)."""

    max_text_bytes: int = 0
    """Text sources: read at most this many bytes of text (whole files, in order); 0 reads everything."""

    max_bad_samples: int = 100
    """Image sources: images that do not decode are skipped and counted (the count and the first paths go in the
    manifest and the prep log); prep fails when more than this many are bad. 0 fails on the first."""

    prep_num_workers: int = 2
    """Tasks prep runs at once on its Ray cluster, one CPU each, and the prep task's RayJob's worker pods: image
    sources (``cifar10``, ``image_folder``) write a shard per Ray task, text (``causal_lm``) tokenises about a MB
    per Ray task. Text prepared outside Ray (a user's ``dataset_source``) uses this many tokenizer threads."""

    prep_memory_per_worker_gib: float = 4.0
    """Image sources on a cluster: memory of each prep worker pod of the prep task's RayJob (one per
    ``prep_num_workers``, 1 CPU each), GiB. A shard task holds one Parquet row group of images at a time (256), not
    its shard: ~140 MB over the process's imports for 256 px JPEGs, whatever the shard's size. A text task holds
    about a MB of text and its ids."""

    loader_num_workers: int = 2
    """Loader processes per training worker that read, decode and augment encoded images (Parquet shards) ahead of
    the step (torch ``DataLoader`` workers); 0 reads in the training thread. Arrays (``.npz`` shards of digits,
    synthetic and text data) are already decoded and are always read in the training thread. What a step sees does
    not depend on it. Each holds the encoded images of the shard it is reading: about this many times the largest
    shard of host memory per training worker (``data.num_shards`` sets their size)."""

    loader_prefetch_batches: int = 4
    """Batches the loader processes of one training worker keep ready, in all."""

    augment: bool = True
    """Encoded images (``cifar10``, ``image_folder``): random-resized-crop and horizontal flip for training; resize
    and centre crop for evaluation either way. Arrays (``digits``, ``synthetic``) are not augmented."""

    augment_min_crop_scale: float = 0.25
    """The smallest area, as a fraction of the image, random-resized-crop keeps (torchvision's default is 0.08)."""

    cache_dir: str = ""
    """Local directory that shards read from ``s3://`` are cached in while training; empty: a directory under the
    system's temporary directory."""

    cache_max_bytes: int = 16 * 2**30
    """Bound of the shard cache in bytes: the least recently used shards are deleted beyond it."""

    def __post_init__(self) -> None:
        _choice("data.dataset", self.dataset, dataset_names())
        source = DATASET_SOURCES[self.dataset]
        if source.needs_path and not self.path:
            self._refuse("path", f"dataset {self.dataset!r} needs data.path set to a local path or s3:// URI")
        _non_negative("data.image_size", self.image_size)
        _seed("data.split_seed", self.split_seed)
        if source.needs_image_size and self.image_size == 0:
            self._refuse("image_size", f"{self.dataset} needs a fixed size such as 64 or 224")
        _fraction("data.val_fraction", self.val_fraction)
        _fraction("data.test_fraction", self.test_fraction)
        if self.val_fraction + self.test_fraction >= 1:
            self._refuse("val_fraction", "val_fraction + test_fraction must leave training samples (< 1)")
        _positive("data.num_shards", self.num_shards)
        _positive("data.synthetic_num_samples", self.synthetic_num_samples)
        _positive("data.synthetic_image_size", self.synthetic_image_size)
        if self.synthetic_num_classes < 2:
            self._refuse("synthetic_num_classes", "it must be >= 2")
        if not self.text_field:
            self._refuse("text_field", "name the JSON field or Parquet column that holds the text")
        if not self.label_field or self.label_field == self.text_field:
            self._refuse("label_field", "name the field or column that holds the label (not the text)")
        _between("data.seq_len", self.seq_len, 2, 1_048_576)
        if not self.tokenizer:
            self._refuse("tokenizer", "use 'byte' or the path or s3:// URI of a tokenizer.json")
        _non_negative("data.max_text_bytes", self.max_text_bytes)
        _non_negative("data.max_bad_samples", self.max_bad_samples)
        _between("data.prep_num_workers", self.prep_num_workers, 1, 1024)
        _pod_memory_gib("data.prep_memory_per_worker_gib", self.prep_memory_per_worker_gib)
        _between("data.loader_num_workers", self.loader_num_workers, 0, 64)
        _positive("data.loader_prefetch_batches", self.loader_prefetch_batches)
        if not 0 < self.augment_min_crop_scale <= 1:
            self._refuse("augment_min_crop_scale", "it must be in (0, 1]")
        _positive("data.cache_max_bytes", self.cache_max_bytes)
        for url in (self.path, self.tokenizer):
            redact(url)  # remembers any credentials in it, which libraries may quote without the URL's scheme

    def for_prep(self) -> DataConfig:
        """This config with :data:`LOADER_FIELDS` at their defaults: what data prep is given and cached by, so a
        change to how training reads the shards (loader processes, augmentation, the local cache) re-runs no prep."""
        defaults = DataConfig()
        return dataclasses.replace(self, **{name: getattr(defaults, name) for name in LOADER_FIELDS})


def no_training_samples_error(cfg: DataConfig, count: int, *, source: str) -> ValueError:
    """The error for split fractions that, rounded, leave none of ``source``'s ``count`` samples to train on."""
    return ValueError(
        f"data.val_fraction={cfg.val_fraction!r} and data.test_fraction={cfg.test_fraction!r} are invalid: rounded, "
        f"they hold out all {count} sample(s) of {source} and leave none to train on; lower them or add samples"
    )


LOADER_FIELDS = (
    "loader_num_workers",
    "loader_prefetch_batches",
    "augment",
    "augment_min_crop_scale",
    "cache_dir",
    "cache_max_bytes",
)
"""The ``DataConfig`` fields only training's loader reads: data prep's output does not depend on them."""


MAX_NAME_PATTERNS = 256
"""Most name patterns in one list (``model.freeze``, ``model.lora.target_modules``, ``optimizer.param_groups``)."""


def _name_patterns(path: str, patterns: Any) -> None:
    """``patterns`` checked as a list of non-empty ``fnmatch`` name patterns, each once. Types too: a section built
    in Python reaches ``__post_init__`` without the schema layer."""
    if not isinstance(patterns, list) or len(patterns) > MAX_NAME_PATTERNS:
        invalid(path, patterns, f"give a list of at most {MAX_NAME_PATTERNS} name patterns")
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern.strip() or len(pattern) > 1000 or "\0" in pattern:
            invalid(path, pattern, "give a parameter or module name pattern such as 'bert.encoder.*'")
    if len(set(patterns)) != len(patterns):
        invalid(path, patterns, "name each pattern once")


@dataclass
class LoraConfig(_Section, path="model.lora"):
    """Low-rank adapters (LoRA, through Hugging Face ``peft``): each target linear layer ``W`` becomes
    ``W x + (alpha / rank) * B A x`` with ``A`` (rank x in) and ``B`` (out x rank, zero at the start) the only weights
    that train; ``W`` stays frozen. See :mod:`training_core.train.lora`."""

    enabled: bool = False
    """Adapt the model with LoRA: only the adapters (and, with ``train_head``, the classifier head) train, and only
    they are checkpointed; the registered model is the merged one (``W + (alpha / rank) * B A``), loadable without
    ``peft``. Off: the whole model trains."""

    rank: int = 8
    """Rank of each adapter (``r``): the adapter of an ``out x in`` layer has ``rank * (in + out)`` weights."""

    alpha: float = 16.0
    """Scale of the adapters' update: it is multiplied by ``alpha / rank``."""

    dropout: float = 0.0
    """Dropout on the adapters' input during training, in [0, 1)."""

    target_modules: list[str] = field(default_factory=lambda: ["query", "value"])
    """Which layers get an adapter, by module name as ``peft`` matches them: a pattern names a module whose full name
    is the pattern or ends with ``.`` and the pattern (``query`` adapts every ``...attention.self.query``). BERT-class
    encoders: ``query``, ``key``, ``value``, ``dense``; GPT-2 (``causal_lm``): ``c_attn``, ``c_proj``, ``c_fc``; an
    image MLP: its linear layers' names. Each pattern must name at least one layer of the model (checked before any
    worker starts)."""

    train_head: bool = True
    """Also train the classifier head in full (the model's last linear layer, the one ``model.new_head``
    re-initialises): a head fitted to the data's classes is new and has no pretrained weights to adapt. A head whose
    weight is tied to another parameter (a language model's output layer, tied to the token embeddings) stays frozen
    either way."""

    def __post_init__(self) -> None:
        if self.rank <= 0:
            self._refuse("rank", "give the adapters' rank, a whole number > 0 (e.g. 8)")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            self._refuse("alpha", "give a scale > 0 (e.g. 2 * rank)")
        _fraction("model.lora.dropout", self.dropout)
        _name_patterns("model.lora.target_modules", self.target_modules)
        if self.enabled and not self.target_modules:
            self._refuse("target_modules", "name at least one layer to adapt, e.g. query")


@dataclass
class ModelConfig(_Section, path="model"):
    name: str = "resnet18"
    """Architecture. ``image_classification``: ``small_cnn`` or a torchvision model (resnet18/34/50/101/152,
    vit_b_16), each adapted to the dataset's channels, image size and number of classes (small inputs get a 3x3
    stem without max-pool; ViT gets a patch size that divides the image). ``causal_lm``: a GPT-2 size
    (gpt2-tiny, gpt2-mini, gpt2, gpt2-medium, gpt2-large, gpt2-xl) or any ``transformers`` causal-LM config class
    by name (``LlamaConfig``, ``GPTNeoXConfig``...), randomly initialised. ``sequence_classification``: a BERT size
    (bert-tiny, bert-mini, bert-small, bert-medium, bert-base, bert-large) or a ``transformers`` config class with a
    sequence-classification model (``RobertaConfig``, ``DistilBertConfig``...), randomly initialised; or empty with
    a Hugging Face directory in ``pretrained`` (its ``config.json`` is the architecture). ``masked_lm``: a BERT size
    or a config class with a masked-LM model. A user workload reads it as it likes."""

    num_layers: int = 0
    """``causal_lm``, ``sequence_classification``: transformer blocks; 0 keeps the named size's."""

    hidden_size: int = 0
    """``causal_lm``, ``sequence_classification``: model width; 0 keeps the named size's."""

    num_heads: int = 0
    """``causal_lm``, ``sequence_classification``: attention heads (must divide ``hidden_size``); 0 keeps the named
    size's."""

    context_length: int = 0
    """``causal_lm``, ``sequence_classification``: positions the model attends over; 0 keeps the named size's (1024
    for GPT-2 sizes, 512 for BERT sizes)."""

    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm so statistics span all workers. Only takes effect on GPU
    with more than one worker; ignored (with a warning) on CPU, where PyTorch has no SyncBatchNorm."""

    activation_checkpointing: str = "none"
    """Recompute blocks' activations in the backward pass instead of keeping them: ``none``; ``full`` (every block:
    the least memory, about a third more compute); ``selective`` (every ``activation_checkpointing_every_k``-th
    block). Blocks are the model's repeated units (ResNet stages, ViT and GPT blocks, a user workload's ``blocks``);
    gradients are the same as without. Works under both ``scaling.strategy`` values."""

    activation_checkpointing_every_k: int = 2
    """``selective``: checkpoint blocks 0, k, 2k, ... (k >= 1; 1 is ``full``)."""

    channels_last: bool = True
    """On a GPU, hold a model with 2-D convolutions (and its inputs) in the channels-last memory format, the layout
    tensor cores read without transposes. Ignored on CPU and for models without convolutions."""

    compile: bool = False
    """``torch.compile`` the model (after sharding or DDP): fused kernels, at the cost of compiling during the first
    steps (and again for a new input shape)."""

    pretrained: str = ""
    """Weights to start from (``image_classification``, ``sequence_classification``): a local path or ``s3://`` URI
    of a ``.safetensors`` state dict, a ``.pt``/``.pth`` state dict (read with ``torch.load(weights_only=True)``)
    or a Hugging Face model directory (``config.json`` plus ``model.safetensors`` or sharded safetensors with their
    index). Pickles (``pytorch_model.bin``) are refused. Names and shapes must match ``model.name``'s model, checked
    before any worker starts. A run resuming its own checkpoint keeps the checkpoint's weights. Empty: random
    initialisation."""

    pretrained_sha256: str = ""
    """The sha256 of the ``pretrained`` weights (of the file, or of a model directory's ``sha256sum``-style listing
    of its files). Empty: computed before any worker starts and recorded here, so the MLflow params name the
    weights' content. Set: pins the weights (a run whose weights have another hash fails), and the Flyte cache key,
    which is the config, then names their content rather than their path."""

    new_head: bool | str = False
    """With ``pretrained``: ``true`` re-initialises the classifier head (the model's last linear layer, e.g. a
    ResNet's ``fc``) when its class count differs from the data's (1,000 ImageNet classes to 10); a name pattern
    (``fc.*``, ``classifier.*``; several separated by commas; ``*`` matches dots too) re-initialises the tensors it
    names, whatever their shapes, and must name at least one. Re-initialised tensors take their layer's
    ``reset_parameters()`` under ``loop.seed`` (the same values on every rank, with DDP or FSDP); the log lists
    them. ``false`` (or empty) loads every tensor."""

    encoder_config: dict[str, Any] = field(default_factory=dict)
    """``sequence_classification``: the ``transformers`` config (a ``config.json``'s contents, with its
    ``model_type``) of the encoder. Filled in from ``pretrained``'s ``config.json`` before any worker starts, so a
    checkpoint rebuilds the architecture without the pretrained files; given with ``model.name`` empty and no
    ``pretrained``, a randomly initialised encoder of that architecture."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    """Parameter-efficient fine-tuning with low-rank adapters (off by default)."""

    freeze: list[str] = field(default_factory=list)
    """Parameters that do not train (``requires_grad`` off, not in the optimizer, not in the checkpoint), as
    ``fnmatch`` patterns of their full names (``bert.embeddings.*``, ``*.bias``; ``*`` matches dots too), matched
    against the names of the model as it trains (with LoRA: after the adapters are added). Each pattern must match a
    parameter (checked before any worker starts). Empty: everything trains."""

    def __post_init__(self) -> None:
        _choice("model.activation_checkpointing", self.activation_checkpointing, ("none", "full", "selective"))
        self._check_pretrained()
        _positive("model.activation_checkpointing_every_k", self.activation_checkpointing_every_k)
        if self.encoder_config:
            self.encoder_config = json_value("model.encoder_config", self.encoder_config)
            if not isinstance(self.encoder_config.get("model_type"), str):
                self._refuse("encoder_config", "give a transformers config.json with model_type")
        if not self.name and not (self.pretrained or self.encoder_config):
            examples = ", ".join(list(IMAGE_MODELS)[:2])
            self._refuse("name", f"name an architecture, e.g. {examples} or gpt2-tiny")
        for name in ("num_layers", "hidden_size", "num_heads", "context_length"):
            _non_negative(f"model.{name}", getattr(self, name))
        if self.num_heads and self.hidden_size and self.hidden_size % self.num_heads:
            self._refuse("num_heads", f"it must divide model.hidden_size={self.hidden_size}")
        _name_patterns("model.freeze", self.freeze)

    def _check_pretrained(self) -> None:
        scheme = self.pretrained.partition("://")[0] if "://" in self.pretrained else ""
        if scheme not in ("", "s3", "file") or "\0" in self.pretrained:
            self._refuse("pretrained", "give a local path or an s3:// URI of the weights")
        if self.pretrained_sha256 and not self.pretrained:
            self._refuse("pretrained_sha256", "it pins model.pretrained: set that too")
        if self.pretrained_sha256 and not re.fullmatch(r"[0-9a-f]{64}", self.pretrained_sha256):
            self._refuse("pretrained_sha256", "give 64 lowercase hex digits (sha256sum's)")
        if isinstance(self.new_head, str) and self.new_head.strip().lower() in ("", "true", "false", "yes", "no"):
            self.new_head = self.new_head.strip().lower() in ("true", "yes")  # YAML, overrides and forms say it so
        if isinstance(self.new_head, str) and (len(self.new_head) > 1000 or "\0" in self.new_head):
            self._refuse("new_head", "give true, false or a short name pattern such as 'fc.*'")
        if self.new_head and not self.pretrained:
            self._refuse("new_head", "it re-initialises the head of model.pretrained: set that too")


@dataclass
class WorkloadConfig(_Section, path="workload"):
    name: str = "image_classification"
    """What is trained: ``image_classification`` (the image models and datasets), ``causal_lm`` (GPT-style
    language models on text), ``array_classification`` and ``array_regression`` (a ``model_factory``'s model on the
    user's own arrays), ``sequence_classification`` (BERT-class encoders classifying labelled text), ``masked_lm``
    (BERT-style pretraining on ``causal_lm``'s text), or user
    code as ``package.module:attribute``: a callable called with no arguments
    (a class or a factory; with ``params=`` when it has that parameter) that returns a
    :class:`training_core.workloads.Workload`."""

    model_factory: str = ""
    """A built-in workload with a user model: ``package.module:attribute`` of a callable
    ``(config, manifest) -> torch.nn.Module``. Empty uses ``model.name`` (``array_classification`` and
    ``array_regression`` need one)."""

    dataset_source: str = ""
    """A built-in workload with user data: ``package.module:attribute`` of a callable ``(data_config)`` (the
    config's ``data`` section, a ``DataConfig``) returning a ``training_core.data.sources.RawDataset``
    (``image_classification``), a mapping of document name to text (``causal_lm``), or the samples
    (``array_classification``, ``array_regression``): a mapping of array name to numeric array (``inputs`` and
    ``targets``, first axis the samples; or of split name to such mappings), a PyTorch map-style ``Dataset`` of
    ``(input, target)`` items, or a Hugging Face ``datasets.Dataset`` with those columns. Empty uses
    ``data.dataset`` (the array workloads: the ``.npz`` file ``data.path``).
    A source with a parameter named ``params`` is also given :attr:`params` as ``params=``."""

    params: dict[str, Any] = field(default_factory=dict)
    """The user's own hyperparameters: names (Python identifiers) to JSON values (numbers, strings, booleans, null,
    lists, mappings), at most :data:`MAX_WORKLOAD_PARAMS_BYTES` as JSON, e.g. ``{kernel_size: 5, dropout: 0.1}``. A
    user workload gets them as its ``params`` attribute: the mapping, or an instance of the dataclass it names as
    ``params_type`` (validated before any worker starts); a ``workload.name`` factory, a ``model_factory`` or a
    ``dataset_source`` with a parameter named ``params`` is also called with ``params=`` (the mapping, or an
    instance of the ``params_type`` the callable declares). Searchable as
    ``workload.params.<name>``, logged as MLflow params, and part of the cache keys (prep's too where prep can read
    them: a user workload or a ``dataset_source``)."""

    primary_metric: str = ""
    """The metric that ranks models and gates registration, for a built-in workload that offers a choice
    (``sequence_classification``: ``accuracy`` or ``macro_f1``). Empty: the workload's own."""

    def __post_init__(self) -> None:
        self.params = checked_params(self.params)
        choices = PRIMARY_METRICS.get(self.name, ())
        if self.primary_metric and self.primary_metric not in choices:
            fix = f"choose one of {', '.join(choices)}" if choices else "leave it empty: this workload ranks on its own"
            self._refuse("primary_metric", fix)
        from_user = self.name not in WORKLOADS
        if from_user and not is_import_path(self.name):
            self._refuse("name", f"choose {', '.join(WORKLOADS)} or {IMPORT_PATH_FIX}")
        for name in ("model_factory", "dataset_source"):
            value = getattr(self, name)
            if value and from_user:
                self._refuse(name, "it applies to a built-in workload; a user workload builds its own")
            if value and not is_import_path(value):
                self._refuse(name, IMPORT_PATH_FIX)

    def for_prep(self) -> WorkloadConfig:
        """This workload as data prep is given and cached by it: without the model factory, which prep never calls
        (a new model re-runs no prep), and without :attr:`params` where nothing prep runs can read them (a built-in
        workload on its own data)."""
        prep_reads_params = self.name not in WORKLOADS or bool(self.dataset_source)
        return dataclasses.replace(
            self, model_factory="", primary_metric="", params=self.params if prep_reads_params else {}
        )


MAX_WORKLOAD_PARAMS_BYTES = 16_384
"""Most ``workload.params`` may weigh as JSON: room for many hyperparameters, small enough for every cache key,
MLflow param (6,000 characters a value) and launch form that carries them."""

PARAMS_FIX = "give a mapping of names (Python identifiers) to JSON values, e.g. {kernel_size: 5, activation: relu}"


def checked_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """``workload.params`` checked (identifier keys, JSON values, bounded size) with its mappings' keys sorted, so
    equal params make equal cache keys whatever order they were written in."""
    import json
    import keyword

    if not isinstance(params, Mapping):
        invalid("workload.params", params, PARAMS_FIX)
    for key in params:
        if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
            invalid("workload.params", key, f"each name must be a Python identifier (a dataclass field); {PARAMS_FIX}")
    checked = {key: json_value(f"workload.params.{key}", params[key]) for key in sorted(params)}
    size = len(json.dumps(checked))
    if size > MAX_WORKLOAD_PARAMS_BYTES:
        invalid(
            "workload.params",
            checked,
            f"it weighs {size:_} bytes as JSON, more than {MAX_WORKLOAD_PARAMS_BYTES:_}: pass hyperparameters here, "
            "and data or large tables through files the workload reads",
        )
    return checked


def json_value(path: str, value: Any, depth: int = 0) -> Any:
    """``value`` when it is a JSON value (mappings' keys sorted), else ``ValueError`` naming ``path``."""
    if depth > MAX_YAML_DEPTH:
        invalid(path, value, f"it nests deeper than {MAX_YAML_DEPTH} levels")
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        invalid(path, value, "expected a whole number in [-2**63, 2**63 - 1] (int64)")
    if isinstance(value, float) and not math.isfinite(value):
        invalid(path, value, "expected a finite number, not inf or nan (JSON has neither)")
    if value is None or isinstance(value, (str, int, float)):  # bool is an int
        return value
    if isinstance(value, (list, tuple)):
        return [json_value(f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        if not all(isinstance(key, str) for key in value):
            invalid(path, value, "a mapping's keys must be strings (JSON objects)")
        return {key: json_value(f"{path}.{clip(key, 60)}", value[key], depth + 1) for key in sorted(value)}
    invalid(
        path,
        value,
        f"a {type(value).__name__} is not a JSON value: use a number, string, boolean, null, list or mapping",
    )


def is_import_path(value: str) -> bool:
    """Whether ``value`` has the form ``package.module:attribute``."""
    module, sep, attribute = value.partition(":")
    return bool(sep) and all(part.isidentifier() for part in module.split(".")) and attribute.isidentifier()


@dataclass
class OptimizerConfig(_Section, path="optimizer"):
    name: str = "adamw"
    """Optimizer: ``sgd`` (with momentum, Nesterov), ``adam`` or ``adamw``."""

    lr: float = 3e-3
    """Peak learning rate, reached after the warmup."""

    weight_decay: float = 0.01
    """Decoupled (adamw) or L2 (sgd, adam) weight decay."""

    momentum: float = 0.9
    """SGD momentum; ignored by adam/adamw."""

    max_grad_norm: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping (the norm is still logged)."""

    fused: bool = True
    """On a GPU, PyTorch's fused kernel of the optimizer (one kernel for every parameter instead of a loop of
    them); on CPU the default (``foreach``) implementation either way."""

    param_groups: dict[str, float] = field(default_factory=dict)
    """Parameters with a learning rate of their own: ``fnmatch`` pattern of full parameter names -> peak learning
    rate (``{"bert.*": 2.0e-5, "classifier.*": 1.0e-3}``: a lower one for the backbone than the head). The schedule
    (warmup, decay) scales every group alike; parameters no pattern matches take ``lr``. Each pattern must match a
    trainable parameter, and no parameter two patterns (checked before any worker starts). Tuning searches a group's
    rate as ``optimizer.param_groups.<pattern>`` (the rest of the path is the pattern, dots and all)."""

    def __post_init__(self) -> None:
        _choice("optimizer.name", self.name, ("sgd", "adam", "adamw"))
        _positive("optimizer.lr", self.lr)
        if not isinstance(self.param_groups, dict):
            self._refuse("param_groups", "give a mapping of name pattern to learning rate")
        _name_patterns("optimizer.param_groups", list(self.param_groups))
        for pattern, lr in self.param_groups.items():
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
                invalid(f"optimizer.param_groups[{pattern!r}]", lr, "give the group's peak learning rate, > 0")
        _non_negative("optimizer.weight_decay", self.weight_decay)
        _fraction("optimizer.momentum", self.momentum)
        _non_negative("optimizer.max_grad_norm", self.max_grad_norm)


@dataclass
class ScheduleConfig:
    name: str = "cosine"
    """LR shape after warmup: ``cosine`` decay to ``min_lr_ratio * lr``, or ``constant``."""

    warmup_steps: int = 20
    """Optimizer steps of linear warmup from ``lr / (warmup_steps + 1)`` to ``lr``."""

    min_lr_ratio: float = 0.0
    """Final LR of the cosine decay as a fraction of ``optimizer.lr``."""

    def __post_init__(self) -> None:
        _choice("schedule.name", self.name, ("cosine", "constant"))
        _non_negative("schedule.warmup_steps", self.warmup_steps)
        _between("schedule.min_lr_ratio", self.min_lr_ratio, 0, 1)


@dataclass
class LoopConfig(_Section, path="loop"):
    epochs: int = 6
    """Passes over the training split, at most ``MAX_EPOCHS`` (1,000,000)."""

    batch_size: int = 32
    """Samples per micro-batch on each worker. The global batch of one optimizer step is
    ``batch_size * grad_accum_steps * scaling.num_workers``. ``auto`` (stored as 0): each worker takes the largest
    micro-batch that fits ``memory_budget_gib`` and divides its share of ``global_batch_size``, and accumulates
    gradients to keep that global batch (measured at start: see :mod:`training_core.train.batch_size`)."""

    global_batch_size: int = 0
    """Samples per optimizer step over all workers. Required with ``batch_size: auto``; otherwise 0, or equal to
    ``batch_size * grad_accum_steps * scaling.num_workers`` (a check)."""

    memory_budget_gib: float = 0.0
    """``batch_size: auto``: memory a worker's training step may use, GiB. 0: 80% of the GPU's memory, or of
    ``scaling.memory_per_worker_gib`` on CPU."""

    oom_policy: str = "fail"
    """A CUDA out-of-memory error in a step: ``fail`` (the error stops the run) or ``reduce`` (the step is retried
    with half the micro-batch and twice the accumulation, the same global batch, for the rest of the run; counted
    in ``training_oom_retries_total``). The out-of-memory alert fires either way."""

    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step; DDP syncs gradients only on the last one."""

    max_steps: int = 0
    """Stop after this many optimizer steps in total; 0 runs all epochs. For smoke tests and benchmarks."""

    log_interval_steps: int = 5
    """Log step metrics (stdout, MLflow) every this many optimizer steps, on rank 0."""

    seed: int = 0
    """Seed of model init, shuffling and dropout, in [0, 2**32 - 1]. Every worker uses it, so replicas start
    identical."""

    stop_at_epoch: int = 0
    """End this run after this many epochs (counted from the start of training, not of this run) while the
    LR schedule still spans ``epochs``; 0 runs to ``epochs``. Successive halving and PBT train a trial in
    such slices, each resuming from the previous slice's checkpoint, so no work is repeated."""

    nonfinite_policy: str = "stop"
    """What a step whose loss or gradient norm is NaN or infinite does (checked once per log window, from counts
    kept on the device): ``stop`` fails the run at that window's end, before it logs or checkpoints anything, with
    an error naming the step and the settings to change (not retried: rerunning diverges the same way);
    ``skip_step`` skips the optimizer update of such steps and counts them, and stops the same way after
    ``max_nonfinite_steps`` of them; on a GPU it copies the weights and optimizer state every step, as the skip
    is decided on the device rather than by waiting for it. Under fp16 (a GradScaler) non-finite gradients are the
    scaler's routine overflow and it skips those steps itself; only a non-finite loss counts there."""

    max_nonfinite_steps: int = 10
    """With ``nonfinite_policy='skip_step'``: skipped steps tolerated in one run attempt before it stops, in
    [1, 1_000_000]. Ignored with ``stop``."""

    def __post_init__(self) -> None:
        _between("loop.epochs", self.epochs, 1, MAX_EPOCHS)
        _non_negative("loop.stop_at_epoch", self.stop_at_epoch)
        if self.stop_at_epoch > self.epochs:
            self._refuse("stop_at_epoch", f"it must be <= loop.epochs={self.epochs} (or 0 to run all epochs)")
        _non_negative("loop.batch_size", self.batch_size)
        _positive("loop.grad_accum_steps", self.grad_accum_steps)
        _non_negative("loop.global_batch_size", self.global_batch_size)
        _between("loop.memory_budget_gib", self.memory_budget_gib, 0, MAX_MEMORY_GIB)
        _choice("loop.oom_policy", self.oom_policy, ("fail", "reduce"))
        if self.batch_size == AUTO and not self.global_batch_size:
            self._refuse(
                "batch_size",
                "auto (or 0) sizes the micro-batch to what fits and keeps loop.global_batch_size fixed, which is "
                "not set: set loop.global_batch_size (e.g. 256), or a batch size > 0",
            )
        if self.batch_size == AUTO and self.grad_accum_steps != 1:
            self._refuse(
                "grad_accum_steps",
                "loop.batch_size=auto sets the accumulation itself (loop.global_batch_size over the micro-batch that "
                "fits); leave it at 1",
            )
        _non_negative("loop.max_steps", self.max_steps)
        _positive("loop.log_interval_steps", self.log_interval_steps)
        _seed("loop.seed", self.seed)
        _choice("loop.nonfinite_policy", self.nonfinite_policy, ("stop", "skip_step"))
        _between(
            "loop.max_nonfinite_steps",
            self.max_nonfinite_steps,
            1,
            MAX_NONFINITE_STEPS,
            "; it counts the skipped steps loop.nonfinite_policy='skip_step' tolerates",
        )


def _label_key(path: str, value: str) -> None:
    if not _LABEL_KEY.fullmatch(value):
        invalid(path, value, "use a Kubernetes label key: [prefix/]name, the name at most 63 of A-Z a-z 0-9 - _ .")


def _label_value(path: str, value: str) -> None:
    if not _LABEL_VALUE.fullmatch(value):
        invalid(path, value, "use a Kubernetes label value: at most 63 of A-Z a-z 0-9 - _ ., alphanumeric at both ends")


@dataclass
class Toleration(_Section, path="scaling.gpu_tolerations[]"):
    """A Kubernetes toleration of the GPU worker pods (see the Kubernetes docs on taints and tolerations)."""

    key: str = "nvidia.com/gpu"
    """Taint key to tolerate; empty with ``operator: Exists`` tolerates every taint."""
    operator: str = "Exists"
    """``Exists`` (any value) or ``Equal`` (the taint's value must be ``value``)."""
    value: str = ""
    """Taint value, for ``operator: Equal``."""
    effect: str = "NoSchedule"
    """``NoSchedule``, ``PreferNoSchedule``, ``NoExecute``, or empty for every effect."""

    def __post_init__(self) -> None:
        _choice("scaling.gpu_tolerations[].operator", self.operator, ("Exists", "Equal"))
        if self.effect not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            self._refuse("effect", "choose NoSchedule, PreferNoSchedule, NoExecute, or '' (every effect)")
        if self.key:
            _label_key("scaling.gpu_tolerations[].key", self.key)
        elif self.operator != "Exists":
            self._refuse("key", "an empty key tolerates every taint only with Exists")
        _label_value("scaling.gpu_tolerations[].value", self.value)
        if self.operator == "Exists" and self.value:
            self._refuse("value", "operator Exists takes no value; use Equal")


@dataclass
class ScalingConfig(_Section, path="scaling"):
    num_workers: int = 2
    """Ray Train workers, one DDP rank each."""

    use_gpu: bool = False
    """Give each worker ``gpus_per_worker`` GPUs and train with CUDA and nccl."""

    cpus_per_worker: float = 1.0
    """CPUs Ray reserves per worker; also the worker pods' CPU request on a cluster. In [0.001, 1024]: a
    millicore is the least Kubernetes can request."""

    gpus_per_worker: int = 1
    """GPUs per worker when ``use_gpu``; also the worker pods' GPU limit."""

    memory_per_worker_gib: float = 4.0
    """Memory request and limit of each Ray worker pod, GiB, in [0.25, 32768]: below 256 MiB a Ray worker does not
    start (see ``MIN_MEMORY_GIB``)."""

    head_cpus: float = 1.0
    """CPU request of the Ray head pod, which runs the task driver; in [0.001, 1024] like ``cpus_per_worker``."""

    head_memory_gib: float = 4.0
    """Memory request and limit of the Ray head pod, GiB, in [0.25, 32768] like ``memory_per_worker_gib``."""

    torch_threads_per_worker: int = 1
    """``torch.set_num_threads`` in each worker; match it to ``cpus_per_worker`` to avoid oversubscription."""

    backend: str = "auto"
    """Collective backend: ``auto`` picks nccl on GPU and gloo on CPU."""

    collective_timeout_s: int = 1800
    """Seconds a collective may wait before DDP gives up (a hung peer fails instead of hanging)."""

    shm_per_worker_gib: float = 0.0
    """Size limit of each Ray pod's memory-backed ``/dev/shm``, GiB: Ray's object store, data-loader processes and
    NCCL use it, and a container runtime's default is 64 MiB. 0 (default): ``SHM_SHARE`` (30%) of the pod's
    memory, the share Ray's object store takes by default. It counts against the pod's memory, so at most
    ``memory_per_worker_gib``."""

    gpu_node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels GPU worker pods must match when ``use_gpu``, e.g.
    ``{"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}``; empty: any node with the GPUs."""

    gpu_tolerations: list[Toleration] = field(default_factory=lambda: [Toleration()])
    """Taints GPU worker pods tolerate when ``use_gpu``; the default tolerates the ``nvidia.com/gpu`` taint that
    managed Kubernetes puts on GPU nodes."""

    strategy: str = "ddp"
    """How workers hold the model: ``ddp`` (each a full replica; gradients all-reduced) or ``fsdp`` (FSDP2
    ``fully_shard`` per block: parameters, gradients and optimizer state sharded across workers, so a model
    ``num_workers`` times larger fits). Under ``fsdp`` with ``precision.mode`` bf16 parameters are held in bf16 for
    compute and gradients reduced in fp32, and checkpoints are sharded (every worker writes its shard through
    ``torch.distributed.checkpoint``; a run resumes on any number of workers)."""

    fsdp_cpu_offload: bool = False
    """``fsdp``: keep sharded parameters, gradients and optimizer state in host memory and copy each block to the
    device for its forward and backward (FSDP2's ``CPUOffloadPolicy``): larger models, slower steps."""

    ddp_bucket_cap_mb: int = DDP_DEFAULT_BUCKET_CAP_MB
    """``ddp``: size of the gradient buckets DDP all-reduces while the backward pass goes on, MiB (PyTorch's
    default 25). Larger buckets: fewer, larger all-reduces (fast networks); smaller: earlier overlap. At the default
    the first bucket (the last layers' gradients, ready first) is 1 MiB, as in PyTorch, so communication starts
    early in the backward pass; any other value caps the first bucket too (PyTorch gives the small first bucket
    only when no size is passed)."""

    ddp_gradient_as_bucket_view: bool = True
    """``ddp``: gradients are views into the all-reduce buckets, saving a copy of every gradient (memory and time)."""

    ddp_static_graph: bool = False
    """``ddp``: the model uses the same parameters in every step (no unused branches): DDP then skips per-step
    graph checks. Wrong for a model that skips parameters in some steps."""

    nccl_env: dict[str, str] = field(default_factory=dict)
    """NCCL settings for every worker (``NCCL_*`` variables, e.g. ``{"NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_IB_DISABLE": "1"}``): in the RayJob pods' environment on a cluster, and in each worker's before its first
    collective locally. See the troubleshooting guide in the README."""

    min_workers: int = 0
    """Elastic training: the fewest workers the job goes on with when nodes are lost (Ray Train's
    ``ScalingConfig(num_workers=(min_workers, num_workers))``). When a worker is lost, Ray Train restarts the group
    at once from the latest checkpoint on the workers the cluster still has room for (at least ``min_workers``); the
    loop keeps the global batch (``num_workers * loop.batch_size * loop.grad_accum_steps``) by accumulating more
    micro-batches, and the epoch's position (no sample repeated or skipped). It grows back to ``num_workers`` within
    ``elastic_resize_interval_s`` of the capacity returning. The RayJob's worker group gets these min and max
    replicas. 0 (default): not elastic, exactly ``num_workers``."""

    elastic_resize_interval_s: float = 60.0
    """Elastic training: seconds between Ray Train's checks for capacity that came back. A group smaller than
    ``num_workers`` restarts larger, from its latest checkpoint, at the first check that finds room for it."""

    elastic_start_timeout_s: float = 20.0
    """Elastic training: seconds a (re)start waits for its workers before Ray Train gives up and decides again on
    the workers the cluster has room for (its ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s by default, which a
    value set in the environment overrides). A restart right after a node is lost can still count the lost node's
    capacity until the cluster declares the node dead: the job then waits this long before it goes on without it."""

    min_allreduce_gbps: float = 0.0
    """Warn at job start when the measured all-reduce bus bandwidth is below this, Gbit/s (e.g. 100 on a
    200 Gbit/s fabric): a wrong network interface or NCCL's fallback to TCP sockets. 0: no warning. The figures
    are logged to MLflow and exported (``training_allreduce_bus_bandwidth_bytes_per_second``) either way."""

    def __post_init__(self) -> None:
        _positive("scaling.num_workers", self.num_workers)
        cpus_why = ": a millicore (0.001) is the least CPU a pod can request, and no node has more than 1024"
        _between("scaling.cpus_per_worker", self.cpus_per_worker, MIN_CPUS, MAX_CPUS, cpus_why)
        _positive("scaling.gpus_per_worker", self.gpus_per_worker)
        _pod_memory_gib("scaling.memory_per_worker_gib", self.memory_per_worker_gib)
        _between("scaling.head_cpus", self.head_cpus, MIN_CPUS, MAX_CPUS, cpus_why)
        _pod_memory_gib("scaling.head_memory_gib", self.head_memory_gib)
        _positive("scaling.torch_threads_per_worker", self.torch_threads_per_worker)
        _choice("scaling.backend", self.backend, ("auto", "gloo", "nccl"))
        _choice("scaling.strategy", self.strategy, ("ddp", "fsdp"))
        if self.fsdp_cpu_offload and self.strategy != "fsdp":
            self._refuse(
                "fsdp_cpu_offload",
                f"it offloads FSDP's shards and needs scaling.strategy='fsdp' (now {self.strategy!r})",
            )
        if self.backend == "nccl" and not self.use_gpu:
            self._refuse("backend", "nccl needs scaling.use_gpu=true; use gloo or auto on CPU")
        _positive("scaling.collective_timeout_s", self.collective_timeout_s)
        _between("scaling.min_workers", self.min_workers, 0, self.num_workers, " (0: not elastic)")
        _positive("scaling.elastic_resize_interval_s", self.elastic_resize_interval_s)
        _positive("scaling.elastic_start_timeout_s", self.elastic_start_timeout_s)
        if self.shm_per_worker_gib and not MIN_SHM_GIB <= self.shm_per_worker_gib <= self.memory_per_worker_gib:
            self._refuse(
                "shm_per_worker_gib",
                f"it must be 0 (30% of the pod's memory) or in [{MIN_SHM_GIB}, scaling.memory_per_worker_gib="
                f"{self.memory_per_worker_gib:g}]: /dev/shm is memory of the pod, and less than the 64 MiB default "
                "starves loaders",
            )
        _non_negative("scaling.min_allreduce_gbps", self.min_allreduce_gbps)
        _between("scaling.ddp_bucket_cap_mb", self.ddp_bucket_cap_mb, 1, 4096)
        for key, value in self.nccl_env.items():
            if not _NCCL_VARIABLE.fullmatch(key):
                invalid(
                    "scaling.nccl_env",
                    key,
                    "each key is an NCCL environment variable: NCCL_ followed by capitals, digits and _",
                )
            if len(value) > 1000 or "\x00" in value:
                invalid(f"scaling.nccl_env[{key}]", value, "use a value of at most 1000 characters, without NUL")
        for key, value in self.gpu_node_selector.items():
            _label_key("scaling.gpu_node_selector", key)
            _label_value(f"scaling.gpu_node_selector[{clip(key, 60)}]", value)

    @property
    def elastic(self) -> bool:
        """Whether the job may run on fewer workers than ``num_workers`` (``min_workers`` below it)."""
        return 0 < self.min_workers < self.num_workers

    def worker_counts(self) -> range:
        """Every number of workers the job may run on."""
        return range(self.min_workers if self.elastic else self.num_workers, self.num_workers + 1)

    def worker_shm_gib(self) -> float:
        """The size limit of a worker pod's ``/dev/shm``, GiB."""
        return self.shm_per_worker_gib or SHM_SHARE * self.memory_per_worker_gib

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.use_gpu else "gloo"


@dataclass
class SyncConfig(_Section, path="sync"):
    mode: str = "allreduce"
    """How workers' updates meet: ``allreduce`` (gradients averaged every step, as one process on the global batch
    would) or ``local_sgd`` (post-local SGD: gradients averaged every step for ``local_sgd_warmup_steps``, then each
    worker steps on its own gradients and the parameters are averaged every ``local_sgd_period_steps`` steps and at
    each epoch's end: far fewer collectives, for slow networks). ``local_sgd`` needs ``scaling.strategy='ddp'``."""

    local_sgd_period_steps: int = 8
    """``local_sgd``: optimizer steps between parameter averages, >= 2 (1 would be all-reduce with extra cost)."""

    local_sgd_warmup_steps: int = 100
    """``local_sgd``: first optimizer steps with gradients all-reduced, while the loss falls fastest."""

    def __post_init__(self) -> None:
        _choice("sync.mode", self.mode, ("allreduce", "local_sgd"))
        _between("sync.local_sgd_period_steps", self.local_sgd_period_steps, 2, 1_000_000)
        _non_negative("sync.local_sgd_warmup_steps", self.local_sgd_warmup_steps)


@dataclass
class PrecisionConfig:
    mode: str = "auto"
    """``fp32``; ``bf16`` autocast; ``fp16`` autocast with GradScaler (GPU only); ``auto`` picks bf16 on
    a GPU that supports it, else fp16 on GPU, and fp32 on CPU. fp16 on CPU falls back to fp32 with a
    warning."""

    def __post_init__(self) -> None:
        _choice("precision.mode", self.mode, ("auto", "fp32", "bf16", "fp16"))


@dataclass
class CheckpointConfig(_Section, path="checkpoint"):
    storage_path: str = ""
    """Root of the run's checkpoints and Ray Train state: a local path or an ``s3://`` URI. Empty: the
    Flyte train task uses ``<raw-output prefix>/checkpoints`` (S3 on a cluster or with
    ``--raw-output-data-prefix``)."""

    interval_steps: int = 0
    """Save every this many optimizer steps; 0 saves only at epoch ends (see ``at_epoch_end``)."""

    at_epoch_end: bool = True
    """Also save after each epoch's validation."""

    keep_last: int = 2
    """Most recent checkpoints kept; older ones are deleted after each successful save."""

    keep_best: bool = False
    """Also keep the checkpoint with the best ``best_metric`` (measured at epoch ends)."""

    best_metric: str = "val_accuracy"
    """Metric that ranks checkpoints for ``keep_best``: ``val_accuracy`` or ``val_loss``."""

    async_save: bool = True
    """Write checkpoints in a background thread; the step only waits for a copy of the state to CPU."""

    max_worker_restarts: int = 2
    """Times Ray Train restarts a failed worker group inside one task attempt, resuming from the latest
    checkpoint, before the task fails (and Flyte retries it)."""

    max_consecutive_save_failures: int = 3
    """Failed saves in a row tolerated (each logged as an error) before training stops with the error."""

    s3_server_side_encryption: str = ""
    """Server-side encryption of checkpoint objects on S3: empty (bucket default), ``AES256`` or ``aws:kms``."""

    s3_kms_key_id: str = ""
    """KMS key for ``aws:kms`` encryption; empty uses the account's default key."""

    preemption_grace_s: int = 25
    """Seconds a worker told to stop (SIGTERM: eviction, spot reclaim) has to write a just-in-time checkpoint
    at its current step before it is killed; keep it under the pod's ``terminationGracePeriodSeconds`` (30 by
    default). The checkpoint comes at the next log step, so ``loop.log_interval_steps`` steps plus a save must fit
    in it (a slower one is logged as a warning). 0: SIGTERM ends the worker at once, and a retry resumes from
    the last interval checkpoint."""

    def __post_init__(self) -> None:
        _non_negative("checkpoint.interval_steps", self.interval_steps)
        _between("checkpoint.preemption_grace_s", self.preemption_grace_s, 0, 3600, ": at most an hour")
        if self.interval_steps == 0 and not self.at_epoch_end:
            self._refuse("at_epoch_end", "with checkpoint.interval_steps=0 nothing would be saved; set one of them")
        _positive("checkpoint.keep_last", self.keep_last)
        _choice("checkpoint.best_metric", self.best_metric, tuple(METRIC_DIRECTIONS))
        _non_negative("checkpoint.max_worker_restarts", self.max_worker_restarts)
        _positive("checkpoint.max_consecutive_save_failures", self.max_consecutive_save_failures)
        _choice("checkpoint.s3_server_side_encryption", self.s3_server_side_encryption, ("", "AES256", "aws:kms"))
        if self.s3_kms_key_id and self.s3_server_side_encryption != "aws:kms":
            self._refuse("s3_kms_key_id", "a KMS key needs checkpoint.s3_server_side_encryption='aws:kms'")

    def storage_options(self, root: str = "s3://") -> dict:
        """fsspec options for a checkpoint ``root``: server-side encryption when it is on S3."""
        if not self.s3_server_side_encryption or not root.startswith("s3://"):
            return {}
        extra = {"ServerSideEncryption": self.s3_server_side_encryption}
        if self.s3_kms_key_id:
            extra["SSEKMSKeyId"] = self.s3_kms_key_id
        return {"s3_additional_kwargs": extra}


@dataclass
class TrackingConfig(_Section, path="tracking"):
    tracking_uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI. A relative sqlite path is resolved against the directory the run starts in."""

    experiment_name: str = "training-pipeline"
    """MLflow experiment the runs are logged under."""

    registered_model_name: str = "digits-classifier"
    """Model Registry name each trained model is registered under."""

    champion_alias: str = "champion"
    """Alias moved to a new version when it clears the gate."""

    promotion_threshold: float = 0.9
    """The bound the workload's primary test metric must clear before a new version can take the champion
    alias: at least this for a metric where higher is better (accuracy), at most this for one where lower is
    better (perplexity). It must also beat the current champion's value."""

    parent_run_id: str = ""
    """MLflow run this run is a child of (a tuning trial under its search's run); empty for none."""

    run_id: str = ""
    """Log into this existing MLflow run instead of creating one: a trial's later slice (successive halving,
    PBT) continues the run of its first. Its params were logged when it was created and are not re-logged."""

    def __post_init__(self) -> None:
        for name in ("tracking_uri", "experiment_name", "registered_model_name", "champion_alias"):
            if not getattr(self, name):
                self._refuse(name, "it must be a non-empty string")
        if not math.isfinite(self.promotion_threshold):
            self._refuse("promotion_threshold", "it must be a finite number")


@dataclass
class ObservabilityConfig(_Section, path="observability"):
    enabled: bool = True
    """Export Prometheus metrics from every rank (training progress, checkpoints, GPUs, host, cost). False turns
    all of it off, samplers and pushes included."""

    pushgateway_url: str = ""
    """Prometheus Pushgateway to push to, e.g. ``http://pushgateway:9091``. Empty: the driver uses the
    ``TRAINING_PUSHGATEWAY_URL`` environment variable if set, else nothing is pushed (and nothing fails)."""

    push_interval_s: float = 15.0
    """Seconds between pushes from each rank's background thread; one more push follows at the end."""

    push_timeout_s: float = 5.0
    """Seconds one push may take before it is given up (logged as a warning; training goes on)."""

    http_port: int = 0
    """Serve each rank's metrics over HTTP for a long-running scrape setup: rank ``r`` listens on
    ``http_port + r``. 0 serves nothing."""

    nvml: bool = True
    """Sample every visible GPU through NVML (utilisation, memory, temperature, power, throttling, XID
    errors). Without a GPU or the NVML library this turns itself off with one info log."""

    host: bool = True
    """Sample the host with psutil: CPU, memory, network and disk I/O bytes."""

    sample_interval_s: float = 5.0
    """Seconds between GPU and host samples (they also go to MLflow's system metrics on rank 0)."""

    mlflow_system_metrics: bool = True
    """Rank 0 logs each sample to the MLflow run as ``system/...`` metrics (MLflow's System Metrics tab)."""

    timeline_max_samples: int = 720
    """Samples rank 0 keeps for the training Deck's timeline (an hour at 5 s); when full, every other one is
    dropped and the interval they cover doubles."""

    gpu_hour_usd: float = 2.5
    """Price of one GPU-hour in USD, for ``training_job_cost_usd`` and the cost logged to MLflow."""

    cpu_hour_usd: float = 0.05
    """Price of one CPU-hour (a vCPU reserved for a worker) in USD."""

    straggler_threshold: float = 0.2
    """A rank whose compute and data wait in a log window (its step less its communication wait) exceed the other
    ranks' median by more than this fraction (0.2: 20 %) for ``straggler_windows`` windows in a row is a straggler:
    named in a warning, ``training_straggler`` and the ``TrainingStraggler`` alert, as compute- or data-bound."""

    straggler_windows: int = 3
    """Log windows in a row a rank must stay over ``straggler_threshold`` (and ``straggler_min_excess_s``) to be
    flagged as a straggler; one window within it clears the flag."""

    straggler_min_excess_s: float = 0.02
    """Seconds a rank's compute and data wait in a log window must also exceed the other ranks' median by to count
    over ``straggler_threshold``. The operating system delays a process by milliseconds whenever another holds its
    core, whatever the window's length: on windows of milliseconds (a small model on CPU) that alone is 20 %, on
    one rank or another at random, and flagged healthy ranks. 0.02 is twice the delays seen to recur three windows
    in a row on 2 workers sharing 2 busy cores (up to 9 ms a window) and a third of what a rank sleeping 30 ms a step
    adds to a 2-step window; on windows of seconds the 20 % is far more, and this changes nothing. 0: the fraction
    alone."""

    def __post_init__(self) -> None:
        if self.pushgateway_url and not self.pushgateway_url.startswith(("http://", "https://")):
            self._refuse("pushgateway_url", "give a full URL such as http://pushgateway:9091, or leave it empty")
        _positive("observability.push_interval_s", self.push_interval_s)
        _positive("observability.push_timeout_s", self.push_timeout_s)
        if not 0 <= self.http_port <= 65535:
            self._refuse("http_port", "use a TCP port in 1-65535, or 0 for no HTTP endpoint")
        _positive("observability.sample_interval_s", self.sample_interval_s)
        if self.timeline_max_samples < 2:
            self._refuse("timeline_max_samples", "it must be >= 2")
        _non_negative("observability.gpu_hour_usd", self.gpu_hour_usd)
        _non_negative("observability.cpu_hour_usd", self.cpu_hour_usd)
        if not 0 < self.straggler_threshold <= 10:
            self._refuse(
                "straggler_threshold", "give a fraction above the other ranks' median in (0, 10], such as 0.2 for 20 %"
            )
        if self.straggler_windows < 1:
            self._refuse("straggler_windows", "it must be >= 1 log window")
        _non_negative("observability.straggler_min_excess_s", self.straggler_min_excess_s)

    def resolved(self, environ: Mapping[str, str] | None = None) -> "ObservabilityConfig":
        """This config with ``pushgateway_url`` taken from ``TRAINING_PUSHGATEWAY_URL`` when it is empty. The
        driver calls it, so Ray workers (which may not share the driver's environment) get the URL in the config."""
        url = (os.environ if environ is None else environ).get("TRAINING_PUSHGATEWAY_URL", "")
        if self.pushgateway_url or not url:
            return self
        return dataclasses.replace(self, pushgateway_url=url)


@dataclass
class EvaluationConfig:
    placement: str = "auto"
    """Where ``evaluate`` runs the test split. ``process``: the evaluate task's own process, on a GPU when
    ``scaling.use_gpu`` asks for one (the task's pod then requests one). ``cluster``: Ray Train workers sized, placed
    and holding the model as in training (``scaling``: FSDP shards stay shards), on a RayJob like ``train``'s.
    ``auto``: ``cluster`` for an FSDP model whose whole weights do not fit ``process_memory_gib`` (8 bytes per
    parameter: the fp32 weights read from the checkpoint and the model they are loaded into), else ``process``."""

    process_memory_gib: float = 8.0
    """Memory limit of the evaluate task's container when it evaluates in its own process."""

    def __post_init__(self) -> None:
        _choice("evaluation.placement", self.placement, ("auto", "process", "cluster"))
        _positive("evaluation.process_memory_gib", self.process_memory_gib)


@dataclass
class TrainingConfig:
    """A whole training run: data, model, optimizer and schedule, loop, scaling, precision, checkpoints,
    tracking, observability."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """What kind of model is trained on what kind of data: built in, or user code."""

    data: DataConfig = field(default_factory=DataConfig)
    """What to train on and how it is sharded."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Which network."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and gradient clipping."""

    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate warmup and decay."""

    loop: LoopConfig = field(default_factory=LoopConfig)
    """Epochs, batch size, accumulation, logging cadence, seed."""

    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    """Workers and their resources."""

    sync: SyncConfig = field(default_factory=SyncConfig)
    """How workers' updates are combined: gradient all-reduce or local SGD."""

    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Mixed precision."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Where run state is kept."""

    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow tracking and the Model Registry."""

    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    """Prometheus metrics (training, GPUs, host, cost), their delivery, and MLflow system metrics."""

    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    """Where the trained model is evaluated on the test split."""

    def __post_init__(self) -> None:
        self._check_workload_fields()
        if self.data.num_shards < self.scaling.num_workers:
            self.data._refuse(
                "num_shards",
                f"each of the scaling.num_workers={self.scaling.num_workers} workers needs a shard of its own; "
                f"set data.num_shards >= {self.scaling.num_workers}",
            )
        if self.data.num_shards % self.scaling.num_workers:
            log.warning(
                "data.num_shards=%d is not a multiple of scaling.num_workers=%d: workers with more shards stop when "
                "the least-loaded one runs out, so part of each epoch is skipped; use a multiple",
                self.data.num_shards,
                self.scaling.num_workers,
            )
        if self.model.sync_batchnorm and not self.scaling.use_gpu:
            log.warning("model.sync_batchnorm=True is ignored on CPU: PyTorch's SyncBatchNorm needs a GPU")
        self._check_global_batch()
        self._check_elastic()
        last_port = self.observability.http_port + self.scaling.num_workers - 1
        if self.observability.http_port and last_port > 65535:
            self.observability._refuse(
                "http_port",
                f"rank r serves on http_port + r, so the last of scaling.num_workers={self.scaling.num_workers} would "
                f"need port {last_port}; use at most {65536 - self.scaling.num_workers}",
            )
        accumulates = self.loop.grad_accum_steps > 1 or self.loop.batch_size == AUTO or self.loop.oom_policy == "reduce"
        if self.scaling.ddp_static_graph and (accumulates or self.sync.mode == "local_sgd"):
            self.scaling._refuse(
                "ddp_static_graph",
                "a static graph syncs gradients in every backward pass, and gradient accumulation "
                "(loop.grad_accum_steps > 1, loop.batch_size=auto, loop.oom_policy=reduce) or sync.mode=local_sgd "
                "skips syncs (DDP fails on it): turn one of them off",
            )
        if self.sync.mode == "local_sgd" and self.scaling.strategy != "ddp":
            self.sync._refuse(
                "mode",
                f"local SGD steps each worker's full replica and averages them; scaling.strategy="
                f"{self.scaling.strategy!r} holds no replica: use scaling.strategy='ddp' or sync.mode='allreduce'",
            )
        if self.precision.mode == "fp16" and not self.scaling.use_gpu:
            log.warning("precision.mode='fp16' falls back to fp32 on CPU: fp16 autocast with GradScaler needs a GPU")

    def _check_global_batch(self) -> None:
        loop, workers = self.loop, self.scaling.num_workers
        if not loop.global_batch_size:
            return
        if loop.global_batch_size % workers:
            loop._refuse(
                "global_batch_size",
                f"every one of the scaling.num_workers={workers} workers trains an equal share: use a multiple of "
                f"{workers}",
            )
        if loop.batch_size and loop.batch_size * loop.grad_accum_steps * workers != loop.global_batch_size:
            loop._refuse(
                "global_batch_size",
                f"it must be loop.batch_size * loop.grad_accum_steps * scaling.num_workers = {loop.batch_size} * "
                f"{loop.grad_accum_steps} * {workers} = {loop.batch_size * loop.grad_accum_steps * workers}; set it "
                "to 0, or loop.batch_size to auto",
            )

    def _check_elastic(self) -> None:
        """An elastic job keeps its global batch on every worker count it may run on: each must divide it."""
        scaling, loop = self.scaling, self.loop
        if not scaling.elastic:
            return
        if self.sync.mode == "local_sgd":
            scaling._refuse(
                "min_workers",
                "local SGD averages a fixed set of replicas; use sync.mode='allreduce' or scaling.min_workers=0",
            )
        global_batch = loop.global_batch_size or loop.batch_size * loop.grad_accum_steps * scaling.num_workers
        uneven = [n for n in scaling.worker_counts() if global_batch % n]
        if uneven:
            multiple = math.lcm(*scaling.worker_counts())
            scaling._refuse(
                "min_workers",
                f"the global batch of {global_batch} samples must split evenly over every worker count from "
                f"{scaling.min_workers} to {scaling.num_workers}, and {', '.join(map(str, uneven[:5]))} does not "
                f"divide it: make loop.global_batch_size (or loop.batch_size * loop.grad_accum_steps * "
                f"scaling.num_workers) a multiple of {multiple}, or raise scaling.min_workers",
            )

    def _check_workload_fields(self) -> None:
        """The dataset and model a built-in workload reads must be its own (a user workload reads them as it
        likes); a user model or dataset replaces the check of the name."""
        name, model = self.workload.name, self.model.name
        if name not in WORKLOADS:
            return
        if name in ARRAY_WORKLOADS:
            self._check_array_workload(name)
            return
        datasets = dataset_names(name)
        if not self.workload.dataset_source and self.data.dataset not in datasets:
            self.data._refuse(
                "dataset",
                f"workload.name={name!r} reads {', '.join(datasets)}; choose one of them, or set "
                "workload.dataset_source to your own",
            )
        if self.workload.model_factory:
            return
        config_class = model.endswith("Config") and model.isidentifier()
        if name == "image_classification":
            _choice("model.name", model, tuple(IMAGE_MODELS))
        elif name == "causal_lm" and model not in LM_SIZES and not config_class:
            self.model._refuse(
                "name",
                f"workload.name='causal_lm' builds {', '.join(LM_SIZES)} or a transformers causal-LM config "
                "class by name (e.g. LlamaConfig)",
            )
        elif name in ("sequence_classification", "masked_lm") and model not in ENCODER_SIZES and not config_class:
            if model:  # empty: model.pretrained's or model.encoder_config's architecture (ModelConfig needs one)
                self.model._refuse(
                    "name",
                    f"workload.name={name!r} builds {', '.join(ENCODER_SIZES)} or a transformers config class by "
                    "name (e.g. RobertaConfig); or set model.name to '' to take model.pretrained's architecture",
                )

    def _check_array_workload(self, name: str) -> None:
        """A built-in of the user's own arrays trains the user's model on the user's data: both must be named."""
        if not self.workload.model_factory:
            self.workload._refuse(
                "model_factory",
                f"workload.name={name!r} trains your model: name a callable (config, manifest) -> torch.nn.Module as "
                "package.module:attribute",
            )
        if not self.workload.dataset_source and not self.data.path:
            self.data._refuse(
                "path",
                f"workload.name={name!r} reads a .npz file of 'inputs' and 'targets' there: name one, or set "
                "workload.dataset_source to a callable (data_config) returning your arrays or Dataset",
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "TrainingConfig":
        """Build from a (possibly partial) nested mapping; missing fields keep their defaults."""
        return build_dataclass(cls, raw)


def load_config(
    path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None
) -> TrainingConfig:
    """Defaults, overlaid by the YAML file at ``path`` (if given), overlaid by environment overrides."""
    return TrainingConfig.from_dict(load_layers(path, environ=environ))
