"""Random weights built directly in device memory, for benchmarks of full-size models.

Writing a 35B-parameter checkpoint means 70 GB to disk and back; these fill a model's parameters in place instead.
Each checkpoint tensor is drawn from its own generator, seeded by the seed and the tensor's name, with the
initialisation `random_checkpoint` uses, so any model that names its tensors like the checkpoint (the engine's, through
its loader entries, or transformers' own) gets the same values, in whatever order it fills them. `make_model` draws
its files the same way on the CPU, so a checkpoint it writes holds exactly what `--load-format random` builds on the
CPU with the same seed; a CUDA generator draws other values from the same seed (a GPU run is reproducible, not equal to
the files). A quantized config (FP8, AWQ, W4A16) gets its projections the way `make_model --quantize` writes them:
each dense draw quantized to the stored tensors on the device, so a 27B FP8 model needs no 27 GB checkpoint either.
"""

from __future__ import annotations

import hashlib

import torch

from hybridkv.sidecar.random_checkpoint import _random_tensor


def random_weight(name: str, shape: tuple[int, ...], config: dict, seed: int, device: torch.device) -> torch.Tensor:
    """The float32 values of checkpoint tensor `name`, on `device`."""
    # A hash of both: the CPU generator keeps only the low 32 bits of its seed, so they must depend on the seed too.
    key = int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little")
    generator = torch.Generator(device).manual_seed(key)
    with torch.device(device):
        return _random_tensor(name, shape, config, generator)


@torch.no_grad()
def fill_engine_model(model, config: dict, seed: int) -> None:
    """Fill this rank's parameters of an engine model with the weights `make_model` writes for `config` (stacked or
    per-expert tensors as that model type's checkpoints store them): each rank draws every full tensor and keeps its
    own rows or columns, so the ranks together hold one model."""
    from hybridkv.sidecar.model.loader import checkpoint_entries
    from hybridkv.sidecar.random_checkpoint import written_names

    config = {**config, **config.get("text_config", {})}  # a vision-language wrapper's text model
    entries = checkpoint_entries(model)
    quantization = model.geometry.quantization
    if quantization is None:
        for name in written_names(entries, model.geometry.model_type):
            _load(entries[name], random_weight(name, entries[name].checkpoint_shape, config, seed,
                                               entries[name].param.device))
        return
    from hybridkv.sidecar.random_checkpoint import DTYPES, checkpoint_shapes, stored_tensors
    from hybridkv.sizing.quantization import linear_layers

    linear_names = frozenset(name for name, _, _ in linear_layers(model.geometry))
    device = next(model.parameters()).device
    dense_config = {key: value for key, value in config.items() if key != "quantization_config"}
    for name, shape in checkpoint_shapes(dense_config, model.geometry.fp8_experts).items():
        dense = random_weight(name, shape, config, seed, device)
        for stored_name, tensor in stored_tensors(name, dense, quantization, linear_names,
                                                  DTYPES[config["dtype"]]).items():
            _load(entries[stored_name], tensor)


def _load(entry, full: torch.Tensor) -> None:
    entry.layout.load(entry.param, full.to(entry.param.dtype), entry.first_part, entry.num_parts)


@torch.no_grad()
def fill_transformers_model(model, config: dict, seed: int) -> None:
    """The same weights in a transformers model (its parameter names are the checkpoint's)."""
    for name, param in model.named_parameters():
        param.copy_(random_weight(name, tuple(param.shape), config, seed, param.device))
