"""make_model / `hybridkv make-model`: reproducible random checkpoints, a round-tripping tokenizer, any scale."""

from __future__ import annotations

import json
import math
import os

import pytest
from safetensors import safe_open

from hybridkv.cli import main
from hybridkv.sidecar.random_checkpoint import ModelSpecError, build_config, build_tokenizer, checkpoint_shapes, make_model
from hybridkv.sidecar.model.qwen3_5 import UnsupportedModelError
from hybridkv.sizing import catalog_geometry, geometry_from_config

TEXTS = [
    "The engine schedules decodes first, then prefills in chunks.",
    "  leading spaces, tabs\tand\nnewlines\r\n",
    "Unicode: naïve café, Ελληνικά, 日本語, emoji 🙂🚀, math ∑x² ≤ ∞",
    "<|endoftext|> is special; <|reserved_3|> is only a name",
    "",
]


def folder_bytes(folder) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_same_seed_gives_identical_files_and_another_seed_other_weights(tmp_path):
    geometry = catalog_geometry("qwen3.5-4b")
    first, again, other = (make_model(tmp_path / name, geometry, seed, tiny=True)
                           for name, seed in (("first", 5), ("again", 5), ("other", 6)))
    assert folder_bytes(first) == folder_bytes(again)
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    with safe_open(first / "model.safetensors", "pt") as a, safe_open(other / "model.safetensors", "pt") as b:
        differing = [name for name in a.keys() if not a.get_tensor(name).equal(b.get_tensor(name))]
        assert differing == list(a.keys())  # every tensor is redrawn with the seed
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_tiny_checkpoint_is_a_few_megabytes_and_describes_itself(tmp_path):
    folder = make_model(tmp_path, catalog_geometry("qwen3.5-4b"), 0, tiny=True)
    umask = os.umask(0o022)
    os.umask(umask)
    for path in folder.iterdir():  # readable by a server running as another user, as the umask allows
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["dtype"] == "bfloat16"
    weights_bytes = (folder / "model.safetensors").stat().st_size
    assert weights_bytes < 5 * 2**20
    geometry = geometry_from_config(config)
    assert weights_bytes >= geometry.num_parameters() * 2  # every parameter stored, in bf16


@pytest.mark.parametrize("catalog_name", ["qwen3.5-0.8b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b"])
def test_full_size_catalog_checkpoint_holds_the_parameter_count_of_the_sizing_model(catalog_name):
    """The tensors make_model would write (and the loader expects) add up to the planner's parameter count."""
    config = build_config(catalog_geometry(catalog_name))
    shapes = checkpoint_shapes(config)
    assert sum(math.prod(shape) for shape in shapes.values()) == catalog_geometry(catalog_name).num_parameters()
    assert ("lm_head.weight" in shapes) == (not config["tie_word_embeddings"])


@pytest.mark.parametrize("vocab_size", [512, 300, 5000])
def test_tokenizer_round_trips_text_and_covers_the_vocabulary(vocab_size):
    tokenizer = build_tokenizer(vocab_size)
    assert tokenizer.get_vocab_size() == vocab_size
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|endoftext|>").ids == [tokenizer.token_to_id("<|endoftext|>")]
    assert tokenizer.encode("hello world").ids != list("hello world".encode())  # merges shorten common words
    # Every id a model can emit decodes to text.
    assert all(isinstance(tokenizer.decode([token_id]), str) for token_id in range(vocab_size))


def test_a_reply_of_reserved_tokens_reads_back_as_the_ids_emitted():
    """A random model emits reserved ids almost only (nearly all of a full-size vocabulary): decoded and tokenized
    again, as a chat client's history is, such a reply is the same ids; byte and merged tokens among them do not
    change how the reserved ones read back."""
    import random

    tokenizer = build_tokenizer(5000)
    first_reserved = tokenizer.token_to_id("<|reserved_0|>")
    rng = random.Random(0)
    reply = [rng.randrange(first_reserved, 5000) for _ in range(200)]
    assert tokenizer.encode(tokenizer.decode(reply), add_special_tokens=False).ids == reply
    mixed = [rng.randrange(0, 5000) for _ in range(200)]
    mixed = [token for token in mixed if token != tokenizer.token_to_id("<|endoftext|>")]
    again = tokenizer.encode(tokenizer.decode(mixed, skip_special_tokens=False), add_special_tokens=False).ids
    assert [token for token in again if token >= first_reserved] == [t for t in mixed if t >= first_reserved]


def test_checkpoint_tokenizer_and_config_agree_on_eos(tmp_path):
    from tokenizers import Tokenizer

    folder = make_model(tmp_path, catalog_geometry("qwen3.5-4b"), 0, tiny=True)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    assert tokenizer.id_to_token(config["eos_token_id"]) == "<|endoftext|>"
    assert generation["eos_token_id"] == config["eos_token_id"]
    assert tokenizer.get_vocab_size() == config["vocab_size"]


def test_vocabulary_too_small_for_bytes_is_refused():
    with pytest.raises(ModelSpecError, match="at least 259"):
        build_tokenizer(100)


@pytest.mark.parametrize("catalog_name,architecture", [("qwen3.5-35b-a3b", "Qwen3_5MoeForCausalLM"),
                                                       ("qwen3-next-80b-a3b", "Qwen3NextForCausalLM")])
def test_moe_catalog_models_are_written_tiny_with_their_architecture(tmp_path, catalog_name, architecture):
    make_model(tmp_path, catalog_geometry(catalog_name), 0, tiny=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (8, 2, 32)
    assert (tmp_path / "model.safetensors").stat().st_size < 8 * 1024**2


def test_architectures_the_engine_does_not_run_are_refused_before_writing(tmp_path):
    with pytest.raises(UnsupportedModelError, match="not supported by the engine yet"):
        make_model(tmp_path, catalog_geometry("qwen3.5-4b"), 0, tiny=True, overrides={"hidden_act": "gelu"})
    assert not any(tmp_path.iterdir())


def test_cli_writes_a_checkpoint_from_a_catalog_name_with_overrides(tmp_path, capsys):
    out = tmp_path / "model"
    code = main(["make-model", "--catalog", "Qwen/Qwen3.5-4B", "--tiny", "--out", str(out), "--seed", "3",
                 "--dtype", "float32", "--set", "num_hidden_layers=8", "--set", "tie_word_embeddings=false"])
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 8
    assert config["layer_types"].count("full_attention") == 2
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32"
    assert "8 layers" in capsys.readouterr().out


def test_cli_writes_a_checkpoint_from_a_config_file(tmp_path):
    config_file = tmp_path / "config.json"
    text_config = build_config(catalog_geometry("qwen3.5-4b"), tiny=True)
    del text_config["tie_word_embeddings"]  # a vision-language config keeps it at the top level
    config_file.write_text(json.dumps({"text_config": text_config, "model_type": "qwen3_5",
                                       "tie_word_embeddings": False}))
    out = tmp_path / "model"
    assert main(["make-model", "--config", str(config_file), "--out", str(out)]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["hidden_size"] == 64 and written["tie_word_embeddings"] is False


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--catalog", "qwen9"], "unknown model 'qwen9'"),
        (["--catalog", "qwen3.5-4b", "--tiny", "--set", "num_attention_heads=0"], "num_attention_heads"),
        (["--catalog", "qwen3.5-4b", "--tiny", "--set", "vocab_size=100"], "at least 259"),
        (["--config", "/nonexistent/config.json"], "cannot read /nonexistent/config.json"),
    ],
)
def test_cli_rejects_bad_input_with_one_line(tmp_path, capsys, arguments, message):
    out = tmp_path / "model"
    assert main(["make-model", *arguments, "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
    assert not out.exists()


def test_rewriting_a_folder_is_allowed_but_stale_weight_files_are_refused(tmp_path):
    geometry = catalog_geometry("qwen3.5-4b")
    make_model(tmp_path, geometry, 1, tiny=True, max_shard_bytes=200_000)
    make_model(tmp_path, geometry, 1, tiny=True, max_shard_bytes=200_000)  # the same files again
    before = folder_bytes(tmp_path)
    with pytest.raises(ModelSpecError, match="model-00001-of-"):
        make_model(tmp_path, geometry, 1, tiny=True)  # one file now: the shards would be left behind
    assert folder_bytes(tmp_path) == before
