"""The Prometheus alert rules have a promtool unit test with one firing and one non-firing case per alert at least,
read only catalogue metrics, and each links to its runbook section. That promtool accepts them and their unit tests
pass is checked in ``tests/tools/test_alert_rules_promtool.py``."""

from __future__ import annotations

import re

import yaml

from dashboards.promql import metric_names
from tests.conftest import REPO_ROOT
from tests.helpers.alert_rules import RULE_TESTS_PATH, RULES_PATH, alerts
from training_core.telemetry.catalog import series_names

RUNBOOK_PATH = REPO_ROOT / "deployment" / "runbook.md"

# Other components (the PrometheusRule, docs) refer to these names.
EXPECTED_ALERTS = {
    "TrainingWorkerLost",
    "TrainingWorkerRestarts",
    "TrainingGpuOutOfMemory",
    "TrainingNonFiniteSteps",
    "TrainingStalled",
    "TrainingCheckpointFailures",
    "TrainingCommunicationHigh",
    "TrainingGpuUtilizationLow",
    "TrainingGpuTemperatureHigh",
    "TrainingStraggler",
}


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _runbook_sections() -> dict[str, str]:
    return {
        _github_anchor(m.group(1)): m.group(1).strip()
        for m in re.finditer(r"^##\s+(.+)$", RUNBOOK_PATH.read_text(encoding="utf-8"), re.MULTILINE)
    }


def test_the_rule_file_has_exactly_the_alerts_other_components_name() -> None:
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names))
    assert set(names) == EXPECTED_ALERTS


def test_every_alert_has_a_firing_and_a_non_firing_unit_test_case() -> None:
    spec = yaml.safe_load(RULE_TESTS_PATH.read_text(encoding="utf-8"))
    assert spec["rule_files"] == [RULES_PATH.name]
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in spec["tests"]:
        for case in test.get("alert_rule_test", []):
            expected = case.get("exp_alerts") or []
            if not expected:
                quiet.add(case["alertname"])
                continue
            firing.add(case["alertname"])
            for alert in expected:
                assert alert.get("exp_labels", {}).get("severity"), (
                    f"{case['alertname']}: firing case without exp_labels"
                )
                assert set(alert.get("exp_annotations", {})) >= {"summary", "description", "runbook_url"}, case[
                    "alertname"
                ]
    names = {rule["alert"] for rule in alerts()}
    assert names - firing == set(), "alerts without a firing case"
    assert names - quiet == set(), "alerts without a non-firing case"


def test_every_alert_expression_names_only_catalogue_metrics() -> None:
    catalogue = series_names()
    for rule in alerts():
        names = metric_names(rule["expr"])
        assert names, f"{rule['alert']} reads no metric"
        assert names <= catalogue, (
            f"{rule['alert']} names {sorted(names - catalogue)}, not in training_core.telemetry.catalog"
        )


def test_every_alert_has_a_severity_a_summary_a_description_and_a_runbook_section() -> None:
    sections = _runbook_sections()
    for rule in alerts():
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        annotations = rule["annotations"]
        assert annotations["summary"].strip() and annotations["description"].strip(), name
        path, _, anchor = annotations["runbook_url"].partition("#")
        assert path == "deployment/runbook.md", name
        assert anchor in sections, f"{name}: runbook has no section for #{anchor}"
        assert sections[anchor] == name, f"{name} links to the section of {sections[anchor]}"


def test_the_runbook_has_one_section_per_alert_and_no_other() -> None:
    assert set(_runbook_sections().values()) == {rule["alert"] for rule in alerts()}


def test_gauge_alerts_ignore_ranks_that_have_finished() -> None:
    # The Pushgateway keeps serving a finished rank's last gauges; without this guard they would fire forever.
    counters = {
        "TrainingWorkerRestarts",
        "TrainingGpuOutOfMemory",
        "TrainingNonFiniteSteps",
        "TrainingCheckpointFailures",
    }
    for rule in alerts():
        if rule["alert"] not in counters:
            assert "training_run_finished == 0" in rule["expr"], rule["alert"]
