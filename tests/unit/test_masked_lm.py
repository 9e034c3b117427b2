"""The ``masked_lm`` workload: BERT-style masking (15%, 80/10/10, special tokens never chosen, seeded per sample and
epoch), a tiny BERT pretrained in this process on the ``causal_lm`` text pipeline (the masked-token perplexity falls,
a resume is bit-identical), its encoder fine-tuned by ``sequence_classification``, and what fails before any worker."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.labeled_text import labeled_rows, wordpiece_tokenizer, write_csv
from tests.helpers.runtime import InProcessRuntime
from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig, WorkloadConfig
from training_core.data import Manifest, prepare
from training_core.data.prepared import ShardStream
from training_core.data.text import load_tokenizer
from training_core.eval_sums import evaluate
from training_core.records import WorkerArgs
from training_core.registry import SOURCE_CHECKS, WORKLOADS, load
from training_core.train.loop import run_worker
from training_core.train.rng import seed_everything
from training_core.workloads import preflight, prep_uses_ray, resolve_workload
from training_core.workloads.masked_lm import IGNORED, MaskingBatcher, MaskSpec, mask_tokens

TEXTS = [text for text, _ in labeled_rows(400)]


def _config(root: Path, tokenizer: str, **loop) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "workload": {"name": "masked_lm"},
            "data": {
                "dataset": "text",
                "path": str(root / "text"),
                "tokenizer": tokenizer,
                "seq_len": 32,
                "num_shards": 2,
            },  # fmt: skip
            "model": {"name": "bert-tiny", "hidden_size": 32, "num_heads": 2},
            "optimizer": {"name": "adamw", "lr": 0.003},
            "loop": {"epochs": 3, "batch_size": 16, "log_interval_steps": 4, **loop},
            "checkpoint": {"interval_steps": 5, "keep_last": 5, "async_save": False},
            "scaling": {"num_workers": 1, "torch_threads_per_worker": 1},
            "observability": {"enabled": False},
        }
    )


def _text(root: Path) -> Path:
    (root / "text").mkdir(parents=True, exist_ok=True)
    (root / "text" / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    return wordpiece_tokenizer(root / "tokenizer" / "tokenizer.json", TEXTS)


def _run(cfg: TrainingConfig, data_dir: Path, root: Path) -> ckpt.LoadedCheckpoint:
    run_worker(WorkerArgs.build(cfg, data_dir=str(data_dir), checkpoint_root=str(root), run_name="mlm"),
               InProcessRuntime())  # fmt: skip
    loaded = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(root)))
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[TrainingConfig, Path, Path, float]:
    """Text prepared for ``masked_lm`` with a WordPiece tokenizer, a tiny BERT's val perplexity before training, and
    the checkpoints of 3 epochs of pretraining it."""
    root = tmp_path_factory.mktemp("mlm")
    cfg = _config(root, str(_text(root)))
    data_dir = root / "data"
    manifest = prepare(cfg.data, str(data_dir), workload=cfg.workload)
    workload = preflight(cfg, str(data_dir))
    seed_everything(cfg.loop.seed)
    untrained = workload.build_model(cfg, manifest)
    cpu = torch.device("cpu")
    batches = ShardStream(manifest, "val", rank=0, world_size=1).eval_batches(batch_size=16)
    before = evaluate(untrained, batches, workload=workload, to_device=workload.to_device(manifest, cpu), device=cpu)
    _run(cfg, data_dir, root / "whole")
    return cfg, data_dir, root / "whole", before.metrics["perplexity"]


# ------------------------------------------------------------------------------------------------------ masking


def test_the_mask_chooses_15_percent_of_ordinary_tokens_and_replaces_them_80_10_10():
    masks = MaskSpec(mask_id=4, special_ids=(0, 1, 2, 3, 4), pad_id=0, vocab_size=1000)
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 1000, size=(256, 128))
    tokens[:, ::16] = 3  # document separators: special, never chosen
    inputs, labels = mask_tokens(tokens, range(256), masks)
    chosen = labels != IGNORED
    ordinary = tokens != 3
    assert not chosen[~ordinary].any() and (inputs[~ordinary] == 3).all()
    assert abs(chosen.sum() / ordinary.sum() - 0.15) < 0.01
    assert (labels[chosen] == tokens[chosen]).all() and (inputs[~chosen] == tokens[~chosen]).all()
    masked = (inputs == 4) & chosen
    unchanged = (inputs == tokens) & chosen
    randomised = chosen & ~masked & ~unchanged
    shares = [part.sum() / chosen.sum() for part in (masked, randomised, unchanged)]
    assert abs(shares[0] - 0.8) < 0.02 and abs(shares[1] - 0.1) < 0.02 and abs(shares[2] - 0.1) < 0.02, shares


def test_a_sample_is_masked_alike_for_its_seed_epoch_and_id_on_any_rank_and_differently_in_another_epoch(pretrained):
    cfg, data_dir, _, _ = pretrained
    manifest = Manifest.load(str(data_dir))
    batcher = MaskingBatcher(MaskSpec.from_manifest(manifest), torch.device("cpu"))

    def masked(epoch: int, world_size: int, batch_size: int) -> dict[int, tuple]:
        """Each training sample's (masked inputs, labels) over every rank, by sample id."""
        found = {}
        for rank in range(world_size):
            stream = ShardStream(manifest, "train", rank=rank, world_size=world_size)
            steps = manifest.splits["train"].num_samples // world_size // batch_size
            for batch in stream.train_batches(epoch=epoch, seed=cfg.loop.seed, batch_size=batch_size,
                                              num_batches=steps):  # fmt: skip
                inputs, labels = batcher(batch)
                for row, sample_id in enumerate(batch["sample_ids"].tolist()):
                    found[sample_id] = (inputs[row].tolist(), labels[row].tolist())
        return found

    one_rank, two_ranks = masked(1, 1, 23), masked(1, 2, 1)  # all 69 samples; 68 of them in batches of 1
    both = one_rank.keys() & two_ranks.keys()
    assert len(both) == 68 and all(one_rank[i] == two_ranks[i] for i in both)
    other_epoch = masked(2, 1, 23)
    assert sum(one_rank[i] != other_epoch[i] for i in other_epoch) > 0.9 * len(other_epoch)
    # Evaluation masks a sample by its id alone: the same in every pass.
    val = next(ShardStream(manifest, "val", rank=0, world_size=1).eval_batches(batch_size=4))
    assert all(torch.equal(a, b) for a, b in zip(batcher(val), batcher(val)))


# ----------------------------------------------------------------------------------------------------- training


def test_a_tiny_bert_pretrains_on_tiny_text_its_masked_perplexity_falls_and_a_resume_is_bit_identical(
    pretrained, tmp_path
):
    cfg, data_dir, whole_root, before = pretrained
    whole = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(whole_root)))
    after = whole.meta.history[-1].val_perplexity
    print(f"masked-token val perplexity: before {before:.1f}, after {after:.1f}")
    assert after < 0.8 * before, (before, after)
    assert whole.meta.global_step > 5, "the resume below must be mid-run"

    mid = tmp_path / "mid"
    mid.mkdir()
    ckpt.CheckpointStorage(str(whole_root)).download(ckpt.step_name(5), str(mid / ckpt.step_name(5)))
    resumed = _run(cfg, data_dir, mid)
    assert resumed.meta.resumed_from_steps == [5] and resumed.meta.global_step == whole.meta.global_step
    for name, tensor in whole.model.items():
        assert torch.equal(tensor, resumed.model[name]), name
    assert resumed.meta.history[-1].val_perplexity == after
    assert resumed.meta.history[-1].train_loss == whole.meta.history[-1].train_loss


def test_a_pretrained_encoder_saved_from_its_checkpoint_fine_tunes_as_a_sequence_classifiers_backbone(
    pretrained, tmp_path
):
    _, _, whole_root, _ = pretrained
    whole = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(whole_root)))
    model = ckpt.load_model(str(whole_root / ckpt.step_name(whole.meta.global_step)))[0]
    model.encoder.save_pretrained(tmp_path / "bert", safe_serialization=True)
    shutil.copy(whole_root.parent / "tokenizer" / "tokenizer.json", tmp_path / "bert" / "tokenizer.json")
    config = TrainingConfig.from_dict(
        {
            "workload": {"name": "sequence_classification"},
            "data": {
                "dataset": "labeled_text",
                "path": str(write_csv(tmp_path / "rows.csv", labeled_rows(60))),
                "tokenizer": str(tmp_path / "bert"),
                "seq_len": 12,
                "num_shards": 2,
            },  # fmt: skip
            "model": {"name": "", "pretrained": str(tmp_path / "bert")},
            "scaling": {"num_workers": 1},
        }
    )
    prepare(config.data, str(tmp_path / "data"), workload=config.workload)
    classifier = preflight(config, str(tmp_path / "data")).build_model(config, Manifest.load(str(tmp_path / "data")))
    backbone = model.encoder.bert.state_dict()
    built = classifier.encoder.bert.state_dict()
    assert backbone and all(torch.equal(built[key], backbone[key]) for key in backbone)


# ------------------------------------------------------------------------------------------------ bad input


def test_a_tokenizer_without_a_mask_token_fails_before_any_worker_naming_the_field(tmp_path):
    texts_dir = _text(tmp_path)
    no_mask = tmp_path / "no_mask" / "tokenizer.json"
    described = json.loads(texts_dir.read_text())
    described["added_tokens"] = [token for token in described["added_tokens"] if token["content"] != "[MASK]"]
    described["model"]["vocab"].pop("[MASK]")
    no_mask.parent.mkdir()
    no_mask.write_text(json.dumps(described))
    for tokenizer in (str(no_mask), "byte"):
        cfg = _config(tmp_path, tokenizer)
        checks = (functools.partial(load(SOURCE_CHECKS["masked_lm"]), cfg.data),
                  functools.partial(prepare, cfg.data, str(tmp_path / "data"), workload=cfg.workload))  # fmt: skip
        for check in checks:
            with pytest.raises(ValueError) as raised:
                check()
            message = str(raised.value)
            assert f"data.tokenizer='{tokenizer}'" in message and "[MASK]" in message and "<mask>" in message
            assert "use a WordPiece or BPE tokenizer.json that has one" in message
    assert not (tmp_path / "data").exists(), "nothing was written"
    # A BPE tokenizer with RoBERTa's <mask> passes; its special tokens are never chosen.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=special))
    bpe.save(str(tmp_path / "bpe.json"))
    load(SOURCE_CHECKS["masked_lm"])(_config(tmp_path, str(tmp_path / "bpe.json")).data)
    masks = MaskSpec.of(load_tokenizer(str(tmp_path / "bpe.json")), str(tmp_path / "bpe.json"))
    assert (masks.mask_id, masks.pad_id, masks.special_ids) == (4, 1, (0, 1, 2, 3, 4))


def test_a_dataset_that_is_not_text_fails_the_prep_and_its_check_naming_masked_lm_not_causal_lm(tmp_path):
    data = dataclasses.replace(_config(tmp_path, str(_text(tmp_path))).data, dataset="digits")
    workload = WorkloadConfig(name="masked_lm")
    checks = (functools.partial(load(SOURCE_CHECKS["masked_lm"]), data),
              functools.partial(prepare, data, str(tmp_path / "data"), workload=workload))  # fmt: skip
    for check in checks:
        with pytest.raises(ValueError, match=r"data.dataset='digits' is invalid: workload.name='masked_lm' reads"):
            check()


def test_the_registry_lists_masked_lm_reading_the_causal_lm_text_sources_through_ray_prep(tmp_path):
    assert "masked_lm" in WORKLOADS and type(resolve_workload(WorkloadConfig(name="masked_lm"))).__name__ == "MaskedLM"
    cfg = _config(tmp_path, "byte")
    assert prep_uses_ray(cfg.data, cfg.workload)
    with pytest.raises(ValueError, match="workload.name='masked_lm' reads stdlib, text"):
        TrainingConfig.from_dict({"workload": {"name": "masked_lm"}, "model": {"name": "bert-tiny"},
                                  "data": {"dataset": "labeled_text", "path": str(tmp_path)}})  # fmt: skip
    with pytest.raises(ValueError, match="workload.name='masked_lm' builds bert-tiny"):
        TrainingConfig.from_dict({"workload": {"name": "masked_lm"}, "model": {"name": "gpt2-tiny"},
                                  "data": {"dataset": "stdlib"}})  # fmt: skip
    with pytest.raises(ValueError, match="choose .*sequence_classification, masked_lm or"):
        TrainingConfig.from_dict({"workload": {"name": "masked_lmx"}})


# ------------------------------------------------------------------------------------------ pretrained weights


@pytest.mark.parametrize("saved_class", ["BertForMaskedLM", "BertForPreTraining", "BertModel"])
def test_a_hugging_face_bert_directory_is_the_masked_lms_weights_at_step_0_beside_its_own_tokenizer(
    pretrained, tmp_path, caplog, saved_class
):
    import transformers

    _, data_dir, whole_root, _ = pretrained
    tokenizer = whole_root.parent / "tokenizer" / "tokenizer.json"
    architecture = transformers.BertConfig(vocab_size=len(json.loads(tokenizer.read_text())["model"]["vocab"]),
                                           hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=37, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(3)
    saved = getattr(transformers, saved_class)(architecture)
    saved.save_pretrained(tmp_path / "bert", safe_serialization=True)
    shutil.copy(tokenizer, tmp_path / "bert" / "tokenizer.json")
    sections = _config(whole_root.parent, str(tokenizer)).to_dict()
    sections["model"] = {"name": "", "pretrained": str(tmp_path / "bert")}
    config = TrainingConfig.from_dict(sections)
    workload, manifest = preflight(config, str(data_dir)), Manifest.load(str(data_dir))
    assert config.model.encoder_config["hidden_size"] == 32 and len(config.model.pretrained_sha256) == 64
    built = {}
    for seed in (1, 2):  # what the weights lack (a head) is seeded by loop.seed, not by the global RNG
        torch.manual_seed(seed)
        with caplog.at_level("WARNING"):
            built[seed] = workload.build_model(config, manifest).encoder.state_dict()
    assert all(torch.equal(built[1][key], built[2][key]) for key in built[1])
    prefix = "" if saved_class != "BertModel" else "bert."
    stored = {prefix + key: value for key, value in saved.state_dict().items()}
    loaded = [key for key in stored if ".pooler." not in key and "seq_relationship" not in key]
    assert loaded and all(torch.equal(built[1][key], stored[key]) for key in loaded)
    assert torch.equal(built[1]["cls.predictions.decoder.weight"], stored["bert.embeddings.word_embeddings.weight"])
    notes = {
        "BertForMaskedLM": [],
        "BertForPreTraining": ["left out 4 tensors", "bert.pooler.dense.bias", "cls.seq_relationship.weight"],
        "BertModel": ["left out 2 tensors", "pooler.dense.weight", "the masked-LM head (cls.predictions.bias"],
    }[saved_class]
    assert all(note in caplog.text for note in notes), caplog.text
    # The data must be tokenised with the tokenizer beside the weights.
    wordpiece_tokenizer(tmp_path / "bert" / "tokenizer.json", TEXTS[:40])
    config = TrainingConfig.from_dict(sections)
    with pytest.raises(ValueError, match="data.tokenizer=.* the data was tokenised with another tokenizer"):
        preflight(config, str(data_dir))
