"""Labelled text for the ``sequence_classification`` tests: a small separable dataset (each class has its own words
among shared filler), a WordPiece ``tokenizer.json`` trained on it, and tiny BERTs saved as Hugging Face directories
(safetensors) with that tokenizer beside them."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

CLASS_WORDS = {
    "fruit": "apple banana cherry grape mango peach".split(),
    "metal": "iron copper zinc nickel cobalt tin".split(),
    "color": "red green blue yellow purple orange".split(),
}
FILLER = "the a of and with some very".split()
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
"""The WordPiece tokenizer's special tokens: ``[PAD]`` is id 0, as in BERT's vocabulary."""


def labeled_rows(count: int, *, seed: int = 0, classes: int = 3) -> list[tuple[str, str]]:
    """``count`` (text, label) pairs, classes in turn: three words of the class's own among four filler words."""
    rng = random.Random(seed)
    names = list(CLASS_WORDS)[:classes]
    rows = []
    for index in range(count):
        label = names[index % classes]
        words = [rng.choice(CLASS_WORDS[label]) for _ in range(3)] + [rng.choice(FILLER) for _ in range(4)]
        rng.shuffle(words)
        rows.append((" ".join(words), label))
    return rows


def write_csv(path: Path, rows: list[tuple[str, object]], *, header: tuple[str, str] = ("text", "label")) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[tuple[str, object]]) -> Path:
    path.write_text("".join(json.dumps({"text": text, "label": label}) + "\n" for text, label in rows))
    return path


def write_parquet(path: Path, rows: list[tuple[str, object]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # The label column first, as a table exported from elsewhere may have it.
    pq.write_table(pa.table({"label": [label for _, label in rows], "text": [t for t, _ in rows]}), path)
    return path


def wordpiece_tokenizer(path: Path, texts: list[str]) -> Path:
    """A BERT-style WordPiece ``tokenizer.json`` (lower-casing, ``[PAD]`` = 0) trained on ``texts``, saved at
    ``path``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=200, special_tokens=SPECIAL_TOKENS))
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def tiny_bert(directory: Path, *, vocab_size: int, num_labels: int, seed: int = 1, head: bool = True):
    """A 2-layer BERT of width 32 (``BertForSequenceClassification``, or without ``head`` a ``BertForMaskedLM``:
    a pretraining checkpoint), randomly initialised from ``seed`` and saved in ``directory`` as safetensors.
    Returns the model."""
    import torch
    import transformers

    config = transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
        pad_token_id=0,
        num_labels=num_labels,
    )
    torch.manual_seed(seed)
    model = (transformers.BertForSequenceClassification if head else transformers.BertForMaskedLM)(config)
    model.save_pretrained(directory, safe_serialization=True)
    return model
