"""Overhead of our training loop inside Ray Train (1 worker) against a bare PyTorch loop.

Both train the same model on the same prepared shards, with the same batch size and thread count, in
this one run. Throughput is steady state: the first ``--warmup-steps`` steps and epoch boundaries
(validation, checkpoint) are left out of both.

Small shared machines drift by 10-20% within minutes, so the runs alternate bare, ours, bare, ours, bare,
and each of ours is compared with the mean of the bare runs just before and after it.

Ours runs as the product ships it: the Ray cluster is started as the product's Ray task starts it (the
platform's process settings, then ``ray.init`` with Ray's defaults; see ``common.start_ray``), and the bare loop
runs in this process as a user's script would. When ``RAY_ADDRESS`` is set, that cluster is used as it is.

Prints one JSON object as the last line and writes it to ``benchmarks/results/loop_overhead.json``.
Goal: ``throughput_ratio`` (ours / bare) >= 0.97.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, start_ray  # noqa: E402


def bare_loop(
    manifest_dir: str, *, model_name: str, batch_size: int, epochs: int, threads: int, warmup_steps: int, seed: int
) -> dict:
    """The textbook loop: tensors in memory, forward, backward, step."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from training_core.data import Manifest, read_shard
    from training_core.models import build_model

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    manifest = Manifest.load(manifest_dir)
    parts = [read_shard(manifest, s) for s in manifest.splits["train"].shards]
    images = torch.from_numpy(np.concatenate([p["images"] for p in parts]))
    labels = torch.from_numpy(np.concatenate([p["labels"] for p in parts]))
    mean = torch.tensor(manifest.mean).view(1, -1, 1, 1)
    std = torch.tensor(manifest.std).view(1, -1, 1, 1)
    model = build_model(model_name, num_classes=manifest.num_classes, input_shape=manifest.input_shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    steps_per_epoch = len(labels) // batch_size
    steady_time_s, steady_steps, step = 0.0, 0, 0
    for _ in range(epochs):
        order = torch.randperm(len(labels))
        epoch_images, epoch_labels = images[order], labels[order]
        last = time.perf_counter()
        for b in range(steps_per_epoch):
            x = (epoch_images[b * batch_size : (b + 1) * batch_size].float().div_(255.0) - mean) / std
            loss = F.cross_entropy(model(x), epoch_labels[b * batch_size : (b + 1) * batch_size])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            now = time.perf_counter()
            step += 1
            if step > warmup_steps:
                steady_time_s += now - last
                steady_steps += 1
            last = now
    return {"samples_per_s": steady_steps * batch_size / steady_time_s, "steps": step, "steady_steps": steady_steps}


def ours(
    manifest_dir: str,
    *,
    model_name: str,
    batch_size: int,
    epochs: int,
    threads: int,
    warmup_steps: int,
    seed: int,
    workdir: str,
) -> dict:
    from training_core.config import TrainingConfig
    from training_core.trainer import fit

    cfg = TrainingConfig.from_dict(
        {
            "data": {"dataset": "synthetic", "num_shards": 1},
            "model": {"name": model_name},
            "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0, "max_grad_norm": 0.0},
            "schedule": {"name": "constant", "warmup_steps": 0},
            "loop": {"epochs": epochs, "batch_size": batch_size, "seed": seed},
            "scaling": {"num_workers": 1, "cpus_per_worker": threads, "torch_threads_per_worker": threads},
            "precision": {"mode": "fp32"},
        }
    )
    result = fit(
        cfg,
        data_dir=manifest_dir,
        checkpoint_dir=os.path.join(workdir, "final"),
        run_name="loop-overhead",
        storage_path=os.path.join(workdir, "ray"),
        warmup_steps_excluded=warmup_steps,
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
    args = parser.parse_args()

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
        common = dict(
            model_name=args.model,
            batch_size=args.batch_size,
            epochs=args.epochs,
            threads=args.threads,
            warmup_steps=args.warmup_steps,
            seed=args.seed,
        )
        process_env = start_ray(num_cpus=max(2, args.threads))
        bare_runs = [bare_loop(data_dir, **common)["samples_per_s"]]
        ours_runs = []
        for round_index in range(args.rounds):
            ours_runs.append(ours(data_dir, workdir=os.path.join(workdir, f"round{round_index}"), **common))
            bare_runs.append(bare_loop(data_dir, **common)["samples_per_s"])
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
        "goal": ">= 0.97",
        "config": vars(args),
    }
    emit("loop_overhead", result)


if __name__ == "__main__":
    main()
