"""User code examples: packages that no built-in workload knows about, trained by naming them in a config
(``workload.name: examples.tabular_mlp.workload:TabularMLP``). See ``examples/README.md``."""
