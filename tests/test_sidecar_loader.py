"""Loading safetensors folders: both Qwen3.5 layouts, sharded files, and a clear error for every mismatch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from sidecar_model_harness import PagedHarness, load_model

from hybridkv.sidecar.random_checkpoint import make_model
from hybridkv.sidecar.model.loader import CheckpointError
from hybridkv.sizing import catalog_geometry

CHECKPOINT_SEED = 11


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_model(folder, catalog_geometry("qwen3.5-4b"), CHECKPOINT_SEED, tiny=True, dtype="float32",
               overrides={"tie_word_embeddings": False})
    return folder


@pytest.fixture(scope="module")
def reference_logits(checkpoint):
    return prompt_logits(checkpoint)


def prompt_logits(folder) -> torch.Tensor:
    return PagedHarness(load_model(folder)).step([("s", list(range(40, 80)))])


def rewrite(source, target, edit) -> None:
    """Copy a single-file checkpoint folder, passing its tensors and config through `edit(tensors, config)`."""
    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, target / "model.safetensors")
    (target / "config.json").write_text(json.dumps(config))


def test_missing_tensor_is_named(checkpoint, tmp_path):
    name = "model.layers.2.linear_attn.in_proj_z.weight"
    rewrite(checkpoint, tmp_path / "ckpt", lambda tensors, config: tensors.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing tensors: {name}"):
        load_model(tmp_path / "ckpt")


def test_extra_tensor_is_named(checkpoint, tmp_path):
    name = "model.layers.0.mlp.shared_expert.weight"
    rewrite(checkpoint, tmp_path / "ckpt", lambda tensors, config: tensors.update({name: torch.zeros(4, 4)}))
    with pytest.raises(CheckpointError, match=rf"unexpected tensors: {name}"):
        load_model(tmp_path / "ckpt")


def test_misshaped_tensor_is_named_with_both_shapes(checkpoint, tmp_path):
    name = "model.layers.3.self_attn.k_proj.weight"

    def shrink(tensors, config):
        tensors[name] = tensors[name][:-1].clone()

    rewrite(checkpoint, tmp_path / "ckpt", shrink)
    with pytest.raises(CheckpointError, match=rf"{name} has shape \[63, 64\], expected \[64, 64\]"):
        load_model(tmp_path / "ckpt")


def test_config_that_disagrees_with_the_weights_is_reported(checkpoint, tmp_path):
    rewrite(checkpoint, tmp_path / "ckpt", lambda tensors, config: config.update(intermediate_size=96))
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight has shape \[128, 64\], expected \[96, 64\]"):
        load_model(tmp_path / "ckpt")


def test_folder_without_weights_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    from hybridkv.sidecar.model.loader import checkpoint_files

    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        checkpoint_files(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_files(tmp_path / "absent")


def test_vision_language_layout_loads_the_same_weights(checkpoint, reference_logits, tmp_path):
    """model.language_model.* holds the text model; the vision tower and MTP weights are skipped."""

    def to_vision_language(tensors, config):
        for name in list(tensors):
            if name.startswith("model."):
                tensors["model.language_model." + name[len("model."):]] = tensors.pop(name)
        tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(12, 4)
        tensors["mtp.fc.weight"] = torch.ones(4, 8)
        text_config = dict(config)
        config.clear()
        config.update(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"],
                      text_config=text_config, vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32})

    rewrite(checkpoint, tmp_path / "vl", to_vision_language)
    assert torch.equal(prompt_logits(tmp_path / "vl"), reference_logits)


def test_sharded_checkpoint_with_index_loads_the_same_weights(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    for folder, max_shard_bytes in ((single, 1 << 30), (sharded, 200_000)):
        make_model(folder, catalog_geometry("qwen3.5-4b"), CHECKPOINT_SEED, tiny=True, dtype="float32",
                   max_shard_bytes=max_shard_bytes)
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    assert torch.equal(prompt_logits(sharded), prompt_logits(single))


def test_index_naming_a_missing_file_is_an_error(tmp_path):
    make_model(tmp_path, catalog_geometry("qwen3.5-4b"), CHECKPOINT_SEED, tiny=True, max_shard_bytes=200_000)
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="names files that do not exist"):
        load_model(tmp_path)


def test_index_naming_a_file_outside_the_folder_is_an_error(tmp_path):
    make_model(tmp_path, catalog_geometry("qwen3.5-4b"), CHECKPOINT_SEED, tiny=True, max_shard_bytes=200_000)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="names files outside the folder: ../elsewhere.safetensors"):
        load_model(tmp_path)


def test_bfloat16_checkpoint_loads_into_a_float32_model_exactly(tmp_path, checkpoint):
    """Weights are converted on load; bf16 values are exact in fp32."""

    def to_bfloat16(tensors, config):
        for name in tensors:
            tensors[name] = tensors[name].to(torch.bfloat16)

    rewrite(checkpoint, tmp_path / "bf16", to_bfloat16)
    model = load_model(tmp_path / "bf16")
    stored = load_file(tmp_path / "bf16" / "model.safetensors")
    assert torch.equal(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"].float())
    assert torch.equal(model.model.layers[0].linear_attn.A_log, stored["model.layers.0.linear_attn.A_log"].float())


@pytest.mark.parametrize(("num_units", "unit_size", "tp_size"), [(510, 1, 4), (8, 3, 2), (2, 5, 4)])
def test_rank_shards_reassemble_the_checkpoint_tensor(num_units, unit_size, tp_size, torch_generator):
    """Rows split across ranks (a vocabulary that does not divide, heads, heads fewer than ranks) read back whole."""
    from hybridkv.sidecar.model.layers import ShardPart, sharded_parameter

    part = ShardPart(num_units, unit_size)
    full = torch.randn(num_units * unit_size, 6, generator=torch_generator)
    shards = []
    for rank in range(tp_size):
        param = sharded_parameter((part.rank_size(rank, tp_size), 6), torch.float32, "cpu", 0, [part], rank, tp_size)
        param.shard_layout.load(param, full, 0, 1)
        shards.append(param.detach())
    if num_units >= tp_size:
        whole = torch.cat(shards)
        assert torch.equal(whole[: full.shape[0]], full)
        assert not whole[full.shape[0]:].any()  # padding rows past the end are zero
    else:  # each rank holds one unit, shared by tp_size // num_units ranks in order
        group = tp_size // num_units
        for rank, shard in enumerate(shards):
            unit = rank // group
            assert torch.equal(shard, full[unit * unit_size : (unit + 1) * unit_size])
