"""Per-worker memory of the same GPT under ``scaling.strategy`` ``ddp`` and ``fsdp`` on 2 CPU workers, the largest GPT
preset each trains on this machine, and the step-time cost of full activation checkpointing.

Each measurement runs the product's pieces (the ``causal_lm`` workload's model, ``sharding.shard_model`` or the
launcher's DDP, ``build_optimizer``, ``train_step`` with AdamW) in 2 fresh ``torch.distributed`` processes (gloo),
on random token batches, for a few optimizer steps. A worker's peak is its peak RSS (``ru_maxrss``), and its model
memory that peak above the RSS it had before the model was built (Python, torch and the process group).

- ``fsdp_memory_ratio``: the fsdp worker's peak RSS over the ddp worker's, for ``gpt2`` (124 M parameters).
  Goal: <= 0.6. ``fsdp_model_memory_ratio``: the same for the model memory alone.
- ``max_params_ddp`` / ``max_params_fsdp``: the largest GPT-2 preset whose predicted per-worker memory (the
  bytes per parameter measured above, times the preset's parameters, plus the baseline and the measured
  activations) fits this machine's memory with 2 workers, then trained for 2 steps to confirm it.
- ``ac_step_time_ratio``: step time with ``model.activation_checkpointing: full`` over without (fsdp, ``gpt2``).

Prints one JSON object as the last line and writes ``benchmarks/results/memory_scaling.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import emit  # noqa: E402

PRESETS = ("gpt2-tiny", "gpt2-mini", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
WORLD_SIZE = 2
SEQ_LEN = 64
MICRO_BATCH = 2


def _worker(rank: int, spec: dict, out: dict) -> None:
    import resource

    import torch
    import torch.distributed as dist

    from training_core.config import TrainingConfig
    from training_core.data import Manifest
    from training_core.parallel import sharding
    from training_core.runners.launch import TorchDistributedRuntime
    from training_core.train.loop import train_step
    from training_core.train.optim import build_optimizer
    from training_core.workloads import resolve_workload
    from training_core.workloads.causal_lm import TextSpec

    torch.set_num_threads(1)
    if spec["strategy"] == "fsdp":
        sharding.return_freed_host_memory()  # as the loop does under FSDP on CPU
    dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=WORLD_SIZE)
    cfg = TrainingConfig.from_dict(
        {
            "workload": {"name": "causal_lm"},
            "data": {"dataset": "stdlib", "seq_len": SEQ_LEN},
            "model": {"name": spec["model"], "activation_checkpointing": spec["ac"]},
            "scaling": {"strategy": spec["strategy"], "num_workers": WORLD_SIZE},
        }
    )
    workload = resolve_workload(cfg.workload)
    manifest = Manifest.from_description(spec["data"])
    vocab = TextSpec.from_manifest(manifest).vocab_size
    with torch.device("meta"):  # imports what building the model imports (transformers), at no memory
        workload.build_model(cfg, manifest)
    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    model = workload.build_model(cfg, manifest)
    blocks = sharding.model_blocks(model, workload)
    sharding.apply_activation_checkpointing(blocks, mode=spec["ac"], every_k=1)
    if spec["strategy"] == "fsdp":
        model = sharding.shard_model(model, blocks, device=torch.device("cpu"), param_dtype=None, cpu_offload=False)
    else:
        runtime = TorchDistributedRuntime(
            rank=rank, world_size=WORLD_SIZE, local_rank=rank, device=torch.device("cpu"), records_path=""
        )
        model = runtime.prepare_model(model, {"gradient_as_bucket_view": True})
    optimizer = build_optimizer(cfg.optimizer, model.parameters())
    step_times = []
    for step in range(spec["steps"]):
        tokens = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(step))
        started = time.perf_counter()
        train_step(
            model=model,
            optimizer=optimizer,
            scaler=torch.amp.GradScaler("cpu", enabled=False),
            micro_batches=[(tokens[:, :-1], tokens[:, 1:])],
            autocast_dtype=None,
            max_grad_norm=1.0,
            loss_fn=workload.loss,
        )
        step_times.append(time.perf_counter() - started)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = sum(sharding.local_tensor(p).numel() for p in model.parameters())
    out[rank] = {
        "peak_bytes": peak_kib * 1024,
        "baseline_bytes": baseline_kib * 1024,
        "local_params": params,
        "step_s": min(step_times[1:]) if len(step_times) > 1 else step_times[0],
    }
    dist.destroy_process_group()


def _run(model: str, strategy: str, data: dict, *, ac: str = "none", steps: int = 3) -> dict:
    """Both workers' figures (the larger of the two per figure) for one configuration, in fresh processes."""
    import torch.multiprocessing as mp

    from training_core.runners.launch import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        spec = {
            "model": model,
            "strategy": strategy,
            "ac": ac,
            "steps": steps,
            "data": data,
            "init": f"tcp://127.0.0.1:{free_port()}",
        }
        mp.spawn(_worker, args=(spec, out), nprocs=WORLD_SIZE, join=True)
        ranks = [dict(out[r]) for r in range(WORLD_SIZE)]
    merged = {key: max(r[key] for r in ranks) for key in ranks[0]}
    merged["model_bytes"] = max(r["peak_bytes"] - r["baseline_bytes"] for r in ranks)
    print(f"{model} {strategy} ac={ac}: {merged}", file=sys.stderr, flush=True)
    return merged


def _preset_params(name: str, vocab_size: int) -> int:
    import torch

    from training_core.config import ModelConfig
    from training_core.workloads.causal_lm import build_lm

    with torch.device("meta"):
        lm = build_lm(ModelConfig(name=name), vocab_size=vocab_size, eot_id=vocab_size - 1)
    return sum(p.numel() for p in lm.parameters())


def _text_data(directory: str) -> tuple[dict, int]:
    """A small prepared text dataset (the byte tokenizer): its description rebuilds the workload's model."""
    from training_core.config import TrainingConfig
    from training_core.data import prepare
    from training_core.workloads.causal_lm import TextSpec

    cfg = TrainingConfig.from_dict(
        {
            "workload": {"name": "causal_lm"},
            "data": {"dataset": "stdlib", "seq_len": SEQ_LEN, "max_text_bytes": 20_000},
            "model": {"name": "gpt2-tiny"},
        }
    )
    manifest = prepare(cfg.data, directory, workload=cfg.workload)
    return manifest.description(), TextSpec.from_manifest(manifest).vocab_size


def _machine_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="GPT preset the ddp/fsdp ratio and AC cost are measured on")
    parser.add_argument("--headroom", type=float, default=0.85, help="share of the machine's memory a run may use")
    parser.add_argument(
        "--no-largest", action="store_true", help="skip the search for the largest preset (a smoke run)"
    )
    args = parser.parse_args()
    os.environ.setdefault("TMPDIR", tempfile.gettempdir())
    from training_core.parallel.ray_settings import apply_process_env

    apply_process_env()  # the workers start with the environment of the platform's Ray workers (glibc reads it then)

    data, vocab = _text_data(tempfile.mkdtemp(prefix="memory-scaling-"))
    ddp, fsdp = _run(args.model, "ddp", data), _run(args.model, "fsdp", data)
    fsdp_ac = _run(args.model, "fsdp", data, ac="full")
    params = _preset_params(args.model, vocab)
    machine = _machine_bytes()
    largest = {}
    for strategy, measured in () if args.no_largest else (("ddp", ddp), ("fsdp", fsdp)):
        # Per-worker memory grows with the parameters a worker holds; the activations and baseline stay.
        per_param = measured["model_bytes"] / params
        fitting = [
            name
            for name in PRESETS
            if WORLD_SIZE * (measured["baseline_bytes"] + per_param * _preset_params(name, vocab))
            <= args.headroom * machine
        ]
        name = fitting[-1]
        _run(name, strategy, data, steps=2)  # it really trains
        largest[strategy] = (name, _preset_params(name, vocab))
    emit(
        "memory_scaling",
        {
            "model": args.model,
            "params": params,
            "vocab_size": vocab,
            "ddp_peak_bytes": ddp["peak_bytes"],
            "fsdp_peak_bytes": fsdp["peak_bytes"],
            "fsdp_memory_ratio": fsdp["peak_bytes"] / ddp["peak_bytes"],
            "fsdp_model_memory_ratio": fsdp["model_bytes"] / ddp["model_bytes"],
            "max_preset_ddp": largest.get("ddp", ("", 0))[0],
            "max_params_ddp": largest.get("ddp", ("", 0))[1],
            "max_preset_fsdp": largest.get("fsdp", ("", 0))[0],
            "max_params_fsdp": largest.get("fsdp", ("", 0))[1],
            "machine_memory_bytes": machine,
            "ddp_step_s": ddp["step_s"],
            "fsdp_step_s": fsdp["step_s"],
            "fsdp_ac_step_s": fsdp_ac["step_s"],
            "ac_step_time_ratio": fsdp_ac["step_s"] / fsdp["step_s"],
            "ac_memory_ratio": fsdp_ac["model_bytes"] / fsdp["model_bytes"],
        },
    )


if __name__ == "__main__":
    main()
