"""Parallelism: process groups and collectives, FSDP sharding, the NCCL network check, and the Ray settings.

- :mod:`~training_core.parallel.distributed`: the worker runtimes (Ray Train's), metric all-reduces, buffer
  broadcasts, DDP all-reduce timing.
- :mod:`~training_core.parallel.sharding`: ``scaling.strategy``: a model's blocks, activation checkpointing, FSDP2.
- :mod:`~training_core.parallel.nccl_network`: which network NCCL chose, and whether it is the one asked for.
- :mod:`~training_core.parallel.ray_settings`: the Ray and process settings shipped to every Ray cluster.
"""
