"""Overhead of our training loop inside Ray Train (1 worker) against a bare PyTorch loop.

Both train the same model on the same prepared shards, with the same batch size and thread count, in
this one run. Throughput is steady state: the first ``--warmup-steps`` steps and epoch boundaries
(validation, checkpoint) are left out of both.

Small shared machines drift by 10-20% within minutes, so the runs alternate bare, ours, bare, ours, bare,
and each of ours is compared with the mean of the bare runs just before and after it.

Ours runs as the product ships it: the Ray cluster is started as the product's Ray task starts it (the
platform's process settings, then ``ray.init`` with Ray's defaults; see ``common.start_ray``), and the bare loop
runs in this process as a user's script would. When ``RAY_ADDRESS`` is set, that cluster is used as it is.

The GPU fast path is measured the same way: ``--device cuda`` trains both on the GPU (images copied from pinned
host memory without blocking, the fused AdamW kernel), ``--precision bf16`` or ``fp16`` adds autocast (and a
GradScaler for fp16) to both, ``--channels-last`` converts model and images to the channels-last layout in both
(on a GPU, as ours does), ``--compile`` compiles the model in both. On a GPU both wait for the device once per log
window (``--log-interval-steps``) and at the last step. For ResNet-50 with AMP on a GPU, for example::

    python benchmarks/loop_overhead.py --device cuda --model resnet50 --image-size 224 --batch-size 128 \
        --precision bf16 --channels-last --compile --samples 8192 --threads 8

Prints one JSON object as the last line and writes it to ``benchmarks/results/loop_overhead.json``.
Goal: ``throughput_ratio`` (ours / bare) >= 0.97 on CPU, >= 0.95 on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, start_ray  # noqa: E402

if TYPE_CHECKING:
    from training_core.config import TrainingConfig

AUTOCAST = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Setup:
    """What both loops train, the same way."""

    model_name: str
    batch_size: int
    epochs: int
    threads: int
    warmup_steps: int
    seed: int
    device: str = "cpu"
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    log_interval_steps: int = 5


def bare_loop(manifest_dir: str, setup: Setup) -> dict:
    """The textbook loop: tensors in memory, forward, backward, step (on the device, with the fast-path options)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    batch_size, epochs, device, precision = setup.batch_size, setup.epochs, setup.device, setup.precision
    warmup_steps, log_interval_steps = setup.warmup_steps, setup.log_interval_steps

    from training_core.data import Manifest, read_shard
    from training_core.models import build_model

    torch.set_num_threads(setup.threads)
    torch.manual_seed(setup.seed)
    on_gpu = device == "cuda"
    manifest = Manifest.load(manifest_dir)
    parts = [read_shard(manifest, s) for s in manifest.splits["train"].shards]
    images = torch.from_numpy(np.concatenate([p["images"] for p in parts]))
    labels = torch.from_numpy(np.concatenate([p["labels"] for p in parts]))
    mean = torch.tensor(manifest.mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(manifest.std, device=device).view(1, -1, 1, 1)
    model = build_model(setup.model_name, num_classes=manifest.num_classes, input_shape=manifest.input_shape)
    layout = torch.channels_last if setup.channels_last and on_gpu else torch.contiguous_format
    model = model.to(device).to(memory_format=layout)
    if setup.compile:
        model.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=on_gpu)
    dtype = getattr(torch, AUTOCAST[precision]) if AUTOCAST[precision] else None
    scaler = torch.amp.GradScaler(device, enabled=precision == "fp16")
    steps_per_epoch = len(labels) // batch_size
    total_steps = epochs * steps_per_epoch
    steady_time_s, steady_steps, step = 0.0, 0, 0
    last = time.perf_counter()
    for _ in range(epochs):
        # The epoch's shuffle counts against its first step, as our loop's first read of an epoch does.
        order = torch.randperm(len(labels))
        epoch_images, epoch_labels = images[order], labels[order]
        if on_gpu:
            epoch_images, epoch_labels = epoch_images.pin_memory(), epoch_labels.pin_memory()
        for b in range(steps_per_epoch):
            batch = slice(b * batch_size, (b + 1) * batch_size)
            x = epoch_images[batch].to(device, non_blocking=True).float().div_(255.0)
            x = ((x - mean) / std).contiguous(memory_format=layout)
            y = epoch_labels[batch].to(device, non_blocking=True)
            with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % log_interval_steps == 0 or step == total_steps:
                loss.item()  # waits for the device, as our loop does once per log window
            now = time.perf_counter()
            if step > warmup_steps:
                steady_time_s += now - last
                steady_steps += 1
            last = now
    return {"samples_per_s": steady_steps * batch_size / steady_time_s, "steps": step, "steady_steps": steady_steps}


def ours_config(setup: Setup) -> TrainingConfig:
    """The ``TrainingConfig`` our loop trains for ``setup`` (synthetic data, one worker)."""
    from training_core.config import TrainingConfig

    return TrainingConfig.from_dict(
        {
            "data": {"dataset": "synthetic", "num_shards": 1},
            "model": {"name": setup.model_name, "channels_last": setup.channels_last, "compile": setup.compile},
            "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0, "max_grad_norm": 0.0, "fused": True},
            "schedule": {"name": "constant", "warmup_steps": 0},
            "loop": {
                "epochs": setup.epochs,
                "batch_size": setup.batch_size,
                "seed": setup.seed,
                "log_interval_steps": setup.log_interval_steps,
            },
            "scaling": {
                "num_workers": 1,
                "cpus_per_worker": setup.threads,
                "torch_threads_per_worker": setup.threads,
                "use_gpu": setup.device == "cuda",
            },
            "precision": {"mode": setup.precision},
        }
    )


def ours(manifest_dir: str, setup: Setup, *, workdir: str) -> dict:
    from training_core.runners.ray_train import fit

    result = fit(
        ours_config(setup),
        data_dir=manifest_dir,
        checkpoint_dir=os.path.join(workdir, "final"),
        run_name="loop-overhead",
        storage_path=os.path.join(workdir, "ray"),
        warmup_steps_excluded=setup.warmup_steps,
    )
    return {
        "samples_per_s": result.metrics.steady_samples_per_s,
        "steps": result.meta.global_step,
        "steady_steps": int(result.metrics.steady_steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small_cnn")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in both loops (and Ray CPUs per worker)")
    parser.add_argument("--samples", type=int, default=4096, help="synthetic dataset size")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="runs of our loop, each bracketed by bare runs")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=tuple(AUTOCAST), default="fp32", help="autocast (fp16: GradScaler)")
    parser.add_argument("--channels-last", action="store_true", help="channels-last layout (on a GPU) in both")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model in both loops")
    parser.add_argument("--log-interval-steps", type=int, default=5, help="the loop's default")
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is available on this machine")
    if args.precision == "fp16" and args.device != "cuda":
        parser.error("--precision fp16 needs --device cuda (our loop trains fp16 on a GPU only)")

    import ray

    from training_core.config import DataConfig
    from training_core.data import prepare

    with tempfile.TemporaryDirectory(prefix="loop-overhead-") as workdir:
        data_dir = os.path.join(workdir, "data")
        prepare(
            DataConfig(
                dataset="synthetic",
                synthetic_num_samples=args.samples,
                synthetic_image_size=args.image_size,
                num_shards=1,
            ),
            data_dir,
        )
        setup = Setup(
            model_name=args.model,
            batch_size=args.batch_size,
            epochs=args.epochs,
            threads=args.threads,
            warmup_steps=args.warmup_steps,
            seed=args.seed,
            device=args.device,
            precision=args.precision,
            channels_last=args.channels_last,
            compile=args.compile,
            log_interval_steps=args.log_interval_steps,
        )
        process_env = start_ray(num_cpus=max(2, args.threads), num_gpus=int(args.device == "cuda"))
        bare_runs = [bare_loop(data_dir, setup)["samples_per_s"]]
        ours_runs = []
        for round_index in range(args.rounds):
            ours_runs.append(ours(data_dir, setup, workdir=os.path.join(workdir, f"round{round_index}")))
            bare_runs.append(bare_loop(data_dir, setup)["samples_per_s"])
        ray.shutdown()

    round_ratios = [o["samples_per_s"] / ((bare_runs[i] + bare_runs[i + 1]) / 2) for i, o in enumerate(ours_runs)]
    ours_samples_per_s = sum(o["samples_per_s"] for o in ours_runs) / len(ours_runs)
    bare_samples_per_s = sum(bare_runs) / len(bare_runs)
    result = {
        "benchmark": "loop_overhead",
        "throughput_ratio": sum(round_ratios) / len(round_ratios),
        "ours_samples_per_s": ours_samples_per_s,
        "bare_samples_per_s": bare_samples_per_s,
        "round_ratios": round_ratios,
        "ours_runs_samples_per_s": [o["samples_per_s"] for o in ours_runs],
        "bare_runs_samples_per_s": bare_runs,
        "steady_steps_per_run": ours_runs[0]["steady_steps"],
        "process_env": process_env,
        "goal": ">= 0.97" if args.device == "cpu" else ">= 0.95",
        "config": vars(args),
    }
    emit("loop_overhead", result)


if __name__ == "__main__":
    main()
