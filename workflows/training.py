"""``training_pipeline``: prepare data -> train on Ray (DDP) -> evaluate -> register in MLflow."""

from __future__ import annotations

from typing import Optional

from flytekit import workflow
from flytekit.types.directory import FlyteDirectory

from tasks.data import prepare_data
from tasks.evaluate import evaluate
from tasks.register import register_model
from tasks.train import train
from tasks.types import Registration
from training_core.config import TrainingConfig


@workflow
def training_pipeline(
    config: TrainingConfig = TrainingConfig(), resume_from: Optional[FlyteDirectory] = None
) -> Registration:
    """Train, evaluate and register a model: an image classifier by default, a language model, or user code.

    :param config: The whole run as one typed tree. ``workload``: image_classification, causal_lm, or user code
        as ``package.module:attribute`` (or a user model factory or dataset source for a built-in). ``data``:
        dataset (digits, synthetic, cifar10, image_folder; stdlib or text files for language models), path,
        split fractions, shard count, tokenizer and sequence length. ``model``: architecture (small_cnn,
        resnet18-152, vit_b_16; gpt2-tiny to gpt2-xl or a transformers config class). ``optimizer``/``schedule``:
        sgd/adam/adamw, lr, weight decay, clipping, warmup + cosine.
        ``loop``: epochs, per-worker batch size, gradient accumulation, seed. ``scaling``: Ray Train workers
        and their CPUs/GPUs/memory. ``precision``: auto/fp32/bf16/fp16. ``checkpoint``: Ray Train storage.
        ``tracking``: MLflow URI, experiment, registered model name, champion alias and promotion threshold.
        Defaults train a small ResNet on sklearn digits with 2 CPU workers and a local sqlite MLflow.
    :param resume_from: Optional checkpoint directory of an earlier run (its ``train`` output ``checkpoint``)
        to continue or fine-tune from instead of starting at step 0.
    :return: The registered version and whether it became the champion, with the reason.
    """
    data = prepare_data(config=config.data, workload=config.workload)
    model = train(config=config, data=data, resume_from=resume_from)
    evaluation = evaluate(data=data, model=model)
    return register_model(tracking=config.tracking, model=model, evaluation=evaluation)
