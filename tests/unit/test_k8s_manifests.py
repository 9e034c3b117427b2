"""Offline checks of the Kubernetes manifests under ``deployment/`` that need no ``kubectl``: every YAML file parses,
the hardening and secret checks catch what they should, and ``deployment.generate --check`` catches a stale file.

The rendered overlays (and the examples) are validated in ``tests/tools/test_k8s_manifests_kubectl.py``, with these
checks.
"""

from __future__ import annotations

import json
import shutil

import yaml

from deployment import generate
from tests.helpers.k8s_manifests import DEPLOYMENT_DIR, REPO_ROOT, hardening_violations, secret_findings


def test_every_yaml_file_under_deployment_parses():
    files = sorted(p for p in DEPLOYMENT_DIR.rglob("*") if p.suffix in (".yaml", ".yml"))
    assert len(files) >= 15, f"expected the kustomize tree under {DEPLOYMENT_DIR}, found {len(files)} YAML files"
    errors = []
    for path in files:
        try:
            docs = [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]
        except yaml.YAMLError as error:
            errors.append(f"{path.relative_to(REPO_ROOT)}: {error}")
            continue
        if not docs:
            errors.append(f"{path.relative_to(REPO_ROOT)}: no document")
    assert not errors, "\n".join(errors)


def test_the_hardening_check_reports_every_rule_an_unhardened_gpu_pod_breaks():
    pod = {"containers": [{"name": "train", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    rules = {rule for rule, _ in hardening_violations(pod)}
    assert rules == {
        "runAsNonRoot",
        "allowPrivilegeEscalation",
        "capabilities.drop",
        "seccompProfile",
        "readOnlyRootFilesystem",
        "resources",
        "gpu.nodeSelector",
        "gpu.tolerations",
    }


def test_the_secret_scan_flags_literal_credentials():
    leaky = {
        "kind": "Deployment",
        "metadata": {"name": "leaky"},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "app",
                            "env": [
                                {"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI"},
                                {"name": "DB_PASSWORD", "valueFrom": {}},
                            ],
                            "args": [
                                "--backend-store-uri=postgresql://mlflow:hunter2@db:5432/mlflow",
                                "--uri=postgresql://u:$(DB_PASSWORD)@db/x",
                            ],
                        }
                    ]
                }
            }
        },
    }
    findings = secret_findings(leaky)
    assert len(findings) == 2, findings
    assert "AWS_SECRET_ACCESS_KEY" in findings[0] and "hunter2" in findings[1]


def test_generate_check_fails_when_a_dashboard_changed(tmp_path, capsys):
    source = tmp_path / "dashboards"
    shutil.copytree(generate.DASHBOARDS_DIR, source)
    assert generate.main(["--check", "--dashboards", str(source)]) == 0
    dashboard = next(source.glob("*.json"))
    content = json.loads(dashboard.read_text(encoding="utf-8"))
    content["title"] = "changed"
    dashboard.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    assert generate.main(["--check", "--dashboards", str(source)]) == 1
    assert "grafana-dashboards.yaml is out of date" in capsys.readouterr().err
