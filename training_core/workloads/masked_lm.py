"""``masked_lm``: BERT-style pretraining of a ``transformers`` encoder by masked-token prediction; the primary metric
is the perplexity of the masked tokens.

Data: the ``causal_lm`` text pipeline, whole (:class:`~training_core.workloads.causal_lm.CausalLM`'s prep: the same
``data.dataset`` sources, tokenised in Ray tasks into a spill file, packed into windows of ``data.seq_len + 1``
tokens, verified ``.npz`` shards with the manifest and the ``tokenizer.json`` copy), with each window's number in its
split stored beside it (``sample_ids``) and the tokenizer's mask and special token ids in ``manifest.spec``. The
tokenizer must be a ``tokenizer.json`` with a mask token (``[MASK]`` or ``<mask>``); one without fails before any
worker starts. A sample is a window's first ``data.seq_len`` tokens (the last is the next window's first).

Masking happens in the batch preparation (:meth:`MaskedLM.to_device`), not in prep: of the tokens that are not
special, 15% are chosen; of those 80% become the mask token, 10% a random token and 10% stay as they are. The draws
come from a ``torch.Generator`` seeded by (``loop.seed``, epoch, sample id) (``sample_seeds``, from the loader), so a
sample is masked the same whichever rank, batch or resume reads it, and differently each epoch; evaluation masks
each sample the same way in every run (seeded by its id alone). Loss, accuracy and perplexity count the chosen
tokens only.

Models: a BERT size of :data:`~training_core.registry.ENCODER_SIZES`, a ``transformers`` config class by name, or
``model.encoder_config`` (the encoder configs of :mod:`~training_core.workloads.sequence_classification`), as a
``*ForMaskedLM`` model, randomly initialised, without dropout; or ``model.pretrained``, a Hugging Face directory
(``BertForMaskedLM``, ``BertForPreTraining``, ``BertModel``) loaded by ``sequence_classification``'s name mapping (a
head the weights lack fresh from ``loop.seed``; pooler and next-sentence tensors left out), with the data tokenised
by the ``tokenizer.json`` beside it; under FSDP each rank reads only the rows it holds (``loads_pretrained_sharded``,
the decoder tied to the word embeddings sharing their one sharded parameter). The loop trains :class:`MaskedLMModel`:
``forward(input_ids [N, T]) -> logits [N, T, V]``; its ``encoder`` is the Hugging Face model, so
``model.encoder.save_pretrained(directory)`` (with the data's ``tokenizer.json`` beside it) is a pretraining checkpoint
``sequence_classification`` fine-tunes from (``model.pretrained``: the backbone loads, the classification head is
new). Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from training_core.config import DataConfig, ModelConfig, TrainingConfig, WorkloadConfig
from training_core.data.loader import sample_seed
from training_core.data.prepared import ArraySpec, Manifest
from training_core.data.shard_files import RERUN_PREP
from training_core.data.text import BYTE, TextTokenizer, check_text_source, load_tokenizer
from training_core.messages import clip, invalid, quote
from training_core.redact import redact
from training_core.schema import is_count
from training_core.workloads.causal_lm import IGNORED, CausalLM, TextSpec, token_sums
from training_core.workloads.protocol import LossOutput, lazy_class, to_device_async
from training_core.workloads.sequence_classification import PAD_TOKENS, EncoderWorkload, encoder_architecture

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

NAME = "masked_lm"
MASK_TOKENS = ("[MASK]", "<mask>")
"""A ``tokenizer.json``'s mask token, in this order of preference (BERT's WordPiece, RoBERTa's BPE)."""
MASK_FRACTION = 0.15
"""Of a sample's tokens that are not special, the share chosen for prediction."""
MASKED_SHARE, RANDOM_SHARE = 0.8, 0.1
"""Of the chosen tokens, the share replaced by the mask token and the share replaced by a random token (the rest
stay as they are): BERT's 80/10/10."""
HEAD = "masked-LM head"
"""What the log calls the tensors outside the encoder's backbone (``cls.predictions.*``) when the weights lack them."""
EVAL_MASK_SEED = 0x3A5C
"""Seeds, with a sample's id, its masking in evaluation: the same in every run, so runs and trials compare."""


@dataclass(frozen=True)
class MaskSpec:
    """What masking needs of the tokenizer, recorded in ``manifest.spec`` at prep."""

    mask_id: int
    special_ids: tuple[int, ...]
    """Ids never chosen: the tokenizer's special tokens (the mask, padding, the document separator...)."""
    pad_id: int | None
    """The tokenizer's padding token (the encoder's ``pad_token_id``); ``None`` when it has none."""
    vocab_size: int

    @classmethod
    def of(cls, tokenizer: TextTokenizer, value: str) -> MaskSpec:
        """The mask ids of ``tokenizer`` (``data.tokenizer``'s ``value``); one without a mask token raises
        ``ValueError`` naming the field."""
        vocab = {} if tokenizer.kind == BYTE else tokenizer.backend().get_vocab(with_added_tokens=True)
        mask_id = next((vocab[token] for token in MASK_TOKENS if token in vocab), None)
        if mask_id is None:
            invalid(
                "data.tokenizer",
                value,
                f"workload.name={NAME!r} needs a tokenizer with a mask token ({', '.join(MASK_TOKENS)}) and it has "
                "none; use a WordPiece or BPE tokenizer.json that has one (BERT's or RoBERTa's), or add it as a "
                "special token",
            )
        added = tokenizer.backend().get_added_tokens_decoder()
        pad_id = next((vocab[token] for token in PAD_TOKENS if token in vocab), None)
        special = {index for index, token in added.items() if token.special}
        special.update(index for index in (mask_id, pad_id, tokenizer.eot_id) if index is not None)
        return cls(mask_id, tuple(sorted(special)), pad_id, tokenizer.vocab_size)

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> MaskSpec:
        """The spec ``masked_lm``'s prep recorded; anything else raises ``ValueError`` naming the key."""
        vocab_size = TextSpec.from_manifest(manifest).vocab_size
        raw = {key: manifest.spec.get(key) for key in ("mask_id", "special_ids", "pad_id")}

        def is_id(value: Any) -> bool:
            return is_count(value) and value < vocab_size

        checks = {
            "mask_id": is_id(raw["mask_id"]),
            "special_ids": isinstance(raw["special_ids"], list) and all(map(is_id, raw["special_ids"])),
            "pad_id": raw["pad_id"] is None or is_id(raw["pad_id"]),
        }
        for key, ok in checks.items():
            if not ok:
                where = f"manifest.json in {clip(redact(manifest.directory or '(a description)'), 500)}"
                raise ValueError(f"{where}: spec.{key}={quote(raw[key])} is invalid; {RERUN_PREP}")
        return cls(raw["mask_id"], tuple(raw["special_ids"]), raw["pad_id"], vocab_size)


def check_source(data: DataConfig) -> None:
    """What can fail before a cluster starts for the prep of ``data``: ``causal_lm``'s checks of the text source and
    the tokenizer, and a tokenizer without a mask token."""
    check_text_source(data, NAME)
    MaskSpec.of(load_tokenizer(data.tokenizer), data.tokenizer)


class MaskedLM(EncoderWorkload, CausalLM):
    """Token ids with some masked in, logits over the vocabulary at every position out; ``workload.dataset_source``
    (a mapping of document name to text) replaces the built-in text, as for ``causal_lm``. Under FSDP each rank reads
    only its shards' rows of ``model.pretrained`` (the decoder tied to the word embeddings reads their stored rows,
    once)."""

    name = NAME
    head = HEAD
    showcase = None
    """No generated text in the evaluation report: an encoder does not continue a prompt."""

    def __init__(self, selected: WorkloadConfig | None = None) -> None:
        if selected and selected.model_factory:
            invalid("workload.model_factory", selected.model_factory,
                    f"workload.name={NAME!r} trains its own encoders; leave it empty")  # fmt: skip
        super().__init__(selected)

    # ------------------------------------------------------------------------------------------------ data prep

    def prepare_data(self, data: DataConfig, out_dir: str) -> Manifest:
        """``causal_lm``'s prep, refusing first a tokenizer without a mask token."""
        MaskSpec.of(load_tokenizer(data.tokenizer), data.tokenizer)
        return super().prepare_data(data, out_dir)

    def shard_arrays(self, packed: Iterator[np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """Each shard's windows with their numbers in the split (``sample_ids``): what seeds their masking."""
        first = 0
        for tokens in packed:
            yield {"tokens": tokens, "sample_ids": np.arange(first, first + len(tokens), dtype=np.int64)}
            first += len(tokens)

    def stored_arrays(self, data: DataConfig, tokenizer: TextTokenizer) -> tuple[dict[str, ArraySpec], dict[str, Any]]:
        arrays, _ = super().stored_arrays(data, tokenizer)
        masks = MaskSpec.of(tokenizer, data.tokenizer)
        spec = {"mask_id": masks.mask_id, "special_ids": list(masks.special_ids), "pad_id": masks.pad_id}
        return {**arrays, "sample_ids": ArraySpec("int64", [])}, spec

    # ------------------------------------------------------------------------------------------------- models

    def check(self, config: TrainingConfig, manifest: Manifest) -> None:
        """The data was prepared by this workload, and the encoder's vocabulary and positions hold it. With
        ``model.pretrained`` (a Hugging Face directory), the data was tokenised with the tokenizer beside it and its
        weights fit (matched on the meta device); its ``config.json`` and sha256 are recorded in
        ``model.encoder_config`` and ``model.pretrained_sha256`` (in place), as ``sequence_classification`` does."""
        if manifest.workload != NAME:
            invalid("workload.name", NAME, f"the prepared data at {quote(manifest.directory)} was written by workload "
                    f"{manifest.workload!r}; prepare the data with workload.name={NAME!r}")  # fmt: skip
        spec = TextSpec.from_manifest(manifest)
        self.adopt_pretrained(config, spec.tokenizer_sha256)
        encoder_config = mlm_config(config.model, manifest)
        vocab = getattr(encoder_config, "vocab_size", None)
        if not isinstance(vocab, int) or vocab < spec.vocab_size:
            invalid("data.tokenizer", config.data.tokenizer, f"its ids run to {spec.vocab_size - 1}, past the "
                    f"encoder's vocabulary of {vocab}: tokenise with the model's own tokenizer")  # fmt: skip
        positions = getattr(encoder_config, "max_position_embeddings", None)
        if isinstance(positions, int) and spec.seq_len > positions:
            fix = f"the encoder has {positions} positions; lower it to at most {positions} and prepare again"
            invalid("data.seq_len", spec.seq_len, fix)
        self.check_pretrained_weights(config, lambda: new_masked_lm(config, manifest))

    def build_model(self, config: TrainingConfig, manifest: Manifest) -> nn.Module:
        """:class:`MaskedLMModel` around a ``transformers`` masked LM, randomly initialised (from the loop's seeded
        RNG), with ``model.pretrained``'s weights loaded as the module docstring says, but not into parameters on
        the meta device: under FSDP each rank reads its shards' rows after sharding (``loads_pretrained_sharded``)."""
        encoder = new_masked_lm(config, manifest)
        self.load_pretrained_weights(encoder, config)
        model = model_class()(encoder)
        log.info("built %s (%s): %.2f M parameters", config.model.name or encoder.config.model_type,
                 type(encoder).__name__, sum(p.numel() for p in model.parameters()) / 1e6)  # fmt: skip
        return model

    # ------------------------------------------------------------------------------------------ batches, loss

    def to_device(self, manifest: Manifest, device: torch.device) -> Callable[[Mapping[str, np.ndarray]], Any]:
        return MaskingBatcher(MaskSpec.from_manifest(manifest), device)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossOutput:
        """Mean cross-entropy over the batch's chosen tokens; sums of correct predictions, chosen tokens and
        samples."""
        inputs, labels = batch
        sums = token_sums(model(inputs), labels)
        loss = sums.pop("loss_sum") / sums["tokens"].clamp(min=1)
        return LossOutput(loss=loss, sums=sums, num_samples=len(inputs), num_tokens=inputs.numel())


def new_masked_lm(config: TrainingConfig, manifest: Manifest) -> nn.Module:
    """The ``transformers`` masked LM the config names for ``manifest``'s data (``model.pretrained``'s
    ``config.json`` when ``check`` has not recorded it), randomly initialised from the global torch RNG."""
    from transformers import AutoModelForMaskedLM

    try:
        return AutoModelForMaskedLM.from_config(mlm_config(config.model, manifest))
    except Exception as exc:  # noqa: BLE001 - transformers raises various types for a config it cannot build
        why = f"transformers cannot build a masked LM of it ({type(exc).__name__}: {clip(str(exc))})"
        invalid("model.name", config.model.name, f"{why}; use a BERT size or BertConfig, RobertaConfig")


def mlm_config(model: ModelConfig, manifest: Manifest) -> Any:
    """The ``transformers`` config of the encoder ``model`` names, for the vocabulary and padding of the data."""
    masks = MaskSpec.from_manifest(manifest)
    return encoder_architecture(model, vocab_size=masks.vocab_size, pad_id=masks.pad_id)


# ----------------------------------------------------------------------------------------------- masking


def mask_tokens(tokens: np.ndarray, seeds: Sequence[int], masks: MaskSpec) -> tuple[np.ndarray, np.ndarray]:
    """``tokens`` [N, T] masked, and the labels: ``(inputs, labels)`` int64 [N, T], a label ``IGNORED`` where the
    token was not chosen. Sample ``i``'s draws come from a ``torch.Generator`` seeded with ``seeds[i]`` alone."""
    import torch

    ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    count, length = ids.shape
    draws = torch.empty((count, 2, length))
    random_ids = torch.empty((count, length), dtype=torch.long)
    for row, seed in enumerate(seeds):
        generator = torch.Generator().manual_seed(int(seed))
        torch.rand((2, length), generator=generator, out=draws[row])
        torch.randint(masks.vocab_size, (length,), generator=generator, out=random_ids[row])
    chosen = (draws[:, 0] < MASK_FRACTION) & ~torch.isin(ids, torch.tensor(masks.special_ids, dtype=torch.long))
    action = draws[:, 1]
    inputs = torch.where(chosen & (action < MASKED_SHARE), masks.mask_id, ids)
    randomised = chosen & (action >= MASKED_SHARE) & (action < MASKED_SHARE + RANDOM_SHARE)
    inputs = torch.where(randomised, random_ids, inputs)
    return inputs.numpy(), torch.where(chosen, ids, IGNORED).numpy()


class MaskingBatcher:
    """Stored windows -> (masked input_ids [N, seq_len], labels [N, seq_len]) int64 on the device. A training batch
    carries each sample's seed for its epoch (``sample_seeds``); an evaluation batch its id only."""

    def __init__(self, masks: MaskSpec, device: torch.device) -> None:
        self.masks, self.device = masks, device

    def __call__(self, batch: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        seeds = batch.get("sample_seeds")
        if seeds is None:
            seeds = [sample_seed(EVAL_MASK_SEED, 0, int(sample_id)) for sample_id in batch["sample_ids"]]
        inputs, labels = mask_tokens(batch["tokens"][:, :-1], seeds, self.masks)
        return to_device_async(inputs, self.device), to_device_async(labels, self.device)


# ------------------------------------------------------------------------------------------------ the model


def _define_model_class() -> type:
    from torch import nn

    class MaskedLMModel(nn.Module):
        """A ``transformers`` masked LM as the loop trains it: ``forward(input_ids [N, T] int64) -> logits
        [N, T, V]`` (packed text: no padding). Its state dict is the Hugging Face model's under ``encoder.``."""

        def __init__(self, encoder: nn.Module) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.encoder(input_ids=input_ids).logits

    return MaskedLMModel


model_class, __getattr__ = lazy_class(globals(), "MaskedLMModel", _define_model_class)
