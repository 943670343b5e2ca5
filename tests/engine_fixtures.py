"""Fixtures shared by the engine tests: one tiny random checkpoint per session and the Hugging Face oracle on it.

Test modules import the fixtures they use (`from engine_fixtures import tiny_checkpoint, ...`); pytest then treats
them as the module's own.
"""

from __future__ import annotations

import sys

import pytest
import torch

CHECKPOINT_SEED = 1234
# The tiny geometry (3 GDN layers + 1 attention layer, hidden 64, vocab 512), stored in float32 for exact comparison.
TINY_MAKE_MODEL = {"tiny": True, "dtype": "float32"}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    from hybridkv.sidecar.checkpoint import make_model
    from hybridkv.sizing import catalog_geometry

    folder = tmp_path_factory.mktemp("tiny-qwen3.5")
    make_model(folder, catalog_geometry("qwen3.5-4b"), seed=CHECKPOINT_SEED, **TINY_MAKE_MODEL)
    return str(folder)


def load_hf_model(folder: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' own Qwen3.5 on the same folder, with fla hidden so its plain-torch GDN path runs."""
    if "transformers" not in sys.modules:
        sys.modules["fla"] = None  # its Triton kernels would be bound without a device check
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


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
