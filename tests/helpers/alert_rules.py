"""The Prometheus alert rules and their promtool unit tests, as committed."""

from __future__ import annotations

import yaml

from tests.conftest import REPO_ROOT

RULES_PATH = REPO_ROOT / "dashboards" / "alerts.rules.yml"
RULE_TESTS_PATH = REPO_ROOT / "dashboards" / "alerts.test.yml"


def alerts() -> list[dict]:
    """Every alerting rule of every group (recording rules left out)."""
    groups = yaml.safe_load(RULES_PATH.read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]
