"""Which network NCCL chose, and whether it is the one the job was told to use.

NCCL picks its transport silently: without RDMA devices in the pod (or their drivers, or the right
``NCCL_IB_HCA``) it falls back to TCP sockets, and a multi-node job runs at a fraction of the speed it was sized
for, with nothing in the logs unless ``NCCL_DEBUG=INFO`` was set. So a GPU worker sets NCCL's debug output to a
file of its own before the first collective (:func:`debug_env`; a user's own ``NCCL_DEBUG`` wins and the check is
off), reads back what NCCL logged at initialisation (:func:`read`), and compares it with the environment that told
NCCL what to use (:func:`mismatch`): ``NCCL_NET``, ``NCCL_IB_DISABLE``, ``NCCL_IB_HCA``, ``NCCL_SOCKET_IFNAME``
(``scaling.nccl_env`` and the pod's).

Contract: only NCCL's documented INFO lines are read (``NET/<name> : Using [0]<device> ...``, ``Using network
<name>``, channel connections ``via NET/<name>/<index>``); no line, no verdict. Nothing here imports torch.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEBUG_FILE_NAME = "nccl-debug.%h.%p.log"
"""NCCL expands ``%h`` to the host name and ``%p`` to the process id: one file per worker process."""

_USING_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.MULTILINE)
_NET_DEVICES = re.compile(r"NCCL INFO NET/(\S+) : Using (\[\d+\].*?)\s*$", re.MULTILINE)
_DEVICE = re.compile(r"\[\d+\](\S+?):")
_VIA_NET = re.compile(r"via NET/([^/\s]+)")


@dataclass(frozen=True)
class NcclNetwork:
    """What NCCL logged about its network at initialisation."""

    network: str
    """The network plugin NCCL chose (``IB``, ``Socket``, a plugin's name such as ``AWS Libfabric``)."""
    devices: list[str] = field(default_factory=list)
    """The devices that network uses: interfaces (``eth0``) for sockets, HCAs (``mlx5_0``) for InfiniBand/RoCE."""
    inter_node: bool = False
    """Whether any channel connects through the network (ranks on other nodes); False: all peers are local."""

    def describe(self) -> str:
        where = "between nodes" if self.inter_node else "set up, peers all on this node"
        return f"{self.network} ({', '.join(self.devices) or 'no device listed'}; {where})"


def debug_env(directory: str) -> dict[str, str]:
    """The environment that makes NCCL log its transport choice into ``directory`` (one file per process). Set it
    before the first NCCL collective of the process; NCCL reads it once."""
    return {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": os.path.join(directory, DEBUG_FILE_NAME),
    }


def parse(text: str) -> NcclNetwork | None:
    """NCCL's choice from its INFO log (one process's), or None when it logged none."""
    chosen = _USING_NETWORK.findall(text)
    listed = _NET_DEVICES.findall(text)
    if not chosen and not listed:
        return None
    network = chosen[-1] if chosen else listed[-1][0]
    using = [found.split(";")[0] for name, found in listed if name == network]  # "; OOB eth0": the bootstrap's
    devices = _DEVICE.findall(using[-1]) if using else []
    return NcclNetwork(network=network, devices=devices, inter_node=bool(_VIA_NET.search(text)))


def read(directory: str, pid: int | None = None) -> NcclNetwork | None:
    """Parse this process's (``pid``'s) NCCL debug file under ``directory``; None when there is none yet."""
    pid = os.getpid() if pid is None else pid
    paths = sorted(glob.glob(os.path.join(directory, f"nccl-debug.*.{pid}.log")))
    return parse("".join(Path(path).read_text(errors="replace") for path in paths)) if paths else None


def _interface_matches(device: str, spec: str) -> bool:
    """NCCL_SOCKET_IFNAME's rules: a comma-separated list of prefixes; ``=`` makes them exact names, ``^`` makes
    them exclusions."""
    exclude = spec.startswith("^")
    spec = spec.removeprefix("^")
    exact = spec.startswith("=")
    names = [n for n in spec.removeprefix("=").split(",") if n]
    hit = any(device == n if exact else device.startswith(n) for n in names)
    return not hit if exclude else hit


def mismatch(found: NcclNetwork, environ: Mapping[str, str]) -> str | None:
    """Why the network NCCL chose is not the one ``environ`` asked for, or None when it is (or nothing was asked).
    The reason names the variable, its value and what NCCL used."""
    net = environ.get("NCCL_NET", "")
    if net and net.lower() != found.network.lower():
        return f"NCCL_NET={net[:40]!r} asks for {net[:40]}, but NCCL uses {found.describe()}"
    if environ.get("NCCL_IB_DISABLE", "0") == "1" and found.network == "IB":
        return f"NCCL_IB_DISABLE=1 turns InfiniBand off, but NCCL uses {found.describe()}"
    hca = environ.get("NCCL_IB_HCA", "")
    if hca and environ.get("NCCL_IB_DISABLE", "0") != "1" and found.network != "IB":
        return (
            f"NCCL_IB_HCA={hca[:60]!r} asks for InfiniBand/RoCE, but NCCL fell back to {found.describe()}: the pod "
            "has no usable RDMA device (check the RDMA device plugin's resources and the HCA names)"
        )
    ifname = environ.get("NCCL_SOCKET_IFNAME", "")
    if ifname and found.network == "Socket":
        wrong = [d for d in found.devices if not _interface_matches(d, ifname)]
        if wrong or not found.devices:
            return f"NCCL_SOCKET_IFNAME={ifname[:60]!r}, but NCCL uses {found.describe()}"
    return None
