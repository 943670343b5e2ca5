"""The Helm chart with the real Helm library (helm-python-sdk): lint, render for default and non-default values,
validate every rendered object against the Kubernetes schemas, and check least privilege; the Dockerfiles with
hadolint."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

helm = pytest.importorskip("helm_python")

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "hybridkv"
KUBERNETES_VERSION = "1.29.0"
NON_DEFAULT_VALUES = {
    "watch": {"clusterWide": True},
    "gpuDiscovery": {"enabled": False},
    "peering": {"enabled": False},
    "verbose": True,
    "capacityIntervalSeconds": 60,
    "image": {"repository": "registry.example/hybridkv-operator", "tag": "1.2.3"},
    "sidecarImage": {"repository": "registry.example/hybridkv-sidecar", "tag": "1.2.3"},
    "serviceAccount": {"create": True, "name": "hkv-operator"},
    "test": {"hybridModel": "qwen35-4b", "prompt": "Hello", "maxTokens": 4},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "control", "effect": "NoSchedule"}],
}
EXTRA_NAMESPACES_VALUES = {"watch": {"namespaces": ["team-a", "team-b"]}}


def render(values: dict, api_versions: tuple[str, ...] = ()) -> list[dict]:
    """The chart's objects; `api_versions` are kinds the cluster is said to serve (`helm template --api-versions`)."""
    with helm.Chart.load(str(CHART)) as chart:
        if api_versions:
            # The Python wrapper does not pass api_versions; its native render call does.
            from helm_python import _native

            options = {"name": "hkv", "namespace": "serving", "api_versions": list(api_versions)}
            manifests = json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(options)))
        else:
            manifests = chart.render(values, name="hkv", namespace="serving")
    objects = []
    for name, text in manifests.items():
        if name.endswith(".txt"):
            continue
        objects += [obj for obj in yaml.safe_load_all(text) if obj]
    return objects


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind]


def operator_args(objects: list[dict]) -> list[str]:
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container["args"]


@pytest.mark.parametrize("values", [{}, NON_DEFAULT_VALUES, EXTRA_NAMESPACES_VALUES], ids=["default", "non-default", "namespaces"])
def test_chart_lints_clean(values):
    result = helm.lint(str(CHART), values, strict=True, namespace="serving", kube_version=KUBERNETES_VERSION)
    assert result["errors"] == []
    assert [m for m in result["messages"] if m["severity"] > 1] == []  # only the optional-icon note


@pytest.mark.parametrize("values", [{}, NON_DEFAULT_VALUES, EXTRA_NAMESPACES_VALUES], ids=["default", "non-default", "namespaces"])
def test_rendered_objects_validate_against_kubernetes_schemas(values):
    objects = render(values)
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("kopf.dev"):
            continue  # a CRD of the chart itself, checked by its own schema at install
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        labels = obj["metadata"]["labels"]
        assert {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by"} <= labels.keys()


def test_operator_runs_once_non_root_read_only_with_a_liveness_endpoint():
    (deployment,) = by_kind(render({}), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert container["args"][0] == "operator" and "--namespace=serving" in container["args"]
    assert "--peering=hybridkv" in container["args"]


def test_default_rbac_is_namespaced_and_reads_nodes_only_for_gpu_discovery():
    objects = render({})
    (role,) = by_kind(objects, "Role")
    assert role["metadata"]["namespace"] == "serving"
    rules = {(group, resource): set(rule["verbs"]) for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"]}
    assert rules[("hybridkv.io", "hybridmodels/status")] == {"patch"}
    assert rules[("", "pods")] == {"list"}
    assert rules[("", "events")] == {"create"}
    assert rules[("", "configmaps")] == {"get"}
    assert rules[("", "secrets")] == {"get"}  # spec.auth's token only; a model's HF token goes by secretKeyRef
    # Children go by garbage collection; only the optional ones leave when their spec field does.
    assert {resource for (_, resource), verbs in rules.items() if "delete" in verbs} == {"horizontalpodautoscalers", "networkpolicies"}
    (cluster_role,) = by_kind(objects, "ClusterRole")
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]

    without_discovery = render({"gpuDiscovery": {"enabled": False}})
    assert by_kind(without_discovery, "ClusterRole") == [] and by_kind(without_discovery, "ClusterRoleBinding") == []
    assert "--no-gpu-discovery" in operator_args(without_discovery)


def test_extra_namespaces_each_get_a_role_and_peering():
    objects = render(EXTRA_NAMESPACES_VALUES)
    assert sorted(role["metadata"]["namespace"] for role in by_kind(objects, "Role")) == ["serving", "team-a", "team-b"]
    assert sorted(p["metadata"]["namespace"] for p in by_kind(objects, "KopfPeering")) == ["serving", "team-a", "team-b"]
    assert [a for a in operator_args(objects) if a.startswith("--namespace")] == [
        "--namespace=serving", "--namespace=team-a", "--namespace=team-b"
    ]


def test_cluster_wide_watch_uses_a_cluster_role_and_no_namespaced_roles():
    objects = render(NON_DEFAULT_VALUES)
    assert by_kind(objects, "Role") == []
    (cluster_role,) = by_kind(objects, "ClusterRole")  # gpuDiscovery is off in these values
    assert any("hybridmodels" in rule["resources"] for rule in cluster_role["rules"])
    args = operator_args(objects)
    assert "--all-namespaces" in args and "--standalone" in args and "--verbose" in args
    assert "--sidecar-image=registry.example/hybridkv-sidecar:1.2.3" in args
    assert by_kind(objects, "KopfPeering") == [] and by_kind(objects, "ClusterKopfPeering") == []


def test_helm_test_pod_checks_readiness_then_generates_once():
    objects = render(NON_DEFAULT_VALUES)
    (pod,) = by_kind(objects, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (readiness,) = pod["spec"]["initContainers"]
    assert "READINESS_SERVICE" in readiness["command"][2] and readiness["command"][3] == "qwen35-4b.serving.svc:50051"
    (generate,) = pod["spec"]["containers"]
    assert generate["args"][0] == "generate" and "--target=qwen35-4b.serving.svc:50051" in generate["args"]
    assert by_kind(render({}), "Pod") == []  # no HybridModel named: no test


def test_readiness_script_of_the_helm_test_runs():
    """The inline script of the test pod compiles and uses names the client really exports."""
    objects = render(NON_DEFAULT_VALUES)
    (pod,) = by_kind(objects, "Pod")
    script = pod["spec"]["initContainers"][0]["command"][2]
    code = compile(script, "helm-test-readiness", "exec")
    import ast

    import hybridkv.api.client as client_module

    imported = [alias.name for node in ast.walk(ast.parse(script)) if isinstance(node, ast.ImportFrom)
                and node.module == "hybridkv.api.client" for alias in node.names]
    assert imported and all(hasattr(client_module, name) for name in imported), imported
    assert hasattr(client_module.GenerationClient, "check_health") and "check_health" in code.co_names


@pytest.mark.parametrize(
    "values,field",
    [
        ({"capacityIntervalSeconds": 1}, "capacityIntervalSeconds"),
        ({"watch": {"namespaces": ["Not_A_Namespace"]}}, "namespaces"),
        ({"test": {"maxTokens": 0.5}}, "maxTokens"),
        ({"unknownKey": True}, "unknownKey"),
    ],
)
def test_values_schema_rejects_bad_values(values, field):
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(Exception) as raised:
        chart.render(values, name="hkv", namespace="serving")
    assert field in str(raised.value)


def test_crds_ship_in_the_chart_and_match_the_one_definition():
    with helm.Chart.load(str(CHART)) as chart:
        crds = {crd["name"]: yaml.safe_load(crd["data"]) for crd in chart.crds}
    assert crds["crds/hybridmodels.hybridkv.io.yaml"]["spec"]["names"]["shortNames"] == ["hm"]
    assert {"crds/kopfpeerings.kopf.dev.yaml", "crds/clusterkopfpeerings.kopf.dev.yaml"} <= crds.keys()
    # Hidden folders (a virtual environment, source trees kept for benchmarks) are not the project's definitions.
    definitions = [path for path in ROOT.rglob("hybridmodels.hybridkv.io*.yaml")
                   if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)]
    assert definitions == [CHART / "crds" / "hybridmodels.hybridkv.io.yaml"]  # kept in one place


@pytest.mark.parametrize("dockerfile", ["operator.Dockerfile", "sidecar.Dockerfile"])
def test_dockerfiles_pass_hadolint_and_run_as_non_root(dockerfile):
    path = ROOT / "docker" / dockerfile
    hadolint = shutil.which("hadolint") or str(pathlib.Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    text = path.read_text()
    assert "USER 10001:10001" in text
    assert ":latest" not in text
    assert not any(word in text.lower() for word in ("hf_token", "password", "secret"))


def test_operator_image_installs_no_torch():
    instructions = [line for line in (ROOT / "docker" / "operator.Dockerfile").read_text().splitlines() if not line.startswith("#")]
    assert any('".[operator]"' in line for line in instructions)
    assert not any("torch" in line or "[engine]" in line for line in instructions)


def test_operator_is_told_its_identity_and_the_scraper_for_network_policies():
    args = operator_args(render({"metrics": {"scraper": {"namespace": "monitoring", "podLabels": {"app": "prometheus"}}}}))
    assert "--operator-namespace=serving" in args
    assert {"--operator-pod-label=app.kubernetes.io/name=hybridkv", "--operator-pod-label=app.kubernetes.io/instance=hkv"} <= set(args)
    assert "--scraper-namespace=monitoring" in args and "--scraper-pod-label=app=prometheus" in args
    assert "--scrape-annotations" in args
    default_args = operator_args(render({"metrics": {"scrapeAnnotations": False}}))
    assert not any(a.startswith("--scraper") for a in default_args) and "--scrape-annotations" not in default_args


def test_pod_monitor_is_rendered_only_where_the_prometheus_operator_serves_it():
    assert by_kind(render({}), "PodMonitor") == []
    served = ("monitoring.coreos.com/v1/PodMonitor",)
    (monitor,) = by_kind(render({"metrics": {"podMonitor": {"labels": {"release": "prometheus"}}}}, served), "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "hybridkv-sidecar"
    (cluster_wide,) = by_kind(render(NON_DEFAULT_VALUES, served), "PodMonitor")
    assert cluster_wide["spec"]["namespaceSelector"] == {"any": True}
    assert by_kind(render({"metrics": {"podMonitor": {"enabled": False}}}, served), "PodMonitor") == []


def test_sidecar_image_pins_the_torch_the_tests_run():
    makefile = (ROOT / "Makefile").read_text()
    (torch_version,) = re.findall(r"^TORCH_VERSION \?= (\S+)$", makefile, re.MULTILINE)
    pins = re.findall(r'"torch==([^"]+)"', (ROOT / "docker" / "sidecar.Dockerfile").read_text())
    assert pins == [torch_version]


@pytest.mark.parametrize("dockerfile", ["operator.Dockerfile", "sidecar.Dockerfile"])
def test_dockerfiles_take_their_base_image_as_an_argument(dockerfile):
    lines = (ROOT / "docker" / dockerfile).read_text().splitlines()
    assert "ARG BASE=python:3.11.11-slim-bookworm" in lines
    assert [line for line in lines if line.startswith("FROM")] == ["FROM ${BASE} AS build", "FROM ${BASE}"]
