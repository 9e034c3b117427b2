"""Data at scale, measured side by side in one run: image prep in 1 and 2 Ray tasks at a time, prep memory for ten
times the images, text prep (a BPE tokenizer) in 1 and 2 Ray tasks at a time (``text_prep_efficiency_2``) and in
1 and 2 tokenizer threads without Ray (``text_prep_threads_efficiency_2``), and the loader's throughput with 1 and 2
processes (224 px JPEGs, the training augmentation) against what a ResNet-50 training step consumes on the same
machine, and beside it the machine's ceiling for that scaling: 1 and 2 independent processes that only decode and
augment (``loader_ceiling_2``).

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/data_loading.py

The last line is one JSON object (also written to ``benchmarks/results/data_loading.json``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit, start_ray, train_bpe_tokenizer  # noqa: E402

LOADER_ROUNDS = 5
TEXT_ROUNDS = 3
PREP_ROUNDS = 3


def alternating_medians(seconds: Callable[[int], float], *, rounds: int) -> dict[int, float]:
    """The median of ``seconds(1)`` and of ``seconds(2)`` over ``rounds`` rounds, run in alternating order (this
    shared machine's throughput drifts by tens of percent between seconds)."""
    values: dict[int, list[float]] = {1: [], 2: []}
    for round_index in range(rounds):
        for count in (1, 2) if round_index % 2 == 0 else (2, 1):
            values[count].append(seconds(count))
    return {count: float(np.median(times)) for count, times in values.items()}


def make_tree(root: Path, *, images: int, side: int, classes: int = 4, seed: int = 0) -> Path:
    """``images`` JPEGs of ``side`` x ``side`` pixels (photo-like noise, ~quality 90) in ``classes`` folders."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = rng.uniform(0, 255, size=(classes, 1, 1, 3))
    for i in range(images):
        c = i % classes
        (root / f"class_{c}").mkdir(parents=True, exist_ok=True)
        low = rng.normal(0, 30, size=(side // 8, side // 8, 3))
        pixels = np.clip(base[c] + np.kron(low, np.ones((8, 8, 1))) + rng.normal(0, 8, (side, side, 3)), 0, 255)
        Image.fromarray(pixels.astype(np.uint8)).save(root / f"class_{c}" / f"{i:06d}.jpg", quality=90)
    return root


def prep_seconds(tree: Path, out: Path, *, image_size: int, num_shards: int, num_workers: int):
    from training_core.config import DataConfig
    from training_core.image_shards import prepare_images

    shutil.rmtree(out, ignore_errors=True)
    cfg = DataConfig(
        dataset="image_folder",
        path=str(tree),
        image_size=image_size,
        num_shards=num_shards,
        prep_num_workers=num_workers,
    )
    start = time.perf_counter()
    prep = prepare_images(cfg, str(out))
    return time.perf_counter() - start, prep


TEXT_PREP = """
import sys, time
from training_core.config import DataConfig
from training_core.workloads.causal_lm import CausalLM

text_bytes, tokenizer, threads, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
cfg = DataConfig(
    dataset="stdlib", max_text_bytes=text_bytes, tokenizer=tokenizer, seq_len=256, num_shards=16,
    prep_num_workers=threads,
)
start = time.perf_counter()
CausalLM().prepare_data(cfg, out)
print(time.perf_counter() - start)
"""


def bpe_tokenizer(path: Path, *, vocab_size: int) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained on 1 MB of the standard library (GPT-2's kind of tokenizer)."""
    from training_core import text

    root = Path(text.stdlib_root())
    sample, files = [], iter(text.stdlib_files())
    while sum(map(len, sample)) < 1_000_000:
        sample.append((root / next(files)).read_text(errors="replace"))
    return train_bpe_tokenizer(path, sample, vocab_size=vocab_size)


def text_prep_seconds(work: Path, *, tokenizer: Path, text_bytes: int, threads: int) -> float:
    """Wall seconds of a whole text prep (read, tokenise, split, pack, write) of ``text_bytes`` of the standard
    library with ``data.prep_num_workers=threads``, in a fresh process (the tokenizer's thread pool is sized once
    per process)."""
    import os
    import subprocess

    out = work / f"text-{threads}"
    shutil.rmtree(out, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"}
    args = [sys.executable, "-c", TEXT_PREP, str(text_bytes), str(tokenizer), str(threads), str(out)]
    result = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def ray_text_prep_seconds(work: Path, *, tokenizer: Path, text_bytes: int, workers: int) -> float:
    """Wall seconds of the same text prep connected to the Ray cluster, as ``prepare_on_ray`` runs it: the ids
    encoded in Ray tasks, ``workers`` at a time, read, spilled and packed here."""
    from training_core.config import DataConfig
    from training_core.workloads.causal_lm import CausalLM

    out = work / f"ray-text-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = DataConfig(
        dataset="stdlib",
        max_text_bytes=text_bytes,
        tokenizer=str(tokenizer),
        seq_len=256,
        num_shards=16,
        prep_num_workers=workers,
    )
    start = time.perf_counter()
    CausalLM().prepare_data(cfg, str(out))
    return time.perf_counter() - start


def loader_samples_per_s(manifest, *, processes: int, batch_size: int, num_batches: int) -> float:
    from training_core.config import DataConfig
    from training_core.data import ShardStream

    stream = ShardStream(manifest, "train", rank=0, world_size=1, data=DataConfig(loader_num_workers=processes))
    batches = stream.train_batches(epoch=0, seed=0, batch_size=batch_size, num_batches=num_batches + 1)
    next(batches)  # process start-up and the first shard's read are not the steady rate
    start = time.perf_counter()
    count = sum(len(b["labels"]) for b in batches)
    return count / (time.perf_counter() - start)


def _decode_samples(shard_samples, count: int, rates) -> None:
    import torch

    torch.set_num_threads(1)  # as in a DataLoader process: the parent's OpenMP pool does not survive the fork
    start = time.perf_counter()
    for i in range(count):
        shard_samples.sample(i % len(shard_samples), epoch=0, train=True, seed=0)
    rates.put(count / (time.perf_counter() - start))


def decode_samples_per_s(manifest, *, processes: int, count: int) -> float:
    """The machine's ceiling for the loader: ``processes`` independent processes that only decode and augment
    samples of one shard (no batching, no transfer), forked with the decoders imported, their rates summed."""
    import multiprocessing

    from training_core.config import DataConfig
    from training_core.image_shards import EncodedImages, import_decoders

    import_decoders()
    shard_samples = EncodedImages.read(manifest, manifest.splits["train"].shards[0], DataConfig())
    shard_samples.sample(0, epoch=0, train=True)  # builds the transforms before the fork
    context = multiprocessing.get_context("fork")
    rates = context.Queue()
    workers = [context.Process(target=_decode_samples, args=(shard_samples, count, rates)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    total = sum(rates.get() for _ in workers)
    for worker in workers:
        worker.join()
    return total


def resnet50_images_per_s(*, batch_size: int, steps: int, threads: int) -> float:
    import torch
    import torchvision

    torch.set_num_threads(threads)
    model = torchvision.models.resnet50(num_classes=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch_size, 3, 224, 224), torch.randint(0, 4, (batch_size,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return batch_size * steps / (time.perf_counter() - start)


def fit_data_wait(tree: Path, work: Path, *, image_size: int, epochs: int) -> dict[str, float]:
    """A real ``fit`` (ResNet-18, 2 workers, the default loader settings) on the JPEG tree prepared at ``image_size``:
    the share of step time spent waiting for data, over every step and over steps after each epoch's first (whose
    wait includes starting the loader processes and reading the first shards)."""
    from training_core.config import TrainingConfig
    from training_core.trainer import fit

    data = {"dataset": "image_folder", "path": str(tree), "image_size": image_size, "num_shards": 8}
    cfg = TrainingConfig.from_dict(
        # A log window per step, to tell each epoch's first step apart; the loader settings are the defaults.
        {
            "data": data,
            "model": {"name": "resnet18"},
            "loop": {"epochs": epochs, "batch_size": 32, "log_interval_steps": 1},
        }
    )
    from training_core.config import DataConfig
    from training_core.workloads.image import ImageClassification

    ImageClassification().prepare_data(DataConfig(**data), str(work / "fit-shards"))
    result = fit(
        cfg,
        data_dir=str(work / "fit-shards"),
        checkpoint_dir=str(work / "fit-final"),
        run_name="data-wait",
        storage_path=str(work / "fit-ray"),
    )
    log = result.meta.step_log
    assert all(r.num_steps == 1 for r in log), "a window per step"
    windows = [(r.data_wait_s, r.step_time_s) for r in log]
    steady = [(r.data_wait_s, r.step_time_s) for i, r in enumerate(log) if i and log[i - 1].epoch == r.epoch]
    return {
        "data_wait_fraction": sum(w for w, _ in windows) / sum(t for _, t in windows),
        "data_wait_fraction_steady": sum(w for w, _ in steady) / sum(t for _, t in steady) if steady else float("nan"),
        "fit_step_time_s": sum(t for _, t in windows) / len(windows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=800, help="224 px JPEGs for the prep timings")
    parser.add_argument(
        "--loader-images",
        type=int,
        default=4000,
        help="224 px JPEGs for the loader timings (an epoch of several seconds: a window of a few batches is noise)",
    )
    parser.add_argument("--text-bytes", type=int, default=8_000_000, help="text of the standard library to prepare")
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="data-loading-"))
    try:
        # Text prep first, with no Ray cluster on the machine, as in a pod of its own (a user's text in prepare_data).
        tokenizer = bpe_tokenizer(work / "tokenizer.json", vocab_size=8192)
        text_prep = alternating_medians(
            lambda threads: text_prep_seconds(work, tokenizer=tokenizer, text_bytes=args.text_bytes, threads=threads),
            rounds=TEXT_ROUNDS,
        )
        start_ray(num_cpus=args.cpus)
        # Then as ``prepare`` runs it: connected to Ray, tokenising in Ray tasks, 1 or 2 at a time.
        ray_text_prep = alternating_medians(
            lambda workers: ray_text_prep_seconds(
                work, tokenizer=tokenizer, text_bytes=args.text_bytes, workers=workers
            ),
            rounds=TEXT_ROUNDS,
        )
        from training_core.data import Manifest
        from training_core.workloads.image import ImageClassification

        tree = make_tree(work / "jpegs", images=args.images, side=256)
        prep_s = alternating_medians(
            lambda workers: prep_seconds(
                tree, work / f"prep-{workers}", image_size=224, num_shards=16, num_workers=workers
            )[0],
            rounds=PREP_ROUNDS,
        )
        rss = []
        for images, shards in ((200, 4), (2000, 40)):
            small = make_tree(work / f"rss-{images}", images=images, side=64, seed=1)
            _, prep = prep_seconds(small, work / f"rss-out-{images}", image_size=64, num_shards=shards, num_workers=2)
            rss.append(max(r.peak_rss_bytes for r in prep.results))
        from training_core.config import DataConfig

        loader_tree = make_tree(work / "loader-jpegs", images=args.loader_images, side=256, seed=2)
        ImageClassification().prepare_data(
            DataConfig(dataset="image_folder", path=str(loader_tree), image_size=224, num_shards=16),
            str(work / "shards"),
        )
        manifest = Manifest.load(str(work / "shards"))
        num_batches = manifest.splits["train"].num_samples // 32 - 1  # one more is read first, untimed
        # Rounds in alternating order; the medians of each count's rates and of the per-round ratios (this shared
        # machine's throughput drifts by tens of percent between seconds).
        rates: dict[int, list[float]] = {1: [], 2: []}
        decode: dict[int, list[float]] = {1: [], 2: []}
        ratios, ceilings = [], []
        for round_index in range(LOADER_ROUNDS):
            for p in (1, 2) if round_index % 2 == 0 else (2, 1):
                rates[p].append(loader_samples_per_s(manifest, processes=p, batch_size=32, num_batches=num_batches))
                decode[p].append(decode_samples_per_s(manifest, processes=p, count=1000))
            ratios.append(rates[2][-1] / rates[1][-1])
            ceilings.append(decode[2][-1] / decode[1][-1])
        loader = {p: float(np.median(values)) for p, values in rates.items()}
        model = resnet50_images_per_s(batch_size=16, steps=3, threads=args.cpus)
        waits = fit_data_wait(tree, work, image_size=64, epochs=2)
        result = {
            "images": args.images,
            "loader_images": args.loader_images,
            "loader_samples_per_s_1": round(loader[1], 1),
            "loader_samples_per_s_2": round(loader[2], 1),
            "loader_scaling_2": round(float(np.median(ratios)), 3),
            "loader_scaling_2_rounds": [round(r, 3) for r in ratios],
            "decode_samples_per_s_1": round(float(np.median(decode[1])), 1),
            "loader_ceiling_2": round(float(np.median(ceilings)), 3),
            "loader_ceiling_2_rounds": [round(r, 3) for r in ceilings],
            "resnet50_train_images_per_s": round(model, 2),
            "consumption_ratio": round(loader[2] / model, 2),
            "data_wait_fraction": round(waits["data_wait_fraction"], 4),
            "data_wait_fraction_steady": round(waits["data_wait_fraction_steady"], 4),
            "fit_step_time_s": round(waits["fit_step_time_s"], 3),
            "prep_images_per_s_1": round(args.images / prep_s[1], 1),
            "prep_images_per_s_2": round(args.images / prep_s[2], 1),
            "prep_efficiency_2": round(prep_s[1] / prep_s[2] / 2, 3),
            "prep_rss_bytes_1x": rss[0],
            "prep_rss_bytes_10x": rss[1],
            "prep_rss_ratio_10x": round(rss[1] / rss[0], 3),
            "text_bytes": args.text_bytes,
            "text_prep_mb_per_s_1": round(args.text_bytes / 1e6 / ray_text_prep[1], 2),
            "text_prep_mb_per_s_2": round(args.text_bytes / 1e6 / ray_text_prep[2], 2),
            "text_prep_efficiency_2": round(ray_text_prep[1] / ray_text_prep[2] / 2, 3),
            "text_prep_threads_mb_per_s_1": round(args.text_bytes / 1e6 / text_prep[1], 2),
            "text_prep_threads_mb_per_s_2": round(args.text_bytes / 1e6 / text_prep[2], 2),
            "text_prep_threads_efficiency_2": round(text_prep[1] / text_prep[2] / 2, 3),
            "cpus": args.cpus,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit("data_loading", result)


if __name__ == "__main__":
    main()
