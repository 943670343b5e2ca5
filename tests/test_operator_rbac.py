"""Least privilege, tied to use: the operator runs through every path it has (GPU discovery, a model config from a
ConfigMap, spec.auth, autoscaling, a NetworkPolicy, capacity collection, drift repair, an optional child removed,
kopf peering) against the API mock, and the (group, resource, verb) triples of the requests it made must be exactly
what the chart's default RBAC grants: a rule no path uses is a finding, and so is a request the chart would deny."""

from __future__ import annotations

import asyncio
import base64

import kmock
import pytest
from operator_cluster import (  # noqa: F401 (cluster is a fixture)
    AUTOSCALERS,
    NAMESPACE,
    NETWORK_POLICIES,
    SERVICES,
    ClusterEmulator,
    api,
    cluster,
    create,
    patch_spec,
    planned,
    running_operator,
    stored,
    wait_for,
)
from test_operator_chart import by_kind, render
from test_operator_handlers import SIDECAR_IMAGE, gpu_node, load_example

from hybridkv.operator import manifests
from hybridkv.operator.handlers import OperatorConfig

pytestmark = [pytest.mark.kmock(cls=ClusterEmulator), pytest.mark.looptime]
PEERING = "hybridkv"
PEERINGS = "kopf.dev/v1/kopfpeerings"
CAPACITY_INTERVAL_S = 30.0
# Checked by the API server's OwnerReferencesPermissionEnforcement admission plugin, not by any request of its own:
# applying a child whose owner reference sets blockOwnerDeletion needs update on the owner's finalizers.
ADMISSION_ONLY = {("hybridkv.io", "hybridmodels/finalizers", "update")}


def granted() -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every rule of the chart's default Roles and ClusterRoles."""
    objects = render({})
    rules = [rule for kind in ("Role", "ClusterRole") for role in by_kind(objects, kind) for rule in role["rules"]]
    return {(group, resource, verb) for rule in rules for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"]}


def used(requests) -> set[tuple[str, str, str]]:
    """The RBAC (group, resource, verb) each API request needs; server-side apply needs create as well as patch."""
    verbs = {kmock.action.LIST: "list", kmock.action.WATCH: "watch", kmock.action.FETCH: "get",
             kmock.action.CREATE: "create", kmock.action.UPDATE: "patch", kmock.action.DELETE: "delete"}
    triples = set()
    for request in requests:
        if request.resource is None or request.resource.plural is None:
            continue  # discovery: granted to every authenticated user
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        verb = verbs[request.action]
        if verb == "patch" and request.method == "PUT":
            verb = "update"
        triples.add((request.resource.group, resource, verb))
        if "apply-patch" in request.headers.get("Content-Type", ""):
            triples.add((request.resource.group, resource, "create"))
    return triples


async def test_every_rbac_rule_of_the_chart_is_used_and_every_request_is_granted(cluster):
    cluster.resources[PEERINGS] = kmock.ResourceInfo(kind="KopfPeering", namespaced=True, verbs={"list", "watch", "patch"})
    await api(cluster, "POST", f"/apis/kopf.dev/v1/namespaces/{NAMESPACE}/kopfpeerings",
              {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING, "namespace": NAMESPACE}})
    await api(cluster, "POST", "/api/v1/nodes", gpu_node("h200-0", "NVIDIA-H200", 143771, 8))
    await api(cluster, "POST", f"/api/v1/namespaces/{NAMESPACE}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sidecar-token", "namespace": NAMESPACE},
        "data": {"token": base64.b64encode(b"t0ken").decode()},
    })
    config = OperatorConfig(
        sidecar_image=SIDECAR_IMAGE, capacity_interval_s=CAPACITY_INTERVAL_S, retry_delay_s=1.0,
        operator_pods=manifests.PodSelector("serving", (("app.kubernetes.io/name", "hybridkv"),)),
    )
    discovered = load_example(
        "examples/qwen3.5-9b-gpu-discovery.yaml",
        auth={"secretRef": {"name": "sidecar-token"}},
        autoscaling={"maxReplicas": 3},
        networkPolicy={"from": [{"podSelector": {"matchLabels": {"app": "gateway"}}}]},
    )
    async with running_operator(config, peering=PEERING):
        await create(cluster, discovered)
        await create(cluster, load_example("examples/qwen3.5-4b-configmap.yaml"))
        await wait_for(lambda: planned(cluster, "qwen35-9b", status="True"))
        await wait_for(lambda: planned(cluster, "qwen35-4b-tp2"))
        # A ready sidecar pod: the collector lists pods and reads the token (nothing answers GetCapacity; no matter).
        await api(cluster, "POST", f"/api/v1/namespaces/{NAMESPACE}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "qwen35-9b-1", "namespace": NAMESPACE, "labels": manifests.labels("qwen35-9b")},
            "spec": {"containers": [{"name": "sidecar", "image": "img"}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        })
        await api(cluster, "DELETE", f"/api/v1/namespaces/{NAMESPACE}/services/qwen35-9b-headless")
        await wait_for(lambda: stored(cluster, SERVICES, "qwen35-9b-headless"), timeout_s=3 * CAPACITY_INTERVAL_S)
        await patch_spec(cluster, "qwen35-9b", {"autoscaling": None, "networkPolicy": None})
        await wait_for(lambda: planned(cluster, "qwen35-9b", generation=2, status="True"))
        assert stored(cluster, AUTOSCALERS, "qwen35-9b") is None and stored(cluster, NETWORK_POLICIES, "qwen35-9b") is None
        await asyncio.sleep(CAPACITY_INTERVAL_S)

    # The operator authenticates with the kubeconfig's token; the test's own calls (kubectl's part) send none.
    observed = used(r for r in cluster if r.headers.get("Authorization") == "Bearer test-token")
    rules = granted()
    assert observed - rules == set(), "requests the chart's RBAC would deny"
    assert rules - observed == ADMISSION_ONLY, "rules no code path uses"
