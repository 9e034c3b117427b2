"""Text for the ``causal_lm`` and ``sequence_classification`` workloads: tokenizers, text sources, the split by
document and the packing of token streams into fixed-length sequences.

- Tokenizers (``data.tokenizer``): ``byte`` (the 256 byte values plus one end-of-text token, no file needed) or a
  Hugging Face ``tokenizer.json`` at a local path or ``s3://`` URI (read through fsspec).
- Sources: ``stdlib`` (the Python standard library's own ``.py`` files on the machine that runs it: real text that
  needs no network) or ``text`` (``.txt`` files whole, ``.jsonl`` lines' ``data.text_field``, ``.parquet`` files'
  ``data.text_field`` column, under ``data.path``, local or ``s3://``). Documents come in sorted order, and
  ``data.max_text_bytes`` keeps the longest prefix of whole documents that fits. ``labeled_text``
  (``sequence_classification``) reads ``.csv`` rows, ``.jsonl`` lines and ``.parquet`` rows with their
  ``data.label_field`` too: each document carries its label.
- A user's files are read within bounds (:func:`path_documents`, :func:`load_tokenizer`); whatever is wrong with
  a file is a ``ValueError`` naming the field, the file and the fix.
- The split is by document (a file, a JSON line, a Parquet row), never inside one, so no validation or test text is
  seen in training: documents visited in a permutation seeded by ``data.split_seed`` fill val and test up to their
  share of the bytes (see :func:`split_documents`), deterministic for a given source and seed.

Heavy imports (tokenizers, fsspec, pyarrow) happen inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from training_core.config import DataConfig
from training_core.data.shard_files import RERUN_PREP, check_sha256
from training_core.files import UnreadableFile, join_path, open_regular, read_regular_path
from training_core.messages import clip, quote
from training_core.redact import redact
from training_core.registry import DATASET_SOURCES, dataset_names, load

log = logging.getLogger(__name__)

BYTE = "byte"
"""``data.tokenizer`` of the built-in byte-level tokenizer."""
BYTE_EOT_ID = 256
"""The byte-level tokenizer's end-of-text token: ids 0..255 are the bytes themselves."""
BYTE_VOCAB_SIZE = 257
TOKENIZER_FILE = "tokenizer.json"
"""Name of the copy of a ``tokenizer.json`` kept in a prepared data directory."""
MAX_TOKENIZER_BYTES = 256 * 2**20
"""Largest ``tokenizer.json`` read: real ones are a few MB (Llama 3's is 9 MB); more is not a tokenizer."""
EOT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")
"""Special tokens taken, in this order of preference, as a ``tokenizer.json``'s end-of-text token (GPT-2, Llama 3,
Llama 2 / T5, Gemma, Llama 3 chat, Qwen, BERT)."""
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
"""Files a ``text`` source reads under ``data.path``."""
LABELED_SUFFIXES = (".csv", ".jsonl", ".parquet")
"""Files a ``labeled_text`` source reads under ``data.path``: records of a text and a label."""
MAX_LABEL_CHARS = 256
"""The longest label read: a class name, not a text."""
SKIPPED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
"""Directories of the standard library not read: installed packages are not the standard library, and the test
suites hold deliberately malformed and generated files."""
_TOKENIZE_BATCH_CHARS = 4_000_000
"""Text handed to ``tokenizers`` per ``encode_batch`` call in this process: large enough for its threads, small
enough that the Python lists of ids it returns stay a few tens of MB."""
_RAY_BATCH_CHARS = 1_000_000
"""Text per Ray task (:func:`encode_batches`): a few tenths of a second of one CPU with a BPE tokenizer, so a
source of a few MB already spreads over several workers, and a task's scheduling (milliseconds) stays negligible."""
TOKENIZER_FIX = "set data.tokenizer to 'byte' or to the local path or s3:// URI of a Hugging Face tokenizer.json"
MAX_TOKEN_ID = int(np.iinfo(np.int32).max)
"""The largest token id a tokenizer may have: ids are stored as int32, in the spill file and in the shards."""


# --------------------------------------------------------------------------------------------------- tokenizers


@dataclass
class TextTokenizer:
    """Text <-> token ids. Ids are in ``[0, vocab_size)``; ``eot_id`` (when there is one) separates documents."""

    kind: str
    """``byte`` or ``tokenizer.json``: what a manifest's ``spec["tokenizer"]`` records."""
    vocab_size: int
    """One more than the largest id the tokenizer produces: the model's vocabulary."""
    eot_id: int | None
    """The end-of-text token appended after every document; ``None`` when a ``tokenizer.json`` has none."""
    json_text: str = ""
    """The ``tokenizer.json`` text (empty for ``byte``)."""
    where: str = field(default="data.tokenizer", compare=False)
    """Names the tokenizer's source (``data.tokenizer='...'``) in the errors encoding raises."""
    _backend: Any = field(default=None, repr=False, compare=False)
    """The parsed ``tokenizers.Tokenizer`` (``tokenizer.json``), built on first use."""

    @property
    def description(self) -> str:
        """``byte`` or the ``tokenizer.json`` text: what :func:`tokenizer_from_description` rebuilds it from."""
        return self.json_text or BYTE

    @property
    def sha256(self) -> str:
        """sha256 of the ``tokenizer.json`` text (empty for ``byte``)."""
        return hashlib.sha256(self.json_text.encode("utf-8")).hexdigest() if self.json_text else ""

    def backend(self) -> Any:
        if self._backend is None:
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_str(self.json_text)
        return self._backend

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's ids (int32), without special tokens a post-processor would add (documents are separated
        by :attr:`eot_id` only)."""
        if self.kind == BYTE:
            return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) for text in texts]
        try:
            encodings = self.backend().encode_batch(list(texts), add_special_tokens=False)
        except BaseException as exc:
            # A Rust panic (a pre-tokenizer regex that backtracks past Oniguruma's retry limit) reaches Python as
            # pyo3's PanicException, a BaseException subclass no module exports: recognised by name. A model that
            # cannot encode the text raises a bare Exception. All else is re-raised.
            if not (is_rust_panic(exc) or type(exc) is Exception):
                raise
            hint = (
                "a pre_tokenizer 'Split' regex that backtracks without bound does this: simplify that regex"
                if is_rust_panic(exc)
                else "fix its model: its unk_token must be in its vocabulary"
            )
            raise ValueError(
                f"{self.where} is invalid: the tokenizer failed inside its Rust code while encoding the text "
                f"({type(exc).__name__}: {clip(str(exc))}); {hint}, or {TOKENIZER_FIX}"
            ) from None
        return [np.asarray(encoding.ids, dtype=np.int32) for encoding in encodings]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``, up to the first end-of-text token (what follows it is a new document). Bytes that
        are not valid UTF-8 (a cut multi-byte character) decode as U+FFFD."""
        ids = [int(i) for i in ids]
        if self.eot_id is not None and self.eot_id in ids:
            ids = ids[: ids.index(self.eot_id)]
        if self.kind == BYTE:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self.backend().decode(ids, skip_special_tokens=False)


def is_rust_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is a panic of a Rust extension (pyo3's ``pyo3_runtime.PanicException``)."""
    return type(exc).__name__ == "PanicException"


def tokenizer_threads(count: int) -> None:
    """Encode with ``count`` threads in this process (``data.prep_num_workers``: the prep pod's CPUs).

    ``tokenizers`` encodes a batch in the thread pool of Rust's rayon, sized once per process at its first use from
    ``RAYON_NUM_THREADS``, else from the machine's cores: in a pod, those of the node, not the CPUs the pod may
    use (a 4-CPU pod on a 96-core node would run 96 threads). A value already in the environment wins."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(count))


def byte_tokenizer() -> TextTokenizer:
    return TextTokenizer(kind=BYTE, vocab_size=BYTE_VOCAB_SIZE, eot_id=BYTE_EOT_ID)


def load_tokenizer(value: str) -> TextTokenizer:
    """The tokenizer ``data.tokenizer`` names: ``byte``, or a ``tokenizer.json`` read through fsspec (a local path
    or ``s3://`` URI; a local one only when it is a regular file, and at most :data:`MAX_TOKENIZER_BYTES` of it).
    A file that cannot be read, is not a Hugging Face tokenizer or has ids beyond :data:`MAX_TOKEN_ID` raises
    ``ValueError`` naming the field, the value and the fix."""
    if value == BYTE:
        return byte_tokenizer()
    where = f"data.tokenizer={quote(value)}"
    try:
        payload = read_regular_path(value, max_bytes=MAX_TOKENIZER_BYTES)
    except UnreadableFile as exc:
        raise ValueError(f"{where} is invalid: {exc}; {TOKENIZER_FIX}") from None
    except Exception as exc:  # noqa: BLE001 - any filesystem failure (scheme, permissions, S3 errors) is the value's
        raise ValueError(
            f"{where} is invalid: it cannot be read ({type(exc).__name__}: {clip(redact(str(exc)))}); {TOKENIZER_FIX}"
        ) from None
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where} is invalid: it is not a tokenizer.json (not UTF-8 text); {TOKENIZER_FIX}") from None
    return tokenizer_from_description(text, where=where)


def prepared_tokenizer(directory: str, tokenizer: str, sha256: str) -> TextTokenizer:
    """The tokenizer data in ``directory`` was prepared with, as its manifest records it (``tokenizer``, ``sha256``):
    ``byte``, or the copy :data:`TOKENIZER_FILE` beside the shards, checked against ``sha256``. A copy that cannot
    be read or does not match raises ``ValueError`` naming it and saying to re-run data prep."""
    if tokenizer == BYTE:
        return byte_tokenizer()
    where = f"{TOKENIZER_FILE} in {clip(redact(directory), 500)}"
    try:
        payload = read_regular_path(join_path(directory, TOKENIZER_FILE), max_bytes=MAX_TOKENIZER_BYTES)
    except UnreadableFile as exc:
        raise ValueError(f"{where} cannot be read: {exc}; {RERUN_PREP}") from None
    check_sha256(where, hashlib.sha256(payload).hexdigest(), sha256)
    return tokenizer_from_description(payload.decode("utf-8"), where=where)


def tokenizer_from_description(description: str, *, where: str) -> TextTokenizer:
    """The tokenizer :attr:`TextTokenizer.description` describes (``byte`` or a ``tokenizer.json`` text).
    ``where`` names the source in the ``ValueError`` a text that is not a tokenizer raises."""
    if description == BYTE:
        return byte_tokenizer()
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_str(description)
        vocab = backend.get_vocab(with_added_tokens=True)
    except BaseException as exc:
        # tokenizers raises a bare Exception for every parse error, and a Rust panic for some (is_rust_panic).
        if not (isinstance(exc, Exception) or is_rust_panic(exc)):
            raise
        raise ValueError(
            f"{where} is invalid: it is not a Hugging Face tokenizer.json ({clip(str(exc))}); {TOKENIZER_FIX}"
        ) from None
    if not vocab:
        raise ValueError(f"{where} is invalid: the tokenizer has an empty vocabulary; {TOKENIZER_FIX}")
    largest_token, largest_id = max(vocab.items(), key=lambda item: item[1])
    if largest_id > MAX_TOKEN_ID:
        raise ValueError(
            f"{where} is invalid: token {quote(largest_token)} has id {largest_id:,}, beyond {MAX_TOKEN_ID:,}, the "
            f"largest id the shards' int32 tokens hold (the tokenizer has {len(vocab):,} tokens); number its tokens "
            f"from 0 without large gaps, or {TOKENIZER_FIX}"
        )
    eot_id = next((vocab[token] for token in EOT_TOKENS if token in vocab), None)
    if eot_id is None:
        log.warning(
            "%s has no end-of-text token (%s): documents are concatenated without a separator",
            where,
            ", ".join(EOT_TOKENS),
        )
    # Ids may have gaps: the model needs a row for the largest one (its cost is checked against the model's size:
    # causal_lm's check, before any worker starts).
    return TextTokenizer(
        kind=TOKENIZER_FILE,
        vocab_size=largest_id + 1,
        eot_id=eot_id,
        json_text=description,
        where=where,
        _backend=backend,
    )


# ------------------------------------------------------------------------------------------------------ sources


@dataclass
class Document:
    """One unit of text that is never split across train/val/test."""

    name: str
    """Unique within its source: a file's path relative to the root, ``file:line`` of a JSON line, ``file:row``
    of a Parquet row, or the key a user's ``dataset_source`` returned."""
    text: str
    label: str | int | None = None
    """A labelled record's label (``labeled_text``); ``None`` for plain text."""


@dataclass
class SourceStats:
    """What reading a source found, for the error when it yields no text."""

    files: int = 0
    """Files read."""
    records: int = 0
    """JSON lines and Parquet rows read."""
    missing_field: int = 0
    """Records without a string ``data.text_field``."""
    first_fields: list[str] = field(default_factory=list)
    """The fields of the first JSON line that lacked ``data.text_field`` (to name in the error)."""
    first_skipped_bytes: int = 0
    """Size of the first document ``data.max_text_bytes`` left out (0 when none was)."""
    text_bytes: int = 0
    """UTF-8 bytes of the documents kept."""
    surrogates_replaced: int = 0
    """Lone surrogate code points (from JSON escapes or a user's strings) written as U+FFFD."""


def read_documents(data: DataConfig, stats: SourceStats, *, workload: str = "causal_lm") -> Iterator[Document]:
    """The documents of ``data.dataset`` (a registered source of ``workload``: ``stdlib``, ``text`` for
    ``causal_lm``), in sorted order, capped by ``data.max_text_bytes``; ``stats`` counts what was read. Empty
    documents are skipped."""
    if data.dataset not in dataset_names(workload):
        raise _text_dataset_error(data, workload)
    documents = load(DATASET_SOURCES[data.dataset].read)(data, stats)
    return capped(documents, data.max_text_bytes, stats)


def stdlib_source(data: DataConfig, stats: SourceStats) -> Iterator[Document]:
    """``data.dataset='stdlib'``: the Python standard library's source files (:func:`stdlib_files`)."""
    root = stdlib_root()
    for name in stdlib_files():
        with open(os.path.join(root, name), "rb") as f:
            payload = f.read()
        stats.files += 1
        yield Document(name, payload.decode("utf-8", errors="replace"))


def path_source(data: DataConfig, stats: SourceStats) -> Iterator[Document]:
    """``data.dataset='text'``: the text files at ``data.path``."""
    return path_documents(data.path, data.text_field, stats)


def labeled_source(data: DataConfig, stats: SourceStats) -> Iterator[Document]:
    """``data.dataset='labeled_text'``: the ``.csv``, ``.jsonl`` and ``.parquet`` records at ``data.path``, each
    with its ``data.label_field``."""
    return path_documents(data.path, data.text_field, stats, label_field=data.label_field)


def check_text_source(data: DataConfig, workload: str = "causal_lm") -> None:
    """Raise the ``ValueError`` a prep of ``data`` by ``workload`` would raise on reading for a dataset that is not
    text, a ``data.path`` that cannot be listed, holds no text file or fewer than 3 ``.txt`` files and nothing else (a
    split is by document), or a ``data.tokenizer`` that cannot be read: what can fail before a cluster starts for the
    prep."""
    if data.dataset not in dataset_names(workload):
        raise _text_dataset_error(data, workload)
    if data.dataset == "text":
        fs, root, files = text_files(data.path)
        if not files:
            raise no_text_error(data, SourceStats(), source=f"data.path={quote(data.path)}")
        if all(file.endswith(".txt") for file in files):  # a document a file: fewer than 3 cannot be split
            split_documents(np.ones(len(files)), data, source=f"data.path={quote(data.path)}")
        # A Parquet file's columns are in its footer: a missing or mistyped text column fails here, not in a task.
        for file in [file for file in files if file.endswith(".parquet")][:PARQUET_FILES_CHECKED]:
            name = display_name(file[len(root) :].lstrip("/") or os.path.basename(file))
            with _open_source(fs, file, name, data.path) as f:
                _parquet_column(_parquet_file(f, name, data.path), "text", data.text_field, name, data.path)
    load_tokenizer(data.tokenizer)


PARQUET_FILES_CHECKED = 16
"""Parquet files whose columns :func:`check_text_source` reads before a prep starts (a footer each; the rest are
checked as the prep reads them)."""


def _text_dataset_error(data: DataConfig, workload: str) -> ValueError:
    return ValueError(
        f"data.dataset={quote(data.dataset)} is invalid: workload.name={workload!r} reads "
        f"{' or '.join(map(repr, dataset_names(workload)))}; choose one of them, or set workload.dataset_source "
        "to your own"
    )


def mapping_documents(texts: Mapping[Any, Any], *, source: str) -> Iterator[Document]:
    """A user's mapping of document name -> text, checked, in sorted name order."""
    if not isinstance(texts, Mapping):
        raise ValueError(
            f"{source} returned a {type(texts).__name__}; it must return a mapping of document name (str) to text (str)"
        )
    for name, text in texts.items():
        if not isinstance(name, str) or not isinstance(text, str):
            raise ValueError(
                f"{source} returned an entry {quote(name)}: {type(text).__name__}; it must return a mapping of "
                "document name (str) to text (str)"
            )
    for name in sorted(texts):
        yield Document(name, texts[name])


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def capped(documents: Iterable[Document], max_bytes: int, stats: SourceStats) -> Iterator[Document]:
    """The non-empty ``documents`` in order while their UTF-8 total stays within ``max_bytes`` (0: no cap).
    Stops at the first that does not fit, so the result is a prefix of the sorted source, the same on every run."""
    for document in documents:
        try:
            size = len(document.text.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate (JSON can escape one, \ud83d): UTF-8 cannot hold it
            if not stats.surrogates_replaced:
                log.warning(
                    "document %s holds lone surrogates (\\ud800-\\udfff), which UTF-8 cannot encode: each becomes "
                    "U+FFFD (counted in the manifest's spec, surrogates_replaced)",
                    quote(document.name),
                )
            fixed, count = _LONE_SURROGATE.subn("\ufffd", document.text)
            stats.surrogates_replaced += count
            document = dataclasses.replace(document, text=fixed)
            size = len(fixed.encode("utf-8"))
        if not size:
            continue
        if max_bytes and stats.text_bytes + size > max_bytes:
            stats.first_skipped_bytes = size
            return
        stats.text_bytes += size
        yield document


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files, relative to :func:`stdlib_root`, sorted (POSIX separators)."""
    root = stdlib_root()
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_STDLIB_DIRS and not d.startswith(".")]
        relative = os.path.relpath(directory, root)
        for name in files:
            if name.endswith(".py") and not name.startswith("."):
                found.append(name if relative == "." else f"{relative}/{name}".replace(os.sep, "/"))
    return sorted(found)


def text_files(path: str, suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> tuple[Any, str, list[str]]:
    """The filesystem, root and sorted files ending in ``suffixes`` (full paths; ``.txt`` / ``.jsonl`` /
    ``.parquet`` by default) of ``path``: the file itself, or those under it (hidden files and directories
    skipped)."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(path)
        if fs.isfile(root):
            return fs, root, [root] if root.endswith(suffixes) else []
        root = root.rstrip("/")
        files = fs.find(root)
    except Exception as exc:  # noqa: BLE001 - any filesystem failure (scheme, permissions, S3 errors) is the path's
        raise ValueError(
            f"data.path={quote(path)} is invalid: it cannot be listed ({type(exc).__name__}: "
            f"{clip(redact(str(exc)))}); point it at a readable local directory, file or s3:// prefix"
        ) from None
    # Hidden files and directories (a part of the path below the root that starts with a dot) are skipped.
    visible = (file for file in files if "/." not in "/" + file[len(root) :].lstrip("/"))
    return fs, root, sorted(file for file in visible if file.endswith(suffixes))


MAX_TEXT_DOCUMENT_BYTES = 256 * 2**20
"""The largest document read: a ``.txt`` file, one ``.jsonl`` line or one Parquet cell, counted in bytes as read (not
as a file reports its size: a device or a /proc file reports 0). A 200 MB ``.txt`` file took 1.2 GB more peak memory
to tokenise (the byte tokenizer) where 200 files of 1 MB took 25 MB; a larger document fails naming its file."""
MAX_JSON_DEPTH = 200
"""The deepest nesting of arrays and objects read in a ``.jsonl`` line: records nest a few levels, and Python's
parser recurses once per level (to a ``RecursionError`` near 1,000), so a deeper line is refused before it is
parsed."""
SOURCE_FILE_FIX = "remove it from data.path, or make it a regular file that can be read"


def _amount(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB" if num_bytes >= 2**20 else f"{num_bytes:,} bytes"


def display_name(name: str) -> str:
    """``name`` as valid UTF-8: a file name whose bytes are not UTF-8 (Python holds them as lone surrogates, which no
    UTF-8 log line, JSON or protobuf message can carry) with those bytes written as ``\\xff``."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that is no escaped byte: not from a file system, but no UTF-8 either
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


def path_documents(path: str, text_field: str, stats: SourceStats, *, label_field: str = "") -> Iterator[Document]:
    """The documents of the text files at ``path`` (see :func:`text_files`), file by file in sorted order: a
    ``.txt`` file whole (UTF-8; bad bytes become U+FFFD), each ``.jsonl`` line's ``text_field``, each ``.parquet``
    row's ``text_field`` column (strings, or dictionary-encoded strings). With ``label_field``, the ``.csv``,
    ``.jsonl`` and ``.parquet`` files (:data:`LABELED_SUFFIXES`) instead, each record with its label
    (:func:`checked_label`): a record with text but no label raises. Only regular files are read (a FIFO, a
    device or a dangling symlink raises), no document beyond :data:`MAX_TEXT_DOCUMENT_BYTES`; every problem with a
    file raises ``ValueError`` naming ``data.path``, the file (its name as valid UTF-8: :func:`display_name`, as in
    each document's name) and the fix."""
    fs, root, files = text_files(path, LABELED_SUFFIXES if label_field else TEXT_SUFFIXES)
    fields = _Fields(text_field, label_field)
    for file in files:
        name = display_name(file[len(root) :].lstrip("/") or os.path.basename(file))
        stats.files += 1
        if file.endswith(".txt"):
            yield _txt_document(fs, file, name, path)
        elif file.endswith(".csv"):
            yield from _csv_documents(fs, file, name, fields, stats, path)
        elif file.endswith(".jsonl"):
            yield from _jsonl_documents(fs, file, name, fields, stats, path)
        else:
            yield from _parquet_documents(fs, file, name, fields, stats, path)


@dataclass(frozen=True)
class _Fields:
    """The fields a record's text and label are read from (``label``: empty for plain text)."""

    text: str
    label: str = ""


def checked_label(value: Any, *, where: str, path: str, label_field: str) -> str | int | None:
    """A record's label: a non-empty string of at most :data:`MAX_LABEL_CHARS` or an integer (not a boolean);
    anything else raises ``ValueError`` naming ``data.label_field``, the record (``where``) and ``data.path``.
    ``None`` for plain text (no ``label_field``)."""
    if not label_field:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63:
        return value
    if isinstance(value, str) and 0 < len(value) <= MAX_LABEL_CHARS:
        return value
    found = "no value" if value is None else f"{type(value).__name__} {clip(repr(value), 80)}"
    raise ValueError(
        f"data.label_field={quote(label_field)} is invalid: {where} under data.path={quote(path)} has {found} there; "
        f"give every record a label, a string of 1 to {MAX_LABEL_CHARS} characters or an integer, or set "
        "data.label_field to the field that holds it"
    )


def _open_source(fs: Any, file: str, name: str, path: str) -> Any:
    """``file`` opened for reading when it is a regular file, else ``ValueError`` naming ``data.path`` and ``name``."""
    try:
        return open_regular(fs, file, name)
    except UnreadableFile as exc:
        raise ValueError(f"data.path={quote(path)} is invalid: {exc}; {SOURCE_FILE_FIX}") from None
    except Exception as exc:  # noqa: BLE001 - whatever a remote filesystem raises for an object it cannot open
        raise ValueError(
            f"data.path={quote(path)} is invalid: {quote(name)} cannot be opened ({type(exc).__name__}: "
            f"{clip(redact(str(exc)))}); {SOURCE_FILE_FIX}"
        ) from None


@contextlib.contextmanager
def _reading(where: str, path: str, errors: tuple[type[BaseException], ...] = (OSError,)) -> Iterator[None]:
    """``errors`` (by default an ``OSError``: a disk's, a network's) raised while reading the file ``where`` (quoted)
    as ``ValueError`` naming ``data.path`` and the file."""
    try:
        yield
    except errors as exc:
        raise ValueError(
            f"data.path={quote(path)} is invalid: {where} cannot be read ({type(exc).__name__}: "
            f"{clip(redact(str(exc)))}); the file is damaged or was cut short: write it again, or remove it"
        ) from None


def _reported_size(f: Any) -> int:
    """The size an open file reports (0 when it reports none): what a ``.txt`` file is refused by before it is read.
    Only a hint: devices and /proc files report 0, so the bytes read are capped as well."""
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):  # a remote file: no descriptor (io.UnsupportedOperation)
        size = getattr(f, "size", None)
        return size if isinstance(size, int) else 0


def _txt_document(fs: Any, file: str, name: str, path: str) -> Document:
    cap = MAX_TEXT_DOCUMENT_BYTES
    with _open_source(fs, file, name, path) as f, _reading(quote(name), path):
        size = _reported_size(f)
        payload = f.read(cap + 1) if size <= cap else b""
    if size > cap or len(payload) > cap:
        found = f"{size / 2**20:,.0f} MiB" if size > cap else f"more than {_amount(cap)}"
        raise ValueError(
            f"data.path={quote(path)} is invalid: {quote(name)} is one document of {found}; a .txt file is a "
            "document, tokenised whole (about 6x its size in memory) and kept in one split: cut it into files of at "
            f"most {_amount(cap)}, or into the lines of a .jsonl file (a document each)"
        )
    return Document(name, payload.decode("utf-8", errors="replace"))


def _jsonl_documents(
    fs: Any, file: str, name: str, fields: _Fields, stats: SourceStats, path: str
) -> Iterator[Document]:
    cap = MAX_TEXT_DOCUMENT_BYTES
    with _open_source(fs, file, name, path) as f, _reading(quote(name), path):
        for number, line in enumerate(_lines(f, cap), start=1):
            if len(line) > cap:
                raise ValueError(
                    f"data.path={quote(path)} is invalid: line {number} of {quote(name)} holds more than "
                    f"{_amount(cap)}, the most read as one document (a .jsonl line is one, tokenised whole); "
                    f"cut its text into lines of at most {_amount(cap)} each"
                )
            if not line.strip():
                continue
            record = _json_record(line, number, name, path)
            stats.records += 1
            text = record.get(fields.text)
            if not isinstance(text, str):
                if not stats.missing_field:
                    stats.first_fields = [str(key) for key in list(record)[:20]]
                stats.missing_field += 1
                continue
            where = f"line {number} of {quote(name)}" if fields.label else ""
            label = checked_label(record.get(fields.label), where=where, path=path, label_field=fields.label)
            yield Document(f"{name}:{number}", text, label)


_READ_CHUNK_BYTES = 2**20


def _lines(f: Any, max_bytes: int) -> Iterator[bytes]:
    """The lines of the binary file ``f`` (each with its ``\\n``), read a chunk at a time. A line longer than
    ``max_bytes`` ends them: it is the last one yielded, as much of it as was read (more than ``max_bytes``), so a
    file with no line end (or a huge one) never sits in memory whole."""
    buffer = bytearray()
    while chunk := f.read(_READ_CHUNK_BYTES):
        searched = len(buffer)  # the bytes before this chunk hold no line end
        buffer += chunk
        start, end = 0, buffer.find(b"\n", searched)
        while end != -1:
            yield bytes(buffer[start : end + 1])
            start, end = end + 1, buffer.find(b"\n", end + 1)
        del buffer[:start]
        if len(buffer) > max_bytes:
            yield bytes(buffer)
            return
    if buffer:
        yield bytes(buffer)


def _json_record(line: bytes, number: int, name: str, path: str) -> dict:
    """The JSON object ``line`` (line ``number`` of the file ``name``) holds, or ``ValueError`` naming ``data.path``,
    the line and the file."""
    fix = "write one JSON object per line"

    def where() -> str:  # quoted only for an error: quoting costs as much as parsing the line
        return f"line {number} of {quote(name)}"

    # Counting is cheap; the exact depth is computed only for a line with many brackets.
    if line.count(b"[") + line.count(b"{") > MAX_JSON_DEPTH and json_depth(line) > MAX_JSON_DEPTH:
        raise ValueError(
            f"data.path={quote(path)} is invalid: {where()} nests arrays and objects {json_depth(line):,} deep, more "
            f"than {MAX_JSON_DEPTH} (the most read); {fix}, nested at most {MAX_JSON_DEPTH} deep"
        )
    try:
        record = _json_loads(line)
    except RecursionError:  # within MAX_JSON_DEPTH, on a stack already deep
        raise ValueError(
            f"data.path={quote(path)} is invalid: {where()} nests arrays and objects too deep to parse; {fix}, nested "
            "a few levels deep"
        ) from None
    except ValueError as exc:  # json's errors, and UnicodeDecodeError for bytes that are no JSON encoding
        raise ValueError(
            f"data.path={quote(path)} is invalid: {where()} is not JSON ({clip(str(exc))}); {fix}"
        ) from None
    if not isinstance(record, dict):
        raise ValueError(
            f"data.path={quote(path)} is invalid: {where()} is a JSON {type(record).__name__}, not an object; {fix}"
        )
    return record


def _json_loads(line: bytes) -> Any:
    """``json.loads``, and valid JSON with an integer past Python's limit on the digits of an int read from a string
    (``sys.get_int_max_str_digits()``, 4,300) read too: a line that fails is parsed again with such integers as
    ``Decimal`` (a parser callback for every integer would slow every line down by a third)."""
    try:
        return json.loads(line)
    except ValueError as exc:
        first = exc
    try:
        return json.loads(line, parse_int=_json_int)
    except ValueError:
        raise first from None


def _json_int(digits: str) -> Any:
    """A JSON integer: an ``int``, or a ``Decimal`` past Python's limit on its digits (:func:`_json_loads`)."""
    try:
        return int(digits)
    except ValueError:
        import decimal

        return decimal.Decimal(digits)


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_DEPTH_CHUNK = 1 << 20


def json_depth(line: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``line``: its brackets outside strings, counted at
    C speed (a regex, ``bytes.translate`` and numpy, a million brackets at a time), never parsed. For text that is
    not JSON (an unterminated string) it is only an estimate."""
    brackets = _JSON_STRING.sub(b"", line).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for start in range(0, len(brackets), _DEPTH_CHUNK):
        chunk = np.frombuffer(brackets, dtype=np.uint8, count=min(_DEPTH_CHUNK, len(brackets) - start), offset=start)
        steps = np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1)
        running = depth + np.cumsum(steps, dtype=np.int64)
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
    return deepest


def _is_text_type(pa: Any, column_type: Any) -> bool:
    """Strings in any of Arrow's layouts: plain, large, views, or dictionary-encoded (what pandas writes for a
    ``category``)."""
    if pa.types.is_dictionary(column_type):
        return _is_text_type(pa, column_type.value_type)
    is_view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(column_type) or pa.types.is_large_string(column_type) or is_view(column_type)


def _parquet_documents(
    fs: Any, file: str, name: str, fields: _Fields, stats: SourceStats, path: str
) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.compute as pc

    cap = MAX_TEXT_DOCUMENT_BYTES
    with _open_source(fs, file, name, path) as f:
        parquet = _parquet_file(f, name, path)
        columns = [_parquet_column(parquet, "text", fields.text, name, path)]
        if fields.label:
            columns.append(_parquet_column(parquet, "label", fields.label, name, path))
        # Batch by batch, so a large file never sits in memory whole.
        batches, row = parquet.iter_batches(columns=columns, batch_size=4096), 0
        while True:
            with _reading(f"{quote(name)} (after row {row})", path, (pa.ArrowException, OSError)):
                batch = next(batches, None)  # a page that cannot be read: a corrupt block, a file cut short
            if batch is None:
                return
            texts = batch.column(fields.text)
            if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
                texts = texts.cast(pa.large_string())  # dictionary-encoded or views: plain strings, one batch's
            sizes = pc.binary_length(texts)
            if (pc.max(sizes).as_py() or 0) > cap:
                at = row + int(np.argmax(sizes.to_numpy(zero_copy_only=False) > cap))
                raise ValueError(
                    f"data.path={quote(path)} is invalid: row {at} of {quote(name)} holds a text of more than "
                    f"{_amount(cap)} in column {fields.text!r}, the most read as one document (a Parquet row "
                    f"is one, tokenised whole); cut it into rows of at most {_amount(cap)} each"
                )
            labels = batch.column(fields.label).to_pylist() if fields.label else [None] * len(texts)
            for text, label in zip(texts.to_pylist(), labels):
                stats.records += 1
                if text is None:
                    stats.missing_field += 1
                else:
                    where = f"row {row} of {quote(name)}" if fields.label else ""
                    label = checked_label(label, where=where, path=path, label_field=fields.label)
                    yield Document(f"{name}:{row}", text, label)
                row += 1


def _parquet_file(f: Any, name: str, path: str) -> Any:
    """The open file ``f`` (``name`` under ``data.path``) as a ``pyarrow.parquet.ParquetFile`` (its footer read),
    else ``ValueError`` naming ``data.path`` and the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(
            f"data.path={quote(path)} is invalid: {quote(name)} is not a Parquet file ({clip(str(exc))}); "
            "remove it or rewrite it"
        ) from None


def _parquet_column(parquet: Any, role: str, column: str, name: str, path: str) -> str:
    """``column`` when the Parquet file ``name`` has it with a type a ``role`` (``text``: strings; ``label``: strings
    or integers) can take, else ``ValueError`` naming ``data.<role>_field``."""
    import pyarrow as pa

    field_name = f"data.{role}_field"
    _column(parquet.schema_arrow.names, role, column, f"Parquet file {quote(name)}", path)
    column_type = parquet.schema_arrow.field(column).type
    if _is_text_type(pa, column_type) or (role == "label" and pa.types.is_integer(column_type)):
        return column
    kinds = "strings" if role == "text" else "strings or integers"
    raise ValueError(
        f"{field_name}={quote(column)} is invalid: column {column!r} of {quote(name)} holds "
        f"{column_type}, not {kinds}; set {field_name} to the column that holds the {role}"
    )


def _csv_documents(fs: Any, file: str, name: str, fields: _Fields, stats: SourceStats, path: str) -> Iterator[Document]:
    """Each row of a ``.csv`` file with a header row naming its columns (UTF-8; bad bytes become U+FFFD): its text
    and label. Read a line at a time (:func:`_lines`), so a file without line ends never sits in memory whole."""
    import csv

    with _open_source(fs, file, name, path) as f, _reading(quote(name), path):
        lines = (line.decode("utf-8", errors="replace") for line in _lines(f, MAX_TEXT_DOCUMENT_BYTES))
        # A byte order mark (Excel's "CSV UTF-8" starts with one) is no part of the first column's name.
        rows = csv.reader(itertools.chain([next(lines, "").removeprefix("\ufeff")], lines))
        try:
            header = next(rows, [])
            where, fix = f"the header row of CSV file {quote(name)}", ", and start the file with a header row"
            text_at, label_at = (_column(header, role, column, where, path, fix) for role, column in
                                 (("text", fields.text), ("label", fields.label)))  # fmt: skip
            for row in rows:
                if not row:
                    continue
                stats.records += 1
                where = f"line {rows.line_num} of {quote(name)}"
                if len(row) != len(header):
                    raise ValueError(
                        f"data.path={quote(path)} is invalid: {where} has {len(row)} fields, the header "
                        f"{len(header)}; quote fields that hold commas or line ends (RFC 4180)"
                    )
                label = checked_label(row[label_at] or None, where=where, path=path, label_field=fields.label)
                yield Document(f"{name}:{rows.line_num}", row[text_at], label)
        except csv.Error as exc:
            raise ValueError(
                f"data.path={quote(path)} is invalid: line {rows.line_num} of {quote(name)} is not CSV "
                f"({clip(str(exc))}); write RFC 4180 CSV with a header row, or put texts longer than "
                f"{csv.field_size_limit():,} characters in .jsonl or .parquet files"
            ) from None


def _column(columns: list[str], role: str, column: str, where: str, path: str, fix: str = "") -> int:
    """Where ``column`` is in the ``columns`` of ``where`` (a file under ``data.path``), else ``ValueError`` naming
    ``data.<role>_field`` and the fix (``fix`` adds to it)."""
    if column in columns:
        return columns.index(column)
    field_name = f"data.{role}_field"
    raise ValueError(
        f"{field_name}={quote(column)} is invalid: {where} under data.path={quote(path)} has no such column (it has "
        f"{clip(', '.join(columns) or 'none')}); set {field_name} to the column that holds the {role}{fix}"
    )


def no_text_error(data: DataConfig, stats: SourceStats, *, source: str, from_user: bool = False) -> ValueError:
    """The error for a source that yielded no text, naming the field to fix (``from_user``: the source is a
    ``workload.dataset_source``, not ``data.dataset``)."""
    if stats.first_skipped_bytes:
        return ValueError(
            f"data.max_text_bytes={data.max_text_bytes} is invalid: the first document of {source} alone has "
            f"{stats.first_skipped_bytes} bytes; raise data.max_text_bytes (0 reads everything)"
        )
    if stats.records and stats.missing_field == stats.records:
        fields = f" (the first line has fields {clip(', '.join(stats.first_fields))})" if stats.first_fields else ""
        return ValueError(
            f"data.text_field={quote(data.text_field)} is invalid: none of the {stats.records} records of {source} "
            f"has a text value there{fields}; set data.text_field to the JSON field or Parquet column that holds "
            "the text"
        )
    registered = DATASET_SOURCES.get(data.dataset)
    if registered is not None and registered.needs_path and not from_user and not stats.files:
        suffixes = LABELED_SUFFIXES if data.dataset == "labeled_text" else TEXT_SUFFIXES
        return ValueError(
            f"data.path={quote(data.path)} is invalid: it holds no {', '.join(suffixes)} files; point it at "
            "such a file, or a local directory or s3:// prefix holding them"
        )
    return ValueError(
        f"{source} has no text ({stats.files} files, {stats.records} records, all empty); point it at files that "
        "hold text"
    )


# ---------------------------------------------------------------------------------------- split and sequences


SPLIT_IDS = {"train": 0, "val": 1, "test": 2}


def split_documents(sizes: Sequence[int], data: DataConfig, *, source: str) -> dict[str, np.ndarray]:
    """Indices of the documents (``sizes``: each one's UTF-8 bytes, in the source's sorted order) in each split.

    The documents are visited in a permutation seeded by ``data.split_seed``; each goes to test when that brings
    test's bytes closer to ``data.test_fraction`` of the total, else to val likewise for ``data.val_fraction``,
    else to train. So a few large files cannot swamp a held-out split: one that would overshoot goes on to train.
    Sizes are bytes, not tokens, so the same source splits alike under every tokenizer. Every split gets at least
    one document (an empty one takes the smallest of a split that has two); fewer than three documents raise
    ``ValueError`` naming the fractions."""
    sizes = np.asarray(sizes, dtype=np.int64)
    count, total = len(sizes), int(sizes.sum())
    for name, value in (("test_fraction", data.test_fraction), ("val_fraction", data.val_fraction)):
        if value <= 0:
            raise ValueError(
                f"data.{name}={value!r} is invalid: the text workloads hold out val and test documents; "
                "set it above 0 (e.g. 0.1)"
            )
    if count < 3:
        raise ValueError(
            f"data.val_fraction={data.val_fraction!r} and data.test_fraction={data.test_fraction!r} cannot be met: "
            f"{source} has {count} document(s), and the split is by document (one at least for each of train, val "
            "and test); use more files (or .jsonl lines / .parquet rows, one document each)"
        )
    assigned = np.zeros(count, dtype=np.int8)  # SPLIT_IDS
    held_out = ((SPLIT_IDS["test"], data.test_fraction * total), (SPLIT_IDS["val"], data.val_fraction * total))
    filled = {split: 0 for split, _ in held_out}
    for index in np.random.default_rng(data.split_seed).permutation(count).tolist():
        size = int(sizes[index])
        for split, target in held_out:
            # Adding the document moves the split's total closer to its target.
            if filled[split] + size / 2 <= target:
                assigned[index] = split
                filled[split] += size
                break
    for split in (SPLIT_IDS["test"], SPLIT_IDS["val"], SPLIT_IDS["train"]):
        if (assigned == split).any():
            continue
        # Three or more documents in the two other splits: one of them has two. It gives up its smallest.
        donor = max((s for s in SPLIT_IDS.values() if s != split), key=lambda s: (np.count_nonzero(assigned == s), -s))
        candidates = np.flatnonzero(assigned == donor)
        assigned[candidates[np.argmin(sizes[candidates])]] = split
    return {name: np.flatnonzero(assigned == split) for name, split in SPLIT_IDS.items()}


@dataclass
class TokenSpill:
    """Every document's token ids (int32), appended in source order to a local file; only each document's offset,
    length and UTF-8 size stay in memory (24 bytes a document), so tokenising a source holds one batch of text."""

    path: str
    offsets: np.ndarray
    """Where each document's ids start in the file, in tokens (int64)."""
    lengths: np.ndarray
    """Each document's number of ids (int64)."""
    sizes: np.ndarray
    """Each document's UTF-8 bytes (int64): what :func:`split_documents` balances."""


def spill_tokens(
    documents: Iterable[Document], tokenizer: TextTokenizer, path: str, *, ray_workers: int = 0
) -> TokenSpill:
    """Tokenise ``documents`` in batches and append each one's ids to the file ``path`` (created or truncated), in
    document order; texts and ids are dropped once written. With ``ray_workers``, that many Ray tasks tokenise at
    once on the connected cluster (:func:`encode_batches`); else this process's tokenizer threads do."""
    from array import array

    lengths: list[np.ndarray] = []
    sizes = array("q")
    batch_chars = _RAY_BATCH_CHARS if ray_workers else _TOKENIZE_BATCH_CHARS

    def batches() -> Iterator[list[str]]:
        batch: list[str] = []
        chars = 0
        for document in documents:
            sizes.append(len(document.text.encode("utf-8")))
            batch.append(document.text)
            chars += len(document.text)
            if chars >= batch_chars:
                yield batch
                batch, chars = [], 0
        if batch:
            yield batch

    with open(path, "wb") as out:
        for parts, batch_lengths in encode_batches(batches(), tokenizer, ray_workers=ray_workers):
            out.writelines(memoryview(np.ascontiguousarray(ids, dtype=np.int32)).cast("B") for ids in parts)
            lengths.append(batch_lengths)
            del parts  # before the next batch is read: one batch's ids in memory at a time
    lengths_array = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    offsets = np.zeros(len(lengths_array), dtype=np.int64)
    np.cumsum(lengths_array[:-1], out=offsets[1:])
    return TokenSpill(path, offsets, lengths_array, np.frombuffer(sizes, dtype=np.int64).copy())


def check_spilled_text(
    spill: TokenSpill, data: DataConfig, stats: SourceStats, *, source: str, from_user: bool = False
) -> None:
    """Raise :func:`no_text_error` when ``spill`` holds no document; warn of records skipped without a text value."""
    if not len(spill.sizes):
        raise no_text_error(data, stats, source=source, from_user=from_user)
    if stats.missing_field:
        log.warning(
            "%s: skipped %d of %d records without a text value in data.text_field=%s",
            source,
            stats.missing_field,
            stats.records,
            quote(data.text_field),
        )


def encode_batches(
    batches: Iterable[list[str]], tokenizer: TextTokenizer, *, ray_workers: int = 0
) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
    """Each batch of texts as its ids (int32 arrays whose concatenation is the texts' ids in order: one per text
    in this process, one per batch from Ray) and each text's number of ids (int64), in batch order.

    Without ``ray_workers``, in this process (the tokenizer's threads). With it, each batch is one Ray task of one
    CPU on the connected cluster, ``ray_workers`` of them at a time, and at most as many finished batches wait
    behind a slower one (:func:`training_core.runners.ray_tasks.map_tasks`): the driver holds a bounded number of
    batches however long the source."""
    # Each batch's texts and ids are let go before the next batch is read (``del``): one batch in memory at a time.
    if not ray_workers:
        for texts in batches:
            encoded = _encoded(tokenizer, texts)
            del texts
            yield encoded
            del encoded
        return
    import ray

    from training_core.runners.ray_tasks import map_tasks

    described = ray.put((tokenizer.description, tokenizer.where))
    arguments = ((described, texts) for texts in batches)
    for ids, lengths in map_tasks(_encode_in_ray_task, arguments, num_workers=ray_workers, ordered=True):
        # Both are views of the task's result in the object store, which stays pinned while either lives: the
        # lengths, which the caller keeps, are copied out, so the ids' memory goes with the batch.
        yield [ids], lengths.copy()
        del ids, lengths


def _encoded(tokenizer: TextTokenizer, texts: list[str]) -> tuple[list[np.ndarray], np.ndarray]:
    ids = tokenizer.encode_batch(texts)
    return ids, np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))


_task_tokenizer: TextTokenizer | None = None
"""The tokenizer a Ray worker process last built (:func:`_encode_in_ray_task`), reused by its next tasks."""


def _encode_in_ray_task(described: tuple[str, str], texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """One batch's ids in a Ray task of one CPU: one tokenizer thread (set before the first encode of the worker
    process sizes the Rust thread pool for good). ``described``: the tokenizer's description and what names its
    source in an error."""
    global _task_tokenizer
    description, where = described
    os.environ["RAYON_NUM_THREADS"] = "1"
    if _task_tokenizer is None or _task_tokenizer.description != description:
        _task_tokenizer = tokenizer_from_description(description, where=where)
    ids, lengths = _encoded(_task_tokenizer, texts)
    return (np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)), lengths


def ray_connected() -> bool:
    """Whether this process is connected to a Ray cluster (a prep running in a Ray task is), without importing
    Ray."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


class SplitStream:
    """The token stream of one split: the ids of ``spill``'s documents ``index`` (in that order), each followed by
    ``eot_id`` when there is one, read from the spill file as it is consumed (:meth:`read`)."""

    def __init__(self, spill: TokenSpill, index: np.ndarray, *, eot_id: int | None) -> None:
        self.spill, self.index, self.eot_id = spill, np.asarray(index, dtype=np.int64), eot_id
        self.num_tokens = int(spill.lengths[self.index].sum()) + (len(self.index) if eot_id is not None else 0)
        self._document, self._position = 0, 0  # the next token: document number in index, position in it

    def read(self, count: int) -> np.ndarray:
        """The next ``count`` tokens of the stream (fewer at its end), int32."""
        parts, wanted = [], count
        with open(self.spill.path, "rb") as f:
            while wanted and self._document < len(self.index):
                doc = int(self.index[self._document])
                length = int(self.spill.lengths[doc])
                if self._position < length:
                    take = min(wanted, length - self._position)
                    f.seek((int(self.spill.offsets[doc]) + self._position) * 4)
                    parts.append(np.fromfile(f, dtype=np.int32, count=take))
                    self._position += take
                    wanted -= take
                    continue
                if self.eot_id is not None:
                    parts.append(np.array([self.eot_id], dtype=np.int32))
                    wanted -= 1
                self._document, self._position = self._document + 1, 0
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def num_sequences(num_tokens: int, seq_len: int) -> int:
    """How many ``seq_len + 1``-token windows :func:`packed_shards` cuts from a stream of ``num_tokens``."""
    return max(num_tokens - 1, 0) // seq_len


def packed_shards(stream: SplitStream, *, seq_len: int, num_shards: int) -> Iterator[np.ndarray]:
    """``stream`` cut into windows of ``seq_len + 1`` tokens (int32, samples x (seq_len + 1); a model reads
    ``[:-1]`` and predicts ``[1:]``), yielded as up to ``num_shards`` shards of consecutive windows (sizes as
    ``np.array_split``'s). Consecutive windows overlap by one token, so every token but the first is a target
    exactly once; the tail shorter than a window is dropped. One shard's tokens are in memory at a time."""
    count = num_sequences(stream.num_tokens, seq_len)
    if not count:
        return
    parts = min(num_shards, count)
    carry = stream.read(1)  # the window's first token is the previous window's last
    for index in range(parts):
        windows = count // parts + (1 if index < count % parts else 0)
        tokens = np.concatenate([carry, stream.read(windows * seq_len)])
        yield np.ascontiguousarray(
            np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[::seq_len][:windows], dtype=np.int32
        )
        carry = tokens[-1:]
