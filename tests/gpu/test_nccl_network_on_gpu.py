"""The NCCL network check after a real collective: a fresh process with
:func:`training_core.parallel.nccl_network.debug_env`
runs an all-reduce, and the worker's reading of its own NCCL log names the network NCCL chose. The ``cpu`` case is
the CPU twin: on gloo there is no NCCL log, and the check gives no verdict instead of failing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from training_core.parallel import nccl_network

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine")),
]

_WORKER = """
import json, os, sys
import torch, torch.distributed as dist
from training_core.parallel import nccl_network

device, directory = sys.argv[1], sys.argv[2]
os.environ.update(nccl_network.debug_env(directory))  # before the first collective, as train_loop_per_worker does
backend = "nccl" if device == "cuda" else "gloo"
dist.init_process_group(backend, init_method="file://" + os.path.join(directory, "pg"), rank=0, world_size=1)
tensor = torch.ones(1024, device=device)
dist.all_reduce(tensor)
if device == "cuda":
    torch.cuda.synchronize()
found = nccl_network.read(directory)
print("FOUND " + json.dumps(None if found is None else found.__dict__))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("device", DEVICES)
def test_the_worker_reads_the_network_nccl_chose_after_its_first_collective(device, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _WORKER, device, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("FOUND ")]
    found = json.loads(line.removeprefix("FOUND "))
    if device == "cpu":
        assert found is None  # gloo: no NCCL, no verdict
        return
    network = nccl_network.NcclNetwork(**found)
    assert network.network, f"NCCL logged no network choice: {found}"
    print(f"NCCL network: {network.describe()}")
    assert nccl_network.mismatch(network, {}) is None
    reason = nccl_network.mismatch(network, {"NCCL_NET": "NoSuchNetwork"})
    assert reason is not None and f"NCCL uses {network.network}" in reason
