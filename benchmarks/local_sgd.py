"""Throughput of ``sync.mode: local_sgd`` over ``allreduce`` on 2 workers, for a model whose step is mostly gradient
all-reduce (ResNet-50 on 8 px synthetic images: 23.5 M parameters, little compute per sample).

Both runs are the product's training loop on the plain ``torch.distributed`` launcher (2 gloo processes), same data,
same steps; ``local_sgd`` all-reduces gradients for ``--warmup`` steps, then averages parameters every ``--period``
steps. Figures are the steady-state samples/s the loop reports (after its warm-up steps).

- ``local_sgd_throughput_ratio``: local SGD's samples/s over all-reduce's (it must not be below 1).
- ``allreduce_fraction``: the share of all-reduce's step spent in gradient all-reduces (why the ratio is what it is).

Prints one JSON object as the last line and writes ``benchmarks/results/local_sgd.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import emit  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--period", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("TMPDIR", tempfile.gettempdir())

    from training_core.config import TrainingConfig
    from training_core.data import prepare
    from training_core.runners.launch import launch

    scratch = Path(tempfile.mkdtemp(prefix="local-sgd-"))
    base = {
        "data": {"dataset": "synthetic", "synthetic_image_size": 8, "synthetic_num_samples": 1024, "num_shards": 2},
        "model": {"name": args.model},
        "loop": {"epochs": 1, "batch_size": 8, "max_steps": args.steps, "log_interval_steps": 10},
        "observability": {"enabled": False},
    }
    prepare(TrainingConfig.from_dict(base).data, str(scratch / "data"))
    figures = {}
    for mode in ("allreduce", "local_sgd"):
        cfg = TrainingConfig.from_dict(
            {
                **base,
                "sync": {"mode": mode, "local_sgd_period_steps": args.period, "local_sgd_warmup_steps": args.warmup},
            }
        )
        result = launch(
            cfg,
            data_dir=str(scratch / "data"),
            checkpoint_dir=str(scratch / f"{mode}-final"),
            run_name=mode,
            storage_path=str(scratch / "runs"),
            warmup_steps_excluded=args.warmup + 1,
        )
        figures[mode] = result.metrics
        print(f"{mode}: {result.metrics.steady_samples_per_s:.1f} samples/s", file=sys.stderr, flush=True)
    emit(
        "local_sgd",
        {
            "model": args.model,
            "steps": args.steps,
            "period_steps": args.period,
            "warmup_steps": args.warmup,
            "allreduce_samples_per_s": figures["allreduce"].steady_samples_per_s,
            "local_sgd_samples_per_s": figures["local_sgd"].steady_samples_per_s,
            "local_sgd_throughput_ratio": figures["local_sgd"].steady_samples_per_s
            / figures["allreduce"].steady_samples_per_s,
            "allreduce_fraction": figures["allreduce"].allreduce_fraction,
        },
    )


if __name__ == "__main__":
    main()
