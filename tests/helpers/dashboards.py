"""The committed Grafana dashboard, and its panels and queries."""

from __future__ import annotations

import json

from dashboards import build


def committed() -> dict:
    return json.loads(build.TRAINING_DASHBOARD_PATH.read_text(encoding="utf-8"))


def all_panels(panels: list[dict]) -> list[dict]:
    """Every panel, rows' nested panels included (Grafana nests them in collapsed rows)."""
    found = []
    for panel in panels:
        found.append(panel)
        found.extend(all_panels(panel.get("panels", [])))
    return found


def visual_panels(board: dict) -> list[dict]:
    return [panel for panel in all_panels(board["panels"]) if panel["type"] != "row"]


def panel_queries(board: dict) -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in visual_panels(board) for target in panel["targets"]]


def variable_queries(board: dict) -> list[tuple[str, str]]:
    return [
        (variable["name"], variable["query"]) for variable in board["templating"]["list"] if variable["type"] == "query"
    ]
