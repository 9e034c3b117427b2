"""What FlyteConsole and the backend will see: documented interfaces, caching, the RayJob shape."""

from __future__ import annotations

from flytekit.configuration import ImageConfig, SerializationSettings

from tasks.data import PREPARE_DATA_CACHE_VERSION, fingerprint_inputs, note_prepared, prepare_data
from tasks.evaluate import evaluate, evaluate_on_ray
from tasks.ray_config import WORKER_GROUP
from tasks.register import register_model
from tasks.train import train
from training_core.config import ScalingConfig
from workflows.training import evaluate_where_it_fits, training_pipeline


def test_every_workflow_and_task_input_is_described_for_the_launch_form():
    for entity in (
        training_pipeline,
        prepare_data,
        fingerprint_inputs,
        note_prepared,
        train,
        evaluate,
        evaluate_on_ray,
        evaluate_where_it_fits,
        register_model,
    ):
        for name, variable in entity.interface.inputs.items():
            assert len(variable.description) > 20, f"{entity.name}.{name} has no description"
    description = training_pipeline.interface.inputs["config"].description
    for section in (
        "data",
        "model",
        "optimizer",
        "loop",
        "scaling",
        "sync",
        "precision",
        "checkpoint",
        "tracking",
        "evaluation",
    ):
        assert f"``{section}``" in description


def test_data_prep_is_cached_on_the_fingerprint_of_what_it_reads_and_its_fingerprint_and_training_are_not():
    assert prepare_data.metadata.cache and prepare_data.metadata.cache_version == PREPARE_DATA_CACHE_VERSION
    assert "inputs_fingerprint" in prepare_data.interface.inputs
    assert prepare_data.metadata.cache_ignore_input_vars == ("run_token",)
    assert not fingerprint_inputs.metadata.cache and not note_prepared.metadata.cache
    assert not train.metadata.cache
    assert train.metadata.retries == 2


def test_train_is_a_ray_task_shaped_by_the_default_scaling_config():
    settings = SerializationSettings(image_config=ImageConfig.auto_default_image())
    assert train.task_type == "ray"
    custom = train.get_custom(settings)
    (group,) = custom["rayCluster"]["workerGroupSpec"]
    defaults = ScalingConfig()
    assert group["groupName"] == WORKER_GROUP and group["replicas"] == defaults.num_workers
    assert custom["rayCluster"]["headGroupSpec"]["rayStartParams"] == {"num-cpus": "0", "num-gpus": "0"}
    assert custom["shutdownAfterJobFinishes"] is True
