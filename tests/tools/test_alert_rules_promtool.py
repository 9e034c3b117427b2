"""promtool accepts the Prometheus alert rules and their promtool unit tests pass. Needs ``promtool`` on PATH
(Debian's prometheus package, which ``make test`` installs). The checks of the rule file that need no promtool are in
``tests/unit/test_alert_rules.py``."""

from __future__ import annotations

import subprocess

from tests.helpers.alert_rules import RULE_TESTS_PATH, RULES_PATH, alerts
from tests.helpers.executables import promtool


def test_promtool_check_rules_accepts_the_rule_file() -> None:
    result = subprocess.run([promtool(), "check", "rules", str(RULES_PATH)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    result = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS_PATH.name],
        cwd=RULE_TESTS_PATH.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
