"""Every path that trains or prepares data on a cluster runs on a RayJob sized from the config it was launched with.

Each entry point's graph is compiled as propeller compiles it (``dispatch_execute`` in TASK_EXECUTION mode) for a
config of 4 GPU workers with sizes unlike the defaults, and the RayJob of every training node is decoded through
flyteidl's RayJob message: replicas, requests and limits, GPUs, node selector, tolerations, ``/dev/shm``.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from flytekit import FlyteFile
from flytekit.models.task import Resources as _Resources
from flytekit.types.directory import FlyteDirectory

from tasks.data import fingerprint_inputs, note_prepared, prepare, prepare_data, prepare_on_ray
from tasks.evaluate import evaluate, evaluate_on_ray
from tasks.ray_config import PREP_GROUP, PREP_HEAD, WORKER_GROUP
from tasks.train import train
from tasks.tuning import SearchState, Trial, train_trial, tune_with_ray
from tasks.types import PreparedData, TrainedModel, TrainMetrics
from tests.helpers.flyte_compile import RayJobShape, compile_dynamic, rayjob_shape
from training_core import checkpoint as ckpt
from training_core import tuning
from training_core.config import DataConfig, ScalingConfig, Toleration, TrainingConfig, WorkloadConfig
from training_core.parallel.ray_settings import POD_HOOK_COMMAND, PROCESS_ENV
from training_core.scaling_benchmark import point_config, scaling_preset
from training_core.tuning import TuningConfig
from workflows.scaling_benchmark import ray_point
from workflows.training import evaluate_where_it_fits, train_on_ray
from workflows.tuning import search_round

GPU_SCALING = ScalingConfig(
    num_workers=4,
    use_gpu=True,
    gpus_per_worker=2,
    cpus_per_worker=6.0,
    memory_per_worker_gib=30.0,
    head_cpus=2.0,
    head_memory_gib=8.0,
    shm_per_worker_gib=8.0,
    gpu_node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
    gpu_tolerations=[Toleration(), Toleration(key="spot", operator="Equal", value="true", effect="NoExecute")],
    nccl_env={"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1"},
)
# A remote directory: a compile only references the data, it never reads it.
DATA = PreparedData(
    directory=FlyteDirectory("s3://bucket/prepared"),
    dataset="digits",
    num_classes=10,
    input_shape=[1, 8, 8],
    split_counts={},
)


@pytest.fixture(autouse=True)
def fresh_compiles():
    """Each test compiles from scratch and leaves the Ray tasks as it found them: a ``task_config`` override stays
    on the task object, and flytekit reuses a dynamic task's first compile within one process."""
    ray_tasks = (train, train_trial, tune_with_ray, prepare_on_ray, evaluate_on_ray)
    saved = [t._task_config for t in ray_tasks]
    dynamics = (train_on_ray, ray_point, search_round, prepare, evaluate_where_it_fits)
    for d in dynamics:
        d._wf = None
    yield
    for t, config in zip(ray_tasks, saved):
        t._task_config = config
    for d in dynamics:
        d._wf = None


def assert_sized(shape: RayJobShape, scaling: ScalingConfig, *, num_workers: int | None = None) -> None:
    """The RayJob has ``num_workers`` (default ``scaling.num_workers``) worker pods of exactly the config's size,
    placed on GPU nodes, and a head that takes no training work."""
    replicas = num_workers or scaling.num_workers
    assert shape.group_name == WORKER_GROUP
    assert shape.replicas == (replicas, replicas, replicas)
    worker = shape.worker
    assert worker.container == "ray-worker"
    expected = {"cpu": f"{scaling.cpus_per_worker:g}", "memory": f"{int(scaling.memory_per_worker_gib * 1024)}Mi"}
    if scaling.use_gpu:
        expected["nvidia.com/gpu"] = str(scaling.gpus_per_worker)
    assert worker.requests == worker.limits == expected
    assert worker.shm_size == f"{int(scaling.worker_shm_gib() * 1024)}Mi"
    if scaling.use_gpu:
        assert worker.node_selector == scaling.gpu_node_selector
        assert worker.tolerations == [
            {k: v for k, v in dataclasses.asdict(t).items() if v} for t in scaling.gpu_tolerations
        ]
    else:
        assert worker.node_selector == {} and worker.tolerations == []
    head = shape.head
    assert head.container == "ray-head"
    head_expected = {"cpu": f"{scaling.head_cpus:g}", "memory": f"{int(scaling.head_memory_gib * 1024)}Mi"}
    assert head.requests == head.limits == head_expected
    assert head.shm_size is not None and head.tolerations == [] and head.node_selector == {}
    assert shape.head_start_params == {"num-cpus": "0", "num-gpus": "0"}
    # ``ray start`` and every process of the cluster inherit the platform's Ray settings from the containers; the
    # workers, which run the collectives, also the config's NCCL settings.
    assert head.env == PROCESS_ENV and worker.env == PROCESS_ENV | scaling.nccl_env
    assert head.post_start == worker.post_start == POD_HOOK_COMMAND


def _only_ray_task(spec):
    rays = [t for t in spec.tasks if t.type == "ray"]
    assert len(rays) == 1, [t.id.name for t in spec.tasks]
    return rays[0]


def test_training_pipeline_trains_on_the_rayjob_of_the_launched_config():
    """``training_pipeline``, ``nightly_training`` and every launch plan over the pipeline reach ``train`` only
    through ``train_on_ray``, whose compile sizes the RayJob (the packaging tests check nothing else does)."""
    config = TrainingConfig(scaling=GPU_SCALING)
    spec = compile_dynamic(train_on_ray, {"config": config, "data": DATA, "resume_from": None})
    (node,) = spec.nodes
    template = _only_ray_task(spec)
    assert node.task_node.reference_id.name == template.id.name == "tasks.train.train"
    # The compiled node keeps the task's retry budget and interruptibility: a retry resumes from its checkpoint.
    assert node.metadata.retries.retries == train.metadata.retries >= 1
    assert node.metadata.interruptible and template.metadata.timeout == train.metadata.timeout
    assert_sized(rayjob_shape(template.custom), GPU_SCALING)


def test_the_default_config_gets_cpu_pods_with_shared_memory_and_no_gpu_placement():
    spec = compile_dynamic(train_on_ray, {"config": TrainingConfig(), "data": DATA, "resume_from": None})
    shape = rayjob_shape(_only_ray_task(spec).custom)
    assert_sized(shape, ScalingConfig())
    assert shape.worker.shm_size == "1228Mi"  # 30% of 4 GiB: room for Ray's object store and loader processes


def _trained(tmp_path, num_parameters: int) -> TrainedModel:
    """A train output whose checkpoint holds only its metadata: the evaluation's placement reads nothing else."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    meta = ckpt.CheckpointMeta(
        model_name="gpt2-large", classes=[], input_shape=[], mean=[], std=[], epoch=1, global_step=10, config={},
        num_parameters=num_parameters,
    )  # fmt: skip
    (checkpoint / ckpt.META_FILE).write_text(json.dumps(dataclasses.asdict(meta)))
    (tmp_path / "report.html").write_text("<html></html>")
    return TrainedModel(
        checkpoint=FlyteDirectory(str(checkpoint)),
        model_name=meta.model_name,
        metrics=TrainMetrics(**{f.name: 0 for f in dataclasses.fields(TrainMetrics)}),
        tracking_uri="sqlite:///x.db",
        mlflow_run_id="run",
        mlflow_model_uri="",
        report=FlyteFile(str(tmp_path / "report.html")),
    )


def _evaluation_node(config: TrainingConfig, model: TrainedModel):
    spec = compile_dynamic(evaluate_where_it_fits, {"config": config, "data": DATA, "model": model})
    (node,) = spec.nodes
    (template,) = spec.tasks
    assert node.task_node.reference_id.name == template.id.name
    return node, template


FSDP_ON_GPUS = {"scaling": {**dataclasses.asdict(GPU_SCALING), "strategy": "fsdp"}, "data": {"num_shards": 8}}


def test_a_sharded_model_too_large_for_one_process_is_evaluated_on_the_rayjob_of_the_launched_config(tmp_path):
    """1.5 B parameters take 12 GB to gather in one process, over the default 8 GiB: ``evaluate_on_ray`` on the
    training's RayJob, its workers loading only their shards."""
    node, template = _evaluation_node(TrainingConfig.from_dict(FSDP_ON_GPUS), _trained(tmp_path, 1_500_000_000))
    assert template.id.name == "tasks.evaluate.evaluate_on_ray" and template.type == "ray"
    assert node.metadata.retries.retries == evaluate_on_ray.metadata.retries >= 1
    assert_sized(rayjob_shape(template.custom), GPU_SCALING)


def test_a_model_that_fits_is_evaluated_in_its_own_pod_on_a_gpu_node_when_the_run_trained_on_gpus(tmp_path):
    raised = {**FSDP_ON_GPUS, "evaluation": {"process_memory_gib": 16}}  # 12 GB fits in 16 GiB
    node, template = _evaluation_node(TrainingConfig.from_dict(raised), _trained(tmp_path, 1_500_000_000))
    assert template.id.name == "tasks.evaluate.evaluate" and template.type == "python-task"
    overrides = node.task_node.overrides
    requests = {r.name: r.value for r in overrides.resources.requests}
    limits = {r.name: r.value for r in overrides.resources.limits}
    assert requests == {1: "1", 3: "2Gi", 2: "1"} and limits == {1: "2", 3: "16Gi", 2: "1"}  # CPU, MEMORY, GPU
    pod = overrides.pod_template
    assert pod.primary_container_name == "primary"
    assert pod.pod_spec["nodeSelector"] == GPU_SCALING.gpu_node_selector
    assert pod.pod_spec["tolerations"] == [
        {k: v for k, v in dataclasses.asdict(t).items() if v} for t in GPU_SCALING.gpu_tolerations
    ]


def test_the_default_run_is_evaluated_in_a_cpu_pod_of_the_evaluate_tasks_size(tmp_path):
    node, template = _evaluation_node(TrainingConfig(), _trained(tmp_path, 300_000))
    assert template.id.name == "tasks.evaluate.evaluate"
    limits = {r.name: r.value for r in node.task_node.overrides.resources.limits}
    assert limits == {1: "2", 3: "8Gi"} and evaluate.metadata.retries >= 1
    assert node.task_node.overrides.pod_template is None


def test_an_elastic_run_gets_a_worker_group_of_min_workers_to_num_workers_replicas():
    """``scaling.min_workers``: KubeRay keeps at least that many worker pods, Ray Train's scaling config gets
    ``(min_workers, num_workers)`` workers and its resize interval."""
    from training_core.parallel.ray_settings import ray_scaling_config

    elastic = dataclasses.replace(GPU_SCALING, min_workers=2, elastic_resize_interval_s=45.0)
    config = TrainingConfig.from_dict(
        {"scaling": dataclasses.asdict(elastic), "data": {"num_shards": 8}, "loop": {"batch_size": 24}}
    )  # a global batch of 96 splits over 2, 3 and 4 workers
    spec = compile_dynamic(train_on_ray, {"config": config, "data": DATA, "resume_from": None})
    shape = rayjob_shape(_only_ray_task(spec).custom)
    assert shape.replicas == (4, 2, 4)
    assert_sized(dataclasses.replace(shape, replicas=(4, 4, 4)), elastic)  # the pods are those of a fixed run
    ray_scaling = ray_scaling_config(config)
    assert (ray_scaling.min_workers, ray_scaling.max_workers) == (2, 4)
    assert ray_scaling.elastic_resize_monitor_interval_s == 45.0
    fixed = ray_scaling_config(TrainingConfig.from_dict({"scaling": {"num_workers": 2, "min_workers": 2}}))
    assert fixed.num_workers == 2, "min_workers == num_workers is not elastic"


def _search_state(config: TuningConfig) -> SearchState:
    trials = [Trial(trial_id=i, params=p) for i, p in enumerate(tuning.initial_params(config))]
    return SearchState(round_index=0, trials=trials, tracking_uri="sqlite:///x.db", parent_run_id="parent")


def test_every_tuning_trial_runs_on_the_rayjob_of_the_search_base_config():
    config = TuningConfig.from_dict(
        {
            "num_trials": 3,
            "max_concurrency": 2,
            "base": {"scaling": dataclasses.asdict(GPU_SCALING), "data": {"num_shards": 8}},
        }
    )
    spec = compile_dynamic(search_round, {"config": config, "data": DATA, "state": _search_state(config)})
    tasks = {t.id.name: t for t in spec.tasks}
    trial_nodes = [n for n in spec.nodes if n.metadata.name.startswith("round-0-trial-")]
    assert len(trial_nodes) == 3
    for node in trial_nodes:
        assert_sized(rayjob_shape(tasks[node.task_node.reference_id.name].custom), GPU_SCALING)


def test_a_ray_tune_search_gets_room_for_max_concurrency_trials_of_the_base_size():
    config = TuningConfig.from_dict(
        {
            "strategy": "ray_tune",
            "num_trials": 3,
            "max_concurrency": 2,
            "base": {"scaling": dataclasses.asdict(GPU_SCALING), "data": {"num_shards": 8}},
        }
    )
    spec = compile_dynamic(search_round, {"config": config, "data": DATA, "state": _search_state(config)})
    template = _only_ray_task(spec)
    assert template.id.name == "tasks.tuning.tune_with_ray"
    assert_sized(rayjob_shape(template.custom), GPU_SCALING, num_workers=2 * GPU_SCALING.num_workers)


def test_each_scaling_point_runs_on_the_rayjob_of_its_worker_count_with_the_gpu_settings():
    base = dataclasses.replace(scaling_preset(), scaling=GPU_SCALING)
    for num_workers in (1, 4):
        config = point_config(base, model="small_cnn", num_workers=num_workers)
        spec = compile_dynamic(ray_point, {"config": config, "data": DATA})
        assert_sized(rayjob_shape(_only_ray_task(spec).custom), config.scaling)
        ray_point._wf = None


def _prep_node(spec):
    """The prep node of ``prepare``'s compiled graph, keyed on the fingerprint the uncached node before it computes
    every run, and followed by the node that says which prepared data the run uses."""
    fingerprint, prep, note = spec.nodes
    assert fingerprint.task_node.reference_id.name == fingerprint_inputs.name
    assert note.task_node.reference_id.name == note_prepared.name
    promised = {b.var: (b.binding.promise.node_id, b.binding.promise.var) for b in prep.inputs if b.binding.promise}
    assert promised == {
        "inputs_fingerprint": (fingerprint.id, "fingerprint"),
        "run_token": (fingerprint.id, "run_token"),
    }
    return prep


@pytest.mark.parametrize("source", ["image_folder", "text"])
def test_image_and_text_prep_run_on_a_rayjob_of_prep_num_workers_sized_from_the_data_config(tmp_path, source):
    """Every entry point prepares through ``prepare`` (the packaging tests check no static node runs a Ray task).
    Its compile checks that the source exists (a wrong path fails before a RayJob starts), so it is a real one."""
    if source == "text":
        for name in ("a.txt", "b.txt", "c.txt"):  # a document a file: three at least, one for each split
            (tmp_path / name).write_text("some text")
    data = DataConfig(
        dataset=source,
        path=str(tmp_path),
        image_size=224,
        prep_num_workers=6,
        prep_memory_per_worker_gib=12.0,
    )
    workload = WorkloadConfig(name="causal_lm" if source == "text" else "image_classification")
    spec = compile_dynamic(prepare, {"config": data, "workload": workload})
    node = _prep_node(spec)
    template = _only_ray_task(spec)
    assert node.task_node.reference_id.name == template.id.name == prepare_on_ray.name
    assert node.metadata.retries.retries == prepare_on_ray.metadata.retries >= 1
    assert template.metadata.discoverable  # cached as the in-process prep is
    shape = rayjob_shape(template.custom)
    assert shape.group_name == PREP_GROUP and shape.replicas == (6, 6, 6)
    assert shape.worker.requests == shape.worker.limits == {"cpu": "1", "memory": "12288Mi"}
    assert shape.worker.shm_size == f"{int(0.3 * 12 * 1024)}Mi"
    assert shape.head.requests == shape.head.limits == {"cpu": PREP_HEAD.cpu, "memory": PREP_HEAD.mem}
    assert shape.head_start_params == {"num-cpus": "0", "num-gpus": "0"}
    assert shape.head.env == shape.worker.env == PROCESS_ENV
    assert shape.head.post_start == shape.worker.post_start == POD_HOOK_COMMAND
    assert "nvidia.com/gpu" not in str(template.custom)


@pytest.mark.parametrize(
    "data, workload",
    [
        (DataConfig(), WorkloadConfig()),
        (DataConfig(dataset="cifar10", path="s3://b/c.tar.gz"), WorkloadConfig(dataset_source="my_pkg.data:load")),
    ],
    ids=["digits", "user-dataset"],
)
def test_other_sources_prepare_in_their_own_pod_without_a_ray_cluster(data, workload):
    spec = compile_dynamic(prepare, {"config": data, "workload": workload})
    node = _prep_node(spec)
    assert node.task_node.reference_id.name == prepare_data.name
    assert not [t for t in spec.tasks if t.type == "ray"]


def test_the_prep_node_is_cached_by_what_changes_the_shards_not_by_the_loader_or_the_model(tmp_path):
    """Flyte keys a cached node by its task and input values: tuning the training loader or swapping the model
    compiles the same prep node (its cached output is reused); the image size does not."""
    from training_core.config import LOADER_FIELDS

    (tmp_path / "class_0").mkdir()

    def prep_inputs(data: DataConfig, workload: WorkloadConfig):
        node = _prep_node(compile_dynamic(prepare, {"config": data, "workload": workload}))
        return node.task_node.reference_id.name, [binding.to_flyte_idl().SerializeToString() for binding in node.inputs]

    base = DataConfig(dataset="image_folder", path=str(tmp_path), image_size=32)
    loader = dataclasses.replace(
        base,
        loader_num_workers=7,
        loader_prefetch_batches=9,
        augment=False,
        augment_min_crop_scale=0.5,
        cache_dir="/elsewhere",
        cache_max_bytes=123,
    )
    assert {f for f in LOADER_FIELDS if getattr(loader, f) != getattr(base, f)} == set(LOADER_FIELDS)
    assert prep_inputs(loader, WorkloadConfig(model_factory="my_pkg.models:build")) == prep_inputs(
        base, WorkloadConfig()
    )
    larger = dataclasses.replace(base, image_size=64)
    assert prep_inputs(larger, WorkloadConfig()) != prep_inputs(base, WorkloadConfig())


def test_a_users_text_prep_pod_gets_the_configured_cpus_and_memory_and_tokenises_on_that_many_threads():
    from training_core.data.text import tokenizer_threads

    data = DataConfig(dataset="text", path="s3://b/corpus", prep_num_workers=6, prep_memory_per_worker_gib=12.0)
    workload = WorkloadConfig(name="causal_lm", dataset_source="my_pkg.data:texts")
    spec = compile_dynamic(prepare, {"config": data, "workload": workload})
    node = _prep_node(spec)
    assert node.task_node.reference_id.name == prepare_data.name
    assert not [t for t in spec.tasks if t.type == "ray"]
    resources = node.task_node.overrides.resources
    assert {r.name: r.value for r in resources.requests} == {r.name: r.value for r in resources.limits}
    assert {r.name: r.value for r in resources.requests} == {
        _Resources.ResourceName.CPU: "6",
        _Resources.ResourceName.MEMORY: "12288Mi",
    }
    with pytest.MonkeyPatch.context() as env:
        env.delenv("RAYON_NUM_THREADS", raising=False)
        tokenizer_threads(data.prep_num_workers)
        assert os.environ["RAYON_NUM_THREADS"] == "6"
        tokenizer_threads(3)  # a value already set wins
        assert os.environ["RAYON_NUM_THREADS"] == "6"


@pytest.mark.parametrize(
    "data, message",
    [
        (DataConfig(dataset="digits"), r"data.dataset='digits' is invalid: workload.name='causal_lm' reads"),
        (DataConfig(dataset="text", path="/nowhere/corpus"), r"data.path='/nowhere/corpus' is invalid: it holds no"),
    ],
    ids=["not-text", "no-text-files"],
)
def test_a_wrong_text_source_fails_the_compile_before_any_rayjob(data, message):
    with pytest.raises(Exception, match=message):
        compile_dynamic(prepare, {"config": data, "workload": WorkloadConfig(name="causal_lm")})


def test_too_few_text_files_or_an_unreadable_tokenizer_fail_the_compile_before_any_rayjob(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("some text " * 100)
    two_files = DataConfig(dataset="text", path=str(tmp_path))
    with pytest.raises(Exception, match=r"cannot be met: data.path=.* has 2 document\(s\), and the split is by"):
        compile_dynamic(prepare, {"config": two_files, "workload": WorkloadConfig(name="causal_lm")})
    (tmp_path / "c.txt").write_text("more text " * 100)
    missing = dataclasses.replace(two_files, tokenizer=str(tmp_path / "nowhere" / "tokenizer.json"))
    with pytest.raises(Exception, match=r"data.tokenizer='.*nowhere/tokenizer.json' is invalid"):
        compile_dynamic(prepare, {"config": missing, "workload": WorkloadConfig(name="causal_lm")})


def test_a_missing_image_source_fails_the_compile_before_any_rayjob(tmp_path):
    data = DataConfig(dataset="cifar10", path=str(tmp_path / "nowhere.tar.gz"))
    # flytekit wraps a user error of the task body; the message is the user's.
    with pytest.raises(Exception, match=r"data.path='.*nowhere.tar.gz' is invalid: nothing exists there"):
        compile_dynamic(prepare, {"config": data, "workload": WorkloadConfig()})
