"""The NCCL network check on NCCL's own INFO lines (the formats of NCCL 2.x logs), and the rules of the variables
that tell NCCL what to use. The check itself, after a real NCCL collective, is tests/gpu/test_nccl_network_on_gpu.py."""

from pathlib import Path

from tests.helpers.nccl_logs import FALLBACK_LOG
from training_core.parallel import nccl_network
from training_core.parallel.nccl_network import NcclNetwork, mismatch, parse

# Two nodes with InfiniBand: rank 0's log (abridged).
IB_LOG = """\
gpu01:4121:4121 [0] NCCL INFO Bootstrap : Using eth0:10.1.0.11<0>
gpu01:4121:4121 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so)
gpu01:4121:4160 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB eth0:10.1.0.11<0>
gpu01:4121:4160 [0] NCCL INFO Using network IB
gpu01:4121:4160 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
gpu01:4121:4160 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/IB/0
"""
# One node: the network is set up but every peer is reached through P2P or shared memory.
LOCAL_LOG = """\
node:77:77 [0] NCCL INFO NET/Socket : Using [0]eth0:172.17.0.2<0> [1]eth1:10.0.0.2<0>
node:77:90 [0] NCCL INFO Using network Socket
node:77:90 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
"""


def test_the_network_nccl_chose_is_read_from_its_log():
    assert parse(IB_LOG) == NcclNetwork(network="IB", devices=["mlx5_0", "mlx5_1"], inter_node=True)
    assert parse(FALLBACK_LOG) == NcclNetwork(network="Socket", devices=["eth0"], inter_node=True)
    assert parse(LOCAL_LOG) == NcclNetwork(network="Socket", devices=["eth0", "eth1"], inter_node=False)
    assert parse("gpu01:1:1 [0] NCCL INFO cudaDriverVersion 12040\n") is None  # nothing said: no verdict


def test_the_silent_fallback_to_sockets_is_named_with_the_variable_that_asked_for_infiniband():
    reason = mismatch(parse(FALLBACK_LOG), {"NCCL_IB_HCA": "mlx5_0,mlx5_1"})
    assert reason is not None and "NCCL_IB_HCA='mlx5_0,mlx5_1'" in reason and "fell back to Socket (eth0" in reason
    assert mismatch(parse(IB_LOG), {"NCCL_IB_HCA": "mlx5_0,mlx5_1"}) is None
    assert "NCCL_NET='IB'" in mismatch(parse(FALLBACK_LOG), {"NCCL_NET": "IB"})
    assert mismatch(parse(IB_LOG), {"NCCL_NET": "ib"}) is None
    assert "NCCL_IB_DISABLE=1" in mismatch(parse(IB_LOG), {"NCCL_IB_DISABLE": "1"})
    # Told nothing: whatever NCCL chose is what it was told.
    assert mismatch(parse(FALLBACK_LOG), {}) is None


def test_socket_interfaces_follow_nccl_socket_ifname_rules():
    fallback, local = parse(FALLBACK_LOG), parse(LOCAL_LOG)
    assert mismatch(fallback, {"NCCL_SOCKET_IFNAME": "eth"}) is None  # a prefix
    assert mismatch(fallback, {"NCCL_SOCKET_IFNAME": "ens,eth0"}) is None
    assert "NCCL_SOCKET_IFNAME='=eth'" in mismatch(fallback, {"NCCL_SOCKET_IFNAME": "=eth"})  # exact names
    assert mismatch(fallback, {"NCCL_SOCKET_IFNAME": "^docker,lo"}) is None  # exclusions
    assert "uses Socket (eth0, eth1" in mismatch(local, {"NCCL_SOCKET_IFNAME": "^eth1"})
    assert mismatch(parse(IB_LOG), {"NCCL_SOCKET_IFNAME": "ens"}) is None  # sockets are not the data path on IB


def test_a_worker_reads_its_own_processs_debug_file(tmp_path: Path):
    env = nccl_network.debug_env(str(tmp_path))
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_FILE"].endswith("nccl-debug.%h.%p.log")
    (tmp_path / "nccl-debug.gpu01.4121.log").write_text(IB_LOG)
    (tmp_path / "nccl-debug.gpu01.4122.log").write_text(FALLBACK_LOG)
    assert nccl_network.read(str(tmp_path), pid=4121).network == "IB"
    assert nccl_network.read(str(tmp_path), pid=4122).network == "Socket"
    assert nccl_network.read(str(tmp_path), pid=9999) is None
