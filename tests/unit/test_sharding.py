"""What FSDP shards one at a time: the blocks of every built-in model, a user workload's own, and the error before
any worker starts when a model has none."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training_core.config import TrainingConfig
from training_core.data import prepare
from training_core.parallel import sharding
from training_core.workloads import preflight


@pytest.mark.parametrize(
    ("name", "count", "kind"),
    [
        ("resnet18", 4, "Sequential"),
        ("resnet50", 4, "Sequential"),
        ("vit_b_16", 12, "EncoderBlock"),
        ("small_cnn", 0, ""),
    ],
)
def test_the_blocks_of_the_built_in_image_models(name, count, kind):
    from training_core.models import build_model

    with torch.device("meta"):
        model = build_model(name, num_classes=10, input_shape=(3, 32, 32))
    blocks = sharding.find_blocks(model)
    assert len(blocks) == count and all(type(b).__name__ == kind for b in blocks)


def test_a_transformers_model_names_its_blocks():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=50))
    blocks = sharding.find_blocks(nn.ModuleDict({"lm": model}))  # found inside a wrapper too
    assert [type(b).__name__ for b in blocks] == ["GPT2Block"] * 3


def test_a_masked_lm_built_on_meta_keeps_its_decoder_tied_and_its_embeddings_out_of_the_blocks():
    """FSDP2 shards a tied parameter in one unit only: BERT's embeddings, whose word embeddings are the masked-LM
    decoder's weight, stay with the root, and the meta build keeps the two names one parameter."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=8)
    with sharding.empty_parameters():
        model = BertForMaskedLM(config)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.weight.is_meta
    assert [type(b).__name__ for b in sharding.find_blocks(model)] == ["BertLayer"] * 2


class _Workload:
    def __init__(self, blocks):
        self._blocks = blocks

    def blocks(self, model):
        return self._blocks(model)


def test_a_workloads_blocks_must_be_its_models_own():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert sharding.model_blocks(model, _Workload(lambda m: [m[0], m[1]])) == [model[0], model[1]]
    with pytest.raises(ValueError, match=r"returned Linear, which are not submodules of the model"):
        sharding.model_blocks(model, _Workload(lambda m: [nn.Linear(2, 2)]))


def test_fsdp_on_a_model_without_blocks_fails_before_any_worker_starts_naming_the_field_and_the_fixes(tmp_path):
    data_dir = str(tmp_path / "digits")
    cfg = TrainingConfig.from_dict({"model": {"name": "small_cnn"}, "scaling": {"strategy": "fsdp"}})
    prepare(cfg.data, data_dir)
    with pytest.raises(ValueError) as excinfo:
        preflight(cfg, data_dir)
    message = str(excinfo.value)
    assert message.startswith("scaling.strategy='fsdp' is invalid: FSDP shards a model block by block")
    assert "declare blocks(model) in the workload" in message and "scaling.strategy='ddp'" in message
    resnet = TrainingConfig.from_dict({"model": {"name": "resnet18"}, "scaling": {"strategy": "fsdp"}})
    preflight(resnet, data_dir)  # its four stages: no error
