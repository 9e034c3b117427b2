"""A real 2-worker training run pushes its metrics to a real Pushgateway, which a real Prometheus scrapes.

Both servers are Debian's binaries (``make system-packages``) on free 127.0.0.1 ports, with their data under
the session directory; the assertions go through Prometheus's HTTP query API, as a dashboard's would.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers.mlflow_db import seed_mlflow_db
from training_core.config import DataConfig, TrainingConfig
from training_core.data import Manifest, prepare
from training_core.runners.launch import free_port
from training_core.telemetry.catalog import PUSHGATEWAY_JOB, STEP_DURATION_BUCKETS_S

REPO_ROOT = Path(__file__).resolve().parents[2]
EXECUTION = "it-prometheus-exec"
JOB = {"execution": EXECUTION, "node": "n-train", "attempt": "0"}
SELECTOR = f'job="{PUSHGATEWAY_JOB}",execution="{EXECUTION}",node="n-train",attempt="0",model="small_cnn"'


@pytest.fixture(scope="module", autouse=True)
def _prometheus_installed() -> None:
    """`make test` installs both when missing: without them these tests fail, they do not skip."""
    if not (shutil.which("prometheus") and shutil.which("prometheus-pushgateway")):
        pytest.fail(
            "needs Debian's prometheus and prometheus-pushgateway: run `make system-packages` (make test does)",
            pytrace=False,
        )


def _wait_ready(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if urllib.request.urlopen(url, timeout=1).status == 200:
                return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{url} did not become ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


@pytest.fixture(scope="module")
def prometheus_stack(session_root: Path, request):
    """A Pushgateway and a Prometheus that scrapes it every second (``honor_labels``: the pushed labels win) and
    evaluates the committed alert rules every second."""
    root = session_root / f"prometheus-{free_port()}"
    root.mkdir()
    gateway_port, prometheus_port = free_port(), free_port()
    gateway_log = root / "pushgateway.log"
    gateway = subprocess.Popen(
        [
            "prometheus-pushgateway",
            f"--web.listen-address=127.0.0.1:{gateway_port}",
            f"--persistence.file={root / 'pushgateway.data'}",
        ],
        stdout=gateway_log.open("w"),
        stderr=subprocess.STDOUT,
    )
    request.addfinalizer(lambda: _stop(gateway))
    _wait_ready(f"http://127.0.0.1:{gateway_port}/-/ready", gateway, gateway_log)
    config = root / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{REPO_ROOT / 'dashboards' / 'alerts.rules.yml'}']\n"
        "scrape_configs:\n"
        "  - job_name: pushgateway\n    honor_labels: true\n    static_configs: "
        f"[{{targets: ['127.0.0.1:{gateway_port}']}}]\n"
    )
    prometheus_log = root / "prometheus.log"
    prometheus = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
        ],
        stdout=prometheus_log.open("w"),
        stderr=subprocess.STDOUT,
    )
    request.addfinalizer(lambda: _stop(prometheus))
    _wait_ready(f"http://127.0.0.1:{prometheus_port}/-/ready", prometheus, prometheus_log)
    return {"pushgateway": f"http://127.0.0.1:{gateway_port}", "prometheus": f"http://127.0.0.1:{prometheus_port}"}


def _query(prometheus: str, expr: str, *, at_unix: float | None = None) -> list[dict]:
    params = {"query": expr} if at_unix is None else {"query": expr, "time": f"{at_unix:.3f}"}
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode(params)}"
    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _by_rank(prometheus: str, expr: str) -> dict[str, float]:
    return {r["metric"]["rank"]: float(r["value"][1]) for r in _query(prometheus, expr)}


@pytest.fixture(scope="module")
def pushed_run(prometheus_stack, ray_session, tmp_path_factory) -> dict:
    """One short 2-worker training that pushes to the stack every second; Prometheus holds its final push."""
    from training_core import tracking
    from training_core.config import TrackingConfig
    from training_core.records import MlflowRun
    from training_core.runners.ray_train import fit

    tmp_path = tmp_path_factory.mktemp("pushed-run")
    data_dir = str(tmp_path / "data")
    prepare(DataConfig(dataset="synthetic", synthetic_num_samples=512, synthetic_image_size=8, num_shards=2), data_dir)
    cfg = TrainingConfig.from_dict(
        {
            "data": {"dataset": "synthetic", "synthetic_num_samples": 512, "synthetic_image_size": 8, "num_shards": 2},
            "model": {"name": "small_cnn"},
            "loop": {"epochs": 1, "batch_size": 16, "log_interval_steps": 2},
            "schedule": {"warmup_steps": 1},
            "checkpoint": {"interval_steps": 4},
            "observability": {
                "pushgateway_url": prometheus_stack["pushgateway"],
                "push_interval_s": 1.0,
                "sample_interval_s": 0.5,
            },
        }
    )
    tracking_uri, run_id = tracking.create_run(
        TrackingConfig(tracking_uri=seed_mlflow_db(tmp_path / "mlflow.db")), run_name="prometheus-it"
    )
    started_unix = time.time()
    result = fit(
        cfg,
        data_dir=data_dir,
        checkpoint_dir=str(tmp_path / "final"),
        run_name="prometheus-it",
        storage_path=str(tmp_path / "ray"),
        job_labels=JOB,
        mlflow_run=MlflowRun(tracking_uri=tracking_uri, run_id=run_id),
    )
    prometheus = prometheus_stack["prometheus"]
    # The final push lands in the Pushgateway at once; Prometheus has it after its next scrape.
    deadline = time.monotonic() + 30
    while _by_rank(prometheus, f"training_run_finished{{{SELECTOR}}}") != {"0": 1.0, "1": 1.0}:
        assert time.monotonic() < deadline, _query(prometheus, f"training_run_finished{{{SELECTOR}}}")
        time.sleep(0.5)
    return {
        "result": result,
        "data_dir": data_dir,
        "tracking_uri": tracking_uri,
        "run_id": run_id,
        "started_unix": started_unix,
        "finished_unix": time.time(),
    }


def test_a_two_worker_run_pushes_step_checkpoint_and_host_metrics_that_prometheus_serves_with_the_execution_labels(
    prometheus_stack,
    pushed_run,
):
    from mlflow.tracking import MlflowClient

    result, data_dir, tracking_uri, run_id = (pushed_run[k] for k in ("result", "data_dir", "tracking_uri", "run_id"))
    selector = SELECTOR
    steps = result.meta.global_step
    assert steps == Manifest.load(data_dir).steps_per_epoch(world_size=2, batch_size=16, grad_accum_steps=1)

    prometheus = prometheus_stack["prometheus"]
    both = {"0", "1"}
    assert _by_rank(prometheus, f"training_steps_total{{{selector}}}") == {"0": steps, "1": steps}
    assert _by_rank(prometheus, f"training_step_duration_seconds_count{{{selector}}}") == {"0": steps, "1": steps}
    sums = _by_rank(prometheus, f"training_step_duration_seconds_sum{{{selector}}}")
    assert set(sums) == both and all(v > 0 for v in sums.values())
    buckets = _query(prometheus, f'training_step_duration_seconds_bucket{{{selector},rank="0"}}')
    assert sorted(float(r["metric"]["le"]) for r in buckets) == [*STEP_DURATION_BUCKETS_S, float("inf")]
    assert max(float(r["value"][1]) for r in buckets) == steps  # the +Inf bucket holds every step
    throughput = _by_rank(prometheus, f"training_samples_per_second{{{selector}}}")
    assert set(throughput) == both and all(v > 0 for v in throughput.values())
    assert _by_rank(prometheus, f"training_samples_total{{{selector}}}") == {"0": steps * 16, "1": steps * 16}
    # Images have no tokens: the token series are there, at 0, for the Token throughput panel.
    assert _by_rank(prometheus, f"training_tokens_total{{{selector}}}") == {"0": 0, "1": 0}
    assert _by_rank(prometheus, f"training_tokens_per_second{{{selector}}}") == {"0": 0, "1": 0}
    assert _by_rank(prometheus, f"training_world_size{{{selector}}}") == {"0": 2, "1": 2}
    # The job-start all-reduce check, the same (slowest rank's) figures on both ranks.
    bandwidth = _by_rank(prometheus, f"training_allreduce_bus_bandwidth_bytes_per_second{{{selector}}}")
    latency = _by_rank(prometheus, f"training_allreduce_latency_seconds{{{selector}}}")
    assert bandwidth["0"] == bandwidth["1"] > 1e6 and 0 < latency["0"] == latency["1"] < 1

    # Rank 0 writes the checkpoints: every 4 steps and at the end of the epoch.
    saves = _by_rank(prometheus, f"training_checkpoint_saves_total{{{selector}}}")
    assert saves["0"] >= 2 and saves["1"] == 0
    assert _by_rank(prometheus, f"training_checkpoint_written_bytes_total{{{selector}}}")["0"] > 0
    assert _by_rank(prometheus, f"training_checkpoint_save_failures_total{{{selector}}}") == {"0": 0, "1": 0}
    assert _by_rank(prometheus, f"training_checkpoint_save_duration_seconds_count{{{selector}}}")["0"] == saves["0"]

    assert _by_rank(prometheus, f"training_gpus{{{selector}}}") == {"0": 0, "1": 0}
    for name in (
        "training_host_cpu_utilization_ratio",
        "training_host_memory_used_bytes",
        "training_host_network_received_bytes_total",
    ):
        assert set(_by_rank(prometheus, f"{name}{{{selector}}}")) == both, name
    cost_usd = _by_rank(prometheus, f"training_job_cost_usd{{{selector}}}")["0"]
    assert cost_usd > 0
    assert set(_by_rank(prometheus, f'training_accuracy{{{selector},split="val"}}')) == both

    # The same run's timeline and cost went into the final checkpoint for the Deck.
    telemetry = result.meta.telemetry
    assert telemetry["samples"] and telemetry["cost"]["cpu_hours"] > 0 and telemetry["cost"]["gpu_hours"] == 0
    assert all(r.elapsed_s > 0 for r in result.meta.step_log)

    # Rank 0 sent the same samples to MLflow's System Metrics, under MLflow's names, and the cost at the end.
    client = MlflowClient(tracking_uri)
    logged = client.get_run(run_id).data.metrics
    assert (
        logged["cost_usd"] == pytest.approx(cost_usd, rel=1e-9) and logged["cpu_hours"] > 0 and logged["gpu_hours"] == 0
    )
    cpu_history = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert len(cpu_history) >= 2
    host_cpu = _by_rank(prometheus, f'training_host_cpu_utilization_ratio{{{selector},rank="0"}}')["0"]
    assert max(cpu_history, key=lambda m: m.step).value == pytest.approx(host_cpu * 100, rel=1e-9)
    assert "system/system_memory_usage_megabytes" in logged and "system/network_receive_megabytes" in logged


def _dashboard_queries() -> list[tuple[str, str, str]]:
    """(row title, panel title, PromQL) of every panel target in every committed dashboard."""
    queries = []
    for path in sorted((REPO_ROOT / "dashboards").glob("*.json")):
        row_title = ""
        # A row is followed by its panels (an expanded row) or holds them (a collapsed one).
        for item in json.loads(path.read_text())["panels"]:
            if item.get("type") == "row":
                row_title = item["title"]
            for panel in [item, *item.get("panels", [])]:
                queries += [(row_title, panel["title"], target["expr"]) for target in panel.get("targets", [])]
    return queries


def _as_grafana_would(expr: str) -> str:
    """The query Grafana sends with this run selected in the variables and a 1-minute rate window."""
    return (
        expr.replace("$execution", EXECUTION)
        .replace("$model", ".*")
        .replace("$rank", ".*")
        .replace("$__rate_interval", "1m")
    )


def test_every_dashboard_query_and_alert_rule_evaluates_on_the_pushed_run_and_no_alert_fires_for_it(
    prometheus_stack, pushed_run
):
    prometheus = prometheus_stack["prometheus"]
    # A moment while both ranks were pushing and not yet finished, as a dashboard opened mid-run would see.
    both_running = f"count(training_run_finished{{{SELECTOR}}} == 0) == 2"
    params = {
        "query": both_running,
        "start": f"{pushed_run['started_unix']:.3f}",
        "end": f"{pushed_run['finished_unix']:.3f}",
        "step": "0.5",
    }
    body = json.loads(
        urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{urllib.parse.urlencode(params)}", timeout=5).read()
    )
    assert body["status"] == "success" and body["data"]["result"], f"Prometheus never saw both ranks running: {body}"
    mid_run_unix = float(body["data"]["result"][0]["values"][-1][0])

    queries = _dashboard_queries()
    assert len(queries) > 30
    rows = {row for row, _, _ in queries}
    for row, panel, expr in queries:
        expr = _as_grafana_would(expr)
        if row.startswith("GPU"):
            # No GPU on this machine: the panels must be empty, not fed by some other series.
            assert _query(prometheus, expr) == [], (panel, expr)
        elif row == "Cluster overview":
            # Running workers and jobs: present mid-run, gone once both ranks said they finished.
            assert _query(prometheus, expr, at_unix=mid_run_unix), (panel, expr, mid_run_unix)
            assert all(float(r["value"][1]) == 0 for r in _query(prometheus, expr)), (panel, expr)
        elif "training_run_finished" in expr:
            # Shown for running ranks only (the ETA): present mid-run.
            assert _query(prometheus, expr, at_unix=mid_run_unix), (row, panel, expr, mid_run_unix)
        else:
            assert _query(prometheus, expr), (row, panel, expr)
    assert {"Cluster overview", "Training progress", "Communication and data wait"} <= rows

    workers_up = next(expr for _, panel, expr in queries if panel == "Workers up")
    assert float(_query(prometheus, _as_grafana_would(workers_up), at_unix=mid_run_unix)[0]["value"][1]) == 2

    # The template variables' label_values() list this run.
    dashboard = json.loads((REPO_ROOT / "dashboards" / "training.json").read_text())
    for variable in dashboard["templating"]["list"]:
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", str(variable.get("query", "")).strip())
        if match:
            values = {r["metric"].get(match[2]) for r in _query(prometheus, _as_grafana_would(match[1]))}
            assert {"execution": EXECUTION, "model": "small_cnn", "rank": "0"}[match[2]] in values, variable["name"]

    # Prometheus loaded the committed alert rules and evaluated each without error; a healthy run fires none.
    # (TrainingCommunicationHigh may be pending: two ranks sharing 2 cores spend over half a step in all-reduce,
    # but it must hold for 15 minutes to fire.)
    rules = yaml.safe_load((REPO_ROOT / "dashboards" / "alerts.rules.yml").read_text())
    alert_names = {rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule}
    assert len(alert_names) == 10  # the nine before and TrainingStraggler
    loaded = json.loads(urllib.request.urlopen(f"{prometheus}/api/v1/rules?type=alert", timeout=5).read())["data"][
        "groups"
    ]
    evaluated = {rule["name"]: rule for group in loaded for rule in group["rules"]}
    assert set(evaluated) == alert_names
    for name, rule in evaluated.items():
        assert rule["health"] == "ok" and not rule.get("lastError"), (name, rule)
    alerts = json.loads(urllib.request.urlopen(f"{prometheus}/api/v1/alerts", timeout=5).read())["data"]["alerts"]
    assert [a for a in alerts if a["state"] == "firing"] == [], alerts


def _push_progress(pushgateway: str, *, execution: str, attempt: str, progress) -> None:
    """One rank 0's pushed metrics at a window of a run's attempt, through the real exporter."""
    from training_core.config import ObservabilityConfig, ScalingConfig
    from training_core.telemetry import JobLabels, PrometheusTelemetry

    labels = JobLabels(execution=execution, node="n-train", attempt=attempt, rank="0", model="small_cnn")
    telemetry = PrometheusTelemetry(
        ObservabilityConfig(pushgateway_url=pushgateway), scaling=ScalingConfig(), labels=labels, world_size=2,
        start_threads=False,
    )  # fmt: skip
    record = {"train_loss": 1.0, "train_accuracy": 0.5, "lr": 0.01, "grad_norm": 1.0, "samples_per_s": 64.0}
    telemetry.window(record | {"step_time_s": 0.5, "data_wait_s": 0.0, "allreduce_fraction": 0.1, "epoch": 1.0},
                     global_step=progress.global_step)  # fmt: skip
    telemetry.progress(progress)
    assert telemetry.push()


def test_remote_wait_prints_a_training_nodes_steps_rate_and_eta_read_from_prometheus_and_says_once_when_it_cannot(
    prometheus_stack, pushed_run
):
    from deployment.progress import ProgressWatch, read_progress
    from training_core.telemetry.eta import Progress

    prometheus = prometheus_stack["prometheus"]
    # Mid-run, a retried node: its first attempt's last push, then the running attempt's.
    execution = "it-watch-exec"
    for attempt, step in (("0", 40), ("1", 150)):
        progress = Progress(
            global_step=step, total_steps=400, steps_per_s=2.5, overhead_per_step_s=0.04, eta_s=(400 - step) * 0.44,
            next_checkpoint_step=200, eta_checkpoint_s=(200 - step) * 0.44,
        )  # fmt: skip
        _push_progress(prometheus_stack["pushgateway"], execution=execution, attempt=attempt, progress=progress)
    deadline = time.monotonic() + 30
    while [p.attempt for p in read_progress(prometheus, execution)] != ["1"]:
        assert time.monotonic() < deadline, read_progress(prometheus, execution)
        time.sleep(0.5)
    (running,) = read_progress(prometheus, execution)
    assert running.line() == "  n-train attempt 1: step 150/400 (38%), 2.5 steps/s, ETA 1m50s, next checkpoint in 22s"

    # The real 2-worker run's rank 0, after its last step: the whole run done, nothing left.
    lines: list[str] = []
    watch = ProgressWatch(prometheus, lines.append)
    watch.poll(EXECUTION)
    watch.poll(EXECUTION)  # nothing moved: no second line
    steps = pushed_run["result"].meta.global_step
    (line,) = lines
    assert re.fullmatch(rf"  n-train attempt 0: step {steps}/{steps} \(100%\), [0-9.e+]+ steps/s, ETA 0s", line), line

    # Without a Prometheus, or with one that does not answer: said once, and the phases go on being followed.
    closed = f"http://127.0.0.1:{free_port()}"
    for url, why in ((None, "pass --prometheus-url or set PROMETHEUS_URL"), (closed, f"Prometheus at {closed}")):
        told: list[str] = []
        watch = ProgressWatch(url, told.append)
        watch.poll(EXECUTION)
        watch.poll(EXECUTION)
        assert len(told) == 1 and why in told[0] and told[0].endswith("following the phases only"), told


def test_a_cuda_oom_on_an_early_step_is_counted_pushed_unfinished_and_fires_the_oom_alert(
    prometheus_stack, tmp_path, monkeypatch
):
    """The loop's real OOM path, in this process with one gloo rank. There is no GPU here, so the third
    ``train_step`` raises the exception CUDA raises; pushes are a minute apart, so Prometheus first sees the
    counter at 1 in the final push, which only the alert's "new series above zero" branch catches."""
    import torch

    from training_core.records import WorkerArgs
    from training_core.runners.launch import TorchDistributedRuntime
    from training_core.train import loop

    data_dir = str(tmp_path / "data")
    prepare(DataConfig(dataset="synthetic", synthetic_num_samples=256, synthetic_image_size=8, num_shards=1), data_dir)
    cfg = TrainingConfig.from_dict(
        {
            "data": {"dataset": "synthetic", "synthetic_num_samples": 256, "synthetic_image_size": 8, "num_shards": 1},
            "model": {"name": "small_cnn"},
            "loop": {"epochs": 1, "batch_size": 16},
            "scaling": {"num_workers": 1},
            "observability": {"pushgateway_url": prometheus_stack["pushgateway"], "push_interval_s": 60.0},
        }
    )
    real_train_step, calls = loop.train_step, []

    def train_step_that_runs_out_of_memory(**kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected: no GPU here)")
        return real_train_step(**kwargs)

    monkeypatch.setattr(loop, "train_step", train_step_that_runs_out_of_memory)
    execution = "it-oom-exec"
    args = WorkerArgs.build(
        cfg,
        data_dir=data_dir,
        checkpoint_root=str(tmp_path / "ckpt"),
        run_name="oom",
        job_labels={"execution": execution},
    )
    runtime = TorchDistributedRuntime.connect(
        rank=0,
        world_size=1,
        local_rank=0,
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        timeout_s=60,
        use_gpu=False,
        records_path=str(tmp_path / "records.jsonl"),
    )
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            loop.run_worker(args, runtime)
    finally:
        runtime.close()

    prometheus = prometheus_stack["prometheus"]
    selector = f'job="{PUSHGATEWAY_JOB}",execution="{execution}",rank="0"'
    deadline = time.monotonic() + 30
    # An earlier push (0 OOMs) may be what Prometheus scraped last: wait for the final one's count.
    while _by_rank(prometheus, f"training_gpu_oom_total{{{selector}}}") != {"0": 1}:
        assert time.monotonic() < deadline, "the final push after the OOM never reached Prometheus"
        time.sleep(0.5)
    assert _by_rank(prometheus, f"training_steps_total{{{selector}}}") == {"0": 2}
    assert _by_rank(prometheus, f"training_run_finished{{{selector}}}") == {"0": 0}

    def oom_alerts() -> list[dict]:
        alerts = json.loads(urllib.request.urlopen(f"{prometheus}/api/v1/alerts", timeout=5).read())["data"]["alerts"]
        return [
            a
            for a in alerts
            if a["labels"]["alertname"] == "TrainingGpuOutOfMemory" and a["labels"].get("execution") == execution
        ]

    while not any(a["state"] == "firing" for a in oom_alerts()):
        assert time.monotonic() < deadline, oom_alerts()
        time.sleep(0.5)
    assert oom_alerts()[0]["labels"]["severity"] == "critical"
