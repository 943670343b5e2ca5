"""The operator's kopf handlers against a Kubernetes API mock (kmock), with the operator running in the test's event
loop (`kopf.operator(...)` as a task: kopf 1.45's `kopf.testing` offers only the thread-based KopfRunner, whose loop
looptime cannot reach) and looptime compressing the waits, so timers and retries cost no real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import pathlib

import aiohttp
import kopf
import pytest
import yaml

from hybridkv.net import free_loopback_port
from hybridkv.operator.handlers import OperatorConfig, collector_running
from hybridkv.sizing import GpuSpec, PlanError, load_hybridmodel_file, parse_hybridmodel
from hybridkv.sizing.planner import plan
from operator_cluster import (  # noqa: F401 (cluster is a fixture)
    AUTOSCALERS,
    DEPLOYMENTS,
    NETWORK_POLICIES,
    HYBRIDMODELS,
    NAMESPACE,
    SERVICES,
    ClusterEmulator,
    api,
    cluster,
    condition,
    create,
    event_reasons,
    objects_of,
    patch_spec,
    planned,
    running_operator,
    stored,
    wait_for,
)

EXAMPLE = "examples/qwen3.5-4b-h200.yaml"
SIDECAR_IMAGE = "registry.example/hybridkv-sidecar:test"
pytestmark = [pytest.mark.kmock(cls=ClusterEmulator), pytest.mark.looptime]


@pytest.fixture
def config() -> OperatorConfig:
    # kopf times retry delays by the wall clock, which looptime does not compress: keep them to one real second.
    return OperatorConfig(sidecar_image=SIDECAR_IMAGE, capacity_interval_s=30.0, retry_delay_s=1.0)


def load_example(path: str = EXAMPLE, **spec_changes) -> dict:
    with open(path) as handle:
        body = yaml.safe_load(handle)
    body["metadata"]["namespace"] = NAMESPACE
    body["spec"].update(spec_changes)
    return body


def flags(deployment: dict) -> dict[str, str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict((*arg.removeprefix("--").split("=", 1), "")[:2] for arg in container["args"])  # a switch: ""


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
        "max-num-batched-tokens": str(expected.max_num_batched_tokens),
        # Prefix caching is on by default: the planned checkpoint pool, passed as planned.
        "enable-prefix-caching": "",
        "prefix-checkpoint-slots": str(expected.layout.checkpoint_slots),
        "prefix-checkpoint-interval": str(expected.checkpoint_interval_tokens),
        "served-model-name": "Qwen/Qwen3.5-4B",  # the resource's model.name, what OpenAI clients send as `model`
        "port": "50051",
        "http-port": "8000",
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


async def test_spec_update_replans_and_reapplies(cluster, config):
    async with running_operator(config):
        await create(cluster, load_example())
        await wait_for(lambda: planned(cluster, "qwen35-4b"))
        await patch_spec(cluster, "qwen35-4b", {"serving": {"maxConcurrency": 64}, "replicas": 2})
        body = await wait_for(lambda: planned(cluster, "qwen35-4b", generation=2))
        deployment = stored(cluster, DEPLOYMENTS, "qwen35-4b")

    updated = load_example()
    updated["spec"]["serving"]["maxConcurrency"] = 64
    expected = plan(parse_hybridmodel(updated))
    assert flags(deployment)["max-num-seqs"] == "64"
    assert flags(deployment)["gpu-memory-utilization"] == expected.gpu_memory_utilization
    assert deployment["spec"]["replicas"] == 2
    assert body["metadata"]["generation"] == 2
    assert body["status"]["observedGeneration"] == 2
    assert body["status"]["plan"]["maxNumSeqs"] == 64
    assert all(c["observedGeneration"] == 2 for c in body["status"]["conditions"])
    assert objects_of(cluster, DEPLOYMENTS) == ["qwen35-4b"]


async def test_an_impossible_spec_is_planned_false_with_the_planners_message_and_no_children(cluster, config):
    body = load_example("examples/qwen3.6-27b-l4.yaml")
    body["spec"]["gpu"]["maxPerReplica"] = 1
    with pytest.raises(PlanError) as planner:
        plan(parse_hybridmodel(body))
    async with running_operator(config):
        await create(cluster, body)
        stored_body = await wait_for(lambda: planned(cluster, "qwen36-27b"))
        await asyncio.sleep(config.capacity_interval_s * 2)  # a collection round changes nothing either

    planned_condition = condition(stored_body, "Planned")
    assert (planned_condition["status"], planned_condition["reason"]) == ("False", "NoFeasiblePlan")
    assert planned_condition["message"] == str(planner.value)
    assert condition(stored_body, "Deployed")["status"] == "False"
    assert "plan" not in stored_body["status"]
    assert objects_of(cluster, DEPLOYMENTS) == [] and objects_of(cluster, SERVICES) == []
    assert "NoFeasiblePlan" in event_reasons(cluster)


async def test_an_impossible_update_keeps_the_running_sidecars(cluster, config):
    async with running_operator(config):
        await create(cluster, load_example())
        await wait_for(lambda: planned(cluster, "qwen35-4b"))
        before = stored(cluster, DEPLOYMENTS, "qwen35-4b")
        # Beyond the model's 262,144-token limit: the planner refuses (the CRD's CEL rule would too).
        await patch_spec(cluster, "qwen35-4b", {"serving": {"maxModelLen": 300_000}})
        body = await wait_for(lambda: planned(cluster, "qwen35-4b", generation=2))

    assert condition(body, "Planned")["status"] == "False"
    assert "max_position_embeddings 262144" in condition(body, "Planned")["message"]
    assert (condition(body, "Deployed")["status"], condition(body, "Deployed")["reason"]) == ("True", "PreviousPlanKept")
    assert stored(cluster, DEPLOYMENTS, "qwen35-4b")["spec"] == before["spec"]
    assert body["status"]["plan"]["maxModelLen"] == int(flags(before)["max-model-len"])  # the running plan


async def test_operator_restart_neither_duplicates_nor_loses_children(cluster, config):
    async with running_operator(config):
        await create(cluster, load_example())
        await wait_for(lambda: planned(cluster, "qwen35-4b"))
        first = {name: stored(cluster, SERVICES, name)["spec"] for name in objects_of(cluster, SERVICES)}
        first_deployment = stored(cluster, DEPLOYMENTS, "qwen35-4b")["spec"]
    # While the operator is down, someone deletes a Service.
    await api(cluster, "DELETE", f"/api/v1/namespaces/{NAMESPACE}/services/qwen35-4b-headless")
    applies_before = len([r for r in cluster["patch"] if "apply-patch" in r.headers.get("Content-Type", "")])

    async with running_operator(config):
        await wait_for(lambda: stored(cluster, SERVICES, "qwen35-4b-headless"))
        await asyncio.sleep(config.capacity_interval_s)

    assert objects_of(cluster, DEPLOYMENTS) == ["qwen35-4b"]
    assert objects_of(cluster, SERVICES) == ["qwen35-4b", "qwen35-4b-headless"]
    assert {name: stored(cluster, SERVICES, name)["spec"] for name in objects_of(cluster, SERVICES)} == first
    assert stored(cluster, DEPLOYMENTS, "qwen35-4b")["spec"] == first_deployment
    applies_after = len([r for r in cluster["patch"] if "apply-patch" in r.headers.get("Content-Type", "")])
    assert applies_after - applies_before == 3  # resumed once: one Deployment and two Services re-applied
    assert not stored(cluster, HYBRIDMODELS, "qwen35-4b")["metadata"].get("finalizers")


def gpu_node(name: str, product: str, memory_mib: int, count: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": str(memory_mib), "nvidia.com/gpu.count": str(count)},
        },
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }


async def test_gpu_is_chosen_from_node_labels_when_the_spec_names_none(cluster, config):
    # Every request at full length: the H200 holds it on fewer GPUs than the H100 (by default both need one).
    resource = load_example("examples/qwen3.5-9b-gpu-discovery.yaml")
    resource["spec"]["serving"]["guaranteeFullLength"] = True
    spec = parse_hybridmodel(resource)
    h200 = plan(spec, GpuSpec.from_memory_mib(143771, "NVIDIA-H200"))
    h100 = plan(spec, GpuSpec.from_memory_mib(81559, "NVIDIA-H100-80GB-HBM3"))
    assert h200.tensor_parallel_size < h100.tensor_parallel_size  # the H200 plan needs fewer GPUs per replica
    one_gpu = dataclasses.replace(spec, gpu=dataclasses.replace(spec.gpu, max_per_replica=1))
    with pytest.raises(PlanError):
        plan(one_gpu, GpuSpec.from_memory_mib(23034, "NVIDIA-L4"))  # and a node with one L4 cannot hold it at all
    for node in (
        gpu_node("l4-0", "NVIDIA-L4", 23034, 1),
        gpu_node("h100-0", "NVIDIA-H100-80GB-HBM3", 81559, 8),
        gpu_node("h200-0", "NVIDIA-H200", 143771, 8),
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-0"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}},
    ):
        await api(cluster, "POST", "/api/v1/nodes", node)

    async with running_operator(config):
        await create(cluster, resource)
        body = await wait_for(lambda: planned(cluster, "qwen35-9b"))
        deployment = await wait_for(lambda: stored(cluster, DEPLOYMENTS, "qwen35-9b"))

    assert body["status"]["plan"]["gpu"] == {"product": "NVIDIA-H200", "memoryMiB": 143771}
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert flags(deployment)["tensor-parallel-size"] == str(h200.tensor_parallel_size)
    assert flags(deployment)["gpu-memory-utilization"] == h200.gpu_memory_utilization


async def test_no_gpu_nodes_is_planned_false_and_retried(cluster, config):
    async with running_operator(config):
        await create(cluster, load_example("examples/qwen3.5-9b-gpu-discovery.yaml"))
        body = await wait_for(lambda: planned(cluster, "qwen35-9b"))
        assert (condition(body, "Planned")["status"], condition(body, "Planned")["reason"]) == ("False", "NoGPUNodes")
        assert objects_of(cluster, DEPLOYMENTS) == []
        # A GPU node joins: the retry plans without any change to the spec.
        await api(cluster, "POST", "/api/v1/nodes", gpu_node("h200-0", "NVIDIA-H200", 143771, 8))
        body = await wait_for(lambda: planned(cluster, "qwen35-9b", status="True"), timeout_s=300)
        assert objects_of(cluster, DEPLOYMENTS) == ["qwen35-9b"]
    assert body["status"]["plan"]["gpu"]["product"] == "NVIDIA-H200"


async def test_model_config_from_a_configmap_that_appears_later(cluster, config):
    from hybridkv.sizing import catalog_entry

    example = "examples/qwen3.5-4b-configmap.yaml"
    async with running_operator(config):
        await create(cluster, load_example(example))
        body = await wait_for(lambda: planned(cluster, "qwen35-4b-tp2"))
        missing = condition(body, "Planned")
        assert (missing["status"], missing["reason"]) == ("False", "ModelConfigUnavailable")
        assert "ConfigMap qwen35-4b-config" in missing["message"]
        config_json = catalog_entry("qwen3.5-4b").config
        await api(cluster, "POST", f"/api/v1/namespaces/{NAMESPACE}/configmaps", {
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "qwen35-4b-config", "namespace": NAMESPACE},
            "data": {"config.json": json.dumps(config_json)},
        })
        body = await wait_for(lambda: planned(cluster, "qwen35-4b-tp2", status="True"), timeout_s=300)
        deployment = stored(cluster, DEPLOYMENTS, "qwen35-4b-tp2")

    expected = plan(parse_hybridmodel(load_example(example)), model_config=config_json)
    assert flags(deployment)["tensor-parallel-size"] == "2" == str(expected.tensor_parallel_size)
    assert flags(deployment)["max-num-seqs"] == "512"
    assert body["status"]["plan"]["predicted"]["tokenCapacity"] == expected.layout.token_capacity
    assert body["status"]["plan"]["gpu"]["product"] == "NVIDIA-H100-80GB-HBM3"


async def test_liveness_endpoint_reports_the_capacity_collector(cluster, config):
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}/healthz"
    async with running_operator(config, liveness_endpoint=url) as memo, aiohttp.ClientSession() as session:

        async def health() -> tuple[int, dict] | None:
            try:
                async with session.get(url) as response:
                    return response.status, await response.json()
            except aiohttp.ClientConnectorError:
                return None  # the endpoint is not listening yet

        for _ in range(100):
            if answer := await health():
                break
            await asyncio.sleep(0.1)
        assert answer == (200, {"capacityCollector": True})
        # kopf caches probe results for 10 s of wall-clock time: the stopped collector is checked on the probe itself.
        memo.collector.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await memo.collector
        with pytest.raises(kopf.PermanentError, match="capacity collector has stopped"):
            await collector_running(memo=memo)


async def test_deleting_a_hybridmodel_is_never_blocked_by_the_operator(cluster, config):
    async with running_operator(config) as memo:
        await create(cluster, load_example())
        await wait_for(lambda: planned(cluster, "qwen35-4b"))
        assert not stored(cluster, HYBRIDMODELS, "qwen35-4b")["metadata"].get("finalizers")
        await api(cluster, "DELETE", f"/apis/hybridkv.io/v1alpha1/namespaces/{NAMESPACE}/hybridmodels/qwen35-4b")
        assert stored(cluster, HYBRIDMODELS, "qwen35-4b") is None  # gone at once: no finalizer to wait for
        await wait_for(lambda: not memo.models)  # the collector no longer asks its pods
        await asyncio.sleep(2 * config.capacity_interval_s)
    # Its children carry an owner reference with blockOwnerDeletion: the garbage collector removes them.
    owner = stored(cluster, DEPLOYMENTS, "qwen35-4b")["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"], owner["blockOwnerDeletion"]) == ("HybridModel", "qwen35-4b", True, True)


def status_writes(cluster) -> int:
    return len([r for r in cluster["patch"] if r.url.path.endswith("/status") and "/hybridmodels/" in r.url.path])


async def test_reverting_a_failed_update_brings_status_back_to_the_spec_handled_now(cluster, config):
    async with running_operator(config):
        await create(cluster, load_example())
        await wait_for(lambda: planned(cluster, "qwen35-4b", status="True"))
        await patch_spec(cluster, "qwen35-4b", {"model": {"configMapRef": {"name": "missing-config"}}})
        failed = await wait_for(lambda: planned(cluster, "qwen35-4b", generation=2, status="False"))
        assert condition(failed, "Planned")["reason"] == "ModelConfigUnavailable"
        # Back to the spec of generation 1, the last one handled successfully.
        await patch_spec(cluster, "qwen35-4b", {"model": {"configMapRef": None}})
        body = await wait_for(lambda: planned(cluster, "qwen35-4b", generation=3, status="True"), timeout_s=300)
        await asyncio.sleep(2 * config.capacity_interval_s)  # collection rounds keep it so
        body = stored(cluster, HYBRIDMODELS, "qwen35-4b")

    assert body["metadata"]["generation"] == 3
    assert body["status"]["observedGeneration"] == 3
    assert body["status"].get("planFailure") is None
    assert (condition(body, "Planned")["status"], condition(body, "Planned")["observedGeneration"]) == ("True", 3)
    assert condition(body, "Deployed")["reason"] == "ChildrenApplied"


async def test_children_that_are_scaled_edited_or_deleted_are_put_back(cluster, config):
    deployment_path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/qwen35-4b"
    async with running_operator(config):
        await create(cluster, load_example(replicas=2))
        await wait_for(lambda: planned(cluster, "qwen35-4b", status="True"))
        applied = json.loads(json.dumps(stored(cluster, DEPLOYMENTS, "qwen35-4b")["spec"]))
        await wait_for(lambda: stored(cluster, HYBRIDMODELS, "qwen35-4b")["status"].get("replicas") == 2,
                       timeout_s=2 * config.capacity_interval_s)
        # kubectl scale, kubectl set image and kubectl delete, while the operator runs.
        await api(cluster, "PATCH", deployment_path, {"spec": {"replicas": 5}}, "application/merge-patch+json")
        edited = json.loads(json.dumps(applied["template"]))
        edited["spec"]["containers"][0]["image"] = "registry.example/other:1"
        await api(cluster, "PATCH", deployment_path, {"spec": {"template": edited}}, "application/merge-patch+json")
        await api(cluster, "DELETE", f"/api/v1/namespaces/{NAMESPACE}/services/qwen35-4b-headless")
        await wait_for(lambda: stored(cluster, SERVICES, "qwen35-4b-headless"), timeout_s=2 * config.capacity_interval_s)
        body = await wait_for(
            lambda: (b := stored(cluster, HYBRIDMODELS, "qwen35-4b"))["status"].get("replicas") == 2 and b,
            timeout_s=2 * config.capacity_interval_s,
        )

    assert stored(cluster, DEPLOYMENTS, "qwen35-4b")["spec"] == applied
    assert objects_of(cluster, SERVICES) == ["qwen35-4b", "qwen35-4b-headless"]
    assert body["spec"]["replicas"] == 2 and body["status"]["replicas"] == 2  # what /scale reports
    assert "ChildrenRepaired" in event_reasons(cluster)


async def test_the_operator_waits_out_an_api_server_away_for_minutes(cluster, config):
    async with running_operator(config) as memo:
        await create(cluster, load_example())
        await wait_for(lambda: planned(cluster, "qwen35-4b", status="True"))
        cluster.set_outage(True)
        await asyncio.sleep(300)  # five minutes of loop time: kopf's watches and the collector all fail meanwhile
        cluster.set_outage(False)
        await patch_spec(cluster, "qwen35-4b", {"replicas": 2})
        body = await wait_for(lambda: planned(cluster, "qwen35-4b", generation=2, status="True"), timeout_s=300)
        assert not memo.collector.done()
    assert stored(cluster, DEPLOYMENTS, "qwen35-4b")["spec"]["replicas"] == 2
    assert body["status"]["observedGeneration"] == 2


async def test_a_round_that_changes_nothing_writes_no_status_and_logs_only_debug(cluster, config, caplog):
    async with running_operator(config):
        await create(cluster, load_example())
        await wait_for(lambda: planned(cluster, "qwen35-4b", status="True"))
        await asyncio.sleep(2 * config.capacity_interval_s)  # the first round records the (empty) measurement
        writes_before = status_writes(cluster)
        caplog.clear()
        caplog.set_level(logging.DEBUG)
        await asyncio.sleep(4 * config.capacity_interval_s)
        writes_after = status_writes(cluster)
        records = list(caplog.records)

    assert writes_after == writes_before
    operator_records = [r for r in records if r.name.startswith(("kopf", "hybridkv"))]  # not the mock server's
    assert [r.getMessage() for r in operator_records if r.levelno >= logging.INFO] == []
    assert any("unchanged" in r.getMessage() for r in operator_records if r.levelno == logging.DEBUG)


async def test_temporary_failures_are_logged_as_warnings_not_errors(cluster, config, caplog):
    caplog.set_level(logging.INFO)
    async with running_operator(config):
        await create(cluster, load_example("examples/qwen3.5-4b-configmap.yaml"))
        await wait_for(lambda: planned(cluster, "qwen35-4b-tp2", status="False"))
        await asyncio.sleep(3)  # a few retries (kopf's retry delay runs on the wall clock)
    retries = [r for r in caplog.records if "failed temporarily" in r.getMessage()]
    assert retries and {r.levelname for r in retries} == {"WARNING"}
    assert [r.getMessage() for r in caplog.records if r.name.startswith(("kopf", "hybridkv")) and r.levelno >= logging.ERROR] == []


async def test_a_kubeconfig_that_impersonates_is_refused_with_a_clear_error(cluster, tmp_path, monkeypatch):
    from hybridkv.operator.handlers import login, operator_memo

    kubeconfig = tmp_path / "impersonating"
    config_doc = yaml.safe_load((pathlib.Path(os.environ["KUBECONFIG"])).read_text())
    config_doc["users"][0]["user"]["as"] = "system:serviceaccount:serving:hkv-hybridkv"
    config_doc["users"][0]["user"]["as-groups"] = ["system:serviceaccounts"]
    kubeconfig.write_text(yaml.safe_dump(config_doc))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    memo = operator_memo(OperatorConfig(sidecar_image=SIDECAR_IMAGE))
    with pytest.raises(kopf.PermanentError) as raised:
        await login(memo=memo, logger=logging.getLogger("test"), settings=kopf.OperatorSettings())
    assert "impersonates (as, as-groups)" in str(raised.value)
    assert "kubectl create token" in str(raised.value)


async def test_autoscaling_and_network_policy_children_follow_the_spec(cluster, config):
    from hybridkv.operator.manifests import PodSelector

    config = dataclasses.replace(config, operator_pods=PodSelector("serving", (("app.kubernetes.io/name", "hybridkv"),)))
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    async with running_operator(config):
        await create(cluster, load_example(autoscaling={"maxReplicas": 4, "targetUsagePercent": 70},
                                           networkPolicy={"from": [gateway]}))
        await wait_for(lambda: planned(cluster, "qwen35-4b", status="True"))
        hpa = stored(cluster, AUTOSCALERS, "qwen35-4b")
        policy = stored(cluster, NETWORK_POLICIES, "qwen35-4b")
        await patch_spec(cluster, "qwen35-4b", {"autoscaling": None, "networkPolicy": None})
        await wait_for(lambda: planned(cluster, "qwen35-4b", generation=2, status="True"))

    assert hpa["spec"]["scaleTargetRef"]["kind"] == "HybridModel" and hpa["spec"]["maxReplicas"] == 4
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "700m"
    assert policy["spec"]["ingress"][0]["from"][1] == gateway
    assert objects_of(cluster, AUTOSCALERS) == [] and objects_of(cluster, NETWORK_POLICIES) == []


async def test_a_network_policy_without_the_operators_identity_is_refused(cluster, config):
    async with running_operator(config):
        await create(cluster, load_example(networkPolicy={}))
        body = await wait_for(lambda: planned(cluster, "qwen35-4b"))
    assert (condition(body, "Planned")["status"], condition(body, "Planned")["reason"]) == ("False", "OperatorIdentityUnknown")
    assert objects_of(cluster, DEPLOYMENTS) == []
