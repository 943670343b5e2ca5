"""The operator's kopf handlers against a Kubernetes API mock (kmock), with the operator running in the test's event
loop (`kopf.operator(...)` as a task: kopf 1.45's `kopf.testing` offers only the thread-based KopfRunner, whose loop
looptime cannot reach) and looptime compressing the waits, so timers and retries cost no real time.
"""

from __future__ import annotations

import asyncio

import aiohttp
import kmock
import pytest
import yaml

from hybridkv.operator.handlers import OperatorConfig
from hybridkv.sizing import load_hybridmodel_file
from hybridkv.sizing.planner import plan
from operator_cluster import (
    DEPLOYMENTS,
    EVENTS,
    HYBRIDMODELS,
    NAMESPACE,
    NODES,
    SERVICES,
    ClusterEmulator,
    declare_resources,
    running_operator,
    wait_for,
    write_kubeconfig,
)

EXAMPLE = "examples/qwen3.5-4b-h200.yaml"
SIDECAR_IMAGE = "registry.example/hybridkv-sidecar:test"
pytestmark = [pytest.mark.kmock(cls=ClusterEmulator), pytest.mark.looptime]


@pytest.fixture
def config() -> OperatorConfig:
    return OperatorConfig(sidecar_image=SIDECAR_IMAGE, capacity_interval_s=30.0)


@pytest.fixture
async def cluster(kmock, tmp_path, monkeypatch):
    declare_resources(kmock)
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, str(kmock.url).rstrip("/"))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return kmock


def load_example(path: str = EXAMPLE, **spec_changes) -> dict:
    with open(path) as handle:
        body = yaml.safe_load(handle)
    body["metadata"]["namespace"] = NAMESPACE
    body["spec"].update(spec_changes)
    return body


async def api(cluster, method: str, path: str, body=None, content_type: str = "application/json") -> dict:
    """A client of the mock API, as kubectl would be."""
    async with aiohttp.ClientSession() as session:
        async with session.request(method, str(cluster.url).rstrip("/") + path, json=body, headers={"Content-Type": content_type}) as response:
            assert response.status < 400, await response.text()
            return await response.json()


async def create(cluster, body: dict) -> dict:
    return await api(cluster, "POST", f"/apis/hybridkv.io/v1alpha1/namespaces/{NAMESPACE}/hybridmodels", body)


async def patch_spec(cluster, name: str, spec: dict) -> dict:
    path = f"/apis/hybridkv.io/v1alpha1/namespaces/{NAMESPACE}/hybridmodels/{name}"
    return await api(cluster, "PATCH", path, {"spec": spec}, "application/merge-patch+json")


def stored(cluster, resource: str, name: str, namespace: str | None = NAMESPACE) -> dict | None:
    key = (kmock.resource(resource), namespace, name)
    if key not in cluster.objects or cluster.objects[key].deleted:
        return None
    return cluster.objects[key].raw


def objects_of(cluster, resource: str) -> list[str]:
    return sorted(name for (res, _, name), obj in cluster.objects.items() if res == kmock.resource(resource) and not obj.deleted)


def condition(body: dict, condition_type: str) -> dict:
    return next(c for c in body.get("status", {}).get("conditions", []) if c["type"] == condition_type)


def planned(cluster, name: str, generation: int = 1):
    """The HybridModel once its Planned condition reflects `generation`."""
    body = stored(cluster, HYBRIDMODELS, name)
    conditions = {c["type"]: c for c in (body or {}).get("status", {}).get("conditions", [])}
    if "Planned" in conditions and conditions["Planned"]["observedGeneration"] >= generation and conditions["Planned"]["status"] != "Unknown":
        return body
    return None


def flags(deployment: dict) -> dict[str, str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])


def event_reasons(cluster) -> list[str]:
    return [obj.raw.get("reason") for (res, _, _), obj in cluster.objects.items() if res == kmock.resource(EVENTS) and not obj.deleted]


async def test_create_applies_the_planned_deployment_and_services(cluster, config):
    expected = plan(load_hybridmodel_file(EXAMPLE))
    async with running_operator(config):
        await create(cluster, load_example())
        body = await wait_for(lambda: planned(cluster, "qwen35-4b"))
        deployment = await wait_for(lambda: stored(cluster, DEPLOYMENTS, "qwen35-4b"))

    assert flags(deployment) == {
        "model": "/mnt/models",
        "tensor-parallel-size": str(expected.tensor_parallel_size),
        "gpu-memory-utilization": expected.gpu_memory_utilization,
        "max-num-seqs": str(expected.max_num_seqs),
        "max-model-len": str(expected.max_model_len),
        "block-size": str(expected.layout.block_size),
        "port": "50051",
        "metrics-port": "9400",
    }
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == SIDECAR_IMAGE
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(expected.tensor_parallel_size)
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
    assert objects_of(cluster, SERVICES) == ["qwen35-4b", "qwen35-4b-headless"]

    status = body["status"]
    assert status["observedGeneration"] == 1
    assert status["plan"]["predicted"]["tokenCapacity"] == expected.layout.token_capacity
    assert status["plan"]["predicted"]["stateSlots"] == expected.max_num_seqs
    assert status["selector"] == "app.kubernetes.io/name=hybridkv-sidecar,app.kubernetes.io/instance=qwen35-4b,app.kubernetes.io/component=sidecar"
    assert (condition(body, "Planned")["status"], condition(body, "Planned")["reason"]) == ("True", "PlanComputed")
    assert condition(body, "Deployed")["status"] == "True"
    assert condition(body, "Ready")["status"] == "False"  # no pod is ready yet
    assert {"PlanComputed", "ChildrenApplied"} <= set(event_reasons(cluster))
    # Server-side apply with one field manager, forcing conflicts on the fields it owns.
    applies = [r for r in cluster["patch"] if "apply-patch" in r.headers.get("Content-Type", "")]
    assert {(r.params["fieldManager"], r.params["force"]) for r in applies} == {("hybridkv-operator", "true")}
