"""Runners: what starts the workers that run the loop, and what ends the processes they leave.

- :mod:`~training_core.runners.ray_train`: ``fit``, the loop under Ray Train's ``TorchTrainer``, and its final
  checkpoint.
- :mod:`~training_core.runners.launch`: the same loop under plain ``torch.distributed``, without Ray.
- :mod:`~training_core.runners.ray_tasks`: plain Ray tasks of one CPU, a bounded number at a time.
- :mod:`~training_core.runners.ray_processes`: the processes of one Ray Train run, and ending those that outlive it.
- :mod:`~training_core.runners.ray_tune`: the ``ray_tune`` search strategy, one Ray Tune ``Tuner`` for a search.
"""
