"""The HybridModel resource (`hybridkv.io/v1alpha1`, kind `HybridModel`): its one parser and validator.

`hybridkv plan`, the examples and the operator all go through `parse_hybridmodel`; the CRD schema is built from the
field list and the bounds below (import the constants rather than copying the numbers). Every bad input raises a
`SpecError` naming the field, and no field is a float: utilization is a string such as "0.90".

    apiVersion: hybridkv.io/v1alpha1                       required, exactly this
    kind: HybridModel                                      required, exactly this
    metadata:
      name          DNS-1035 label, ≤ 63 chars             required (names the Deployment and the Service)
      namespace     DNS-1123 label, ≤ 63 chars             optional; other metadata keys are ignored
    spec:
      model:                                               required
        name        catalog name or HF id "org/name", ≤ 256 chars          required
        config      inline config.json object, ≤ 256 KiB as JSON           optional } at most one; a catalog name
        configMapRef {name (DNS-1123 subdomain), key (default config.json)} optional } needs neither
        source:     exactly one of                                         required (to deploy)
          pvc       {claimName (DNS-1123 subdomain), path (relative, no "..", ≤ 1024 chars, default ".")}
          uri       "hf://org/name[@revision]", ≤ 512 chars
        secretRef   {name (DNS-1123 subdomain)}: token for the download    optional
      serving:                                             required
        maxModelLen     integer in [1, 1,048,576]: longest request (prompt + output) in tokens     required
        maxConcurrency  integer in [1, 65,536]: running requests per replica; becomes max_num_seqs required
        targetTokens    integer in [1, 2^40]: attention-KV tokens per replica                       optional
        guaranteeFullLength  boolean: hold every running request at maxModelLen at once             optional
        ssmStateDtype   float32 | bfloat16 | float16: the GDN recurrent state (default: the config's) optional
        kvCacheDtype    auto | fp8: the attention KV pool (fp8: e4m3 with static per-layer scales)  optional
        targetTpotMs    integer in [1, 60,000]: time per output token to keep decoding requests under; new
                        requests wait meanwhile (hybridkv serve --target-tpot-ms)                   optional
        workload:       request lengths to size from (at most one of targetTokens/guaranteeFullLength) optional
          promptTokens / outputTokens  {mean (required), p50 | p90 | p99 (at most one)}: log-normal lengths
          histogram     list (≤ 256) of {promptTokens, outputTokens, weight}
          traceConfigMapRef {name, key (default trace.jsonl)}: a JSONL trace (hybridkv simulate's format)
          maxPreemptionRate  string "0" … "1": preemptions per request allowed (default "0.01")
          conversations {systemPromptTokens [1, maxModelLen], turns [1, 64], history messages | tokens (default
                        messages)}: with promptTokens, the requests are the turns of maxConcurrency chats at once
                        sharing a system prompt (promptTokens: each turn's new message; outputTokens: its reply);
                        with prefix caching, the planner sizes the checkpoint pool by replaying them   optional
        prefixCaching:  share cached prompt prefixes (hybridkv serve's default)                           optional
          enabled       boolean, default true (false: hybridkv serve --no-enable-prefix-caching)
          checkpointSlots  integer in [1, 65,536]: GDN state checkpoints (default: half of max_num_seqs)
          checkpointIntervalTokens  integer in [0, 1,048,576], a multiple of 16: also checkpoint long prompts every
                        this many tokens; 0 checkpoints prompt ends only (default 2048)
      gpu:                                                 optional (else from GPU Feature Discovery labels)
        product         GFD product string (nvidia.com/gpu.product), ≤ 128 chars
        memoryMiB       integer in [1, 2,097,152] (nvidia.com/gpu.memory)
        maxPerReplica   integer in [1, 64]: upper bound on tensor-parallel size
        shared          boolean: the GPU is shared (MIG, time-slicing): take the lowest utilization that fits
        computeCapability  "major.minor" (nvidia.com/gpu.compute.major/minor), for a GPU the catalog lacks
      replicas      integer in [0, 1024], default 1
      image         container image reference, ≤ 512 chars                                      optional
      nodeSelector  map of label key (≤ 317 chars) to value (≤ 63 chars), ≤ 64 entries          optional
      tolerations   list (≤ 32) of {key, operator Exists|Equal, value, effect NoSchedule|PreferNoSchedule|NoExecute,
                    tolerationSeconds integer}                                                    optional
      resources     {requests, limits}: cpu / memory / ephemeral-storage quantities (string or integer); GPUs come
                    from the plan and may not be set here                                          optional
      overrides:                                           optional; honoured or rejected with a reason by the planner
        tensorParallelSize    integer in [1, 64]
        gpuMemoryUtilization  string "0.01" … "1.00" (at most two decimals, > 0)
        maxNumSeqs            integer in [1, 65,536], ≥ serving.maxConcurrency
      auth:                                                optional: the sidecars require a bearer token
        secretRef   {name (DNS-1123 subdomain), key (default token)}: the Secret key holding the token
      autoscaling:                                         optional: a HorizontalPodAutoscaler on the scale subresource
        minReplicas         integer in [1, 1024], default 1
        maxReplicas         integer in [1, 1024], ≥ minReplicas                                  required
        targetUsagePercent  integer in [1, 100], default 80: usage of the fuller pool (state slots or token blocks)
      networkPolicy:                                       optional: admit only the operator, these peers and the scraper
        from        list (≤ 16) of {namespaceSelector, podSelector}, each {matchLabels: map (≤ 16)}, one at least
      cache:                                               optional: what a pod start would otherwise rebuild
        pvc         {claimName (DNS-1123 subdomain), path (relative, no "..", ≤ 1024 chars, default ".")}: a writable
                    folder for Triton's compiled kernels and tuning results and, with an hf:// source, the weights
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from hybridkv.sizing.allocators import DEFAULT_BLOCK_SIZE, MAX_CHECKPOINT_SLOTS
from hybridkv.sizing.errors import GeometryError, GpuError, SpecError
from hybridkv.sizing.geometry import ModelGeometry, geometry_from_config
from hybridkv.sizing.gpus import parse_compute_capability
from hybridkv.sizing.memory import KV_CACHE_DTYPES
from hybridkv.sizing.prefix import DEFAULT_CHECKPOINT_INTERVAL_TOKENS

API_VERSION = "hybridkv.io/v1alpha1"
KIND = "HybridModel"
GROUP = "hybridkv.io"
VERSION = "v1alpha1"
PLURAL = "hybridmodels"
SHORT_NAME = "hm"

MAX_RESOURCE_NAME_LENGTH = 63
# The operator names a Service `<name>-headless`, which must itself be a 63-character label.
MAX_HYBRIDMODEL_NAME_LENGTH = MAX_RESOURCE_NAME_LENGTH - len("-headless")
MAX_SUBDOMAIN_LENGTH = 253
MAX_MODEL_NAME_LENGTH = 256
# A real config.json is a few KB. kopf keeps the last handled spec in an annotation, and Kubernetes caps all of an
# object's annotations at 256 KiB together, so an inline config must stay well below that.
MAX_CONFIG_JSON_BYTES = 65_536
MAX_PVC_PATH_LENGTH = 1024
MAX_URI_LENGTH = 512
MAX_MODEL_LEN_TOKENS = 1_048_576
MAX_CONCURRENCY = 65_536
MAX_TARGET_TPOT_MS = 60_000
MAX_TARGET_TOKENS = 2**40
MAX_GPU_MEMORY_MIB = 2_097_152
MAX_GPUS_PER_REPLICA = 64
MAX_REPLICAS = 1024
MAX_IMAGE_LENGTH = 512
MAX_GPU_PRODUCT_LENGTH = 128
MAX_NODE_SELECTOR_ENTRIES = 64
MAX_LABEL_KEY_LENGTH = 317
MAX_LABEL_VALUE_LENGTH = 63
MAX_TOLERATIONS = 32
MAX_TOLERATION_SECONDS = 31_536_000
MAX_YAML_BYTES = 1_048_576
# A HybridModel's YAML, aliases expanded, holds at most this many values, nested at most this deep.
MAX_YAML_NODES = 200_000
MAX_YAML_DEPTH = 64
DEFAULT_CONFIG_MAP_KEY = "config.json"
DEFAULT_TRACE_KEY = "trace.jsonl"
MAX_HISTOGRAM_BINS = 256
MAX_HISTOGRAM_WEIGHT = 1_000_000
DEFAULT_MAX_PREEMPTION_RATE = "0.01"
MAX_CONVERSATION_TURNS = 64
# How a chat's clients send the history back: as messages the server renders again through the chat template (the
# OpenAI chat endpoint; Qwen's templates render an earlier reply unlike the generation prompt before it), or as the
# token ids the server produced (gRPC token ids, /v1/completions with a token prompt).
CONVERSATION_HISTORIES = ("messages", "tokens")
PREEMPTION_RATE_PATTERN = r"^(0(\.[0-9]{1,4})?|1(\.0{1,4})?)$"
SSM_STATE_DTYPES = ("float32", "bfloat16", "float16")
PERCENTILES = ("p50", "p90", "p99")
DEFAULT_AUTH_SECRET_KEY = "token"
DEFAULT_TARGET_USAGE_PERCENT = 80
MAX_NETWORK_PEERS = 16
MAX_PEER_LABELS = 16

DNS1035_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS1123_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$"
HF_URI_PATTERN = r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9][A-Za-z0-9._/-]*)?$"
UTILIZATION_PATTERN = r"^(0\.[0-9]{1,2}|1(\.0{1,2})?)$"
GPU_PRODUCT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._ -]*$"
LABEL_KEY_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
LABEL_VALUE_PATTERN = r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
IMAGE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$"
TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
RESOURCE_NAMES = ("cpu", "memory", "ephemeral-storage")
GPU_RESOURCE_NAME = "nvidia.com/gpu"


@dataclass(frozen=True)
class ModelSource:
    pvc_claim_name: str | None = None
    pvc_path: str | None = None
    uri: str | None = None


@dataclass(frozen=True)
class CacheVolume:
    """A writable PersistentVolumeClaim folder the pods keep their caches in across restarts (`spec.cache.pvc`)."""
    claim_name: str
    path: str = "."


@dataclass(frozen=True)
class ConfigMapRef:
    name: str
    key: str = DEFAULT_CONFIG_MAP_KEY


@dataclass(frozen=True)
class ModelRef:
    name: str
    source: ModelSource | None  # None only when parsed with require_source=False (planning without deploying)
    config: dict | None = None
    config_map_ref: ConfigMapRef | None = None
    secret_name: str | None = None


@dataclass(frozen=True)
class LengthDistribution:
    """Request lengths as a mean and at most one percentile (a log-normal through both; σ = 1 with the mean only)."""

    mean: int
    percentile: tuple[int, int] | None = None  # (50, 90 or 99; tokens)


@dataclass(frozen=True)
class Conversations:
    """Chats sharing a system prompt: the workload's prompt and output lengths are each turn's message and reply."""

    system_prompt_tokens: int
    turns: int
    history: str = "messages"  # one of CONVERSATION_HISTORIES

    @property
    def rerendered(self) -> bool:
        return self.history == "messages"


@dataclass(frozen=True)
class Workload:
    """The request lengths to size the pools from: distributions, a histogram, or a trace in a ConfigMap."""

    prompt_tokens: LengthDistribution | None = None
    output_tokens: LengthDistribution | None = None
    histogram: tuple[tuple[int, int, int], ...] = ()  # (prompt tokens, output tokens, weight)
    trace_config_map_ref: ConfigMapRef | None = None
    max_preemption_rate: Decimal = Decimal(DEFAULT_MAX_PREEMPTION_RATE)
    conversations: Conversations | None = None


@dataclass(frozen=True)
class PrefixCaching:
    """Prefix caching in the engine: on (the default) or off, its GDN checkpoint slots (None: the sizing default) and
    interval."""

    enabled: bool = True
    checkpoint_slots: int | None = None
    checkpoint_interval_tokens: int = DEFAULT_CHECKPOINT_INTERVAL_TOKENS


@dataclass(frozen=True)
class Serving:
    max_model_len: int
    max_concurrency: int
    target_tokens: int | None = None
    guarantee_full_length: bool = False
    ssm_state_dtype: str | None = None
    kv_cache_dtype: str = "auto"
    workload: Workload | None = None
    prefix_caching: PrefixCaching = PrefixCaching()
    target_tpot_ms: int | None = None


@dataclass(frozen=True)
class GpuConstraint:
    product: str | None = None
    memory_mib: int | None = None
    max_per_replica: int | None = None
    shared: bool = False
    compute_capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class Overrides:
    tensor_parallel_size: int | None = None
    gpu_memory_utilization: str | None = None
    max_num_seqs: int | None = None


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str = DEFAULT_AUTH_SECRET_KEY


@dataclass(frozen=True)
class Autoscaling:
    max_replicas: int
    min_replicas: int = 1
    target_usage_percent: int = DEFAULT_TARGET_USAGE_PERCENT


@dataclass(frozen=True)
class NetworkPeer:
    """Pods admitted to the sidecars' gRPC port: by namespace labels, pod labels, or both (NetworkPolicyPeer)."""

    namespace_labels: dict[str, str] | None = None
    pod_labels: dict[str, str] | None = None


@dataclass(frozen=True)
class NetworkPolicy:
    peers: tuple[NetworkPeer, ...]


@dataclass(frozen=True)
class HybridModelSpec:
    name: str
    model: ModelRef
    serving: Serving
    namespace: str | None = None
    gpu: GpuConstraint = field(default_factory=GpuConstraint)
    replicas: int = 1
    image: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()
    resources: dict[str, dict[str, str]] = field(default_factory=dict)
    overrides: Overrides = field(default_factory=Overrides)
    auth_secret: SecretKeyRef | None = None
    autoscaling: Autoscaling | None = None
    network_policy: NetworkPolicy | None = None
    cache: CacheVolume | None = None

    def inline_geometry(self) -> ModelGeometry | None:
        """The geometry of an inline `model.config` (already validated by the parser), else None."""
        if self.model.config is None:
            return None
        return geometry_from_config(self.model.config, name=self.model.name)


# ---- field readers ---------------------------------------------------------------------------------------------------
def _mapping(value: Any, path: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict:
    if not isinstance(value, dict):
        raise SpecError(f"{path} must be an object, got {_kind(value)}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise SpecError(f"{path} has unknown field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    for key in required:
        if value.get(key) is None:
            raise SpecError(f"{path}.{key} is required")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _integer(value: Any, path: str, lower: int, upper: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{path} must be an integer in [{lower}, {upper}], got {_kind(value)} {value!r}")
    if not lower <= value <= upper:
        raise SpecError(f"{path} = {value} is outside [{lower}, {upper}]")
    return value


def _string(value: Any, path: str, max_length: int, pattern: str | None = None, hint: str = "") -> str:
    if not isinstance(value, str):
        raise SpecError(f"{path} must be a string, got {_kind(value)} {value!r}")
    if not value or len(value) > max_length:
        raise SpecError(f"{path} must be 1 to {max_length} characters, got {len(value)}")
    if pattern and not re.match(pattern, value):
        raise SpecError(f"{path} {value!r} is not valid{': ' + hint if hint else ''}")
    return value


# ---- sections --------------------------------------------------------------------------------------------------------
def _model(raw: Any, require_source: bool) -> ModelRef:
    path = "spec.model"
    required = ("name", "source") if require_source else ("name",)
    model = _mapping(raw, path, ("name", "config", "configMapRef", "source", "secretRef"), required)
    name = _string(model["name"], f"{path}.name", MAX_MODEL_NAME_LENGTH, MODEL_NAME_PATTERN,
                   "use a catalog name such as qwen3.5-9b or a Hugging Face id such as Qwen/Qwen3.5-9B")
    config = model.get("config")
    config_map_ref = None
    if config is not None and model.get("configMapRef") is not None:
        raise SpecError(f"{path}: give the model config inline (config) or by reference (configMapRef), not both")
    if config is not None:
        if not isinstance(config, dict):
            raise SpecError(f"{path}.config must be an object (the model's config.json), got {_kind(config)}")
        try:
            size = len(json.dumps(config))
        except RecursionError:
            raise SpecError(f"{path}.config nests too deeply to be a model config") from None
        except (TypeError, ValueError):
            raise SpecError(f"{path}.config must hold only JSON values (objects, lists, strings, numbers)") from None
        if size > MAX_CONFIG_JSON_BYTES:
            raise SpecError(f"{path}.config is {size} bytes of JSON; at most {MAX_CONFIG_JSON_BYTES} are accepted")
        try:
            geometry_from_config(config, name=name)
        except GeometryError as exc:
            raise SpecError(f"{path}.config: {exc}") from None
    ref = model.get("configMapRef")
    if ref is not None:
        config_map_ref = _config_map_ref(ref, f"{path}.configMapRef", DEFAULT_CONFIG_MAP_KEY)
    secret = model.get("secretRef")
    secret_name = None
    if secret is not None:
        secret = _mapping(secret, f"{path}.secretRef", ("name",), ("name",))
        secret_name = _string(secret["name"], f"{path}.secretRef.name", MAX_SUBDOMAIN_LENGTH,
                              DNS1123_SUBDOMAIN_PATTERN, "a Secret name")
    source = None if model.get("source") is None else _source(model["source"])
    return ModelRef(name=name, source=source, config=config, config_map_ref=config_map_ref,
                    secret_name=secret_name)


def _source(raw: Any) -> ModelSource:
    path = "spec.model.source"
    source = _mapping(raw, path, ("pvc", "uri"))
    given = [key for key in ("pvc", "uri") if source.get(key) is not None]
    if len(given) != 1:
        raise SpecError(f"{path} must set exactly one of pvc (a pre-staged folder) or uri (hf://org/name[@rev])")
    if given == ["uri"]:
        return ModelSource(uri=_string(source["uri"], f"{path}.uri", MAX_URI_LENGTH, HF_URI_PATTERN,
                                       "expected hf://org/name or hf://org/name@revision"))
    claim, folder = _pvc_folder(source["pvc"], f"{path}.pvc")
    return ModelSource(pvc_claim_name=claim, pvc_path=folder)


def _pvc_folder(raw: Any, path: str) -> tuple[str, str]:
    """(claimName, path) of a `{claimName, path}` folder on a PersistentVolumeClaim; the path stays inside it."""
    pvc = _mapping(raw, path, ("claimName", "path"), ("claimName",))
    claim = _string(pvc["claimName"], f"{path}.claimName", MAX_SUBDOMAIN_LENGTH, DNS1123_SUBDOMAIN_PATTERN,
                    "a PersistentVolumeClaim name")
    folder = _string(pvc.get("path", "."), f"{path}.path", MAX_PVC_PATH_LENGTH, r"^[^\x00]+$")
    if folder.startswith("/") or ".." in folder.split("/"):
        raise SpecError(f"{path}.path {folder!r} must be relative to the volume and must not contain '..'")
    return claim, folder


def _boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{path} must be true or false, got {_kind(value)} {value!r}")
    return value


def _config_map_ref(raw: Any, path: str, default_key: str) -> ConfigMapRef:
    ref = _mapping(raw, path, ("name", "key"), ("name",))
    return ConfigMapRef(
        name=_string(ref["name"], f"{path}.name", MAX_SUBDOMAIN_LENGTH, DNS1123_SUBDOMAIN_PATTERN, "a ConfigMap name"),
        key=_string(ref.get("key", default_key), f"{path}.key", MAX_SUBDOMAIN_LENGTH, r"^[-._a-zA-Z0-9]+$",
                    "a ConfigMap key"),
    )


def _length_distribution(raw: Any, path: str, max_model_len: int) -> LengthDistribution:
    lengths = _mapping(raw, path, ("mean", *PERCENTILES), ("mean",))
    mean = _integer(lengths["mean"], f"{path}.mean", 1, max_model_len)
    given = [key for key in PERCENTILES if lengths.get(key) is not None]
    if len(given) > 1:
        raise SpecError(f"{path} takes at most one percentile beside the mean, got {', '.join(given)}")
    if not given:
        return LengthDistribution(mean)
    key = given[0]
    tokens = _integer(lengths[key], f"{path}.{key}", 1, MAX_MODEL_LEN_TOKENS)
    # A log-normal's median is below its mean and its 90th/99th percentiles are above it.
    if (key == "p50" and tokens >= mean) or (key != "p50" and tokens <= mean):
        side = "below" if key == "p50" else "above"
        raise SpecError(f"{path}.{key} {tokens} must be {side} the mean {mean} for a long-tailed (log-normal) length")
    return LengthDistribution(mean, (int(key[1:]), tokens))


def _workload(raw: Any, max_model_len: int) -> Workload:
    path = "spec.serving.workload"
    workload = _mapping(raw, path, ("promptTokens", "outputTokens", "histogram", "traceConfigMapRef",
                                    "maxPreemptionRate", "conversations"))
    forms = [key for key in ("promptTokens", "histogram", "traceConfigMapRef") if workload.get(key) is not None]
    if workload.get("conversations") is not None and forms != ["promptTokens"]:
        raise SpecError(f"{path}.conversations needs {path}.promptTokens and outputTokens (each turn's message and "
                        "reply lengths), not a histogram or trace")
    if workload.get("outputTokens") is not None and "promptTokens" not in forms:
        raise SpecError(f"{path}.outputTokens needs {path}.promptTokens beside it")
    if len(forms) != 1:
        raise SpecError(
            f"{path} must give exactly one of promptTokens (with outputTokens), histogram or traceConfigMapRef"
        )
    rate = workload.get("maxPreemptionRate", DEFAULT_MAX_PREEMPTION_RATE)
    if not isinstance(rate, str) or not re.match(PREEMPTION_RATE_PATTERN, rate):
        raise SpecError(f"{path}.maxPreemptionRate must be a string from \"0\" to \"1\" (preemptions per request, "
                        f"at most four decimals), got {rate!r}")
    common = {"max_preemption_rate": Decimal(rate)}
    if forms == ["promptTokens"]:
        if workload.get("outputTokens") is None:
            raise SpecError(f"{path}.outputTokens is required with {path}.promptTokens")
        prompt = _length_distribution(workload["promptTokens"], f"{path}.promptTokens", max_model_len)
        output = _length_distribution(workload["outputTokens"], f"{path}.outputTokens", max_model_len)
        if prompt.mean + output.mean > max_model_len:
            raise SpecError(f"{path}: the mean prompt ({prompt.mean}) and output ({output.mean}) lengths add up to "
                            f"more than serving.maxModelLen {max_model_len}")
        conversations = None
        if workload.get("conversations") is not None:
            conversations = _conversations(workload["conversations"], f"{path}.conversations", max_model_len)
            first_turn = conversations.system_prompt_tokens + prompt.mean + output.mean
            if first_turn > max_model_len:
                raise SpecError(f"{path}.conversations: the system prompt ({conversations.system_prompt_tokens}) "
                                f"and a mean turn ({prompt.mean} + {output.mean} tokens) add up to more than "
                                f"serving.maxModelLen {max_model_len}")
        return Workload(prompt_tokens=prompt, output_tokens=output, conversations=conversations, **common)
    if forms == ["traceConfigMapRef"]:
        return Workload(trace_config_map_ref=_config_map_ref(workload["traceConfigMapRef"],
                                                             f"{path}.traceConfigMapRef", DEFAULT_TRACE_KEY), **common)
    bins = workload["histogram"]
    if not isinstance(bins, list) or not 1 <= len(bins) <= MAX_HISTOGRAM_BINS:
        raise SpecError(f"{path}.histogram must be a list of 1 to {MAX_HISTOGRAM_BINS} bins")
    histogram = []
    for index, item in enumerate(bins):
        where = f"{path}.histogram[{index}]"
        item = _mapping(item, where, ("promptTokens", "outputTokens", "weight"), ("promptTokens", "outputTokens"))
        prompt = _integer(item["promptTokens"], f"{where}.promptTokens", 1, max_model_len)
        output = _integer(item["outputTokens"], f"{where}.outputTokens", 1, max_model_len)
        if prompt + output > max_model_len:
            raise SpecError(f"{where}: {prompt} + {output} tokens exceed serving.maxModelLen {max_model_len}")
        histogram.append((prompt, output, _integer(item.get("weight", 1), f"{where}.weight", 1, MAX_HISTOGRAM_WEIGHT)))
    return Workload(histogram=tuple(histogram), **common)


def _conversations(raw: Any, path: str, max_model_len: int) -> Conversations:
    item = _mapping(raw, path, ("systemPromptTokens", "turns", "history"), ("systemPromptTokens", "turns"))
    system = _integer(item["systemPromptTokens"], f"{path}.systemPromptTokens", 1, max_model_len)
    turns = _integer(item["turns"], f"{path}.turns", 1, MAX_CONVERSATION_TURNS)
    history = item.get("history", CONVERSATION_HISTORIES[0])
    if history not in CONVERSATION_HISTORIES:
        raise SpecError(f"{path}.history must be one of {', '.join(CONVERSATION_HISTORIES)} (messages: clients send "
                        f"the history as chat messages; tokens: as the token ids the server produced), got {history!r}")
    return Conversations(system, turns, history)


def _prefix_caching(raw: Any) -> PrefixCaching:
    path = "spec.serving.prefixCaching"
    prefix = _mapping(raw, path, ("enabled", "checkpointSlots", "checkpointIntervalTokens"))
    enabled = _boolean(prefix.get("enabled", True), f"{path}.enabled")
    slots = prefix.get("checkpointSlots")
    interval = prefix.get("checkpointIntervalTokens")
    if not enabled and (slots is not None or interval is not None):
        given = "checkpointSlots" if slots is not None else "checkpointIntervalTokens"
        raise SpecError(f"{path}.{given} applies only with {path}.enabled: true; enable it or drop {given}")
    if slots is not None:
        slots = _integer(slots, f"{path}.checkpointSlots", 1, MAX_CHECKPOINT_SLOTS)
    if interval is None:
        interval = DEFAULT_CHECKPOINT_INTERVAL_TOKENS
    else:
        interval = _integer(interval, f"{path}.checkpointIntervalTokens", 0, MAX_MODEL_LEN_TOKENS)
        if interval % DEFAULT_BLOCK_SIZE:
            raise SpecError(f"{path}.checkpointIntervalTokens = {interval} is not a multiple of the "
                            f"{DEFAULT_BLOCK_SIZE}-token block; 0 checkpoints prompt ends only")
    return PrefixCaching(enabled=enabled, checkpoint_slots=slots, checkpoint_interval_tokens=interval)


def _serving(raw: Any) -> Serving:
    path = "spec.serving"
    serving = _mapping(raw, path, ("maxModelLen", "maxConcurrency", "targetTokens", "guaranteeFullLength",
                                   "ssmStateDtype", "kvCacheDtype", "workload", "prefixCaching", "targetTpotMs"),
                       ("maxModelLen", "maxConcurrency"))
    max_model_len = _integer(serving["maxModelLen"], f"{path}.maxModelLen", 1, MAX_MODEL_LEN_TOKENS)
    target = serving.get("targetTokens")
    guarantee = _boolean(serving.get("guaranteeFullLength", False), f"{path}.guaranteeFullLength")
    given = [key for key, on in (("targetTokens", target is not None), ("guaranteeFullLength", guarantee),
                                 ("workload", serving.get("workload") is not None)) if on]
    if len(given) > 1:
        raise SpecError(f"{path}: {' and '.join(given)} each say what the cache must hold; give at most one")
    dtype = serving.get("ssmStateDtype")
    if dtype is not None and dtype not in SSM_STATE_DTYPES:
        raise SpecError(f"{path}.ssmStateDtype must be one of {', '.join(SSM_STATE_DTYPES)}, got {dtype!r}")
    kv_dtype = "auto" if serving.get("kvCacheDtype") is None else serving["kvCacheDtype"]
    if kv_dtype not in KV_CACHE_DTYPES:
        raise SpecError(f"{path}.kvCacheDtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_dtype!r}")
    return Serving(
        max_model_len=max_model_len,
        max_concurrency=_integer(serving["maxConcurrency"], f"{path}.maxConcurrency", 1, MAX_CONCURRENCY),
        target_tokens=None if target is None else _integer(target, f"{path}.targetTokens", 1, MAX_TARGET_TOKENS),
        guarantee_full_length=guarantee,
        ssm_state_dtype=dtype,
        kv_cache_dtype=kv_dtype,
        workload=None if serving.get("workload") is None else _workload(serving["workload"], max_model_len),
        prefix_caching=PrefixCaching() if serving.get("prefixCaching") is None
        else _prefix_caching(serving["prefixCaching"]),
        target_tpot_ms=None if serving.get("targetTpotMs") is None
        else _integer(serving["targetTpotMs"], f"{path}.targetTpotMs", 1, MAX_TARGET_TPOT_MS),
    )


def _gpu(raw: Any) -> GpuConstraint:
    path = "spec.gpu"
    if raw is None:
        return GpuConstraint()
    gpu = _mapping(raw, path, ("product", "memoryMiB", "maxPerReplica", "shared", "computeCapability"))
    product, memory, max_per_replica = gpu.get("product"), gpu.get("memoryMiB"), gpu.get("maxPerReplica")
    capability = gpu.get("computeCapability")
    if capability is not None:
        if not isinstance(capability, str):
            raise SpecError(f"{path}.computeCapability must be a string such as \"9.0\", got {_kind(capability)}")
        try:
            capability = parse_compute_capability(capability, f"{path}.computeCapability")
        except GpuError as exc:
            raise SpecError(str(exc)) from None
    return GpuConstraint(
        shared=_boolean(gpu.get("shared", False), f"{path}.shared"),
        compute_capability=capability,
        product=None if product is None else _string(product, f"{path}.product", MAX_GPU_PRODUCT_LENGTH,
                                                     GPU_PRODUCT_PATTERN, "a GFD product such as NVIDIA-H200"),
        memory_mib=None if memory is None else _integer(memory, f"{path}.memoryMiB", 1, MAX_GPU_MEMORY_MIB),
        max_per_replica=None if max_per_replica is None else _integer(
            max_per_replica, f"{path}.maxPerReplica", 1, MAX_GPUS_PER_REPLICA
        ),
    )


def _node_selector(raw: Any) -> dict[str, str]:
    path = "spec.nodeSelector"
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SpecError(f"{path} must be a map of label keys to values, got {_kind(raw)}")
    if len(raw) > MAX_NODE_SELECTOR_ENTRIES:
        raise SpecError(f"{path} has {len(raw)} entries; at most {MAX_NODE_SELECTOR_ENTRIES} are accepted")
    selector = {}
    for key, value in raw.items():
        key = _string(key, f"{path} key", MAX_LABEL_KEY_LENGTH, LABEL_KEY_PATTERN, "a Kubernetes label key")
        valid = isinstance(value, str) and len(value) <= MAX_LABEL_VALUE_LENGTH and re.match(LABEL_VALUE_PATTERN, value)
        if not valid:
            raise SpecError(
                f"{path}.{key} must be a label value (≤ {MAX_LABEL_VALUE_LENGTH} characters), got {value!r}"
            )
        selector[key] = value
    return selector


def _tolerations(raw: Any) -> tuple[dict, ...]:
    path = "spec.tolerations"
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError(f"{path} must be a list, got {_kind(raw)}")
    if len(raw) > MAX_TOLERATIONS:
        raise SpecError(f"{path} has {len(raw)} entries; at most {MAX_TOLERATIONS} are accepted")
    tolerations = []
    for index, item in enumerate(raw):
        where = f"{path}[{index}]"
        item = _mapping(item, where, ("key", "operator", "value", "effect", "tolerationSeconds"))
        toleration: dict[str, Any] = {}
        if item.get("key") is not None:
            toleration["key"] = _string(item["key"], f"{where}.key", MAX_LABEL_KEY_LENGTH, LABEL_KEY_PATTERN)
        operator = item.get("operator", "Equal")
        if operator not in TOLERATION_OPERATORS:
            raise SpecError(f"{where}.operator must be one of {', '.join(TOLERATION_OPERATORS)}, got {operator!r}")
        toleration["operator"] = operator
        if item.get("value") is not None:
            if operator == "Exists":
                raise SpecError(f"{where}.value must be empty when operator is Exists")
            value = item["value"]
            if not isinstance(value, str) or len(value) > MAX_LABEL_VALUE_LENGTH:
                raise SpecError(f"{where}.value must be a string of ≤ {MAX_LABEL_VALUE_LENGTH} characters")
            toleration["value"] = value
        if item.get("effect") is not None:
            if item["effect"] not in TOLERATION_EFFECTS:
                raise SpecError(
                    f"{where}.effect must be one of {', '.join(TOLERATION_EFFECTS)}, got {item['effect']!r}"
                )
            toleration["effect"] = item["effect"]
        if item.get("tolerationSeconds") is not None:
            if toleration.get("effect") != "NoExecute":
                raise SpecError(f"{where}.tolerationSeconds is only allowed with effect NoExecute")
            toleration["tolerationSeconds"] = _integer(
                item["tolerationSeconds"], f"{where}.tolerationSeconds", 0, MAX_TOLERATION_SECONDS
            )
        if "key" not in toleration and operator != "Exists":
            raise SpecError(f"{where}: a toleration without a key must use operator Exists")
        tolerations.append(toleration)
    return tuple(tolerations)


def _resources(raw: Any) -> dict[str, dict[str, str]]:
    path = "spec.resources"
    if raw is None:
        return {}
    resources = _mapping(raw, path, ("requests", "limits"))
    parsed: dict[str, dict[str, str]] = {}
    for section in ("requests", "limits"):
        values = resources.get(section)
        if values is None:
            continue
        if not isinstance(values, dict):
            raise SpecError(f"{path}.{section} must be an object, got {_kind(values)}")
        parsed[section] = {}
        for name, quantity in values.items():
            if name == GPU_RESOURCE_NAME:
                raise SpecError(
                    f"{path}.{section}.{GPU_RESOURCE_NAME} is set by the plan (one GPU per tensor-parallel rank); "
                    "use gpu.maxPerReplica or overrides.tensorParallelSize instead"
                )
            if name not in RESOURCE_NAMES:
                raise SpecError(f"{path}.{section}.{name} is not supported; use {', '.join(RESOURCE_NAMES)}")
            if isinstance(quantity, bool) or not isinstance(quantity, (str, int)):
                raise SpecError(f"{path}.{section}.{name} must be a quantity string such as '8Gi', got {quantity!r}")
            text = str(quantity)
            if len(text) > 64 or not re.match(QUANTITY_PATTERN, text):
                raise SpecError(f"{path}.{section}.{name} {quantity!r} is not a Kubernetes quantity such as '8Gi'")
            parsed[section][name] = text
    return parsed


def _overrides(raw: Any, serving: Serving) -> Overrides:
    path = "spec.overrides"
    if raw is None:
        return Overrides()
    overrides = _mapping(raw, path, ("tensorParallelSize", "gpuMemoryUtilization", "maxNumSeqs"))
    tp = overrides.get("tensorParallelSize")
    utilization = overrides.get("gpuMemoryUtilization")
    max_num_seqs = overrides.get("maxNumSeqs")
    if utilization is not None:
        if not isinstance(utilization, str):
            raise SpecError(
                f"{path}.gpuMemoryUtilization must be a string such as \"0.90\" (quoted in YAML), "
                f"got {_kind(utilization)} {utilization!r}"
            )
        if not re.match(UTILIZATION_PATTERN, utilization) or Decimal(utilization) <= 0:
            raise SpecError(f"{path}.gpuMemoryUtilization {utilization!r} must be in (0, 1] with at most two decimals")
    if max_num_seqs is not None:
        max_num_seqs = _integer(max_num_seqs, f"{path}.maxNumSeqs", 1, MAX_CONCURRENCY)
        if max_num_seqs < serving.max_concurrency:
            raise SpecError(
                f"{path}.maxNumSeqs {max_num_seqs} is below serving.maxConcurrency {serving.max_concurrency}; "
                "the engine could not run that many requests at once"
            )
    return Overrides(
        tensor_parallel_size=None if tp is None else _integer(tp, f"{path}.tensorParallelSize", 1,
                                                              MAX_GPUS_PER_REPLICA),
        gpu_memory_utilization=utilization,
        max_num_seqs=max_num_seqs,
    )


def _auth(raw: Any) -> SecretKeyRef | None:
    if raw is None:
        return None
    path = "spec.auth"
    ref = _mapping(_mapping(raw, path, ("secretRef",), ("secretRef",))["secretRef"], f"{path}.secretRef",
                   ("name", "key"), ("name",))
    return SecretKeyRef(
        name=_string(ref["name"], f"{path}.secretRef.name", MAX_SUBDOMAIN_LENGTH, DNS1123_SUBDOMAIN_PATTERN,
                     "a Secret name"),
        key=_string(ref.get("key", DEFAULT_AUTH_SECRET_KEY), f"{path}.secretRef.key", MAX_SUBDOMAIN_LENGTH,
                    r"^[-._a-zA-Z0-9]+$", "a Secret key"),
    )


def _autoscaling(raw: Any) -> Autoscaling | None:
    if raw is None:
        return None
    path = "spec.autoscaling"
    autoscaling = _mapping(raw, path, ("minReplicas", "maxReplicas", "targetUsagePercent"), ("maxReplicas",))
    minimum = _integer(autoscaling.get("minReplicas", 1), f"{path}.minReplicas", 1, MAX_REPLICAS)
    maximum = _integer(autoscaling["maxReplicas"], f"{path}.maxReplicas", 1, MAX_REPLICAS)
    if maximum < minimum:
        raise SpecError(f"{path}.maxReplicas {maximum} is below minReplicas {minimum}")
    target = _integer(autoscaling.get("targetUsagePercent", DEFAULT_TARGET_USAGE_PERCENT),
                      f"{path}.targetUsagePercent", 1, 100)
    return Autoscaling(max_replicas=maximum, min_replicas=minimum, target_usage_percent=target)


def _match_labels(raw: Any, path: str) -> dict[str, str]:
    selector = _mapping(raw, path, ("matchLabels",), ("matchLabels",))["matchLabels"]
    if not isinstance(selector, dict) or not 1 <= len(selector) <= MAX_PEER_LABELS:
        raise SpecError(f"{path}.matchLabels must be a map of 1 to {MAX_PEER_LABELS} labels")
    for key, value in selector.items():
        _string(key, f"{path}.matchLabels key", MAX_LABEL_KEY_LENGTH, LABEL_KEY_PATTERN, "a label key")
        if not isinstance(value, str) or len(value) > MAX_LABEL_VALUE_LENGTH or not re.match(LABEL_VALUE_PATTERN, value):
            raise SpecError(f"{path}.matchLabels[{key!r}] must be a label value of at most {MAX_LABEL_VALUE_LENGTH} "
                            "characters")
    return dict(selector)


def _network_policy(raw: Any) -> NetworkPolicy | None:
    if raw is None:
        return None
    path = "spec.networkPolicy"
    peers_raw = _mapping(raw, path, ("from",)).get("from") or []
    if not isinstance(peers_raw, list) or len(peers_raw) > MAX_NETWORK_PEERS:
        raise SpecError(f"{path}.from must be a list of at most {MAX_NETWORK_PEERS} peers")
    peers = []
    for index, peer_raw in enumerate(peers_raw):
        where = f"{path}.from[{index}]"
        peer = _mapping(peer_raw, where, ("namespaceSelector", "podSelector"))
        if peer.get("namespaceSelector") is None and peer.get("podSelector") is None:
            raise SpecError(f"{where} must set namespaceSelector, podSelector or both")
        peers.append(NetworkPeer(
            namespace_labels=None if peer.get("namespaceSelector") is None
            else _match_labels(peer["namespaceSelector"], f"{where}.namespaceSelector"),
            pod_labels=None if peer.get("podSelector") is None else _match_labels(peer["podSelector"], f"{where}.podSelector"),
        ))
    return NetworkPolicy(peers=tuple(peers))


def _cache(raw: Any) -> CacheVolume | None:
    if raw is None:
        return None
    path = "spec.cache"
    claim, folder = _pvc_folder(_mapping(raw, path, ("pvc",), ("pvc",))["pvc"], f"{path}.pvc")
    return CacheVolume(claim_name=claim, path=folder)


SPEC_FIELDS = ("model", "serving", "gpu", "replicas", "image", "nodeSelector", "tolerations", "resources",
               "overrides", "auth", "autoscaling", "networkPolicy", "cache")


def parse_hybridmodel(obj: Any, require_source: bool = True) -> HybridModelSpec:
    """Validate a HybridModel object (a dict from YAML or the API server); SpecError names the first bad field.

    `require_source=False` accepts a resource without spec.model.source, for planning only (`hybridkv plan` flags).
    """
    top = _mapping(obj, "HybridModel", ("apiVersion", "kind", "metadata", "spec", "status"),
                   ("apiVersion", "kind", "metadata", "spec"))
    if top["apiVersion"] != API_VERSION:
        raise SpecError(f"apiVersion must be {API_VERSION!r}, got {top['apiVersion']!r}")
    if top["kind"] != KIND:
        raise SpecError(f"kind must be {KIND!r}, got {top['kind']!r}")
    metadata = top["metadata"]
    if not isinstance(metadata, dict):
        raise SpecError(f"metadata must be an object, got {_kind(metadata)}")
    if metadata.get("name") is None:
        raise SpecError("metadata.name is required")
    name = _string(metadata["name"], "metadata.name", MAX_HYBRIDMODEL_NAME_LENGTH, DNS1035_LABEL_PATTERN,
                   "lower-case letters, digits and '-', starting with a letter (it names a Service)")
    namespace = metadata.get("namespace")
    if namespace is not None:
        namespace = _string(namespace, "metadata.namespace", MAX_RESOURCE_NAME_LENGTH, DNS1123_LABEL_PATTERN)
    spec = _mapping(top["spec"], "spec", SPEC_FIELDS, ("model", "serving"))
    serving = _serving(spec["serving"])
    replicas = spec.get("replicas")
    image = spec.get("image")
    return HybridModelSpec(
        name=name,
        namespace=namespace,
        model=_model(spec["model"], require_source),
        serving=serving,
        gpu=_gpu(spec.get("gpu")),
        replicas=1 if replicas is None else _integer(replicas, "spec.replicas", 0, MAX_REPLICAS),
        image=None if image is None else _string(image, "spec.image", MAX_IMAGE_LENGTH, IMAGE_PATTERN,
                                                 "a container image reference"),
        node_selector=_node_selector(spec.get("nodeSelector")),
        tolerations=_tolerations(spec.get("tolerations")),
        resources=_resources(spec.get("resources")),
        overrides=_overrides(spec.get("overrides"), serving),
        auth_secret=_auth(spec.get("auth")),
        autoscaling=_autoscaling(spec.get("autoscaling")),
        network_policy=_network_policy(spec.get("networkPolicy")),
        cache=_cache(spec.get("cache")),
    )


def load_hybridmodel_yaml(text: str, source: str = "<input>") -> HybridModelSpec:
    return parse_hybridmodel(read_hybridmodel_yaml(text, source))


def read_hybridmodel_yaml(text: str, source: str = "<input>") -> Any:
    """Parse one HybridModel YAML document; malformed YAML is a SpecError with the line and column."""
    if len(text.encode()) > MAX_YAML_BYTES:
        raise SpecError(f"{source} is larger than {MAX_YAML_BYTES} bytes")
    try:
        documents = [doc for doc in _yaml_documents(text, source) if doc is not None]
    except RecursionError:
        raise SpecError(f"{source} nests deeper than YAML can be read here") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{source} is not valid YAML{where}: {problem}") from None
    if len(documents) != 1:
        raise SpecError(f"{source} must hold exactly one HybridModel document, found {len(documents)}")
    return documents[0]


def _yaml_documents(text: str, source: str) -> list:
    """`yaml.safe_load_all`, with each document's node graph checked before it is built: aliases may repeat a
    subtree, so a few lines of nested aliases would otherwise expand into billions of values."""
    loader = yaml.SafeLoader(text)
    try:
        documents = []
        while loader.check_node():
            node = loader.get_node()
            _expanded_nodes(node, 0, {}, source)
            documents.append(loader.construct_document(node))
        return documents
    finally:
        loader.dispose()


def _expanded_nodes(node, depth: int, sizes: dict, source: str) -> int:
    """Nodes `node` stands for with every alias expanded (a shared subtree counted each time it is used); refuses
    more than MAX_YAML_NODES, nesting past MAX_YAML_DEPTH, an alias inside its own anchor, and a key given twice in
    one mapping (kubectl refuses those too)."""
    if id(node) in sizes:
        if sizes[id(node)] is None:
            raise SpecError(f"{source}: an alias refers to the mapping or list it is inside "
                            f"(line {node.start_mark.line + 1})")
        return sizes[id(node)]
    if depth > MAX_YAML_DEPTH:
        raise SpecError(f"{source} nests deeper than {MAX_YAML_DEPTH} levels (line {node.start_mark.line + 1})")
    sizes[id(node)] = None
    size = 1
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in seen:
                    raise SpecError(f"{source}: key {key.value[:80]!r} appears twice in one mapping "
                                    f"(line {key.start_mark.line + 1})")
                seen.add(key.value)
            size += _expanded_nodes(key, depth + 1, sizes, source) + _expanded_nodes(value, depth + 1, sizes, source)
            if size > MAX_YAML_NODES:
                break
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            size += _expanded_nodes(item, depth + 1, sizes, source)
            if size > MAX_YAML_NODES:
                break
    if size > MAX_YAML_NODES:
        raise SpecError(f"{source} expands to more than {MAX_YAML_NODES} values (its aliases repeat too much)")
    sizes[id(node)] = size
    return size


def load_hybridmodel_file(path: str | Path) -> HybridModelSpec:
    return parse_hybridmodel(read_hybridmodel_file(path))


def read_hybridmodel_file(path: str | Path) -> Any:
    """The one YAML document of a HybridModel file, not yet validated."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_YAML_BYTES:
            raise SpecError(f"{path} is larger than {MAX_YAML_BYTES} bytes")
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path} is not UTF-8 text") from None
    return read_hybridmodel_yaml(text, str(path))
