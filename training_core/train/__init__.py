"""Training: the loop (:mod:`~training_core.train.loop`, ``run_worker`` and its ``Trainer``) and the parts, each
with one job, that the ``Trainer`` hands its work to (README.md's module map lists them)."""
