"""The sidecar Deployment and Services the operator applies: pure builders, validated against Kubernetes schemas."""

from __future__ import annotations

import kubernetes_validate
import pytest

from hybridkv.operator import manifests
from hybridkv.operator.manifests import SidecarSettings

# The oldest Kubernetes the chart supports (CEL rules in the CRD) and the newest schema the validator ships.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def hybridmodel(name="qwen", source=None, secret=None, **spec_fields):
    return {
        "apiVersion": "hybridkv.io/v1alpha1",
        "kind": "HybridModel",
        "metadata": {"name": name, "namespace": "models", "uid": "0b7d4a8e-4f0e-4f43-9c55-3c1c2f0a5d11", "generation": 1},
        "spec": {
            "model": {
                "name": "qwen3.5-4b",
                "source": source or {"pvc": {"claimName": "weights", "path": "qwen3.5-4b"}},
                **({"secretRef": {"name": secret}} if secret else {}),
            },
            "serving": {"maxModelLen": 8192, "maxConcurrency": 64},
            **spec_fields,
        },
    }


def settings(tp=1, **overrides):
    values = dict(
        tensor_parallel_size=tp,
        gpu_memory_utilization="0.90",
        max_num_seqs=64,
        max_model_len=8192,
        block_size=16,
        max_num_batched_tokens=8192,
        gpu_node_labels=(("nvidia.com/gpu.product", "NVIDIA-H200"),),
    )
    values.update(overrides)
    return SidecarSettings(**values)


AUTH = {"secretRef": {"name": "qwen-token", "key": "bearer"}}
AUTOSCALING = {"minReplicas": 2, "maxReplicas": 8, "targetUsagePercent": 75}
GATEWAY = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}},
           "podSelector": {"matchLabels": {"app": "envoy"}}}
NETWORK_POLICY = {"from": [GATEWAY]}
OPTIONS = manifests.ChildOptions(
    default_image="img:1",
    scrape_annotations=True,
    operator_pods=manifests.PodSelector("serving", (("app.kubernetes.io/name", "hybridkv"),)),
    metrics_scrapers=manifests.PodSelector("monitoring"),
)


def sidecar_container(deployment):
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def flags(container) -> dict[str, str]:
    """The sidecar's flags by name; a switch (no value) maps to ""."""
    return dict((*arg.removeprefix("--").split("=", 1), "")[:2] for arg in container["args"])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_deployment_requests_tp_gpus_and_passes_the_planned_flags(tp):
    deployment = manifests.build_deployment(hybridmodel(), settings(tp=tp), "registry.example/sidecar:1")
    container = sidecar_container(deployment)
    assert container["command"] == ["hybridkv", "serve"]
    assert flags(container) == {
        "model": "/mnt/models",
        "tensor-parallel-size": str(tp),
        "gpu-memory-utilization": "0.90",
        "max-num-seqs": "64",
        "max-model-len": "8192",
        "block-size": "16",
        "max-num-batched-tokens": "8192",
        "no-enable-prefix-caching": "",  # these settings planned no checkpoint pool; the sidecar's default is on
        "served-model-name": "qwen3.5-4b",
        "port": "50051",
        "http-port": "8000",
        "metrics-port": "9400",
    }
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(tp)
    assert container["resources"]["requests"]["nvidia.com/gpu"] == str(tp)
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}


def test_kv_cache_memory_budget_becomes_the_flag():
    container = sidecar_container(manifests.build_deployment(hybridmodel(), settings(kv_cache_memory_bytes=8 << 30), "img"))
    assert flags(container)["kv-cache-memory"] == str(8 << 30)


def test_an_fp8_kv_cache_plan_becomes_the_flag_the_sidecar_parses():
    from hybridkv.cli import build_parser
    from hybridkv.operator.planning import sidecar_settings
    from hybridkv.sizing import parse_hybridmodel, plan

    resource = hybridmodel(gpu={"product": "NVIDIA-H200"})
    resource["spec"]["serving"]["kvCacheDtype"] = "fp8"
    planned = sidecar_settings(plan(parse_hybridmodel(resource)))
    container = sidecar_container(manifests.build_deployment(resource, planned, "img"))
    assert flags(container)["kv-cache-dtype"] == "fp8"
    assert build_parser().parse_args(container["command"][1:] + container["args"]).kv_cache_dtype == "fp8"


def test_a_tpot_target_becomes_the_flag_the_sidecar_parses():
    from hybridkv.cli import build_parser
    from hybridkv.operator.planning import sidecar_settings
    from hybridkv.sizing import parse_hybridmodel, plan

    resource = hybridmodel(gpu={"product": "NVIDIA-H200"})
    resource["spec"]["serving"]["targetTpotMs"] = 20
    spec = parse_hybridmodel(resource)
    container = sidecar_container(manifests.build_deployment(
        resource, sidecar_settings(plan(spec), spec.serving.target_tpot_ms), "img"))
    assert flags(container)["target-tpot-ms"] == "20"
    assert build_parser().parse_args(container["command"][1:] + container["args"]).target_tpot_ms == 20.0
    without = sidecar_container(manifests.build_deployment(resource, sidecar_settings(plan(spec)), "img"))
    assert "target-tpot-ms" not in flags(without)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_sidecar_command_line_parses_with_hybridkv_serve(tp):
    """The arguments are the real `hybridkv serve` flags: the sidecar's own parser reads back the planned values."""
    from hybridkv.cli import build_parser

    container = sidecar_container(manifests.build_deployment(hybridmodel(), settings(tp=tp, kv_cache_memory_bytes=1 << 33), "img"))
    assert container["command"][0] == "hybridkv"
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    assert (args.command, args.model) == ("serve", "/mnt/models")
    assert (args.tensor_parallel_size, args.max_num_seqs, args.max_model_len, args.block_size) == (tp, 64, 8192, 16)
    assert (args.max_num_batched_tokens, args.port, args.http_port, args.metrics_port) == (8192, 50051, 8000, 9400)
    assert args.served_model_name == "qwen3.5-4b"  # what OpenAI clients send as `model`
    assert float(args.gpu_memory_utilization) == 0.90
    assert str(args.kv_cache_memory) in (str(1 << 33), "8Gi")


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_probes_are_grpc_health_with_a_30_minute_startup_budget_for_any_tp(tp):
    container = sidecar_container(manifests.build_deployment(hybridmodel(), settings(tp=tp), "img"))
    startup, readiness, liveness = container["startupProbe"], container["readinessProbe"], container["livenessProbe"]
    assert startup["grpc"] == {"port": 50051, "service": "hybridkv.v1.Readiness"}
    assert readiness["grpc"] == {"port": 50051, "service": "hybridkv.v1.Readiness"}
    assert liveness["grpc"] == {"port": 50051, "service": "hybridkv.v1.Liveness"}
    assert startup["periodSeconds"] * startup["failureThreshold"] == 30 * 60
    assert "initialDelaySeconds" not in readiness and "initialDelaySeconds" not in liveness


def test_tensor_parallel_replicas_get_shared_memory_for_their_workers():
    single = manifests.build_deployment(hybridmodel(), settings(tp=1), "img")
    parallel = manifests.build_deployment(hybridmodel(), settings(tp=2), "img")
    assert "/dev/shm" not in [m["mountPath"] for m in sidecar_container(single)["volumeMounts"]]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in sidecar_container(parallel)["volumeMounts"]
    dshm = next(v for v in parallel["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["medium"] == "Memory"


def test_pod_runs_non_root_read_only_with_no_capabilities_and_no_api_token():
    deployment = manifests.build_deployment(hybridmodel(), settings(), "img")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for container in pod["containers"] + pod.get("initContainers", []):
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
    mounted = {m["mountPath"] for m in sidecar_container(deployment)["volumeMounts"]}
    assert {"/tmp", "/cache"} <= mounted  # writable scratch and caches on a read-only root
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never needs spare GPUs to roll out


def test_pvc_volume_root_is_mounted_without_a_sub_path():
    deployment = manifests.build_deployment(hybridmodel(source={"pvc": {"claimName": "weights", "path": "."}}), settings(), "img")
    mount = next(m for m in sidecar_container(deployment)["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/mnt/models", "readOnly": True}


def test_pvc_weights_are_mounted_read_only_from_the_folder():
    deployment = manifests.build_deployment(hybridmodel(), settings(), "img")
    pod = deployment["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    mount = next(m for m in sidecar_container(deployment)["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/mnt/models", "readOnly": True, "subPath": "qwen3.5-4b"}
    assert "initContainers" not in pod


def test_hf_weights_are_downloaded_first_with_the_token_only_in_the_environment():
    source = {"uri": "hf://Qwen/Qwen3.5-4B@main"}
    deployment = manifests.build_deployment(hybridmodel(source=source, secret="hf-token"), settings(), "registry.example/sidecar:1")
    pod = deployment["spec"]["template"]["spec"]
    (download,) = pod["initContainers"]
    assert download["command"] == ["hf", "download"]
    assert download["args"] == ["Qwen/Qwen3.5-4B", "--local-dir=/mnt/models", "--revision=main"]
    token = next(e for e in download["env"] if e["name"] == "HF_TOKEN")
    assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    assert not any("hf-token" in arg or "HF_TOKEN" in arg for arg in download["args"] + sidecar_container(deployment)["args"])
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in sidecar_container(deployment)["env"]
    model_mount = next(m for m in sidecar_container(deployment)["volumeMounts"] if m["name"] == "model")
    assert model_mount["readOnly"] is True


def test_caches_live_in_an_empty_dir_unless_a_cache_pvc_keeps_them_across_restarts():
    pod = manifests.build_deployment(hybridmodel(), settings(), "img")["spec"]["template"]["spec"]
    assert {"name": "cache", "emptyDir": {}} in pod["volumes"]
    assert "fsGroupChangePolicy" not in pod["securityContext"]

    deployment = manifests.build_deployment(hybridmodel(cache={"pvc": {"claimName": "kernels", "path": "./team-a/"}}),
                                            settings(), "img")
    pod = deployment["spec"]["template"]["spec"]
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "kernels"}} in pod["volumes"]
    assert not any(volume.get("emptyDir") is not None for volume in pod["volumes"] if volume["name"] == "cache")
    container = sidecar_container(deployment)
    assert {"name": "cache", "mountPath": "/cache"} in container["volumeMounts"]  # writable, the whole volume
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TRITON_CACHE_DIR"] == "/cache/team-a/triton"
    assert env["HF_HOME"] == "/cache/team-a/huggingface" and env["XDG_CACHE_HOME"] == "/cache/team-a"
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    # A PVC source's weights are where they were: the cache holds only what the pods build.
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/mnt/models")
    assert mount == {"name": "model", "mountPath": "/mnt/models", "readOnly": True, "subPath": "qwen3.5-4b"}

    root = manifests.build_deployment(hybridmodel(cache={"pvc": {"claimName": "kernels", "path": "."}}), settings(), "img")
    env = {e["name"]: e["value"] for e in sidecar_container(root)["env"]}
    assert env["TRITON_CACHE_DIR"] == "/cache/triton"


@pytest.mark.parametrize(
    "uri,folder",
    [
        ("hf://Qwen/Qwen3.5-4B", "models/Qwen--Qwen3.5-4B/main"),
        ("hf://Qwen/Qwen3.5-4B@refs/pr/12", "models/Qwen--Qwen3.5-4B/refs--pr--12"),
        ("hf://Qwen/Qwen3.5-4B@0123abcd", "models/Qwen--Qwen3.5-4B/0123abcd"),
    ],
)
def test_with_a_cache_pvc_weights_download_once_per_repository_and_revision(uri, folder):
    body = hybridmodel(source={"uri": uri}, secret="hf-token", cache={"pvc": {"claimName": "kernels", "path": "qwen"}})
    deployment = manifests.build_deployment(body, settings(), "img")
    pod = deployment["spec"]["template"]["spec"]
    (download,) = pod["initContainers"]
    assert download["args"][:2] == ["Qwen/Qwen3.5-4B", f"--local-dir=/cache/qwen/{folder}"]
    assert download["volumeMounts"] == [{"name": "cache", "mountPath": "/cache"}, {"name": "tmp", "mountPath": "/tmp"}]
    assert not any(volume["name"] == "model" for volume in pod["volumes"])  # no emptyDir to fill at every start
    mount = next(m for m in sidecar_container(deployment)["volumeMounts"] if m["mountPath"] == "/mnt/models")
    assert mount == {"name": "cache", "mountPath": "/mnt/models", "readOnly": True, "subPath": f"qwen/{folder}"}
    assert flags(sidecar_container(deployment))["model"] == "/mnt/models"


def test_user_resources_and_scheduling_are_kept_but_the_gpu_count_is_the_plan():
    spec = {
        "resources": {"requests": {"cpu": "6", "memory": "48Gi", "nvidia.com/gpu": "8"}, "limits": {"memory": "64Gi"}},
        "nodeSelector": {"pool": "inference"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        "replicas": 3,
    }
    deployment = manifests.build_deployment(hybridmodel(**spec), settings(tp=2), "img")
    resources = sidecar_container(deployment)["resources"]
    assert resources["requests"] == {"cpu": "6", "memory": "48Gi", "nvidia.com/gpu": "2"}
    assert resources["limits"] == {"memory": "64Gi", "nvidia.com/gpu": "2"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200", "pool": "inference"}
    assert spec["tolerations"][0] in pod["tolerations"]
    assert deployment["spec"]["replicas"] == 3


def test_spec_image_wins_over_the_operator_default():
    deployment = manifests.build_deployment(hybridmodel(image="registry.example/custom:2"), settings(), "default:1")
    assert sidecar_container(deployment)["image"] == "registry.example/custom:2"
    assert sidecar_container(manifests.build_deployment(hybridmodel(), settings(), "default:1"))["image"] == "default:1"


def test_services_select_the_sidecar_pods_and_the_headless_one_lists_each_pod():
    body = hybridmodel()
    deployment = manifests.build_deployment(body, settings(), "img")
    cluster_ip, headless = manifests.build_services(body)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for service in (cluster_ip, headless):
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert {"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"} in service["spec"]["ports"]
        assert {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"} in service["spec"]["ports"]
    assert cluster_ip["metadata"]["name"] == "qwen" and cluster_ip["spec"]["type"] == "ClusterIP"
    assert headless["metadata"]["name"] == "qwen-headless" and headless["spec"]["clusterIP"] == "None"
    assert manifests.selector_string("qwen") == ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())


def test_children_are_owned_by_the_hybridmodel_for_garbage_collection():
    body = hybridmodel()
    for child in manifests.build_children(body, settings(), manifests.ChildOptions(default_image="img")):
        assert child["metadata"]["namespace"] == "models"
        assert child["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "hybridkv.io/v1alpha1",
                "kind": "HybridModel",
                "name": "qwen",
                "uid": body["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    "source,tp,cache",
    [
        ({"pvc": {"claimName": "weights", "path": "models/qwen"}}, 1, None),
        ({"uri": "hf://Qwen/Qwen3.5-9B"}, 2, None),
        ({"uri": "hf://Qwen/Qwen3.5-9B@refs/pr/3"}, 2, {"pvc": {"claimName": "kernels", "path": "a/b"}}),
    ],
)
def test_children_validate_against_the_kubernetes_schemas(version, source, tp, cache):
    body = hybridmodel(source=source, secret="hf", tolerations=[{"key": "a", "operator": "Exists"}], nodeSelector={"zone": "a"},
                       auth=AUTH, autoscaling=AUTOSCALING, networkPolicy=NETWORK_POLICY, **({"cache": cache} if cache else {}))
    children = manifests.build_children(body, settings(tp=tp, kv_cache_memory_bytes=1 << 33), OPTIONS)
    assert [c["kind"] for c in children] == ["Deployment", "Service", "Service", "HorizontalPodAutoscaler", "NetworkPolicy"]
    for child in children:
        kubernetes_validate.validate(child, version, strict=True)


def test_auth_mounts_the_secret_key_and_passes_the_token_file():
    deployment = manifests.build_deployment(hybridmodel(auth=AUTH), settings(), "img")
    container = sidecar_container(deployment)
    assert flags(container)["auth-token-file"] == "/etc/hybridkv/auth/token"
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth"]
    assert volume["secret"] == {"secretName": "qwen-token", "items": [{"key": "bearer", "path": "token"}], "defaultMode": 0o440}
    assert {"name": "auth", "mountPath": "/etc/hybridkv/auth", "readOnly": True} in container["volumeMounts"]
    assert "auth-token-file" not in flags(sidecar_container(manifests.build_deployment(hybridmodel(), settings(), "img")))


def test_scrape_annotations_name_the_metrics_port():
    deployment = manifests.build_deployment(hybridmodel(), settings(), "img", scrape_annotations=True)
    assert deployment["spec"]["template"]["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "9400", "prometheus.io/path": "/metrics"
    }
    assert "annotations" not in manifests.build_deployment(hybridmodel(), settings(), "img")["spec"]["template"]["metadata"]


def test_autoscaler_scales_the_hybridmodel_on_both_pools_usage():
    hpa = manifests.build_autoscaler(hybridmodel(autoscaling=AUTOSCALING))
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "hybridkv.io/v1alpha1", "kind": "HybridModel", "name": "qwen"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert [(m["pods"]["metric"]["name"], m["pods"]["target"]) for m in hpa["spec"]["metrics"]] == [
        ("hybridkv_state_pool_usage", {"type": "AverageValue", "averageValue": "750m"}),
        ("hybridkv_token_pool_usage", {"type": "AverageValue", "averageValue": "750m"}),
    ]
    assert manifests.build_autoscaler(hybridmodel(autoscaling={"maxReplicas": 3}))["spec"]["minReplicas"] == 1


def test_network_policy_admits_the_operator_the_spec_peers_and_the_scraper_only():
    policy = manifests.build_network_policy(hybridmodel(networkPolicy=NETWORK_POLICY), OPTIONS)
    assert policy["spec"]["podSelector"] == {"matchLabels": manifests.selector_labels("qwen")}
    grpc, metrics = policy["spec"]["ingress"]
    assert grpc["ports"] == [{"protocol": "TCP", "port": 50051}, {"protocol": "TCP", "port": 8000}]
    assert grpc["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "serving"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "hybridkv"}}},
        GATEWAY,
    ]
    assert metrics == {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                       "ports": [{"protocol": "TCP", "port": 9400}]}
    # Without a configured scraper the metrics port admits nobody.
    closed = manifests.build_network_policy(hybridmodel(networkPolicy={}), manifests.ChildOptions("img", operator_pods=OPTIONS.operator_pods))
    assert [rule["ports"][0]["port"] for rule in closed["spec"]["ingress"]] == [50051]


def test_drift_is_a_lost_or_changed_value_not_a_defaulted_one():
    desired = {"spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "s", "image": "a"}]}}}}
    defaulted = {"spec": {"replicas": 2, "revisionHistoryLimit": 10,
                          "template": {"spec": {"containers": [{"name": "s", "image": "a", "imagePullPolicy": "IfNotPresent"}]}}}}
    assert not manifests.drifted(desired, defaulted)
    assert manifests.drifted(desired, {"spec": {**defaulted["spec"], "replicas": 5}})
    assert manifests.drifted(desired, {"spec": {"replicas": 2, "template": {"spec": {"containers": []}}}})


def test_a_planned_prefix_cache_reaches_hybridkv_serve_with_its_checkpoints():
    from hybridkv.cli import build_parser

    parse = build_parser().parse_args
    off = sidecar_container(manifests.build_deployment(hybridmodel(), settings(), "img"))
    assert parse(off["command"][1:] + off["args"]).enable_prefix_caching is False
    on = sidecar_container(manifests.build_deployment(
        hybridmodel(), settings(prefix_checkpoint_slots=24, prefix_checkpoint_interval_tokens=0), "img"))
    args = parse(on["command"][1:] + on["args"])
    assert (args.enable_prefix_caching, args.prefix_checkpoint_slots, args.prefix_checkpoint_interval) == (True, 24, 0)
