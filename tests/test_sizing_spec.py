"""The HybridModel parser: the examples parse, every bad field gets one specific SpecError."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from hybridkv.errors import UserError
from hybridkv.sizing import SpecError, catalog_entry
from hybridkv.sizing.spec import load_hybridmodel_file, load_hybridmodel_yaml, parse_hybridmodel

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))

VALID = {
    "apiVersion": "hybridkv.io/v1alpha1",
    "kind": "HybridModel",
    "metadata": {"name": "demo", "namespace": "serving", "uid": "1234", "resourceVersion": "7"},
    "spec": {
        "model": {"name": "qwen3.5-9b", "source": {"pvc": {"claimName": "models", "path": "Qwen3.5-9B"}}},
        "serving": {"maxModelLen": 8192, "maxConcurrency": 64},
    },
}


def _with(path: str, value):
    obj = copy.deepcopy(VALID)
    *parents, last = path.split(".")
    node = obj
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return obj


_DELETE = object()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse(path):
    spec = load_hybridmodel_file(path)
    assert spec.serving.max_concurrency >= 1 and spec.model.source is not None


def test_valid_resource_with_every_field():
    obj = _with("spec.gpu", {"product": "NVIDIA-H100-80GB-HBM3", "memoryMiB": 81559, "maxPerReplica": 2})
    obj["spec"].update(
        replicas=2,
        image="ghcr.io/example/hybridkv:0.1.0",
        nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        resources={"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi"}},
        overrides={"tensorParallelSize": 2, "gpuMemoryUtilization": "0.90", "maxNumSeqs": 128},
    )
    obj["spec"]["serving"]["targetTokens"] = 500_000
    spec = parse_hybridmodel(obj)
    assert (spec.name, spec.namespace, spec.replicas) == ("demo", "serving", 2)
    assert spec.overrides.gpu_memory_utilization == "0.90" and spec.overrides.max_num_seqs == 128
    assert spec.gpu.memory_mib == 81559 and spec.serving.target_tokens == 500_000
    assert spec.model.source.pvc_claim_name == "models"


def test_a_cache_folder_is_optional_and_defaults_to_the_volume_root():
    assert parse_hybridmodel(VALID).cache is None
    spec = parse_hybridmodel(_with("spec.cache", {"pvc": {"claimName": "kernels"}}))
    assert (spec.cache.claim_name, spec.cache.path) == ("kernels", ".")
    spec = parse_hybridmodel(_with("spec.cache", {"pvc": {"claimName": "kernels", "path": "team-a/qwen"}}))
    assert (spec.cache.claim_name, spec.cache.path) == ("kernels", "team-a/qwen")


def test_inline_config_is_validated_and_gives_a_geometry():
    config = copy.deepcopy(catalog_entry("qwen3.5-0.8b").config)
    spec = parse_hybridmodel(_with("spec.model.config", config))
    assert spec.inline_geometry().num_parameters() == 752_393_024
    del config["head_dim"]
    with pytest.raises(SpecError, match="spec.model.config: config is missing 'head_dim'"):
        parse_hybridmodel(_with("spec.model.config", config))


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("apiVersion", "hybridkv.io/v1", "apiVersion must be 'hybridkv.io/v1alpha1'"),
        ("kind", "Deployment", "kind must be 'HybridModel'"),
        ("metadata.name", "Bad_Name", "metadata.name 'Bad_Name' is not valid"),
        ("metadata.name", _DELETE, "metadata.name is required"),
        ("metadata.name", "m" * 55, "metadata.name must be 1 to 54 characters, got 55"),
        ("spec.model.name", _DELETE, "spec.model.name is required"),
        ("spec.model.name", "../etc", "spec.model.name '../etc' is not valid"),
        ("spec.model.source", _DELETE, "spec.model.source is required"),
        ("spec.model.config", {"padding": "x" * 65_536}, "spec.model.config is 65551 bytes of JSON; at most 65536"),
        ("spec.model.source", {"pvc": {"claimName": "m"}, "uri": "hf://a/b"}, "exactly one of pvc"),
        ("spec.model.source", {"uri": "https://example.com/x"}, "hf://org/name"),
        ("spec.model.source", {"pvc": {"claimName": "m", "path": "../x"}}, "must not contain '..'"),
        ("spec.model.configMapRef", {"name": "cfg"}, None),
        ("spec.serving.maxModelLen", 8192.0, "maxModelLen must be an integer.*a float"),
        ("spec.serving.maxModelLen", 0, "maxModelLen = 0 is outside"),
        ("spec.serving.maxConcurrency", True, "maxConcurrency must be an integer.*a boolean"),
        ("spec.serving.maxConcurrency", 70_000, "is outside \\[1, 65536\\]"),
        ("spec.serving.targetTokens", "1M", "targetTokens must be an integer"),
        ("spec.serving.targetTpotMs", 0, "targetTpotMs = 0 is outside \\[1, 60000\\]"),
        ("spec.serving.targetTpotMs", 20.5, "targetTpotMs must be an integer"),
        ("spec.serving.extra", 1, "spec.serving has unknown field\\(s\\) extra"),
        ("spec.gpu", {"memoryMiB": -1}, "spec.gpu.memoryMiB = -1 is outside"),
        ("spec.gpu", {"maxPerReplica": 0}, "maxPerReplica = 0 is outside"),
        ("spec.replicas", -1, "spec.replicas = -1 is outside"),
        ("spec.overrides", {"gpuMemoryUtilization": 0.9}, "must be a string such as \"0.90\""),
        ("spec.overrides", {"gpuMemoryUtilization": "1.5"}, "must be in \\(0, 1\\]"),
        ("spec.overrides", {"gpuMemoryUtilization": "0.00"}, "must be in \\(0, 1\\]"),
        ("spec.overrides", {"gpuMemoryUtilization": "0.905"}, "at most two decimals"),
        ("spec.overrides", {"maxNumSeqs": 32}, "maxNumSeqs 32 is below serving.maxConcurrency 64"),
        ("spec.overrides", {"tensorParallelSize": 0}, "tensorParallelSize = 0 is outside"),
        ("spec.resources", {"limits": {"nvidia.com/gpu": 2}}, "is set by the plan"),
        ("spec.resources", {"limits": {"memory": "lots"}}, "not a Kubernetes quantity"),
        ("spec.tolerations", [{"operator": "Sometimes"}], "operator must be one of Exists, Equal"),
        ("spec.nodeSelector", {"ok": 3}, "must be a label value"),
        ("spec.surprise", {}, "spec has unknown field\\(s\\) surprise"),
        ("spec.cache", {}, "spec.cache.pvc is required"),
        ("spec.cache", {"emptyDir": {}}, "spec.cache has unknown field\\(s\\) emptyDir"),
        ("spec.cache", {"pvc": {"claimName": "Cache_1"}}, "spec.cache.pvc.claimName 'Cache_1' is not valid"),
        ("spec.cache", {"pvc": {"claimName": "c", "path": "/var/cache"}}, "spec.cache.pvc.path '/var/cache' must be relative"),
        ("spec.cache", {"pvc": {"claimName": "c", "path": "a/../../b"}}, "must not contain '..'"),
    ],
)
def test_bad_fields_are_named(path, value, message):
    obj = _with(path, value)
    if message is None:  # a valid variant
        assert parse_hybridmodel(obj).model.config_map_ref.key == "config.json"
        return
    with pytest.raises(SpecError, match=message) as info:
        parse_hybridmodel(obj)
    assert isinstance(info.value, UserError)


def test_source_may_be_left_out_only_for_planning():
    obj = _with("spec.model.source", _DELETE)
    assert parse_hybridmodel(obj, require_source=False).model.source is None
    with pytest.raises(SpecError, match="spec.model.source is required"):
        parse_hybridmodel(obj)


def test_inline_config_and_configmap_together_are_rejected():
    obj = _with("spec.model.configMapRef", {"name": "cfg"})
    obj["spec"]["model"]["config"] = copy.deepcopy(catalog_entry("qwen3.5-0.8b").config)
    with pytest.raises(SpecError, match="not both"):
        parse_hybridmodel(obj)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("apiVersion: hybridkv.io/v1alpha1\nkind: [HybridModel\n", "not valid YAML at line"),
        ("", "exactly one HybridModel document, found 0"),
        ("a: 1\n---\nb: 2\n", "found 2"),
        ("- just\n- a list\n", "HybridModel must be an object, got a list"),
        ("a: 1\nb: 2\na: 3\n", "key 'a' appears twice in one mapping .line 3."),
        ("[" * 5000 + "]" * 5000 + "\n", "nests deeper"),
        ("a: " + "[" * 70 + "]" * 70 + "\n", "nests deeper than 64 levels"),
        ("a: &x [*x]\n", "alias refers to the mapping or list it is inside"),
        # Nine lines of ten aliases each: a billion values once expanded ("billion laughs").
        ("l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 9)), "expands to more than"),
    ],
)
def test_malformed_yaml_gives_one_clear_error(text, message):
    with pytest.raises(SpecError, match=message):
        load_hybridmodel_yaml(text)


def test_aliases_within_the_bound_and_merge_keys_still_load():
    import yaml

    from hybridkv.sizing.spec import read_hybridmodel_yaml

    text = "defaults: &defaults {a: 1, b: [1, 2]}\nuse: {<<: *defaults, b: 2}\nagain: *defaults\n"
    assert read_hybridmodel_yaml(text) == {"defaults": {"a": 1, "b": [1, 2]}, "use": {"a": 1, "b": 2},
                                           "again": {"a": 1, "b": [1, 2]}}
    assert load_hybridmodel_yaml(yaml.safe_dump(VALID)) == parse_hybridmodel(VALID)


def test_missing_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="cannot read"):
        load_hybridmodel_file(tmp_path / "absent.yaml")


def test_prefix_caching_is_on_unless_turned_off_and_keeps_what_it_is_given():
    on = parse_hybridmodel(VALID).serving.prefix_caching
    assert (on.enabled, on.checkpoint_slots, on.checkpoint_interval_tokens) == (True, None, 2048)
    assert parse_hybridmodel(_with("spec.serving.prefixCaching", {})).serving.prefix_caching == on
    off = parse_hybridmodel(_with("spec.serving.prefixCaching", {"enabled": False})).serving.prefix_caching
    assert off.enabled is False
    given = parse_hybridmodel(_with("spec.serving.prefixCaching", {
        "enabled": True, "checkpointSlots": 40, "checkpointIntervalTokens": 0})).serving.prefix_caching
    assert (given.checkpoint_slots, given.checkpoint_interval_tokens) == (40, 0)


@pytest.mark.parametrize(
    "value,message",
    [
        ("yes", "spec.serving.prefixCaching must be an object, got a string"),
        ({"enabled": "true"}, "prefixCaching.enabled must be true or false"),
        ({"enabled": True, "checkpointSlots": 0}, "prefixCaching.checkpointSlots = 0 is outside \\[1, 65536\\]"),
        ({"enabled": True, "checkpointSlots": 2.5}, "checkpointSlots must be an integer.*a float"),
        ({"enabled": True, "checkpointIntervalTokens": 1000}, "checkpointIntervalTokens = 1000 is not a multiple of "
                                                              "the 16-token block"),
        ({"enabled": True, "checkpointIntervalTokens": -16}, "checkpointIntervalTokens = -16 is outside"),
        ({"enabled": False, "checkpointSlots": 8},
         "checkpointSlots applies only with spec.serving.prefixCaching.enabled: true"),
        ({"enabled": True, "slots": 8}, "prefixCaching has unknown field\\(s\\) slots"),
    ],
)
def test_bad_prefix_caching_fields_are_named(value, message):
    with pytest.raises(SpecError, match=message):
        parse_hybridmodel(_with("spec.serving.prefixCaching", value))
