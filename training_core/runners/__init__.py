"""Runners: what starts the workers that run the loop (Ray Train, plain ``torch.distributed``, Ray tasks, Ray Tune),
and what ends the processes they leave (README.md's module map lists the modules)."""
