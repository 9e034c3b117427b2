import pytest

from training_core.config import TrainingConfig, load_config
from training_core.registry import IMAGE_MODELS


def test_defaults_build_and_round_trip_through_a_dict():
    cfg = TrainingConfig()
    assert TrainingConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.scaling.resolved_backend() == "gloo"


@pytest.mark.parametrize(
    ("overrides", "field", "bad", "fix"),
    [
        ({"model": {"name": "resnet9000"}}, "model.name", "'resnet9000'", ", ".join(IMAGE_MODELS)),
        ({"data": {"dataset": "mnist"}}, "data.dataset", "'mnist'", "digits, synthetic, cifar10, image_folder"),
        ({"optimizer": {"name": "lion"}}, "optimizer.name", "'lion'", "sgd, adam, adamw"),
        ({"loop": {"batch_size": 0}}, "loop.batch_size", "0", "set loop.global_batch_size"),
        ({"loop": {"batch_size": -4}}, "loop.batch_size", "-4", ">= 0"),
        ({"scaling": {"num_workers": 0}}, "scaling.num_workers", "0", "> 0"),
        ({"optimizer": {"lr": 0}}, "optimizer.lr", "0", "> 0"),
        ({"optimizer": {"lr": -1e-3}}, "optimizer.lr", "-0.001", "> 0"),
        ({"data": {"dataset": "cifar10"}}, "data.path", "''", "s3://"),
        ({"precision": {"mode": "int8"}}, "precision.mode", "'int8'", "auto, fp32, bf16, fp16"),
        ({"scaling": {"backend": "nccl"}}, "scaling.backend", "'nccl'", "use_gpu"),
        ({"data": {"num_shards": 2}, "scaling": {"num_workers": 4}}, "data.num_shards", "2", ">= 4"),
        ({"scaling": {"strategy": "zero3"}}, "scaling.strategy", "'zero3'", "ddp, fsdp"),
        ({"scaling": {"fsdp_cpu_offload": True}}, "scaling.fsdp_cpu_offload", "True", "strategy='fsdp'"),
        (
            {"model": {"activation_checkpointing": "some"}},
            "model.activation_checkpointing",
            "'some'",
            "none, full, selective",
        ),
        ({"model": {"activation_checkpointing_every_k": 0}}, "model.activation_checkpointing_every_k", "0", "> 0"),
        ({"sync": {"mode": "gossip"}}, "sync.mode", "'gossip'", "allreduce, local_sgd"),
        ({"evaluation": {"placement": "gpu"}}, "evaluation.placement", "'gpu'", "auto, process, cluster"),
        ({"scaling": {"min_workers": 3}}, "scaling.min_workers", "3", "in [0, 2] (0: not elastic"),
        (
            {"scaling": {"num_workers": 4, "min_workers": 3}, "data": {"num_shards": 4}, "loop": {"batch_size": 8}},
            "scaling.min_workers",
            "3",
            "a multiple of 12",
        ),
        (
            {"scaling": {"min_workers": 1}, "sync": {"mode": "local_sgd"}},
            "scaling.min_workers",
            "1",
            "sync.mode='allreduce'",
        ),
        ({"evaluation": {"process_memory_gib": 0}}, "evaluation.process_memory_gib", "0", "> 0"),
        (
            {"scaling": {"ddp_static_graph": True}, "loop": {"grad_accum_steps": 2}},
            "scaling.ddp_static_graph",
            "True",
            "turn one of them off",
        ),
        ({"scaling": {"nccl_env": {"LD_PRELOAD": "x.so"}}}, "scaling.nccl_env", "'LD_PRELOAD'", "NCCL_"),
        ({"scaling": {"ddp_bucket_cap_mb": 0}}, "scaling.ddp_bucket_cap_mb", "0", "[1, 4_096]"),
        ({"sync": {"local_sgd_period_steps": 1}}, "sync.local_sgd_period_steps", "1", "[2, 1_000_000]"),
        (
            {"sync": {"mode": "local_sgd"}, "scaling": {"strategy": "fsdp"}},
            "sync.mode",
            "'local_sgd'",
            "use scaling.strategy='ddp'",
        ),
    ],
)
def test_invalid_setting_names_field_value_and_fix(overrides, field, bad, fix):
    with pytest.raises(ValueError) as excinfo:
        TrainingConfig.from_dict(overrides)
    message = str(excinfo.value)
    assert f"{field}={bad}" in message
    assert fix in message


def test_unknown_field_lists_the_valid_ones():
    with pytest.raises(
        ValueError,
        match=r"model has unknown field\(s\) nmae: valid fields are activation_checkpointing, "
        r"activation_checkpointing_every_k, channels_last, compile, context_length, encoder_config, freeze, "
        r"hidden_size, lora, name, new_head, num_heads, num_layers, pretrained, pretrained_sha256, sync_batchnorm",
    ):
        TrainingConfig.from_dict({"model": {"nmae": "x"}})


def test_wrong_type_is_rejected_with_the_field_name():
    with pytest.raises(ValueError, match=r"loop.epochs='many' is invalid: expected a number"):
        TrainingConfig.from_dict({"loop": {"epochs": "many"}})
    with pytest.raises(ValueError, match=r"loop.epochs=2.5 is invalid: expected a whole number"):
        TrainingConfig.from_dict({"loop": {"epochs": 2.5}})


def test_yaml_file_then_environment_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: resnet34\nscaling:\n  num_workers: 4\n")
    env = {"TRAINING_CORE__SCALING__NUM_WORKERS": "3", "TRAINING_CORE__OPTIMIZER__LR": "0.05", "UNRELATED": "1"}
    cfg = load_config(path, environ=env)
    assert cfg.model.name == "resnet34"
    assert cfg.scaling.num_workers == 3
    assert cfg.optimizer.lr == pytest.approx(0.05)


def test_fp16_on_cpu_warns_that_it_falls_back(caplog):
    TrainingConfig.from_dict({"precision": {"mode": "fp16"}})
    assert "falls back to fp32 on CPU" in caplog.text


def test_every_field_has_a_docstring():
    import ast
    import inspect

    from training_core.config import sections as module

    tree = ast.parse(inspect.getsource(module))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
            body = node.body
            for index, item in enumerate(body):
                if isinstance(item, ast.AnnAssign):
                    following = body[index + 1] if index + 1 < len(body) else None
                    documented = isinstance(following, ast.Expr) and isinstance(
                        getattr(following, "value", None), ast.Constant
                    )
                    assert documented, f"{node.name}.{item.target.id} has no docstring"


# --- workload.params: the user's own hyperparameters --------------------------------------------------------------


def test_workload_params_are_read_from_yaml_and_the_environment_with_their_json_types(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("workload:\n  params: {kernel_size: 3, dropout: 0.1, act: relu, layers: [64, 32], extra: null}\n")
    cfg = load_config(path, environ={"TRAINING_CORE__WORKLOAD__PARAMS__KERNEL_SIZE": "5"})
    assert cfg.workload.params == {"act": "relu", "dropout": 0.1, "extra": None, "kernel_size": 5, "layers": [64, 32]}
    assert list(cfg.workload.params) == sorted(cfg.workload.params)  # equal params, equal cache keys


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"kernel-size": 3}, "workload.params='kernel-size' is invalid: each name must be a Python identifier"),
        ({"lr": float("inf")}, "workload.params.lr=inf is invalid: expected a finite number, not inf or nan"),
        ({"sizes": [1, {2}]}, "workload.params.sizes[1]={2} is invalid: a set is not a JSON value"),
        ({"notes": "x" * 20_000}, "more than 16_384: pass hyperparameters here"),
        ("kernel_size=3", "workload.params='kernel_size=3' is invalid: expected a mapping"),
    ],
    ids=["not-an-identifier", "not-finite", "not-json", "too-large", "not-a-mapping"],
)
def test_bad_workload_params_name_the_field_the_value_and_the_fix(params, message):
    with pytest.raises(ValueError, match=r"is invalid") as caught:
        TrainingConfig.from_dict({"workload": {"params": params}})
    assert message in str(caught.value)


def test_workload_params_key_prep_only_where_prep_can_read_them():
    params = {"kernel_size": 5}
    built_in = TrainingConfig.from_dict({"workload": {"params": params, "model_factory": "pkg.models:make"}}).workload
    assert built_in.for_prep().params == {}  # the built-in image prep never reads them: a new kernel re-preps nothing
    source = TrainingConfig.from_dict({"workload": {"params": params, "dataset_source": "pkg.data:load"}}).workload
    assert source.for_prep().params == params
    user = TrainingConfig.from_dict({"workload": {"name": "pkg.work:Build", "params": params}}).workload
    assert user.for_prep().params == params


def test_workload_params_are_logged_as_mlflow_params_by_their_dotted_name():
    from training_core.metrics import flatten

    cfg = TrainingConfig.from_dict({"workload": {"params": {"kernel_size": 5, "head": {"width": 64}}}})
    flat = flatten(cfg.to_dict())
    assert flat["workload.params.kernel_size"] == 5 and flat["workload.params.head.width"] == 64


def test_a_nan_validation_metric_is_never_the_best_and_never_keeps_a_number_from_being_it():
    # A NaN best (a diverged first validation) used to stay best for the rest of the run: nothing compares above it.
    from training_core.config.sections import is_better

    nan = float("nan")
    assert is_better("val_accuracy", 0.9, nan) and is_better("val_loss", 2.0, nan)
    assert not is_better("val_accuracy", nan, None) and not is_better("val_loss", nan, 1.0)
    assert is_better("val_accuracy", 0.9, 0.8) and not is_better("val_loss", 2.0, 1.0)
