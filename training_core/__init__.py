"""training_core: the PyTorch + Ray library behind the pipeline; never imports flytekit.

Importing the package is cheap: submodules import torch, ray and mlflow where they are used. Each subpackage's
``__init__`` says its one job in its first line and lists its modules.

- ``config/``: the typed config tree (``TrainingConfig``) and the one way it is read (``load_config``).
- ``data/``: raw sources, sharded prep with a manifest, shard streams and the per-worker loader.
- ``workloads/``: the workload seam (``Workload``), the built-ins and users' code.
- ``train/``: the training loop and the parts it hands its jobs to.
- ``parallel/``: process groups and collectives, FSDP sharding, the NCCL check, the Ray settings.
- ``runners/``: what starts the workers (Ray Train, plain ``torch.distributed``, Ray tasks, Ray Tune).
- ``checkpoint/``: checkpoints written, stored, verified, read back and restored.
- ``telemetry/``: Prometheus telemetry of a worker, goodput, stragglers and the ETA.
- Modules: ``registry`` (what users and contributors add), ``schema`` (the schema layer of everything read),
  ``messages`` (error wording), ``records`` (typed records across modules), ``files`` (reading users' files),
  ``redact``, ``models``, ``pretrained``, ``eval_sums``, ``evaluation``, ``tracking`` (MLflow), ``metrics`` (sinks),
  ``tuning``, ``scaling_benchmark``.
"""

__version__ = "0.1.0"
