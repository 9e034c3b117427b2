"""Successive halving (``asha``) against a full ``random`` search over the same trials.

Both searches run through the real workflow, ``pyflyte run workflows/tuning.py tuning_pipeline``, one after
the other, against one local Ray cluster that this benchmark starts (and stops: only its own process group).
With the same ``seed`` and search space, ``random`` and ``asha`` draw the same trial configs
(``tuning.initial_params``); the benchmark checks that in the two trial tables and fails if they differ.
``random`` trains every trial to ``base.loop.epochs``; ``asha`` trains all of them to the first rung, then
resumes only the top ``1/eta`` of each rung from their checkpoints to the next.

- ``compute_ratio``: epochs trained by all asha trials / epochs trained by all random trials (from the trial
  tables' ``epochs_used``, cross-checked with the MLflow parent run's ``epochs_used``). Goal: <= 0.4.
- ``best_accuracy_delta``: best val accuracy of the full search minus that of asha, in points. Goal: <= 1.
- ``wall_s`` of each ``pyflyte run`` and their ratio, with the 1-minute load average before and after each
  run (the seconds are only comparable on a quiet machine). Each ``train_trial`` node also pays a fixed cost
  (starting a Ray Train worker group, MLflow bookkeeping), and asha runs more, shorter nodes, so on tiny
  trials the seconds ratio is well above the epochs ratio.

Each run gets its own working directory (its ``mlflow.db``), HOME (flytekit's local cache, so the second
search cannot reuse the first one's cached trials) and TMPDIR, all under one temporary directory that is
removed at the end. Prints one JSON object as the last line and writes
``benchmarks/results/tuning_efficiency.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
METRIC = "val_accuracy"


def tuning_config(args: argparse.Namespace, algorithm: str) -> dict:
    """The full TuningConfig as a dict: pyflyte fills missing nested fields with the dataclass defaults,
    not the tuning defaults, so every field is passed."""
    from training_core.tuning import TuningConfig

    return TuningConfig.from_dict(
        {
            "algorithm": algorithm,
            "num_trials": args.num_trials,
            "seed": args.seed,
            "max_concurrency": args.max_concurrency,
            "metric": METRIC,
            "asha": {"min_epochs": args.min_epochs, "eta": args.eta},
            "base": {
                "data": {"dataset": "digits", "num_shards": 2},
                "model": {"name": "small_cnn"},
                "loop": {"epochs": args.epochs},
                "scaling": {"num_workers": 1},
            },
        }
    ).to_dict()


def start_ray(root: Path, num_cpus: int, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """A local Ray head in its own process group; returns the process and the cluster address."""
    temp_dir = root / "ray"
    process = subprocess.Popen(
        [
            str(VENV_BIN / "ray"),
            "start",
            "--head",
            "--block",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            "--port=0",
        ],
        stdout=open(root / "ray-head.log", "w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    address_file = temp_dir / "ray_current_cluster"
    deadline = time.monotonic() + 180
    while not (address_file.exists() and address_file.read_text().strip()):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_ray(process)
            raise RuntimeError(f"ray start failed:\n{(root / 'ray-head.log').read_text()[-4000:]}")
        time.sleep(0.5)
    return process, address_file.read_text().strip()


def stop_ray(process: subprocess.Popen) -> None:
    """Stop this benchmark's cluster only (its process group); ``ray stop`` would end every Ray on the machine."""
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_search(algorithm: str, config: dict, *, root: Path, env: dict[str, str], timeout_s: int) -> dict:
    """One ``pyflyte run`` of the tuning pipeline in its own directory; returns its wall time, trial table
    and MLflow figures."""
    workdir = root / algorithm
    home, tmp = workdir / "home", workdir / "tmp"
    for path in (home, tmp):
        path.mkdir(parents=True)
    run_env = dict(env, HOME=str(home), TMPDIR=str(tmp))
    log_path = workdir / "pyflyte.log"
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with open(log_path, "w") as log:
        result = subprocess.run(
            [
                str(VENV_BIN / "pyflyte"),
                "run",
                str(REPO_ROOT / "workflows" / "tuning.py"),
                "tuning_pipeline",
                "--config",
                json.dumps(config),
            ],
            cwd=workdir,
            env=run_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        )
    wall_s = time.monotonic() - started
    output = log_path.read_text()
    if result.returncode != 0:
        raise RuntimeError(f"{algorithm} search failed (exit {result.returncode}):\n{output[-6000:]}")
    return {
        "wall_s": wall_s,
        "load_avg_1m": [load_before, os.getloadavg()[0]],
        "trials": read_trial_table(output, tmp),
        "mlflow": read_parent_run(workdir / "mlflow.db", algorithm),
    }


def read_trial_table(output: str, tmp: Path) -> list[dict[str, str]]:
    """The run's ``trials.csv`` (``TuningResult.table``): the path pyflyte printed, else the one file of
    that name under the run's TMPDIR."""
    printed = [Path(p) for p in re.findall(r"(/[^\s'\"]*/trials\.csv)", output) if Path(p).is_file()]
    paths = printed or sorted(tmp.rglob("trials.csv"))
    if not paths:
        raise RuntimeError(f"no trials.csv in the output or under {tmp}")
    with open(paths[-1], newline="") as f:
        return list(csv.DictReader(f))


def read_parent_run(db: Path, algorithm: str) -> dict:
    """The search's MLflow parent run (the one with ``algorithm`` as a param) and its number of child runs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("tuning")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    (parent,) = [r for r in runs if r.data.params.get("algorithm") == algorithm]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return {
        "best_metric": parent.data.metrics[f"best_{METRIC}"],
        "best_trial": int(parent.data.metrics["best_trial"]),
        "epochs_used": int(parent.data.metrics["epochs_used"]),
        "child_runs": len(children),
        "status": parent.info.status,
    }


def summarize(trials: list[dict[str, str]], space_paths: list[str], full_epochs: int) -> dict:
    """Epochs used, slices (train_trial nodes) and the best trial among those trained to the full budget."""
    score_columns = [c for c in trials[0] if c.startswith(f"{METRIC}@")]
    full = [t for t in trials if int(t["epochs_trained"]) >= full_epochs]
    best = max(full, key=lambda t: (float(t[f"final_{METRIC}"]), -int(t["trial"])))
    return {
        "num_trials": len(trials),
        "epochs_used": sum(int(t["epochs_used"]) for t in trials),
        "num_slices": sum(1 for t in trials for c in score_columns if t[c] != ""),
        "trials_at_full_budget": len(full),
        "best_trial": int(best["trial"]),
        "best_val_accuracy": float(best[f"final_{METRIC}"]),
        "best_params": {p: best[p] for p in space_paths},
        "trials_per_epoch": {c.split("@")[1]: sum(1 for t in trials if t[c] != "") for c in score_columns},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-trials", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=9, help="base.loop.epochs: a trial's full budget")
    parser.add_argument("--min-epochs", type=int, default=1, help="asha.min_epochs: the first rung")
    parser.add_argument("--eta", type=int, default=3, help="asha.eta")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-concurrency", type=int, default=2)
    parser.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs of the benchmark's Ray cluster")
    parser.add_argument("--timeout-s", type=int, default=3600, help="limit of each pyflyte run")
    args = parser.parse_args()

    from training_core import tuning

    configs = {algorithm: tuning_config(args, algorithm) for algorithm in ("asha", "random")}
    search = tuning.TuningConfig.from_dict(configs["asha"])
    rungs = tuning.asha_rungs(search.base.loop.epochs, min_epochs=search.asha.min_epochs, eta=search.asha.eta)
    space_paths = [spec.path for spec in search.search_space]

    root = Path(tempfile.mkdtemp(prefix="tune-eff-"))  # short: Ray's socket paths are limited to ~107 characters
    env = dict(
        os.environ,
        TMPDIR=str(root),
        RAY_TMPDIR=str(root),
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_TRAIN_V2_ENABLED="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONUNBUFFERED="1",
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    ray_process = None
    try:
        ray_process, address = start_ray(root, args.ray_cpus, env)
        env["RAY_ADDRESS"] = address
        runs = {}
        for algorithm, config in configs.items():
            print(f"running the {algorithm} search ...", file=sys.stderr, flush=True)
            runs[algorithm] = run_search(algorithm, config, root=root, env=env, timeout_s=args.timeout_s)
            print(f"{algorithm}: {runs[algorithm]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    finally:
        if ray_process is not None:
            stop_ray(ray_process)
        shutil.rmtree(root, ignore_errors=True)

    drawn = {alg: {int(t["trial"]): {p: t[p] for p in space_paths} for t in run["trials"]} for alg, run in runs.items()}
    if drawn["asha"] != drawn["random"]:
        raise AssertionError(
            f"asha and random did not train the same trial configs:\nasha:   {drawn['asha']}\nrandom: {drawn['random']}"
        )
    expected = {i: p for i, p in enumerate(tuning.initial_params(search))}
    if drawn["asha"] != expected:
        raise AssertionError(
            f"the trial tables do not hold the trials tuning.initial_params draws:\n{drawn['asha']}\n{expected}"
        )

    summaries = {alg: summarize(run["trials"], space_paths, search.base.loop.epochs) for alg, run in runs.items()}
    for alg, summary in summaries.items():
        logged = runs[alg]["mlflow"]
        if (logged["epochs_used"], logged["best_trial"]) != (summary["epochs_used"], summary["best_trial"]):
            raise AssertionError(f"{alg}: MLflow parent run {logged} disagrees with the trial table {summary}")
    asha, full = summaries["asha"], summaries["random"]
    compute_ratio = asha["epochs_used"] / full["epochs_used"]
    delta_points = 100 * (full["best_val_accuracy"] - asha["best_val_accuracy"])
    full_scores = {int(t["trial"]): float(t[f"final_{METRIC}"]) for t in runs["random"]["trials"]}
    # A trial asha trained to the full budget in slices (resumed from its checkpoints) against the same trial
    # trained in one go by the random search: resuming is exact, so they should agree.
    sliced = {
        int(t["trial"]): float(t[f"final_{METRIC}"])
        for t in runs["asha"]["trials"]
        if int(t["epochs_trained"]) >= search.base.loop.epochs
    }
    result = {
        "benchmark": "tuning_efficiency",
        "compute_ratio": compute_ratio,
        "best_accuracy_delta": delta_points,
        "wall_s_ratio": runs["asha"]["wall_s"] / runs["random"]["wall_s"],
        "goal": {"compute_ratio": "<= 0.4", "best_accuracy_delta": "<= 1 point"},
        "met": {"compute_ratio": compute_ratio <= 0.4, "best_accuracy_delta": delta_points <= 1.0},
        "rungs": rungs,
        "asha": {
            **asha,
            **{k: runs["asha"][k] for k in ("wall_s", "load_avg_1m")},
            "mlflow_parent": runs["asha"]["mlflow"],
        },
        "random": {
            **full,
            **{k: runs["random"][k] for k in ("wall_s", "load_avg_1m")},
            "mlflow_parent": runs["random"]["mlflow"],
        },
        # Where asha's pick ranks in the full search: 1 means it found the same best trial.
        "asha_best_rank_in_full_search": 1
        + sum(1 for s in full_scores.values() if s > full_scores[asha["best_trial"]]),
        "full_search_final_val_accuracy": full_scores,
        "sliced_vs_uninterrupted_val_accuracy": {i: [score, full_scores[i]] for i, score in sliced.items()},
        "same_trial_configs": True,
        "settings": {
            "num_trials": args.num_trials,
            "seed": args.seed,
            "base.loop.epochs": args.epochs,
            "asha.min_epochs": args.min_epochs,
            "asha.eta": args.eta,
            "max_concurrency": args.max_concurrency,
            "metric": METRIC,
            "model": "small_cnn",
            "dataset": "digits",
            "data.num_shards": 2,
            "scaling.num_workers": 1,
            "ray_cpus": args.ray_cpus,
            "search_space": [
                f"{s.path} {s.kind} " + (",".join(s.choices) if s.kind == "choice" else f"[{s.low:g}, {s.high:g}]")
                for s in search.search_space
            ],
            "workflow": "pyflyte run workflows/tuning.py tuning_pipeline (local execution)",
        },
    }
    emit("tuning_efficiency", result)


if __name__ == "__main__":
    main()
