"""``causal_lm``: GPT-style decoders trained on text with next-token cross-entropy; perplexity is the primary metric.

Models (``model.name``) are Hugging Face ``transformers`` architectures built from a config and randomly
initialised, never downloaded: a GPT-2 size of :data:`GPT2_SIZES` (``gpt2-tiny`` for tests up to ``gpt2-xl``,
1.5 B parameters), or any ``transformers`` causal-LM config class by name (``LlamaConfig``, ``GPTNeoXConfig``...).
``model.num_layers`` / ``hidden_size`` / ``num_heads`` / ``context_length`` override the size when non-zero. The
vocabulary is always the prepared data's tokenizer's (``manifest.spec["vocab_size"]``). Dropout is 0 everywhere:
it draws random numbers per rank, which would break the equality of a DDP run with a single-process run and of a
resumed run with an uninterrupted one.

The loop trains :class:`CausalLMModel`: ``forward(input_ids [N, T]) -> logits [N, T, V]`` around the Hugging Face
model, with greedy :meth:`~CausalLMModel.generate` and :meth:`~CausalLMModel.generate_text` (it carries its
tokenizer, so a model logged to MLflow decodes on its own).

Data prep (:mod:`training_core.data.text`) tokenises ``data.dataset`` (``stdlib`` or ``text``) or a user's
``workload.dataset_source`` into sequences of ``data.seq_len + 1`` tokens (``tokens``, int32), split by document,
and keeps a copy of a ``tokenizer.json`` beside the shards (its sha256 and the vocabulary in ``manifest.spec``).

Importing this module imports neither torch nor transformers: :class:`CausalLMModel` is defined on first use
(module ``__getattr__``), under this module's name, so it pickles by reference like any module-level class.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterator, Mapping, NoReturn

import numpy as np

from training_core.config import DataConfig, ModelConfig, TrainingConfig, WorkloadConfig
from training_core.data.prepared import ArraySpec, Manifest, write_shards
from training_core.data.shard_files import RERUN_PREP
from training_core.data.text import (
    BYTE,
    TOKENIZER_FILE,
    SourceStats,
    SplitStream,
    TextTokenizer,
    TokenSpill,
    capped,
    check_spilled_text,
    load_tokenizer,
    mapping_documents,
    num_sequences,
    packed_shards,
    prepared_tokenizer,
    ray_connected,
    read_documents,
    spill_tokens,
    split_documents,
    tokenizer_from_description,
    tokenizer_threads,
)
from training_core.files import join_path
from training_core.messages import clip, invalid, quote
from training_core.redact import redact
from training_core.registry import LM_SIZES as GPT2_SIZES
from training_core.schema import Rule, SchemaError, check, is_int
from training_core.workloads.image import user_model
from training_core.workloads.protocol import (
    LossOutput,
    check_prepared_by,
    lazy_class,
    mean_of,
    sample_count,
    to_device_async,
)
from training_core.workloads.user_code import call_configured, factory_params, load_optional, takes_params

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)


GPT2_ATTENTION = "sdpa"
"""Attention kernel of the GPT-2 sizes. On CPU it gives the same logits as ``eager`` run after run and whatever
the batch size (checked); on GPU it is the fused, memory-efficient kernel that makes the large sizes fit."""

SHOWCASE_PROMPTS = ("def ", "import ", "class ", "    return ")
"""Prompts of :meth:`CausalLM.showcase`: openings of Python source, the embedded corpus."""

OVERRIDES = (
    ("num_layers", "num_hidden_layers"),
    ("hidden_size", "hidden_size"),
    ("num_heads", "num_attention_heads"),
    ("context_length", "max_position_embeddings"),
)
"""``model.*`` override -> the standard ``transformers`` config attribute (each config maps it to its own name,
e.g. GPT-2's ``n_layer``, through ``attribute_map``)."""
IGNORED = -100
"""The label of a token that is not predicted (``cross_entropy``'s ``ignore_index``): ``masked_lm``'s unchosen ones."""


MAX_EMBEDDING_BYTES = 32 * 2**30
"""The largest token embedding a built-in model is given (vocabulary x hidden size x 4 bytes of fp32), checked
before any worker starts: Llama 3 405B's is 8.4 GB (128 256 x 16 384), gpt2-xl's 0.3 GB. Past it the vocabulary
is not a real one: a tokenizer whose ids have a large gap (one id of 2,000,000,000 gives gpt2-tiny a 477 GiB
embedding, which no worker could allocate)."""


class CausalLM:
    """Token ids in, next-token logits out. ``model_factory(config, manifest)`` (a ``torch.nn.Module`` whose
    ``forward(input_ids [N, T]) -> logits [N, T, manifest.spec["vocab_size"]]``) and ``dataset_source(data)`` (a
    mapping of document name to text) replace the built-in model and text; either is also given ``params=``
    (``workload.params``, typed by its ``params_type`` if it declares one) when it has that parameter."""

    name = "causal_lm"
    primary_metric = "perplexity"
    primary_mode = "min"
    dynamic_axes = (0, 1)
    """The logged model takes any batch and any sequence length (up to its context)."""

    def __init__(self, selected: WorkloadConfig | None = None) -> None:
        selected = self.selected = selected or WorkloadConfig(name=self.name)
        self.model_factory = load_optional("workload.model_factory", selected.model_factory)
        self.dataset_source = load_optional("workload.dataset_source", selected.dataset_source)
        self.dataset_source_path = selected.dataset_source

    # ------------------------------------------------------------------------------------------------ data prep

    def prepare_data(self, data: DataConfig, out_dir: str) -> Manifest:
        """Tokenise the text ``data`` names (or ``workload.dataset_source`` returns), split it by document into
        train/val/test, pack each split into ``data.seq_len + 1``-token sequences and write them with the manifest
        (and a copy of a ``tokenizer.json``) to ``out_dir``.

        Memory is bounded by a shard, not by the source: the ids go to a spill file on local disk as they are
        tokenised (4 bytes a token, removed at the end), and each shard's sequences are cut from it when written.
        Every split is checked to hold a sequence before any shard is written."""
        import tempfile

        # A built-in source read in a Ray task (the prep's RayJob, or a local cluster) is tokenised by
        # data.prep_num_workers Ray tasks at a time; a user's mapping, or a prep outside Ray, by this process's threads.
        ray_workers = data.prep_num_workers if self.dataset_source is None and ray_connected() else 0
        if not ray_workers:
            tokenizer_threads(data.prep_num_workers)
        tokenizer = load_tokenizer(data.tokenizer)
        stats = SourceStats()
        if self.dataset_source is None:
            source = f"data.path={quote(data.path)}" if data.dataset == "text" else f"data.dataset={data.dataset!r}"
            documents = read_documents(data, stats, workload=self.name)
        else:
            source = f"workload.dataset_source={quote(self.dataset_source_path)}"
            texts = call_configured(self.selected, "dataset_source", self.dataset_source, data)
            documents = capped(mapping_documents(texts, source=source), data.max_text_bytes, stats)
        log.info(
            "tokenising %s %s",
            source,
            f"in Ray tasks, {ray_workers} at a time" if ray_workers else "in this process's tokenizer threads",
        )
        with tempfile.TemporaryDirectory(prefix="token-spill-") as spill_dir:
            spill = spill_tokens(documents, tokenizer, os.path.join(spill_dir, "ids.bin"), ray_workers=ray_workers)
            check_spilled_text(spill, data, stats, source=source, from_user=self.dataset_source is not None)
            streams = _split_streams(spill, data, tokenizer, source)
            if tokenizer.kind == TOKENIZER_FILE:
                write_text(out_dir, TOKENIZER_FILE, tokenizer.json_text)
            template = self._manifest_template(data, tokenizer, stats, streams)
            log.info(
                "tokenised %s: %d documents, %d bytes, tokens per split %s (tokenizer %s, vocabulary %d)",
                source,
                len(spill.sizes),
                stats.text_bytes,
                template.spec["tokens"],
                tokenizer.kind,
                tokenizer.vocab_size,
            )
            shards = {}
            for split, stream in streams.items():
                packed = packed_shards(stream, seq_len=data.seq_len, num_shards=data.num_shards)
                count = min(data.num_shards, num_sequences(stream.num_tokens, data.seq_len))
                shards[split] = (count, self.shard_arrays(packed))
            return write_shards(out_dir, shards, template=template)

    def shard_arrays(self, packed: Iterator[np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """Each packed shard as the arrays written (:meth:`stored_arrays` names them): its ``tokens``."""
        return ({"tokens": tokens} for tokens in packed)

    def stored_arrays(self, data: DataConfig, tokenizer: TextTokenizer) -> tuple[dict[str, ArraySpec], dict[str, Any]]:
        """The arrays a sample stores and what ``manifest.spec`` records beyond the tokenizer and the splits (a
        workload sharing this prep adds its own)."""
        return {"tokens": ArraySpec("int32", [data.seq_len + 1], max_value=tokenizer.vocab_size - 1)}, {}

    def _manifest_template(
        self, data: DataConfig, tokenizer: TextTokenizer, stats: SourceStats, streams: dict[str, SplitStream]
    ) -> Manifest:
        """The prepared data's manifest without its shards: the tokenizer, the sequence length and each split's
        documents and tokens (``spec``)."""
        spec = {
            "tokenizer": tokenizer.kind,
            "tokenizer_sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            "seq_len": data.seq_len,
            "text_bytes": stats.text_bytes,
            "documents": {split: len(stream.index) for split, stream in streams.items()},
            "tokens": {split: stream.num_tokens for split, stream in streams.items()},
        }
        if stats.surrogates_replaced:
            spec["surrogates_replaced"] = stats.surrogates_replaced
        arrays, extra_spec = self.stored_arrays(data, tokenizer)
        spec.update(extra_spec)
        if data.dataset == "text" and self.dataset_source is None:
            spec["path"] = redact(data.path)
        return Manifest(
            dataset=data.dataset if self.dataset_source is None else self.dataset_source_path,
            classes=[],
            input_shape=[data.seq_len],
            mean=[],
            std=[],
            splits={},
            workload=self.name,
            arrays=arrays,
            spec=spec,
        )

    # ------------------------------------------------------------------------------------------------- models

    def check(self, config: TrainingConfig, manifest: Manifest) -> None:
        """The data was prepared by this workload, its sequences fit the model's context and its tokenizer's
        vocabulary is the model's. Builds configs only (a user's model on the meta device): nothing is allocated."""
        check_prepared_by(self.name, "token sequences", manifest)
        spec = TextSpec.from_manifest(manifest)
        if self.model_factory is not None:
            self._check_user_model(config, manifest, spec)
            return
        lm_config = model_config(config.model, vocab_size=spec.vocab_size, eot_id=spec.eot_id)
        context = context_length(lm_config)
        if context is not None and spec.seq_len > context:
            raise ValueError(
                f"data.seq_len={spec.seq_len} is invalid: model.name={quote(config.model.name)} attends over "
                f"{context} positions (model.context_length={config.model.context_length}); lower data.seq_len to "
                f"at most {context} and re-run data prep, or set model.context_length to at least {spec.seq_len}"
            )
        model_vocab = getattr(lm_config.get_text_config(), "vocab_size", None)
        if model_vocab != spec.vocab_size:
            raise ValueError(
                f"model.name={quote(config.model.name)} is invalid: its vocabulary ({model_vocab}) is not the "
                f"tokenizer's ({spec.vocab_size}, data.tokenizer={spec.tokenizer!r}); use a config class whose "
                "vocab_size is its own (a text-only config such as LlamaConfig, not a multimodal one)"
            )
        _check_embedding_size(config, lm_config, spec)

    def _check_user_model(self, config: TrainingConfig, manifest: Manifest, spec: TextSpec) -> None:
        """Build the user's model on the meta device (no memory, no initialisation) and compare its logits' width
        with the vocabulary. A factory that cannot run there is left for the workers to build and report."""
        import torch
        from torch import nn

        path = config.workload.model_factory
        try:
            factory = self.model_factory
            if takes_params(factory):
                factory = functools.partial(factory, params=factory_params(config.workload, factory))
            with torch.device("meta"):
                model = factory(config, manifest)
                if not isinstance(model, nn.Module):
                    return  # build_model names the problem
                logits = model(torch.zeros((1, min(spec.seq_len, 8)), dtype=torch.long))
        except Exception as exc:  # noqa: BLE001 - meta tensors refuse some operations; the real build decides
            log.warning(
                "workload.model_factory=%s could not be checked on the meta device (%s: %s); its vocabulary is "
                "checked when it trains",
                quote(path),
                type(exc).__name__,
                clip(str(exc)),
            )
            return
        shape = tuple(getattr(logits, "shape", ()))
        if len(shape) != 3 or shape[-1] != spec.vocab_size:
            raise ValueError(
                f"workload.model_factory={quote(path)} is invalid: its model maps token ids [N, T] to "
                f"{type(logits).__name__} {list(shape)}, but the tokenizer (data.tokenizer={spec.tokenizer!r}) has a "
                f"vocabulary of {spec.vocab_size}; return logits [N, T, manifest.spec['vocab_size']]"
            )

    def build_model(self, config: TrainingConfig, manifest: Manifest) -> nn.Module:
        """:class:`CausalLMModel` around a randomly initialised ``transformers`` model (or the user's model). The
        tokenizer comes from the data directory when the manifest has one (a model rebuilt from a checkpoint's
        description has none: it trains and scores, but cannot :meth:`~CausalLMModel.generate_text`)."""
        spec = TextSpec.from_manifest(manifest)
        if self.model_factory is not None:
            return user_model(config, manifest, self.model_factory)
        lm = build_lm(config.model, vocab_size=spec.vocab_size, eot_id=spec.eot_id)
        tokenizer = read_tokenizer(manifest).description if manifest.directory else ""
        model = model_class()(lm, tokenizer=tokenizer, eot_id=spec.eot_id, context_length=context_length(lm.config))
        log.info(
            "built %s (%s): %.1f M parameters",
            config.model.name,
            type(lm).__name__,
            sum(p.numel() for p in model.parameters()) / 1e6,
        )
        return model

    # ------------------------------------------------------------------------------------------ batches, loss

    def to_device(self, manifest: Manifest, device: torch.device) -> Callable[[Mapping[str, np.ndarray]], Any]:
        return TokenBatcher(device)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossOutput:
        """Mean next-token cross-entropy over every token of the batch; sums of correct (argmax) predictions,
        tokens and sequences, on the device."""
        import torch.nn.functional as F

        inputs, targets = batch
        logits = model(inputs)
        # In fp32 whatever autocast made the logits: a bf16 log-softmax over 50 k entries loses the loss's digits.
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        correct = (logits.detach().argmax(dim=-1) == targets).sum()
        samples = sample_count(targets)
        sums = {"correct": correct, "tokens": samples * targets.shape[1], "samples": samples}
        return LossOutput(loss=loss, sums=sums, num_samples=len(targets), num_tokens=targets.numel())

    def eval_sums(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``loss_sum`` (summed per-token negative log-likelihood, float64), ``correct``, ``tokens``, ``samples`` of
        the predicted tokens (:func:`token_sums`)."""
        inputs, targets = batch
        sums = token_sums(model(inputs), targets)
        return sums | {"loss_sum": sums["loss_sum"].double()}

    def metrics(self, sums: Mapping[str, Any]) -> dict[str, float]:
        """``accuracy`` of the predicted tokens; with ``loss_sum`` also ``loss`` (per predicted token, nats) and
        ``perplexity`` (``exp(loss)``)."""
        found = {"accuracy": mean_of(sums, "correct", "tokens")}
        if "loss_sum" in sums:
            found["loss"] = mean_of(sums, "loss_sum", "tokens")
            found["perplexity"] = perplexity(found["loss"])
        return found

    def example_input(self, manifest: Manifest) -> np.ndarray:
        return np.zeros((2, manifest.input_shape[0]), dtype=np.int64)

    def showcase(self, model: nn.Module, manifest: Manifest, *, max_new_tokens: int = 48) -> list[tuple[str, str]]:
        """``(prompt, continuation)`` for each of :data:`SHOWCASE_PROMPTS`: the model's greedy continuation, decoded
        with the data's tokenizer (up to an end-of-text token), for the evaluation report. Works for a user's model
        too (greedy decoding through its ``forward``)."""
        tokenizer = read_tokenizer(manifest)
        model = getattr(model, "module", model)  # a DDP wrapper's model
        if isinstance(model, model_class()):
            generate = functools.partial(model.generate, max_new_tokens=max_new_tokens)
        else:
            seq_len = TextSpec.from_manifest(manifest).seq_len
            generate = functools.partial(greedy_decode, model, max_new_tokens=max_new_tokens, context_length=seq_len)
        return [(prompt, _continuation(model, tokenizer, prompt, generate)) for prompt in SHOWCASE_PROMPTS]


# ------------------------------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class TextSpec:
    """What ``manifest.spec`` of prepared text records (written by :meth:`CausalLM.prepare_data`)."""

    tokenizer: Annotated[str, Rule((BYTE, TOKENIZER_FILE).__contains__, f"{BYTE!r} or {TOKENIZER_FILE!r}")]
    """``byte``, or ``tokenizer.json``: the copy of the tokenizer in the data directory."""
    tokenizer_sha256: Annotated[str, Rule(lambda v: isinstance(v, str), "the sha256 of tokenizer.json")]
    """sha256 of that copy (empty for ``byte``)."""
    vocab_size: Annotated[int, Rule(lambda v: is_int(v) and v >= 2, "an integer >= 2")]
    eot_id: int | None
    seq_len: int

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> "TextSpec":
        """The spec, checked against the manifest's arrays; anything else raises ``ValueError`` naming the key."""
        where = f"manifest.json in {clip(redact(manifest.directory or '(a description)'), 500)}"
        spec = {key: manifest.spec.get(key) for key in cls.__dataclass_fields__}  # its own keys; one left out is null
        input_shape = f"the manifest's input_shape is {manifest.input_shape}"
        below = f"expected null or an id below the vocabulary ({spec['vocab_size']})"

        def fail(key: str, why: str) -> NoReturn:
            raise ValueError(f"{where}: spec.{key}={quote(spec[key])} is invalid: {why}; {RERUN_PREP}")

        try:
            text = check(cls, spec)
        except SchemaError as exc:  # seq_len and eot_id: the words of the checks against the manifest below
            key = exc.problems[0].path
            fail(key, {"seq_len": input_shape, "eot_id": below}.get(key, exc.problems[0].fix))
        if manifest.input_shape != [text.seq_len]:
            fail("seq_len", input_shape)
        if text.eot_id is not None and not 0 <= text.eot_id < text.vocab_size:
            fail("eot_id", below)
        if text.tokenizer == TOKENIZER_FILE and len(text.tokenizer_sha256) != 64:
            fail("tokenizer_sha256", "expected the sha256 of tokenizer.json")
        tokens = manifest.arrays.get("tokens")
        if tokens is None or tokens.shape != [text.seq_len + 1] or tokens.max_value != text.vocab_size - 1:
            fail("vocab_size", f"the manifest's arrays are {manifest.arrays}")
        return text


def _check_embedding_size(config: TrainingConfig, lm_config: Any, spec: TextSpec) -> None:
    """``ValueError`` naming ``data.tokenizer`` when the prepared data's vocabulary would give the model an fp32 token
    embedding (vocabulary x hidden size x 4 bytes) larger than :data:`MAX_EMBEDDING_BYTES`."""
    text_config = lm_config.get_text_config()
    vocab_size, hidden_size = getattr(text_config, "vocab_size", None), getattr(text_config, "hidden_size", None)
    size = vocab_size * hidden_size * 4 if is_int(vocab_size) and is_int(hidden_size) else 0
    if size <= MAX_EMBEDDING_BYTES:
        return
    raise ValueError(
        f"data.tokenizer={quote(config.data.tokenizer)} is invalid: its vocabulary of {spec.vocab_size:,} ids (one "
        f"more than its largest id) gives model.name={quote(config.model.name)} a token embedding of "
        f"{spec.vocab_size:,} x {hidden_size:,} fp32 = {size / 2**30:,.1f} GiB, more than the "
        f"{MAX_EMBEDDING_BYTES / 2**30:,.0f} GiB allowed (Llama 3 405B's is 8 GB); use a tokenizer whose ids run "
        "from 0 without large gaps, and re-run data prep"
    )


def read_tokenizer(manifest: Manifest, spec: Any = None) -> TextTokenizer:
    """The tokenizer the data in ``manifest.directory`` was prepared with (:func:`~training_core.data.text.
    prepared_tokenizer`), as ``spec`` (its ``tokenizer`` and ``tokenizer_sha256``; by default the
    :class:`TextSpec`) records it."""
    spec = spec or TextSpec.from_manifest(manifest)
    return prepared_tokenizer(manifest.directory, spec.tokenizer, spec.tokenizer_sha256)


def _split_streams(
    spill: TokenSpill, data: DataConfig, tokenizer: TextTokenizer, source: str
) -> dict[str, SplitStream]:
    """The spilled documents split by document into train/val/test streams; raises ``ValueError`` naming
    ``data.seq_len`` when a split holds less than one sequence."""
    streams = {
        split: SplitStream(spill, index, eot_id=tokenizer.eot_id)
        for split, index in split_documents(spill.sizes, data, source=source).items()
    }
    for split, stream in streams.items():
        if not num_sequences(stream.num_tokens, data.seq_len):
            fraction = (
                "lower data.val_fraction or data.test_fraction" if split == "train" else f"raise data.{split}_fraction"
            )
            raise ValueError(
                f"data.seq_len={data.seq_len} is invalid: the {split} split of {source} ({len(stream.index)} "
                f"documents, {stream.num_tokens} tokens) holds less than one sequence of seq_len + 1 tokens; "
                f"lower data.seq_len, {fraction}, or add text (data.max_text_bytes, more documents)"
            )
    return streams


def write_text(out_dir: str, name: str, text: str) -> None:
    """Write ``text`` as the UTF-8 file ``name`` in ``out_dir`` (a local path or a URL), created if missing."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(out_dir)
    fs.makedirs(root, exist_ok=True)
    with fs.open(join_path(root, name), "wb") as f:
        f.write(text.encode("utf-8"))


# ------------------------------------------------------------------------------------------------ the models


def model_config(model: ModelConfig, *, vocab_size: int, eot_id: int | None) -> Any:
    """The ``transformers`` config ``model`` names, with the data's vocabulary, its overrides and no dropout.
    An unknown name, a config class that is not a causal language model, or overrides it cannot take raise
    ``ValueError`` naming the field."""
    import transformers

    if model.name in GPT2_SIZES:
        size = GPT2_SIZES[model.name]
        hidden = model.hidden_size or size.hidden_size
        heads = model.num_heads or size.num_heads
        if hidden % heads:
            field_name, value = ("model.hidden_size", hidden) if model.hidden_size else ("model.num_heads", heads)
            raise ValueError(
                f"{field_name}={value} is invalid: {model.name} has {heads} attention heads of {hidden} / {heads} "
                "dimensions; make model.hidden_size a multiple of model.num_heads"
            )
        return transformers.GPT2Config(
            vocab_size=vocab_size,
            n_positions=model.context_length or size.context_length,
            n_embd=hidden,
            n_layer=model.num_layers or size.num_layers,
            n_head=heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=eot_id,
            eos_token_id=eot_id,
        )
    config_class = _config_class(model.name)
    defaults = config_class()
    kwargs: dict[str, Any] = {"vocab_size": vocab_size, "bos_token_id": eot_id, "eos_token_id": eot_id}
    # Some configs (BERT's) make a bidirectional encoder unless told they are a decoder: it would see the tokens
    # it is asked to predict.
    if hasattr(defaults, "is_decoder"):
        kwargs["is_decoder"] = True
    kwargs |= no_dropout(defaults) | size_overrides(model, defaults)
    _scale_with_overrides(defaults, kwargs, model)
    try:
        return config_class(**kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers validates configs with various exception types
        raise ValueError(
            f"model.name={quote(model.name)} is invalid with model.num_layers={model.num_layers}, hidden_size="
            f"{model.hidden_size}, num_heads={model.num_heads}, context_length={model.context_length}: "
            f"{type(exc).__name__}: {clip(str(exc))}; fix those overrides"
        ) from None


def size_overrides(model: ModelConfig, defaults: Any) -> dict[str, int]:
    """``model``'s non-zero :data:`OVERRIDES` under the attribute names of ``defaults`` (a ``transformers`` config);
    one the config has no integer attribute for raises ``ValueError`` naming the field."""
    found = {}
    for field_name, attribute in OVERRIDES:
        value = getattr(model, field_name)
        if value and not isinstance(getattr(defaults, attribute, None), int):
            invalid(f"model.{field_name}", value, f"{model.name} has no {attribute}; leave model.{field_name} at 0")
        if value:
            found[attribute] = value
    return found


def no_dropout(config: Any) -> dict[str, float]:
    """The dropout probabilities a ``transformers`` config sets (``*dropout*``, ``*pdrop``), each 0.0."""
    return {
        key: 0.0
        for key, value in config.to_dict().items()
        if isinstance(value, float) and value > 0 and ("dropout" in key or key.endswith("pdrop"))
    }


def _config_class(name: str) -> type:
    """The ``transformers`` config class ``name``, checked to configure a causal language model."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    sizes = ", ".join(GPT2_SIZES)
    found = getattr(transformers, name, None) if name.endswith("Config") and name.isidentifier() else None
    if not (isinstance(found, type) and issubclass(found, transformers.PretrainedConfig)):
        raise ValueError(
            f"model.name={quote(name)} is invalid: transformers {transformers.__version__} has no config class of "
            f"that name; use {sizes} or a transformers causal-LM config class (e.g. LlamaConfig, GPTNeoXConfig, "
            "Qwen2Config)"
        )
    if found not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"model.name={quote(name)} is invalid: transformers has no causal language model for {name}; use {sizes} "
            "or a causal-LM config class (e.g. LlamaConfig, GPTNeoXConfig, Qwen2Config)"
        )
    return found


def _scale_with_overrides(defaults: Any, kwargs: dict[str, Any], model: ModelConfig) -> None:
    """Keep the proportions of the default config under ``model``'s overrides: the MLP's width follows the
    model's (a 64-wide Llama with Llama-7B's 11 008-wide MLP is not a small Llama), and grouped-query attention
    keeps its ratio of query to key/value heads where the new head count allows."""
    default_hidden = getattr(defaults, "hidden_size", None)
    default_inner = getattr(defaults, "intermediate_size", None)
    if model.hidden_size and isinstance(default_hidden, int) and isinstance(default_inner, int) and default_hidden:
        kwargs["intermediate_size"] = max(1, round(default_inner * model.hidden_size / default_hidden))
    default_heads = getattr(defaults, "num_attention_heads", None)
    default_kv = getattr(defaults, "num_key_value_heads", None)
    if model.num_heads and isinstance(default_heads, int) and isinstance(default_kv, int) and default_kv:
        ratio = max(default_heads // default_kv, 1)
        kwargs["num_key_value_heads"] = model.num_heads // ratio if model.num_heads % ratio == 0 else model.num_heads


def context_length(lm_config: Any) -> int | None:
    """Positions a model of ``lm_config`` attends over; ``None`` when the config sets no limit (a state-space
    model)."""
    value = getattr(lm_config.get_text_config(), "max_position_embeddings", None)
    return value if is_int(value) and value > 0 else None


def build_lm(model: ModelConfig, *, vocab_size: int, eot_id: int | None) -> nn.Module:
    """A randomly initialised ``transformers`` causal LM (from the global torch RNG: seed it first)."""
    from transformers import AutoModelForCausalLM

    lm_config = model_config(model, vocab_size=vocab_size, eot_id=eot_id)
    if model.name in GPT2_SIZES:
        return AutoModelForCausalLM.from_config(lm_config, attn_implementation=GPT2_ATTENTION)
    # Other configs get transformers' default kernel for their architecture (sdpa where it is supported).
    try:
        return AutoModelForCausalLM.from_config(lm_config)
    except Exception as exc:  # noqa: BLE001 - transformers raises various types for a config it cannot build
        raise ValueError(
            f"model.name={quote(model.name)} is invalid: transformers cannot build it ({type(exc).__name__}: "
            f"{clip(str(exc))}); fix the overrides (model.num_layers, hidden_size, num_heads, context_length)"
        ) from None


def _define_model_class() -> type:
    import torch
    from torch import nn

    class CausalLMModel(CarriesTokenizer, nn.Module):
        """A ``transformers`` causal LM as the loop trains it: ``forward(input_ids [N, T] int64) -> logits
        [N, T, V]``. Carries its tokenizer (``byte`` or the ``tokenizer.json`` text; empty when built without
        one), so a pickled model (MLflow's) can :meth:`generate_text` on its own. The state dict is the Hugging Face
        model's under ``lm.``."""

        def __init__(self, lm: nn.Module, *, tokenizer: str, eot_id: int | None, context_length: int | None) -> None:
            super().__init__()
            self.lm = lm
            self.tokenizer = tokenizer
            self.eot_id = eot_id
            self.context_length = context_length

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=input_ids, use_cache=False).logits

        @torch.no_grad()
        def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
            """``input_ids`` [N, T] followed by ``max_new_tokens`` greedy tokens; after a sequence's end-of-text
            token the rest of it is end-of-text. A prompt that leaves the context too little room for the new
            tokens is read from its end (the new tokens are then limited to the context less one)."""
            return _generate(self, input_ids, max_new_tokens) if max_new_tokens > 0 else input_ids

        def generate_text(self, prompt: str, max_new_tokens: int) -> str:
            """``prompt`` followed by its greedy continuation of up to ``max_new_tokens`` tokens, up to an
            end-of-text token."""
            generate = functools.partial(self.generate, max_new_tokens=max_new_tokens)
            return prompt + _continuation(self, self.text_tokenizer("generate text"), prompt, generate)

    return CausalLMModel


class CarriesTokenizer:
    """What a text model that carries its tokenizer shares (``tokenizer``: ``byte`` or the ``tokenizer.json`` text;
    empty when built without the data, from a checkpoint's description): the :class:`TextTokenizer` it decodes with,
    made on first use and left out of a pickle, so a pickled model (MLflow's) rebuilds it on its own."""

    tokenizer: str
    _text_tokenizer: TextTokenizer | None = None

    def text_tokenizer(self, purpose: str) -> TextTokenizer:
        """The tokenizer; ``ValueError`` when the model was built without one (it cannot ``purpose``)."""
        if not self.tokenizer:
            raise ValueError(
                "this model was built without its tokenizer (from a checkpoint's description, with no data "
                f"directory); build it with the prepared data's manifest to {purpose}"
            )
        if self._text_tokenizer is None:
            self._text_tokenizer = tokenizer_from_description(self.tokenizer, where="the model's tokenizer")
        return self._text_tokenizer

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__().copy()  # nn.Module's, the model's other base
        state["_text_tokenizer"] = None  # rebuilt from ``tokenizer`` on first use
        return state


def _generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """:meth:`CausalLMModel.generate` for a positive ``max_new_tokens``: the Hugging Face model's greedy
    ``generate`` in eval mode, padded with end-of-text to ``max_new_tokens``."""
    import torch

    context = model.context_length
    kept = input_ids if context is None else input_ids[:, -max(1, context - max_new_tokens) :]
    new_tokens = max_new_tokens if context is None else min(max_new_tokens, context - kept.shape[1])
    pad_id = model.eot_id if model.eot_id is not None else 0
    with eval_mode(model):
        output = model.lm.generate(
            input_ids=kept,
            attention_mask=torch.ones_like(kept),
            max_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad_id,
            eos_token_id=model.eot_id,
        )
    generated = output[:, kept.shape[1] :]
    # generate stops once every sequence has ended: the rest is end-of-text, so the shape is always the same.
    padding = generated.new_full((len(generated), new_tokens - generated.shape[1]), pad_id)
    return torch.cat([input_ids, generated, padding], dim=1)


model_class, __getattr__ = lazy_class(globals(), "CausalLMModel", _define_model_class)


def _continuation(
    model: nn.Module, tokenizer: TextTokenizer, prompt: str, generate: Callable[[torch.Tensor], torch.Tensor]
) -> str:
    """The text ``generate`` (prompt ids [1, T] on ``model``'s device -> [1, T + new]) continues ``prompt`` with,
    decoded up to an end-of-text token. An empty prompt starts a new document (the end-of-text token)."""
    import torch

    ids = tokenizer.encode(prompt).tolist() or [tokenizer.eot_id if tokenizer.eot_id is not None else 0]
    input_ids = torch.tensor(ids, dtype=torch.long, device=next(model.parameters()).device)[None]
    return tokenizer.decode(generate(input_ids)[0, input_ids.shape[1] :].tolist())


def greedy_decode(
    model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *, context_length: int
) -> torch.Tensor:
    """``input_ids`` followed by ``max_new_tokens`` argmax tokens of any ``forward(input_ids) -> logits`` model,
    reading at most the last ``context_length`` tokens (no cache: for models without ``generate``, such as the
    ``torch.export`` program MLflow loads from the registry)."""
    import torch

    output = input_ids
    with eval_mode(model), torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(output[:, -context_length:])
            output = torch.cat([output, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return output


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode, its mode restored after; a module that cannot switch (an exported program: always in
    inference mode) is left as it is."""
    was_training = model.training
    try:
        model.train(False)
    except NotImplementedError:
        was_training = None
    try:
        yield
    finally:
        if was_training is not None:
            model.train(was_training)


# ----------------------------------------------------------------------------------------------- batches


class TokenBatcher:
    """Stored int32 sequences [N, L + 1] -> (inputs [N, L], targets [N, L]) int64 on the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, batch: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        # Moved as int32 (half the bytes) and widened on the device: embeddings and cross-entropy take int64.
        tokens = to_device_async(batch["tokens"], self.device).long()
        return tokens[:, :-1], tokens[:, 1:]


def token_sums(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sums of ``logits`` [N, T, V] for ``labels`` [N, T] over the tokens whose label is not :data:`IGNORED`:
    ``loss_sum`` (summed cross-entropy, fp32), ``correct`` (argmax), ``tokens``; and ``samples``."""
    import torch.nn.functional as F

    logits = logits.float()  # a bf16 log-softmax over the vocabulary loses the loss's digits
    chosen = labels != IGNORED
    return {
        "loss_sum": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORED, reduction="sum"),
        "correct": ((logits.argmax(dim=-1) == labels) & chosen).sum(),
        "tokens": chosen.sum(),
        "samples": sample_count(labels),
    }


def perplexity(loss: float) -> float:
    """``exp(loss)``; infinite past float range, NaN for NaN (which compares false)."""
    return math.inf if loss >= 700 else math.exp(loss)
