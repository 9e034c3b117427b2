"""The Grafana dashboard is generated code: the committed JSON is what the builder writes, its queries read only
series the exporter produces, and its layout is the six rows operators expect. promtool's check of the queries is
in ``tests/tools/test_dashboards_promtool.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dashboards import build
from dashboards.promql import metric_names
from tests.helpers.dashboards import all_panels, committed, panel_queries, variable_queries, visual_panels
from training_core.telemetry.catalog import series_names

DASHBOARD_DIR = Path(build.__file__).resolve().parent

EXPECTED_ROWS = {
    "Cluster overview": ["Workers up", "GPUs in use", "Running jobs", "World size"],
    "GPU metrics per GPU": [
        "GPU utilisation",
        "GPU memory used vs total",
        "GPU temperature",
        "GPU power",
        "GPU clock throttling",
        "GPU XID errors",
    ],
    "Training progress": [
        "Loss",
        "Accuracy",
        "Throughput",
        "Token throughput",
        "Learning rate",
        "Gradient norm",
        "Non-finite steps",
        "Epoch and global step",
    ],
    "Communication and data wait": [
        "Communication share of step time",
        "Data wait share of step time",
        "All-reduce and data wait seconds per second",
        "Step duration p50 / p95",
        "All-reduce check at job start",
    ],
    "Checkpoints, system health and cost": [
        "Job cost",
        "GPU-hours",
        "CPU-hours",
        "Checkpoint save duration p50 / p95",
        "Checkpoint saves and failures",
        "Checkpoint bytes written",
        "Worker restarts, preemptions and GPU OOMs",
        "Host CPU",
        "Host memory used vs total",
        "Host network",
        "Host disk",
    ],
    "Goodput, stragglers and progress": [
        "Worker-hours by category",
        "Goodput ratio",
        "Straggling ranks",
        "Time to the end of the run",
    ],
}


def test_committed_dashboard_json_is_exactly_what_the_builder_generates() -> None:
    for path, text in build.rendered_dashboards().items():
        assert path.exists(), f"{path} is missing: run `{build.REGENERATE_COMMAND}` and commit it"
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.name} differs from what dashboards/build.py generates: run `{build.REGENERATE_COMMAND}` and "
            "commit it"
        )


def test_every_dashboard_json_in_the_directory_comes_from_the_builder() -> None:
    assert sorted(DASHBOARD_DIR.glob("*.json")) == sorted(build.rendered_dashboards())


def test_building_twice_gives_identical_bytes() -> None:
    assert build.render(build.build_training_dashboard()) == build.render(build.build_training_dashboard())


def test_check_mode_fails_on_a_stale_file_and_a_regeneration_fixes_it(tmp_path, monkeypatch, capsys) -> None:
    target = tmp_path / "training.json"
    target.write_text("{}\n", encoding="utf-8")
    monkeypatch.setattr(build, "TRAINING_DASHBOARD_PATH", target)

    assert build.main(["--check"]) == 1
    assert target.read_text(encoding="utf-8") == "{}\n"
    assert build.REGENERATE_COMMAND in capsys.readouterr().err

    assert build.main([]) == 0
    assert build.main(["--check"]) == 0
    assert target.read_text(encoding="utf-8") == build.TRAINING_DASHBOARD_PATH.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        (
            "histogram_quantile(0.95, sum by (le, rank) "
            '(rate(training_step_duration_seconds_bucket{execution=~"$execution"}[$__rate_interval])))',
            {"training_step_duration_seconds_bucket"},
        ),
        (
            'sum(a_total{path="x{y}", le="0.5"}) without (gpu) / on(execution) group_left(model) b_bytes offset '
            "1h30m > 1e3",
            {"a_total", "b_bytes"},
        ),
        (
            "time() - last_push > 120 and on(execution, node, attempt, rank) finished == bool 0",
            {"last_push", "finished"},
        ),
        (
            '{__name__="named_total", job="x"} # comment naming not_a_metric\n+ rate(c[5m:30s]) * 0x1F unless d @ 100',
            {"named_total", "c", "d"},
        ),
        ('label_replace(up, "dst", "$1", "src", "(.*)") or vector(0) + Inf - NaN', {"up"}),
        ("sum by (execution) (x) and sum(y) by (model)", {"x", "y"}),
        ('label_values(training_world_size{model=~"$model"}, execution)', {"training_world_size"}),
        ("label_values(execution)", set()),
        ("count_values('value', x:recorded:rate5m{a='b'})", {"x:recorded:rate5m"}),
    ],
    ids=[
        "histogram-quantile",
        "matchers-grouping-offset-number",
        "time-and-bool",
        "name-matcher-comment-subquery-hex",
        "strings-and-special-floats",
        "by-after-aggregation",
        "grafana-label-values",
        "label-values-without-selector",
        "single-quotes-and-colons",
    ],
)
def test_the_metric_name_extractor_finds_metrics_and_nothing_else(expr: str, expected: set[str]) -> None:
    assert metric_names(expr) == expected


def test_every_panel_query_names_only_catalogue_metrics() -> None:
    catalogue = series_names()
    queries = panel_queries(committed())
    assert len(queries) >= 30
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"panel {title!r} reads no metric: {expr}"
        assert names <= catalogue, (
            f"panel {title!r} names {sorted(names - catalogue)}, not in training_core.telemetry.catalog: {expr}"
        )


def test_every_template_variable_query_names_only_catalogue_metrics() -> None:
    variables = dict(variable_queries(committed()))
    assert sorted(variables) == ["execution", "model", "rank"]
    for name, query in variables.items():
        assert query.startswith("label_values(") and query.rstrip(")").endswith(name)
        assert metric_names(query) and metric_names(query) <= series_names(), f"variable {name}: {query}"


def test_the_dashboard_has_a_prometheus_datasource_variable() -> None:
    variables = {variable["name"]: variable for variable in committed()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_every_panel_has_the_datasource_variable_a_unit_and_queries_filtered_by_execution_and_model() -> None:
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    for panel in visual_panels(committed()):
        assert panel["datasource"] == datasource, panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), f"panel {panel['title']!r} has no unit"
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"] == datasource, panel["title"]
            assert "$execution" in target["expr"] and "$model" in target["expr"], (panel["title"], target["expr"])


def test_the_dashboard_has_the_six_rows_with_their_panels_in_order() -> None:
    rows: dict[str, list[str]] = {}
    current = None
    for panel in committed()["panels"]:
        if panel["type"] == "row":
            current = panel["title"]
            rows[current] = [nested["title"] for nested in panel.get("panels", [])]
        else:
            assert current is not None, f"panel {panel['title']!r} sits above the first row"
            rows[current].append(panel["title"])
    assert rows == EXPECTED_ROWS


def test_units_match_what_the_panels_show() -> None:
    units = {panel["title"]: panel["fieldConfig"]["defaults"]["unit"] for panel in visual_panels(committed())}
    assert units["GPU utilisation"] == "percentunit"
    assert units["GPU memory used vs total"] == "bytes"
    assert units["GPU temperature"] == "celsius"
    assert units["GPU power"] == "watt"
    assert units["Step duration p50 / p95"] == "s"
    assert units["Job cost"] == "currencyUSD"
    assert units["GPU-hours"] == units["CPU-hours"] == "h"
    assert units["All-reduce check at job start"] == "Bps"


def test_panel_ids_are_unique_and_panels_stay_inside_the_24_column_grid() -> None:
    panels = all_panels(committed()["panels"])
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
