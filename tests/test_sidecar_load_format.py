"""`--load-format random`: a folder with only config.json and the tokenizer serves the weights make-model would write
for the same seed, on one rank and on two (each rank builds its own shard)."""

from __future__ import annotations

import json

import pytest
from engine_fixtures import CHECKPOINT_SEED, make_engine, tiny_checkpoint  # noqa: F401 - pytest fixture

from hybridkv.cli import build_parser, main
from hybridkv.errors import UserError
from hybridkv.sidecar.core.sampling import SamplingParams
from hybridkv.sidecar.serving.cli import build_configs

PROMPTS = ([5, 17, 300, 42, 9], [100 + i for i in range(40)], [7] * 3)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def config_only_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("config-only")
    assert main(["make-model", "--catalog", "qwen3.5-4b", "--tiny", "--dtype", "float32", "--config-only",
                 "--seed", str(CHECKPOINT_SEED), "--out", str(folder)]) == 0
    assert not list(folder.glob("*.safetensors"))
    return str(folder)


def greedy_tokens(engine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{index}", list(prompt), params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return [tokens[f"r{index}"] for index in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def checkpoint_tokens(tiny_checkpoint):  # noqa: F811
    engine = make_engine(tiny_checkpoint)
    try:
        return greedy_tokens(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_random_weights_serve_the_tokens_of_the_checkpoint_written_with_the_same_seed(config_only_folder, tp,
                                                                                       checkpoint_tokens):
    args = build_parser().parse_args(["serve", "--model", config_only_folder, "--load-format", "dummy", "--seed",
                                      str(CHECKPOINT_SEED), "--device", "cpu", "--http-port", "0"])
    engine_config = build_configs(args)[0]
    assert engine_config.load_format == "random"
    engine = make_engine(config_only_folder, load_format="random", seed=engine_config.seed, tensor_parallel_size=tp)
    try:
        assert greedy_tokens(engine) == checkpoint_tokens
    finally:
        engine.close()


def test_a_config_only_folder_without_random_weights_names_the_missing_weights(config_only_folder):
    with pytest.raises(UserError, match="no \\*.safetensors files"):
        make_engine(config_only_folder)


# Qwen3-Next in FP8 needs GDN head dims of 128 (whole scale blocks per key head), its published size.
@pytest.mark.parametrize("catalog, quantize, overrides", [
    ("qwen3.5-4b", "fp8", None), ("qwen3.5-4b", "awq", None), ("qwen3.5-4b", "w4a16", None),
    ("qwen3.5-35b-a3b", "fp8", None),
    ("qwen3-next-80b-a3b", "fp8", {"linear_key_head_dim": 128, "linear_value_head_dim": 128}),
])
def test_random_weights_of_a_quantized_config_are_the_quantized_checkpoint_of_the_same_seed(tmp_path, catalog,
                                                                                           quantize, overrides):
    """The stored tensors are quantized from the same dense draws make-model quantizes, so on the CPU the random
    model holds the checkpoint's exact bytes: the same greedy tokens, and the same weight bytes as its files."""
    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sizing import catalog_geometry
    from hybridkv.sizing.quantization import text_model_tensor_bytes

    written = make_model(tmp_path / "files", catalog_geometry(catalog), CHECKPOINT_SEED, tiny=True,
                         dtype="float32", quantize=quantize, overrides=overrides)
    config_only = make_model(tmp_path / "config", catalog_geometry(catalog), CHECKPOINT_SEED, tiny=True,
                             dtype="float32", quantize=quantize, overrides=overrides, weights=False)
    assert not list(config_only.glob("*.safetensors"))
    runs = []
    for folder, load_format in ((written, "auto"), (config_only, "random")):
        engine = make_engine(str(folder), load_format=load_format, seed=CHECKPOINT_SEED,
                             kv_cache_memory_bytes=64 * 2**20)
        try:
            predicted = engine.capacity().to_dict()["predicted"]["weights_bytes"]
            runs.append((greedy_tokens(engine), engine.runner.weights_bytes, predicted))
        finally:
            engine.close()
    assert runs[0] == runs[1]
    tied = json.loads((written / "config.json").read_text()).get("tie_word_embeddings", False)
    # The planner counts a random model's weights from the geometry alone: the checkpoint's bytes, exactly.
    assert runs[1][1] == runs[1][2] == text_model_tensor_bytes(written, tie_word_embeddings=tied)


def test_an_unknown_load_format_is_refused(config_only_folder):
    with pytest.raises(UserError, match="load_format must be one of"):
        make_engine(config_only_folder, load_format="pickle")
