"""The ``causal_lm`` workload: text prep (stdlib, .txt / .jsonl / .parquet, a user's source; byte-level and
tokenizer.json), GPT-2 sizes and transformers configs by name, loss and metrics against direct computation,
greedy generation, the checks that fail in the driver, and a short training run that learns."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import hypothesis
import numpy as np
import pytest
import torch

from training_core.config import DataConfig, TrainingConfig
from training_core.data import Manifest, read_shard, text
from training_core.workloads import resolve_workload
from training_core.workloads.causal_lm import CausalLM, TextSpec, model_config, read_tokenizer

SEQ_LEN = 64
STDLIB_BYTES = 600_000


def lm_config(**overrides) -> TrainingConfig:
    """A causal_lm run config: gpt2-tiny on the stdlib, with ``overrides`` (section -> fields)."""
    raw = {
        "workload": {"name": "causal_lm"},
        "data": {"dataset": "stdlib", "seq_len": SEQ_LEN, "num_shards": 2, "max_text_bytes": STDLIB_BYTES},
        "model": {"name": "gpt2-tiny"},
    }
    for section, fields in overrides.items():
        raw[section] = {**raw.get(section, {}), **fields}
    return TrainingConfig.from_dict(raw)


def text_data(path: Path | str, **fields) -> DataConfig:
    return DataConfig(**{"dataset": "text", "path": str(path), "seq_len": 16, "num_shards": 1, **fields})


def all_tokens(manifest: Manifest, split: str) -> np.ndarray:
    """Every stored sequence of ``split``, each shard read (and verified) against the manifest."""
    return np.concatenate([read_shard(manifest, shard)["tokens"] for shard in manifest.splits[split].shards])


def unpack(sequences: np.ndarray) -> np.ndarray:
    """The token stream the overlapping windows were cut from (each window shares its last token with the next)."""
    return np.concatenate([sequences[0], *[row[1:] for row in sequences[1:]]])


@pytest.fixture(scope="module")
def stdlib_manifest(tmp_path_factory) -> Manifest:
    out = tmp_path_factory.mktemp("stdlib")
    CausalLM().prepare_data(lm_config().data, str(out))
    return Manifest.load(str(out))


@pytest.fixture(scope="module")
def bpe_tokenizer_path(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json trained here on a few KB of the standard library."""
    from benchmarks.common import train_bpe_tokenizer

    sample = "".join((Path(text.stdlib_root()) / name).read_text() for name in ("abc.py", "bisect.py", "copy.py"))
    return train_bpe_tokenizer(
        tmp_path_factory.mktemp("tokenizer") / "tokenizer.json", [sample[:20_000]], vocab_size=400
    )


# ------------------------------------------------------------------------------------------------ data prep


def test_the_stdlib_prepares_into_verified_shards_of_every_byte_and_one_eot_per_document(stdlib_manifest):
    manifest, spec = stdlib_manifest, stdlib_manifest.spec
    assert manifest.workload == "causal_lm" and manifest.dataset == "stdlib" and manifest.classes == []
    assert manifest.input_shape == [SEQ_LEN] and manifest.arrays["tokens"].shape == [SEQ_LEN + 1]
    assert spec["tokenizer"] == "byte" and spec["vocab_size"] == 257 and spec["eot_id"] == 256
    assert 0.9 * STDLIB_BYTES < spec["text_bytes"] <= STDLIB_BYTES
    # Byte-level: each byte is a token, and each document ends with one end-of-text token.
    assert sum(spec["tokens"].values()) == spec["text_bytes"] + sum(spec["documents"].values())
    for split in ("train", "val", "test"):
        sequences = all_tokens(manifest, split)
        assert sequences.dtype == np.int32 and sequences.shape == (manifest.splits[split].num_samples, SEQ_LEN + 1)
        assert len(sequences) == (spec["tokens"][split] - 1) // SEQ_LEN
        assert (sequences[1:, 0] == sequences[:-1, -1]).all()  # windows overlap by one token
        assert np.count_nonzero(unpack(sequences) == 256) <= spec["documents"][split]
    # The split follows the fractions of the text (by whole documents, so roughly).
    share = {split: count / sum(spec["tokens"].values()) for split, count in spec["tokens"].items()}
    assert share["test"] == pytest.approx(0.2, abs=0.1) and share["val"] == pytest.approx(0.1, abs=0.07)
    # The text is the standard library's, documents in sorted order within each split: the first file starts one.
    first_bytes = (Path(text.stdlib_root()) / text.stdlib_files()[0]).read_bytes()[:SEQ_LEN]
    starts = [unpack(all_tokens(manifest, s))[: len(first_bytes)].astype(np.uint8).tobytes() for s in manifest.splits]
    assert first_bytes in starts


def test_prep_is_deterministic_and_the_split_is_by_document(tmp_path):
    sizes = [100 + 37 * i for i in range(60)]
    data = DataConfig(dataset="stdlib", val_fraction=0.1, test_fraction=0.2, split_seed=3)
    parts = text.split_documents(sizes, data, source="test")
    assert {k: v.tolist() for k, v in parts.items()} == {
        k: v.tolist() for k, v in text.split_documents(sizes, data, source="test").items()
    }
    indices = np.concatenate(list(parts.values()))
    assert sorted(indices.tolist()) == list(range(60))  # disjoint and complete
    other = text.split_documents(sizes, DataConfig(dataset="stdlib", split_seed=4), source="test")
    assert parts["test"].tolist() != other["test"].tolist()
    share = {k: sum(sizes[i] for i in v) / sum(sizes) for k, v in parts.items()}
    assert share["test"] == pytest.approx(0.2, abs=0.03) and share["val"] == pytest.approx(0.1, abs=0.03)

    # Whole prep twice: the same shards, byte for byte.
    config = lm_config(data={"max_text_bytes": 200_000})
    first = CausalLM().prepare_data(config.data, str(tmp_path / "a"))
    second = CausalLM().prepare_data(config.data, str(tmp_path / "b"))
    assert first.to_json() == second.to_json()


def test_packed_shards_cut_the_split_stream_like_windows_of_the_whole_split(tmp_path):
    """The streamed packing (one shard's tokens read from the spill at a time) against the windows of the whole
    split's stream, cut once and split like ``np.array_split``: for any documents, split, seq_len and shard count."""
    st = hypothesis.strategies
    byte = text.byte_tokenizer()

    @hypothesis.settings(max_examples=150, deadline=None, database=None, derandomize=True)
    @hypothesis.given(
        lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12),
        pick=st.data(),
        seq_len=st.integers(1, 17),
        num_shards=st.integers(1, 6),
        eot=st.booleans(),
    )
    def check(lengths, pick, seq_len, num_shards, eot):
        documents = [
            text.Document(f"d{i}", "".join(chr(97 + (i + j) % 26) for j in range(n))) for i, n in enumerate(lengths)
        ]
        spill = text.spill_tokens(iter(documents), byte, str(tmp_path / "ids.bin"))
        index = np.array(sorted(pick.draw(st.sets(st.integers(0, len(lengths) - 1), min_size=1))))
        eot_id = text.BYTE_EOT_ID if eot else None
        parts = []
        for i in index.tolist():
            parts.append(np.frombuffer(documents[i].text.encode(), dtype=np.uint8).astype(np.int32))
            parts.extend([np.array([eot_id], dtype=np.int32)] if eot else [])
        stream = np.concatenate(parts)
        count = max(len(stream) - 1, 0) // seq_len
        windows = np.stack([stream[k * seq_len : k * seq_len + seq_len + 1] for k in range(count)]) if count else None
        got = list(
            text.packed_shards(text.SplitStream(spill, index, eot_id=eot_id), seq_len=seq_len, num_shards=num_shards)
        )
        assert text.SplitStream(spill, index, eot_id=eot_id).num_tokens == len(stream)
        if not count:
            assert got == []
            return
        want = np.array_split(windows, min(num_shards, count))
        assert [g.shape for g in got] == [w.shape for w in want]
        assert all(np.array_equal(g, w) and g.dtype == np.int32 for g, w in zip(got, want))

    check()


def test_prep_run_again_into_its_directory_rewrites_only_the_missing_or_changed_shards(tmp_path):
    data = lm_config(data={"max_text_bytes": 200_000, "num_shards": 3}).data
    out = tmp_path / "prepared"
    first = CausalLM().prepare_data(data, str(out))
    files = sorted(out.glob("*.npz"))
    assert len(files) == 9
    for file in files:
        os.utime(file, (1_000_000, 1_000_000))
    files[0].unlink()  # a prep killed before this shard
    files[4].write_bytes(files[4].read_bytes()[:-10])  # one cut short
    again = CausalLM().prepare_data(data, str(out))
    assert again.to_json() == first.to_json()
    assert {f.name for f in files if f.stat().st_mtime != 1_000_000} == {files[0].name, files[4].name}
    for split in again.splits:
        all_tokens(again, split)  # every shard verifies against the manifest


@pytest.mark.parametrize("tokenised_in", ["threads", "ray-tasks"])
def test_text_prep_memory_is_bounded_by_a_shard_not_by_the_source(tmp_path, request, tokenised_in):
    """Peak private RSS of prep (its own process) for a source ten times larger, with ten times the shards: within
    1.2x. The source is large enough that holding it would show: 24 MB of text, 96 MB of token ids. Tokenised in
    the process's threads, or in Ray tasks: there the driver holds a bounded number of batches, and the texts and
    ids it passes through Ray's object store are shared memory of the node's store (bounded by its
    ``object_store_memory``, reused as objects are freed), not the driver's, so they are not counted."""
    connect = ""
    if tokenised_in == "ray-tasks":
        connect = f"import ray; ray.init(address={request.getfixturevalue('ray_address')!r})\n"
    script = (
        "import logging, sys, threading, time\n"
        "logging.basicConfig(level=logging.INFO)\n"
        f"{connect}"
        "def private_kib():\n"
        "    status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
        "    return int(status['RssAnon'].split()[0]) + int(status['RssFile'].split()[0])\n"
        "peak = [private_kib()]\n"
        "def sample():\n"
        "    while True:\n"
        "        peak[0] = max(peak[0], private_kib())\n"
        "        time.sleep(0.002)\n"
        "threading.Thread(target=sample, daemon=True).start()\n"
        "from training_core.config import DataConfig, WorkloadConfig\n"
        "from training_core.data import prepare\n"
        "prepare(DataConfig(dataset='text', path=sys.argv[1], seq_len=128, num_shards=int(sys.argv[2])), sys.argv[3],"
        " workload=WorkloadConfig(name='causal_lm'))\n"
        "print('PEAK', max(peak[0], private_kib()))\n"
    )
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz  \n", dtype=np.uint8)
    peaks = []
    for name, files, shards in (("small", 12, 2), ("large", 120, 20)):
        source = tmp_path / name
        source.mkdir()
        for i in range(files):
            (source / f"{i:04d}.txt").write_bytes(letters[rng.integers(0, len(letters), 200_000)].tobytes())
        done = subprocess.run(
            [sys.executable, "-c", script, str(source), str(shards), str(tmp_path / f"out-{name}")],
            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        peaks.append(int(done.stdout.split("PEAK ")[-1].split()[0]) * 1024)
        manifest = Manifest.load(str(tmp_path / f"out-{name}"))
        assert len(manifest.splits["train"].shards) == shards
        assert ("in Ray tasks, 2 at a time" in done.stderr) == (tokenised_in == "ray-tasks"), done.stderr[-3000:]
    print(f"text prep peak RSS: {peaks[0] / 2**20:.0f} MiB for 2.4 MB, {peaks[1] / 2**20:.0f} MiB for 24 MB")
    assert peaks[1] / peaks[0] <= 1.2, peaks


def marked_documents(data: DataConfig) -> dict[str, str]:
    """A ``workload.dataset_source``: 40 documents, each its own marker repeated."""
    return {f"doc{i:02d}": f"<doc{i:02d}>" * (20 + i) for i in range(40)}


def test_a_user_dataset_source_never_puts_one_document_in_two_splits(tmp_path):
    workload = resolve_workload(
        TrainingConfig.from_dict(
            {
                "workload": {
                    "name": "causal_lm",
                    "dataset_source": "tests.integration.test_causal_lm:marked_documents",
                },
                "model": {"name": "gpt2-tiny"},
            }
        ).workload
    )
    manifest = workload.prepare_data(DataConfig(dataset="stdlib", seq_len=16, num_shards=1), str(tmp_path))
    assert manifest.dataset == "tests.integration.test_causal_lm:marked_documents"
    markers = {}
    for split in ("train", "val", "test"):
        decoded = bytes(unpack(all_tokens(manifest, split)).astype(np.uint8)).decode()  # EOT (256) wraps to 0
        markers[split] = set(re.findall(r"<doc\d\d>", decoded))
    assert not (markers["train"] & markers["val"]) and not (markers["train"] & markers["test"])
    assert not (markers["val"] & markers["test"])
    assert manifest.spec["documents"] == {split: len(found) for split, found in markers.items()}
    assert sum(manifest.spec["documents"].values()) == 40


def test_a_txt_tree_a_jsonl_field_and_a_parquet_column_are_read(tmp_path):
    import pandas as pd

    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / ".hidden").mkdir()
    for i in range(6):
        (tree / ("sub" if i % 2 else "") / f"part{i}.txt").write_text(f"file {i} " * 40)
    (tree / ".hidden" / "skip.txt").write_text("never read " * 100)
    (tree / "notes.md").write_text("not a text source " * 100)
    (tree / "empty.txt").write_text("")
    manifest = CausalLM().prepare_data(text_data(tree), str(tmp_path / "out-txt"))
    assert sum(manifest.spec["documents"].values()) == 6
    assert manifest.spec["text_bytes"] == sum(len(f"file {i} " * 40) for i in range(6))
    assert manifest.dataset == "text"

    records = [{"content": f"line {i} " * 30, "id": i} for i in range(12)] + [{"id": 99}]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    manifest = CausalLM().prepare_data(text_data(jsonl, text_field="content"), str(tmp_path / "out-jsonl"))
    assert sum(manifest.spec["documents"].values()) == 12

    parquet_dir = tmp_path / "parquet"
    parquet_dir.mkdir()
    frame = pd.DataFrame({"body": [f"row {i} " * 25 for i in range(10)] + [None], "n": range(11)})
    frame.to_parquet(parquet_dir / "a.parquet")
    frame.iloc[:5].to_parquet(parquet_dir / "b.parquet")
    manifest = CausalLM().prepare_data(text_data(parquet_dir, text_field="body"), str(tmp_path / "out-parquet"))
    assert sum(manifest.spec["documents"].values()) == 15

    # max_text_bytes keeps whole documents, in sorted order, within the cap.
    stats = text.SourceStats()
    capped = list(text.read_documents(text_data(jsonl, text_field="content", max_text_bytes=1000), stats))
    assert [d.name for d in capped] == ["data.jsonl:1", "data.jsonl:2", "data.jsonl:3", "data.jsonl:4"]
    assert stats.text_bytes == 4 * len("line 0 " * 30) <= 1000 < 5 * len("line 0 " * 30)


def test_a_lone_surrogate_escaped_in_json_becomes_u_fffd_and_is_counted(tmp_path, caplog):
    """JSON can escape half of a surrogate pair (``\\ud83d``); UTF-8 cannot encode it, and it failed the prep with a
    bare ``UnicodeEncodeError`` after tokenising every earlier document."""
    lines = [json.dumps({"text": f"line {i} " * 30}) for i in range(8)]
    lines[3] = json.dumps({"text": "half a pair \ud83d then text " * 20})
    (tmp_path / "data.jsonl").write_text("\n".join(lines))
    with caplog.at_level("WARNING", logger="training_core"):
        manifest = CausalLM().prepare_data(text_data(tmp_path / "data.jsonl"), str(tmp_path / "out"))
    assert manifest.spec["surrogates_replaced"] == 20 and sum(manifest.spec["documents"].values()) == 8
    assert "document 'data.jsonl:4' holds lone surrogates" in caplog.text


def test_a_txt_file_too_large_to_tokenise_as_one_document_fails_naming_it_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "MAX_TEXT_DOCUMENT_BYTES", 2 * 2**20)
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text("small " * 100)
    (tmp_path / "whole-corpus.txt").write_bytes(b"x" * (3 * 2**20))
    with pytest.raises(ValueError, match=r"'whole-corpus.txt' is one document of 3 MiB; a .txt file is a document"):
        CausalLM().prepare_data(text_data(tmp_path), str(tmp_path / "out"))


def test_a_tokenizer_json_from_a_local_path_is_copied_and_sets_the_vocabulary(tmp_path, bpe_tokenizer_path):
    data = DataConfig(
        dataset="stdlib", max_text_bytes=150_000, seq_len=32, num_shards=2, tokenizer=str(bpe_tokenizer_path)
    )
    manifest = CausalLM().prepare_data(data, str(tmp_path))
    spec = TextSpec.from_manifest(Manifest.load(str(tmp_path)))
    assert spec.tokenizer == "tokenizer.json" and spec.vocab_size == 400 and spec.eot_id == 0
    assert (tmp_path / "tokenizer.json").read_bytes() == bpe_tokenizer_path.read_bytes()
    import hashlib

    assert spec.tokenizer_sha256 == hashlib.sha256(bpe_tokenizer_path.read_bytes()).hexdigest()
    # BPE merges bytes: fewer tokens than bytes.
    assert sum(manifest.spec["tokens"].values()) < 0.8 * manifest.spec["text_bytes"]
    tokenizer = read_tokenizer(manifest)
    source = "def gcd(a, b):\n    return a\n"
    assert tokenizer.decode(tokenizer.encode(source)) == source
    sequences = all_tokens(manifest, "train")
    assert 0 <= sequences.min() and sequences.max() < 400

    config = lm_config(data={"tokenizer": str(bpe_tokenizer_path), "seq_len": 32})
    workload = CausalLM()
    workload.check(config, manifest)
    torch.manual_seed(0)
    model = workload.build_model(config, manifest)
    assert model(torch.zeros((2, 32), dtype=torch.long)).shape == (2, 32, 400)
    # The model carries its tokenizer: a pickled copy generates text on its own.
    restored = pickle.loads(pickle.dumps(model))
    assert type(restored) is type(model)
    generated = model.generate_text("def ", 8)
    assert generated.startswith("def ") and restored.generate_text("def ", 8) == generated
    assert isinstance(model.generate_text("", 4), str)
    import cloudpickle  # what MLflow pickles models with

    assert cloudpickle.loads(cloudpickle.dumps(model)).generate_text("def ", 8) == generated

    (tmp_path / "tokenizer.json").write_text(bpe_tokenizer_path.read_text().replace("<|endoftext|>", "<|endoftexx|>"))
    with pytest.raises(ValueError, match="tokenizer.json in .* is corrupt: sha256"):
        read_tokenizer(manifest)


def test_text_can_be_read_from_s3(tmp_path, s3_server, bpe_tokenizer_path):
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    for i in range(5):
        fs.pipe(f"s3://flyte/lm-text/docs/{i}.jsonl", (json.dumps({"text": f"s3 document {i} " * 30}) + "\n").encode())
    fs.pipe("s3://flyte/lm-text/tokenizer.json", bpe_tokenizer_path.read_bytes())
    data = text_data("s3://flyte/lm-text/docs", tokenizer="s3://flyte/lm-text/tokenizer.json")
    manifest = CausalLM().prepare_data(data, "s3://flyte/lm-prepared")
    assert sum(manifest.spec["documents"].values()) == 5 and manifest.spec["vocab_size"] == 400
    loaded = Manifest.load("s3://flyte/lm-prepared")
    assert read_tokenizer(loaded).vocab_size == 400
    assert len(all_tokens(loaded, "train")) == loaded.splits["train"].num_samples


# ---------------------------------------------------------------------------------------------------- models


def test_gpt2_tiny_and_a_llama_config_by_name_build_from_the_datas_vocabulary(stdlib_manifest):
    workload = CausalLM()
    torch.manual_seed(0)
    config = lm_config()
    workload.check(config, stdlib_manifest)
    model = workload.build_model(config, stdlib_manifest)
    assert type(model.lm).__name__ == "GPT2LMHeadModel"
    assert model.lm.config.vocab_size == 257 and model.lm.config.n_positions == 256 and model.lm.config.n_layer == 2
    assert model(torch.zeros((3, SEQ_LEN), dtype=torch.long)).shape == (3, SEQ_LEN, 257)
    torch.manual_seed(0)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            model.state_dict().values(), workload.build_model(config, stdlib_manifest).state_dict().values()
        )
    )

    llama = lm_config(
        model={"name": "LlamaConfig", "num_layers": 2, "hidden_size": 64, "num_heads": 4, "context_length": 128}
    )
    workload.check(llama, stdlib_manifest)
    model = workload.build_model(llama, stdlib_manifest)
    assert type(model.lm).__name__ == "LlamaForCausalLM"
    lm = model.lm.config
    assert (lm.vocab_size, lm.num_hidden_layers, lm.hidden_size, lm.num_attention_heads) == (257, 2, 64, 4)
    assert lm.max_position_embeddings == 128 and lm.intermediate_size == 172  # Llama's 11008 / 4096 ratio
    assert model(torch.zeros((1, SEQ_LEN), dtype=torch.long)).shape == (1, SEQ_LEN, 257)
    generated = model.generate(torch.tensor([[1, 2, 3]]), 5)
    assert generated.shape == (1, 8) and generated[0, :3].tolist() == [1, 2, 3]

    # Every model is causal: a later token never changes an earlier position's logits. BERT's config makes an
    # encoder unless told it is a decoder.
    bert = workload.build_model(
        lm_config(model={"name": "BertConfig", "num_layers": 1, "hidden_size": 32, "num_heads": 2}), stdlib_manifest
    )
    assert bert.lm.config.is_decoder and bert.lm.config.hidden_dropout_prob == 0
    tokens = torch.randint(0, 257, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 257
    for causal in (model, bert):
        with torch.no_grad():
            assert torch.allclose(causal(tokens)[0, :10], causal(changed)[0, :10])


def test_a_model_rebuilt_from_a_checkpoints_description_trains_but_has_no_tokenizer(stdlib_manifest):
    described = Manifest.from_description(stdlib_manifest.description())
    assert described.directory == "" and TextSpec.from_manifest(described).vocab_size == 257
    model = CausalLM().build_model(lm_config(), described)
    assert model(torch.zeros((1, 4), dtype=torch.long)).shape == (1, 4, 257)
    with pytest.raises(ValueError, match="built without its tokenizer"):
        model.generate_text("def ", 3)


def test_the_named_sizes_have_gpt2s_parameter_counts():
    from transformers import AutoModelForCausalLM

    from training_core.config import ModelConfig
    from training_core.registry import LM_SIZES
    from training_core.workloads.causal_lm import GPT2_SIZES

    assert GPT2_SIZES is LM_SIZES
    expected_millions = {"gpt2": 124, "gpt2-medium": 355, "gpt2-large": 774, "gpt2-xl": 1558}
    for name, millions in expected_millions.items():
        config = model_config(ModelConfig(name=name), vocab_size=50257, eot_id=50256)
        with torch.device("meta"):  # shapes only: nothing is allocated or initialised
            model = AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, abs=1), name
    assert (
        model_config(ModelConfig(name="gpt2-xl", num_layers=2, context_length=2048), vocab_size=257, eot_id=256).n_layer
        == 2
    )


# ------------------------------------------------------------------------------------------ loss and metrics


def test_loss_eval_sums_and_metrics_match_a_direct_computation(stdlib_manifest):
    workload = CausalLM()
    config = lm_config()
    torch.manual_seed(1)
    model = workload.build_model(config, stdlib_manifest)
    stored = read_shard(stdlib_manifest, stdlib_manifest.splits["val"].shards[0])
    batch = workload.to_device(stdlib_manifest, torch.device("cpu"))({"tokens": stored["tokens"][:6]})
    inputs, targets = batch
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == targets.shape == (6, SEQ_LEN)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])

    output = workload.loss(model, batch)
    with torch.no_grad():
        logits = model(inputs)
        nll = -torch.log_softmax(logits.double(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
        sums = workload.eval_sums(model, batch)
    assert output.loss.item() == pytest.approx(nll.mean().item(), rel=1e-5)
    assert output.num_samples == 6 and {k: v.dim() for k, v in output.sums.items()} == {
        "correct": 0,
        "tokens": 0,
        "samples": 0,
    }
    correct = int((logits.argmax(-1) == targets).sum())
    assert (int(output.sums["correct"]), int(output.sums["tokens"]), int(output.sums["samples"])) == (
        correct,
        6 * SEQ_LEN,
        6,
    )
    assert sums["loss_sum"].dtype == torch.float64 and sums["loss_sum"].item() == pytest.approx(
        nll.sum().item(), rel=1e-5
    )
    metrics = workload.metrics(sums)
    assert metrics["accuracy"] == pytest.approx(correct / (6 * SEQ_LEN))
    assert metrics["loss"] == pytest.approx(nll.mean().item(), rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]))
    assert set(workload.metrics(output.sums)) == {"accuracy"}
    assert math.isnan(workload.metrics({"correct": 0, "tokens": 0})["accuracy"])
    assert workload.primary_metric == "perplexity" and workload.primary_mode == "min"
    example = workload.example_input(stdlib_manifest)
    assert example.shape == (2, SEQ_LEN) and example.dtype == np.int64


def test_showcase_decodes_greedy_continuations_of_fixed_prompts(stdlib_manifest):
    workload = CausalLM()
    torch.manual_seed(0)
    model = workload.build_model(lm_config(), stdlib_manifest)
    shown = workload.showcase(model, stdlib_manifest, max_new_tokens=12)
    assert [prompt for prompt, _ in shown] == ["def ", "import ", "class ", "    return "]
    assert all(isinstance(continuation, str) and len(continuation.encode()) <= 12 for _, continuation in shown)
    assert shown == workload.showcase(model, stdlib_manifest, max_new_tokens=12)  # greedy: deterministic
    # A prompt longer than the context still generates (its start is dropped).
    assert model.generate(torch.ones((1, 300), dtype=torch.long), 4).shape == (1, 304)
    # Sequences that end (end-of-text) are padded with it: always max_new_tokens new tokens.
    model.eot_id = int(model.generate(torch.tensor([[1, 2, 3]]), 1)[0, -1])  # the first token it will generate
    ended = model.generate(torch.tensor([[1, 2, 3], [1, 2, 3]]), 6)
    assert ended.shape == (2, 9) and (ended[:, 3:] == model.eot_id).all()


def test_a_tiny_gpt2_learns_the_standard_library(stdlib_manifest):
    workload = CausalLM()
    torch.manual_seed(0)
    model = workload.build_model(lm_config(), stdlib_manifest)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sequences = all_tokens(stdlib_manifest, "train")
    to_device = workload.to_device(stdlib_manifest, torch.device("cpu"))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(30):
        batch = to_device({"tokens": sequences[rng.choice(len(sequences), 16, replace=False)]})
        output = workload.loss(model, batch)
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
        losses.append(output.loss.item())
    assert losses[0] == pytest.approx(math.log(257), abs=0.3)  # an untrained model guesses uniformly
    assert np.mean(losses[-5:]) < losses[0] - 1.5, losses


# ---------------------------------------------------------------------------------------------- bad inputs


def test_a_file_that_is_not_a_tokenizer_names_data_tokenizer(tmp_path):
    for name, content in (("plain.txt", "hello"), ("other.json", '{"vocab": [1, 2]}'), ("binary.json", b"\xff\xfe")):
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(ValueError, match=rf"data.tokenizer='.*{name}' is invalid: .*not .*tokenizer.json.*'byte'"):
            CausalLM().prepare_data(DataConfig(dataset="stdlib", tokenizer=str(path)), str(tmp_path / "out"))
    with pytest.raises(
        ValueError, match=r"data.tokenizer='.*missing.json' is invalid: '.*missing.json' does not exist"
    ):
        text.load_tokenizer(str(tmp_path / "missing.json"))


def test_a_source_without_text_names_the_field_to_fix(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"data.path='.*empty' is invalid: it holds no .txt, .jsonl, .parquet files"):
        CausalLM().prepare_data(text_data(empty), str(tmp_path / "out"))
    (empty / "a.txt").write_text("")
    with pytest.raises(ValueError, match=r"data.path='.*empty' has no text \(1 files"):
        CausalLM().prepare_data(text_data(empty), str(tmp_path / "out"))
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": "text", "id": i}) for i in range(5)))
    with pytest.raises(
        ValueError, match=r"data.text_field='text' is invalid: none of the 5 records .* fields body, id"
    ):
        CausalLM().prepare_data(text_data(jsonl), str(tmp_path / "out"))
    jsonl.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"data.path='.*rows.jsonl' is invalid: line 2 of 'rows.jsonl' is not JSON"):
        CausalLM().prepare_data(text_data(jsonl), str(tmp_path / "out"))
    import pandas as pd

    pd.DataFrame({"body": ["x" * 100] * 4}).to_parquet(tmp_path / "t.parquet")
    with pytest.raises(
        ValueError,
        match=r"data.text_field='text' is invalid: Parquet file 't.parquet' .* has no such column \(it has body\)",
    ):
        CausalLM().prepare_data(text_data(tmp_path / "t.parquet"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"data.max_text_bytes=10 is invalid: the first document .* alone has"):
        CausalLM().prepare_data(DataConfig(dataset="stdlib", max_text_bytes=10), str(tmp_path / "out"))


def test_too_little_text_for_the_split_or_a_sequence_names_the_fields(tmp_path):
    tree = tmp_path / "two"
    tree.mkdir()
    for i in range(2):
        (tree / f"{i}.txt").write_text("some text " * 50)
    with pytest.raises(
        ValueError, match=r"data.val_fraction=0.1 and data.test_fraction=0.2 cannot be met: .* 2 document"
    ):
        CausalLM().prepare_data(text_data(tree), str(tmp_path / "out"))
    (tree / "2.txt").write_text("more text " * 50)
    with pytest.raises(
        ValueError, match=r"data.seq_len=4096 is invalid: the (train|val|test) split .* less than one sequence"
    ):
        CausalLM().prepare_data(text_data(tree, seq_len=4096), str(tmp_path / "out"))
    assert CausalLM().prepare_data(text_data(tree, seq_len=8), str(tmp_path / "out")).split_counts()["val"] >= 1
    with pytest.raises(ValueError, match=r"data.val_fraction=0.0 is invalid"):
        CausalLM().prepare_data(text_data(tree, val_fraction=0.0), str(tmp_path / "out"))


def test_a_sequence_longer_than_the_models_context_names_data_seq_len(stdlib_manifest):
    with pytest.raises(
        ValueError, match=r"data.seq_len=64 is invalid: model.name='gpt2-tiny' attends over 32 positions"
    ):
        CausalLM().check(lm_config(model={"context_length": 32}), stdlib_manifest)
    with pytest.raises(ValueError, match=r"data.seq_len=64 is invalid: model.name='LlamaConfig' attends over 48"):
        CausalLM().check(
            lm_config(
                model={"name": "LlamaConfig", "num_layers": 1, "hidden_size": 32, "num_heads": 2, "context_length": 48}
            ),
            stdlib_manifest,
        )


def wrong_vocab_model(config: TrainingConfig, manifest: Manifest) -> torch.nn.Module:
    """A ``workload.model_factory`` whose logits are one token short of the vocabulary."""
    return torch.nn.Sequential(
        torch.nn.Embedding(manifest.spec["vocab_size"], 8), torch.nn.Linear(8, manifest.spec["vocab_size"] - 1)
    )


def right_vocab_model(config: TrainingConfig, manifest: Manifest) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Embedding(manifest.spec["vocab_size"], 8), torch.nn.Linear(8, manifest.spec["vocab_size"])
    )


def test_a_vocabulary_mismatch_is_an_error(stdlib_manifest):
    config = lm_config(workload={"model_factory": "tests.integration.test_causal_lm:wrong_vocab_model"})
    with pytest.raises(
        ValueError,
        match=r"workload.model_factory='.*wrong_vocab_model' is invalid: .* \[1, 8, 256\], .* vocabulary of 257",
    ):
        resolve_workload(config.workload).check(config, stdlib_manifest)
    # A transformers config whose vocabulary lives elsewhere (a multimodal config) keeps its own: refused.
    with pytest.raises(
        ValueError,
        match=r"model.name='Gemma3Config' is invalid: its vocabulary \(262208\) is not the tokenizer's \(257",
    ):
        CausalLM().check(lm_config(model={"name": "Gemma3Config"}), stdlib_manifest)

    config = lm_config(workload={"model_factory": "tests.integration.test_causal_lm:right_vocab_model"})
    workload = resolve_workload(config.workload)
    workload.check(config, stdlib_manifest)
    model = workload.build_model(config, stdlib_manifest)
    assert isinstance(model, torch.nn.Sequential)
    assert [p for p, _ in workload.showcase(model, stdlib_manifest, max_new_tokens=3)] == list(
        ("def ", "import ", "class ", "    return ")
    )


def test_an_unknown_or_non_causal_config_class_names_model_name(stdlib_manifest):
    for name, why in (
        ("NoSuchModelConfig", "has no config class of that name"),
        ("ResNetConfig", "no causal language model"),
    ):
        with pytest.raises(ValueError, match=rf"model.name='{name}' is invalid: .*{why}"):
            CausalLM().check(lm_config(model={"name": name}), stdlib_manifest)
    with pytest.raises(ValueError, match=r"model.hidden_size=100 is invalid: gpt2 has 12 attention heads"):
        CausalLM().check(lm_config(model={"name": "gpt2", "hidden_size": 100}), stdlib_manifest)
    with pytest.raises(ValueError, match=r"model.num_heads=2 is invalid: MambaConfig has no num_attention_heads"):
        CausalLM().check(lm_config(model={"name": "MambaConfig", "num_heads": 2}), stdlib_manifest)
    image = dataclasses.replace(stdlib_manifest, workload="image_classification")
    with pytest.raises(ValueError, match=r"workload.name='causal_lm' trains on token sequences"):
        CausalLM().check(lm_config(), image)


def test_importing_the_workload_imports_neither_torch_nor_transformers():
    code = (
        "import sys, training_core.workloads.causal_lm, training_core.data.text\n"
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers', 'fsspec') if m in sys.modules))"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert found.strip() == "[]"
