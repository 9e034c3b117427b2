"""The per-worker exporter: catalogue, labels, NVML fallback, host counters, cost, delivery, config."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import subprocess
import sys
import threading

import pytest

from training_core import checkpoint as ckpt
from training_core.config import ObservabilityConfig, ScalingConfig, TrainingConfig
from training_core.runners.launch import free_port
from training_core.telemetry import (
    GpuReading,
    HostReading,
    HostSampler,
    JobLabels,
    NullTelemetry,
    NvmlGpus,
    PrometheusTelemetry,
    Timeline,
    build_telemetry,
    job_cost,
    mlflow_system_metrics,
)
from training_core.telemetry.catalog import JOB_LABELS, METRICS, PUSHGATEWAY_JOB, series_names
from training_core.telemetry.eta import Progress

LABELS = JobLabels(execution="exec-1", node="n0", attempt="1", rank="0", model="small_cnn")
RECORD = {
    "train_loss": 1.5,
    "train_accuracy": 0.25,
    "lr": 0.01,
    "grad_norm": 2.0,
    "samples_per_s": 640.0,
    "step_time_s": 0.1,
    "data_wait_s": 0.01,
    "allreduce_fraction": 0.2,
    "epoch": 0.0,
}


def _telemetry(labels: JobLabels = LABELS, **cfg) -> PrometheusTelemetry:
    return PrometheusTelemetry(
        ObservabilityConfig(**cfg), scaling=ScalingConfig(), labels=labels, world_size=2, start_threads=False
    )


def _value(telemetry: PrometheusTelemetry, name: str, **extra: str) -> float | None:
    return telemetry.registry.get_sample_value(name, {**telemetry.labels.as_dict(), **extra})


def test_the_registry_exports_exactly_the_catalogues_series_each_with_the_job_labels():
    telemetry = _telemetry()
    telemetry.step(duration_s=0.1, num_samples=32, data_wait_s=0.01, comm_s=0.02)
    telemetry.window(RECORD, global_step=1)
    telemetry.validation(loss=1.2, accuracy=0.5)
    telemetry.checkpoint_saved(duration_s=0.3, bytes_written=1000)
    telemetry.sample()

    families = {family.name: family for family in telemetry.registry.collect()}
    exported = {sample.name for family in families.values() for sample in family.samples}
    assert exported <= series_names()
    # Every metric of the catalogue is registered, with its kind and help; only GPU series lack samples here.
    by_name = {spec.name: spec for spec in METRICS}
    assert {f.name + ("_total" if f.type == "counter" else "") for f in families.values()} == set(by_name)
    for family in families.values():
        spec = by_name[family.name + ("_total" if family.type == "counter" else "")]
        assert (family.type, family.documentation) == (spec.kind, spec.help)
    without_gpu = {name for spec in METRICS if "gpu" not in spec.extra_labels for name in spec.series}
    assert exported == without_gpu
    for family in families.values():
        for sample in family.samples:
            assert {k: sample.labels[k] for k in JOB_LABELS} == LABELS.as_dict(), sample
    assert _value(telemetry, "training_step_duration_seconds_count") == 1
    assert _value(telemetry, "training_samples_total") == 32
    # Tokens: 0 for a workload without them (the record has no tokens_per_s), counted when a step reports them.
    assert _value(telemetry, "training_tokens_total") == 0 and _value(telemetry, "training_tokens_per_second") == 0
    telemetry.step(duration_s=0.1, num_samples=4, num_tokens=4 * 128, data_wait_s=0.0, comm_s=0.0)
    telemetry.window(RECORD | {"tokens_per_s": 5120.0}, global_step=2)
    assert _value(telemetry, "training_tokens_total") == 512 and _value(telemetry, "training_samples_total") == 36
    assert _value(telemetry, "training_tokens_per_second") == 5120.0
    assert _value(telemetry, "training_loss", split="val") == 1.2
    assert _value(telemetry, "training_data_wait_ratio") == pytest.approx(0.1)
    assert _value(telemetry, "training_checkpoint_written_bytes_total") == 1000
    assert _value(telemetry, "training_world_size") == 2
    telemetry.close(finished=True)
    assert _value(telemetry, "training_run_finished") == 1


def test_without_a_gpu_nvml_turns_off_with_one_info_log_and_training_gpus_is_zero(caplog):
    with caplog.at_level(logging.INFO, logger="training_core"):
        telemetry = _telemetry()
        telemetry.sample()
        telemetry.sample()
        telemetry.close(finished=True)
    nvml_logs = [r for r in caplog.records if "GPU metrics off" in r.getMessage()]
    assert len(nvml_logs) == 1 and nvml_logs[0].levelno == logging.INFO
    assert telemetry.gpus is None
    assert _value(telemetry, "training_gpus") == 0


def test_every_nvml_call_path_survives_nvmls_real_error_returns():
    import pynvml

    # A handle on an uninitialised NVML: each call below reaches the real library binding and gets its error.
    gpus = NvmlGpus(pynvml, {"0": None})
    gpus.watch_xid_errors()
    (reading,) = gpus.read()
    assert reading == GpuReading(gpu="0")  # every figure left out, nothing raised
    assert gpus.take_xid_errors() == {}
    gpus.close()
    assert NvmlGpus.open() is None


def test_importing_torch_and_the_nvml_binding_warns_nothing():
    # torch imports `pynvml` at import time: the deprecated `pynvml` shim package warned in every process of a run.
    found = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", "import torch, pynvml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0, found.stderr[-2000:]


def test_gpu_and_host_readings_go_to_mlflow_under_mlflows_system_metric_names():
    host = HostReading(
        cpu_utilization_ratio=0.5,
        memory_used_bytes=2e9,
        memory_total_bytes=8e9,
        network_received_bytes=3e6,
        network_transmitted_bytes=1e6,
        disk_read_bytes=0.0,
        disk_written_bytes=0.0,
    )
    gpu = GpuReading(gpu="1", utilization_ratio=0.9, memory_used_bytes=4e9, memory_total_bytes=16e9, power_watts=250.0)
    metrics = mlflow_system_metrics(host, [gpu])
    assert metrics == pytest.approx(
        {
            "system/cpu_utilization_percentage": 50.0,
            "system/system_memory_usage_megabytes": 2000.0,
            "system/system_memory_usage_percentage": 25.0,
            "system/network_receive_megabytes": 3.0,
            "system/network_transmit_megabytes": 1.0,
            "system/gpu_1_utilization_percentage": 90.0,
            "system/gpu_1_memory_usage_megabytes": 4000.0,
            "system/gpu_1_memory_usage_percentage": 25.0,
            "system/gpu_1_power_usage_watts": 250.0,
        }
    )


def test_host_byte_counters_grow_with_network_and_disk_traffic(tmp_path):
    telemetry = _telemetry()
    telemetry.sample()
    before = {
        name: _value(telemetry, name)
        for name in ("training_host_network_received_bytes_total", "training_host_disk_written_bytes_total")
    }
    payload = os.urandom(1 << 20)
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = threading.Thread(target=lambda: socket.create_connection(server.getsockname()).sendall(payload))
        sender.start()
        connection, _ = server.accept()
        received = 0
        while received < len(payload):
            received += len(connection.recv(1 << 16))
        connection.close()
        sender.join()
    with open(tmp_path / "blob", "wb") as f:
        f.write(payload * 4)
        f.flush()
        os.fsync(f.fileno())
    telemetry.sample()
    assert _value(telemetry, "training_host_network_received_bytes_total") >= before[
        "training_host_network_received_bytes_total"
    ] + len(payload)
    import psutil

    if psutil.disk_io_counters() is not None:  # some containers expose no disk statistics: the counter stays 0
        assert (
            _value(telemetry, "training_host_disk_written_bytes_total")
            > before["training_host_disk_written_bytes_total"]
        )
    assert 0 <= _value(telemetry, "training_host_cpu_utilization_ratio") <= 1
    assert (
        0 < _value(telemetry, "training_host_memory_used_bytes") < _value(telemetry, "training_host_memory_total_bytes")
    )
    reading = HostSampler().read()
    assert reading.network_received_bytes >= 0 and reading.disk_read_bytes >= 0


def test_job_cost_is_world_size_times_resources_times_wall_time_at_the_configured_prices():
    prices = ObservabilityConfig(gpu_hour_usd=2.0, cpu_hour_usd=0.1)
    gpu_job = ScalingConfig(num_workers=4, use_gpu=True, gpus_per_worker=2, cpus_per_worker=8)
    cost = job_cost(gpu_job, prices, wall_s=1800, prior={"gpu_hours": 1.0, "cpu_hours": 10.0})
    assert cost.gpu_seconds == 3600 + 4 * 2 * 1800
    assert cost.cpu_seconds == 36000 + 4 * 8 * 1800
    assert cost.summary() == pytest.approx(
        {
            "gpu_hours": 5.0,
            "cpu_hours": 26.0,
            "cost_usd": 5 * 2.0 + 26 * 0.1,
            "gpu_hour_usd": 2.0,
            "cpu_hour_usd": 0.1,
            "preemption_gpu_hours": 0.0,
            "preemption_cpu_hours": 0.0,
            "preemption_cost_usd": 0.0,
        }
    )
    cpu_only = job_cost(ScalingConfig(num_workers=2, cpus_per_worker=1.5), prices, wall_s=3600)
    assert (cpu_only.gpu_seconds, cpu_only.cpu_seconds, cpu_only.cost_usd) == (0.0, 3 * 3600, pytest.approx(0.3))
    # An elastic run going on with 3 of its 4 workers after a lost node pays for the 3 it holds.
    shrunk = job_cost(dataclasses.replace(gpu_job, min_workers=2), prices, wall_s=1800, num_workers=3)
    assert (shrunk.gpu_seconds, shrunk.cpu_seconds) == (3 * 2 * 1800, 3 * 8 * 1800)


def test_the_cost_splits_out_what_preemptions_lost_and_carries_it_over_restarts():
    prices = ObservabilityConfig(gpu_hour_usd=2.0, cpu_hour_usd=0.1)
    gpu_job = ScalingConfig(num_workers=4, use_gpu=True, gpus_per_worker=2, cpus_per_worker=8)
    earlier = {"gpu_hours": 3.0, "cpu_hours": 12.0, "preemption_gpu_hours": 0.5, "preemption_cpu_hours": 2.0}
    # This attempt: 1800 s held, of which its first 90 s (start-up after a preemption) trained nothing.
    cost = job_cost(gpu_job, prices, wall_s=1800, prior=earlier, lost_wall_s=90)
    assert cost.preemption_gpu_seconds == 0.5 * 3600 + 4 * 2 * 90
    assert cost.preemption_cpu_seconds == 2.0 * 3600 + 4 * 8 * 90
    assert cost.preemption_cost_usd == pytest.approx((0.5 + 8 * 90 / 3600) * 2.0 + (2.0 + 32 * 90 / 3600) * 0.1)
    assert cost.preemption_gpu_seconds < cost.gpu_seconds and cost.preemption_cost_usd < cost.cost_usd
    summary = cost.summary()
    assert summary["preemption_gpu_hours"] == pytest.approx(0.5 + 8 * 90 / 3600)

    # The exporter: the first step after a preemption's resume, 30 s after this attempt started.
    telemetry = _telemetry(gpu_hour_usd=2.0, cpu_hour_usd=0.1)
    telemetry.resumed({"cost": earlier}, global_step=40, elapsed_s=100.0, num_restarts=1, num_preemptions=1)
    lost_s = telemetry.preemption_recovered(first_step_unix=telemetry.started_unix + 30.0)
    assert lost_s == pytest.approx(30.0)
    # Two 1-CPU workers (the default scaling) held 30 s without training, on top of the earlier attempts' 2 h.
    assert _value(telemetry, "training_job_preemption_cpu_seconds_total") == pytest.approx(2.0 * 3600 + 2 * 30.0)
    # The earlier attempts' GPU-hours carry over; this CPU attempt adds none.
    assert _value(telemetry, "training_job_preemption_gpu_seconds_total") == pytest.approx(0.5 * 3600)
    saved = telemetry.snapshot()["cost"]
    assert saved["preemption_cpu_hours"] == pytest.approx(2.0 + 60 / 3600)
    assert saved["preemption_cpu_hours"] <= saved["cpu_hours"]
    telemetry.close(finished=False)
    other_rank = _telemetry(dataclasses.replace(LABELS, rank="1"))
    assert other_rank.preemption_recovered(first_step_unix=other_rank.started_unix + 5.0) == pytest.approx(5.0)
    assert _value(other_rank, "training_job_preemption_cpu_seconds_total") == 0.0  # rank 0 alone counts the job's
    other_rank.close(finished=False)


def test_cost_and_timeline_carry_over_a_restart_through_the_checkpoint_meta():
    first = _telemetry()
    first.sample()
    saved = first.snapshot()
    first.close(finished=False)
    assert set(saved) == {"samples", "sample_stride", "cost"} and len(saved["samples"]) == 1
    sample = saved["samples"][0]
    assert set(sample) == {
        "elapsed_s",
        "cpu_utilization",
        "memory_used_bytes",
        "gpu_utilization",
        "gpu_memory_used_bytes",
    }
    assert sample["gpu_utilization"] == {} and sample["gpu_memory_used_bytes"] == {}
    # Pretend the first attempt held its 2 workers for an hour: the next one starts from there.
    saved = {**saved, "cost": job_cost(ScalingConfig(), ObservabilityConfig(), wall_s=3600).summary()}
    meta = json.loads(json.dumps(saved))  # as it travels in meta.json
    second = _telemetry()
    second.resumed(meta, global_step=40, elapsed_s=100.0, num_restarts=2, num_preemptions=1)
    second.sample()
    after = second.snapshot()
    assert after["cost"]["cpu_hours"] >= 2.0 and after["cost"]["cost_usd"] >= 2.0 * 0.05
    assert _value(second, "training_job_cpu_seconds_total") >= 7200
    assert _value(second, "training_job_cost_usd") == pytest.approx(after["cost"]["cost_usd"], rel=1e-3)
    assert after["samples"][:1] == saved["samples"] and after["samples"][-1]["elapsed_s"] >= 100.0
    assert _value(second, "training_steps_total") == 40 and _value(second, "training_worker_restarts_total") == 2
    assert _value(second, "training_preemptions_total") == 1  # counted apart from the failure
    second.close(finished=True)
    other_rank = _telemetry(dataclasses.replace(LABELS, rank="1"))
    assert other_rank.snapshot() == {}  # rank 0 alone records the job's cost and timeline
    other_rank.close(finished=True)


def test_the_timeline_stays_bounded_and_spans_the_whole_run():
    timeline = Timeline(10)
    for i in range(1000):
        timeline.add({"elapsed_s": float(i)})
    times = [s["elapsed_s"] for s in timeline.samples]
    assert 4 <= len(times) < 10 and times[0] == 0.0 and times[-1] >= 800 and times == sorted(times)


def test_a_resumed_run_continues_its_timeline_at_the_interval_it_had_reached():
    # Without the stride in the checkpoint a resumed run sampled at every reading again: its part of the Deck's
    # timeline came 8x denser than the part before it.
    first = _telemetry(timeline_max_samples=8)
    for i in range(40):
        first.timeline.add({"elapsed_s": float(i)})
    saved = first.snapshot()
    first.close(finished=True)
    assert saved["sample_stride"] == first.timeline.stride == 8
    second = _telemetry(timeline_max_samples=8)
    second.resumed(saved, global_step=40, elapsed_s=40.0, num_restarts=1)
    for i in range(40, 56):
        second.timeline.add({"elapsed_s": float(i)})
    times = [s["elapsed_s"] for s in second.timeline.samples]
    assert times[: len(saved["samples"])] == [s["elapsed_s"] for s in saved["samples"]]
    assert times[len(saved["samples"]) :] == [47.0, 55.0]  # one reading in 8, as before the resume
    for stride in ("8", -1, 0, 2**41, None):  # a checkpoint is data: anything else restarts the thinning at 1
        third = _telemetry(timeline_max_samples=8)
        third.resumed({**saved, "sample_stride": stride}, global_step=40, elapsed_s=40.0, num_restarts=1)
        assert third.timeline.stride == 1, stride
        third.close(finished=True)
    second.close(finished=True)


def test_pushing_to_an_unreachable_gateway_warns_once_and_never_raises(caplog):
    telemetry = _telemetry(pushgateway_url=f"http://127.0.0.1:{free_port()}", push_timeout_s=1.0)
    with caplog.at_level(logging.WARNING, logger="training_core"):
        assert telemetry.push() is False
        assert telemetry.push() is False
        telemetry.close(finished=True)
    assert len([r for r in caplog.records if "pushing metrics" in r.getMessage()]) == 1


def test_nothing_is_pushed_without_a_url_and_disabled_observability_is_a_no_op():
    telemetry = _telemetry()
    assert telemetry.push() is False
    telemetry.close(finished=True)
    off = build_telemetry(ObservabilityConfig(enabled=False), scaling=ScalingConfig(), labels=LABELS, world_size=1)
    assert isinstance(off, NullTelemetry) and off.snapshot() == {}


def test_the_http_endpoint_serves_this_ranks_metrics_on_port_plus_rank():
    import urllib.request

    port = free_port(count=2)  # rank 1 serves port + 1
    telemetry = _telemetry(dataclasses.replace(LABELS, rank="1"), http_port=port)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/metrics", timeout=5).read().decode()
    finally:
        telemetry.close(finished=True)
    assert 'training_world_size{attempt="1",execution="exec-1",model="small_cnn",node="n0",rank="1"} 2.0' in body
    assert "_created" not in body


def test_the_pushgateway_url_falls_back_to_the_drivers_environment_and_travels_in_the_loop_config():
    from training_core.records import WorkerArgs

    environ = {"TRAINING_PUSHGATEWAY_URL": "http://gateway:9091"}
    assert ObservabilityConfig().resolved(environ).pushgateway_url == "http://gateway:9091"
    assert (
        ObservabilityConfig(pushgateway_url="http://mine:9091").resolved(environ).pushgateway_url == "http://mine:9091"
    )
    assert ObservabilityConfig().resolved({}).pushgateway_url == ""
    os.environ["TRAINING_PUSHGATEWAY_URL"] = "http://gateway:9091"
    try:
        args = WorkerArgs.build(TrainingConfig(), data_dir="d", checkpoint_root="r", run_name="run-7")
    finally:
        del os.environ["TRAINING_PUSHGATEWAY_URL"]
    assert args.config.observability.pushgateway_url == "http://gateway:9091"
    assert args.job_labels == {"execution": "run-7", "node": "local", "attempt": "0"}
    assert PUSHGATEWAY_JOB == "flyte_ray_training"


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [
        ("pushgateway_url", "gateway:9091", "http://pushgateway:9091"),
        ("push_interval_s", 0.0, "> 0"),
        ("push_timeout_s", -1.0, "> 0"),
        ("http_port", 70000, "1-65535"),
        ("sample_interval_s", 0.0, "> 0"),
        ("timeline_max_samples", 1, ">= 2"),
        ("gpu_hour_usd", -0.5, ">= 0"),
        ("cpu_hour_usd", -0.1, ">= 0"),
    ],
)
def test_invalid_observability_settings_name_the_field_the_value_and_the_fix(field, value, fix):
    with pytest.raises(ValueError) as error:
        TrainingConfig.from_dict({"observability": {field: value}})
    message = str(error.value)
    assert message.startswith(f"observability.{field}={value!r} is invalid") and fix in message


def test_an_http_port_whose_last_rank_would_pass_65535_is_refused_before_any_worker_binds():
    # Rank r serves on http_port + r: bind() of 65536 raised OverflowError in the last worker, not an OSError.
    raw = {"observability": {"http_port": 65535}, "scaling": {"num_workers": 2}, "data": {"num_shards": 2}}
    with pytest.raises(ValueError) as error:
        TrainingConfig.from_dict(raw)
    message = str(error.value)
    assert message.startswith("observability.http_port=65535 is invalid") and "use at most 65534" in message
    raw["observability"]["http_port"] = 65534
    assert TrainingConfig.from_dict(raw).observability.http_port == 65534


def test_a_checkpointers_real_outcomes_reach_the_save_counters(tmp_path):
    import torch

    telemetry = _telemetry()
    model = torch.nn.Linear(4, 2)
    meta = ckpt.CheckpointMeta(
        model_name="m", classes=["a", "b"], input_shape=[4], mean=[0.0], std=[1.0], epoch=0, global_step=1, config={}
    )
    good = ckpt.Checkpointer(ckpt.CheckpointStorage(str(tmp_path / "ok")), keep_last=1, observer=telemetry)
    good.save(1, good.stage(model=model, meta=meta))
    good.wait()
    (tmp_path / "blocked").write_text("a file where the checkpoint directory should go")
    bad = ckpt.Checkpointer(
        ckpt.CheckpointStorage(str(tmp_path / "blocked")), keep_last=1, observer=telemetry, max_consecutive_failures=5
    )
    bad.save(2, bad.stage(model=model, meta=meta))
    with pytest.raises(ckpt.CheckpointError):
        bad.wait()
    assert _value(telemetry, "training_checkpoint_saves_total") == 1
    assert _value(telemetry, "training_checkpoint_save_failures_total") == 1
    assert _value(telemetry, "training_checkpoint_written_bytes_total") == good.bytes_written > 0
    assert _value(telemetry, "training_checkpoint_save_duration_seconds_count") == 1
    telemetry.close(finished=True)


def test_checkpoint_meta_written_before_telemetry_existed_still_loads():
    old = {
        "model_name": "m",
        "classes": ["a"],
        "input_shape": [1],
        "mean": [0.0],
        "std": [1.0],
        "epoch": 0,
        "global_step": 3,
        "config": {},
    }
    meta = ckpt.CheckpointMeta(**old)
    assert (meta.telemetry, meta.elapsed_s) == ({}, 0.0)


def test_ports_picked_for_servers_are_free_consecutive_and_below_the_ephemeral_range():
    from training_core.runners.launch import _ephemeral_port_range

    low, _ = _ephemeral_port_range()
    for _ in range(20):
        first = free_port(count=3)
        assert 20000 <= first and first + 3 <= low
        with socket.socket() as a, socket.socket() as b, socket.socket() as c:
            for s, port in zip((a, b, c), range(first, first + 3)):
                s.bind(("0.0.0.0", port))


def test_an_ephemeral_range_starting_low_moves_the_picked_ports_above_it_and_one_covering_all_ports_is_named(
    monkeypatch,
):
    from training_core.runners import launch

    monkeypatch.setattr(launch, "_ephemeral_port_range", lambda: (1024, 64999))
    for _ in range(20):
        first = free_port(count=2)
        assert 65000 <= first and first + 2 <= 65536
    monkeypatch.setattr(launch, "_ephemeral_port_range", lambda: (1024, 65535))
    with pytest.raises(RuntimeError) as error:
        free_port()
    message = str(error.value)
    assert "ephemeral range 1024-65535" in message and "net.ipv4.ip_local_port_range" in message
    assert "start that range at 32768" in message


def test_goodput_counters_grow_by_each_categorys_increase_and_straggler_and_eta_gauges_follow_the_latest_window():
    from training_core.telemetry.goodput import AttemptGoodput, ExecutionGoodput, GoodputSeconds

    def execution(productive: float, checkpoint: float) -> ExecutionGoodput:
        seconds = GoodputSeconds(productive=productive, checkpoint=checkpoint, startup=2.0)
        return ExecutionGoodput((AttemptGoodput(0, 2, 100.0, 110.0, "running", seconds),))

    telemetry = _telemetry()
    telemetry.goodput(execution(6.0, 1.0))
    telemetry.goodput(execution(14.0, 1.0))  # a later window: the counters take the increase only
    assert _value(telemetry, "training_job_goodput_seconds_total", category="productive") == 14.0
    assert _value(telemetry, "training_job_goodput_seconds_total", category="checkpoint") == 1.0
    assert _value(telemetry, "training_job_goodput_seconds_total", category="hung") == 0.0
    assert _value(telemetry, "training_goodput_ratio") == pytest.approx(14.0 / 17.0)
    telemetry.stragglers({"compute": 1.0, "data": 0.0})
    telemetry.stragglers({"compute": 0.0, "data": 1.0})
    assert _value(telemetry, "training_straggler", cause="compute") == 0.0
    assert _value(telemetry, "training_straggler", cause="data") == 1.0
    telemetry.progress(
        Progress(
            global_step=60,
            total_steps=100,
            steps_per_s=2.0,
            overhead_per_step_s=0.1,
            eta_s=42.5,
            next_checkpoint_step=None,
            eta_checkpoint_s=None,
        )
    )
    assert _value(telemetry, "training_eta_seconds") == 42.5 and _value(telemetry, "training_total_steps") == 100
    assert _value(telemetry, "training_steps_per_second") == 2.0
    assert math.isnan(_value(telemetry, "training_eta_checkpoint_seconds"))  # none due
    telemetry.close(finished=False)
    other_rank = _telemetry(dataclasses.replace(LABELS, rank="1"))
    other_rank.goodput(execution(6.0, 1.0))  # rank 0 alone counts the job's
    assert _value(other_rank, "training_job_goodput_seconds_total", category="productive") == 0.0
    other_rank.close(finished=False)
    NullTelemetry().goodput(execution(1.0, 1.0))  # observability off: in step with the exporter, does nothing
