"""Training: the loop (:mod:`~training_core.train.loop`, ``run_worker`` and its ``Trainer``) and the parts, each
with one job, that the ``Trainer`` hands its work to.

- :mod:`~training_core.train.step`: one optimizer step over micro-batches (``train_step``), precision, masking.
- :mod:`~training_core.train.meter`: the sums behind every record, and where the records go.
- :mod:`~training_core.train.accounting`: goodput, stragglers and the ETA at each log window and checkpoint.
- :mod:`~training_core.train.run_state`: where a run is, what a checkpoint holds of it, resume and writes.
- :mod:`~training_core.train.epoch_data`: the run's length, which samples an epoch trains, and what is left of them.
- :mod:`~training_core.train.model`: how a worker holds the model, and the trained model to MLflow.
- :mod:`~training_core.train.local_sgd`: local SGD's averaging and its per-rank replicas.
- :mod:`~training_core.train.guards`: out-of-memory retries, non-finite steps and weights, preemption.
- :mod:`~training_core.train.network_checks`: the job-start all-reduce probe and NCCL's network choice.
- :mod:`~training_core.train.batch_size`: ``loop.batch_size: auto``, the largest micro-batch that fits.
- :mod:`~training_core.train.optim`: optimizer and LR schedule, and how a resumed run follows a changed config.
- :mod:`~training_core.train.rng`: every rank's RNG streams, saved and restored (exact resume).
- :mod:`~training_core.train.preemption`: SIGTERM and Ray's preemption notice: the just-in-time checkpoint.
- :mod:`~training_core.train.failures`: why a run failed: infrastructure (worth a retry) or the user's own error.
"""
