"""``loop.batch_size: auto``: the plan from measured memory, and probes that leave the model as they found it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers.memory import RSS_BASE
from training_core.config import TrainingConfig
from training_core.models import build_model
from training_core.train import batch_size
from training_core.workloads.protocol import classification_loss


def test_the_plan_is_the_largest_divisor_of_the_workers_share_that_fits():
    plan = batch_size.plan_micro_batch(96, fixed_bytes=1000, bytes_per_sample=10, budget_bytes=1500)
    assert (plan.micro_batch_size, plan.grad_accum_steps) == (48, 2)  # 50 would fit, but does not divide 96
    assert plan.predicted_bytes(48) == 1480 <= plan.budget_bytes
    whole = batch_size.plan_micro_batch(96, fixed_bytes=0, bytes_per_sample=1, budget_bytes=10**6)
    assert (whole.micro_batch_size, whole.grad_accum_steps) == (96, 1)


def test_a_budget_below_one_sample_names_the_setting_and_the_ways_out():
    with pytest.raises(ValueError, match=r"loop.memory_budget_gib=0.00: raise it, shard the model"):
        batch_size.plan_micro_batch(32, fixed_bytes=2**20, bytes_per_sample=1, budget_bytes=2**19)


def test_probes_grow_with_the_batch_and_leave_batchnorm_statistics_and_the_rng_as_they_were():
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=10, input_shape=(3, 16, 16))
    batches = tuple((torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,))) for n in (1, 2))
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    fixed, per_sample = batch_size.measure(
        model, classification_loss, batches, device=torch.device("cpu"), optimizer_name="sgd", momentum=0.9,
        no_sync=lambda m: contextlib.nullcontext(),
    )  # fmt: skip
    weights = sum(p.numel() * 4 for p in model.parameters())
    # Weights, gradients, momentum and the step's two temporaries, with the allocator's headroom.
    assert fixed == int(batch_size.CPU_ALLOCATOR_HEADROOM * 5 * weights)
    # ResNet-18 at 16 px saves a few hundred KB of activations per sample: far more than the head's inputs.
    assert 100_000 < per_sample < 20_000_000
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("loop", "field", "fix"),
    [
        ({"batch_size": "auto"}, "loop.batch_size=0", "set loop.global_batch_size"),
        ({"batch_size": "auto", "global_batch_size": 64, "grad_accum_steps": 2}, "loop.grad_accum_steps=2", "leave it"),
        ({"batch_size": 16, "global_batch_size": 64}, "loop.global_batch_size=64", "16 * 1 * 2 = 32"),
        ({"batch_size": "auto", "global_batch_size": 63}, "loop.global_batch_size=63", "a multiple of 2"),
        ({"oom_policy": "ignore"}, "loop.oom_policy='ignore'", "fail, reduce"),
    ],
)
def test_auto_batch_settings_that_cannot_hold_name_the_field_and_the_fix(loop, field, fix):
    with pytest.raises(ValueError) as excinfo:
        TrainingConfig.from_dict({"loop": loop})
    assert field in str(excinfo.value) and fix in str(excinfo.value)


def test_auto_is_stored_as_zero_and_round_trips():
    cfg = TrainingConfig.from_dict({"loop": {"batch_size": "auto", "global_batch_size": 64}})
    assert cfg.loop.batch_size == 0
    assert TrainingConfig.from_dict(cfg.to_dict()).loop.batch_size == 0


# Each step in a process of its own. The peak is the kernel's VmHWM, reset just before the run (``5`` to
# ``/proc/self/clear_refs``): ``ru_maxrss`` keeps the forking parent's RSS across exec, so under a large pytest process
# it read the parent's size and the growth 0. ``measure <data>`` prints a step's memory as the loop measures it;
# ``run <data> <budget>`` trains with that budget and prints how much the peak RSS grew over the RSS before the run.
_RSS_SCRIPT = r"""
import json, re, sys, tempfile
import torch
from training_core.config import TrainingConfig
from training_core.data import Manifest
from training_core.train.loop import run_worker
from training_core.records import WorkerArgs
from training_core.workloads import resolve_workload
from tests.helpers.memory import RSS_BASE, measured_step_memory
from tests.helpers.runtime import InProcessRuntime

mode, data_dir = sys.argv[1], sys.argv[2]
if mode == "measure":
    fixed, per_sample = measured_step_memory(TrainingConfig.from_dict(RSS_BASE), data_dir)
    print("RESULT " + json.dumps({"fixed": fixed, "per_sample": per_sample}))
else:
    auto = TrainingConfig.from_dict(
        {**RSS_BASE, "loop": {**RSS_BASE["loop"], "batch_size": "auto", "global_batch_size": 64,
         "memory_budget_gib": float(sys.argv[3]) / 2**30}}
    )
    # What the run imports (torchvision's models, fsspec) is the process's, not the step's: imported before the count.
    import fsspec
    manifest, workload = Manifest.load(data_dir), resolve_workload(auto.workload)
    with torch.device("meta"):
        workload.build_model(auto, manifest)
    def status_bytes(key):
        return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS
    before = status_bytes("VmRSS")
    run_worker(WorkerArgs.build(auto, data_dir=data_dir, checkpoint_root=tempfile.mkdtemp(), run_name="rss"),
               InProcessRuntime())
    peak = status_bytes("VmHWM")
    print("RESULT " + json.dumps({"growth": peak - before}))
"""


def _rss_step(*args: str) -> tuple[dict, str]:
    import json
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    done = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT ")), done.stderr


def test_on_cpu_an_auto_batch_run_stays_within_its_memory_budget_by_peak_rss(tmp_path):
    """A ResNet-18 (32 px) with a budget that fits 16 samples of a global batch of 64: the run's peak RSS grows by
    no more than the budget over what its process held before (weights, gradients, AdamW, the checkpoint's copy and
    the activations all count)."""
    from training_core.data import prepare

    data_dir = str(tmp_path / "data")
    prepare(TrainingConfig.from_dict(RSS_BASE).data, data_dir)
    measured, _ = _rss_step("measure", data_dir)
    budget = measured["fixed"] + 20 * measured["per_sample"]  # fits 16 of the global 64, not 32
    result, log = _rss_step("run", data_dir, str(budget))
    assert "loop.batch_size=auto: micro-batch 16, 4 accumulation step(s)" in log
    print(f"peak RSS growth {result['growth'] / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB")
    # More than the weights alone (the run really allocated after the measurement), no more than the budget.
    assert measured["fixed"] / 9 < result["growth"] <= budget
