"""Fixtures shared by the engine tests: one tiny random checkpoint per session and the Hugging Face oracle on it.

Test modules import the fixtures they use (`from engine_fixtures import tiny_checkpoint, ...`); pytest then treats
them as the module's own.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

CHECKPOINT_SEED = 1234
# The tiny geometry (3 GDN layers + 1 attention layer, hidden 64, vocab 512), stored in float32 for exact comparison.
TINY_MAKE_MODEL = {"tiny": True, "dtype": "float32"}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sizing import catalog_geometry

    folder = tmp_path_factory.mktemp("tiny-qwen3.5")
    make_model(folder, catalog_geometry("qwen3.5-4b"), seed=CHECKPOINT_SEED, **TINY_MAKE_MODEL)
    return str(folder)


def load_hf_model(folder: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' own Qwen3.5 on the same folder, with fla hidden so its plain-torch GDN path runs."""
    from sidecar_model_harness import transformers_without_fla

    with transformers_without_fla() as hf_class:
        return hf_class.from_pretrained(folder, dtype=dtype).to(device).eval()


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint):
    return load_hf_model(tiny_checkpoint)


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (stopping at the checkpoint's eos, which is kept) and the float32 logits before each of them."""
    device = next(model.parameters()).device
    out = model.generate(
        torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, torch.cat(out.logits).float().cpu()


def pool_budget(folder: str, state_slots: int, token_blocks: int, block_size: int) -> int:
    """The cache budget that holds exactly `token_blocks` usable blocks and `state_slots` slots (plus the null
    block and slot), derived here from config.json for fp32 pools."""
    config = json.load(open(os.path.join(folder, "config.json")))
    layer_types = config["layer_types"]
    num_attention = layer_types.count("full_attention")
    num_gdn = layer_types.count("linear_attention")
    bytes_per_token = num_attention * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    conv_dim = (2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
                + config["linear_num_value_heads"] * config["linear_value_head_dim"])
    conv_bytes = (config["linear_conv_kernel_dim"] - 1) * conv_dim * 4
    ssm_bytes = config["linear_num_value_heads"] * config["linear_value_head_dim"] * config["linear_key_head_dim"] * 4
    bytes_per_request = num_gdn * (conv_bytes + ssm_bytes)
    return (state_slots + 1) * bytes_per_request + (token_blocks + 1) * block_size * bytes_per_token


def make_engine(folder: str, **overrides):
    from hybridkv.sidecar.core.config import EngineConfig
    from hybridkv.sidecar.core.engine import Engine

    settings_ = dict(model=folder, device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=256,
                     kv_cache_memory_bytes=8 * 1024**2, enforce_eager=True)
    settings_.update(overrides)
    return Engine(EngineConfig(**settings_))
