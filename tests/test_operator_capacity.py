"""The operator's capacity collection against the real sidecar: `hybridkv.sidecar.serving.server` serving the tiny CPU engine
on loopback, its pods and Deployment status emulated in kmock, the operator running in the test loop."""

from __future__ import annotations

import base64
import socket

import pytest

pytest.importorskip("torch")

from operator_cluster import (  # noqa: E402, F401 (cluster is a fixture)
    DEPLOYMENTS,
    HYBRIDMODELS,
    NAMESPACE,
    ClusterEmulator,
    api,
    cluster,
    condition,
    create,
    event_reasons,
    planned,
    running_operator,
    stored,
    wait_for,
)

from hybridkv.api.client import GenerationClient  # noqa: E402
from hybridkv.operator import manifests  # noqa: E402
from hybridkv.operator.handlers import OperatorConfig  # noqa: E402

pytestmark = [pytest.mark.kmock(cls=ClusterEmulator), pytest.mark.looptime]
MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 256
KV_CACHE_MEMORY_BYTES = 8 * 1024**2
CAPACITY_INTERVAL_S = 30.0
# The sidecar requires this bearer token (spec.auth); the operator reads it from the HybridModel's Secret.
TOKEN = "capacity-test-token"


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sidecar.core.config import EngineConfig
    from hybridkv.sidecar.serving.server import BackgroundServer, ServerConfig
    from hybridkv.sizing import catalog_geometry

    model_dir = make_model(tmp_path_factory.mktemp("tiny-qwen3.5"), catalog_geometry("qwen3.5-4b"), seed=3, tiny=True)
    engine_config = EngineConfig(
        model=str(model_dir),
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=512,
        kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES,
        device="cpu",
    )
    server = BackgroundServer(engine_config, ServerConfig(host="127.0.0.1", port=0, metrics_port=0, auth_token=TOKEN)).start().load()
    yield server
    server.close()


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def token_secret(name: str, token: str) -> dict:
    encoded = base64.b64encode(token.encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NAMESPACE}, "data": {"token": encoded}}


def hybridmodel(name: str, max_concurrency: int, target_tokens: int, token_secret_name: str = "sidecar-token") -> dict:
    return {
        "apiVersion": "hybridkv.io/v1alpha1",
        "kind": "HybridModel",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "qwen3.5-4b", "source": {"pvc": {"claimName": "models", "path": "tiny"}}},
            "serving": {"maxModelLen": MAX_MODEL_LEN, "maxConcurrency": max_concurrency, "targetTokens": target_tokens},
            "gpu": {"product": "NVIDIA-L4"},
            "auth": {"secretRef": {"name": token_secret_name}},
        },
    }


def sidecar_pod(model: str, port: int) -> dict:
    """A running, ready sidecar pod of `model` whose gRPC port is `port` on loopback, as the kubelet reports it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{model}-7d9f-abcde", "namespace": NAMESPACE, "labels": manifests.labels(model)},
        "spec": {"containers": [{"name": "sidecar", "image": "img", "ports": [{"name": "grpc", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


async def test_collector_writes_measured_capacity_and_compares_it_with_the_target(cluster, sidecar):
    measured = GenerationClient(sidecar.target, token=TOKEN).get_capacity()
    port = int(sidecar.target.rsplit(":", 1)[1])
    models = {
        # Target below what the engine allocated, and exactly its slots.
        "fits": hybridmodel("fits", MAX_NUM_SEQS, measured["token_capacity"] // 2),
        # Twice the engine's slots: short.
        "short": hybridmodel("short", 2 * MAX_NUM_SEQS, measured["token_capacity"] // 2),
        # Its pod is ready but nothing answers on its port.
        "silent": hybridmodel("silent", MAX_NUM_SEQS, measured["token_capacity"] // 2),
        # Its Secret holds another token: the sidecar refuses GetCapacity.
        "refused": hybridmodel("refused", MAX_NUM_SEQS, measured["token_capacity"] // 2, token_secret_name="stale-token"),
    }
    config = OperatorConfig(sidecar_image="img", capacity_interval_s=CAPACITY_INTERVAL_S, retry_delay_s=1.0)
    async with running_operator(config):
        await api(cluster, "POST", f"/api/v1/namespaces/{NAMESPACE}/secrets", token_secret("sidecar-token", TOKEN))
        await api(cluster, "POST", f"/api/v1/namespaces/{NAMESPACE}/secrets", token_secret("stale-token", "not-the-token"))
        for body in models.values():
            await create(cluster, body)
        for name in models:
            await wait_for(lambda name=name: planned(cluster, name, status="True"))
            # What the Deployment controller and the kubelet would report once the pod is up.
            await api(cluster, "PATCH", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}/status",
                      {"status": {"replicas": 1, "readyReplicas": 1}}, "application/merge-patch+json")
            await api(cluster, "POST", f"/api/v1/namespaces/{NAMESPACE}/pods", sidecar_pod(name, closed_port() if name == "silent" else port))
        bodies = {
            name: await wait_for(
                lambda name=name: (b := stored(cluster, HYBRIDMODELS, name)) and b["status"].get("readyReplicas") == 1 and b,
                timeout_s=4 * CAPACITY_INTERVAL_S,
            )
            for name in models
        }

    fits = bodies["fits"]["status"]
    assert fits["capacity"]["replicas"] == [
        {
            "name": "fits-7d9f-abcde",
            "tokenBlocks": measured["token_blocks"],
            "blockSize": measured["block_size"],
            "tokenCapacity": measured["token_capacity"],
            "stateSlots": measured["state_slots"],
            "tokenPoolBytes": measured["token_pool_bytes"],
            "statePoolBytes": measured["state_pool_bytes"],
            "checkpointSlots": measured["checkpoint_slots"],  # 0: this sidecar runs without prefix caching
            "checkpointPoolBytes": measured["checkpoint_pool_bytes"],
            "budgetBytes": measured["budget_bytes"],
            "weightsBytes": measured["weights_bytes"],
            "reserveBytes": measured["reserve_bytes"],
            "tensorParallelSize": 1,
        }
    ]
    assert (fits["capacity"]["tokenCapacity"], fits["capacity"]["stateSlots"]) == (measured["token_capacity"], MAX_NUM_SEQS)
    assert fits["plan"]["predicted"]["tokenCapacity"] > 0  # the prediction stays next to the measurement
    assert (condition(bodies["fits"], "CapacityVerified")["status"], condition(bodies["fits"], "CapacityVerified")["reason"]) == ("True", "CapacityMeetsTarget")
    assert condition(bodies["fits"], "Ready")["status"] == "True"

    short = condition(bodies["short"], "CapacityVerified")
    target_tokens = bodies["short"]["status"]["plan"]["targetTokens"]
    assert (short["status"], short["reason"]) == ("False", "CapacityBelowTarget")
    assert short["message"] == (
        f"short-7d9f-abcde measured {measured['token_capacity']:,} tokens and {MAX_NUM_SEQS} slots; "
        f"the target is {target_tokens:,} tokens and {2 * MAX_NUM_SEQS} slots per replica"
    )

    silent = bodies["silent"]["status"]
    assert silent["capacity"]["unreachable"] == ["silent-7d9f-abcde"] and silent["capacity"]["replicas"] == []
    unavailable = condition(bodies["silent"], "CapacityVerified")
    assert (unavailable["status"], unavailable["reason"]) == ("False", "CapacityUnavailable")
    assert unavailable["message"].startswith("GetCapacity failed for silent-7d9f-abcde")
    refused = bodies["refused"]["status"]["capacity"]
    assert refused["unreachable"] == ["refused-7d9f-abcde"] and refused["replicas"] == []
    assert {"CapacityMeetsTarget", "CapacityBelowTarget", "ReplicasReady"} <= set(event_reasons(cluster))
    assert stored(cluster, DEPLOYMENTS, "fits")["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 50051
