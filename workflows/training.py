"""``training_pipeline``: prepare data -> train on Ray (DDP) -> evaluate -> register in MLflow."""

from __future__ import annotations

from typing import Optional

from flytekit import dynamic, workflow
from flytekit.types.directory import FlyteDirectory

from tasks.data import prepare
from tasks.evaluate import evaluate
from tasks.ray_config import ray_job_config
from tasks.register import register_model
from tasks.train import train
from tasks.types import PreparedData, Registration, TrainedModel
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
        Defaults train a small ResNet on sklearn digits with 2 CPU workers and a local sqlite MLflow.
    :param resume_from: Optional checkpoint directory of an earlier run (its ``train`` output ``checkpoint``)
        to continue or fine-tune from instead of starting at step 0.
    :return: The registered version and whether it became the champion, with the reason.
    """
    data = prepare(config=config.data, workload=config.workload)
    model = train_on_ray(config=config, data=data, resume_from=resume_from)
    evaluation = evaluate(data=data, model=model)
    return register_model(tracking=config.tracking, model=model, evaluation=evaluation)
