"""The GPU check: every GPU path and figure of the platform in one command of at most 8 minutes on one H100.

A GPU machine is lent now and then, for minutes, with no Ray, Flyte or MLflow and nothing to fetch (see
docs/gpu_check.md). This command is prepared and rehearsed here so that it only has to be run there::

    python3 benchmarks/device_check.py --out "$OUT"            # on the lent machine (make device-check)
    .venv/bin/python benchmarks/device_check.py --device cpu   # the rehearsal: tiny sizes, under a minute

It runs the parts below in this fixed order, each in a process group of its own with its own time limit (and
within ``--budget-s`` in all), so one hang costs its part only. After every part ``device_check.json`` in ``--out``
is rewritten with everything finished so far; every part's output goes to ``device_check.log`` beside it. The last
line printed is the JSON.

1. ``gpu_tests``: the cuda cases of ``tests/gpu/`` under pytest: ``fsdp_bf16_ok``, ``fp16_scaler_ok``, ``nccl_ok``,
   ``eval_on_gpu_ok``, ``batch_size_probe_ok``, ``device_copy_ok``, ``fast_path_ok`` (true, false with the
   failure's first line in ``notes``, or null when skipped).
2. ``nvml``: the platform's NVML reader sees the GPU (``nvml_ok``).
3. ``matmul_peak``: the best FLOP/s of a square bf16 matmul (``matmul_peak_flops``), MFU's denominator.
4. ``prepare``: the synthetic images and the tokenised text the measured parts train on (untimed).
5. ``resnet50``: ResNet-50, 224 px, batch 128, bf16 autocast, channels-last: our loop
(``training_core.runners.launch``, the
   plain ``torch.distributed`` launcher, one GPU) against ``loop_overhead.py``'s bare loop on the same data, each in a
   fresh process, steady state: ``resnet50_images_per_s`` (ours) and ``resnet50_ratio`` (ours / bare).
6. ``gpt2_eager`` (and 9. ``gpt2_compiled``): GPT-2 124M (its 50,257-token vocabulary: a BPE trained on the standard
   library, padded), sequence 1024, batch 16, bf16, our loop against ``lm_throughput.py``'s bare loop, without (and
   with) ``torch.compile``: ``gpt2_[eager_]tokens_per_s``, ``gpt2_[eager_]ratio`` and ``gpt2_[eager_]mfu`` (model
   FLOPs, PaLM's formula, over ``matmul_peak_flops``).
7. ``loader``: ResNet-50 fed by our loader (``ShardStream``, 14 loader processes, the carried JPEG shards: their prep
   runs in Ray tasks, so they are prepared here) against synthetic tensors on the GPU (``data_loading.py``'s
   comparison): ``loader_gpu_ratio`` and NVML's utilisation meanwhile (``loader_gpu_utilisation``).
8. ``oom_reduce``: our loop in this process under a GPU memory cap: a batch too large for it hits a real CUDA
   out-of-memory error and ``loop.oom_policy: reduce`` halves it until it fits (``oom_reduce_ok``), then
   ``loop.batch_size: auto`` plans a batch that fits the same cap (``batch_size_auto_ok``).
9. ``gpt2_compiled``: last of the figures, as compiling is the likeliest to run long.
10. ``wheels``: installs the carried wheels (``.device-carry/wheels``, built by ``benchmarks/device_wheels.py``)
    with ``pip install --no-index`` and checks they import (``carried_wheels_ok``). Nothing measured needs them; it
    comes after the figures so that what it installs cannot change them.
11. ``scaling`` (only when the budget has room): the CPU scaling benchmark's preset on 1, 2, 4 and 8 workers under
    plain ``torch.distributed`` (``scaling_{n}``: efficiency against 1 worker). Ray Train's side needs Ray, which the
    device lacks.

With ``--device cpu`` every part runs at tiny sizes on the CPU; what only a GPU can give is null with its reason in
``notes``. Nothing on this path imports Ray, Flyte or MLflow (tests/integration/test_device_check.py runs it with those
unimportable in every process it starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "device"
DEFAULT_CARRY = REPO_ROOT / ".device-carry"
SUMMARY_FILE = "device_check.json"
LOG_FILE = "device_check.log"
WHEELS_DIR = "wheels"
LOADER_SHARDS_DIR = "loader-shards"
REQUIREMENTS_FILE = "requirements.txt"
ABSENT_ON_DEVICE = ("ray", "flytekit", "mlflow")
"""Not in the device's image: nothing the check runs may import them."""
PRODUCT_DEPS = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions")
"""What the platform's own code imports (the config's schema layer) that the device's image lacks: installed from the
carried wheels (MLflow's dependencies) into the check's scratch before the first part, when ``pydantic`` is missing."""
GPT2_VOCAB_SIZE = 50257


class Skip(Exception):
    """A part that cannot run here (no GPU, nothing carried): its keys are null with this reason."""


@dataclass(frozen=True)
class Sizes:
    """Every size the parts use: :data:`FULL` on a GPU, :data:`TINY` for the CPU rehearsal."""

    image_model: str
    image_size: int
    image_batch: int
    image_samples: int
    image_epochs: int
    image_warmup_steps: int
    precision: str
    channels_last: bool
    lm_model: str
    lm_seq_len: int
    lm_batch: int
    lm_steps: int
    lm_warmup_steps: int
    lm_compiled_warmup_steps: int
    lm_text_bytes: int
    lm_vocab_size: int
    peak_size: int
    peak_dtype: str
    loader_processes: int
    loader_batch: int
    loader_rounds: int
    loader_max_steps: int
    oom_batch: int
    oom_cap_gib: float
    scaling_counts: tuple[int, ...]
    scaling_steps: int
    threads: int


FULL = Sizes(
    image_model="resnet50", image_size=224, image_batch=128, image_samples=2048, image_epochs=2, image_warmup_steps=5,
    precision="bf16", channels_last=True, lm_model="gpt2", lm_seq_len=1024, lm_batch=16, lm_steps=30,
    lm_warmup_steps=5, lm_compiled_warmup_steps=10, lm_text_bytes=6_000_000, lm_vocab_size=GPT2_VOCAB_SIZE,
    peak_size=8192, peak_dtype="bfloat16", loader_processes=14, loader_batch=128, loader_rounds=3, loader_max_steps=50,
    oom_batch=256, oom_cap_gib=4.0, scaling_counts=(1, 2, 4, 8), scaling_steps=40, threads=4,
)  # fmt: skip
TINY = Sizes(
    image_model="small_cnn", image_size=16, image_batch=8, image_samples=64, image_epochs=2, image_warmup_steps=2,
    precision="fp32", channels_last=False, lm_model="gpt2-tiny", lm_seq_len=64, lm_batch=4, lm_steps=8,
    lm_warmup_steps=2, lm_compiled_warmup_steps=2, lm_text_bytes=200_000, lm_vocab_size=1024, peak_size=256,
    peak_dtype="float32", loader_processes=2, loader_batch=2, loader_rounds=1, loader_max_steps=1,
    oom_batch=8, oom_cap_gib=1.0, scaling_counts=(1, 2), scaling_steps=4, threads=1,
)  # fmt: skip


@dataclass(frozen=True)
class Part:
    name: str
    keys: tuple[str, ...]
    """The summary keys this part fills (null with the part's error when it fails)."""
    limit_s: int
    """Its own time limit on a GPU (the rehearsal's parts share the same limits)."""
    optional: bool = False
    """Run only when the budget left covers ``limit_s``."""


PARTS = (
    Part(
        "gpu_tests",
        (
            "fsdp_bf16_ok",
            "fp16_scaler_ok",
            "nccl_ok",
            "eval_on_gpu_ok",
            "batch_size_probe_ok",
            "device_copy_ok",
            "fast_path_ok",
        ),
        200,
    ),  # fmt: skip
    Part("nvml", ("nvml_ok",), 30),
    Part("matmul_peak", ("matmul_peak_flops",), 45),
    Part("prepare", (), 120),
    Part("resnet50", ("resnet50_images_per_s", "resnet50_ratio"), 150),
    Part("gpt2_eager", ("gpt2_eager_tokens_per_s", "gpt2_eager_mfu", "gpt2_eager_ratio"), 120),
    Part("loader", ("loader_gpu_ratio", "loader_gpu_utilisation"), 120),
    Part("oom_reduce", ("oom_reduce_ok", "batch_size_auto_ok"), 120),
    Part("gpt2_compiled", ("gpt2_tokens_per_s", "gpt2_mfu", "gpt2_ratio"), 240),
    Part("wheels", ("carried_wheels_ok",), 90),
    Part("scaling", ("scaling_1", "scaling_2", "scaling_4", "scaling_8"), 150, optional=True),
)
KEYS = tuple(key for part in PARTS for key in part.keys)
MIN_PART_S = 15
"""A part is not started with less budget than this left (it could not finish)."""

GPU_TESTS = {
    "fsdp_bf16_ok": ("test_fsdp_precision", "test_bf16_"),
    "fp16_scaler_ok": ("test_fsdp_precision", "test_fp16_"),
    "nccl_ok": ("test_nccl_network_on_gpu", ""),
    "eval_on_gpu_ok": ("test_evaluate_device", ""),
    "batch_size_probe_ok": ("test_batch_size_on_gpu", ""),
    "device_copy_ok": ("test_device_copy", ""),
    "fast_path_ok": ("test_fast_path", ""),
}
"""Summary key -> (module of tests/gpu, test-name prefix) of the cases it stands for."""
GPU_TEST_SELECTION = "cuda or test_batch_size_on_gpu"
"""pytest ``-k``: the cuda case of each parametrised test, and the GPU-only module."""


# ----------------------------------------------------------------------------------------------- the parts' side


@dataclass
class Context:
    """What a part gets: the device, the sizes, its scratch directory, and the summary so far."""

    device: str
    sizes: Sizes
    work: Path
    carry: Path
    summary: dict[str, Any]

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def require_gpu(self, what: str) -> None:
        if not self.cuda:
            raise Skip(f"{what} needs a GPU (--device cpu)")


@dataclass
class PartResult:
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


def in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a spawned process (nothing of this one's heap, threads or CUDA state), its result back."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def part_wheels(ctx: Context) -> PartResult:
    wheels = ctx.carry / WHEELS_DIR
    requirements = wheels / REQUIREMENTS_FILE
    if not requirements.is_file():
        raise Skip(f"no carried wheels at {wheels} (benchmarks/device_wheels.py builds them)")
    if not ctx.cuda:
        raise Skip("--device cpu: the rehearsal installs nothing into this environment (the wheels are for cp312)")
    env = {**os.environ, "PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    install = ["install", "--no-index", "--find-links", str(wheels), "-r", str(requirements)]
    subprocess.run([sys.executable, "-m", "pip", *install], check=True, env=env)
    names = [line.split("==")[0] for line in requirements.read_text().split() if line]
    modules = ["mlflow" if name.startswith("mlflow") else name.replace("-", "_") for name in names]
    subprocess.run([sys.executable, "-c", "; ".join(f"import {m}" for m in modules)], check=True)
    return PartResult(values={"carried_wheels_ok": True}, details={"installed": names})


def junit_cases(path: Path) -> list[dict[str, str]]:
    """Each test case of a JUnit XML report: module, name, outcome (passed/failed/skipped) and the first line of
    its message."""
    import xml.etree.ElementTree as ET

    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                message = (child.get("message") or child.text or child.tag).strip().splitlines()[0][:300]
                break
        module = case.get("classname", "").rsplit(".", 1)[-1]
        cases.append({"module": module, "name": case.get("name", ""), "outcome": outcome, "message": message})
    return cases


def gpu_test_verdicts(cases: list[dict[str, str]]) -> PartResult:
    """The summary keys of :data:`GPU_TESTS` from pytest's cases: true when every case of a key passed, false (with
    the first failure's first line) when one failed, null (with the reason) when all were skipped or none ran."""
    result = PartResult()
    claimed = set()
    for key, (module, prefix) in GPU_TESTS.items():
        mine = [c for c in cases if c["module"] == module and c["name"].startswith(prefix)]
        claimed.update(id(c) for c in mine)
        failed = [c for c in mine if c["outcome"] == "failed"]
        passed = [c for c in mine if c["outcome"] == "passed"]
        if failed:
            result.values[key] = False
            result.notes[key] = f"{failed[0]['name']}: {failed[0]['message']}"
        elif passed:
            result.values[key] = True
        else:
            result.values[key] = None
            result.notes[key] = f"skipped: {mine[0]['message']}" if mine else f"no case of tests/gpu/{module}.py ran"
    others = {f"{c['module']}::{c['name']}": c["outcome"] for c in cases if id(c) not in claimed}
    if others:
        result.details["other_cases"] = others
    return result


def part_gpu_tests(ctx: Context) -> PartResult:
    report = ctx.work / "gpu_tests.xml"
    command = [
        sys.executable, "-m", "pytest", "tests/gpu", "-k", GPU_TEST_SELECTION, "-q", "-p", "no:cacheprovider",
        f"--junitxml={report}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT)
    if not report.is_file():
        raise RuntimeError(f"pytest exited with {done.returncode} and wrote no report")
    result = gpu_test_verdicts(junit_cases(report))
    result.details["pytest_exit_code"] = done.returncode
    return result


def part_nvml(ctx: Context) -> PartResult:
    from training_core.telemetry.gpu import NvmlGpus

    gpus = NvmlGpus.open()
    if gpus is None:
        if not ctx.cuda:
            raise Skip("NVML is not available on this machine (no GPU)")
        return PartResult(values={"nvml_ok": False}, notes={"nvml_ok": "NvmlGpus.open() found no usable NVML"})
    try:
        readings = [dataclasses.asdict(r) for r in gpus.read()]
    finally:
        gpus.close()
    ok = bool(readings) and all(r["memory_total_bytes"] and r["utilization_ratio"] is not None for r in readings)
    result = PartResult(values={"nvml_ok": ok}, details={"readings": readings})
    if not ok:
        result.notes["nvml_ok"] = "a GPU reading lacks its memory or utilisation"
    return result


def part_matmul_peak(ctx: Context) -> PartResult:
    from benchmarks.lm_throughput import peak_matmul_flops

    s = ctx.sizes
    peak = peak_matmul_flops(device=ctx.device, dtype=s.peak_dtype, threads=s.threads, size=s.peak_size, repeats=5)
    return PartResult(
        values={"matmul_peak_flops": peak}, details={"size": s.peak_size, "dtype": s.peak_dtype, "device": ctx.device}
    )


def image_setup(ctx: Context):
    from benchmarks.loop_overhead import Setup

    s = ctx.sizes
    return Setup(
        model_name=s.image_model, batch_size=s.image_batch, epochs=s.image_epochs, threads=s.threads,
        warmup_steps=s.image_warmup_steps, seed=0, device=ctx.device, precision=s.precision,
        channels_last=s.channels_last,
    )  # fmt: skip


def lm_config(ctx: Context, *, compiled: bool) -> dict[str, Any]:
    """The GPT run both loops train (``lm_throughput.py``'s config) on the prepared text and tokenizer."""
    from benchmarks.lm_throughput import training_config

    s = ctx.sizes
    args = argparse.Namespace(
        max_text_bytes=s.lm_text_bytes, seq_len=s.lm_seq_len, model=s.lm_model, compile=compiled, steps=s.lm_steps,
        batch_size=s.lm_batch, log_interval_steps=5, seed=0, threads=s.threads,
    )  # fmt: skip
    config = training_config(args, device=ctx.device, precision=s.precision)
    config["data"]["tokenizer"] = str(ctx.work / "tokenizer.json")
    return config


def padded_bpe_tokenizer(path: Path, *, text_bytes: int, vocab_size: int) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained on ``text_bytes`` of the standard library, its vocabulary padded
    with unused special tokens to exactly ``vocab_size`` ids (GPT-2's 50,257: the model then has GPT-2's shape)."""
    from tokenizers import Tokenizer

    from benchmarks.common import train_bpe_tokenizer
    from training_core.data import text

    root, files, sample = Path(text.stdlib_root()), iter(text.stdlib_files()), []
    while sum(map(len, sample)) < text_bytes:
        sample.append((root / next(files)).read_text(errors="replace"))
    train_bpe_tokenizer(path, sample, vocab_size=vocab_size)
    tokenizer = Tokenizer.from_file(str(path))
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tokenizer.add_special_tokens([f"<|unused_{i}|>" for i in range(missing)])
    tokenizer.save(str(path))
    assert max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1 == vocab_size
    return path


def part_prepare(ctx: Context) -> PartResult:
    from training_core.config import DataConfig, TrainingConfig
    from training_core.data import prepare

    s = ctx.sizes
    images = DataConfig(
        dataset="synthetic", synthetic_num_samples=s.image_samples, synthetic_image_size=s.image_size, num_shards=1
    )
    prepare(images, str(ctx.work / "images"))
    padded_bpe_tokenizer(ctx.work / "tokenizer.json", text_bytes=s.lm_text_bytes, vocab_size=s.lm_vocab_size)
    cfg = TrainingConfig.from_dict(lm_config(ctx, compiled=False))
    manifest = prepare(cfg.data, str(ctx.work / "text"), workload=cfg.workload)
    return PartResult(details={"train_sequences": manifest.splits["train"].num_samples, "vocab_size": s.lm_vocab_size})


def launch_ours(cfg, data_dir: Path, *, warmup_steps: int, workdir: Path):
    """Our loop on one worker under the plain ``torch.distributed`` launcher: the run's last epoch record."""
    from training_core.runners.launch import launch

    result = launch(
        cfg,
        data_dir=str(data_dir),
        checkpoint_dir=str(workdir / "final"),
        run_name=workdir.name,
        storage_path=str(workdir / "runs"),
        warmup_steps_excluded=warmup_steps,
    )
    return result.metrics


def part_resnet50(ctx: Context) -> PartResult:
    from benchmarks.loop_overhead import bare_loop, ours_config

    setup = image_setup(ctx)
    data_dir = ctx.work / "images"
    bare = in_fresh_process(bare_loop, str(data_dir), setup)
    ours = launch_ours(ours_config(setup), data_dir, warmup_steps=setup.warmup_steps, workdir=ctx.work / "resnet50")
    return PartResult(
        values={
            "resnet50_images_per_s": ours.steady_samples_per_s,
            "resnet50_ratio": ours.steady_samples_per_s / bare["samples_per_s"],
        },
        details={
            "bare_images_per_s": bare["samples_per_s"],
            "steady_steps": int(ours.steady_steps),
            "setup": str(setup),
        },
    )


def lm_part(ctx: Context, *, compiled: bool) -> PartResult:
    from benchmarks.lm_throughput import bare_loop
    from training_core.config import TrainingConfig

    s = ctx.sizes
    prefix = "gpt2" if compiled else "gpt2_eager"
    warmup = s.lm_compiled_warmup_steps if compiled else s.lm_warmup_steps
    config = lm_config(ctx, compiled=compiled)
    data_dir = ctx.work / "text"
    bare = in_fresh_process(bare_loop, config, str(data_dir), warmup)
    ours = launch_ours(TrainingConfig.from_dict(config), data_dir, warmup_steps=warmup, workdir=ctx.work / prefix)
    tokens_per_s = ours.steady_samples_per_s * s.lm_seq_len
    peak = ctx.summary.get("matmul_peak_flops")
    result = PartResult(
        values={
            f"{prefix}_tokens_per_s": tokens_per_s,
            f"{prefix}_ratio": tokens_per_s / bare["tokens_per_s"],
            f"{prefix}_mfu": tokens_per_s * bare["model_flops_per_token"] / peak if peak else None,
        },
        details={
            "bare_tokens_per_s": bare["tokens_per_s"],
            "parameters": bare["parameters"],
            "model_flops_per_token": bare["model_flops_per_token"],
            "steady_steps": int(ours.steady_steps),
        },
    )
    if not peak:
        result.notes[f"{prefix}_mfu"] = "no matmul_peak_flops: its part did not finish"
    return result


def part_gpt2_eager(ctx: Context) -> PartResult:
    return lm_part(ctx, compiled=False)


def part_gpt2_compiled(ctx: Context) -> PartResult:
    ctx.require_gpu("torch.compile's figure (inductor's CPU build takes longer than the rehearsal)")
    return lm_part(ctx, compiled=True)


def part_loader(ctx: Context) -> PartResult:
    from benchmarks.data_loading import resnet50_fed_by_loader
    from training_core.data import Manifest

    shards = ctx.carry / LOADER_SHARDS_DIR
    if not (shards / "manifest.json").is_file():
        raise Skip(
            f"no carried JPEG shards at {shards} (benchmarks/device_wheels.py prepares them; their prep needs Ray)"
        )
    s = ctx.sizes
    manifest = Manifest.load(str(shards))
    steps = min(s.loader_max_steps, manifest.splits["train"].num_samples // s.loader_batch - 1)
    if steps < 1:
        raise ValueError(f"{shards} holds too few training images for a batch of {s.loader_batch}")
    fed = resnet50_fed_by_loader(
        manifest, device_name=ctx.device, batch_size=s.loader_batch, steps=steps,
        loader_processes=s.loader_processes, rounds=s.loader_rounds,
    )  # fmt: skip
    result = PartResult(
        values={
            "loader_gpu_ratio": fed["resnet50_loader_ratio"],
            "loader_gpu_utilisation": fed["gpu_utilisation_with_loader"],
        },
        details={**fed, "loader_processes": s.loader_processes, "steps": steps},
    )
    if fed["gpu_utilisation_with_loader"] is None:
        result.notes["loader_gpu_utilisation"] = "no NVML reading (no GPU)" if not ctx.cuda else "NVML gave none"
    return result


class _Messages:
    """The ``training_core`` log's messages while it is installed (the loop's out-of-memory warnings)."""

    def __enter__(self) -> list[str]:
        import logging

        self.messages: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        logging.getLogger("training_core").addHandler(self.handler)
        return self.messages

    def __exit__(self, *exc_info: Any) -> None:
        import logging

        logging.getLogger("training_core").removeHandler(self.handler)


def run_in_this_process(cfg, data_dir: Path, workdir: Path, use_gpu: bool) -> list[str]:
    """Our loop in this process (``TorchDistributedRuntime``, as a launched rank runs it, on GPU 0 with
    ``use_gpu``); the log's messages."""
    from training_core.records import WorkerArgs
    from training_core.runners.launch import TorchDistributedRuntime, free_port
    from training_core.train.loop import run_worker

    args = WorkerArgs.build(cfg, data_dir=str(data_dir), checkpoint_root=str(workdir / "ckpt"), run_name=workdir.name)
    runtime = TorchDistributedRuntime.connect(
        rank=0, world_size=1, local_rank=0, backend=cfg.scaling.resolved_backend(),
        init_method=f"tcp://127.0.0.1:{free_port()}", timeout_s=cfg.scaling.collective_timeout_s, use_gpu=use_gpu,
        records_path=str(workdir / "records.jsonl"),
    )  # fmt: skip
    with _Messages() as messages:
        try:
            run_worker(args, runtime)
        finally:
            runtime.close()
    return messages


def part_oom_reduce(ctx: Context) -> PartResult:
    """On a GPU under a memory cap: ``loop.oom_policy: reduce`` after a real out-of-memory error, then
    ``loop.batch_size: auto`` planned for the same cap. On the CPU the same two runs, with nothing to exhaust:
    rehearsed, not judged (an error there fails the part)."""
    import gc

    import torch

    from benchmarks.loop_overhead import ours_config
    from training_core.config import TrainingConfig

    s = ctx.sizes
    if ctx.cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(s.oom_cap_gib * 2**30 / total)
    base = ours_config(dataclasses.replace(image_setup(ctx), batch_size=s.oom_batch, epochs=1)).to_dict()
    base["loop"].update(max_steps=3, log_interval_steps=1)
    base["observability"] = {"enabled": False}
    runs = {
        "oom_reduce_ok": {**base, "loop": {**base["loop"], "oom_policy": "reduce"}},
        "batch_size_auto_ok": {
            **base,
            "loop": {
                **base["loop"],
                "batch_size": "auto",
                "global_batch_size": s.oom_batch,
                "memory_budget_gib": s.oom_cap_gib * 0.9,
            },
        },  # fmt: skip
    }
    result = PartResult(details={"cap_gib": s.oom_cap_gib, "batch_size": s.oom_batch})
    for key, config in runs.items():
        workdir = ctx.work / key
        try:
            messages = run_in_this_process(TrainingConfig.from_dict(config), ctx.work / "images", workdir, ctx.cuda)
        except Exception as exc:  # noqa: BLE001 - on a GPU, any error is this key's verdict
            if not ctx.cuda:
                raise
            result.values[key], result.notes[key] = False, first_error_line(f"{type(exc).__name__}: {exc}")
            continue
        finally:
            gc.collect()
            if ctx.cuda:
                torch.cuda.empty_cache()
        retries = [m for m in messages if "out of memory" in m]
        result.details[key] = {"oom_retries": retries, "batch_messages": [m for m in messages if "batch" in m][:5]}
        if not ctx.cuda:
            result.values[key], result.notes[key] = None, "rehearsed on the CPU: no GPU memory to exhaust"
        elif key == "oom_reduce_ok":
            result.values[key] = bool(retries)
            if not retries:
                result.notes[key] = f"batch {s.oom_batch} fit under {s.oom_cap_gib} GiB: no out-of-memory to reduce"
        else:
            result.values[key] = not retries  # trained the global batch under the cap, oom_policy fail
    return result


def part_scaling(ctx: Context) -> PartResult:
    from training_core.data import prepare
    from training_core.scaling_benchmark import point_config, scaling_preset

    s = ctx.sizes
    preset = scaling_preset()
    preset = dataclasses.replace(preset, loop=dataclasses.replace(preset.loop, max_steps=s.scaling_steps))
    data_dir = ctx.work / "scaling-data"
    prepare(preset.data, str(data_dir))
    usable = [n for n in s.scaling_counts if n <= (os.cpu_count() or 1)]
    samples_per_s = {}
    for n in usable:
        cfg = point_config(preset, model=preset.model.name, num_workers=n)
        metrics = launch_ours(cfg, data_dir, warmup_steps=min(5, s.scaling_steps // 2), workdir=ctx.work / f"scale{n}")
        samples_per_s[n] = metrics.steady_samples_per_s
    result = PartResult(details={"torch_distributed_samples_per_s": samples_per_s, "ray_train": "not on the device"})
    for n in (1, 2, 4, 8):
        key = f"scaling_{n}"
        if n in samples_per_s:
            result.values[key] = samples_per_s[n] / (n * samples_per_s[usable[0]] / usable[0])
        else:
            result.values[key] = None
            why = f"{n} workers > {os.cpu_count()} cores" if n in s.scaling_counts else "not in these sizes' counts"
            result.notes[key] = f"not measured: {why}"
    return result


PART_FUNCTIONS: dict[str, Callable[[Context], PartResult]] = {
    "wheels": part_wheels,
    "gpu_tests": part_gpu_tests,
    "nvml": part_nvml,
    "matmul_peak": part_matmul_peak,
    "prepare": part_prepare,
    "resnet50": part_resnet50,
    "gpt2_eager": part_gpt2_eager,
    "gpt2_compiled": part_gpt2_compiled,
    "loader": part_loader,
    "oom_reduce": part_oom_reduce,
    "scaling": part_scaling,
}


def run_part(name: str, ctx: Context, result_path: Path) -> None:
    """One part in this (its own) process: its result, or its skip reason, as JSON at ``result_path``."""
    try:
        result = PART_FUNCTIONS[name](ctx)
        payload = {"status": "ok", **dataclasses.asdict(result)}
    except Skip as skip:
        payload = {"status": "skipped", "reason": str(skip)}
    result_path.write_text(json.dumps(payload, default=str))


# --------------------------------------------------------------------------------------------- the orchestrator


_EXCEPTION_LINE = re.compile(r"(?:^|\s)((?:[A-Za-z_][\w.]*\.)?\w*(?:Error|Exception|Interrupt|Exit)\b.*)")


def first_error_line(log_tail: str) -> str:
    """The line of a part's output that names its failure: from the last ``SomethingError...`` that starts a line
    (or follows a prefix such as torch's ``[rank0]:``), else the last line."""
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    for line in reversed(lines):
        found = _EXCEPTION_LINE.search(line)
        if found and not line.startswith(("File ", "raise ")):
            return found.group(1)[:300]
    return lines[-1][:300] if lines else "no output"


def environment(device: str) -> dict[str, Any]:
    """Versions and the machine, without importing torch here."""
    versions = {}
    for name in ("torch", "torchvision", "transformers", "tokenizers", "peft", "pandas", "pyarrow", "nvidia-ml-py"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    gpu = None
    if device == "cuda":
        try:
            query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
            gpu = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            gpu = f"nvidia-smi failed: {exc}"
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "gpu": gpu,
        "versions": versions,
        "importable": {name: _importable(name) for name in ABSENT_ON_DEVICE},
    }


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class Summary:
    """``device_check.json``: every key (null until its part fills it), the parts' outcomes, rewritten whole after
    each part."""

    def __init__(self, path: Path, *, device: str, sizes: Sizes, budget_s: float) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "check": "device_check",
            "device": device,
            "sizes": "full" if sizes == FULL else "tiny",
            "started_utc": _utc_now(),
            "finished_utc": None,
            "budget_s": budget_s,
            **{key: None for key in KEYS},
            "notes": {key: "not run" for key in KEYS},
            "parts": {},
            "details": {},
            "environment": {},
        }

    def record(self, part: Part, outcome: dict[str, Any], seconds: float) -> None:
        status = outcome["status"]
        self.data["parts"][part.name] = {"status": status, "seconds": round(seconds, 1)}
        notes = self.data["notes"]
        for key in part.keys:
            notes.pop(key, None)
        if status == "ok":
            for key, value in outcome["values"].items():
                self.data[key] = value
            notes.update(outcome["notes"])
            if outcome["details"]:
                self.data["details"][part.name] = outcome["details"]
        else:
            reason = outcome.get("reason", "")
            self.data["parts"][part.name]["reason"] = reason
            for key in part.keys:
                notes[key] = f"{status}: {reason}"

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def install_product_deps(carry: Path, target: Path) -> dict[str, Any]:
    """Install ``PRODUCT_DEPS`` from the carried wheels into ``target`` when this interpreter lacks pydantic (the
    device's image does); what was done, for the summary's details. Nothing else is installed before the figures."""
    if _importable("pydantic"):
        return {"status": "present"}
    wheels = sorted(w for name in PRODUCT_DEPS for w in (carry / WHEELS_DIR).glob(f"{name}-*.whl"))
    found = {w.name.split("-")[0] for w in wheels}
    if "pydantic" not in found or "pydantic_core" not in found:
        return {"status": "missing", "reason": f"no pydantic wheels in {carry / WHEELS_DIR} (device_wheels.py)"}
    env = {**os.environ, "PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    install = ["install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--target", str(target)]
    subprocess.run([sys.executable, "-m", "pip", *install, *map(str, wheels)], check=True, env=env)
    return {"status": "installed", "wheels": [w.name for w in wheels], "target": str(target)}


def part_env(site: Path | None = None) -> dict[str, str]:
    """The parts' environment: this repository (and ``site``, the product's dependencies installed for the check)
    importable in every process they start (pytest's subprocesses, spawned ranks), whatever ``PYTHONPATH`` held kept
    first."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO_ROOT)]
    if site is not None:
        paths.append(str(site))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def run_isolated(part: Part, args: argparse.Namespace, work: Path, log, timeout_s: float) -> dict[str, Any]:
    """Run ``part`` in a process group of its own, killed whole at ``timeout_s``; its outcome."""
    result_path = work / f"{part.name}.result.json"
    command = [
        sys.executable, str(Path(__file__).resolve()), "--part", part.name, "--device", args.device, "--sizes",
        args.sizes, "--carry", str(args.carry), "--work", str(work), "--out", str(args.out),
    ]  # fmt: skip
    log.write(f"\n===== part {part.name} (limit {timeout_s:.0f} s) {_utc_now()}\n")
    log.flush()
    site = work / "site"
    env = part_env(site if site.is_dir() else None)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        returncode = process.wait(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        returncode = None
    _end_group(process)
    if timed_out:
        return {"status": "timeout", "reason": f"stopped at its limit of {timeout_s:.0f} s"}
    if returncode == 0 and result_path.is_file():
        return json.loads(result_path.read_text())
    log.flush()
    return {"status": "failed", "reason": first_error_line(_tail(Path(log.name)))}


def _end_group(process: subprocess.Popen) -> None:
    """Stop the part's process group (its ranks, loader processes, pytest's children): TERM, then KILL."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            time.sleep(0.5)  # the group's other members get their moment before the KILL below


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tail(path: Path, max_bytes: int = 20_000) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - max_bytes))
        return f.read().decode(errors="replace")


def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    sizes = FULL if args.sizes == "full" else TINY
    args.out.mkdir(parents=True, exist_ok=True)
    summary = Summary(args.out / SUMMARY_FILE, device=args.device, sizes=sizes, budget_s=args.budget_s)
    summary.data["environment"] = environment(args.device)
    summary.write()
    deadline = time.monotonic() + args.budget_s
    chosen = set(args.only or [p.name for p in PARTS])
    with tempfile.TemporaryDirectory(prefix="device-check-") as scratch, open(args.out / LOG_FILE, "w") as log:
        work = Path(scratch)
        try:
            summary.data["details"]["product_deps"] = install_product_deps(args.carry, work / "site")
        except subprocess.CalledProcessError as exc:
            summary.data["details"]["product_deps"] = {"status": "failed", "reason": str(exc)[:300]}
        for part in PARTS:
            left_s = deadline - time.monotonic()
            if part.name not in chosen:
                summary.record(part, {"status": "skipped", "reason": "not chosen (--only)"}, 0.0)
            elif left_s < (part.limit_s if part.optional else MIN_PART_S):
                summary.record(part, {"status": "skipped", "reason": f"budget: {left_s:.0f} s left"}, 0.0)
            else:
                (work / "summary.json").write_text(json.dumps(summary.data, default=str))
                start, cpu_before = time.monotonic(), _children_cpu_s()
                limit_s = min(part.limit_s, left_s, args.max_part_s or part.limit_s)
                outcome = run_isolated(part, args, work, log, limit_s)
                summary.record(part, outcome, time.monotonic() - start)
                # CPU seconds of the part's processes: on a loaded machine, a hint of what it costs unloaded.
                summary.data["parts"][part.name]["cpu_s"] = round(_children_cpu_s() - cpu_before, 1)
            summary.write()
    summary.data["finished_utc"] = _utc_now()
    summary.write()
    return summary.data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--sizes", choices=("full", "tiny"), help="default: full on cuda, tiny on cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where device_check.json and .log go")
    parser.add_argument("--carry", type=Path, default=DEFAULT_CARRY, help="the carried folder (device_wheels.py)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="all parts together, seconds")
    parser.add_argument("--max-part-s", type=float, help="caps every part's own time limit, seconds")
    parser.add_argument("--only", nargs="+", choices=[p.name for p in PARTS], help="run these parts only")
    parser.add_argument("--part", choices=[p.name for p in PARTS], help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = args.sizes or ("full" if args.device == "cuda" else "tiny")
    args.carry = args.carry.resolve()
    if args.part:
        summary = json.loads((args.work / "summary.json").read_text())
        ctx = Context(
            device=args.device,
            sizes=FULL if args.sizes == "full" else TINY,
            work=args.work,
            carry=args.carry,
            summary=summary,
        )
        run_part(args.part, ctx, args.work / f"{args.part}.result.json")
        return
    print(json.dumps(orchestrate(args), default=str), flush=True)


if __name__ == "__main__":
    main()
