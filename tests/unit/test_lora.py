"""Parameter-efficient fine-tuning (``model.lora``, ``model.freeze``, ``optimizer.param_groups``): only the adapters
train and only they are checkpointed, a resume from such a checkpoint is exact and needs its own frozen base, the
registered model is merged and loads without ``peft``, and bad patterns fail before any worker starts."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn

from tests.helpers.labeled_text import labeled_rows, write_csv
from tests.helpers.mlflow_db import seed_mlflow_db
from tests.helpers.runtime import InProcessRuntime
from training_core import checkpoint as ckpt
from training_core import tracking
from training_core.checkpoint.layout import MANIFEST_FILE, META_FILE, MODEL_FILE
from training_core.checkpoint.snapshot import torch_bytes
from training_core.config import (
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    ScheduleConfig,
    TrackingConfig,
    TrainingConfig,
)
from training_core.data import Manifest, prepare
from training_core.records import MlflowRun, WorkerArgs
from training_core.train.loop import run_worker
from training_core.train.lora import merge_adapters, prepare_trainable
from training_core.train.optim import apply_hyperparameters, build_optimizer, build_scheduler, param_groups
from training_core.train.rng import seed_everything
from training_core.tuning import ParamSpec, apply_params, default_base
from training_core.workloads import preflight, resolve_workload

LORA = {"enabled": True, "rank": 2, "alpha": 4.0, "target_modules": ["query", "value"]}
HEAD_GROUP = {"encoder.classifier.*": 0.02}
"""The head at twice ``optimizer.lr``: a pattern MLflow would refuse in a param's name, logged as one JSON param."""


def _config(data: Path, *, lora: dict | None = None, freeze: list[str] | None = None, **sections) -> TrainingConfig:
    loop = {"epochs": 2, "batch_size": 16, "log_interval_steps": 100, **sections.pop("loop", {})}
    return TrainingConfig.from_dict(
        {
            "workload": {"name": "sequence_classification"},
            "data": {"dataset": "labeled_text", "path": str(data), "tokenizer": "byte", "seq_len": 12, "num_shards": 1},
            "model": {
                "name": "bert-tiny",
                "hidden_size": 32,
                "num_heads": 2,
                "lora": LORA if lora is None else lora,
                "freeze": freeze or [],
            },  # fmt: skip
            "optimizer": {"lr": 0.01, **sections.pop("optimizer", {"param_groups": HEAD_GROUP})},
            "loop": loop,
            "checkpoint": {"interval_steps": 3},
            "scaling": {"num_workers": 1, "torch_threads_per_worker": 1},
            "observability": {"enabled": False},
            **sections,
        }
    )


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> tuple[Path, str]:
    """Labelled rows as CSV and their prepared data directory."""
    root = tmp_path_factory.mktemp("lora-data")
    rows = write_csv(root / "rows.csv", labeled_rows(90))
    config = _config(rows)
    prepare(config.data, str(root / "data"), workload=config.workload)
    return rows, str(root / "data")


def _train(cfg: TrainingConfig, data_dir: str, root: Path, mlflow: MlflowRun | None = None) -> ckpt.LoadedCheckpoint:
    run_worker(WorkerArgs.build(cfg, data_dir=data_dir, checkpoint_root=str(root), run_name="lora", mlflow=mlflow),
               InProcessRuntime())  # fmt: skip
    loaded = ckpt.load_latest_valid(ckpt.CheckpointStorage(str(root)))
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def lora_run(text, tmp_path_factory) -> tuple[ckpt.LoadedCheckpoint, str, str]:
    """A LoRA run of 2 epochs that logs its model to MLflow: its final checkpoint, tracking URI and model URI."""
    root = tmp_path_factory.mktemp("lora-run")
    store = TrackingConfig(tracking_uri=seed_mlflow_db(root / "mlflow.db"), experiment_name="lora")
    tracking_uri, run_id = tracking.create_run(store, run_name="lora")
    final = _train(_config(text[0]), text[1], root / "ckpt", MlflowRun(tracking_uri, run_id))
    params = MlflowClient(tracking_uri=tracking_uri).get_run(run_id).data.params
    assert params["optimizer.param_groups"] == json.dumps(HEAD_GROUP) and params["model.lora.rank"] == "2"
    return final, tracking_uri, final.meta.mlflow_model_uri


def _built(cfg: TrainingConfig, data_dir: str) -> nn.Module:
    """The model a worker trains for ``cfg``, built from its seed."""
    seed_everything(cfg.loop.seed)
    return prepare_trainable(resolve_workload(cfg.workload).build_model(cfg, Manifest.load(data_dir)), cfg.model)


def test_only_the_adapters_and_the_new_head_train_and_the_checkpoint_holds_only_them(text, lora_run):
    final, _, _ = lora_run
    model = _built(_config(text[0]), text[1])
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    adapters = {name for name in trainable if ".lora_A.default." in name or ".lora_B.default." in name}
    assert len(adapters) == 2 * 2 * 2  # 2 layers x (query, value) x (A, B)
    assert all(".attention.self.query." in n or ".attention.self.value." in n for n in adapters)
    assert trainable == adapters | {"encoder.classifier.weight", "encoder.classifier.bias"}
    assert set(final.model) == trainable and final.meta.frozen_base_sha256 == ckpt.base_sha256(model)
    # The adapter checkpoint's weights against the whole model's: bert-tiny at width 32 is 0.05 M parameters.
    adapter_bytes = len(torch_bytes(final.model))
    full_bytes = len(torch_bytes(model.state_dict()))
    assert (Path(final.uri) / MODEL_FILE).stat().st_size == adapter_bytes
    assert full_bytes > 20 * adapter_bytes, (full_bytes, adapter_bytes)
    # The frozen base did not move: the run's weights merged back are the base plus the adapters' update.
    base = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    rebuilt, _, _ = ckpt.load_model(final.uri)
    for name, tensor in rebuilt.named_parameters():
        assert torch.equal(tensor, base[name]) if name in base else torch.equal(tensor, final.model[name]), name


def test_a_lora_run_resumed_from_its_adapter_checkpoint_ends_bit_identical_to_one_call(text, lora_run, tmp_path):
    whole, _, _ = lora_run
    first = _train(_config(text[0], loop={"stop_at_epoch": 1}), text[1], tmp_path / "sliced")
    sliced = _train(_config(text[0]), text[1], tmp_path / "sliced")
    assert first.meta.frozen_base_sha256 == whole.meta.frozen_base_sha256
    assert (
        sliced.meta.resumed_from_steps == [first.meta.global_step] and sliced.meta.global_step == whole.meta.global_step
    )
    assert sliced.model.keys() == whole.model.keys()
    assert all(whole.model[name].abs().sum() > 0 for name in whole.model if "lora_B" in name)  # B starts at zero
    for name, tensor in whole.model.items():
        assert torch.equal(tensor, sliced.model[name]), name
    for index, state in whole.trainer["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg_sq"], sliced.trainer["optimizer"]["state"][index]["exp_avg_sq"])


def test_a_lora_run_under_fsdp_resumes_from_its_sharded_adapter_checkpoint_bit_identical(text, process_group, tmp_path):
    """FSDP2 shards the adapted blocks (adapters and frozen base in one unit); its sharded checkpoints hold the
    trainable parameters only, and a resume loads them over the base rebuilt from the seed."""
    fsdp = {"strategy": "fsdp", "num_workers": 1, "torch_threads_per_worker": 1}
    whole = _train(_config(text[0], scaling=fsdp), text[1], tmp_path / "whole")
    _train(_config(text[0], scaling=fsdp, loop={"stop_at_epoch": 1}), text[1], tmp_path / "sliced")
    sliced = _train(_config(text[0], scaling=fsdp), text[1], tmp_path / "sliced")
    assert sliced.meta.resumed_from_steps and sliced.meta.global_step == whole.meta.global_step
    assert whole.shard_metadata is not None
    saved = {key.removeprefix("model.") for key in whole.shard_metadata.state_dict_metadata if key.startswith("model.")}
    assert saved == set(_trainable_names(_config(text[0]), text[1]))
    whole_model, _, _ = ckpt.load_model(whole.uri)
    sliced_model, _, _ = ckpt.load_model(sliced.uri)
    for (name, tensor), (_, other) in zip(whole_model.state_dict().items(), sliced_model.state_dict().items()):
        assert torch.equal(tensor, other), name


def _trainable_names(cfg: TrainingConfig, data_dir: str) -> list[str]:
    return [name for name, param in _built(cfg, data_dir).named_parameters() if param.requires_grad]


def test_an_adapter_checkpoint_refuses_a_model_whose_frozen_base_differs(text, lora_run):
    final, _, _ = lora_run
    other_seed = _built(_config(text[0], loop={"seed": 1}), text[1])
    with pytest.raises(ValueError, match="frozen base has sha256 .* resume with the run's pretrained weights"):
        ckpt.restore(ckpt.load_directory(final.uri), model=other_seed)


def _with_saved_seed(final: ckpt.LoadedCheckpoint, seed: object, directory: Path) -> str:
    """A copy of ``final`` whose metadata names another ``loop.seed``, its manifest entry rewritten to match (what
    only someone editing both files together gets past verification)."""
    shutil.copytree(final.uri, directory)
    meta = json.loads((directory / META_FILE).read_text())
    meta["config"]["loop"]["seed"] = seed
    raw = json.dumps(meta).encode()
    (directory / META_FILE).write_bytes(raw)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    manifest["files"][META_FILE] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))
    return str(directory)


def test_an_adapter_checkpoint_rebuilds_its_base_from_its_saved_seed_and_names_a_bad_one(lora_run, tmp_path):
    final, _, _ = lora_run
    # Another seed builds another base, which the checkpoint's frozen-base sha256 refuses: the seed is the saved one.
    with pytest.raises(ValueError, match="frozen base has sha256"):
        ckpt.load_model(_with_saved_seed(final, 1, tmp_path / "seed-1"))
    bad_seeds = {
        "one": "loop.seed='one' is invalid: expected a number (int)",
        2**40: "loop.seed=1099511627776 is invalid: use a seed in [0, 4294967295]",
    }
    for seed, message in bad_seeds.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            ckpt.load_model(_with_saved_seed(final, seed, tmp_path / f"seed-{seed}"))


def test_the_registered_model_is_the_merged_one_and_predicts_without_peft(text, lora_run, tmp_path):
    final, tracking_uri, model_uri = lora_run
    assert model_uri.startswith("models:/") or model_uri.startswith("runs:/")
    adapted, _, _ = ckpt.load_model(final.uri)
    inputs = torch.tensor(resolve_workload(_config(text[0]).workload).example_input(Manifest.load(text[1])))
    with torch.no_grad():
        expected = adapted.eval()(inputs)
    torch.save({"inputs": inputs, "expected": expected}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys

        class NoPeft(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "peft" or name.startswith("peft."):
                    raise ImportError("peft is blocked")

        sys.meta_path.insert(0, NoPeft())
        import mlflow, torch
        from training_core.workloads.sequence_classification import load_classifier

        mlflow.set_tracking_uri({tracking_uri!r})
        registered = load_classifier({model_uri!r})
        io = torch.load({str(tmp_path / "io.pt")!r})
        names = list(registered.program.state_dict())
        assert names and not any("lora" in name or "base_layer" in name for name in names), names
        with torch.no_grad():
            torch.testing.assert_close(registered.program(io["inputs"]), io["expected"], rtol=1e-5, atol=1e-6)
        assert registered.classify(["apple banana the cherry"])[0] in ("fruit", "metal", "color")
        assert "peft" not in sys.modules
        print("merged ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})  # fmt: skip
    assert done.returncode == 0 and "merged ok" in done.stdout, done.stderr[-3000:]


def test_merging_folds_each_adapter_into_its_linear_layer_of_an_image_mlp():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    model = prepare_trainable(mlp, ModelConfig(name="mlp", lora=LoraConfig(enabled=True, target_modules=["1", "3"])))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        "1.lora_A.default.weight", "1.lora_B.default.weight", "3.lora_A.default.weight", "3.lora_B.default.weight",
        "5.weight", "5.bias",
    }  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: a trained adapter is not
                param.normal_()
    inputs = torch.randn(5, 3, 2, 2)
    merged = merge_adapters(copy.deepcopy(model))
    assert [type(m) for m in merged] == [nn.Flatten, nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    torch.testing.assert_close(merged(inputs), model(inputs), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ freeze and param groups


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)


def test_frozen_parameters_stay_out_of_the_optimizer_and_each_group_keeps_its_rate_under_the_schedule():
    model = prepare_trainable(_Classifier(), ModelConfig(name="m", freeze=["backbone.0.*"]))
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["backbone.0.weight", "backbone.0.bias"]
    cfg = TrainingConfig(optimizer=OptimizerConfig(lr=0.1, param_groups={"backbone.*": 0.01}))
    optimizer = build_optimizer(cfg.optimizer, param_groups(cfg.optimizer, model))
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 2]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for p in (model.head.weight, model.head.bias, model.backbone[1].weight, model.backbone[1].bias)
    }
    scheduler = build_scheduler(ScheduleConfig(warmup_steps=3), optimizer, total_steps=10)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    head_lr, backbone_lr = (g["lr"] for g in optimizer.param_groups)
    assert 0 < backbone_lr < 0.01 and head_lr == pytest.approx(10 * backbone_lr)
    # A resumed trial whose search changed a group's rate follows the new one, at the schedule's position.
    apply_hyperparameters(apply_params(cfg, {"optimizer.param_groups.backbone.*": "0.02"}), optimizer, scheduler)
    assert optimizer.param_groups[1]["lr"] == pytest.approx(2 * backbone_lr)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(head_lr)


def test_tuning_searches_lora_and_param_group_fields_by_their_paths():
    ParamSpec("model.lora.rank", "int", low=2, high=16)
    spec = ParamSpec("optimizer.param_groups.bert.encoder.*", "log_uniform", low=1e-5, high=1e-3)
    trial = apply_params(default_base(), {spec.path: "0.0003", "model.lora.rank": "4", "model.lora.dropout": "0.1"})
    assert trial.optimizer.param_groups == {"bert.encoder.*": 0.0003}
    assert (trial.model.lora.rank, trial.model.lora.dropout) == (4, 0.1)


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("sections", "field", "fix"),
    [
        ({"lora": {**LORA, "target_modules": ["query", "qkv"]}}, "model.lora.target_modules='qkv'", "no layer"),
        ({"freeze": ["bert.nothing.*"]}, "model.freeze='bert.nothing.*'", "matches no parameter"),
        ({"optimizer": {"param_groups": {"*.gamma": 0.1}}}, "optimizer.param_groups['*.gamma']=0.1", "matches no"),
        (
            {"optimizer": {"param_groups": {"*query*": 0.1, "*lora_A*": 0.2}}},
            "optimizer.param_groups=['*query*', '*lora_A*']",
            "disjoint",
        ),
    ],
    ids=["lora-target", "freeze", "param-group", "overlapping-groups"],
)
def test_a_pattern_that_matches_nothing_or_twice_fails_before_any_worker_starts(text, sections, field, fix):
    config = _config(text[0], **({"lora": sections["lora"]} if "lora" in sections else {}),
                     freeze=sections.get("freeze"), **({"optimizer": sections["optimizer"]} if "optimizer" in sections
                                                        else {}))  # fmt: skip
    with pytest.raises(ValueError) as raised:
        preflight(config, text[1])
    assert str(raised.value).startswith(f"{field} is invalid:") and fix in str(raised.value)


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"rank": 0}, "model.lora.rank=0 is invalid: give the adapters' rank"),
        ({"rank": -2}, "model.lora.rank=-2 is invalid"),
        ({"dropout": 1.0}, "model.lora.dropout=1.0 is invalid: it must be in [0, 1)"),
        ({"dropout": -0.1}, "model.lora.dropout=-0.1 is invalid"),
        ({"enabled": True, "target_modules": []}, "model.lora.target_modules=[] is invalid: name at least one"),
    ],
)
def test_a_bad_lora_setting_is_refused_with_its_field_value_and_fix(lora, message):
    with pytest.raises(ValueError) as raised:
        TrainingConfig.from_dict({"model": {"lora": lora}})
    assert str(raised.value).startswith(message)
