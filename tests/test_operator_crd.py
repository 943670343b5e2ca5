"""The HybridModel CRD against the parser: same bounds, same verdicts on the examples, and the messages users see.

The API server checks a HybridModel in two passes, reproduced here: the structural OpenAPI schema (with jsonschema)
after applying the schema's defaults, then every `x-kubernetes-validations` CEL rule (with the
common-expression-language package) on the node it is attached to.
"""

from __future__ import annotations

import functools
import pathlib

import cel
import jsonschema
import pytest
import yaml

from hybridkv.operator.manifests import HEADLESS_SUFFIX
from hybridkv.sizing import allocators as allocators_module
from hybridkv.sizing import spec as spec_module
from hybridkv.sizing.errors import SpecError
from hybridkv.sizing.geometry import catalog_entry, catalog_geometry, catalog_names

ROOT = pathlib.Path(__file__).resolve().parents[1]
CRD_PATH = ROOT / "charts" / "hybridkv" / "crds" / "hybridmodels.hybridkv.io.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CATALOG_EXAMPLE = ROOT / "examples" / "qwen3.5-4b-h200.yaml"
INVALID = sorted((ROOT / "tests" / "data" / "invalid-hybridmodels").glob("*.yaml"))


@functools.cache
def crd() -> dict:
    return yaml.safe_load(CRD_PATH.read_text())


def version() -> dict:
    (served,) = crd()["spec"]["versions"]
    return served


def schema() -> dict:
    return version()["schema"]["openAPIV3Schema"]


def node(path: str) -> dict:
    """The schema of a dotted field path under the root (e.g. "spec.serving.maxModelLen")."""
    current = schema()
    for part in path.split("."):
        current = current["items"] if part == "[]" else current["properties"][part]
    return current


def with_defaults(value, schema_node):
    """The object as the API server stores it: missing fields with a schema default are filled in."""
    if isinstance(value, dict) and "properties" in schema_node:
        filled = dict(value)
        for key, child in schema_node["properties"].items():
            if key not in filled and "default" in child:
                filled[key] = child["default"]
            if key in filled:
                filled[key] = with_defaults(filled[key], child)
        return filled
    if isinstance(value, list) and "items" in schema_node:
        return [with_defaults(item, schema_node["items"]) for item in value]
    return value


def cel_failures(value, schema_node, path: str = "") -> list[str]:
    """Messages of the CEL rules that reject `value`, depth first, each prefixed with the field path."""
    failures = []
    for rule in schema_node.get("x-kubernetes-validations", []):
        if not cel.evaluate(rule["rule"], {"self": value}):
            message = rule.get("message") or cel.evaluate(rule["messageExpression"], {"self": value})
            failures.append(f"{path}: {message}" if path else message)
    if isinstance(value, dict) and "properties" in schema_node:
        for key, child in schema_node["properties"].items():
            if key in value:
                failures += cel_failures(value[key], child, f"{path}.{key}" if path else key)
    elif isinstance(value, dict) and isinstance(schema_node.get("additionalProperties"), dict):
        for key, item in value.items():
            failures += cel_failures(item, schema_node["additionalProperties"], f"{path}[{key}]")
    elif isinstance(value, list) and "items" in schema_node:
        for index, item in enumerate(value):
            failures += cel_failures(item, schema_node["items"], f"{path}[{index}]")
    return failures


def api_server_errors(obj: dict) -> list[str]:
    """What `kubectl apply` would report for `obj`: schema errors first; CEL runs only on a well-typed object."""
    stored = with_defaults(obj, schema())
    validator = jsonschema.Draft202012Validator(schema())
    errors = [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(stored), key=lambda e: list(map(str, e.absolute_path)))
    ]
    return errors or cel_failures(stored, schema())


def expectations(path: pathlib.Path) -> dict[str, str]:
    lines = [line.removeprefix("# ") for line in path.read_text().splitlines() if line.startswith("# ")]
    return dict(line.split(": ", 1) for line in lines if line.split(": ", 1)[0] in ("crd", "parser"))


def test_crd_names_scope_and_subresources():
    spec = crd()["spec"]
    assert crd()["metadata"]["name"] == f"{spec_module.PLURAL}.{spec_module.GROUP}"
    assert (spec["group"], spec["scope"], spec["names"]["kind"]) == (spec_module.GROUP, "Namespaced", spec_module.KIND)
    assert spec["names"]["shortNames"] == [spec_module.SHORT_NAME]
    assert version()["name"] == spec_module.VERSION and version()["served"] and version()["storage"]
    assert version()["subresources"] == {
        "status": {},
        "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas", "labelSelectorPath": ".status.selector"},
    }
    columns = [column["name"] for column in version()["additionalPrinterColumns"] if not column.get("priority")]
    assert columns == ["Ready", "Model", "GPUs", "TP", "Tokens", "Slots", "Age"]


def test_crd_schema_is_structural_and_bounded():
    """Every field has a type, no $ref or additionalProperties: false, and every string, list and map is bounded."""

    def walk(schema_node, path):
        assert "$ref" not in schema_node and schema_node.get("additionalProperties") is not False, path
        if schema_node.get("x-kubernetes-int-or-string"):
            return
        assert "type" in schema_node, path
        kind = schema_node["type"]
        if kind == "string" and "enum" not in schema_node and "format" not in schema_node and path.startswith("spec"):
            assert "maxLength" in schema_node, path
        if kind == "integer":
            assert "minimum" in schema_node, path
        if kind == "array":
            assert "maxItems" in schema_node, path
            walk(schema_node["items"], path + "[]")
        if kind == "object":
            for key, child in schema_node.get("properties", {}).items():
                walk(child, f"{path}.{key}" if path else key)
            if isinstance(schema_node.get("additionalProperties"), dict):
                assert "maxProperties" in schema_node, path
                walk(schema_node["additionalProperties"], path + "{}")

    for part in ("spec", "status"):
        walk(schema()["properties"][part], part)


@pytest.mark.parametrize(
    "path,keyword,expected",
    [
        ("spec.model.name", "maxLength", spec_module.MAX_MODEL_NAME_LENGTH),
        ("spec.model.name", "pattern", spec_module.MODEL_NAME_PATTERN),
        ("spec.model.configMapRef.name", "maxLength", spec_module.MAX_SUBDOMAIN_LENGTH),
        ("spec.model.configMapRef.key", "default", spec_module.DEFAULT_CONFIG_MAP_KEY),
        ("spec.model.source.pvc.claimName", "pattern", spec_module.DNS1123_SUBDOMAIN_PATTERN),
        ("spec.model.source.pvc.path", "maxLength", spec_module.MAX_PVC_PATH_LENGTH),
        ("spec.cache.pvc.claimName", "pattern", spec_module.DNS1123_SUBDOMAIN_PATTERN),
        ("spec.cache.pvc.claimName", "maxLength", spec_module.MAX_SUBDOMAIN_LENGTH),
        ("spec.cache.pvc.path", "maxLength", spec_module.MAX_PVC_PATH_LENGTH),
        ("spec.cache.pvc.path", "default", "."),
        ("spec.model.source.uri", "maxLength", spec_module.MAX_URI_LENGTH),
        ("spec.model.source.uri", "pattern", spec_module.HF_URI_PATTERN),
        ("spec.model.secretRef.name", "pattern", spec_module.DNS1123_SUBDOMAIN_PATTERN),
        ("spec.serving.maxModelLen", "maximum", spec_module.MAX_MODEL_LEN_TOKENS),
        ("spec.serving.maxConcurrency", "maximum", spec_module.MAX_CONCURRENCY),
        ("spec.serving.targetTokens", "maximum", spec_module.MAX_TARGET_TOKENS),
        ("spec.serving.kvCacheDtype", "enum", list(spec_module.KV_CACHE_DTYPES)),
        ("spec.serving.kvCacheDtype", "default", "auto"),
        ("spec.serving.targetTpotMs", "maximum", spec_module.MAX_TARGET_TPOT_MS),
        ("spec.serving.workload.conversations.turns", "maximum", spec_module.MAX_CONVERSATION_TURNS),
        ("spec.serving.workload.conversations.systemPromptTokens", "maximum", spec_module.MAX_MODEL_LEN_TOKENS),
        ("spec.serving.workload.conversations.history", "enum", list(spec_module.CONVERSATION_HISTORIES)),
        ("spec.serving.workload.conversations.history", "default", spec_module.CONVERSATION_HISTORIES[0]),
        ("spec.serving.prefixCaching.enabled", "default", spec_module.PrefixCaching().enabled),
        ("spec.serving.prefixCaching.checkpointSlots", "maximum", allocators_module.MAX_CHECKPOINT_SLOTS),
        ("spec.serving.prefixCaching.checkpointIntervalTokens", "multipleOf", allocators_module.DEFAULT_BLOCK_SIZE),
        ("spec.serving.prefixCaching.checkpointIntervalTokens", "maximum", spec_module.MAX_MODEL_LEN_TOKENS),
        ("spec.gpu.product", "maxLength", spec_module.MAX_GPU_PRODUCT_LENGTH),
        ("spec.gpu.product", "pattern", spec_module.GPU_PRODUCT_PATTERN),
        ("spec.gpu.memoryMiB", "maximum", spec_module.MAX_GPU_MEMORY_MIB),
        ("spec.gpu.maxPerReplica", "maximum", spec_module.MAX_GPUS_PER_REPLICA),
        ("spec.replicas", "maximum", spec_module.MAX_REPLICAS),
        ("spec.replicas", "default", 1),
        ("spec.image", "maxLength", spec_module.MAX_IMAGE_LENGTH),
        ("spec.image", "pattern", spec_module.IMAGE_PATTERN),
        ("spec.nodeSelector", "maxProperties", spec_module.MAX_NODE_SELECTOR_ENTRIES),
        ("spec.tolerations", "maxItems", spec_module.MAX_TOLERATIONS),
        ("spec.tolerations.[].key", "maxLength", spec_module.MAX_LABEL_KEY_LENGTH),
        ("spec.tolerations.[].value", "maxLength", spec_module.MAX_LABEL_VALUE_LENGTH),
        ("spec.tolerations.[].operator", "enum", list(spec_module.TOLERATION_OPERATORS)),
        ("spec.tolerations.[].effect", "enum", list(spec_module.TOLERATION_EFFECTS)),
        ("spec.tolerations.[].tolerationSeconds", "maximum", spec_module.MAX_TOLERATION_SECONDS),
        ("spec.resources.requests", "maxProperties", len(spec_module.RESOURCE_NAMES)),
        ("spec.overrides.tensorParallelSize", "maximum", spec_module.MAX_GPUS_PER_REPLICA),
        ("spec.overrides.gpuMemoryUtilization", "pattern", spec_module.UTILIZATION_PATTERN),
        ("spec.overrides.maxNumSeqs", "maximum", spec_module.MAX_CONCURRENCY),
    ],
)
def test_crd_bounds_match_the_parser(path, keyword, expected):
    assert node(path)[keyword] == expected


def test_crd_states_the_parsers_inline_config_limit():
    assert f"at most {spec_module.MAX_CONFIG_JSON_BYTES} bytes of JSON" in node("spec.model.config")["description"]


def test_crd_spec_fields_are_the_parsers():
    assert tuple(node("spec")["properties"]) == spec_module.SPEC_FIELDS
    for integer_field in ("spec.serving.maxModelLen", "spec.serving.maxConcurrency", "spec.gpu.memoryMiB", "spec.replicas"):
        assert node(integer_field)["minimum"] in (0, 1)
    assert node("spec.overrides.gpuMemoryUtilization")["type"] == "string"  # no floats in spec


def test_name_bound_leaves_room_for_the_headless_service_name():
    longest = "a" * (spec_module.MAX_RESOURCE_NAME_LENGTH - len(HEADLESS_SUFFIX))
    assert len(longest) == spec_module.MAX_HYBRIDMODEL_NAME_LENGTH  # the parser and the CRD agree
    example = yaml.safe_load(CATALOG_EXAMPLE.read_text())
    assert api_server_errors({**example, "metadata": {"name": longest}}) == []
    assert api_server_errors({**example, "metadata": {"name": longest + "a"}})


@pytest.mark.parametrize("name", [n for entry in catalog_names() for n in (entry, *catalog_entry(entry).hf_ids)])
def test_max_model_len_rule_knows_each_catalog_models_limit(name):
    limit = catalog_geometry(name).max_position_embeddings
    example = yaml.safe_load(CATALOG_EXAMPLE.read_text())
    example["spec"]["model"]["name"] = name
    example["spec"]["serving"]["maxModelLen"] = limit
    assert api_server_errors(example) == []
    example["spec"]["serving"]["maxModelLen"] = limit + 1
    assert api_server_errors(example) == [f"spec: serving.maxModelLen {limit + 1} exceeds the {limit} tokens {name} supports"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_the_api_server_and_the_parser(path):
    obj = yaml.safe_load(path.read_text())
    assert api_server_errors(obj) == []
    parsed = spec_module.parse_hybridmodel(obj)
    assert parsed.name == obj["metadata"]["name"]


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_each_invalid_hybridmodel_is_rejected_with_the_message_a_user_sees(path):
    expected = expectations(path)
    obj = yaml.safe_load(path.read_text())
    errors = api_server_errors(obj)
    assert errors, f"{path.name} passed the CRD"
    assert any(expected["crd"] in error for error in errors), errors
    if expected["parser"].startswith("accepts"):
        spec_module.parse_hybridmodel(obj)
    else:
        with pytest.raises(SpecError) as raised:
            spec_module.parse_hybridmodel(obj)
        assert expected["parser"] in str(raised.value)


def _without_nulls(value):
    """The object as stored after a merge patch: null fields are deleted."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


@pytest.mark.parametrize("path", [p for p in EXAMPLES if "gpu:\n    product" in p.read_text() or "memoryMiB" in p.read_text()], ids=lambda p: p.name)
def test_the_status_the_operator_writes_fits_the_crd_status_schema(path):
    """A status with every field the operator writes is accepted as is: nothing pruned, nothing rejected."""
    from hybridkv.operator import status as hm_status
    from hybridkv.operator.planning import plan_status
    from hybridkv.sizing.planner import plan

    obj = yaml.safe_load(path.read_text())
    obj["metadata"] = {**obj["metadata"], "namespace": "models", "generation": 1}
    parsed = spec_module.parse_hybridmodel(obj)
    config = catalog_entry("qwen3.5-4b").config if parsed.model.config_map_ref else None
    planned = plan(parsed, model_config=config)
    report = {
        "block_size": 16, "token_blocks": 1000, "token_capacity": 16000, "state_slots": 8, "token_pool_bytes": 1 << 30,
        "state_pool_bytes": 1 << 28, "budget_bytes": 2 << 30, "weights_bytes": 8 << 30, "reserve_bytes": 1 << 30,
        "tensor_parallel_size": planned.tensor_parallel_size,
    }
    facts = {
        "plan": plan_status(planned),
        "planFailure": {"reason": "InvalidSpec", "message": "an earlier failure"},
        "observedGeneration": 1,
        "selector": "app.kubernetes.io/instance=x",
        "replicas": 1,
        "readyReplicas": 1,
        "capacity": hm_status.measured_capacity({"x-0": report}, ["x-1"], "2026-11-29T13:00:00Z"),
    }
    facts["conditions"] = hm_status.conditions_for(obj, facts, 1, "2026-11-29T13:00:00Z")
    status_schema = schema()["properties"]["status"]
    stored = _without_nulls(facts)
    assert list(jsonschema.Draft202012Validator(status_schema).iter_errors(stored)) == []

    def unknown_fields(value, schema_node, path="status"):
        if isinstance(value, dict) and "properties" in schema_node:
            return [f"{path}.{key}" for key in value if key not in schema_node["properties"]] + [
                missing
                for key, item in value.items()
                if key in schema_node["properties"]
                for missing in unknown_fields(item, schema_node["properties"][key], f"{path}.{key}")
            ]
        if isinstance(value, list) and "items" in schema_node:
            return [missing for item in value for missing in unknown_fields(item, schema_node["items"], path + "[]")]
        return []

    assert unknown_fields(stored, status_schema) == []  # the API server would prune these silently
