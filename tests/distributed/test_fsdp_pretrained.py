"""Fine-tuning from pretrained weights under FSDP on 2 gloo workers under Ray Train: each rank reads and holds about
half of the weights (measured: the bytes it read, its shards' bytes, its peak resident set), and the run equals DDP
on the same data and the same re-initialised head. With LoRA adapters or frozen parameters the model is built on the
meta device and read by rows too, and starts with the same weights, adapters included, as when built whole. So does
``masked_lm`` from a Hugging Face BERT, its decoder tied to the word embeddings: one sharded parameter, read once."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from training_core.config import OptimizerConfig, TrainingConfig
from training_core.data import Manifest, ShardStream, prepare
from training_core.train.loop import train_step
from training_core.train.optim import build_optimizer
from training_core.workloads.image import Normalizer

WORLD_SIZE = 2
NUM_STEPS = 2
MICRO_BATCH = 4
DATA = {"dataset": "synthetic", "synthetic_num_samples": 64, "synthetic_image_size": 8, "num_shards": 2}


TRAINABLE = {
    "lora": {"lora": {"enabled": True, "rank": 4, "target_modules": ["conv2", "fc"]}},
    "freeze": {"freeze": ["conv1.*", "layer1.*"]},
}
"""``model`` settings that leave part of the model frozen: LoRA on every block's second convolution and on the
re-initialised head (whose ``base_layer`` takes the seeded fresh values), and frozen name patterns."""


def _config(weights: str, strategy: str, **model) -> TrainingConfig:
    """resnet18 (44.7 MB of float32 for 10 classes) from weights with a 1,000-class ``fc``, re-initialised by name."""
    return TrainingConfig.from_dict(
        {
            "data": DATA,
            "model": {"name": "resnet18", "pretrained": weights, "new_head": "fc.*", **model},
            "scaling": {"strategy": strategy, "num_workers": WORLD_SIZE},
        }
    )


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM, the kernel's peak resident set, restarts from the current one


def _warm_up() -> None:
    """Load what the first FSDP sharding and the first ResNet build import, outside what is measured."""
    import torchvision.models  # noqa: F401 - imported for its memory, before the measure

    from training_core.parallel import sharding

    with sharding.empty_parameters():
        tiny = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    sharding.shard_model(tiny, [tiny[0]], device=torch.device("cpu"), param_dtype=None, cpu_offload=False)
    tiny(torch.ones(1, 4)).sum().backward()


def _train(model: torch.nn.Module, manifest: Manifest, rank: int) -> None:
    stream = ShardStream(manifest, "train", rank=rank, world_size=WORLD_SIZE)
    normalize = Normalizer(manifest, torch.device("cpu"))
    optimizer = build_optimizer(OptimizerConfig(name="sgd", lr=0.05, momentum=0.9), model.parameters())
    from training_core.workloads.protocol import classification_loss

    for batch in stream.train_batches(epoch=0, seed=0, batch_size=MICRO_BATCH, num_batches=NUM_STEPS):
        train_step(model=model, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu", enabled=False),
                   micro_batches=[normalize(batch)], autocast_dtype=None, max_grad_norm=0.0,
                   loss_fn=classification_loss)  # fmt: skip


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}


def _resumed(model: torch.nn.Module, cfg: TrainingConfig, manifest: Manifest, runtime, checkpoints: str):
    """A resume as the loop does it: ``model``'s sharded checkpoint under ``checkpoints``, then a model built from
    the pretrained weights again (each rank its rows), then the checkpoint restored over them: that model."""
    from training_core import checkpoint as ckpt
    from training_core.train.model import build_sharded_pretrained
    from training_core.workloads import resolve_workload

    storage = ckpt.CheckpointStorage(checkpoints)
    meta = ckpt.CheckpointMeta(model_name=cfg.model.name, classes=[], input_shape=[], mean=[], std=[], epoch=0,
                               global_step=NUM_STEPS, config={})  # fmt: skip
    first = runtime.rank == 0
    checkpointer = ckpt.Checkpointer(storage, keep_last=1, async_save=False)
    optimizer = build_optimizer(OptimizerConfig(name="sgd", lr=0.05), model.parameters())
    checkpointer.save_sharded(NUM_STEPS, model=model, optimizer=optimizer, trainer_state={"rng": {}} if first else None,
                              meta=meta if first else None)  # fmt: skip
    checkpointer.wait()
    again, _, _ = build_sharded_pretrained(cfg, resolve_workload(cfg.workload), manifest, runtime, param_dtype=None)
    loaded = ckpt.load_latest_valid(storage)
    assert loaded is not None and loaded.meta.global_step == NUM_STEPS
    ckpt.restore(loaded, model=again.model)
    return again.model


def _step_zero(config: dict, manifest: Manifest, runtime, model: dict) -> dict:
    """With ``model`` (:data:`TRAINABLE`): the step-0 weights built on the meta device and read by rows (FSDP),
    gathered, and on rank 0 (which saves them) built whole as the loop builds them (DDP); both frozen bases' sha256;
    and the sharded build's figures."""
    from training_core import checkpoint as ckpt
    from training_core.train.lora import prepare_trainable
    from training_core.train.model import build_sharded_pretrained
    from training_core.train.rng import seed_everything
    from training_core.workloads import resolve_workload

    whole_cfg, sharded_cfg = (_config(config["weights"], strategy, **model) for strategy in ("ddp", "fsdp"))
    workload = resolve_workload(whole_cfg.workload)
    started = time.monotonic()
    held, _, bytes_read = build_sharded_pretrained(sharded_cfg, workload, manifest, runtime, param_dtype=None)
    states = {
        "fsdp": _whole(held.model),
        "sha256": [ckpt.base_sha256(held.model)],
        "trainable": sorted(name for name, p in held.model.named_parameters() if p.requires_grad),
    }
    sharded_s = time.monotonic() - started
    if runtime.rank == 0:
        seed_everything(whole_cfg.loop.seed)
        whole = prepare_trainable(workload.build_model(whole_cfg, manifest), whole_cfg.model, seed=whole_cfg.loop.seed)
        states["whole"] = {key: value.clone() for key, value in whole.state_dict().items()}
        states["sha256"].append(ckpt.base_sha256(whole))
    return {"states": states, "bytes_read": bytes_read, "sharded_s": sharded_s}


def _masked_lm_step_zero(sections: dict, text_dir: str, runtime, checkpoints: str) -> dict:
    """``masked_lm`` from a Hugging Face directory (``sections``: the config preflight checked): built on the meta
    device and read by rows (FSDP), its state gathered, whether the decoder and the word embeddings are one
    parameter, and one forward and backward (FSDP2 refuses a tied parameter in two units); on rank 0 the same built
    whole as the loop builds it (DDP) and run on the same tokens. Then one SGD step, and a resume from a sharded
    checkpoint of it under ``checkpoints`` (:func:`_resumed`): the trained and the resumed states, and whether the
    resumed model's decoder is still its word embeddings. Also the bytes this rank read."""
    from training_core.train.model import build_sharded_pretrained
    from training_core.train.rng import seed_everything
    from training_core.workloads import resolve_workload

    cfg, manifest = TrainingConfig.from_dict(sections), Manifest.load(text_dir)
    workload = resolve_workload(cfg.workload)
    tokens = torch.arange(2 * 12).reshape(2, 12) % manifest.spec["vocab_size"]
    held, _, bytes_read = build_sharded_pretrained(cfg, workload, manifest, runtime, param_dtype=None)
    encoder = held.model.encoder
    embeddings = encoder.bert.embeddings.word_embeddings.weight
    states = {"fsdp": _whole(held.model), "tied": encoder.cls.predictions.decoder.weight is embeddings}
    logits = held.model(tokens)
    logits.sum().backward()
    states["fsdp_logits"] = logits.detach()
    states["fsdp_grad"] = embeddings.grad.full_tensor()
    if runtime.rank == 0:
        seed_everything(cfg.loop.seed)
        whole = workload.build_model(cfg, manifest)
        states["whole"] = {key: value.clone() for key, value in whole.state_dict().items()}
        logits = whole(tokens)
        logits.sum().backward()
        states["whole_logits"] = logits.detach()
        states["whole_grad"] = whole.encoder.bert.embeddings.word_embeddings.weight.grad
    torch.optim.SGD(held.model.parameters(), lr=0.5).step()  # the tied weight takes both names' gradients, once
    states["trained"] = _whole(held.model)
    resumed = _resumed(held.model, cfg, manifest, runtime, checkpoints)
    states["resumed"] = _whole(resumed)
    decoder = resumed.encoder.cls.predictions.decoder.weight
    states["resumed_tied"] = decoder is resumed.encoder.bert.embeddings.word_embeddings.weight
    return {"states": states, "bytes_read": bytes_read}


def _worker(config: dict) -> None:
    import ray.train

    from training_core.parallel import sharding
    from training_core.parallel.distributed import RayTrainRuntime
    from training_core.train.model import build_sharded_pretrained, hold_model
    from training_core.workloads import resolve_workload

    rank, runtime = ray.train.get_context().get_world_rank(), RayTrainRuntime()
    manifest = Manifest.load(config["data_dir"])
    _warm_up()
    sharding.return_freed_host_memory()  # as the loop does under FSDP on CPU
    figures, states = {}, {}
    for strategy in ("ddp", "fsdp"):
        cfg = _config(config["weights"], strategy)
        workload = resolve_workload(cfg.workload)
        _reset_peak_rss()
        before = _rss_bytes("VmRSS:")
        if strategy == "fsdp":
            held, _, bytes_read = build_sharded_pretrained(cfg, workload, manifest, runtime, param_dtype=None)
        else:  # what FSDP did before too: every rank builds the model whole and reads the whole file
            held = hold_model(workload.build_model(cfg, manifest), cfg, workload, runtime, param_dtype=None)
            bytes_read = Path(config["weights"]).stat().st_size
        peak = _rss_bytes("VmHWM:") - before
        shard_bytes = sum(
            sharding.local_tensor(p).numel() * p.element_size() for p in held.model.parameters()
        )  # fmt: skip
        figures[strategy] = {"bytes_read": bytes_read, "peak_rss": peak, "shard_bytes": shard_bytes}
        start = _whole(held.model)
        _train(held.model, manifest, rank)
        states[strategy] = {"start": start, "end": _whole(held.model)}
    cfg = _config(config["weights"], "fsdp")
    states["resumed"] = _whole(_resumed(held.model, cfg, manifest, runtime, config["checkpoints"]))
    started = time.monotonic()
    for kind, model in TRAINABLE.items():
        built = _step_zero(config, manifest, runtime, model)
        states[kind] = built.pop("states")
        figures[kind] = built
    figures["trainable_s"] = time.monotonic() - started
    started = time.monotonic()
    for kind, sections in config["masked_lm"].items():
        built = _masked_lm_step_zero(sections, config["text_dir"], runtime, f"{config['checkpoints']}-{kind}")
        states[f"masked_lm-{kind}"], figures[f"masked_lm-{kind}"] = built.pop("states"), built
    figures["masked_lm_s"] = time.monotonic() - started
    Path(config["out_dir"], f"figures-{rank}.json").write_text(json.dumps(figures))
    if rank == 0:
        torch.save(states, Path(config["out_dir"]) / "states.pt")
    ray.train.report({"rank": rank})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("synthetic")
    prepare(TrainingConfig.from_dict({"data": DATA}).data, str(out))
    return str(out)


MASKED_LM_WEIGHTS = ("BertForMaskedLM", "BertModel")
"""How the ``masked_lm`` weights are saved: with their masked-LM head (its decoder tied to the word embeddings, so
saved once, under the embeddings' name), and the backbone alone (the head is new, from the seed)."""


@pytest.fixture(scope="module")
def masked_lm_configs(tmp_path_factory) -> tuple[str, dict[str, TrainingConfig]]:
    """Text prepared for ``masked_lm`` with a WordPiece tokenizer, and for each of :data:`MASKED_LM_WEIGHTS` a tiny
    BERT saved that way beside that tokenizer and the FSDP config preflight checked against the data."""
    from tests.helpers.labeled_text import labeled_rows, tiny_bert, wordpiece_tokenizer
    from training_core.workloads import preflight

    root = tmp_path_factory.mktemp("masked-lm")
    texts = [text for text, _ in labeled_rows(120)]
    (root / "text").mkdir()
    (root / "text" / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    tokenizer = wordpiece_tokenizer(root / "tokenizer.json", texts)
    masked = tiny_bert(root / "BertForMaskedLM", vocab_size=len(json.loads(tokenizer.read_text())["model"]["vocab"]),
                       num_labels=2, head=False)  # fmt: skip
    masked.bert.save_pretrained(root / "BertModel", safe_serialization=True)
    sections = {
        "workload": {"name": "masked_lm"},
        "data": {"dataset": "text", "path": str(root / "text"), "tokenizer": str(tokenizer), "seq_len": 16,
                 "num_shards": 2, "prep_num_workers": 1},
        "scaling": {"strategy": "fsdp", "num_workers": WORLD_SIZE},
    }  # fmt: skip
    configs = {}
    for kind in MASKED_LM_WEIGHTS:
        (root / kind / "tokenizer.json").write_bytes(tokenizer.read_bytes())
        configs[kind] = TrainingConfig.from_dict({**sections, "model": {"name": "", "pretrained": str(root / kind)}})
    prepare(configs[kind].data, str(root / "data"), workload=configs[kind].workload)
    for config in configs.values():
        preflight(config, str(root / "data"))  # records the architecture and the weights' sha256
    return str(root / "data"), configs


def _tensor_bytes(weights: Path) -> dict[str, int]:
    """The bytes of each tensor stored in the safetensors file ``weights``, and of its header (``""``)."""
    with open(weights, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    stored = {name: entry["data_offsets"][1] - entry["data_offsets"][0] for name, entry in header.items()}
    return {**stored, "": 8 + size}


def test_fsdp_fine_tuning_from_pretrained_weights_reads_half_on_each_rank_and_equals_ddp(
    ray_session, data_dir, masked_lm_configs, tmp_path
):
    """Also with LoRA and with frozen parameters: read by rows (``loads_by_rows``), the same step-0 weights as built
    whole, adapters included (each ``lora_A`` drawn from the seed, each ``lora_B`` zeros), and the same frozen base.
    And ``masked_lm`` from a Hugging Face BERT saved with and without its head: read by rows, the decoder and the
    word embeddings one sharded parameter whose stored rows the ranks read once between them, the same step-0
    weights (a head the weights lack: the seeded fresh one), logits and tied gradient as built whole."""
    import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from training_core.models import build_model
    from training_core.train.model import loads_by_rows
    from training_core.workloads import resolve_workload

    text_dir, masked_lm = masked_lm_configs
    manifest = Manifest.load(data_dir)
    torch.manual_seed(3)
    imagenet = build_model("resnet18", num_classes=1000, input_shape=manifest.input_shape).state_dict()
    saved = {key: value + 0.5 if value.is_floating_point() else value for key, value in imagenet.items()}
    save_file(saved, tmp_path / "resnet18.safetensors")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    TorchTrainer(
        _worker,
        train_loop_config={
            "data_dir": data_dir,
            "weights": str(tmp_path / "resnet18.safetensors"),
            "out_dir": str(tmp_path),
            "checkpoints": str(tmp_path / "checkpoints"),
            "text_dir": text_dir,
            "masked_lm": {kind: cfg.to_dict() for kind, cfg in masked_lm.items()},
        },
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=WORLD_SIZE, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="fsdp-pretrained", storage_path=str(tmp_path / "ray")),
    ).fit()

    states = torch.load(tmp_path / "states.pt", weights_only=True)
    ddp, fsdp = states["ddp"], states["fsdp"]
    # Step 0: the pretrained weights exactly, but fc, which is the same seeded re-initialisation with both.
    for key, tensor in ddp["start"].items():
        assert torch.equal(fsdp["start"][key], tensor), key
        if not key.startswith("fc."):
            assert torch.equal(tensor, saved[key]), key
    assert ddp["start"]["fc.weight"].shape == (10, 512)
    # The fine-tuned parameters: the same to float tolerance (gradients reduced in another order), and trained.
    trained = dict(build_model("resnet18", num_classes=10, input_shape=manifest.input_shape).named_parameters())
    for key in trained:
        torch.testing.assert_close(fsdp["end"][key], ddp["end"][key], rtol=1e-4, atol=1e-6, msg=key)
    assert not torch.equal(ddp["end"]["fc.weight"], ddp["start"]["fc.weight"])
    # A resume reads the pretrained weights (by rows) again, then restores its own checkpoint over them. (Buffers
    # are left out: each rank keeps its own BatchNorm statistics, and the sharded checkpoint holds one rank's.)
    for key in trained:
        assert torch.equal(states["resumed"][key], fsdp["end"][key]), key

    model_bytes = sum(t.numel() * t.element_size() for t in ddp["start"].values())
    for rank in range(WORLD_SIZE):
        figures = json.loads((tmp_path / f"figures-{rank}.json").read_text())
        sharded, whole = figures["fsdp"], figures["ddp"]
        # Each rank read about half the weights (its rows, the skipped 1,000-class fc none) and holds half of them.
        assert 0.45 < sharded["bytes_read"] / model_bytes < 0.55, (rank, figures, model_bytes)
        assert 0.45 < sharded["shard_bytes"] / model_bytes < 0.55, (rank, figures, model_bytes)
        # Its resident set grew by less than 60% of the model to load it; whole, it grew by more than the model.
        assert sharded["peak_rss"] < 0.6 * model_bytes < whole["peak_rss"] / 1.6, (rank, figures, model_bytes)
        for kind in TRAINABLE:  # an adapted layer's base read its own rows; the adapters are not in the weights
            assert 0.45 < figures[kind]["bytes_read"] / model_bytes < 0.55, (rank, kind, figures, model_bytes)
        print(f"rank {rank}: the LoRA and freeze builds took {figures['trainable_s']:.1f} s, the masked_lm ones "
              f"{figures['masked_lm_s']:.1f} s, {figures}")  # fmt: skip

    # LoRA and model.freeze: read by rows too, from the same step-0 weights and frozen base as built whole.
    for kind, model in TRAINABLE.items():
        cfg = _config(str(tmp_path / "resnet18.safetensors"), "fsdp", **model)
        assert loads_by_rows(cfg, resolve_workload(cfg.workload)), kind
        built = states[kind]
        assert built["fsdp"].keys() == built["whole"].keys(), kind
        for key, tensor in built["whole"].items():
            assert torch.equal(built["fsdp"][key], tensor), (kind, key)
        assert built["sha256"][0] == built["sha256"][1] != "", kind
    lora, frozen = states["lora"], states["freeze"]
    adapter = "layer2.1.conv2.lora_{}.default.weight"
    assert torch.equal(lora["whole"]["layer2.1.conv2.base_layer.weight"], saved["layer2.1.conv2.weight"])
    assert torch.equal(lora["whole"]["fc.base_layer.weight"], ddp["start"]["fc.weight"])  # the seeded new head
    assert lora["whole"][adapter.format("A")].abs().sum() > 0 and not lora["whole"][adapter.format("B")].any()
    assert {name.split(".lora_")[0] for name in lora["trainable"]} == {"fc"} | {
        f"layer{layer}.{block}.conv2" for layer in range(1, 5) for block in range(2)
    }
    assert "conv1.weight" not in frozen["trainable"] and "layer2.0.conv1.weight" in frozen["trainable"]
    assert not any(name.startswith("layer1.") for name in frozen["trainable"])

    # masked_lm: read by rows, the tie kept through the meta build and FSDP2, each stored tensor read once.
    ranks = [json.loads((tmp_path / f"figures-{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    for kind, cfg in masked_lm.items():
        assert loads_by_rows(cfg, resolve_workload(cfg.workload)), kind
        built = states[f"masked_lm-{kind}"]
        assert built["tied"], kind
        assert built["fsdp"].keys() == built["whole"].keys(), kind
        for key, tensor in built["whole"].items():
            assert torch.equal(built["fsdp"][key], tensor), (kind, key)
        torch.testing.assert_close(built["fsdp_logits"], built["whole_logits"], rtol=1e-5, atol=1e-6, msg=kind)
        torch.testing.assert_close(built["fsdp_grad"], built["whole_grad"], rtol=1e-4, atol=1e-6, msg=kind)
        whole = built["whole"]
        tied = ("encoder.cls.predictions.decoder.weight", "encoder.bert.embeddings.word_embeddings.weight")
        assert torch.equal(whole[tied[0]], whole[tied[1]]), kind
        # A sharded checkpoint of a step (the tied weight saved and restored as one parameter): the resume reads the
        # pretrained weights by rows again, restores the trained ones over them, and keeps the tie.
        trained, resumed = built["trained"], built["resumed"]
        assert not torch.equal(trained[tied[1]], whole[tied[1]]) and torch.equal(trained[tied[0]], trained[tied[1]])
        assert resumed.keys() == trained.keys() and built["resumed_tied"], kind
        for key, tensor in trained.items():
            assert torch.equal(resumed[key], tensor), (kind, key)
        stored = _tensor_bytes(Path(cfg.model.pretrained) / "model.safetensors")
        header = stored.pop("")
        read = [figures[f"masked_lm-{kind}"]["bytes_read"] for figures in ranks]
        # Between them the ranks read each stored tensor once (the tied one too) and each its header.
        assert sum(read) == sum(stored.values()) + WORLD_SIZE * header, (kind, read, stored)
        assert all(0.4 < count / sum(stored.values()) < 0.6 for count in read), (kind, read)
    fresh = states["masked_lm-BertModel"]["whole"]  # its head is new: transformers' zero bias, a seeded dense layer
    head = "encoder.cls.predictions."
    assert not fresh[f"{head}bias"].any() and fresh[f"{head}transform.dense.weight"].any()
    loaded = states["masked_lm-BertForMaskedLM"]["whole"]
    assert not torch.equal(loaded[f"{head}transform.dense.weight"], fresh[f"{head}transform.dense.weight"])
