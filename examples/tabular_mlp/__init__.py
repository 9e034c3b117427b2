"""An MLP classifier on a CSV table: a user workload (``workload.name:
examples.tabular_mlp.workload:TabularMLP``) that no built-in knows about."""
