"""What the Kubernetes manifest tests check in every pod spec: hardening rules and literal secrets."""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

from tests.conftest import REPO_ROOT

DEPLOYMENT_DIR = REPO_ROOT / "deployment"

# Names of settings whose values are credentials: they may only come from a Secret.
SECRET_NAME = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL|API_KEY", re.IGNORECASE)
# Credentials in text: an AWS access key id, a PEM key, a URL with an inline password that is not a $(VAR) reference.
SECRET_TEXT = re.compile(r"AKIA[0-9A-Z]{16}|-----BEGIN [A-Z ]*PRIVATE KEY-----|://[^/\s:@$]+:(?!\$\()[^@\s/]+@")


def pod_specs(obj: dict) -> Iterator[tuple[str, dict]]:
    """Every pod spec an object creates, with where it sits: workload templates, RayCluster head and worker
    groups, and the same inside a RayJob (plus its submitter pod template)."""
    kind, spec = obj["kind"], obj.get("spec", {})
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
        yield "template", spec["template"]["spec"]
    elif kind == "CronJob":
        yield "jobTemplate", spec["jobTemplate"]["spec"]["template"]["spec"]
    elif kind == "Pod":
        yield "pod", spec
    elif kind == "RayCluster":
        yield from _ray_cluster_pod_specs(spec, "")
    elif kind == "RayJob":
        yield from _ray_cluster_pod_specs(spec.get("rayClusterSpec", {}), "rayClusterSpec.")
        if "submitterPodTemplate" in spec:
            yield "submitterPodTemplate", spec["submitterPodTemplate"]["spec"]


def _ray_cluster_pod_specs(spec: dict, prefix: str) -> Iterator[tuple[str, dict]]:
    if "headGroupSpec" in spec:
        yield f"{prefix}headGroupSpec", spec["headGroupSpec"]["template"]["spec"]
    for group in spec.get("workerGroupSpecs", []):
        yield f"{prefix}workerGroupSpecs[{group['groupName']}]", group["template"]["spec"]


def hardening_violations(pod: dict) -> list[tuple[str, str]]:
    """(rule, detail) for every hardening rule ``pod`` breaks. Pod-level settings count for every container."""
    violations = []
    pod_sc = pod.get("securityContext", {})
    containers = pod.get("initContainers", []) + pod.get("containers", [])
    if not containers:
        violations.append(("containers", "the pod spec has no containers"))
    for container in containers:
        name = container.get("name", "?")
        sc = container.get("securityContext", {})

        def setting(key: str, sc: dict = sc) -> Any:
            return sc.get(key, pod_sc.get(key))

        if setting("runAsNonRoot") is not True or setting("runAsUser") == 0:
            violations.append(("runAsNonRoot", f"{name}: runAsNonRoot must be true (and runAsUser non-zero)"))
        if sc.get("allowPrivilegeEscalation") is not False:
            violations.append(("allowPrivilegeEscalation", f"{name}: allowPrivilegeEscalation must be false"))
        if sc.get("privileged"):
            violations.append(("privileged", f"{name}: privileged"))
        capabilities = sc.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            violations.append(("capabilities.drop", f"{name}: capabilities must drop ALL"))
        if capabilities.get("add"):
            violations.append(("capabilities.add", f"{name}: adds {capabilities['add']}"))
        if (setting("seccompProfile") or {}).get("type") != "RuntimeDefault":
            violations.append(("seccompProfile", f"{name}: seccompProfile must be RuntimeDefault"))
        if sc.get("readOnlyRootFilesystem") is not True:
            violations.append(("readOnlyRootFilesystem", f"{name}: readOnlyRootFilesystem must be true"))
        resources = container.get("resources", {})
        for bound in ("requests", "limits"):
            missing = {"cpu", "memory"} - set(resources.get(bound, {}))
            if missing:
                violations.append(("resources", f"{name}: resources.{bound} lacks {sorted(missing)}"))
        gpus = resources.get("limits", {}).get("nvidia.com/gpu") or resources.get("requests", {}).get("nvidia.com/gpu")
        if gpus:
            if not any(key.startswith("nvidia.com/gpu") for key in pod.get("nodeSelector", {})):
                violations.append(("gpu.nodeSelector", f"{name}: asks for GPUs without a nvidia.com/gpu* nodeSelector"))
            if not any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])):
                violations.append(
                    ("gpu.tolerations", f"{name}: asks for GPUs without tolerating the nvidia.com/gpu taint")
                )
    return violations


def secret_findings(obj: dict) -> list[str]:
    """Credential values in one object: a Secret with data, a credential-named env var or ConfigMap key with a
    literal value, or credential-looking text anywhere."""
    findings = []
    if obj.get("kind") == "Secret" and (obj.get("data") or obj.get("stringData")):
        findings.append("a Secret with values: create it out of band (deployment/README.md)")
    if obj.get("kind") == "ConfigMap":
        findings += [f"ConfigMap key {key}" for key in obj.get("data", {}) if SECRET_NAME.search(key)]
    for _, pod in pod_specs(obj):
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            for env in container.get("env", []):
                if SECRET_NAME.search(env["name"]) and "value" in env:
                    findings.append(f"{container['name']}: env {env['name']} has a literal value")
    text = json.dumps(obj)
    findings += [f"credential-like text {match!r}" for match in SECRET_TEXT.findall(text)]
    return findings
