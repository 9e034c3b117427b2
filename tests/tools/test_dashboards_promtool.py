"""Every query of the Grafana dashboard is valid PromQL to promtool. Needs ``promtool`` on PATH (Debian's prometheus
package, which ``make test`` installs). The dashboard's checks that need no promtool are in
``tests/unit/test_dashboards.py``."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.helpers.dashboards import committed, panel_queries, variable_queries
from tests.helpers.executables import promtool


def test_every_panel_query_is_valid_promql_to_promtool(tmp_path) -> None:
    board = committed()
    rules = []
    for index, (_, expr) in enumerate(panel_queries(board) + variable_queries(board)):
        if expr.startswith("label_values("):
            expr = expr[len("label_values(") : expr.rindex(",")]
        concrete = re.sub(r"\$__rate_interval", "1m", expr)
        concrete = re.sub(r"\$\w+", ".*", concrete)
        rules.append({"record": f"dashboard:query_{index}", "expr": concrete})
    rule_file = tmp_path / "dashboard_queries.rules.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8")
    result = subprocess.run([promtool(), "check", "rules", str(rule_file)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
