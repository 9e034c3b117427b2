"""NCCL debug logs of real jobs, as NCCL writes them (``NCCL_DEBUG=INFO``)."""

# The same job where the pods had no RDMA device: NCCL fell back to TCP sockets without a warning.
FALLBACK_LOG = """\
gpu01:4121:4121 [0] NCCL INFO Bootstrap : Using eth0:10.1.0.11<0>
gpu01:4121:4160 [0] NCCL INFO NET/IB : No device found.
gpu01:4121:4160 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.0.11<0>
gpu01:4121:4160 [0] NCCL INFO Using network Socket
gpu01:4121:4160 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/Socket/0
"""
