"""Parallelism: process groups and collectives, FSDP sharding, the NCCL network check, and the Ray settings
(README.md's module map lists the modules)."""
