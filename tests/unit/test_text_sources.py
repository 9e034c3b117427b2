"""What data prep reads from a user: ``.txt`` / ``.jsonl`` / ``.parquet`` files under ``data.path``, a
``tokenizer.json`` and a CIFAR-10 tarball. Special files (FIFOs, a symlink to ``/dev/zero``, a dangling symlink),
damaged and hostile contents and tokenizers with ids too large for the shards or the model each end in a
``ValueError`` naming the field, the file and the fix: never a hang, an exhausted memory or a library's bare
exception. Real files throughout."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import hypothesis
import numpy as np
import pytest

from training_core.config import DataConfig, TrainingConfig
from training_core.data import text
from training_core.workloads import causal_lm
from training_core.workloads.causal_lm import CausalLM


def documents(path: Path | str, text_field: str = "text") -> list[text.Document]:
    return list(text.path_documents(str(path), text_field, text.SourceStats()))


def error(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as caught:
        call(*args, **kwargs)
    return str(caught.value)


def three_txt_files(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        (directory / f"part{i}.txt").write_text(f"document {i} " * 20)
    return directory


def bpe_tokenizer(path: Path, *, eot_id: int | None = None) -> Path:
    """A real byte-level BPE tokenizer.json (tokenizers' trainer, ``<|endoftext|>`` as id 0), its end-of-text token
    renumbered to ``eot_id`` when given, the way a hand-edited file would be."""
    from benchmarks.common import train_bpe_tokenizer

    train_bpe_tokenizer(path, ["the quick brown fox jumps over the lazy dog. " * 40], vocab_size=300)
    if eot_id is not None:
        raw = json.loads(path.read_text())
        raw["added_tokens"][0]["id"] = eot_id
        raw["model"]["vocab"]["<|endoftext|>"] = eot_id
        path.write_text(json.dumps(raw))
    return path


# ------------------------------------------------------------------------------------------------ special files


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["x.txt", "x.jsonl", "x.parquet"])
def test_a_fifo_named_like_a_text_file_is_refused_without_blocking(tmp_path, name):
    os.mkfifo(three_txt_files(tmp_path / "data") / name)
    found = error(documents, tmp_path / "data")
    assert f"data.path='{tmp_path / 'data'}' is invalid: '{name}' is a FIFO, not a regular file" in found
    assert "remove it from data.path" in found


@pytest.mark.timeout(30)
def test_a_fifo_named_tokenizer_json_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "tokenizer.json")
    found = error(text.load_tokenizer, str(tmp_path / "tokenizer.json"))
    assert "data.tokenizer=" in found and "is a FIFO, not a regular file" in found and "'byte'" in found


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["x.txt", "x.jsonl"])
def test_a_symlink_to_dev_zero_is_refused_not_read_until_memory_runs_out(tmp_path, name):
    """/dev/zero reports a size of 0, so a cap on the reported size never applied, and it has no line end either."""
    (three_txt_files(tmp_path / "data") / name).symlink_to("/dev/zero")
    assert "is a character device, not a regular file" in error(documents, tmp_path / "data")


def test_a_tokenizer_json_linked_to_dev_zero_is_named_as_the_device_it_is(tmp_path):
    (tmp_path / "tokenizer.json").symlink_to("/dev/zero")
    found = error(text.load_tokenizer, str(tmp_path / "tokenizer.json"))
    assert "is a character device, not a regular file" in found


def test_a_dangling_symlink_under_data_path_names_the_file(tmp_path):
    (three_txt_files(tmp_path / "data") / "gone.txt").symlink_to(tmp_path / "removed.txt")
    found = error(documents, tmp_path / "data")
    assert "'gone.txt' does not exist (a dangling symlink, or it was removed)" in found and "data.path=" in found


def test_a_txt_file_is_capped_by_the_bytes_read_not_by_the_size_it_reports(tmp_path, monkeypatch):
    """A regular file whose reported size is 0 although it holds text: /proc's files are such."""
    monkeypatch.setattr(text, "MAX_TEXT_DOCUMENT_BYTES", 100)
    procfs_file = Path("/proc/self/status")  # Linux, where the platform runs: reports size 0, holds ~1.5 KB
    assert os.stat(procfs_file).st_size == 0 and len(procfs_file.read_bytes()) > 100
    (tmp_path / "status.txt").symlink_to(procfs_file)
    assert "'status.txt' is one document of more than 100 bytes" in error(documents, tmp_path / "status.txt")


def test_a_file_name_that_is_not_utf8_is_read_and_named_in_utf8(tmp_path):
    data = three_txt_files(tmp_path / "data")
    with open(os.path.join(os.fsencode(data), b"caf\xe9.txt"), "wb") as f:
        f.write(b"latin-1 name")
    names = [document.name for document in documents(data)]
    assert names[0] == "caf\\xe9.txt" and all(name.encode("utf-8") for name in names)
    with open(os.path.join(os.fsencode(data), b"bad\xff.jsonl"), "wb") as f:
        f.write(b"not json\n")
    found = error(documents, data)
    assert "line 1 of 'bad\\\\xff.jsonl' is not JSON" in found
    found.encode("utf-8")


# --------------------------------------------------------------------------------------------------------- JSONL


def test_a_json_line_nested_100000_deep_fails_fast_naming_the_line(tmp_path):
    lines = [json.dumps({"text": "fine " * 10}), '{"text": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}"]
    (tmp_path / "deep.jsonl").write_text("\n".join(lines) + "\n")
    started = time.perf_counter()
    found = error(documents, tmp_path / "deep.jsonl")
    assert time.perf_counter() - started < 2
    assert f"line 2 of 'deep.jsonl' nests arrays and objects 100,001 deep, more than {text.MAX_JSON_DEPTH}" in found


def test_brackets_inside_json_strings_do_not_count_as_nesting(tmp_path):
    record = {"text": "[[[{{{" * 1000 + ' \\" ]] ' + "{" * 500, "meta": [[[1]]]}
    (tmp_path / "code.jsonl").write_text(json.dumps(record) + "\n")
    assert [d.text for d in documents(tmp_path / "code.jsonl")] == [record["text"]]
    assert text.json_depth(json.dumps(record).encode()) == 4


def test_a_json_line_with_a_5000_digit_integer_is_read(tmp_path):
    (tmp_path / "big.jsonl").write_text('{"id": ' + "7" * 5000 + ', "text": "a document"}\n')
    assert [d.text for d in documents(tmp_path / "big.jsonl")] == ["a document"]


def test_a_json_line_longer_than_a_document_may_be_fails_naming_the_line_and_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "MAX_TEXT_DOCUMENT_BYTES", 2 * 2**20)
    lines = [json.dumps({"text": "short"}), json.dumps({"text": "x" * (3 * 2**20)})]
    (tmp_path / "long.jsonl").write_text("\n".join(lines) + "\n")
    found = error(documents, tmp_path / "long.jsonl")
    assert "line 2 of 'long.jsonl' holds more than 2 MiB, the most read as one document" in found
    assert "cut its text into lines of at most 2 MiB" in found


def _jsonl_lines(st):
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
    values = st.recursive(
        scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    )
    records = st.dictionaries(st.sampled_from(["text", "body", "x"]), values, max_size=3).map(json.dumps)
    deep = st.integers(1, 3000).map(lambda n: '{"text": "t", "a": ' + "[" * n + "]" * n + "}")
    huge_int = st.integers(1, 9000).map(lambda n: '{"text": "t", "n": -' + "9" * n + "}")
    raw = st.binary(max_size=40).map(lambda b: b.decode("latin-1"))
    return st.lists(st.one_of(records, deep, huge_int, raw, st.text(max_size=30)), min_size=1, max_size=5)


def test_generated_jsonl_lines_give_documents_or_a_value_error_naming_the_file(tmp_path):
    @hypothesis.settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @hypothesis.given(_jsonl_lines(hypothesis.strategies))
    def check(lines):
        path = tmp_path / "generated.jsonl"
        path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass"))
        try:
            found = documents(path)
        except ValueError as exc:
            assert f"data.path='{path}' is invalid: " in str(exc) and "'generated.jsonl'" in str(exc)
            assert len(str(exc)) < 2000
        else:
            assert all(isinstance(d.text, str) for d in found)

    check()


# ------------------------------------------------------------------------------------------------------- Parquet


def test_a_dictionary_encoded_string_column_is_read_as_text(tmp_path):
    import pandas as pd
    import pyarrow.parquet as pq

    frame = pd.DataFrame({"text": pd.Categorical(["spam", "eggs", "spam", None])})
    frame.to_parquet(tmp_path / "category.parquet")
    assert str(pq.read_schema(tmp_path / "category.parquet").field("text").type).startswith("dictionary")
    stats = text.SourceStats()
    found = list(text.path_documents(str(tmp_path / "category.parquet"), "text", stats))
    assert [d.text for d in found] == ["spam", "eggs", "spam"] and stats.missing_field == 1


def test_a_parquet_file_with_a_corrupt_page_names_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    rows = ["".join(rng.choice(list("abcdefgh "), size=200)) for _ in range(2000)]
    path = tmp_path / "corrupt.parquet"
    pq.write_table(pa.table({"text": rows}), path, compression="snappy", use_dictionary=False)
    payload = bytearray(path.read_bytes())
    # The data page's compressed bytes sit between the 4-byte magic and the footer: scramble their middle.
    middle = len(payload) // 3
    payload[middle : middle + 2000] = rng.integers(0, 256, size=2000, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(payload))
    found = error(documents, path)
    assert f"data.path='{path}' is invalid: 'corrupt.parquet' (after row 0) cannot be read" in found
    assert "write it again, or remove it" in found


def test_a_parquet_cell_longer_than_a_document_may_be_fails_naming_the_row(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(text, "MAX_TEXT_DOCUMENT_BYTES", 2 * 2**20)
    pq.write_table(pa.table({"text": ["short", "x" * (3 * 2**20), "short"]}), tmp_path / "long.parquet")
    found = error(documents, tmp_path / "long.parquet")
    assert "row 1 of 'long.parquet' holds a text of more than 2 MiB in column 'text'" in found


# ----------------------------------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("eot_id", [2**31, 2**32 - 1])
def test_a_token_id_beyond_int32_is_refused_when_the_tokenizer_is_loaded(tmp_path, eot_id):
    path = bpe_tokenizer(tmp_path / "tokenizer.json", eot_id=eot_id)
    found = error(text.load_tokenizer, str(path))
    assert f"data.tokenizer='{path}' is invalid: token '<|endoftext|>' has id {eot_id:,}, beyond 2,147,483,647" in found
    assert "int32" in found


def test_a_vocabulary_whose_embedding_would_not_fit_fails_the_check_naming_its_size(tmp_path):
    """An id of 2,000,000,000 fits the shards' int32, so prep passes; gpt2-tiny's embedding would be 477 GiB."""
    tokenizer = bpe_tokenizer(tmp_path / "tokenizer.json", eot_id=2_000_000_000)
    data = {"dataset": "text", "path": str(three_txt_files(tmp_path / "data")), "seq_len": 8, "num_shards": 2}
    data["tokenizer"] = str(tokenizer)
    manifest = CausalLM().prepare_data(DataConfig(**data), str(tmp_path / "out"))
    assert manifest.spec["vocab_size"] == 2_000_000_001
    config = TrainingConfig.from_dict({"workload": {"name": "causal_lm"}, "data": data, "model": {"name": "gpt2-tiny"}})
    found = error(CausalLM().check, config, manifest)
    assert "vocabulary of 2,000,000,001 ids" in found and "2,000,000,001 x 64 fp32 = 476.8 GiB" in found
    assert f"more than the {causal_lm.MAX_EMBEDDING_BYTES // 2**30} GiB allowed" in found


def test_a_tokenizer_whose_pre_tokenizer_regex_panics_is_a_value_error_naming_it(tmp_path):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1, "<|endoftext|>": 2}, unk_token="[UNK]"))
    # Exponential backtracking: Oniguruma gives up past its retry limit, and tokenizers panics.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(a|a)*$"), behavior="isolated")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = text.load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert loaded.encode("a b").tolist()  # short text matches within the limit
    found = error(loaded.encode_batch, ["a" * 40 + "!"])
    assert f"data.tokenizer='{tmp_path / 'tokenizer.json'}' is invalid: the tokenizer failed" in found
    assert "PanicException" in found and "pre_tokenizer 'Split' regex" in found


def test_a_tokenizer_whose_unk_token_is_not_in_its_vocabulary_fails_the_prep_naming_data_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"document": 0, "<|endoftext|>": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    data = DataConfig(
        dataset="text", path=str(three_txt_files(tmp_path / "data")), tokenizer=str(tmp_path / "tokenizer.json")
    )
    found = error(CausalLM().prepare_data, data, str(tmp_path / "out"))
    assert f"data.tokenizer='{tmp_path / 'tokenizer.json'}' is invalid: the tokenizer failed" in found
    assert "Missing [UNK] token from the vocabulary" in found and "its unk_token must be in its vocabulary" in found


# ---------------------------------------------------------------------------------- the CIFAR-10 tarball (datasets)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("special", ["fifo", "dev-zero"])
def test_a_cifar10_path_that_is_a_fifo_or_a_device_is_refused_without_reading_it(tmp_path, special):
    from training_core.data.sources import load_raw

    path = tmp_path / "cifar-10-python.tar.gz"
    if special == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    found = error(load_raw, DataConfig(dataset="cifar10", path=str(path)))
    kind = "a FIFO" if special == "fifo" else "a character device"
    assert f"data.path='{path}' is invalid: '{path}' is {kind}, not a regular file" in found


def test_a_csv_file_that_starts_with_a_byte_order_mark_is_read_by_its_column_names(tmp_path):
    for quoted in ("text,label", '"text","label"'):
        (tmp_path / "excel.csv").write_bytes(f"\ufeff{quoted}\r\nred apple,fruit\r\n".encode())
        found = list(text.path_documents(str(tmp_path), "text", text.SourceStats(), label_field="label"))
        assert [(d.name, d.text, d.label) for d in found] == [("excel.csv:2", "red apple", "fruit")]


def test_jsonl_lines_are_read_whole_whatever_reads_they_span(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "_READ_CHUNK_BYTES", 7)
    records = [{"text": "x" * n + "\u00e9"} for n in (0, 1, 6, 7, 8, 30)]
    (tmp_path / "spans.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n" + json.dumps(records[1]))
    found = documents(tmp_path / "spans.jsonl")
    assert [(d.name, d.text) for d in found] == [
        *((f"spans.jsonl:{i}", r["text"]) for i, r in enumerate(records, start=1)),
        ("spans.jsonl:8", records[1]["text"]),
    ]


@pytest.mark.timeout(30)
def test_a_fifo_in_place_of_the_prepared_tokenizer_json_is_refused_without_blocking(tmp_path):
    from training_core.workloads.causal_lm import read_tokenizer

    data = DataConfig(
        dataset="text",
        path=str(three_txt_files(tmp_path / "data")),
        seq_len=8,
        num_shards=1,
        tokenizer=str(bpe_tokenizer(tmp_path / "tokenizer.json")),
    )
    manifest = CausalLM().prepare_data(data, str(tmp_path / "out"))
    (tmp_path / "out" / "tokenizer.json").unlink()
    os.mkfifo(tmp_path / "out" / "tokenizer.json")
    found = error(read_tokenizer, manifest)
    assert "tokenizer.json in " in found and "is a FIFO, not a regular file" in found and "re-run data prep" in found


def test_a_parquet_file_without_the_text_column_fails_the_source_check_before_any_prep(tmp_path):
    import pandas as pd

    (tmp_path / "corpus").mkdir()
    pd.DataFrame({"text": ["a document " * 20] * 4}).to_parquet(tmp_path / "corpus" / "a.parquet")
    pd.DataFrame({"body": ["another one " * 20] * 4}).to_parquet(tmp_path / "corpus" / "b.parquet")
    data = DataConfig(dataset="text", path=str(tmp_path / "corpus"))
    with pytest.raises(
        ValueError, match=r"data.text_field='text' is invalid: Parquet file 'b.parquet' .* \(it has body\)"
    ):
        text.check_text_source(data)
    text.check_text_source(DataConfig(dataset="text", path=str(tmp_path / "corpus" / "a.parquet")))
