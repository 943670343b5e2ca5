"""The children of a HybridModel as pure functions: the sidecar Deployment and its two Services, and the optional
HorizontalPodAutoscaler and NetworkPolicy.

Inputs are the HybridModel object as the API server returns it (its spec already validated by the CRD and the
parser) and the sidecar settings the planner chose; outputs are plain manifests ready for server-side apply.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The sidecar's health service names; kubelet's gRPC probes ask for them by name.
from hybridkv.api.client import LIVENESS_SERVICE, READINESS_SERVICE
from hybridkv.sizing.spec import DEFAULT_AUTH_SECRET_KEY, DEFAULT_TARGET_USAGE_PERCENT

API_VERSION = "hybridkv.io/v1alpha1"
KIND = "HybridModel"

GRPC_PORT = 50051
# The OpenAI-compatible HTTP API: what an InferencePool, a gateway or an OpenAI client reaches.
HTTP_PORT = 8000
METRICS_PORT = 9400
# Loading weights, profiling and capturing graphs may take long on a cold node: 30 minutes before liveness counts.
STARTUP_BUDGET_S = 30 * 60
PROBE_PERIOD_S = 10
GPU_RESOURCE = "nvidia.com/gpu"
MODEL_DIR = "/mnt/models"
CACHE_DIR = "/cache"
RUN_AS_ID = 10001
# Per GPU, unless spec.resources says otherwise: host memory for loading weights, CPU for tokenizing and scheduling.
DEFAULT_CPU_PER_GPU = 2
DEFAULT_MEMORY_GIB_PER_GPU = 16
# torch.distributed workers of one replica exchange tensors through /dev/shm; the container default is 64 MiB.
SHARED_MEMORY_LIMIT = "8Gi"
HEADLESS_SUFFIX = "-headless"
# The component name of the operator in events and server-side apply.
FIELD_MANAGER = "hybridkv-operator"
# The revision `hf download` fetches when an hf:// URI names none (huggingface_hub's default).
DEFAULT_HF_REVISION = "main"
# The key of `model.secretRef`'s Secret that holds the Hugging Face token.
HF_TOKEN_SECRET_KEY = "token"
# Where `spec.auth`'s Secret key is mounted in the sidecar (read by --auth-token-file).
AUTH_DIR = "/etc/hybridkv/auth"
AUTH_TOKEN_FILE = f"{AUTH_DIR}/token"
# Owner and group read (the pod's fsGroup), nobody else.
AUTH_FILE_MODE = 0o440
# Per-pod metrics the HorizontalPodAutoscaler reads through the custom metrics API (a Prometheus adapter rule or
# KEDA serves them from the sidecars' hybridkv:state_pool_usage_perc and hybridkv:token_pool_usage_perc, 0-1).
STATE_POOL_USAGE_METRIC = "hybridkv_state_pool_usage"
TOKEN_POOL_USAGE_METRIC = "hybridkv_token_pool_usage"
# The label every namespace carries with its own name (Kubernetes 1.21+).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class SidecarSettings:
    """What the planner chose for every replica; becomes the `hybridkv serve` flags and the GPU request."""

    tensor_parallel_size: int
    gpu_memory_utilization: str
    max_num_seqs: int
    max_model_len: int
    block_size: int
    max_num_batched_tokens: int
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    prefix_checkpoint_slots: int = 0  # > 0: prefix caching on, with this many GDN state checkpoints
    prefix_checkpoint_interval_tokens: int = 0
    target_tpot_ms: int | None = None  # the HybridModel's serving.targetTpotMs: admission keeps TPOT under it
    # GPU Feature Discovery labels the nodes must carry (the planned product, or the memory when only that is known).
    gpu_node_labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PodSelector:
    """Pods in one namespace with these labels: the operator itself, or the Prometheus that scrapes the sidecars."""

    namespace: str
    labels: tuple[tuple[str, str], ...] = ()

    def peer(self) -> dict:
        peer: dict[str, Any] = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: self.namespace}}}
        if self.labels:
            peer["podSelector"] = {"matchLabels": dict(self.labels)}
        return peer


@dataclass(frozen=True)
class ChildOptions:
    """What the operator's own configuration adds to the children of every HybridModel."""

    default_image: str
    # prometheus.io/scrape, /port and /path on the sidecar pods (for a Prometheus that discovers pods by them).
    scrape_annotations: bool = False
    # The peers every NetworkPolicy admits: the operator (to GetCapacity) and the metrics scraper (to /metrics).
    operator_pods: PodSelector | None = None
    metrics_scrapers: PodSelector | None = None


def selector_labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "hybridkv-sidecar",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "sidecar",
    }


def selector_string(name: str) -> str:
    """The serialised label selector of the sidecar pods (`status.selector`, for the scale subresource)."""
    return ",".join(f"{key}={value}" for key, value in selector_labels(name).items())


def labels(name: str) -> dict[str, str]:
    return {**selector_labels(name), "app.kubernetes.io/part-of": "hybridkv", "app.kubernetes.io/managed-by": "hybridkv-operator"}


def owner_reference(body: Mapping) -> dict:
    meta = body["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(body: Mapping, name: str) -> dict:
    meta = body["metadata"]
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": labels(meta["name"]),
        "ownerReferences": [owner_reference(body)],
    }


def sidecar_args(settings: SidecarSettings, served_model_name: str, auth: bool = False) -> list[str]:
    """The `hybridkv serve` flags (docs/api.md, "hybridkv serve") for the planned settings; the HTTP API answers to
    `served_model_name` (the HybridModel's `model.name`, what clients put in `model`)."""
    args = [
        f"--model={MODEL_DIR}",
        f"--served-model-name={served_model_name}",
        f"--tensor-parallel-size={settings.tensor_parallel_size}",
        f"--gpu-memory-utilization={settings.gpu_memory_utilization}",
        f"--max-num-seqs={settings.max_num_seqs}",
        f"--max-model-len={settings.max_model_len}",
        f"--block-size={settings.block_size}",
        # The planner's reserve estimate assumed this step size; the engine must use the same.
        f"--max-num-batched-tokens={settings.max_num_batched_tokens}",
    ]
    if settings.kv_cache_memory_bytes is not None:
        args.append(f"--kv-cache-memory={settings.kv_cache_memory_bytes}")
    if settings.kv_cache_dtype != "auto":  # the plan counted the token pool in this dtype's bytes
        args.append(f"--kv-cache-dtype={settings.kv_cache_dtype}")
    if settings.prefix_checkpoint_slots:  # the plan took these checkpoints out of the token pool
        args += ["--enable-prefix-caching", f"--prefix-checkpoint-slots={settings.prefix_checkpoint_slots}",
                 f"--prefix-checkpoint-interval={settings.prefix_checkpoint_interval_tokens}"]
    else:  # the plan kept every byte for the pools; the sidecar's default is on
        args.append("--no-enable-prefix-caching")
    if settings.target_tpot_ms is not None:
        args.append(f"--target-tpot-ms={settings.target_tpot_ms}")
    args += [f"--port={GRPC_PORT}", f"--http-port={HTTP_PORT}", f"--metrics-port={METRICS_PORT}"]
    if auth:
        args.append(f"--auth-token-file={AUTH_TOKEN_FILE}")
    return args


def _grpc_probe(service: str, failure_threshold: int) -> dict:
    return {
        "grpc": {"port": GRPC_PORT, "service": service},
        "periodSeconds": PROBE_PERIOD_S,
        "timeoutSeconds": 5,
        "failureThreshold": failure_threshold,
    }


def _container_security() -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


@dataclass(frozen=True)
class CacheFolder:
    """Where a pod keeps its caches: an emptyDir by default (gone with the pod), or `spec.cache.pvc`'s folder, kept
    across restarts so that a new pod finds the kernels its predecessors compiled and the weights they downloaded."""

    claim_name: str | None = None  # None: an emptyDir
    folder: str = ""  # inside the volume, relative; "" for its root

    @property
    def volume(self) -> dict:
        if self.claim_name is None:
            return {"name": "cache", "emptyDir": {}}
        return {"name": "cache", "persistentVolumeClaim": {"claimName": self.claim_name}}

    @property
    def root(self) -> str:
        """The folder as the containers see it (the volume is mounted whole at CACHE_DIR)."""
        return posixpath.join(CACHE_DIR, self.folder) if self.folder else CACHE_DIR

    @property
    def persistent(self) -> bool:
        return self.claim_name is not None

    def env(self) -> list[dict]:
        return [
            {"name": "HOME", "value": "/tmp"},
            {"name": "HF_HOME", "value": f"{self.root}/huggingface"},
            {"name": "TRITON_CACHE_DIR", "value": f"{self.root}/triton"},
            {"name": "XDG_CACHE_HOME", "value": self.root},
        ]


def _cache_folder(spec: Mapping) -> CacheFolder:
    pvc = (spec.get("cache") or {}).get("pvc")
    if not pvc:
        return CacheFolder()
    # The folder is validated relative and without '..'; normalized so "./a/" and "a" name one folder.
    folder = posixpath.normpath(str(pvc.get("path") or "."))
    return CacheFolder(pvc["claimName"], "" if folder == "." else folder)


def _downloaded_model_folder(repo: str, revision: str) -> str:
    """The folder, under a persistent cache, that an hf:// source's weights are downloaded to: one per repository and
    revision, each a single path component (a revision's '/' becomes '--', as in branch names like refs/pr/1)."""
    org, name = repo.split("/", 1)
    return f"models/{org}--{name}/{(revision or DEFAULT_HF_REVISION).replace('/', '--')}"


def _resources(spec: Mapping, tensor_parallel_size: int) -> dict:
    """Requests and limits: the user's CPU and memory figures win; the GPU count is always the planned tp."""
    user = spec.get("resources") or {}
    requests = {
        "cpu": str(DEFAULT_CPU_PER_GPU * tensor_parallel_size),
        "memory": f"{DEFAULT_MEMORY_GIB_PER_GPU * tensor_parallel_size}Gi",
        **(user.get("requests") or {}),
    }
    limits = {**(user.get("limits") or {})}
    requests[GPU_RESOURCE] = str(tensor_parallel_size)
    limits[GPU_RESOURCE] = str(tensor_parallel_size)
    return {"requests": requests, "limits": limits}


def _model_source(model: Mapping, image: str, cache: CacheFolder) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumes, sidecar volume mounts, init containers) that put the weights at MODEL_DIR.

    `model.source` is exactly one of a PVC folder or an hf://org/name[@revision] URI (the parser checked it). A
    download goes to an emptyDir, or with a persistent cache to its folder for that repository and revision, where
    the next pod's download finds the files and only checks them against the Hub.
    """
    source = model["source"]
    pvc = source.get("pvc")
    if pvc:
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": pvc["claimName"], "readOnly": True}}
        mount = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
        sub_path = str(pvc.get("path") or "").strip("/")
        if sub_path not in ("", "."):
            mount["subPath"] = sub_path
        return [volume], [mount], []
    repo, _, revision = source["uri"].removeprefix("hf://").partition("@")
    if cache.persistent:
        folder = _downloaded_model_folder(repo, revision)
        local_dir = f"{cache.root}/{folder}"
        volumes = []  # the cache volume is the pod's already
        mount = {"name": "cache", "mountPath": MODEL_DIR, "readOnly": True,
                 "subPath": posixpath.join(cache.folder, folder)}
        download_mounts = [{"name": "cache", "mountPath": CACHE_DIR}]
    else:
        local_dir = MODEL_DIR
        volumes = [{"name": "model", "emptyDir": {}}]
        mount = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
        download_mounts = [{"name": "model", "mountPath": MODEL_DIR}, {"name": "cache", "mountPath": CACHE_DIR}]
    download_args = [repo, f"--local-dir={local_dir}"]
    if revision:
        download_args.append(f"--revision={revision}")
    env = cache.env()
    secret_ref = model.get("secretRef")
    if secret_ref:
        # The token reaches the downloader only through the environment, never the command line or a log.
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret_ref["name"], "key": HF_TOKEN_SECRET_KEY}}}
        )
    download = {
        "name": "download-model",
        "image": image,
        "command": ["hf", "download"],
        "args": download_args,
        "env": env,
        "securityContext": _container_security(),
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": [*download_mounts, {"name": "tmp", "mountPath": "/tmp"}],
    }
    return volumes, [mount], [download]


def _tolerations(spec: Mapping) -> list[dict]:
    tolerations = list(spec.get("tolerations") or [])
    # GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule so that only GPU workloads land there.
    if not any(t.get("key") == GPU_RESOURCE for t in tolerations):
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def build_deployment(body: Mapping, settings: SidecarSettings, default_image: str, scrape_annotations: bool = False) -> dict:
    """The sidecar Deployment: `spec.replicas` pods, each with `tp` GPUs of the planned product."""
    name = body["metadata"]["name"]
    spec = body["spec"]
    image = spec.get("image") or default_image
    auth_ref = (spec.get("auth") or {}).get("secretRef")
    cache = _cache_folder(spec)
    model_volumes, model_mounts, init_containers = _model_source(spec["model"], image, cache)
    volumes = [
        *model_volumes,
        {"name": "tmp", "emptyDir": {}},
        cache.volume,
    ]
    mounts = [*model_mounts, {"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}]
    if auth_ref:
        volumes.append({
            "name": "auth",
            "secret": {
                "secretName": auth_ref["name"],
                "items": [{"key": auth_ref.get("key", DEFAULT_AUTH_SECRET_KEY), "path": "token"}],
                "defaultMode": AUTH_FILE_MODE,
            },
        })
        mounts.append({"name": "auth", "mountPath": AUTH_DIR, "readOnly": True})
    if settings.tensor_parallel_size > 1:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHARED_MEMORY_LIMIT}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    node_selector = {**dict(settings.gpu_node_labels), **(spec.get("nodeSelector") or {})}
    sidecar = {
        "name": "sidecar",
        "image": image,
        "command": ["hybridkv", "serve"],
        "args": sidecar_args(settings, spec["model"]["name"], auth=bool(auth_ref)),
        # The weights are local by now: the engine must never reach out to the Hub.
        "env": [*cache.env(), {"name": "HF_HUB_OFFLINE", "value": "1"}],
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "startupProbe": _grpc_probe(READINESS_SERVICE, STARTUP_BUDGET_S // PROBE_PERIOD_S),
        "readinessProbe": _grpc_probe(READINESS_SERVICE, 3),
        "livenessProbe": _grpc_probe(LIVENESS_SERVICE, 6),
        "resources": _resources(spec, settings.tensor_parallel_size),
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_ID,
            "runAsGroup": RUN_AS_ID,
            "fsGroup": RUN_AS_ID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [sidecar],
        "volumes": volumes,
        "tolerations": _tolerations(spec),
    }
    if cache.persistent:
        # The volume outlives the pod: its files are the pod group's already, so kubelet need not walk thousands of
        # cached kernels to change their group at every start.
        pod_spec["securityContext"]["fsGroupChangePolicy"] = "OnRootMismatch"
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(body, name),
        "spec": {
            "replicas": 1 if spec.get("replicas") is None else int(spec["replicas"]),  # validated by the spec
            # GPUs are scarce: a new pod starts only after the old one released its GPUs.
            "strategy": {"type": "Recreate"},
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector_labels(name)},
            "template": {"metadata": _pod_metadata(name, scrape_annotations), "spec": pod_spec},
        },
    }


def _pod_metadata(name: str, scrape_annotations: bool) -> dict:
    metadata: dict[str, Any] = {"labels": labels(name)}
    if scrape_annotations:
        metadata["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(METRICS_PORT),
            "prometheus.io/path": "/metrics",
        }
    return metadata


def build_services(body: Mapping) -> list[dict]:
    """A ClusterIP Service (one address) and a headless one (every ready pod, for client-side gRPC balancing)."""
    name = body["metadata"]["name"]
    ports = [
        {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
        {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"},
        {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP", "appProtocol": "http"},
    ]
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(body, name),
            "spec": {"type": "ClusterIP", "selector": selector_labels(name), "ports": ports},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(body, name + HEADLESS_SUFFIX),
            "spec": {"clusterIP": "None", "selector": selector_labels(name), "ports": ports},
        },
    ]


def _usage_metric(metric_name: str, target_usage_percent: int) -> dict:
    # A pool's usage is 0-1; the HPA's averageValue is a quantity, so 80 % is "800m".
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": metric_name},
            "target": {"type": "AverageValue", "averageValue": f"{target_usage_percent * 10}m"},
        },
    }


def build_autoscaler(body: Mapping) -> dict:
    """An autoscaling/v2 HorizontalPodAutoscaler of the HybridModel (its scale subresource), on both pools' usage:
    the HPA follows the metric that asks for the most replicas, so the fuller pool drives it."""
    name = body["metadata"]["name"]
    autoscaling = body["spec"]["autoscaling"]
    target = int(autoscaling.get("targetUsagePercent", DEFAULT_TARGET_USAGE_PERCENT))
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(body, name),
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": name},
            "minReplicas": int(autoscaling.get("minReplicas", 1)),
            "maxReplicas": int(autoscaling["maxReplicas"]),
            "metrics": [_usage_metric(STATE_POOL_USAGE_METRIC, target), _usage_metric(TOKEN_POOL_USAGE_METRIC, target)],
        },
    }


def _peer(raw: Mapping) -> dict:
    return {key: {"matchLabels": dict(raw[key]["matchLabels"])} for key in ("namespaceSelector", "podSelector") if raw.get(key)}


def build_network_policy(body: Mapping, options: ChildOptions) -> dict:
    """Ingress to the sidecar pods: gRPC from the operator and the spec's peers, metrics from the scraper only.
    The kubelet's probes come from the node, which NetworkPolicies do not filter."""
    name = body["metadata"]["name"]
    grpc_peers = [options.operator_pods.peer()] if options.operator_pods else []
    grpc_peers += [_peer(peer) for peer in (body["spec"]["networkPolicy"].get("from") or [])]
    serving_ports = [{"protocol": "TCP", "port": GRPC_PORT}, {"protocol": "TCP", "port": HTTP_PORT}]
    ingress = [{"from": grpc_peers, "ports": serving_ports}] if grpc_peers else []
    if options.metrics_scrapers:
        ingress.append({"from": [options.metrics_scrapers.peer()], "ports": [{"protocol": "TCP", "port": METRICS_PORT}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(body, name),
        "spec": {"podSelector": {"matchLabels": selector_labels(name)}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


# The kinds a HybridModel may or may not have, by the spec field that asks for them.
OPTIONAL_CHILDREN = (("HorizontalPodAutoscaler", "autoscaling"), ("NetworkPolicy", "networkPolicy"))


def build_children(body: Mapping, settings: SidecarSettings, options: ChildOptions) -> list[dict]:
    children = [build_deployment(body, settings, options.default_image, options.scrape_annotations), *build_services(body)]
    if body["spec"].get("autoscaling"):
        children.append(build_autoscaler(body))
    if body["spec"].get("networkPolicy") is not None:
        children.append(build_network_policy(body, options))
    return children


def drifted(desired: Any, live: Any) -> bool:
    """Whether `live` lost or changed a value that `desired` sets; fields only the server added are no drift."""
    if isinstance(desired, Mapping):
        return not isinstance(live, Mapping) or any(drifted(value, live.get(key)) for key, value in desired.items())
    if isinstance(desired, list):
        return (
            not isinstance(live, list)
            or len(desired) != len(live)
            or any(drifted(wanted, found) for wanted, found in zip(desired, live, strict=True))
        )
    return desired != live


def event(body: Mapping, event_type: str, reason: str, message: str, now: str) -> dict:
    """A core/v1 Event about the HybridModel (`kubectl describe hm` lists it)."""
    meta = body["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        },
        "type": event_type,
        "reason": reason,
        # The API server caps event messages at 1 KiB.
        "message": message[:1024],
        "source": {"component": FIELD_MANAGER},
        "reportingComponent": FIELD_MANAGER,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
