"""Random weights built directly in device memory, for benchmarks of full-size models.

Writing a 35B-parameter checkpoint means 70 GB to disk and back; these fill a model's parameters in place instead.
Each checkpoint tensor is drawn from its own generator, seeded by the seed and the tensor's name, with the
initialisation `random_checkpoint` uses, so any model that names its tensors like the checkpoint (the engine's, through
its loader entries, or transformers' own) gets the same values, in whatever order and on whichever device it fills them.
The values differ from those `make_model` writes to disk, which draws all tensors from one sequence.
"""

from __future__ import annotations

import zlib

import torch

from hybridkv.sidecar.random_checkpoint import _random_tensor


def random_weight(name: str, shape: tuple[int, ...], config: dict, seed: int, device: torch.device) -> torch.Tensor:
    """The float32 values of checkpoint tensor `name`, on `device`."""
    generator = torch.Generator(device).manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    with torch.device(device):
        return _random_tensor(name, shape, config, generator)


@torch.no_grad()
def fill_engine_model(model, config: dict, seed: int) -> None:
    """Fill this rank's parameters of an engine model with the weights a stacked-expert checkpoint would hold."""
    from hybridkv.sidecar.model.loader import checkpoint_entries

    for name, entry in checkpoint_entries(model).items():
        if entry.alternative_to is None:
            device = entry.param.device
            full = random_weight(name, entry.checkpoint_shape, config, seed, device).to(entry.param.dtype)
            entry.layout.load(entry.param, full, entry.first_part, entry.num_parts)


@torch.no_grad()
def fill_transformers_model(model, config: dict, seed: int) -> None:
    """The same weights in a transformers model (its parameter names are the checkpoint's)."""
    for name, param in model.named_parameters():
        param.copy_(random_weight(name, tuple(param.shape), config, seed, param.device))
