"""Pretrained weights (``model.pretrained``): read from real files without unpickling anything, identified by their
sha256, matched against the model before any worker starts, and loaded at step 0 unless a checkpoint of the run
itself is restored over them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.runtime import InProcessRuntime
from training_core import checkpoint as ckpt
from training_core.config import TrainingConfig
from training_core.data import Manifest, prepare
from training_core.metrics import flatten
from training_core.pretrained import locate, read_pretrained, weights_sha256
from training_core.records import WorkerArgs
from training_core.train.loop import run_worker
from training_core.train.lora import prepare_trainable
from training_core.workloads import preflight, resolve_workload


def _config(pretrained: str = "", **model) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "data": {"dataset": "synthetic", "synthetic_num_samples": 256, "synthetic_image_size": 8, "num_shards": 1},
            "model": {"name": "small_cnn", "pretrained": pretrained, **model},
            "optimizer": {"name": "adamw", "lr": 0.01},
            "loop": {"epochs": 2, "batch_size": 16, "log_interval_steps": 4},
            "checkpoint": {"interval_steps": 0, "keep_last": 2},
            "scaling": {"num_workers": 1, "torch_threads_per_worker": 1},
            "observability": {"enabled": False},
        }
    )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("synthetic")
    prepare(_config().data, str(out))
    return str(out)


def _weights(data_dir: str, *, num_classes: int | None = None, name: str = "small_cnn") -> dict[str, torch.Tensor]:
    """A state dict of the model ``name`` builds for the data (with another class count if asked), values set apart
    from any fresh initialisation so a comparison cannot pass by chance."""
    from training_core.models import build_model

    manifest = Manifest.load(data_dir)
    torch.manual_seed(1234)
    model = build_model(name, num_classes=num_classes or manifest.num_classes, input_shape=manifest.input_shape)
    return {key: (value + 0.5 if value.is_floating_point() else value) for key, value in model.state_dict().items()}


def _built(cfg: TrainingConfig, data_dir: str) -> dict[str, torch.Tensor]:
    workload = preflight(cfg, data_dir)
    return workload.build_model(cfg, Manifest.load(data_dir)).state_dict()


def _assert_equal(found: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], *, except_: tuple = ()) -> None:
    assert found.keys() == saved.keys()
    for key in saved:
        if key not in except_:
            assert torch.equal(found[key], saved[key]), key


def _error(cfg_or_source, data_dir: str | None = None) -> str:
    with pytest.raises(ValueError) as raised:
        if data_dir is None:
            read_pretrained(cfg_or_source)
        else:
            preflight(cfg_or_source, data_dir)
    return str(raised.value)


def test_a_safetensors_state_dict_is_the_models_weights_at_step_0_and_its_sha256_is_the_files(data_dir, tmp_path):
    saved = _weights(data_dir)
    path = tmp_path / "weights.safetensors"
    save_file(saved, path)
    cfg = _config(str(path))
    _assert_equal(_built(cfg, data_dir), saved)
    assert cfg.model.pretrained_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_pt_state_dict_loads_with_weights_only_and_equals_the_saved_one(data_dir, tmp_path):
    saved = _weights(data_dir)
    torch.save(saved, tmp_path / "weights.pt")
    _assert_equal(_built(_config(str(tmp_path / "weights.pt")), data_dir), saved)


def _hf_directory(root: Path, state: dict[str, torch.Tensor], *, shards: int = 1) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "small_cnn"}))
    if shards == 1:
        save_file(state, root / "model.safetensors")
        return root
    keys, weight_map = sorted(state), {}
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {key: state[key] for key in keys[index::shards]}
        save_file(part, root / name)
        weight_map.update(dict.fromkeys(part, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def test_a_hugging_face_directory_single_or_sharded_reads_whole_and_its_hash_follows_every_file(data_dir, tmp_path):
    saved = _weights(data_dir)
    single = read_pretrained(str(_hf_directory(tmp_path / "single", saved)))
    sharded = _hf_directory(tmp_path / "sharded", saved, shards=2)
    first = read_pretrained(str(sharded))
    assert single.kind == first.kind == "huggingface"
    _assert_equal(single.state_dict, saved)
    _assert_equal(first.state_dict, saved)
    _assert_equal(_built(_config(str(sharded)), data_dir), saved)

    assert weights_sha256(locate(str(sharded))) == first.sha256  # streamed, without reading the tensors

    (sharded / "config.json").write_text(json.dumps({"model_type": "small_cnn", "note": 1}))
    changed = read_pretrained(str(sharded)).sha256
    assert changed != first.sha256 and changed == weights_sha256(locate(str(sharded)))


class _Marker:
    """A pickle whose loading creates a file: proof of whether anything was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_is_refused_by_name_with_the_conversion_and_nothing_is_unpickled(data_dir, tmp_path):
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Marker(str(marker)))
    bin_file = tmp_path / "pytorch_model.bin"
    bin_file.write_bytes(payload)
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "pytorch_model.bin").write_bytes(payload)
    pt_file = tmp_path / "weights.pt"
    torch.save({"weight": _Marker(str(marker))}, pt_file)

    for source in (bin_file, directory):
        message = _error(_config(str(source)), data_dir)
        assert "model.pretrained=" in message and str(source) in message
        assert "safetensors.torch.save_file(torch.load(path, weights_only=True)" in message
        assert "safe_serialization=True" in message
    message = _error(_config(str(pt_file)), data_dir)
    assert "weights_only=True" in message and "weights.pt" in message
    assert not marker.exists()


def _flipped(tmp_path: Path, data_dir: str, offset: int) -> Path:
    path = tmp_path / f"flipped{offset}.safetensors"
    save_file(_weights(data_dir), path)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def test_a_safetensors_file_with_a_flipped_header_byte_or_a_truncated_header_fails_naming_it(data_dir, tmp_path):
    truncated = tmp_path / "truncated.safetensors"
    save_file(_weights(data_dir), truncated)
    truncated.write_bytes(truncated.read_bytes()[:40])
    for path in (_flipped(tmp_path, data_dir, 8), _flipped(tmp_path, data_dir, 3), truncated):
        message = _error(_config(str(path)), data_dir)
        assert f"model.pretrained={str(path)!r}" in message, message
        assert "not a valid safetensors file" in message and "Copy it again" in message


def test_a_path_that_does_not_exist_a_directory_that_is_not_a_model_and_a_fifo_fail_with_the_fix(data_dir, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("hello")
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    expected = {
        tmp_path / "missing.safetensors": "nothing exists there",
        tmp_path / "notes": "it is a directory but not a model (it holds README.md)",
        fifo: "is a FIFO, not a regular file",
    }
    for source, problem in expected.items():
        message = _error(_config(str(source)), data_dir)
        assert f"model.pretrained={str(source)!r}" in message and problem in message, message
        assert "a .safetensors or .pt/.pth state dict, or a Hugging Face model directory" in message


def test_names_or_shapes_that_do_not_match_fail_in_preflight_listing_the_first_few(data_dir, tmp_path):
    saved = _weights(data_dir)
    renamed = {("trunk." + key if key.startswith("features") else key): value for key, value in saved.items()}
    save_file(renamed, tmp_path / "renamed.safetensors")
    message = _error(_config(str(tmp_path / "renamed.safetensors")), data_dir)
    assert "4 of the model's tensors missing (features.0.bias, features.0.weight" in message
    assert "4 tensors the model lacks (trunk.features.0.bias" in message

    save_file(_weights(data_dir, num_classes=1000), tmp_path / "imagenet_head.safetensors")
    message = _error(_config(str(tmp_path / "imagenet_head.safetensors")), data_dir)
    assert "2 of another shape (head.bias [1000] vs the model's [10]" in message
    assert "set model.new_head: true" in message


def _seeded_head(seed: int, in_features: int = 1024, classes: int = 10) -> dict[str, torch.Tensor]:
    """What ``model.new_head`` re-initialises a head to: a fresh layer's ``reset_parameters()`` under the seed."""
    layer = torch.nn.Linear(in_features, classes)
    torch.manual_seed(seed)
    layer.reset_parameters()
    return {"head.weight": layer.weight.detach(), "head.bias": layer.bias.detach()}


def test_new_head_reinitialises_only_a_head_of_another_class_count_from_the_seed_and_says_so(
    data_dir, tmp_path, caplog
):
    saved = _weights(data_dir, num_classes=1000)
    save_file(saved, tmp_path / "imagenet_head.safetensors")
    cfg = _config(str(tmp_path / "imagenet_head.safetensors"), new_head=True)
    with caplog.at_level(logging.INFO, logger="training_core"):
        torch.manual_seed(7)
        found = _built(cfg, data_dir)
    torch.manual_seed(8)  # the head depends on loop.seed alone, not on the RNG the build found
    assert torch.equal(_built(cfg, data_dir)["head.weight"], found["head.weight"])
    _assert_equal(found, saved, except_=("head.weight", "head.bias"))
    head = _seeded_head(cfg.loop.seed)
    assert torch.equal(found["head.weight"], head["head.weight"]) and torch.equal(found["head.bias"], head["head.bias"])
    assert "re-initialised the classifier head 'head' (1000 classes in the pretrained weights, 10 here)" in caplog.text
    assert "re-initialised 2 tensors: head.weight, head.bias" in caplog.text


def test_new_head_as_a_name_pattern_reinitialises_what_it_names_and_a_pattern_naming_nothing_fails(
    data_dir, tmp_path, caplog
):
    saved = _weights(data_dir)  # the data's 10 classes: `true` would keep this head, a pattern re-initialises it
    save_file({k: v for k, v in saved.items() if k != "head.bias"}, tmp_path / "headless_bias.safetensors")
    cfg = _config(str(tmp_path / "headless_bias.safetensors"), new_head="head.*")
    with caplog.at_level(logging.INFO, logger="training_core"):
        found = _built(cfg, data_dir)
    _assert_equal(found, saved, except_=("head.weight", "head.bias"))
    assert torch.equal(found["head.weight"], _seeded_head(cfg.loop.seed)["head.weight"])
    assert "re-initialised 2 tensors: head.weight, head.bias" in caplog.text
    # The overrides and old checkpoints' booleans still read as booleans.
    assert TrainingConfig.from_dict({"model": {"pretrained": "w.pt", "new_head": "true"}}).model.new_head is True
    assert TrainingConfig.from_dict({"model": {"pretrained": "w.pt", "new_head": False}}).model.new_head is False

    message = _error(_config(str(tmp_path / "headless_bias.safetensors"), new_head="classifier.*"), data_dir)
    assert "model.new_head='classifier.*' is invalid: it names none of the model's tensors" in message
    assert "head.weight, head.bias" in message and "e.g. 'fc.*'" in message


def test_a_torchvision_resnet18_with_1000_classes_fine_tunes_its_fc_to_the_datas_10_classes(data_dir, tmp_path):
    saved = _weights(data_dir, num_classes=1000, name="resnet18")
    save_file(saved, tmp_path / "resnet18.safetensors")
    cfg = _config(str(tmp_path / "resnet18.safetensors"), new_head=True)
    cfg.model.name = "resnet18"
    found = _built(cfg, data_dir)
    _assert_equal(found, saved, except_=("fc.weight", "fc.bias"))
    assert found["fc.weight"].shape == (10, 512) and not torch.equal(found["fc.weight"], saved["fc.weight"][:10])


def test_pinned_weights_whose_content_changed_fail_naming_both_hashes(data_dir, tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file(_weights(data_dir), path)
    message = _error(_config(str(path), pretrained_sha256="0" * 64), data_dir)
    assert f"its sha256 is {hashlib.sha256(path.read_bytes()).hexdigest()}" in message
    assert "model.pretrained_sha256=" + "0" * 64 in message


@pytest.mark.parametrize(
    ("model", "field", "fix"),
    [
        ({"new_head": True}, "model.new_head=True", "set that too"),
        ({"pretrained": "w.safetensors", "pretrained_sha256": "abc"}, "model.pretrained_sha256='abc'", "64 lowercase"),
        ({"pretrained": "gs://bucket/w.safetensors"}, "model.pretrained='gs://bucket/w", "an s3:// URI"),
    ],
)
def test_the_config_refuses_a_malformed_pretrained_section_naming_the_field(model, field, fix):
    with pytest.raises(ValueError) as raised:
        TrainingConfig.from_dict({"model": model})
    assert field in str(raised.value) and fix in str(raised.value)


class _StartRecorder(InProcessRuntime):
    """Records the weights the loop hands to the runtime: the model before its first step (and before a resume)."""

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        self.initial = {key: value.clone() for key, value in model.state_dict().items()}
        return super().prepare_model(model)


def _run(cfg: TrainingConfig, data_dir: str, root: Path) -> _StartRecorder:
    runtime = _StartRecorder()
    run_worker(WorkerArgs.build(cfg, data_dir=data_dir, checkpoint_root=str(root), run_name="unit"), runtime)
    return runtime


def _final(root: Path) -> ckpt.LoadedCheckpoint:
    loaded = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(root)))
    assert loaded is not None
    return loaded


def test_training_starts_from_the_pretrained_weights_and_a_resume_keeps_its_own_checkpoints(data_dir, tmp_path):
    saved = _weights(data_dir)
    save_file(saved, tmp_path / "weights.safetensors")
    cfg = _config(str(tmp_path / "weights.safetensors"))
    preflight(cfg, data_dir)
    # What a worker gets (Ray Train's train_loop_config) and logs as MLflow params names the weights' content.
    sent = WorkerArgs.from_dict(WorkerArgs.build(cfg, data_dir=data_dir, checkpoint_root="", run_name="x").to_dict())
    params = flatten(sent.config.to_dict())
    assert (
        params["model.pretrained_sha256"] == hashlib.sha256((tmp_path / "weights.safetensors").read_bytes()).hexdigest()
    )
    whole = _run(cfg, data_dir, tmp_path / "whole")
    _assert_equal(whole.initial, saved)
    assert not torch.equal(_final(tmp_path / "whole").model["head.weight"], saved["head.weight"])  # it trained

    first_slice = TrainingConfig.from_dict(cfg.to_dict() | {"loop": cfg.loop.__dict__ | {"stop_at_epoch": 1}})
    _run(first_slice, data_dir, tmp_path / "sliced")
    after_first = _final(tmp_path / "sliced").model
    _run(cfg, data_dir, tmp_path / "sliced")  # reads the pretrained weights again, then restores its checkpoint
    sliced, ended = _final(tmp_path / "sliced"), _final(tmp_path / "whole")
    assert sliced.meta.resumed_from_steps == [ended.meta.global_step // 2]
    assert not torch.equal(after_first["head.weight"], saved["head.weight"])
    for key, tensor in ended.model.items():
        assert torch.equal(sliced.model[key], tensor), key


def test_a_built_in_workload_that_loads_no_pretrained_weights_refuses_them_rather_than_ignoring_them(tmp_path):
    from training_core.workloads.resolve import check_pretrained_supported

    cfg = TrainingConfig.from_dict(
        {
            "workload": {"name": "causal_lm"},
            "data": {"dataset": "text", "path": str(tmp_path)},
            "model": {"name": "gpt2-tiny", "pretrained": str(tmp_path / "w.pt")},
        }
    )
    with pytest.raises(ValueError, match=r"model.pretrained=.*workload 'causal_lm' does not load pretrained weights"):
        check_pretrained_supported(cfg, resolve_workload(cfg.workload))


def test_a_checkpoint_of_a_fine_tuned_run_loads_after_its_pretrained_weights_are_gone(data_dir, tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file(_weights(data_dir), path)
    cfg = _config(str(path))
    cfg.loop.epochs = 1
    preflight(cfg, data_dir)
    _run(cfg, data_dir, tmp_path / "run")
    final = _final(tmp_path / "run")
    path.unlink()  # evaluation and the registry rebuild the model from the checkpoint alone
    model, meta, _ = ckpt.load_model(final.uri)
    assert meta.config["model"]["pretrained"] == str(path)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, final.model[key]), key


def test_a_searchs_trials_carry_the_weights_sha256_so_the_cached_trials_key_names_their_content(data_dir, tmp_path):
    from tasks.tuning import SearchState, Trial, plan_round
    from training_core import tuning
    from training_core.pretrained import pinned_sha256

    path = tmp_path / "weights.safetensors"
    save_file(_weights(data_dir), path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert pinned_sha256(str(path)) == digest and pinned_sha256("") == ""
    with pytest.raises(ValueError, match=f"its sha256 is {digest}, not model.pretrained_sha256=1111"):
        pinned_sha256(str(path), "1" * 64)

    config = tuning.TuningConfig.from_dict(
        {"num_trials": 2, "base": {"model": {"name": "small_cnn", "pretrained": str(path)}, "loop": {"epochs": 2}}}
    )
    trials = [Trial(trial_id=i, params=p) for i, p in enumerate(tuning.initial_params(config))]
    state = SearchState(0, trials, tracking_uri="sqlite:///m.db", parent_run_id="p", pretrained_sha256=digest)
    assert [s.config.model.pretrained_sha256 for s in plan_round(config, state)] == [digest, digest]


def test_rows_of_safetensors_tensors_are_read_by_byte_range_and_only_their_bytes_count(tmp_path):
    from training_core.pretrained import SafetensorsRows

    tensors = {
        "w": torch.arange(35, dtype=torch.float32).reshape(5, 7),
        "half": torch.arange(6, dtype=torch.bfloat16).reshape(3, 2),
        "ids": torch.arange(5, dtype=torch.int64),
        "steps": torch.tensor(9, dtype=torch.int64),
    }
    save_file(tensors, tmp_path / "w.safetensors")
    reader = SafetensorsRows(locate(str(tmp_path / "w.safetensors")))
    header_bytes = reader.bytes_read
    for name, start, stop in (("w", 3, 5), ("w", 5, 5), ("ids", 0, 3), ("steps", 0, 0)):
        out = torch.empty_like(tensors[name][start:stop] if tensors[name].dim() else tensors[name])
        reader.read_rows(name, start, stop, out)
        assert torch.equal(out, tensors[name][start:stop] if out.dim() else tensors[name]), name
    out = torch.empty(2, 2, dtype=torch.float32)  # another dtype than the file's: converted
    reader.read_rows("half", 1, 3, out)
    assert torch.equal(out, tensors["half"][1:3].float())
    assert reader.bytes_read - header_bytes == 2 * 7 * 4 + 3 * 8 + 8 + 2 * 2 * 2

    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-30])
    with pytest.raises(ValueError, match=r"model.pretrained=.*cut.safetensors.* ends before byte"):
        SafetensorsRows(locate(str(tmp_path / "cut.safetensors"))).read_rows("w", 0, 5, torch.empty(5, 7))


@pytest.mark.parametrize("suffix", ["safetensors", "pt", "directory"])
def test_an_fsdp_model_built_empty_gets_each_shards_rows_and_equals_the_whole_load(
    data_dir, tmp_path, process_group, suffix
):
    from tests.helpers.runtime import InProcessRuntime
    from training_core.parallel.sharding import is_sharded
    from training_core.train.model import build_sharded_pretrained

    saved = _weights(data_dir, num_classes=1000)
    path = tmp_path / f"w.{suffix}"
    if suffix == "safetensors":
        save_file(saved, path)
    elif suffix == "pt":
        torch.save(saved, path)
    else:  # a Hugging Face directory of two safetensors shards and their index
        path.mkdir()
        names = sorted(saved)
        shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
        for shard, keys in shards.items():
            save_file({key: saved[key] for key in keys}, path / shard)
        weight_map = {key: shard for shard, keys in shards.items() for key in keys}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (path / "config.json").write_text("{}")
    cfg = _config(str(path), new_head=True)
    whole = _built(cfg, data_dir)
    cfg.scaling.strategy = "fsdp"
    workload, manifest = resolve_workload(cfg.workload), Manifest.load(data_dir)
    held, num_parameters, bytes_read = build_sharded_pretrained(cfg, workload, manifest, InProcessRuntime(),
                                                                param_dtype=None)  # fmt: skip
    assert is_sharded(held.model) and num_parameters == sum(p.numel() for p in held.model.parameters())
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    for key, tensor in get_model_state_dict(held.model).items():
        assert torch.equal(tensor.full_tensor(), whole[key]), key  # the head: the same seeded re-initialisation
    loaded_bytes = sum(t.numel() * t.element_size() for k, t in saved.items() if not k.startswith("head."))
    if suffix != "pt":  # the head's 1,000 rows are never read; a .pt is read whole
        assert loaded_bytes < bytes_read < loaded_bytes + 4096
    else:
        assert bytes_read == sum(t.numel() * t.element_size() for t in saved.values())


@pytest.mark.parametrize("trainable", [{}, {"lora": {"enabled": True, "rank": 2, "target_modules": ["features.2"]}}],
                         ids=["all", "lora"])  # fmt: skip
def test_under_fsdp_the_loop_reads_the_weights_by_rows_and_a_resume_keeps_its_own_checkpoint(
    data_dir, tmp_path, process_group, caplog, trainable
):
    """With LoRA too: the adapters are added on the meta device, and the checkpoints hold the trainable parameters
    only and name the frozen base the model read by rows, the one a whole build of the weights has."""
    save_file(_weights(data_dir, num_classes=1000), tmp_path / "weights.safetensors")
    cfg = _config(str(tmp_path / "weights.safetensors"), new_head="head.*", **trainable)
    cfg.scaling.strategy = "fsdp"
    as_ddp = TrainingConfig.from_dict(cfg.to_dict() | {"scaling": cfg.scaling.__dict__ | {"strategy": "ddp"}})
    preflight(as_ddp, data_dir)  # records the sha256 (small_cnn has no blocks, which preflight wants under FSDP)
    cfg.model.pretrained_sha256 = as_ddp.model.pretrained_sha256
    with caplog.at_level(logging.INFO, logger="training_core"):
        _run(cfg, data_dir, tmp_path / "whole")
    assert "of the weights by rows (FSDP)" in caplog.text
    first_slice = TrainingConfig.from_dict(cfg.to_dict() | {"loop": cfg.loop.__dict__ | {"stop_at_epoch": 1}})
    _run(first_slice, data_dir, tmp_path / "sliced")
    _run(cfg, data_dir, tmp_path / "sliced")  # reads the weights by rows again, then restores its checkpoint
    sliced, ended = _final(tmp_path / "sliced"), _final(tmp_path / "whole")
    assert sliced.meta.resumed_from_steps == [ended.meta.global_step // 2]
    for key, tensor in ended.model.items():
        assert torch.equal(sliced.model[key], tensor), key
    if trainable:
        whole = prepare_trainable(resolve_workload(cfg.workload).build_model(cfg, Manifest.load(data_dir)), cfg.model)
        assert ended.meta.frozen_base_sha256 == sliced.meta.frozen_base_sha256 == ckpt.base_sha256(whole) != ""
        assert ended.shard_metadata is not None
        keys = ended.shard_metadata.state_dict_metadata
        saved = {key.removeprefix("model.") for key in keys if key.startswith("model.")}
        assert saved == {name for name, p in whole.named_parameters() if p.requires_grad} == {
            "features.2.lora_A.default.weight", "features.2.lora_B.default.weight", "head.weight", "head.bias"
        }  # fmt: skip


def test_an_fsdp_runs_preflight_matches_the_weights_by_their_headers_and_records_their_streamed_sha256(
    data_dir, tmp_path
):
    path = tmp_path / "resnet18.safetensors"
    save_file(_weights(data_dir, num_classes=1000, name="resnet18"), path)
    cfg = _config(str(path))
    cfg.model.name, cfg.scaling.strategy = "resnet18", "fsdp"
    assert "fc.weight [1000, 512] vs the model's [10, 512]" in _error(cfg, data_dir)
    cfg.model.new_head = "fc.*"
    import tracemalloc

    tracemalloc.start()  # the file's bytes would be a Python bytes object: read whole, they would show here
    try:
        preflight(cfg, data_dir)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes < path.stat().st_size / 8, (peak_bytes, path.stat().st_size)
    assert cfg.model.pretrained_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_fsdp_export_rebuilds_the_model_without_reading_the_pretrained_weights_again(
    data_dir, tmp_path, process_group
):
    # At the end of an FSDP run rank 0 rebuilds the model whole for MLflow and loads the gathered state into it. It
    # used to rebuild with model.pretrained too: weights moved or changed during the run failed the export after all
    # the training, and unchanged ones were read and hashed again only to be overwritten.
    from torch.distributed.fsdp import fully_shard

    from training_core.train.model import ModelExport

    path = tmp_path / "weights.safetensors"
    save_file(_weights(data_dir), path)
    cfg = _config(str(path), new_head="head.*")
    workload = preflight(cfg, data_dir)
    manifest = Manifest.load(data_dir)
    model = workload.build_model(cfg, manifest)
    with torch.no_grad():
        for parameter in model.parameters():  # "trained": set apart from the pretrained and the seeded weights
            parameter.mul_(-2.0)
    trained = {key: value.clone() for key, value in model.state_dict().items()}
    fully_shard(model)
    path.unlink()  # the weights the run started from are gone by its end
    export = ModelExport(None, cfg, manifest=manifest, workload=workload, rank=0, sharded=True)
    _assert_equal(export.gathered(model).state_dict(), trained)
