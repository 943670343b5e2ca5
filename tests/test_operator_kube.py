"""The operator's own API client: server-side apply, paging, rotating service-account tokens, unreachable servers."""

from __future__ import annotations


import kopf
import pytest

from hybridkv.net import free_loopback_port
from hybridkv.operator.kube import FIELD_MANAGER, KubeApi, KubeApiError
from operator_cluster import NAMESPACE, ClusterEmulator, declare_resources

pytestmark = pytest.mark.kmock(cls=ClusterEmulator)


def service(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": name}},
            "spec": {"ports": [{"port": 50051}]}}


async def test_apply_creates_then_updates_with_the_field_manager_and_reads_back(kmock):
    declare_resources(kmock)
    kube = KubeApi()
    kube.connect(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), token="t0"))
    try:
        await kube.apply(service("a"))
        changed = service("a")
        changed["spec"]["ports"] = [{"port": 50052}]
        await kube.apply(changed)
        await kube.apply(service("b"))
        assert (await kube.get("Service", NAMESPACE, "a"))["spec"]["ports"] == [{"port": 50052}]
        assert await kube.get("Service", NAMESPACE, "missing") is None
        assert [s["metadata"]["name"] for s in await kube.list("Service", NAMESPACE, "app=b")] == ["b"]
    finally:
        await kube.close()
    applies = list(kmock["patch"])
    assert len(applies) == 3
    assert all(r.headers["Content-Type"] == "application/apply-patch+yaml" for r in applies)
    assert all(r.params == {"fieldManager": FIELD_MANAGER, "force": "true"} for r in applies)


async def test_a_rotated_service_account_token_is_used_on_the_next_call(kmock, tmp_path):
    declare_resources(kmock)
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    kube = KubeApi()
    kube.connect(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), token="first"), token_file=str(token_file))
    try:
        await kube.list("Pod", NAMESPACE)
        token_file.write_text("second\n")
        await kube.list("Pod", NAMESPACE)
    finally:
        await kube.close()
    assert [r.headers["Authorization"] for r in kmock["get"]] == ["Bearer first", "Bearer second"]


async def test_an_unreachable_server_is_an_api_error_not_a_crash():
    port = free_loopback_port()  # nothing listens there
    kube = KubeApi()
    kube.connect(kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}"))
    try:
        with pytest.raises(KubeApiError) as raised:
            await kube.get("Deployment", NAMESPACE, "x")
    finally:
        await kube.close()
    assert raised.value.reason == "Unreachable"


async def test_calls_before_login_say_so():
    with pytest.raises(KubeApiError) as raised:
        await KubeApi().get("Pod", NAMESPACE, "x")
    assert raised.value.reason == "NotConnected"
