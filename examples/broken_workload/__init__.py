"""A user workload that breaks the protocol on purpose: what a bad ``workload.name`` looks like when it fails."""
