"""Grafana dashboards and Prometheus alert rules for the training metrics, kept as code.

``python -m dashboards.build`` writes ``dashboards/*.json`` from :mod:`dashboards.build`; the alert rules live
in ``dashboards/alerts.rules.yml`` with their ``promtool test rules`` cases in ``dashboards/alerts.test.yml``.
"""
