"""Offline validation of the Kubernetes manifests under ``deployment/``. Needs ``kubectl`` on PATH (``make test``
installs it through ``make system-packages`` where apt offers it).

Every overlay (and the examples) is rendered with ``kubectl kustomize``. Built-in kinds validate strictly with
``kubernetes-validate``; custom resources validate against their CRDs' schemas from ``../shared/crds`` with
``jsonschema``. The pod specs are checked for hardening, the manifests for secret material, and the generated
alert rules and dashboards against ``dashboards/``. The checks that need no ``kubectl``, and the hardening and secret
checks themselves, are in ``tests/unit/test_k8s_manifests.py``.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from deployment import generate
from tests.helpers.executables import kubectl
from tests.helpers.k8s_manifests import (
    DEPLOYMENT_DIR,
    REPO_ROOT,
    SECRET_TEXT,
    hardening_violations,
    pod_specs,
    secret_findings,
)

KUSTOMIZE_DIR = DEPLOYMENT_DIR / "kustomize"


def _find_crds_dir() -> Path:
    """The CRD schemas: ``$FRT_CRDS_DIR``, else ``shared/crds`` beside the repository or beside one of its parent
    directories (a clone elsewhere, e.g. CI's, still finds the workplace's ``shared/``), else the workplace's
    ``/work/shared/crds``."""
    candidates = [Path(os.environ["FRT_CRDS_DIR"])] if os.environ.get("FRT_CRDS_DIR") else []
    candidates += [parent / "shared" / "crds" for parent in REPO_ROOT.parents]
    candidates.append(Path("/work/shared/crds"))
    return next((path for path in candidates if path.is_dir()), REPO_ROOT.parent / "shared" / "crds")


CRDS_DIR = _find_crds_dir()

# The newest Kubernetes release kubernetes-validate ships schemas for (1.37, August 2026).
KUBERNETES_VERSION = "1.37.0"

# Everything `kubectl apply -k` is documented for: the two overlays and the KubeRay examples.
KUSTOMIZE_TARGETS = ("overlays/local", "overlays/production", "examples")

CUSTOM_RESOURCE_GROUPS = ("ray.io", "monitoring.coreos.com")
REQUIRED_CUSTOM_KINDS = {"RayCluster", "RayJob", "PodMonitor", "ServiceMonitor", "PrometheusRule"}

PROJECT_IMAGE = "flyte-ray-training"

# Hardening rules a pod may break, by (namespace, kind, name), each with the reason. Nothing else may break any.
HARDENING_EXCEPTIONS: dict[tuple[str, str, str], dict[str, str]] = {
    ("gpu-monitoring", "DaemonSet", "dcgm-exporter"): {
        "runAsNonRoot": "DCGM's profiling metrics program the GPU's counters, which needs root",
        "capabilities.add": "the same counters need CAP_SYS_ADMIN; everything else is dropped",
        "readOnlyRootFilesystem": "the embedded nv-hostengine writes its state and logs inside the image",
    },
}


@functools.cache
def _render(target: str) -> tuple[dict, ...]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(KUSTOMIZE_DIR / target)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {target} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(target: str) -> list[dict]:
    """The objects of one kustomize target (a deep copy: tests may not change the shared rendering)."""
    return copy.deepcopy(list(_render(target)))


def all_rendered() -> Iterator[tuple[str, dict]]:
    for target in KUSTOMIZE_TARGETS:
        for obj in render(target):
            yield target, obj


def ident(obj: dict) -> str:
    meta = obj.get("metadata", {})
    return f"{obj.get('kind')} {meta.get('namespace', '-')}/{meta.get('name')}"


def is_custom(obj: dict) -> bool:
    return obj["apiVersion"].split("/")[0] in CUSTOM_RESOURCE_GROUPS


@pytest.mark.parametrize("target", KUSTOMIZE_TARGETS)
def test_kubectl_kustomize_renders_every_target_into_named_namespaced_objects(target):
    objects = render(target)
    assert objects, f"{target} rendered nothing"
    cluster_scoped = {"Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding"}
    for obj in objects:
        assert obj.get("apiVersion") and obj.get("kind") and obj["metadata"].get("name"), obj
        if obj["kind"] not in cluster_scoped:
            assert obj["metadata"].get("namespace"), (
                f"{ident(obj)} has no namespace: apply would put it in the current one"
            )
    names = [ident(obj) for obj in objects]
    assert len(names) == len(set(names)), (
        f"{target} renders duplicates: {sorted(n for n in names if names.count(n) > 1)}"
    )


def test_every_rendered_built_in_object_validates_strictly_against_the_newest_kubernetes():
    import kubernetes_validate

    assert KUBERNETES_VERSION in kubernetes_validate.utils.all_versions(), (
        f"kubernetes-validate {kubernetes_validate.__version__} ships no schemas for {KUBERNETES_VERSION}"
    )
    errors, validated = [], 0
    for target, obj in all_rendered():
        if is_custom(obj):
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            validated += 1
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            errors.append(f"{target}: {ident(obj)} at {path}: {error.message}")
        except kubernetes_validate.utils.SchemaNotFoundError as error:
            # The library only warns on an unknown kind; here it is an error (a typo or a removed API version).
            errors.append(f"{target}: {ident(obj)}: {error.message}")
    assert not errors, "\n".join(errors)
    assert validated >= 40, f"only {validated} built-in objects were validated"


def _closed(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` wherever it lists properties and does not preserve unknown
    fields: the API server would silently prune a misspelt field; here it fails."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if (
        "properties" in closed
        and "additionalProperties" not in closed
        and not closed.get("x-kubernetes-preserve-unknown-fields")
    ):
        closed["additionalProperties"] = False
    return closed


@functools.cache
def crd_validators() -> dict[tuple[str, str], Any]:
    """``(apiVersion, kind)`` -> a validator of the closed openAPIV3Schema of every CRD in ``../shared/crds``."""
    import jsonschema

    if not CRDS_DIR.is_dir():
        pytest.fail(
            f"the CRD schemas are missing: expected the directory {CRDS_DIR} (the repository's sibling shared/crds, "
            "see its README) with the KubeRay and Prometheus Operator CRDs, or set FRT_CRDS_DIR"
        )
    schemas = {}
    for path in sorted(CRDS_DIR.glob("*.yaml")):
        # libyaml when present: the KubeRay CRDs are ~25,000 lines each.
        for crd in yaml.load_all(
            path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        ):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schema = _closed(version["schema"]["openAPIV3Schema"])
                schemas[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return schemas


def test_every_custom_resource_validates_against_its_crd_schema():
    validators = crd_validators()
    errors, kinds = [], set()
    for target, obj in all_rendered():
        if not is_custom(obj):
            continue
        kinds.add(obj["kind"])
        validator = validators.get((obj["apiVersion"], obj["kind"]))
        if validator is None:
            errors.append(f"{target}: {ident(obj)}: no CRD in {CRDS_DIR} serves {obj['apiVersion']} {obj['kind']}")
            continue
        for error in validator.iter_errors(obj):
            errors.append(f"{target}: {ident(obj)} at {'.'.join(str(p) for p in error.path)}: {error.message}")
    assert not errors, "\n".join(errors)
    assert REQUIRED_CUSTOM_KINDS <= kinds, f"no {sorted(REQUIRED_CUSTOM_KINDS - kinds)} among the rendered objects"


def test_the_crd_check_catches_a_misspelt_field():
    monitor = next(obj for obj in render("overlays/local") if obj["kind"] == "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["honorlabels"] = True
    validator = crd_validators()[(monitor["apiVersion"], "ServiceMonitor")]
    messages = [error.message for error in validator.iter_errors(monitor)]
    assert any("honorlabels" in message for message in messages), messages


def test_every_pod_spec_is_hardened_except_the_listed_exceptions():
    violations, checked, used_exceptions = [], 0, set()
    for target, obj in all_rendered():
        key = (obj["metadata"].get("namespace", ""), obj["kind"], obj["metadata"]["name"])
        allowed = HARDENING_EXCEPTIONS.get(key, {})
        for where, pod in pod_specs(obj):
            checked += 1
            for rule, detail in hardening_violations(pod):
                if rule in allowed:
                    used_exceptions.add((key, rule))
                else:
                    violations.append(f"{target}: {ident(obj)} {where}: {detail}")
    assert not violations, "\n".join(violations)
    # RayCluster and RayJob heads and workers (4), and each overlay's Deployments, StatefulSet and DaemonSet (7).
    assert checked >= 11, f"only {checked} pod specs were checked"
    unused = {(key, rule) for key, rules in HARDENING_EXCEPTIONS.items() for rule in rules} - used_exceptions
    assert not unused, f"exceptions that no pod needs any more (remove them): {sorted(unused)}"


def test_gpu_workers_select_and_tolerate_gpu_nodes():
    cluster = next(obj for obj in render("examples") if obj["kind"] == "RayCluster")
    gpu_groups = [
        g
        for g in cluster["spec"]["workerGroupSpecs"]
        if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]
    ]
    assert gpu_groups, "the RayCluster example has no GPU worker group"
    for group in gpu_groups:
        pod = group["template"]["spec"]
        resources = pod["containers"][0]["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_no_manifest_holds_secret_material():
    findings = [
        f"{target}: {ident(obj)}: {finding}" for target, obj in all_rendered() for finding in secret_findings(obj)
    ]
    for path in sorted(DEPLOYMENT_DIR.rglob("*")):
        if path.is_file() and path.suffix in (".yaml", ".yml", ".env", ".json"):
            findings += [
                f"{path.relative_to(REPO_ROOT)}: {m!r}" for m in SECRET_TEXT.findall(path.read_text(encoding="utf-8"))
            ]
    assert not findings, "\n".join(findings)
    mlflow = next(
        obj for obj in render("overlays/local") if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "mlflow"
    )
    env = {e["name"]: e for e in mlflow["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DB_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-db"


def test_generated_prometheus_rule_and_dashboard_configmaps_equal_what_dashboards_generates():
    rendered = generate.render()
    stale = generate.stale_files(rendered)
    assert not stale, (
        f"{[str(p.relative_to(REPO_ROOT)) for p in stale]} differ from dashboards/: run `python -m deployment.generate`"
    )
    objects = render("overlays/local")
    rule = next(obj for obj in objects if obj["kind"] == "PrometheusRule")
    source = yaml.safe_load((generate.DASHBOARDS_DIR / generate.RULES_FILE_NAME).read_text(encoding="utf-8"))
    assert rule["spec"]["groups"] == source["groups"]
    configmaps = {
        name: json.loads(text)
        for obj in objects
        if obj["kind"] == "ConfigMap" and obj["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
        for name, text in obj["data"].items()
    }
    dashboards = {
        path.name: json.loads(path.read_text(encoding="utf-8")) for path in generate.DASHBOARDS_DIR.glob("*.json")
    }
    assert configmaps == dashboards


def test_project_image_follows_the_makefile_image_setting():
    match = re.search(r"^IMAGE \?= (\S+):(\S+)$", (REPO_ROOT / "Makefile").read_text(encoding="utf-8"), re.MULTILINE)
    assert match, "the Makefile no longer sets `IMAGE ?= name:tag`"
    for target in ("overlays/local", "examples"):
        kustomization = yaml.safe_load((KUSTOMIZE_DIR / target / "kustomization.yaml").read_text(encoding="utf-8"))
        image = next(i for i in kustomization["images"] if i["name"] == PROJECT_IMAGE)
        assert (image["newName"], image["newTag"]) == match.groups(), (
            f"{target} sets another image than the Makefile's IMAGE"
        )
    image_user, project_containers = _dockerfile_user(), 0
    for target, obj in all_rendered():
        for where, pod in pod_specs(obj):
            for container in pod["containers"]:
                if f"/{PROJECT_IMAGE}:" in container["image"]:
                    project_containers += 1
                    user = container.get("securityContext", {}).get(
                        "runAsUser", pod.get("securityContext", {}).get("runAsUser")
                    )
                    assert str(user) == image_user, (
                        f"{target}: {ident(obj)} {where}: runAsUser {user}, the image's USER is {image_user}"
                    )
                assert container["image"] != PROJECT_IMAGE, (
                    f"{target}: {ident(obj)} {where}: image placeholder not replaced"
                )
                assert ":" in container["image"].rsplit("/", 1)[-1], (
                    f"{target}: {ident(obj)}: {container['image']} has no tag"
                )
    # MLflow in both overlays, the RayCluster's and the RayJob's heads and workers.
    assert project_containers == 6


def _dockerfile_user() -> str:
    """The final stage's USER of the project's Dockerfile: pods of the project image run as that UID, so files the
    image gives to it (its working directory) stay writable where the root filesystem is."""
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(path=str(REPO_ROOT / "Dockerfile"))
    users = [instruction["value"] for instruction in parser.structure if instruction["instruction"] == "USER"]
    assert users and users[-1].isdigit(), f"the Dockerfile's final USER should be a numeric UID, found {users}"
    return users[-1]


def _service_url(objects: list[dict], name: str, namespace: str) -> str:
    service = next(
        o
        for o in objects
        if o["kind"] == "Service" and o["metadata"]["name"] == name and o["metadata"]["namespace"] == namespace
    )
    return f"http://{name}.{namespace}.svc.cluster.local:{service['spec']['ports'][0]['port']}"


@pytest.mark.parametrize("overlay", ["overlays/local", "overlays/production"])
def test_mlflow_serves_its_in_cluster_name_and_training_pods_point_at_it(overlay):
    objects = render(overlay)
    mlflow = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "mlflow")
    container = mlflow["spec"]["template"]["spec"]["containers"][0]
    args = dict(arg.split("=", 1) for arg in container["args"] if "=" in arg)
    url = _service_url(objects, "mlflow", "mlflow")
    host_port = url.removeprefix("http://")
    assert host_port in args["--allowed-hosts"].split(",")
    assert args["--port"] == "5000" and args["--backend-store-uri"].startswith("postgresql+psycopg2://")
    assert args["--artifacts-destination"] == "$(MLFLOW_ARTIFACTS_DESTINATION)"
    settings = next(
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("mlflow-settings")
    )
    assert settings["data"]["MLFLOW_ARTIFACTS_DESTINATION"].startswith("s3://")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    training_env = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "training-env")
    assert training_env["data"]["TRAINING_CORE__TRACKING__TRACKING_URI"] == url
    assert training_env["data"]["TRAINING_PUSHGATEWAY_URL"] == _service_url(objects, "pushgateway", "monitoring")


def _egress_ports(policies: list[dict]) -> set[tuple[str, int]]:
    return {
        (p.get("protocol", "TCP"), p["port"])
        for policy in policies
        for rule in policy["spec"].get("egress", [])
        for p in rule.get("ports", [])
    }


def test_training_namespace_denies_all_traffic_but_the_listed_allows():
    objects = render("overlays/local")
    policies = [o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["namespace"] == "training"]
    deny = next(p for p in policies if p["metadata"]["name"] == "default-deny-all")
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    ports = _egress_ports(policies)
    # DNS, S3 over HTTPS and the local object store, MLflow, the Pushgateway, the Ray head's job API.
    assert {("UDP", 53), ("TCP", 53), ("TCP", 443), ("TCP", 9000), ("TCP", 5000), ("TCP", 9091), ("TCP", 8265)} <= ports
    ray = next(p for p in policies if p["metadata"]["name"] == "allow-ray-intra-cluster")
    assert ray["spec"]["podSelector"] == {"matchLabels": {"ray.io/is-ray-node": "yes"}}
    assert ray["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {"ray.io/is-ray-node": "yes"}}}]
    for name, port in (("mlflow", 5000), ("pushgateway", 9091)):
        service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == name)
        assert service["spec"]["ports"][0]["port"] == port


def test_monitors_select_existing_pods_and_ports():
    objects = render("overlays/local")
    pushgateway_service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "pushgateway")
    service_monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    assert (
        service_monitor["spec"]["selector"]["matchLabels"].items() <= pushgateway_service["metadata"]["labels"].items()
    )
    assert service_monitor["spec"]["endpoints"][0]["honorLabels"] is True
    assert service_monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in pushgateway_service["spec"]["ports"]}
    dcgm = next(o for o in objects if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "dcgm-exporter")
    dcgm_monitor = next(o for o in objects if o["kind"] == "PodMonitor" and o["metadata"]["name"] == "dcgm-exporter")
    assert dcgm_monitor["spec"]["namespaceSelector"]["matchNames"] == [dcgm["metadata"]["namespace"]]
    assert (
        dcgm_monitor["spec"]["selector"]["matchLabels"].items()
        <= dcgm["spec"]["template"]["metadata"]["labels"].items()
    )
    assert dcgm_monitor["spec"]["podMetricsEndpoints"][0]["port"] in {
        p["name"] for p in dcgm["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    ray_monitor = next(o for o in objects if o["kind"] == "PodMonitor" and o["metadata"]["name"] == "ray-nodes")
    for obj in render("examples"):
        for where, pod in pod_specs(obj):
            ports = {p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
            assert ray_monitor["spec"]["podMetricsEndpoints"][0]["portNumber"] in ports, f"{ident(obj)} {where}"
    for obj in render("examples"):
        for group in [
            obj["spec"].get("rayClusterSpec", obj["spec"])["headGroupSpec"],
            *obj["spec"].get("rayClusterSpec", obj["spec"])["workerGroupSpecs"],
        ]:
            assert group["rayStartParams"]["metrics-export-port"] == "8080"


def test_priority_classes_let_training_runs_preempt_tuning_trials():
    classes = {o["metadata"]["name"]: o for o in render("overlays/local") if o["kind"] == "PriorityClass"}
    assert classes["training-run"]["value"] > classes["tuning-trial"]["value"]
    assert classes["tuning-trial"]["preemptionPolicy"] == "Never"
    quotas = {o["metadata"]["name"]: o for o in render("overlays/local") if o["kind"] == "ResourceQuota"}
    assert "requests.nvidia.com/gpu" in quotas["training"]["spec"]["hard"]
    assert quotas["tuning-trials"]["spec"]["scopeSelector"]["matchExpressions"][0]["values"] == ["tuning-trial"]
