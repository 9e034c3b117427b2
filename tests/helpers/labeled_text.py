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
TOPIC_WORDS = {
    "fruit": CLASS_WORDS["fruit"] + "lemon melon plum pear kiwi lime apricot papaya guava fig".split(),
    "metal": CLASS_WORDS["metal"] + "silver gold lead steel bronze brass chrome titanium platinum mercury".split(),
    "color": CLASS_WORDS["color"] + "violet pink brown black white grey cyan magenta indigo maroon".split(),
}
"""A larger vocabulary of the same three classes (16 words each), for the "pretrained beats random" task: a
pretraining corpus uses every word, a small fine-tuning set sees each word once or twice."""
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


def word_tokenizer(path: Path, words: list[str]) -> Path:
    """A BERT-style WordPiece ``tokenizer.json`` (lower-casing, ``[PAD]`` = 0) whose vocabulary is
    :data:`SPECIAL_TOKENS` then ``words`` sorted, saved at ``path``. Nothing is trained (WordPiece training breaks
    frequency ties in no fixed order), so the same words always get the same ids."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + sorted(set(words)))}
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
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


def topic_rows(
    count: int, *, seed: int, topic_words: int = 1, classes: dict[str, list[str]] = TOPIC_WORDS
) -> list[tuple[str, str]]:
    """``count`` (text, label) pairs over ``classes`` (label -> its words), classes in turn: ``topic_words`` words of
    the class's own among ``7 - topic_words`` filler words."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        label = list(classes)[index % len(classes)]
        words = [rng.choice(classes[label]) for _ in range(topic_words)]
        words += [rng.choice(FILLER) for _ in range(7 - topic_words)]
        rng.shuffle(words)
        rows.append((" ".join(words), label))
    return rows


def pretrained_bert(directory: Path, *, seed: int, steps: int = 100, seq_len: int = 16):
    """A tiny BERT (:func:`tiny_bert`'s layout) pretrained briefly on a task whose features transfer, saved in
    ``directory`` with ``save_pretrained`` (safetensors) and its ``tokenizer.json`` (:func:`word_tokenizer`). The
    task: 900 texts of one, two or three words of one half of a :data:`TOPIC_WORDS` class among filler words,
    labelled by that half (six classes: a 3-class fine-tuning re-initialises the head). Every topic word is in the
    corpus, so the encoder learns each word's topic, which a small fine-tuning set of :func:`topic_rows` cannot teach
    a random encoder. Seeded: the same ``seed`` saves the same bytes (at the same torch thread count). Returns the
    model, after ``steps`` AdamW steps (batch 32, learning rate 0.01)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    halves = {
        f"{topic}-{half}": words[half * 8 : half * 8 + 8] for topic, words in TOPIC_WORDS.items() for half in (0, 1)
    }
    rows = [row for count in (1, 2, 3) for row in topic_rows(300, seed=seed + count, topic_words=count, classes=halves)]
    words = FILLER + [word for topic in TOPIC_WORDS.values() for word in topic]
    tokenizer_path = word_tokenizer(directory / "tokenizer.json", words)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    input_ids = torch.zeros(len(rows), seq_len, dtype=torch.long)  # [PAD] is 0
    for row, encoded in enumerate(tokenizer.encode_batch([text for text, _ in rows])):
        ids = [cls_id, *encoded.ids[: seq_len - 2], sep_id]
        input_ids[row, : len(ids)] = torch.tensor(ids)
    labels = torch.tensor([list(halves).index(label) for _, label in rows])
    config = transformers.BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
        pad_token_id=0,
        num_labels=len(halves),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randint(len(rows), (32,), generator=batches)
        ids = input_ids[batch]
        model(input_ids=ids, attention_mask=(ids != 0).long(), labels=labels[batch]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory, safe_serialization=True)
    return model
