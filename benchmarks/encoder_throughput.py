"""BERT sequence-classification throughput: our loop inside Ray Train (1 worker) against a bare PyTorch loop, and what
LoRA costs and saves.

Both train the same encoder (the ``sequence_classification`` workload's ``--size``, BERT-base by default, randomly
initialised from the same seed) on the same prepared data, with the same sequence length, batch size, optimizer
(AdamW), thread count and precision, in this one run. The data is synthetic labelled text: texts of random words,
longer than ``--seq-len`` tokens so that every sample fills the sequence, two classes marked by words of their own,
tokenised by a WordPiece ``tokenizer.json`` of BERT's 30,522 tokens trained on the same text (so the embeddings are
BERT-base's size). The bare loop is the textbook one written here: the samples in memory, the ``transformers``
model itself (no wrapper), attention mask from the padding, cross-entropy, backward, step, the loss read once per log
window (as ours reads it). It runs in a fresh process, as a Ray Train worker does, so neither inherits the other's
heap.

Throughput is steady state, timed the same way on both sides: a step's time runs from the previous step's end, the
first ``--warmup-steps`` steps are left out, and so are epoch boundaries (validation, checkpoint). Ours is the run's
records' ``steady_samples_per_s``.

Small shared machines drift by 10-20% within minutes, so the runs alternate bare, ours, ours with LoRA, bare, ours,
ours with LoRA, ..., bare; each of ours is compared with the mean of the bare runs just before and after it, and
``throughput_ratio`` is the median of those round ratios (``sequences_per_s``: the median of our runs).

LoRA is measured with our loop (``model.lora``: ``--lora-rank``, ``--lora-alpha``, ``--lora-targets``; the
classifier head trains in full): ``lora_step_time_ratio`` is the median over rounds of LoRA's steady step time over
the full fine-tuning run's in the same round; ``lora_checkpoint_ratio`` the bytes of the LoRA run's final checkpoint
(its adapters, the head and their optimizer state) over the full run's (every weight and its optimizer state).

``--device auto`` (the default) trains on a GPU when there is one: then, unless given, ``--size`` is ``bert-large``,
``--seq-len`` 128 and the precision bf16, and the result reports sequences/s beside the requirements' anchor (more
than 200 sequences/s on 4 V100s, about 50 per GPU). Without a GPU ``--device cuda`` falls back to the CPU with a
warning. On a 2-core CPU BERT-base takes seconds a step: ``--quick`` runs BERT-small at sequence length 64 for a
run of a minute or two.

The benchmark starts its own Ray cluster as the product does (``common.start_ray``; ``RAY_TMPDIR`` and ``TMPDIR`` in
a temporary directory), or uses ``RAY_ADDRESS``'s as it is. Prints one JSON object as the last line and writes it to
``benchmarks/results/encoder_throughput.json``. Goals: ``throughput_ratio`` >= 0.97, ``lora_step_time_ratio`` <= 1.0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import string
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, start_ray  # noqa: E402

BERT_VOCAB_SIZE = 30_522
"""BERT's WordPiece vocabulary (bert-base-uncased): the tokenizer trained here has this many tokens."""
ANCHOR = {"sequences_per_s_4_v100": 200, "sequences_per_s_per_gpu": 50, "model": "bert-large", "seq_len": 128}
"""The requirements' BERT-Large anchor: more than 200 sequences/s on 4 V100s, about 50 per GPU."""
QUICK = {"size": "bert-small", "seq_len": 64, "batch_size": 8, "steps": 12, "warmup_steps": 3, "rounds": 2}
"""``--quick``: a run of a minute or two on a 2-core CPU."""
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_corpus(path: Path, *, samples: int, words_per_text: int, seed: int) -> tuple[list[str], list[str]]:
    """``samples`` JSONL records of ``words_per_text`` random lowercase words out of 40,000, labelled ``a`` or ``b``
    by marker words of their own mixed in. Returns the texts and the 40,000 words (the tokenizer learns them all, so
    WordPiece fills BERT's vocabulary however few the texts)."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))) for _ in range(40_000)]
    markers = {"a": words[:50], "b": words[50:100]}
    texts = []
    with open(path, "w", encoding="utf-8") as f:
        for index in range(samples):
            label = "ab"[index % 2]
            text = rng.choices(words, k=words_per_text)
            for position in rng.sample(range(words_per_text), 4):
                text[position] = rng.choice(markers[label])
            texts.append(" ".join(text))
            f.write(json.dumps({"text": texts[-1], "label": label}) + "\n")
    return texts, words


def write_tokenizer(path: Path, texts: list[str]) -> Path:
    """A BERT-style WordPiece ``tokenizer.json`` (lower-casing, ``[PAD]`` = 0) of :data:`BERT_VOCAB_SIZE` tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=BERT_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return path


def training_config(args: argparse.Namespace, *, data_path: str, tokenizer: str, lora: bool) -> dict[str, Any]:
    """The run both loops train, as a config mapping (what ``fit`` gets; the bare loop reads the same fields)."""
    model: dict[str, Any] = {"name": args.size}
    if lora:
        model["lora"] = {"enabled": True, "rank": args.lora_rank, "alpha": args.lora_alpha,
                         "target_modules": args.lora_targets}  # fmt: skip
    return {
        "workload": {"name": "sequence_classification"},
        "data": {
            "dataset": "labeled_text",
            "path": data_path,
            "tokenizer": tokenizer,
            "seq_len": args.seq_len,
            "num_shards": 1,
            "val_fraction": 0.02,
            "test_fraction": 0.02,
        },
        "model": model,
        "optimizer": {"name": "adamw", "lr": 1e-4, "weight_decay": 0.0, "max_grad_norm": 0.0},
        "schedule": {"name": "constant", "warmup_steps": 0},
        "loop": {
            "epochs": args.steps,  # enough that --steps, not the epoch count, ends every run
            "batch_size": args.batch_size,
            "max_steps": args.steps,
            "log_interval_steps": args.log_interval_steps,
            "seed": args.seed,
        },
        "scaling": {
            "num_workers": 1,
            "cpus_per_worker": args.threads,
            "torch_threads_per_worker": args.threads,
            "use_gpu": args.device == "cuda",
        },
        "precision": {"mode": args.precision},
    }


def bare_loop(config: dict[str, Any], data_dir: str, warmup_steps: int) -> dict[str, Any]:
    """The textbook loop on the ``transformers`` encoder the workload builds, in this (fresh) process."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from training_core.config import TrainingConfig
    from training_core.data import Manifest, read_shard
    from training_core.workloads.sequence_classification import LabeledTextSpec, new_encoder

    cfg = TrainingConfig.from_dict(config)
    device = torch.device("cuda" if cfg.scaling.use_gpu else "cpu")
    autocast_dtype = torch.bfloat16 if cfg.precision.mode == "bf16" else None
    torch.set_num_threads(cfg.scaling.torch_threads_per_worker)
    torch.manual_seed(cfg.loop.seed)
    manifest = Manifest.load(data_dir)
    pad_id = LabeledTextSpec.from_manifest(manifest).pad_id
    shards = [read_shard(manifest, s) for s in manifest.splits["train"].shards]
    input_ids = torch.from_numpy(np.concatenate([s["input_ids"] for s in shards])).long()
    labels = torch.from_numpy(np.concatenate([s["labels"] for s in shards])).long()
    model = new_encoder(cfg, manifest).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    # On a GPU the fused kernel, as our loop builds it there (optimizer.fused).
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay, fused=device.type == "cuda"
    )
    batch_size, total_steps, log_every = cfg.loop.batch_size, cfg.loop.max_steps, cfg.loop.log_interval_steps
    steady_step_times_s: list[float] = []
    step = 0
    while step < total_steps:
        order = torch.randperm(len(labels))
        last = time.perf_counter()
        for b in range(min(len(labels) // batch_size, total_steps - step)):
            index = order[b * batch_size : (b + 1) * batch_size]
            ids = input_ids[index].to(device, non_blocking=True)
            targets = labels[index].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                logits = model(input_ids=ids, attention_mask=(ids != pad_id).long()).logits
            loss = F.cross_entropy(logits.float(), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % log_every == 0 or step == total_steps:
                loss.item()  # waits for the device, as our loop does once per window
            now = time.perf_counter()
            if step > warmup_steps:
                steady_step_times_s.append(now - last)
            last = now
    return {
        "sequences_per_s": len(steady_step_times_s) * batch_size / sum(steady_step_times_s),
        "step_time_p50_s": float(np.percentile(steady_step_times_s, 50)),
        "steps": step,
        "steady_steps": len(steady_step_times_s),
        "parameters": parameters,
    }


def run_bare(config: dict[str, Any], data_dir: str, warmup_steps: int) -> dict[str, Any]:
    """:func:`bare_loop` in a fresh process (spawned: nothing of this one's heap, threads or CUDA state)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(bare_loop, config, data_dir, warmup_steps).result()


def directory_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def run_ours(config: dict[str, Any], data_dir: str, warmup_steps: int, *, workdir: str) -> dict[str, Any]:
    """``fit`` of the same config: our loop in one Ray Train worker; with the bytes of its final checkpoint."""
    from training_core.config import TrainingConfig
    from training_core.runners.ray_train import fit

    result = fit(
        TrainingConfig.from_dict(config),
        data_dir=data_dir,
        checkpoint_dir=os.path.join(workdir, "final"),
        run_name="encoder-throughput",
        storage_path=os.path.join(workdir, "ray"),
        warmup_steps_excluded=warmup_steps,
    )
    m = result.metrics
    return {
        "sequences_per_s": m.steady_samples_per_s,
        "step_time_p50_s": m.step_time_p50_s,
        "steps": result.meta.global_step,
        "steady_steps": int(m.steady_steps),
        "checkpoint_bytes": directory_bytes(result.checkpoint_dir),
    }


def resolve_device(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--size``, ``--seq-len`` and ``--precision`` settled in place: the GPU's BERT-Large defaults,
    ``--quick``'s, or BERT-base's on a CPU; ``cuda`` without a GPU falls back to the CPU with a warning."""
    import torch

    gpu = torch.cuda.is_available()
    if args.device == "cuda" and not gpu:
        warnings.warn("--device cuda: no GPU is available; measuring on the CPU", stacklevel=1)
    args.device = "cuda" if args.device in ("auto", "cuda") and gpu else "cpu"
    defaults = QUICK if args.quick else {"size": "bert-base", "seq_len": 128, "batch_size": 8, "steps": 20,
                                          "warmup_steps": 4, "rounds": 3}  # fmt: skip
    if args.device == "cuda":
        defaults = {"size": ANCHOR["model"], "seq_len": ANCHOR["seq_len"], "batch_size": 32, "steps": 60,
                    "warmup_steps": 10, "rounds": 3}  # fmt: skip
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.precision == "auto":
        args.precision = "bf16" if args.device == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps={args.warmup_steps} leaves no steady steps of --steps={args.steps}")


def parse_args() -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    from training_core.registry import ENCODER_SIZES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=tuple(ENCODER_SIZES), help="default bert-base (bert-large on a GPU)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence; default 128 (64 with --quick)")
    parser.add_argument("--batch-size", type=int, help="sequences per step; default 8 (32 on a GPU)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run; default 20 (12 with --quick, 60 on a GPU)")
    parser.add_argument("--warmup-steps", type=int, help="steps left out of the steady state; default 4")
    parser.add_argument("--rounds", type=int, help="runs of our loop (full and LoRA), each bracketed by bare runs")
    parser.add_argument("--quick", action="store_true", help="bert-small at 64 tokens, 12 steps, 2 rounds")
    parser.add_argument("--log-interval-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in both loops (and Ray CPUs per worker)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto", help="auto: bf16 on a GPU")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--lora-targets", nargs="+", default=["query", "value"], help="model.lora.target_modules")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    resolve_device(args, parser)
    return args, parser


def measure(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Prepare the data, then the alternating runs; the figures of every run."""
    import ray

    from training_core.config import TrainingConfig
    from training_core.data import prepare
    from training_core.workloads.sequence_classification import LabeledTextSpec

    # Enough training samples that --steps end inside the first epoch (no validation between steady steps).
    samples = int((args.steps + 2) * args.batch_size / 0.96) + 8
    texts, words = write_corpus(Path(root, "rows.jsonl"), samples=samples, words_per_text=args.seq_len, seed=args.seed)
    tokenizer = str(write_tokenizer(Path(root, "tokenizer.json"), texts + words))
    full = training_config(args, data_path=str(Path(root, "rows.jsonl")), tokenizer=tokenizer, lora=False)
    lora = training_config(args, data_path=str(Path(root, "rows.jsonl")), tokenizer=tokenizer, lora=True)
    data_dir = os.path.join(root, "data")
    cfg = TrainingConfig.from_dict(full)
    manifest = prepare(cfg.data, data_dir, workload=cfg.workload)
    process_env = start_ray(num_cpus=max(2, args.threads), num_gpus=int(args.device == "cuda"))
    bare_runs = [run_bare(full, data_dir, args.warmup_steps)]
    ours_runs, lora_runs = [], []
    for round_index in range(args.rounds):
        workdir = os.path.join(root, f"round{round_index}")
        ours_runs.append(run_ours(full, data_dir, args.warmup_steps, workdir=workdir))
        lora_runs.append(run_ours(lora, data_dir, args.warmup_steps, workdir=workdir + "-lora"))
        bare_runs.append(run_bare(full, data_dir, args.warmup_steps))
        print(
            f"round {round_index}: ours {ours_runs[-1]['sequences_per_s']:.2f} sequences/s, LoRA "
            f"{lora_runs[-1]['sequences_per_s']:.2f}, bare {bare_runs[-2]['sequences_per_s']:.2f} then "
            f"{bare_runs[-1]['sequences_per_s']:.2f}",
            flush=True,
        )
    ray.shutdown()
    return {
        "bare": bare_runs,
        "ours": ours_runs,
        "lora": lora_runs,
        "process_env": process_env,
        "train_sequences": manifest.splits["train"].num_samples,
        "vocab_size": LabeledTextSpec.from_manifest(manifest).vocab_size,
    }


def summarise(args: argparse.Namespace, runs: dict[str, Any]) -> dict[str, Any]:
    ours_sps = [o["sequences_per_s"] for o in runs["ours"]]
    lora_sps = [o["sequences_per_s"] for o in runs["lora"]]
    bare_sps = [b["sequences_per_s"] for b in runs["bare"]]
    round_ratios = [o / ((bare_sps[i] + bare_sps[i + 1]) / 2) for i, o in enumerate(ours_sps)]
    # Steady step time is batch / sequences per s: LoRA's over the full run's in the same round.
    lora_step_ratios = [full / adapted for full, adapted in zip(ours_sps, lora_sps)]
    checkpoint_ratios = [a["checkpoint_bytes"] / f["checkpoint_bytes"] for f, a in zip(runs["ours"], runs["lora"])]
    sequences_per_s = statistics.median(ours_sps)
    result = {
        "benchmark": "encoder_throughput",
        "throughput_ratio": statistics.median(round_ratios),
        "sequences_per_s": sequences_per_s,
        "lora_step_time_ratio": statistics.median(lora_step_ratios),
        "lora_checkpoint_ratio": statistics.median(checkpoint_ratios),
        "bare_sequences_per_s": statistics.median(bare_sps),
        "lora_sequences_per_s": statistics.median(lora_sps),
        "round_ratios": round_ratios,
        "round_lora_step_time_ratios": lora_step_ratios,
        "ours_runs_sequences_per_s": ours_sps,
        "lora_runs_sequences_per_s": lora_sps,
        "bare_runs_sequences_per_s": bare_sps,
        "full_checkpoint_bytes": runs["ours"][0]["checkpoint_bytes"],
        "lora_checkpoint_bytes": runs["lora"][0]["checkpoint_bytes"],
        "parameters": runs["bare"][0]["parameters"],
        "steady_steps_per_run": runs["ours"][0]["steady_steps"],
        "train_sequences": runs["train_sequences"],
        "vocab_size": runs["vocab_size"],
        "process_env": runs["process_env"],
        "goal": {"throughput_ratio": ">= 0.97", "lora_step_time_ratio": "<= 1.0"},
        "config": vars(args),
    }
    if args.device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
        result["anchor"] = ANCHOR
        result["sequences_per_s_over_anchor_per_gpu"] = sequences_per_s / ANCHOR["sequences_per_s_per_gpu"]
    return result


def main() -> None:
    args, _ = parse_args()
    root = tempfile.mkdtemp(prefix="encoder-throughput-")
    # Ray's session files and sockets, and every temporary file of this run, in one directory removed at the end.
    os.environ.update(TMPDIR=root, RAY_TMPDIR=root)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tempfile.tempdir = root
    load_before = os.getloadavg()
    try:
        runs = measure(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = summarise(args, runs)
    result["load_average_1m_before_after"] = [load_before[0], os.getloadavg()[0]]
    emit("encoder_throughput", result)


if __name__ == "__main__":
    main()
