"""Data at scale, measured side by side in one run: image prep in 1 and 2 Ray tasks at a time, prep memory for ten
times the images, text prep (a BPE tokenizer) in 1 and 2 Ray tasks at a time (``text_prep_efficiency_2``) and in
1 and 2 tokenizer threads without Ray (``text_prep_threads_efficiency_2``), and the loader's throughput with 1 and 2
processes (224 px JPEGs, the training augmentation) against what a ResNet-50 training step consumes on the same
machine, and beside it the machine's ceiling for that scaling: 1 and 2 independent processes that only decode and
augment (``loader_ceiling_2``), with the machine to the loader and beside an idle Ray cluster (``..._beside_idle_ray``).
ResNet-50 fed by the loader against the same model on synthetic tensors already on the device
(``resnet50_loader_ratio``; on a GPU with its utilisation, ``gpu_utilisation_with_loader``).

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/data_loading.py

The last line is one JSON object (also written to ``benchmarks/results/data_loading.json``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

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
    from training_core.data.image_shards import prepare_images

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
    from training_core.data import text

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
    from training_core.data.image_shards import EncodedImages, import_decoders

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


def loader_rounds(manifest) -> dict[str, Any]:
    """The loader's epoch with 1 and 2 processes (batches of 32) and beside it the machine's ceiling
    (:func:`decode_samples_per_s`), in :data:`LOADER_ROUNDS` rounds of alternating order: the medians of each count's
    rates and of the per-round ratios (this shared machine's throughput drifts by tens of percent between seconds)."""
    num_batches = manifest.splits["train"].num_samples // 32 - 1  # one more is read first, untimed
    rates: dict[int, list[float]] = {1: [], 2: []}
    decode: dict[int, list[float]] = {1: [], 2: []}
    ratios, ceilings = [], []
    for round_index in range(LOADER_ROUNDS):
        for p in (1, 2) if round_index % 2 == 0 else (2, 1):
            rates[p].append(loader_samples_per_s(manifest, processes=p, batch_size=32, num_batches=num_batches))
            decode[p].append(decode_samples_per_s(manifest, processes=p, count=1000))
        ratios.append(rates[2][-1] / rates[1][-1])
        ceilings.append(decode[2][-1] / decode[1][-1])
    return {
        "samples_per_s_1": round(float(np.median(rates[1])), 1),
        "samples_per_s_2": round(float(np.median(rates[2])), 1),
        "scaling_2": round(float(np.median(ratios)), 3),
        "scaling_2_rounds": [round(r, 3) for r in ratios],
        "decode_samples_per_s_1": round(float(np.median(decode[1])), 1),
        "ceiling_2": round(float(np.median(ceilings)), 3),
        "ceiling_2_rounds": [round(r, 3) for r in ceilings],
    }


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


def _sample_utilisation(gpus, done, out: list[float]) -> None:
    """NVML's utilisation of every GPU every 0.2 s into ``out`` until ``done`` is set."""
    while not done.wait(0.2):
        out.extend(r.utilization_ratio for r in gpus.read() if r.utilization_ratio is not None)


def resnet50_fed_by_loader(
    manifest, *, device_name: str, batch_size: int, steps: int, loader_processes: int, rounds: int
) -> dict[str, float | None]:
    """ResNet-50 training images/s on ``device_name`` fed by the product's loader (``ShardStream`` with
    ``loader_processes``, then the workload's copy to the device: pinned memory, non-blocking) against the same model
    on synthetic tensors already on the device, in ``rounds`` of alternating order; each timed run is ``steps`` steps
    of one epoch after an untimed first. On a GPU: channels-last, bf16 autocast, and the GPU's mean utilisation (NVML,
    sampled every 0.2 s) while the loader fed it."""
    import threading

    import torch
    import torchvision

    from training_core.config import DataConfig
    from training_core.data import ShardStream
    from training_core.telemetry.gpu import NvmlGpus
    from training_core.workloads.image import ImageClassification

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    model = torchvision.models.resnet50(num_classes=manifest.num_classes).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    to_device = ImageClassification().to_device(manifest, device)

    def step(inputs, targets) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = torch.nn.functional.cross_entropy(
                model(inputs.contiguous(memory_format=torch.channels_last)), targets
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def timed(batches) -> float:
        step(*next(batches))  # the loader's start and first shards, or the first step's allocations: not timed
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step(*next(batches))
        if cuda:
            torch.cuda.synchronize()
        return batch_size * steps / (time.perf_counter() - start)

    def synthetic():
        inputs = torch.randn(batch_size, 3, 224, 224, device=device)
        targets = torch.randint(0, manifest.num_classes, (batch_size,), device=device)
        while True:
            yield inputs, targets

    def loader():
        stream = ShardStream(
            manifest, "train", rank=0, world_size=1, data=DataConfig(loader_num_workers=loader_processes)
        )
        batches = stream.train_batches(epoch=0, seed=0, batch_size=batch_size, num_batches=steps + 1)
        return (to_device(batch) for batch in batches)

    gpus = NvmlGpus.open() if cuda else None
    utilisation: list[float] = []
    rates: dict[str, list[float]] = {"synthetic": [], "loader": []}
    for round_index in range(rounds):
        for source in ("synthetic", "loader") if round_index % 2 == 0 else ("loader", "synthetic"):
            done = threading.Event()
            sampler = threading.Thread(target=_sample_utilisation, args=(gpus, done, utilisation), daemon=True)
            if source == "loader" and gpus is not None:
                sampler.start()
            rates[source].append(timed(synthetic() if source == "synthetic" else loader()))
            done.set()
            if sampler.is_alive():
                sampler.join()
    if gpus is not None:
        gpus.close()
    ratios = [loaded / synthetic for loaded, synthetic in zip(rates["loader"], rates["synthetic"])]
    return {
        "resnet50_synthetic_images_per_s": float(np.median(rates["synthetic"])),
        "resnet50_loader_images_per_s": float(np.median(rates["loader"])),
        "resnet50_loader_ratio": float(np.median(ratios)),
        "gpu_utilisation_with_loader": float(np.mean(utilisation)) if utilisation else None,
    }


def fit_data_wait(tree: Path, work: Path, *, image_size: int, epochs: int) -> dict[str, float]:
    """A real ``fit`` (ResNet-18, 2 workers, the default loader settings) on the JPEG tree prepared at ``image_size``:
    the share of step time spent waiting for data, over every step and over steps after each epoch's first (whose
    wait includes starting the loader processes and reading the first shards)."""
    from training_core.config import TrainingConfig
    from training_core.runners.ray_train import fit

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
    parser.add_argument(
        "--gpu-images",
        type=int,
        default=16_000,
        help="224 px JPEGs for ResNet-50 on a GPU fed by the loader (an epoch of several seconds at GPU speed)",
    )
    parser.add_argument(
        "--gpu-loader-processes",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 2),
        help="loader processes feeding the GPU (data.loader_num_workers; the default leaves the step's process a core)",
    )
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
        import torch

        if torch.cuda.is_available():  # prepared while the Ray cluster is up, as every prep here
            gpu_tree = make_tree(work / "gpu-jpegs", images=args.gpu_images, side=256, seed=3)
            ImageClassification().prepare_data(
                DataConfig(dataset="image_folder", path=str(gpu_tree), image_size=224, num_shards=64),
                str(work / "gpu-shards"),
            )
            fed_manifest = Manifest.load(str(work / "gpu-shards"))
            fed = {"device_name": "cuda", "batch_size": 128, "loader_processes": args.gpu_loader_processes}
            fed.update(rounds=3, steps=min(50, fed_manifest.splits["train"].num_samples // 128 - 1))
        else:  # the same comparison on the CPU, where the loader's processes share the cores with the step
            fed_manifest = manifest
            fed = {"device_name": "cpu", "batch_size": 16, "loader_processes": 2, "rounds": 2, "steps": 3}
        beside_ray = loader_rounds(manifest)
        import ray

        ray.shutdown()  # the machine to the loader alone; ``fit`` below starts a local cluster again
        alone = loader_rounds(manifest)
        model = resnet50_images_per_s(batch_size=16, steps=3, threads=args.cpus)
        fed_result = resnet50_fed_by_loader(fed_manifest, **fed)
        waits = fit_data_wait(tree, work, image_size=64, epochs=2)
        result = {
            "images": args.images,
            "loader_images": args.loader_images,
            # The loader with the machine to itself, then beside the benchmark's idle Ray cluster (its daemons and
            # idle workers wake up on their own: they take from the 2 processes more than from 1).
            **{f"loader_{key}": value for key, value in alone.items()},
            **{f"loader_{key}_beside_idle_ray": value for key, value in beside_ray.items()},
            "resnet50_train_images_per_s": round(model, 2),
            "consumption_ratio": round(alone["samples_per_s_2"] / model, 2),
            **{key: value if value is None else round(value, 3) for key, value in fed_result.items()},
            "resnet50_fed": fed,
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
