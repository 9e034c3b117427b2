"""Tests that run an external tool on the repository's files: ``promtool`` (alert rules, dashboard queries),
``kubectl kustomize`` (the Kubernetes manifests) and ``mount`` (a real tmpfs for a full disk). Each module says which
one it needs. ``make test`` installs promtool and kubectl (``make system-packages``), and their tests fail, not skip,
without them; ``mount`` comes with every Debian system."""
