"""Model geometry: config parsing, the catalog, and parameter counts checked against transformers' own models."""

from __future__ import annotations

import copy
import json
import sys
from functools import cache

import pytest

from hybridkv.errors import UserError
from hybridkv.sizing import GeometryError, catalog_entry, catalog_geometry, catalog_names, geometry_from_config

CATALOG = catalog_names()


@cache
def _transformers_model(name: str):
    """Build the transformers text model of a catalog config on the meta device (no memory)."""
    config = catalog_entry(name).config
    torch = pytest.importorskip("torch")
    sys.modules["fla"] = None  # transformers must not bind fla's GPU kernels on a CPU machine
    transformers = pytest.importorskip("transformers")
    classes = {
        "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    }
    config_class, model_class = classes[config["model_type"]]
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "attn_output_gate", "mamba_ssm_dtype")}
    with torch.device("meta"):
        return model_class(config_class(**kwargs))


def test_qwen35_4b_text_parameters_match_the_reference_figure():
    assert catalog_geometry("qwen3.5-4b").num_parameters() == 4_205_751_296


@pytest.mark.parametrize("name", CATALOG)
def test_parameter_count_matches_transformers(name):
    model = _transformers_model(name)
    assert catalog_geometry(name).num_parameters() == sum(p.numel() for p in model.parameters())


def _replicated(param_name: str) -> bool:
    return "norm" in param_name or param_name.endswith("mlp.gate.weight") or "shared_expert_gate" in param_name


@pytest.mark.parametrize("name", ["qwen3.5-4b", "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_parameters_per_rank_follow_the_sharding(name, tp):
    """Per rank: norms, routers and shared-expert gates whole; K/V heads split or replicated; the rest split by tp."""
    geometry = catalog_geometry(name)
    model = _transformers_model(name)
    kv_heads = geometry.num_key_value_heads
    expected = 0
    for param_name, param in model.named_parameters():
        if _replicated(param_name):
            expected += param.numel()
        elif param_name.endswith(("k_proj.weight", "v_proj.weight")):
            expected += param.numel() * max(1, kv_heads // tp) // kv_heads
        else:
            assert param.numel() % tp == 0, param_name
            expected += param.numel() // tp
    assert geometry.parameters_per_rank(tp) == expected
    assert geometry.weights_bytes(tp) == 2 * expected


def test_vocab_parallel_embedding_is_padded_to_a_multiple_of_tp():
    config = copy.deepcopy(catalog_entry("qwen3.5-4b").config)
    config["vocab_size"] = 248_321  # not divisible by 2
    geometry = geometry_from_config(config)
    assert geometry.parameter_counts(2)["embedding"] == 124_161 * 2560


def test_vl_wrapper_with_text_config_gives_the_text_geometry():
    text = copy.deepcopy(catalog_entry("qwen3.5-9b").config)
    wrapper = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {k: v for k, v in text.items() if k not in ("model_type", "tie_word_embeddings")},
        "vision_config": catalog_entry("qwen3.5-9b").vision_config,
        "tie_word_embeddings": False,
    }
    geometry = geometry_from_config(wrapper, name="Qwen3.5-9B")
    assert geometry == catalog_geometry("Qwen/Qwen3.5-9B")
    assert geometry.vision is not None and geometry.num_parameters() == 8_953_803_264  # the tower is not text
    assert geometry.model_type == "qwen3_5_text"


def test_the_wrapper_decides_whether_a_vl_checkpoint_ties_its_head():
    text = dict(catalog_entry("qwen3.5-4b").config, tie_word_embeddings=False)
    wrapper = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True}
    assert geometry_from_config(wrapper).tie_word_embeddings
    assert not geometry_from_config(text).tie_word_embeddings


def test_layer_types_from_interval_and_explicit_list_agree():
    config = copy.deepcopy(catalog_entry("qwen3.5-0.8b").config)
    geometry = geometry_from_config(config)
    assert geometry.full_attention_layer_ids == (3, 7, 11, 15, 19, 23)
    assert geometry.num_linear_attention_layers == 18
    config["layer_types"] = list(geometry.layer_types)
    assert geometry_from_config(config).layer_types == geometry.layer_types


def test_catalog_geometry_values_and_dtypes():
    four = catalog_geometry("Qwen3.5-4B")
    assert (four.hidden_size, four.num_hidden_layers, four.conv_dim, four.tie_word_embeddings) == (2560, 32, 8192, True)
    assert four.default_ssm_dtype == "float32"
    nxt = catalog_geometry("qwen3-next-80b-a3b")
    assert nxt.mamba_ssm_dtype is None and nxt.default_ssm_dtype == "bfloat16"
    assert nxt.vocab_size == 151_936 and len(nxt.sparse_layer_ids) == 48
    assert set(catalog_entry("qwen3.5-2b").guessed) == {"tie_word_embeddings", "mamba_ssm_dtype"}


def test_unknown_model_names_the_known_ones():
    with pytest.raises(GeometryError, match="unknown model 'llama-3-8b'.*qwen3.5-4b"):
        catalog_geometry("llama-3-8b")


@pytest.mark.parametrize("missing", ["hidden_size", "num_key_value_heads", "linear_num_value_heads", "head_dim"])
def test_config_missing_a_key_names_it(missing):
    config = copy.deepcopy(catalog_entry("qwen3.5-4b").config)
    del config[missing]
    with pytest.raises(GeometryError, match=f"missing '{missing}'"):
        geometry_from_config(config)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("hidden_size", 0, "outside"),
        ("hidden_size", 2560.0, "must be an integer"),
        ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
        ("model_type", "llama", "not a hybrid"),
        ("model_type", ["qwen3_5_text"], "'model_type' must be a string"),
        ("layer_types", ["full_attention"] * 32, "only one kind"),
        ("layer_types", ["linear_attention"] * 31, "32"),
        ("dtype", "int4", "not a supported dtype"),
        ("tie_word_embeddings", "yes", "true or false"),
    ],
)
def test_invalid_config_values_give_one_clear_error(key, value, message):
    config = copy.deepcopy(catalog_entry("qwen3.5-4b").config)
    config[key] = value
    with pytest.raises(GeometryError, match=message) as info:
        geometry_from_config(config)
    assert isinstance(info.value, UserError)


def test_moe_config_without_experts_is_rejected():
    config = copy.deepcopy(catalog_entry("qwen3.5-35b-a3b").config)
    del config["num_experts"]
    with pytest.raises(GeometryError, match="num_experts"):
        geometry_from_config(config)


def test_a_wrapper_whose_model_type_is_not_a_string_is_named():
    text = copy.deepcopy(catalog_entry("qwen3.5-4b").config)
    del text["model_type"]
    with pytest.raises(GeometryError, match="wrapper config's 'model_type' must be a string"):
        geometry_from_config({"model_type": ["qwen3_5"], "text_config": text})


def test_config_files_are_read_bounded_and_must_be_json_objects(tmp_path):
    from hybridkv.sizing import read_config_file
    from hybridkv.sizing.geometry import MAX_CONFIG_FILE_BYTES

    good = tmp_path / "config.json"
    good.write_text(json.dumps({"model_type": "qwen3_5_text"}))
    assert read_config_file(str(good)) == {"model_type": "qwen3_5_text"}
    cases = {
        "list.json": ("[1, 2]", "must hold a JSON object, got list"),
        "broken.json": ("{", "is not valid JSON"),
        "huge.json": (" " * (MAX_CONFIG_FILE_BYTES + 1), f"larger than {MAX_CONFIG_FILE_BYTES} bytes"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(GeometryError, match=message):
            read_config_file(str(tmp_path / name))
    with pytest.raises(GeometryError, match="cannot read"):
        read_config_file(str(tmp_path / "missing.json"))


def test_the_shared_expert_runs_in_the_stack_when_as_wide_and_stored_as_the_experts():
    """The engine's rule (one place, `ModelGeometry.shared_expert_in_stack`): a shared expert as wide as a routed one
    whose three projections are stored as the experts are (16-bit with 16-bit experts, e4m3 with e4m3 experts)."""
    import copy

    config = copy.deepcopy(catalog_entry("qwen3.5-35b-a3b").config)
    assert geometry_from_config(config).shared_expert_in_stack
    assert not geometry_from_config({**config, "shared_expert_intermediate_size": 1024}).shared_expert_in_stack
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
           "modules_to_not_convert": ["lm_head", "mlp.gate", "mlp.shared_expert_gate"]}
    quantized = geometry_from_config({**config, "quantization_config": fp8})
    assert quantized.fp8_experts and quantized.shared_expert_in_stack
    kept = {**fp8, "modules_to_not_convert": fp8["modules_to_not_convert"] + ["shared_expert"]}
    mixed = geometry_from_config({**config, "quantization_config": kept})
    assert mixed.fp8_experts and not mixed.shared_expert_in_stack
    assert not catalog_geometry("qwen3.5-4b").shared_expert_in_stack
