"""``training_pipeline``: prepare data -> train on Ray (DDP or FSDP) -> evaluate where the model fits -> register in
MLflow."""

from __future__ import annotations

from typing import Optional

from flytekit import Resources, dynamic, workflow
from flytekit.types.directory import FlyteDirectory

from tasks.artifacts import artifact_location
from tasks.data import prepare
from tasks.evaluate import evaluate, evaluate_on_ray
from tasks.ray_config import gpu_task_pod_template, ray_job_config
from tasks.register import register_model
from tasks.train import train
from tasks.types import Evaluation, PreparedData, Registration, TrainedModel
from training_core.config import TrainingConfig


# A dynamic node only compiles its graph; the train node it compiles carries its own timeout and retries.
@dynamic(interruptible=True)
def train_on_ray(
    config: TrainingConfig, data: PreparedData, resume_from: Optional[FlyteDirectory] = None
) -> TrainedModel:
    """``train`` on a RayJob sized from the config this execution was launched with.

    A static workflow node would serialize with the RayJob of the default config whatever config a launch
    (FlyteConsole's form, a launch plan, FlyteRemote) passes, and a job asking for more workers or GPUs than that
    RayJob has never starts. Compiled at run time, the node's RayJob takes ``config.scaling``: worker replicas,
    CPUs, GPUs, memory, ``/dev/shm``, GPU node selector and tolerations.

    :param config: The run; ``scaling`` sizes the RayJob.
    :param data: Prepared shards from ``prepare_data``.
    :param resume_from: Optional checkpoint directory of an earlier run to continue from.
    :return: The trained model, its checkpoint and its metrics.
    """
    return train(config=config, data=data, resume_from=resume_from).with_overrides(
        task_config=ray_job_config(config.scaling)
    )


@dynamic(interruptible=True)
def evaluate_where_it_fits(config: TrainingConfig, data: PreparedData, model: TrainedModel) -> Evaluation:
    """``evaluate`` in a task's own process, or ``evaluate_on_ray`` on a RayJob sized like training's, as
    ``config.evaluation`` places it for this model (its parameter count is read from the checkpoint's metadata,
    not its weights). In a process, the pod's memory limit is ``evaluation.process_memory_gib``, and it gets a GPU
    when ``scaling.use_gpu`` (on the GPU nodes of ``scaling.gpu_node_selector``).

    :param config: The run; ``evaluation`` places the evaluation, ``scaling`` sizes it.
    :param data: Prepared shards; the ``test`` split is used.
    :param model: The trained model from ``train``.
    :return: Test metrics and the evaluation report.
    """
    from training_core.checkpoint import load_meta
    from training_core.evaluation import evaluation_placement

    meta = load_meta(artifact_location(model.checkpoint))
    if evaluation_placement(config, meta.num_parameters) == "cluster":
        return evaluate_on_ray(config=config, data=data, model=model).with_overrides(
            task_config=ray_job_config(config.scaling)
        )
    memory, gpu = f"{config.evaluation.process_memory_gib:g}Gi", {"gpu": "1"} if config.scaling.use_gpu else {}
    return evaluate(data=data, model=model).with_overrides(
        requests=Resources(cpu="1", mem="2Gi", **gpu),
        limits=Resources(cpu="2", mem=memory, **gpu),
        **({"pod_template": gpu_task_pod_template(config.scaling)} if config.scaling.use_gpu else {}),
    )


@workflow
def training_pipeline(
    config: TrainingConfig = TrainingConfig(), resume_from: Optional[FlyteDirectory] = None
) -> Registration:
    """Train, evaluate and register a model: an image classifier by default, a language model, or user code.

    :param config: The whole run as one typed tree. ``workload``: image_classification, causal_lm, or user code
        as ``package.module:attribute`` (or a user model factory or dataset source for a built-in). ``data``:
        dataset (digits, synthetic, cifar10, image_folder; stdlib or text files for language models), path,
        split fractions, shard count, tokenizer and sequence length. ``model``: architecture (small_cnn,
        resnet18-152, vit_b_16; gpt2-tiny to gpt2-xl or a transformers config class) and activation
        checkpointing. ``optimizer``/``schedule``: sgd/adam/adamw, lr, weight decay, clipping, warmup + cosine.
        ``loop``: epochs, per-worker batch size, gradient accumulation, seed. ``scaling``: Ray Train workers,
        their CPUs/GPUs/memory, and the strategy (ddp replicas or fsdp shards). ``sync``: gradient all-reduce or
        local SGD. ``precision``: auto/fp32/bf16/fp16. ``checkpoint``: Ray Train storage.
        ``tracking``: MLflow URI, experiment, registered model name, champion alias and promotion threshold.
        ``evaluation``: where the test split is evaluated (the evaluate task's process, on a GPU when training used
        GPUs, or Ray workers holding the FSDP shards of a model too large for one process).
        Defaults train a small ResNet on sklearn digits with 2 CPU workers and a local sqlite MLflow.
    :param resume_from: Optional checkpoint directory of an earlier run (its ``train`` output ``checkpoint``)
        to continue or fine-tune from instead of starting at step 0.
    :return: The registered version and whether it became the champion, with the reason.
    """
    data = prepare(config=config.data, workload=config.workload)
    model = train_on_ray(config=config, data=data, resume_from=resume_from)
    evaluation = evaluate_where_it_fits(config=config, data=data, model=model)
    return register_model(tracking=config.tracking, model=model, evaluation=evaluation)
