"""training_core: PyTorch + Ray Train library behind the pipeline; never imports flytekit.

Importing the package is cheap: submodules import torch, ray and mlflow where they are used.

- ``config``: the typed config tree (``TrainingConfig``) and ``load_config``.
- ``datasets`` / ``data``: raw sources, sharded prep with a manifest, per-worker shard streams.
- ``models``: the model registry.
- ``loop``: ``train_loop_per_worker`` and ``train_step``.
- ``trainer``: ``fit`` runs the loop under ``TorchTrainer``.
- ``evaluation``: test-split metrics of a checkpoint.
- ``tracking``: MLflow runs and the Model Registry promotion gate.
- ``checkpoint`` / ``metrics``: checkpoint files and metric sinks.
"""

__version__ = "0.1.0"
