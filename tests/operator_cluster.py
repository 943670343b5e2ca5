"""An in-process Kubernetes API for the operator's handler tests: kmock's emulator plus the two behaviours of a
real API server the operator relies on, and the operator itself running in the test's event loop.

- server-side apply (PATCH with `application/apply-patch+yaml`) creates an object that does not exist yet;
- objects get `uid`, `creationTimestamp`, `resourceVersion` and `generation` (bumped when the spec changes);
- lists honour equality-based `labelSelector`s (`key=value,...`), the only kind the operator sends;
- the Deployment controller's bookkeeping: `status.replicas` follows a Deployment's `spec.replicas`;
- an outage (`cluster.outage = True`): every request gets 503 and open watch streams end, as when the API server is
  restarted or unreachable behind its load balancer.

kmock merges patches as plain JSON merge patches (lists are replaced), which is what the operator sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import uuid

import aiohttp
import aiohttp.web
import kmock
import pytest_asyncio
import yaml

from hybridkv.operator.handlers import OperatorConfig, build_registry, operator_memo

HYBRIDMODELS = "hybridkv.io/v1alpha1/hybridmodels"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
PODS = "v1/pods"
NODES = "v1/nodes"
CONFIGMAPS = "v1/configmaps"
EVENTS = "v1/events"
SECRETS = "v1/secrets"
AUTOSCALERS = "autoscaling/v2/horizontalpodautoscalers"
NETWORK_POLICIES = "networking.k8s.io/v1/networkpolicies"
NAMESPACE = "models"


class ClusterEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with server-side apply upserts and server-set metadata."""

    _resource_versions = itertools.count(1)
    outage = False

    def set_outage(self, outage: bool) -> None:
        self.outage = outage
        if outage:
            self._outage_started().set()
        else:
            self._outage_event = asyncio.Event()

    def _outage_started(self) -> asyncio.Event:
        if getattr(self, "_outage_event", None) is None:
            self._outage_event = asyncio.Event()
        return self._outage_event

    async def _serve_watch(self, request):
        """kmock's watch stream, ended when an outage starts."""
        events = aiter(super()._serve_watch(request))
        outage = asyncio.ensure_future(self._outage_started().wait())
        try:
            while True:
                next_event = asyncio.ensure_future(anext(events))
                await asyncio.wait({next_event, outage}, return_when=asyncio.FIRST_COMPLETED)
                if outage.done():
                    next_event.cancel()
                    with contextlib.suppress(BaseException):
                        await next_event
                    return
                try:
                    yield next_event.result()
                except StopAsyncIteration:
                    return
        finally:
            outage.cancel()
            await events.aclose()

    async def _handle(self, request):
        if self.outage:
            return aiohttp.web.json_response(
                {"kind": "Status", "status": "Failure", "reason": "ServiceUnavailable", "message": "outage", "code": 503},
                status=503,
            )
        response = await self._handle_up(request)
        if request.resource == kmock.resource(DEPLOYMENTS) and request.name and request.method == "PATCH" and not request.subresource:
            deployment = self.objects[(request.resource, request.namespace, request.name)]
            replicas = (deployment.raw.get("spec") or {}).get("replicas")
            if replicas is not None and (deployment.raw.get("status") or {}).get("replicas") != replicas:
                deployment.patch({"status": {"replicas": replicas}})
        return response

    async def _handle_up(self, request):
        data = request.data if isinstance(request.data, dict) else None
        if request.resource is not None and data is not None and request.method == "POST":
            self._stamp_new(data)
        elif request.resource is not None and data is not None and request.method == "PATCH" and request.name:
            key = (request.resource, request.namespace, request.name)
            exists = key in self.objects and not self.objects[key].deleted
            if not exists and "apply-patch" in request.headers.get("Content-Type", ""):
                await self._create_applied(key, data)
            elif exists:
                self._stamp_update(self.objects[key].raw, data, status_only=request.subresource == "status")
        return await super()._handle(request)

    async def _serve_list(self, request):
        listing = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            wanted = dict(term.split("=", 1) for term in selector.split(","))
            listing["items"] = [
                item for item in listing["items"]
                if wanted.items() <= ((item.get("metadata") or {}).get("labels") or {}).items()
            ]
        return listing

    def _stamp_new(self, data: dict) -> None:
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", "2026-11-29T12:00:00Z")
        meta["generation"] = 1
        meta["resourceVersion"] = str(next(self._resource_versions))

    def _stamp_update(self, current: dict, data: dict, status_only: bool) -> None:
        meta = data.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self._resource_versions))
        if not status_only and "spec" in data:
            merged = copy.deepcopy(current.get("spec") or {})
            kmock_patch = kmock.Object({"spec": merged})
            kmock_patch.patch({"spec": data["spec"]})
            if kmock_patch.raw["spec"] != current.get("spec"):
                meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1

    async def _create_applied(self, key, data: dict) -> None:
        self._stamp_new(data)
        async with self._lock:
            self.objects[key] = copy.deepcopy(data)
            await self._buses[key[0]].put({"type": "ADDED", "object": self.objects[key].raw})


def declare_resources(cluster: kmock.KubernetesEmulator) -> None:
    """API discovery: the HybridModel CRD with its status and scale subresources, and the core kinds."""
    cluster.resources[HYBRIDMODELS] = kmock.ResourceInfo(
        kind="HybridModel",
        singular="hybridmodel",
        namespaced=True,
        shortnames={"hm"},
        subresources={"status", "scale"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    )
    for resource, kind, namespaced in (
        (DEPLOYMENTS, "Deployment", True),
        (SERVICES, "Service", True),
        (PODS, "Pod", True),
        (NODES, "Node", False),
        (CONFIGMAPS, "ConfigMap", True),
        (EVENTS, "Event", True),
        (SECRETS, "Secret", True),
        (AUTOSCALERS, "HorizontalPodAutoscaler", True),
        (NETWORK_POLICIES, "NetworkPolicy", True),
        # kopf waits for the namespaces resource to exist before it serves any namespace.
        ("v1/namespaces", "Namespace", False),
    ):
        cluster.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs={"get", "list", "watch", "create", "patch", "delete"})


def write_kubeconfig(path, server_url: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": server_url}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester", "namespace": NAMESPACE}}],
        "current-context": "kmock",
    }
    path.write_text(yaml.safe_dump(config))


@contextlib.asynccontextmanager
async def running_operator(config: OperatorConfig, liveness_endpoint: str | None = None, peering: str | None = None):
    """The operator (kopf) as a task in the running loop, serving NAMESPACE (standalone, or with the KopfPeering
    `peering`); stopped on exit.

    Yields the operator's memo (its configuration, API client and collector task).
    """
    import kopf

    stop_flag = asyncio.Event()
    ready_flag = asyncio.Event()
    memo = operator_memo(config)
    task = asyncio.create_task(
        kopf.operator(
            registry=build_registry(config),
            memo=memo,
            standalone=peering is None,
            peering_name=peering,
            namespaces=[NAMESPACE],
            liveness_endpoint=liveness_endpoint,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    )
    await asyncio.wait_for(ready_flag.wait(), timeout=30)
    try:
        yield memo
    finally:
        stop_flag.set()
        await asyncio.wait_for(task, timeout=30)


async def wait_for(predicate, timeout_s: float = 60.0, step_s: float = 0.5):
    """Poll `predicate()` (loop time) until it returns a truthy value; that value."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s of loop time")
        await asyncio.sleep(step_s)


@pytest_asyncio.fixture
async def cluster(kmock, tmp_path, monkeypatch):
    declare_resources(kmock)
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, str(kmock.url).rstrip("/"))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return kmock


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


def planned(cluster, name: str, generation: int = 1, status: str | None = None):
    """The HybridModel once its Planned condition reflects `generation` (and has `status`, if given)."""
    body = stored(cluster, HYBRIDMODELS, name)
    conditions = {c["type"]: c for c in (body or {}).get("status", {}).get("conditions", [])}
    planned_condition = conditions.get("Planned", {"status": "Unknown", "observedGeneration": 0})
    if planned_condition["observedGeneration"] < generation or planned_condition["status"] == "Unknown":
        return None
    return body if status is None or planned_condition["status"] == status else None


def event_reasons(cluster) -> list[str]:
    return [obj.raw.get("reason") for (res, _, _), obj in cluster.objects.items() if res == kmock.resource(EVENTS) and not obj.deleted]
