"""The Helm values for the upstream flyte-binary and kuberay-operator charts, checked offline: Flyte's Ray plugin
is on, storage is S3, no credential is inline, everything has resources, and every key exists in the chart."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from training_core.config import ScalingConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
HELM = REPO_ROOT / "deployment" / "helm"

# Key paths of the charts' own values.yaml, for the sections these files set. Names only, read from
# flyteorg/flyte charts/flyte-binary/values.yaml @ 02154d2c9b56de9ae9b83b1f4d54a912750ed7db and
# ray-project/kuberay helm-chart/kuberay-operator/values.yaml @ 002c26b0530ac50cd8ba52208e0743071654698c.
FLYTE_BINARY_KEYS = {
    *(
        f"configuration.database.{k}"
        for k in ("username", "password", "passwordPath", "host", "port", "dbname", "options")
    ),
    *(f"configuration.storage.{k}" for k in ("metadataContainer", "userDataContainer", "provider")),
    *(
        f"configuration.storage.providerConfig.s3.{k}"
        for k in ("region", "disableSSL", "v2Signing", "endpoint", "authType", "accessKey", "secretKey")
    ),
    *(
        f"configuration.{k}"
        for k in (
            "inline",
            "inlineConfigMap",
            "inlineSecretRef",
            "externalConfigMap",
            "externalSecretRef",
            "labels",
            "annotations",
        )
    ),
    "enabled_plugins.tasks.task-plugins.enabled-plugins",
    "enabled_plugins.tasks.task-plugins.default-for-task-types",
    *(f"deployment.image.{k}" for k in ("repository", "tag", "pullPolicy")),
    *(
        f"deployment.{k}"
        for k in (
            "extraEnvVars",
            "extraEnvVarsConfigMap",
            "extraEnvVarsSecret",
            "command",
            "args",
            "livenessProbe",
            "readinessProbe",
            "startupProbe",
            "lifecycleHooks",
            "labels",
            "annotations",
            "podLabels",
            "podAnnotations",
            "extraVolumeMounts",
            "extraVolumes",
            "sidecars",
            "initContainers",
            "extraPodSpec",
        )
    ),
    *(f"deployment.podSecurityContext.{k}" for k in ("enabled", "runAsUser", "runAsGroup", "fsGroup")),
    *(f"rbac.{k}" for k in ("create", "labels", "annotations", "extraRules")),
}
KUBERAY_OPERATOR_KEYS = {
    "nameOverride",
    "fullnameOverride",
    "componentOverride",
    "replicas",
    "imagePullSecrets",
    "nodeSelector",
    "priorityClassName",
    "labels",
    "annotations",
    "affinity",
    "tolerations",
    "operatorCommand",
    "leaderElectionEnabled",
    "reconcileConcurrency",
    "rbacEnable",
    "crNamespacedRbacEnable",
    "singleNamespaceInstall",
    "env",
    "resources",
    "livenessProbe",
    "readinessProbe",
    "hostUsers",
    "podSecurityContext",
    "securityContext",
    *(f"image.{k}" for k in ("repository", "tag", "pullPolicy")),
    *(f"metrics.{k}" for k in ("enabled",)),
}
# Keys a chart's templates read although its values.yaml has them only in a comment, or not at all
# (flyte-binary templates/deployment.yaml reads deployment.resources and deployment.securityContext;
# kuberay-operator documents watchNamespace in a comment).
READ_BUT_UNDECLARED = {
    "flyte-binary": {"deployment.resources", "deployment.securityContext"},
    "kuberay-operator": {"watchNamespace"},
}
# Values passed through as Flyte configuration or as Kubernetes objects: their inner keys belong to Flyte or to
# Kubernetes, not to the chart.
PASS_THROUGH = {
    "configuration.inline",
    "enabled_plugins.tasks.task-plugins.default-for-task-types",
    "resources",
    "podSecurityContext",
    "securityContext",
    "deployment.resources",
    "deployment.securityContext",
}
CHART_KEYS = {"flyte-binary": FLYTE_BINARY_KEYS, "kuberay-operator": KUBERAY_OPERATOR_KEYS}

# Keys that hold a reference to a Secret or a file, never the secret itself.
SECRET_REFERENCES = {
    "passwordPath",
    "extraEnvVarsSecret",
    "secretName",
    "default-env-from-secrets",
    "inlineSecretRef",
    "externalSecretRef",
}
SECRET_KEY_NAME = re.compile(r"password|secret|accesskey|access_key|token|credential|privatekey", re.IGNORECASE)
SECRET_VALUE = re.compile(r"AKIA[0-9A-Z]{16}|-----BEGIN [A-Z ]*PRIVATE KEY-----|\b[0-9a-zA-Z/+]{40}\b")


def load(chart: str) -> dict[str, Any]:
    return yaml.safe_load((HELM / f"{chart}.values.yaml").read_text())


def key_paths(values: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of the keys set, stopping at lists, scalars and pass-through sections."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in PASS_THROUGH:
            yield from key_paths(value, path + ".")
        else:
            yield path


def walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{path}.{key}".lstrip("."), value
            yield from walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from walk(value, f"{path}[{index}]")


def quantity(text: str | int | float) -> float:
    """A Kubernetes quantity in base units (cores, bytes)."""
    match = re.fullmatch(r"([0-9.]+)(m|Ki|Mi|Gi|Ti)?", str(text))
    assert match, f"{text!r} is not a quantity these values use"
    factor = {None: 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[match[2]]
    return float(match[1]) * factor


def runtime_uid() -> int:
    users = [
        i["value"] for i in DockerfileParser(str(REPO_ROOT / "Dockerfile")).structure if i["instruction"] == "USER"
    ]
    return int(users[-1].split(":")[0])


def training_namespace() -> str:
    kustomization = REPO_ROOT / "deployment" / "kustomize" / "base" / "training" / "kustomization.yaml"
    return yaml.safe_load(kustomization.read_text())["namespace"]


@pytest.mark.parametrize("chart", sorted(CHART_KEYS))
def test_every_key_set_exists_in_the_upstream_chart(chart):
    allowed = CHART_KEYS[chart] | READ_BUT_UNDECLARED[chart]
    unknown = [path for path in key_paths(load(chart)) if path not in allowed]
    assert not unknown, f"{chart}.values.yaml sets keys its chart does not have: {unknown}"


@pytest.mark.parametrize("chart", sorted(CHART_KEYS))
def test_no_credential_is_written_in_the_values(chart):
    for path, value in walk(load(chart)):
        key = path.rsplit(".", 1)[-1]
        if SECRET_KEY_NAME.search(key) and key not in SECRET_REFERENCES and not isinstance(value, (dict, list)):
            assert value in ("", None), f"{chart}: {path} holds a credential; reference a Secret instead"
        if isinstance(value, str):
            assert not SECRET_VALUE.search(value), f"{chart}: {path} looks like key material"


def test_flyte_runs_ray_tasks_through_the_ray_plugin():
    values = load("flyte-binary")
    plugins = values["enabled_plugins"]["tasks"]["task-plugins"]
    # The list replaces the chart's: the container task types must stay enabled next to ray.
    assert {"ray", "container", "sidecar", "k8s-array"} <= set(plugins["enabled-plugins"])
    assert plugins["default-for-task-types"]["ray"] == "ray"
    assert plugins["default-for-task-types"]["container"] == "container"
    ray = values["configuration"]["inline"]["plugins"]["ray"]
    assert ray["shutdownAfterJobFinishes"] is True
    assert isinstance(ray["ttlSecondsAfterFinished"], int) and 0 < ray["ttlSecondsAfterFinished"] <= 24 * 3600
    assert ray["serviceType"] == "ClusterIP"
    # A finished task's RayJob, and the RayCluster KubeRay keeps for the TTL, go when Flyte finalizes the task.
    assert values["configuration"]["inline"]["plugins"]["k8s"]["delete-resource-on-finalize"] is True
    rules = values["rbac"]["extraRules"]
    assert any("ray.io" in r["apiGroups"] and "rayjobs" in r["resources"] and "create" in r["verbs"] for r in rules)


def test_flyte_stores_metadata_and_raw_outputs_on_s3_with_credentials_from_secrets():
    values = load("flyte-binary")
    storage = values["configuration"]["storage"]
    assert storage["provider"] == "s3"
    assert storage["metadataContainer"] and storage["userDataContainer"]
    s3 = storage["providerConfig"]["s3"]
    assert s3["region"]
    # `accesskey` would take the keys from these values; `iam` takes them from the SDK chain (IRSA or env).
    assert s3["authType"] == "iam" and not s3.get("accessKey") and not s3.get("secretKey")
    assert values["deployment"]["extraEnvVarsSecret"]
    database = values["configuration"]["database"]
    assert not database.get("password") and database["passwordPath"]
    mounts = {m["mountPath"] for m in values["deployment"]["extraVolumeMounts"]}
    assert str(Path(database["passwordPath"]).parent) in mounts
    assert all("secret" in v for v in values["deployment"]["extraVolumes"])
    k8s = values["configuration"]["inline"]["plugins"]["k8s"]
    assert k8s["default-env-from-secrets"], "task pods get no S3 credentials"


def test_task_resource_defaults_fit_under_limits_and_hold_the_default_rayjob():
    resources = load("flyte-binary")["configuration"]["inline"]["task_resources"]
    defaults, limits = resources["defaults"], resources["limits"]
    for name in ("cpu", "memory"):
        assert quantity(defaults[name]) <= quantity(limits[name]), f"task_resources: default {name} over its limit"
    scaling = ScalingConfig()
    assert quantity(limits["memory"]) >= scaling.memory_per_worker_gib * 2**30
    assert quantity(limits["memory"]) >= scaling.head_memory_gib * 2**30
    assert quantity(limits["cpu"]) >= scaling.cpus_per_worker
    assert quantity(limits["gpu"]) >= scaling.gpus_per_worker


def test_control_planes_state_requests_and_limits():
    flyte = load("flyte-binary")["deployment"]["resources"]
    operator = load("kuberay-operator")["resources"]
    for resources in (flyte, operator):
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[kind])
        assert quantity(resources["requests"]["memory"]) <= quantity(resources["limits"]["memory"])


def test_task_and_ray_pods_run_as_the_image_user_and_hardened():
    k8s = load("flyte-binary")["configuration"]["inline"]["plugins"]["k8s"]
    pod = k8s["default-pod-security-context"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == runtime_uid()
    assert pod["seccompProfile"]["type"] == "RuntimeDefault"
    container = k8s["default-security-context"]
    assert container["allowPrivilegeEscalation"] is False and container["capabilities"]["drop"] == ["ALL"]


def test_kuberay_operator_is_hardened_and_watches_only_the_training_namespace():
    values = load("kuberay-operator")
    assert values["image"]["tag"] not in ("nightly", "latest")
    context = values["securityContext"]
    assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
    assert context["runAsNonRoot"] is True and context["capabilities"]["drop"] == ["ALL"]
    assert context["seccompProfile"]["type"] == "RuntimeDefault"
    assert values["podSecurityContext"]["runAsNonRoot"] is True
    # Namespaced Roles only in the watched namespace, which is where Flyte puts every execution.
    assert values["singleNamespaceInstall"] is True and values["crNamespacedRbacEnable"] is True
    namespace = training_namespace()
    assert values["watchNamespace"] == [namespace]
    assert load("flyte-binary")["configuration"]["inline"]["namespace_mapping"]["template"] == namespace
