"""Language-model training throughput: our loop inside Ray Train (1 worker) against a bare PyTorch loop, and MFU.

Both train the same GPT (the ``causal_lm`` workload's ``--model``, built by the workload for both) on the same
prepared text (the Python standard library's source, byte-level tokens, at most ``--max-text-bytes`` of it), with
the same sequence length, batch size, optimizer, thread count and precision, in this one run. The bare loop is
the textbook one written here: the training sequences in memory, forward, cross-entropy, backward, step, the loss
read once per log window (as ours reads it). It runs in a fresh process, as a Ray Train worker does, so neither
inherits the other's heap.

Throughput is steady state, timed the same way on both sides: a step's time runs from the previous step's end, the
first ``--warmup-steps`` steps are left out, and so are epoch boundaries (validation, checkpoint). Ours is the
run's records' ``steady_samples_per_s`` times the tokens per sample. On a GPU both sides wait for the device once
per log window only (``loop.log_interval_steps``) and at the last step.

Small shared machines drift by 10-20% within minutes, so the runs alternate bare, ours, bare, ours, ..., bare;
each of ours is compared with the mean of the bare runs just before and after it, and ``throughput_ratio`` is the
median of those round ratios. ``tokens_per_s`` is the median of our runs. ``step_time_p50_ratio`` makes the same
comparison with each run's median step time (bare over ours): a gap in both is a slower step, a gap in the throughput
alone is a few slow steps (another process on the machine, a garbage collection).

Model FLOPs per token (forward and backward), after PaLM (Chowdhery et al. 2022, appendix B)::

    6 * N + 12 * L * T * H

with ``N`` the parameters that take part in matrix multiplies (all of them but embedding tables that are only
looked up: the position embeddings, and the token embeddings unless the output layer shares them), ``L`` the
layers, ``T`` the sequence length and ``H`` the hidden size: ``6 N`` is the weights' multiply-adds (2 forward, 4
backward), ``12 L T H`` the attention scores and their weighted sum (2 matrix products of ``T x H`` per layer
and token, 2 FLOPs a multiply-add, 3x for backward), counted over the full ``T x T`` square although the mask is
causal. ``mfu`` = model FLOPs/s over the machine's peak matmul FLOP/s, measured in this run: the best of
``--peak-repeats`` timings of a ``--peak-size`` square ``torch.matmul`` (fp32 on CPU, bf16 on a GPU) with the
same thread count, before the first training run and after the last.

``--device cuda`` trains on the GPU (Ray Train with ``use_gpu``) with bf16 autocast where the GPU supports it, and
the fused AdamW kernel in both loops; without a GPU it falls back to the CPU with a warning. ``--compile`` compiles
the model in both (``model.compile`` in ours); compiling happens in the warm-up steps, which are left out. The
benchmark starts its own Ray cluster as the product does (``common.start_ray``; ``RAY_TMPDIR`` and ``TMPDIR`` in a
temporary directory), or uses ``RAY_ADDRESS``'s as it is.

Prints one JSON object as the last line and writes it to ``benchmarks/results/lm_throughput.json``.
Goal: ``throughput_ratio`` (ours / bare, tokens/s) >= 0.97.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, start_ray  # noqa: E402


def training_config(args: argparse.Namespace, *, device: str, precision: str) -> dict[str, Any]:
    """The run both loops train, as a config mapping (what ``fit`` gets; the bare loop reads the same fields)."""
    return {
        "workload": {"name": "causal_lm"},
        "data": {
            "dataset": "stdlib",
            "max_text_bytes": args.max_text_bytes,
            "seq_len": args.seq_len,
            "tokenizer": "byte",
            "num_shards": 1,
            "val_fraction": 0.05,
            "test_fraction": 0.05,
        },
        "model": {"name": args.model, "compile": args.compile},
        "optimizer": {"name": "adamw", "lr": 3e-4, "weight_decay": 0.0, "max_grad_norm": 0.0},
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
            "use_gpu": device == "cuda",
        },
        "precision": {"mode": precision},
    }


def model_figures(model: Any, *, seq_len: int) -> dict[str, float]:
    """Parameters, the parameters that take part in matrix multiplies, and model FLOPs per token (see above)."""
    from torch import nn

    parameters = sum(p.numel() for p in model.parameters())
    multiplied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    looked_up = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding) and id(m.weight) not in multiplied
    )
    config = next(m.config for m in model.modules() if hasattr(getattr(m, "config", None), "num_hidden_layers"))
    layers, hidden = int(config.num_hidden_layers), int(config.hidden_size)
    flop_parameters = parameters - looked_up
    return {
        "parameters": parameters,
        "flop_parameters": flop_parameters,
        "num_layers": layers,
        "hidden_size": hidden,
        "model_flops_per_token": 6 * flop_parameters + 12 * layers * seq_len * hidden,
    }


def bare_loop(config: dict[str, Any], data_dir: str, warmup_steps: int) -> dict[str, Any]:
    """The textbook loop on the GPT the workload builds, in this (fresh) process."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from training_core.config import TrainingConfig
    from training_core.data import Manifest, read_shard
    from training_core.workloads import resolve_workload

    cfg = TrainingConfig.from_dict(config)
    device = torch.device("cuda" if cfg.scaling.use_gpu else "cpu")
    autocast_dtype = torch.bfloat16 if cfg.precision.mode == "bf16" else None
    torch.set_num_threads(cfg.scaling.torch_threads_per_worker)
    torch.manual_seed(cfg.loop.seed)
    manifest = Manifest.load(data_dir)
    sequences = torch.from_numpy(
        np.concatenate([read_shard(manifest, s)["tokens"] for s in manifest.splits["train"].shards])
    ).long()
    model = resolve_workload(cfg.workload).build_model(cfg, manifest).to(device)
    figures = model_figures(model, seq_len=cfg.data.seq_len)
    if cfg.model.compile:
        model.compile()
    # On a GPU the fused kernel, as our loop builds it there (optimizer.fused).
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay, fused=device.type == "cuda"
    )
    batch_size, total_steps, log_every = cfg.loop.batch_size, cfg.loop.max_steps, cfg.loop.log_interval_steps
    steady_step_times_s: list[float] = []
    step = 0
    while step < total_steps:
        order = torch.randperm(len(sequences))
        last = time.perf_counter()
        for b in range(min(len(sequences) // batch_size, total_steps - step)):
            batch = sequences[order[b * batch_size : (b + 1) * batch_size]].to(device, non_blocking=True)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                logits = model(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
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
        "tokens_per_s": len(steady_step_times_s) * batch_size * cfg.data.seq_len / sum(steady_step_times_s),
        "step_time_p50_s": float(np.percentile(steady_step_times_s, 50)),
        "steps": step,
        "steady_steps": len(steady_step_times_s),
        **figures,
    }


def run_bare(config: dict[str, Any], data_dir: str, warmup_steps: int) -> dict[str, Any]:
    """:func:`bare_loop` in a fresh process (spawned: nothing of this one's heap, threads or CUDA state)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(bare_loop, config, data_dir, warmup_steps).result()


def run_ours(config: dict[str, Any], data_dir: str, warmup_steps: int, *, workdir: str) -> dict[str, Any]:
    """``fit`` of the same config: our loop in one Ray Train worker."""
    from training_core.config import TrainingConfig
    from training_core.runners.ray_train import fit

    result = fit(
        TrainingConfig.from_dict(config),
        data_dir=data_dir,
        checkpoint_dir=os.path.join(workdir, "final"),
        run_name="lm-throughput",
        storage_path=os.path.join(workdir, "ray"),
        warmup_steps_excluded=warmup_steps,
    )
    m = result.metrics
    # The records' steady figure is samples/s; every sample is seq_len tokens (the records' own tokens over samples
    # is kept, to show it).
    return {
        "tokens_per_s": m.steady_samples_per_s * config["data"]["seq_len"],
        "records_tokens_per_sample": m.tokens_per_s / m.samples_per_s if m.samples_per_s else 0.0,
        "step_time_p50_s": m.step_time_p50_s,
        "steps": result.meta.global_step,
        "steady_steps": int(m.steady_steps),
    }


def peak_matmul_flops(*, device: str, dtype: str, threads: int, size: int, repeats: int) -> float:
    """The best FLOP/s of ``repeats`` timings of a ``size`` square ``torch.matmul`` (several per timing on a GPU)."""
    import torch

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    a = torch.randn(size, size, device=device).to(dt)
    b = torch.randn(size, size, device=device).to(dt)
    per_timing = 20 if device == "cuda" else 1
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.matmul(a, b)  # warm-up: library start, kernel choice, page faults of the output
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(per_timing):
            torch.matmul(a, b)
        sync()
        best = min(best, (time.perf_counter() - start) / per_timing)
    return 2 * size**3 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-mini", help="a causal_lm model.name (gpt2-tiny ... gpt2-xl)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=45, help="optimizer steps per run")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the steady state")
    parser.add_argument("--log-interval-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in both loops (and Ray CPUs per worker)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto", help="auto: bf16 on a GPU")
    parser.add_argument("--max-text-bytes", type=int, default=400_000, help="stdlib text prepared")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model in both loops")
    parser.add_argument("--rounds", type=int, default=4, help="runs of our loop, each bracketed by bare runs")
    parser.add_argument("--peak-size", type=int, default=0, help="peak matmul side; 0: 2048 on CPU, 8192 on GPU")
    parser.add_argument("--peak-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        warnings.warn("--device cuda: no GPU is available; measuring on the CPU", stacklevel=1)
        device = "cpu"
    precision = args.precision
    if precision == "auto":
        precision = "bf16" if device == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    peak_size = args.peak_size or (8192 if device == "cuda" else 2048)
    peak = dict(
        device=device,
        dtype="bfloat16" if precision == "bf16" else "float32",
        threads=args.threads,
        size=peak_size,
        repeats=args.peak_repeats,
    )
    config = training_config(args, device=device, precision=precision)
    if args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps={args.warmup_steps} leaves no steady steps of --steps={args.steps}")

    root = tempfile.mkdtemp(prefix="lm-throughput-")
    # Ray's session files and sockets, and every temporary file of this run, in one directory removed at the end.
    os.environ.update(TMPDIR=root, RAY_TMPDIR=root)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tempfile.tempdir = root
    load_before = os.getloadavg()
    try:
        import ray

        from training_core.config import TrainingConfig
        from training_core.data import prepare

        cfg = TrainingConfig.from_dict(config)
        data_dir = os.path.join(root, "data")
        manifest = prepare(cfg.data, data_dir, workload=cfg.workload)
        peaks = [peak_matmul_flops(**peak)]
        process_env = start_ray(num_cpus=max(2, args.threads), num_gpus=int(device == "cuda"))
        bare_runs = [run_bare(config, data_dir, args.warmup_steps)]
        ours_runs = []
        for round_index in range(args.rounds):
            ours_runs.append(
                run_ours(config, data_dir, args.warmup_steps, workdir=os.path.join(root, f"round{round_index}"))
            )
            bare_runs.append(run_bare(config, data_dir, args.warmup_steps))
            print(
                f"round {round_index}: ours {ours_runs[-1]['tokens_per_s']:.0f} tokens/s, bare "
                f"{bare_runs[-2]['tokens_per_s']:.0f} then {bare_runs[-1]['tokens_per_s']:.0f}",
                flush=True,
            )
        ray.shutdown()
        peaks.append(peak_matmul_flops(**peak))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ours_tps = [o["tokens_per_s"] for o in ours_runs]
    bare_tps = [b["tokens_per_s"] for b in bare_runs]
    round_ratios = [o / ((bare_tps[i] + bare_tps[i + 1]) / 2) for i, o in enumerate(ours_tps)]
    # The same comparison of typical step times (medians): near round_ratios when ours is slower at every step,
    # above them when a few slow steps (another process, a collection) make the difference.
    ours_p50 = [o["step_time_p50_s"] for o in ours_runs]
    bare_p50 = [b["step_time_p50_s"] for b in bare_runs]
    p50_ratios = [((bare_p50[i] + bare_p50[i + 1]) / 2) / o for i, o in enumerate(ours_p50)]
    figures = {k: bare_runs[0][k] for k in ("parameters", "flop_parameters", "num_layers", "hidden_size")}
    flops_per_token = bare_runs[0]["model_flops_per_token"]
    peak_flops = max(peaks)
    tokens_per_s, bare_tokens_per_s = statistics.median(ours_tps), statistics.median(bare_tps)
    result = {
        "benchmark": "lm_throughput",
        "throughput_ratio": statistics.median(round_ratios),
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token / peak_flops,
        "bare_tokens_per_s": bare_tokens_per_s,
        "bare_mfu": bare_tokens_per_s * flops_per_token / peak_flops,
        "model_flops_per_s": tokens_per_s * flops_per_token,
        "peak_flops_per_s": peak_flops,
        "peak_flops_per_s_before_after": peaks,
        "model_flops_per_token": flops_per_token,
        "flops_formula": "6 * flop_parameters + 12 * num_layers * seq_len * hidden_size",
        **figures,
        "round_ratios": round_ratios,
        "step_time_p50_ratio": statistics.median(p50_ratios),
        "round_step_time_p50_ratios": p50_ratios,
        "ours_runs_step_time_p50_s": ours_p50,
        "bare_runs_step_time_p50_s": bare_p50,
        "ours_runs_tokens_per_s": ours_tps,
        "bare_runs_tokens_per_s": bare_tps,
        "steady_steps_per_run": ours_runs[0]["steady_steps"],
        "records_tokens_per_sample": ours_runs[0]["records_tokens_per_sample"],
        "train_sequences": manifest.splits["train"].num_samples,
        "device": device,
        "precision": precision,
        "peak_matmul": {k: v for k, v in peak.items() if k != "device"},
        "process_env": process_env,
        "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "goal": ">= 0.97",
        "config": vars(args),
    }
    emit("lm_throughput", result)


if __name__ == "__main__":
    main()
