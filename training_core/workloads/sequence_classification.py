"""``sequence_classification``: a ``transformers`` encoder with a classification head (BERT, RoBERTa, DistilBERT...)
on labelled text; cross-entropy, ``accuracy`` and macro-F1 (``workload.primary_metric`` picks the one that ranks).

Data (``data.dataset: labeled_text``): ``.csv`` rows, ``.jsonl`` lines or ``.parquet`` rows under ``data.path``
(local or ``s3://``), each with its text (``data.text_field``) and label (``data.label_field``: strings or
integers; the sorted distinct labels are the manifest's classes), prepared by the ``causal_lm`` text pipeline of
:mod:`training_core.data.text`. A sample (:class:`SampleLayout`) is ``[CLS] text [SEP]`` cut to ``data.seq_len``
tokens and padded: ``input_ids`` int32 ``[seq_len]`` and ``labels`` int64.

Models: a BERT size of :data:`~training_core.registry.ENCODER_SIZES` or a ``transformers`` config class by name
(``model.name``, randomly initialised, the data's vocabulary), or a Hugging Face directory (``model.pretrained``:
``config.json`` plus safetensors, never a pickle) whose ``config.json`` is the architecture (``model.name`` empty,
or one that agrees) and whose weights are loaded as :func:`encoder_mapping` names them, checked on the meta device
before any worker starts (``model.new_head`` re-initialises a head of another class count). The data must be
tokenised with the directory's ``tokenizer.json`` (``data.tokenizer`` set to it or to the directory). Dropout is 0,
as in ``causal_lm``, so DDP equals one process and a resumed run an uninterrupted one.

The loop trains :class:`SequenceClassifierModel`. The MLflow model is a ``torch.export`` program with the tokenizer
and classes logged beside it (:meth:`~SequenceClassification.model_files`), which :func:`load_classifier` turns into
a classifier of raw strings. Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from training_core.config import DataConfig, ModelConfig, TrainingConfig, WorkloadConfig
from training_core.data.prepared import ArraySpec, Manifest, write_shards
from training_core.data.shard_files import RERUN_PREP
from training_core.data.text import (
    BYTE,
    LABELED_SUFFIXES,
    MAX_TOKENIZER_BYTES,
    SPLIT_IDS,
    TOKENIZER_FILE,
    Document,
    SourceStats,
    TextTokenizer,
    TokenSpill,
    check_spilled_text,
    load_tokenizer,
    no_text_error,
    ray_connected,
    read_documents,
    spill_tokens,
    split_documents,
    text_files,
    tokenizer_from_description,
    tokenizer_threads,
)
from training_core.files import UnreadableFile, join_path, read_regular
from training_core.messages import clip, invalid, quote
from training_core.redact import redact
from training_core.registry import ENCODER_SIZES, PRIMARY_METRICS
from training_core.schema import is_count
from training_core.workloads.causal_lm import (
    OVERRIDES,
    CarriesTokenizer,
    eval_mode,
    no_dropout,
    read_tokenizer,
    size_overrides,
    write_text,
)
from training_core.workloads.protocol import (
    Classifier,
    check_prepared_by,
    lazy_class,
    to_device_async,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from training_core.pretrained import NameMapping

log = logging.getLogger(__name__)

NAME = "sequence_classification"
CLS_TOKENS = ("[CLS]", "<s>", "<|startoftext|>", "<bos>")
"""A ``tokenizer.json``'s sequence-start token, in this order of preference (BERT, RoBERTa, GPT-style, Gemma)."""
SEP_TOKENS = ("[SEP]", "</s>", "<|endoftext|>", "<eos>")
"""Its sequence-end token."""
PAD_TOKENS = ("[PAD]", "<pad>", "<|padding|>")
"""Its padding token; a tokenizer without one gets a new id past its vocabulary."""
MAX_CLASSES = 2048
"""Most distinct labels: the evaluation sums a classes x classes confusion matrix on the device."""
CLASSIFIER_FILE = "classifier.json"
"""Logged beside the MLflow model: its class names and the sample layout of its ids (:meth:`~SequenceClassification.
model_files`)."""
MAX_CONFIG_BYTES = 2**20
"""Most bytes read of a pretrained directory's ``config.json``."""
_INTEGER = re.compile(r"-?\d{1,18}")


class EncoderWorkload:
    """What the workloads of a ``transformers`` encoder (this one and ``masked_lm``) share: ``model.pretrained``, a
    Hugging Face directory, checked before any worker starts and loaded, its tensors named by :func:`encoder_mapping`
    (the model's ``encoder`` is the Hugging Face one)."""

    head = "classification head"
    """What the log calls the tensors outside the encoder's backbone when the weights lack them."""
    loads_pretrained_sharded = True
    """Under FSDP each rank reads only its shards' rows of ``model.pretrained``, named by :meth:`pretrained_mapping`."""

    def pretrained_mapping(self, model: nn.Module, stored_names: Iterable[str]) -> NameMapping:
        """How the model names ``model.pretrained``'s tensors (:func:`encoder_mapping`, under ``encoder.``): what the
        whole load and FSDP's row-by-row load (``loads_pretrained_sharded``) both read by."""
        return encoder_mapping(model.encoder, stored_names, head=self.head).under("encoder.")

    def adopt_pretrained(self, config: TrainingConfig, tokenizer_sha256: str) -> None:
        """With ``model.pretrained``: the data (tokenised with the tokenizer of sha256 ``tokenizer_sha256``, empty for
        bytes) must be tokenised with the ``tokenizer.json`` beside the weights, when there is one (other ids would look
        up other tokens' embeddings); its ``config.json`` is recorded in ``model.encoder_config`` (in place), so
        workers and checkpoints rebuild the same model."""
        if config.model.pretrained:
            check_pretrained_tokenizer(config, tokenizer_sha256)
            config.model.encoder_config = pretrained_config_json(config.model)

    def check_pretrained_weights(self, config: TrainingConfig, new: Callable[[], nn.Module]) -> None:
        """With ``model.pretrained``: its weights matched against the encoder ``new()`` builds on the meta device
        (nothing allocated), their sha256 recorded in ``model.pretrained_sha256`` (in place)."""
        if config.model.pretrained:
            import torch

            from training_core.pretrained import check_weights

            with torch.device("meta"):
                encoder = new()
            mapping_of = functools.partial(encoder_mapping, head=self.head)
            check_weights(config, encoder, mapping_of=mapping_of, fix=PRETRAINED_FIX)

    def load_pretrained_weights(self, encoder: nn.Module, config: TrainingConfig) -> None:
        """``model.pretrained``'s weights into ``encoder`` when there are some, named by :func:`encoder_mapping`
        (:func:`~training_core.pretrained.load_pretrained`: not into parameters on the meta device; under FSDP each
        rank reads its shards' rows after sharding, ``loads_pretrained_sharded``)."""
        from training_core.pretrained import load_pretrained

        mapping_of = functools.partial(encoder_mapping, head=self.head)
        load_pretrained(encoder, config.model, seed=config.loop.seed, mapping_of=mapping_of)


class SequenceClassification(EncoderWorkload, Classifier):
    """Token ids in, class logits out; built-in data and models only (no ``workload.model_factory`` or
    ``dataset_source``)."""

    name = NAME
    primary_mode = "max"
    metric_modes = {"accuracy": "max", "macro_f1": "max", "loss": "min"}
    """Which way each metric improves: tuning ranks by any of them (``val_macro_f1``)."""
    f1_name = "macro_f1"
    dynamic_axes = (0, 1)
    """The logged model takes any batch and any sequence length (up to its positions)."""

    def __init__(self, selected: WorkloadConfig | None = None) -> None:
        selected = selected or WorkloadConfig(name=NAME)
        for field_name in ("model_factory", "dataset_source"):
            if getattr(selected, field_name):
                invalid(
                    f"workload.{field_name}",
                    getattr(selected, field_name),
                    f"workload.name={NAME!r} trains its own encoders on data.dataset='labeled_text'; leave it empty",
                )
        self.primary_metric = selected.primary_metric or PRIMARY_METRICS[NAME][0]

    # ------------------------------------------------------------------------------------------------ data prep

    def prepare_data(self, data: DataConfig, out_dir: str) -> Manifest:
        """Read the labelled records ``data`` names, tokenise them (in Ray tasks when this process is connected to a
        cluster), split them by record and write each split's samples as shards, the manifest and the tokenizer's
        copy to ``out_dir``. The ids wait in a spill file on local disk, so memory is bounded by a shard."""
        import tempfile

        ray_workers = data.prep_num_workers if ray_connected() else 0
        if not ray_workers:
            tokenizer_threads(data.prep_num_workers)
        tokenizer = load_tokenizer(tokenizer_file(data.tokenizer))
        stats, labels = SourceStats(), LabelRecorder(data)
        source = f"data.path={quote(data.path)}"
        documents = labels.record(read_documents(data, stats, workload=NAME))
        log.info("tokenising %s %s", source, f"in Ray tasks, {ray_workers} at a time" if ray_workers else "here")
        with tempfile.TemporaryDirectory(prefix="token-spill-") as spill_dir:
            spill = spill_tokens(documents, tokenizer, os.path.join(spill_dir, "ids.bin"), ray_workers=ray_workers)
            check_spilled_text(spill, data, stats, source=source)
            classes, label_ids = labels.classes()
            layout = SampleLayout.of(tokenizer, data.seq_len)
            splits = {  # shuffled within the split: a source sorted by label mixes
                split: np.random.default_rng([data.split_seed, SPLIT_IDS[split]]).permutation(index)
                for split, index in split_documents(spill.sizes, data, source=source).items()
            }
            if tokenizer.kind != BYTE:
                write_text(out_dir, TOKENIZER_FILE, tokenizer.json_text)
            template = _manifest_template(data, tokenizer, layout, classes, stats, splits, spill)
            log.info("tokenised %s: %d records, %d classes, %s", source, len(spill.sizes), len(classes), template.spec)
            shards = {
                split: (min(data.num_shards, len(index)), _shards(spill, index, label_ids, layout, data.num_shards))
                for split, index in splits.items()
            }
            return write_shards(out_dir, shards, template=template)

    # ------------------------------------------------------------------------------------------------- models

    def check(self, config: TrainingConfig, manifest: Manifest) -> None:
        """The data was prepared by this workload and fits the model: its tokenizer's ids, its sequence length and,
        with ``model.pretrained``, the weights (read and matched on the meta device, nothing allocated) and the
        tokenizer beside them. Records the pretrained ``config.json`` in ``model.encoder_config`` and the weights'
        sha256 in ``model.pretrained_sha256`` (in place), so workers and checkpoints rebuild the same model."""
        check_prepared_by(NAME, "labelled token sequences", manifest)
        spec = LabeledTextSpec.from_manifest(manifest)
        self.adopt_pretrained(config, spec.tokenizer_sha256)
        _check_fits(config, build_encoder_config(config.model, spec, manifest.classes), spec)
        self.check_pretrained_weights(config, lambda: new_encoder(config, manifest))

    def build_model(self, config: TrainingConfig, manifest: Manifest) -> nn.Module:
        """:class:`SequenceClassifierModel` around the encoder (randomly initialised from the loop's seeded RNG), with
        ``model.pretrained``'s weights loaded when there are some (not into parameters on the meta device: under FSDP
        each rank reads its shards' rows after sharding, ``loads_pretrained_sharded``). The tokenizer comes from the
        data directory when the manifest has one (a model rebuilt from a checkpoint's description has none: it trains
        and scores but cannot :meth:`~SequenceClassifierModel.classify` strings)."""
        spec = LabeledTextSpec.from_manifest(manifest)
        encoder = new_encoder(config, manifest)
        self.load_pretrained_weights(encoder, config)
        tokenizer = read_tokenizer(manifest, spec).description if manifest.directory else ""
        model = model_class()(encoder, spec=spec, classes=list(manifest.classes), tokenizer=tokenizer)
        log.info(
            "built %s (%s): %.2f M parameters, %d classes",
            config.model.name or encoder.config.model_type,
            type(encoder).__name__,
            sum(p.numel() for p in model.parameters()) / 1e6,
            manifest.num_classes,
        )
        return model

    # ------------------------------------------------------------------------------------------ batches, loss

    def to_device(self, manifest: Manifest, device: torch.device) -> Callable[[Mapping[str, np.ndarray]], Any]:
        """Stored samples -> (input_ids [N, T] int64, labels [N] int64) on ``device``, cut after the batch's last
        column that is not padding (so a batch of short texts costs short sequences)."""
        pad_id = LabeledTextSpec.from_manifest(manifest).pad_id

        def batch_to_device(batch: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
            ids = batch["input_ids"]
            used = np.flatnonzero((ids != pad_id).any(axis=0))
            width = int(used[-1]) + 1 if len(used) else 1
            input_ids = to_device_async(np.ascontiguousarray(ids[:, :width]), device).long()
            return input_ids, to_device_async(batch["labels"], device)

        return batch_to_device

    def model_files(self, manifest: Manifest) -> dict[str, bytes]:
        """The files logged beside the MLflow model (a ``torch.export`` program, which carries no tokenizer), so
        :func:`load_classifier` classifies raw strings with a registered version: :data:`CLASSIFIER_FILE` (the class
        names and the sample layout) and the data's ``tokenizer.json`` (none for ``byte``)."""
        spec = LabeledTextSpec.from_manifest(manifest)
        described = {"classes": list(manifest.classes), **dataclasses.asdict(spec)}
        files = {CLASSIFIER_FILE: json.dumps(described, sort_keys=True).encode()}
        if spec.tokenizer == TOKENIZER_FILE:
            files[TOKENIZER_FILE] = read_tokenizer(manifest, spec).json_text.encode("utf-8")
        return files

    def example_input(self, manifest: Manifest) -> np.ndarray:
        spec = LabeledTextSpec.from_manifest(manifest)
        example = np.full((2, spec.seq_len), spec.pad_id, dtype=np.int64)
        example[:, 0] = spec.cls_id if spec.cls_id is not None else 0
        return example


PRETRAINED_FIX = (
    "save the encoder the directory's config.json describes (model.save_pretrained(directory, "
    "safe_serialization=True)), or set model.new_head: true to re-initialise a classification head of another class "
    "count"
)


# ------------------------------------------------------------------------------------------------ prep parts


class LabelRecorder:
    """The labels of the documents passing through :meth:`record`, in order, as indices of the distinct labels seen;
    :meth:`classes` orders them. Memory: 8 bytes a record and the distinct labels (at most :data:`MAX_CLASSES`)."""

    def __init__(self, data: DataConfig) -> None:
        self.data = data
        self.distinct: dict[str | int, int] = {}
        self.ids = array("q")

    def record(self, documents: Iterable[Document]) -> Iterator[Document]:
        for document in documents:
            if document.label is None:  # a registered source of this workload that reads no labels
                invalid("data.dataset", self.data.dataset, f"its record {quote(document.name)} has no label; "
                        "register a source that yields each document's label")  # fmt: skip
            index = self.distinct.setdefault(document.label, len(self.distinct))
            if len(self.distinct) > MAX_CLASSES:
                invalid(
                    "data.label_field",
                    self.data.label_field,
                    f"{quote(document.name)} brings the distinct labels past {MAX_CLASSES:,}: a label names a "
                    "class; point data.label_field at the class column",
                )
            self.ids.append(index)
            yield document

    def classes(self) -> tuple[list[str], np.ndarray]:
        """The class names (sorted: numerically when every label is an integer or a string of one) and each
        record's class index (int64)."""
        labels = list(self.distinct)
        kinds = sorted({type(label).__name__ for label in labels})
        if len(kinds) > 1:
            examples = [next(repr(label) for label in labels if type(label).__name__ == kind) for kind in kinds]
            invalid(
                "data.label_field",
                self.data.label_field,
                f"the records' labels mix {' and '.join(kinds)} ({', '.join(examples)}); give every label as a "
                "string, or every one as an integer",
            )
        if len(labels) < 2:
            invalid(
                "data.label_field",
                self.data.label_field,
                f"every record under data.path={quote(self.data.path)} has the label {clip(repr(labels[0]))}: a "
                "classifier needs at least 2 classes",
            )
        numeric = all(isinstance(label, int) or _INTEGER.fullmatch(label) for label in labels)
        order = sorted(labels, key=lambda label: (int(label), str(label)) if numeric else (0, str(label)))
        remap = np.argsort([self.distinct[label] for label in order])  # first-seen index -> sorted index
        return [str(label) for label in order], remap[np.frombuffer(self.ids, dtype=np.int64)]


@dataclass(frozen=True)
class SampleLayout:
    """How a text's ids become a sample: ``[cls_id] ids [sep_id]`` (each where the tokenizer has one), cut to
    ``seq_len`` and padded with ``pad_id``."""

    cls_id: int | None
    sep_id: int | None
    pad_id: int
    vocab_size: int
    """The model's vocabulary: the tokenizer's, plus one when ``pad_id`` was added past it."""
    seq_len: int

    @classmethod
    def of(cls, tokenizer: TextTokenizer, seq_len: int) -> SampleLayout:
        if tokenizer.kind == BYTE:  # its end-of-text token starts a sample; padding is a new id
            cls_id, sep_id, pad_id = tokenizer.eot_id, None, None
        else:
            vocab = tokenizer.backend().get_vocab(with_added_tokens=True)
            cls_id, sep_id, pad_id = (next((vocab[t] for t in names if t in vocab), None)
                                      for names in (CLS_TOKENS, SEP_TOKENS, PAD_TOKENS))  # fmt: skip
        vocab_size = tokenizer.vocab_size + (pad_id is None)
        layout = cls(cls_id, sep_id, tokenizer.vocab_size if pad_id is None else pad_id, vocab_size, seq_len)
        if layout.room < 1:
            invalid("data.seq_len", seq_len, f"a sample holds {seq_len - layout.room} special tokens: raise it")
        return layout

    @property
    def room(self) -> int:
        """Text tokens a sample holds."""
        return self.seq_len - (self.cls_id is not None) - (self.sep_id is not None)

    def sample(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Write the sample of ``ids`` (already cut to :attr:`room`) into the padded row ``out``."""
        at = 0
        if self.cls_id is not None:
            out[0], at = self.cls_id, 1
        out[at : at + len(ids)] = ids
        if self.sep_id is not None:
            out[at + len(ids)] = self.sep_id


def _shards(
    spill: TokenSpill, index: np.ndarray, label_ids: np.ndarray, layout: SampleLayout, num_shards: int
) -> Iterator[dict[str, np.ndarray]]:
    """The split's samples (records ``index``, in that order) as up to ``num_shards`` shards, each read from the
    spill file when it is written: one shard's samples in memory at a time."""
    with open(spill.path, "rb") as f:
        for part in np.array_split(index, min(num_shards, len(index))):
            input_ids = np.full((len(part), layout.seq_len), layout.pad_id, dtype=np.int32)
            for row, document in enumerate(part.tolist()):
                f.seek(int(spill.offsets[document]) * 4)
                count = min(int(spill.lengths[document]), layout.room)
                layout.sample(np.fromfile(f, dtype=np.int32, count=count), input_ids[row])
            yield {"input_ids": input_ids, "labels": label_ids[part]}


def _manifest_template(
    data: DataConfig,
    tokenizer: TextTokenizer,
    layout: SampleLayout,
    classes: list[str],
    stats: SourceStats,
    splits: Mapping[str, np.ndarray],
    spill: TokenSpill,
) -> Manifest:
    spec = {
        "tokenizer": tokenizer.kind,
        "tokenizer_sha256": tokenizer.sha256,
        **dataclasses.asdict(layout),  # cls_id, sep_id, pad_id, vocab_size, seq_len
        "label_field": data.label_field,
        "text_bytes": stats.text_bytes,
        "records": {split: len(index) for split, index in splits.items()},
        "truncated": {split: int((spill.lengths[index] > layout.room).sum()) for split, index in splits.items()},
        "path": redact(data.path),
    }
    return Manifest(
        dataset=data.dataset,
        classes=classes,
        input_shape=[data.seq_len],
        mean=[],
        std=[],
        splits={},
        workload=NAME,
        arrays={
            "input_ids": ArraySpec("int32", [data.seq_len], max_value=layout.vocab_size - 1),
            "labels": ArraySpec("int64", [], max_value=len(classes) - 1),
        },
        spec=spec,
    )


def tokenizer_file(value: str) -> str:
    """``data.tokenizer`` as a tokenizer to load: a directory (a pretrained model's) stands for its
    ``tokenizer.json``."""
    if value == BYTE:
        return value
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(value)
        is_dir = fs.isdir(path)
    except Exception:  # noqa: BLE001 - load_tokenizer names what is wrong with the value
        return value
    return join_path(value, TOKENIZER_FILE) if is_dir else value


def check_source(data: DataConfig) -> None:
    """What can fail before a cluster starts for the prep of ``data``: a ``data.path`` without records, a
    ``data.tokenizer`` that cannot be read."""
    if not text_files(data.path, LABELED_SUFFIXES)[2]:
        raise no_text_error(data, SourceStats(), source=f"data.path={quote(data.path)}")
    load_tokenizer(tokenizer_file(data.tokenizer))


# ------------------------------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class LabeledTextSpec(SampleLayout):
    """What ``manifest.spec`` of prepared labelled text records (:meth:`SequenceClassification.prepare_data`): the
    sample layout and the tokenizer."""

    tokenizer: str
    tokenizer_sha256: str

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> LabeledTextSpec:
        """The spec, checked against the manifest's arrays; anything else raises ``ValueError`` naming the key."""
        where = f"manifest.json in {clip(redact(manifest.directory or '(a description)'), 500)}"
        raw = {key: manifest.spec.get(key) for key in cls.__dataclass_fields__}
        ids = manifest.arrays.get("input_ids")
        checks = {
            "tokenizer": raw["tokenizer"] in (BYTE, TOKENIZER_FILE),
            "tokenizer_sha256": isinstance(raw["tokenizer_sha256"], str),
            "vocab_size": is_count(raw["vocab_size"]) and ids is not None and ids.max_value == raw["vocab_size"] - 1,
            "pad_id": is_count(raw["pad_id"]) and is_count(raw["vocab_size"]) and raw["pad_id"] < raw["vocab_size"],
            "cls_id": raw["cls_id"] is None or is_count(raw["cls_id"]),
            "sep_id": raw["sep_id"] is None or is_count(raw["sep_id"]),
            "seq_len": is_count(raw["seq_len"]) and manifest.input_shape == [raw["seq_len"]],
        }
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"{where}: spec.{key}={quote(raw[key])} is invalid; {RERUN_PREP}")
        return cls(**raw)


# ------------------------------------------------------------------------------------------------ the encoder


def pretrained_config_json(model: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face directory ``model.pretrained`` (a JSON object with a ``model_type``);
    a weights file without one needs ``model.name``, and gets ``{}``."""
    from training_core.pretrained import fail, locate

    files = locate(model.pretrained)
    if files.kind != "huggingface":
        if not model.name:
            invalid("model.name", model.name, "a state dict brings no architecture: name a BERT size or config class")
        return {}
    try:
        config = json.loads(read_regular(files.fs, files.files[0], max_bytes=MAX_CONFIG_BYTES))
    except (UnreadableFile, ValueError) as exc:
        fail(model.pretrained, f"its config.json cannot be read as JSON ({clip(str(exc))}); save it again")
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        fail(model.pretrained, "its config.json has no model_type; save the model with save_pretrained")
    if model.encoder_config and model.encoder_config != config:
        invalid("model.encoder_config", model.encoder_config, "it is filled in from model.pretrained: leave it empty")
    return config


def check_pretrained_tokenizer(config: TrainingConfig, tokenizer_sha256: str) -> None:
    """The data (tokenised with the tokenizer of sha256 ``tokenizer_sha256``, empty for bytes) must be tokenised
    with the ``tokenizer.json`` beside the pretrained weights, when there is one: other ids would look up other
    tokens' embeddings."""
    from training_core.pretrained import locate

    files = locate(config.model.pretrained)
    if files.kind != "huggingface":
        return
    beside = join_path(files.files[0].rsplit("/", 1)[0], TOKENIZER_FILE)
    try:
        digest = hashlib.sha256(read_regular(files.fs, beside, max_bytes=MAX_TOKENIZER_BYTES)).hexdigest()
    except (UnreadableFile, OSError):
        return  # no tokenizer beside the weights: the vocabulary check decides
    if digest != tokenizer_sha256:
        invalid(
            "data.tokenizer",
            config.data.tokenizer,
            f"the data was tokenised with another tokenizer (sha256 {tokenizer_sha256[:12] or 'byte'}) than the "
            f"tokenizer.json beside model.pretrained={quote(config.model.pretrained)} ({digest[:12]}); set "
            "data.tokenizer to that directory and prepare the data again",
        )


def build_encoder_config(model: ModelConfig, spec: LabeledTextSpec, classes: Sequence[str]) -> Any:
    """The ``transformers`` config of the encoder ``model`` names (``model.encoder_config``, a BERT size or a config
    class), with the data's classes and no dropout. A name that builds no sequence classifier, overrides it cannot
    take, or a name that disagrees with ``model.encoder_config`` raise ``ValueError`` naming the field."""
    config = encoder_architecture(model, vocab_size=spec.vocab_size, pad_id=spec.pad_id)
    config.id2label = dict(enumerate(classes))
    config.label2id = {name: index for index, name in enumerate(classes)}
    config.problem_type = "single_label_classification"
    return config


def encoder_architecture(model: ModelConfig, *, vocab_size: int, pad_id: int | None) -> Any:
    """The ``transformers`` config of the encoder ``model`` names (``model.encoder_config``, a BERT size or a config
    class by name) for a vocabulary of ``vocab_size`` ids padded with ``pad_id``, without dropout and without a
    task's fields (``masked_lm`` builds its encoder from it too)."""
    import transformers

    # model.pretrained's config.json when check() has not recorded it (a model built without it)
    described = model.encoder_config or (pretrained_config_json(model) if model.pretrained else {})
    if described:
        config = _config_from_json(model, described)
    elif model.name in ENCODER_SIZES:
        size = ENCODER_SIZES[model.name]
        sized = {a: getattr(model, f) or getattr(size, f) for f, a in OVERRIDES}
        config = transformers.BertConfig(
            vocab_size=vocab_size, pad_token_id=pad_id, intermediate_size=4 * sized["hidden_size"], **sized
        )
    else:
        config = _config_from_class(model, vocab_size=vocab_size, pad_id=pad_id)
    config.update(no_dropout(config))
    return config


def _config_from_json(model: ModelConfig, described: dict[str, Any]) -> Any:
    """The config ``described`` (``model.encoder_config``); ``model.name`` and the overrides, when given, must agree
    with it."""
    from transformers import AutoConfig

    raw = dict(described)
    try:
        config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    except Exception as exc:  # noqa: BLE001 - transformers raises various types for a config it cannot read
        invalid("model.encoder_config", described, f"transformers cannot read it ({clip(str(exc))})")
    size = ENCODER_SIZES.get(model.name)
    sized = ("num_layers", "hidden_size", "num_heads") if size else ()  # a BERT size fixes these, not its positions
    expected = {a: getattr(model, f) or (getattr(size, f) if f in sized else 0) for f, a in OVERRIDES}
    if not size and model.name and type(config).__name__ != model.name:
        invalid("model.name", model.name, f"model.pretrained is a {type(config).__name__}: leave model.name empty")
    differ = [
        f"{a}={v} vs {getattr(config, a, None)}" for a, v in expected.items() if v and getattr(config, a, None) != v
    ]
    if differ:
        invalid("model.name", model.name, f"it disagrees with model.pretrained's config.json ({', '.join(differ)}); "
                "leave model.name empty and the model.* sizes at 0 to take the pretrained architecture")  # fmt: skip
    return config


def _config_from_class(model: ModelConfig, *, vocab_size: int, pad_id: int | None) -> Any:
    """The ``transformers`` config class ``model.name``, with the data's vocabulary and the ``model.*`` overrides."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    found = getattr(transformers, model.name, None) if model.name.isidentifier() else None
    if not (isinstance(found, type) and found in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING):
        invalid(
            "model.name",
            model.name,
            f"transformers {transformers.__version__} has no sequence-classification model of that config class; "
            f"use {', '.join(ENCODER_SIZES)} or a config class such as BertConfig, RobertaConfig, DistilBertConfig",
        )
    kwargs = {"vocab_size": vocab_size, "pad_token_id": pad_id, **size_overrides(model, found())}
    try:
        return found(**kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers validates configs with various exception types
        invalid("model.name", model.name, f"{type(exc).__name__}: {clip(str(exc))}; fix the model.* overrides")


def _check_fits(config: TrainingConfig, encoder_config: Any, spec: LabeledTextSpec) -> None:
    """The data's ids index the encoder's embedding, and its samples fit the encoder's positions."""
    vocab = getattr(encoder_config, "vocab_size", None)
    if not isinstance(vocab, int) or spec.vocab_size > vocab:
        invalid(
            "data.tokenizer",
            config.data.tokenizer,
            f"its ids run to {spec.vocab_size - 1} (padding included), past the encoder's vocabulary of {vocab}: "
            "tokenise with the model's own tokenizer (model.pretrained's tokenizer.json) and prepare the data again",
        )
    pad = getattr(encoder_config, "pad_token_id", None)
    if config.model.pretrained and pad is not None and pad != spec.pad_id:
        invalid(
            "data.tokenizer",
            config.data.tokenizer,
            f"its padding id {spec.pad_id} is not model.pretrained's pad_token_id {pad}: tokenise with the model's "
            "own tokenizer and prepare the data again",
        )
    positions = getattr(encoder_config, "max_position_embeddings", None)
    if isinstance(positions, int) and spec.seq_len > positions:
        invalid(
            "data.seq_len",
            spec.seq_len,
            f"the encoder has {positions} positions; lower data.seq_len to at most {positions} and prepare again",
        )


def new_encoder(config: TrainingConfig, manifest: Manifest) -> nn.Module:
    """The ``transformers`` sequence classifier the config names for ``manifest``'s data, randomly initialised (from
    the global torch RNG: seed it first); on the meta device under ``torch.device('meta')``."""
    from transformers import AutoModelForSequenceClassification

    encoder_config = build_encoder_config(config.model, LabeledTextSpec.from_manifest(manifest), manifest.classes)
    try:
        return AutoModelForSequenceClassification.from_config(encoder_config)
    except Exception as exc:  # noqa: BLE001 - transformers raises various types for a config it cannot build
        invalid("model.name", config.model.name, f"transformers cannot build it ({type(exc).__name__}: "
                f"{clip(str(exc))}); fix the model.* overrides or model.encoder_config")  # fmt: skip


def encoder_mapping(
    encoder: nn.Module, stored_names: Iterable[str], *, head: str = "classification head"
) -> NameMapping:
    """How ``encoder`` (a ``transformers`` model) names a Hugging Face checkpoint's tensors ``stored_names``: a
    backbone saved alone gets the encoder's prefix (``bert.``); tensors the encoder lacks outside the backbone (a
    pretraining head's: ``cls.*``) or in a pooler are left out; a tensor tied to another (a masked LM's decoder to
    the word embeddings) loads from that one's; and a ``head`` (the tensors outside the backbone) or a pooler the
    weights lack entirely takes a seeded fresh value (:data:`~training_core.pretrained.FRESH`)."""
    from training_core.pretrained import FRESH, NameMapping, tied_names

    prefix, pooler = f"{encoder.base_model_prefix}.", f"{encoder.base_model_prefix}.pooler."
    own = list(encoder.state_dict())
    stored = list(stored_names)
    if any(key.startswith(prefix) for key in own) and not any(key.startswith(prefix) for key in stored):
        source_of = {f"{prefix}{key}": key for key in stored}
    else:
        source_of = {key: key for key in stored}
    dropped = sorted(s for k, s in source_of.items() if k not in own and (k.startswith(pooler) or
                     not k.startswith(prefix)))  # fmt: skip
    notes = [f"left out {len(dropped)} tensors of another head ({', '.join(dropped[:5])})"] if dropped else []
    sources = {key: source_of.get(key, key) for key in own}  # one the weights lack: plan_loading lists it
    parts = {head: [k for k in own if not k.startswith(prefix)], "pooler": [k for k in own if k.startswith(pooler)]}
    for part, keys in parts.items():
        if keys and not any(key in source_of for key in keys):
            sources.update(dict.fromkeys(keys, FRESH))
            notes.append(f"the {part} ({', '.join(keys[:5])}) is new, initialised here")
    for tied in tied_names(encoder):
        found = [source_of[key] for key in tied if key in source_of]
        sources.update(dict.fromkeys(tied, found[0]) if found else {})
    return NameMapping(sources, dropped, "; ".join(notes))


# ------------------------------------------------------------------------------------------------ the model


@dataclass
class RegisteredClassifier:
    """A registered version: its ``torch.export`` program with the tokenizer and classes logged beside it (or, for
    :meth:`SequenceClassifierModel.classify`, the model itself as the program)."""

    program: Any
    """Input ids [N, seq_len] int64 on the host -> logits [N, classes]."""
    tokenizer: TextTokenizer
    layout: SampleLayout
    classes: list[str]

    def classify(self, texts: Sequence[str]) -> list[str]:
        """The predicted class name of each text (cut to the sequence length the model was trained on)."""
        import torch

        rows = np.full((len(texts), self.layout.seq_len), self.layout.pad_id, dtype=np.int64)
        for row, ids in zip(rows, self.tokenizer.encode_batch(list(texts))):
            self.layout.sample(ids[: self.layout.room], row)
        with torch.no_grad():
            logits = self.program(torch.from_numpy(rows))
        return [self.classes[index] for index in logits.argmax(dim=1).tolist()]


def load_classifier(model_uri: str) -> RegisteredClassifier:
    """The model at ``model_uri`` (``models:/<name>@champion``, ``runs:/...``), downloaded with its
    :data:`CLASSIFIER_FILE` and tokenizer, ready to :meth:`~RegisteredClassifier.classify` raw strings."""
    import mlflow

    local = mlflow.artifacts.download_artifacts(artifact_uri=model_uri)
    files = Path(local, "extra_files")
    if not (files / CLASSIFIER_FILE).is_file():
        raise ValueError(
            f"model {quote(model_uri)} has no {CLASSIFIER_FILE} beside it: it was not logged by the "
            f"{NAME} workload (or by an older version); register a model trained by it"
        )
    described = json.loads((files / CLASSIFIER_FILE).read_text(encoding="utf-8"))
    layout = SampleLayout(**{key: described[key] for key in SampleLayout.__dataclass_fields__})
    description = BYTE if described["tokenizer"] == BYTE else (files / TOKENIZER_FILE).read_text(encoding="utf-8")
    tokenizer = tokenizer_from_description(description, where=f"{TOKENIZER_FILE} of {quote(model_uri)}")
    return RegisteredClassifier(mlflow.pytorch.load_model(local), tokenizer, layout, described["classes"])


def _define_model_class() -> type:
    """:class:`SequenceClassifierModel`, defined here so importing this module does not import torch."""
    from torch import nn

    class SequenceClassifierModel(CarriesTokenizer, nn.Module):
        """A ``transformers`` sequence classifier as the loop trains it: ``forward(input_ids [N, T] int64) -> logits
        [N, classes]``, attending to every position that is not padding. Carries its class names, sample layout and
        tokenizer (the ``tokenizer.json`` text or ``byte``; empty when rebuilt without the data), so a pickled
        model (MLflow's) classifies raw strings on its own. Its state dict is the encoder's under ``encoder.``."""

        def __init__(self, encoder: nn.Module, *, spec: LabeledTextSpec, classes: list[str], tokenizer: str) -> None:
            super().__init__()
            self.encoder = encoder
            self.layout = SampleLayout(spec.cls_id, spec.sep_id, spec.pad_id, spec.vocab_size, spec.seq_len)
            self.classes = classes
            self.tokenizer = tokenizer

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.encoder(input_ids=input_ids, attention_mask=(input_ids != self.layout.pad_id).long()).logits

        def classify(self, texts: Sequence[str]) -> list[str]:
            """The predicted class name of each text (cut to the sequence length the model was trained on)."""
            tokenizer, device = self.text_tokenizer("classify text"), next(self.parameters()).device
            classifier = RegisteredClassifier(lambda ids: self(ids.to(device)), tokenizer, self.layout, self.classes)
            with eval_mode(self):
                return classifier.classify(texts)

    return SequenceClassifierModel


model_class, __getattr__ = lazy_class(globals(), "SequenceClassifierModel", _define_model_class)
