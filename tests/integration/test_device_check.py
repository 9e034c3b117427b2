"""The GPU check (benchmarks/device_check.py) rehearsed on the CPU under the lent machine's constraints: Ray, Flyte
and MLflow unimportable in every process it starts, what it carries under 60 MiB with the repository, a hang or a
failure costing its part only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import device_check, device_wheels

REPO_ROOT = Path(__file__).resolve().parents[2]

GPU_ONLY_KEYS = (
    "fsdp_bf16_ok", "fp16_scaler_ok", "nccl_ok", "eval_on_gpu_ok", "batch_size_probe_ok", "device_copy_ok",
    "fast_path_ok", "nvml_ok", "gpt2_tokens_per_s", "gpt2_mfu", "gpt2_ratio", "oom_reduce_ok", "batch_size_auto_ok",
    "loader_gpu_utilisation", "carried_wheels_ok",
)  # fmt: skip

# Put first on PYTHONPATH, this runs in every Python process started with that environment (the check, its parts,
# pytest and its subprocesses, spawned ranks and bare loops): the device's missing packages are made missing here
# (``None`` in ``sys.modules``: ``import ray`` raises ModuleNotFoundError and ``importlib.util.find_spec`` answers
# None, as for a package that is not installed), and the process is logged. ``DEVICE_CHECK_HANG`` makes the part of
# that name hang, with a child of its own.
_SHIM = """
import os, sys

for _name in {blocked!r}:
    sys.modules[_name] = None
with open({log!r}, "a") as _log:
    _cmdline = open("/proc/self/cmdline", "rb").read().decode(errors="replace")
    _log.write(str(os.getpid()) + " " + " ".join(_cmdline.replace("\\0", " ").split()) + "\\n")
_hang = os.environ.get("DEVICE_CHECK_HANG")
if _hang and sys.argv[:1] != ["-c"] and "--part" in sys.argv and sys.argv[sys.argv.index("--part") + 1] == _hang:
    import subprocess, time

    _child = subprocess.Popen(["sleep", "600"])
    with open({log!r} + ".hung", "w") as _hung:
        _hung.write(f"{{os.getpid()}} {{_child.pid}}")
    time.sleep(600)
"""


def device_like_env(tmp_path: Path, **extra: str) -> tuple[dict[str, str], Path]:
    """The environment of a process on the lent machine: ray, flytekit and mlflow unimportable in it and in every
    Python process it starts. Returns it and the log of those processes."""
    shim, log = tmp_path / "shim", tmp_path / "processes.log"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(_SHIM.format(blocked=device_check.ABSENT_ON_DEVICE, log=str(log)))
    env = {**os.environ, "PYTHONPATH": str(shim), **extra}
    env.pop("RAY_ADDRESS", None)
    return env, log


def run_check(env: dict[str, str], *args: str, timeout_s: int = 900) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "device_check.py"), "--device", "cpu", *args],
        env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(done.stdout.strip().splitlines()[-1])


def test_the_shim_makes_the_missing_packages_unimportable_in_a_child_process(tmp_path):
    env, log = device_like_env(tmp_path)
    probe = "import importlib.util, sys\nfor n in ('ray', 'flytekit', 'mlflow'):\n" + (
        "    assert importlib.util.find_spec(n) is None, n\n"
        "    try:\n        __import__(n + '.sub')\n    except ModuleNotFoundError:\n        pass\n"
        "    else:\n        sys.exit(n + ' imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(log.read_text().splitlines()) == 1


def test_the_cpu_rehearsal_runs_every_part_without_ray_flytekit_or_mlflow_in_any_process(tmp_path, ray_session):
    carry = tmp_path / "carry"
    # The loader's JPEG shards are prepared as on the development machine: in Ray tasks (the session's cluster).
    device_wheels.build_loader_shards(carry / device_check.LOADER_SHARDS_DIR, images=24, num_shards=2)
    env, log = device_like_env(tmp_path)
    out = tmp_path / "out"
    # A budget that a loaded CI machine cannot exhaust: the test checks what runs, not how fast.
    done, summary = run_check(env, "--out", str(out), "--carry", str(carry), "--budget-s", "3000")

    assert summary == json.loads((out / device_check.SUMMARY_FILE).read_text())
    assert (out / device_check.LOG_FILE).stat().st_size > 0
    assert summary["environment"]["importable"] == {"ray": False, "flytekit": False, "mlflow": False}
    statuses = {name: part["status"] for name, part in summary["parts"].items()}
    assert list(statuses) == [part.name for part in device_check.PARTS]
    expected_ok = ("gpu_tests", "matmul_peak", "prepare", "resnet50", "gpt2_eager", "loader", "oom_reduce", "scaling")
    assert {name: statuses[name] for name in expected_ok} == dict.fromkeys(expected_ok, "ok"), summary["parts"]
    assert {s for name, s in statuses.items() if name not in expected_ok} == {"skipped"}, summary["parts"]
    for key in ("resnet50_images_per_s", "resnet50_ratio", "gpt2_eager_tokens_per_s", "gpt2_eager_mfu",
                "gpt2_eager_ratio", "matmul_peak_flops", "loader_gpu_ratio", "scaling_2"):  # fmt: skip
        assert summary[key] > 0, key
    assert summary["scaling_1"] == pytest.approx(1.0)
    for key in GPU_ONLY_KEYS:
        assert summary[key] is None and summary["notes"][key], key
    # The shim reached the processes the check started: its parts, pytest, and spawned ranks and bare loops.
    processes = log.read_text().splitlines()
    assert any("--part gpu_tests" in line for line in processes)
    assert any("pytest" in line for line in processes)
    assert sum("spawn_main" in line for line in processes) >= 4, processes


def test_a_hanging_part_is_stopped_with_its_children_and_the_next_part_still_runs(tmp_path):
    env, log = device_like_env(tmp_path, DEVICE_CHECK_HANG="gpu_tests")
    out = tmp_path / "out"
    _, summary = run_check(env, "--out", str(out), "--only", "gpu_tests", "nvml", "--max-part-s", "5")
    assert summary["parts"]["gpu_tests"]["status"] == "timeout"
    assert summary["notes"]["nccl_ok"].startswith("timeout: stopped at its limit of 5 s")
    assert summary["parts"]["nvml"]["status"] == "skipped"  # it ran after the hang: no NVML here
    assert summary["parts"]["prepare"] == {"status": "skipped", "seconds": 0.0, "reason": "not chosen (--only)"}
    hung = [int(pid) for pid in Path(str(log) + ".hung").read_text().split()]
    assert len(hung) == 2 and not [pid for pid in hung if running(pid)]


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, killed but not yet reaped by whoever inherited it, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_failing_part_reports_its_error_line_against_its_keys(tmp_path):
    env, _ = device_like_env(tmp_path)
    _, summary = run_check(env, "--out", str(tmp_path / "out"), "--only", "resnet50")  # nothing prepared its data
    assert summary["parts"]["resnet50"]["status"] == "failed"
    reason = summary["parts"]["resnet50"]["reason"]
    assert "Error" in reason.split(":", 1)[0] and summary["notes"]["resnet50_ratio"] == f"failed: {reason}"
    assert summary["resnet50_ratio"] is None


def test_pytests_cases_become_pass_fail_or_skipped_verdicts_with_the_first_line(tmp_path):
    (tmp_path / "test_fsdp_precision.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('device', ['cuda'])\n"
        "def test_bf16_trains(device):\n    pass\n"
        "def test_fp16_scales():\n    assert 1 == 2, 'scale stayed 65536.0'\n"
    )
    (tmp_path / "test_nccl_network_on_gpu.py").write_text(
        "import pytest\n@pytest.mark.skip(reason='no GPU on this machine')\ndef test_network():\n    pass\n"
    )
    report = tmp_path / "report.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path), "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=tmp_path, capture_output=True, timeout=120,
    )  # fmt: skip
    verdicts = device_check.gpu_test_verdicts(device_check.junit_cases(report))
    assert verdicts.values["fsdp_bf16_ok"] is True
    assert verdicts.values["fp16_scaler_ok"] is False
    assert "scale stayed 65536.0" in verdicts.notes["fp16_scaler_ok"]
    assert verdicts.values["nccl_ok"] is None and "no GPU on this machine" in verdicts.notes["nccl_ok"]
    assert verdicts.values["eval_on_gpu_ok"] is None
    assert verdicts.notes["eval_on_gpu_ok"] == "no case of tests/gpu/test_evaluate_device.py ran"


def test_the_carried_folder_and_the_tracked_files_stay_under_60_mib():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    tracked = sum((REPO_ROOT / p).stat().st_size for p in listed.decode().split("\0") if (REPO_ROOT / p).is_file())
    carried = device_wheels.folder_bytes(device_check.DEFAULT_CARRY) if device_check.DEFAULT_CARRY.is_dir() else 0
    assert tracked + carried < 60 * 2**20, f"tracked {tracked / 2**20:.1f} MiB + carried {carried / 2**20:.1f} MiB"


def test_the_wheels_carried_are_mlflows_client_at_the_projects_mlflow_pin():
    pins = device_wheels.project_pins()
    assert device_wheels.carried_requirements(pins) == [f"mlflow-skinny=={pins['mlflow']}"]
    assert device_wheels.carried_requirements(pins, ("mlflow", "flytekit"))[1] == f"flytekit=={pins['flytekit']}"
