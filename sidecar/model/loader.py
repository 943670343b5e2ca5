"""Load a folder of safetensors with Hugging Face names into one tensor-parallel rank of the model.

Both layouts Qwen3.5/3.6 ship are accepted: `Qwen3_5ForCausalLM` (`model.layers.*`) and the vision-language
checkpoint (`model.language_model.layers.*`, with the vision tower `model.visual.*` skipped). Multi-token-prediction
weights (`mtp.*`) are skipped too, and a log line counts what was skipped; with tied embeddings a stored
`lm_head.weight` is skipped (the head is the embedding). Stacked experts are read from the 3-D tensors Qwen3.5-MoE
stores (`mlp.experts.gate_up_proj`) or from one tensor per expert (`mlp.experts.N.gate_proj.weight`, as Qwen3-Next
and transformers' `save_pretrained` store them), whichever the checkpoint holds. Static fp8 KV-cache scales (`self_attn.k_scale`, `self_attn.k_proj.k_scale`,
`self_attn.kv_scale` and their V counterparts, `KV_SCALE_NAMES`) go to their attention layer. Every name and shape is checked against the model before any weight is read; each rank then reads only
its own rows or columns through safetensors slices, never the whole tensor.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hybridkv.errors import UserError
from hybridkv.sidecar.model.layers import ShardLayout
from hybridkv.sidecar.model.qwen3_5 import PACKED_CHECKPOINT_NAMES, Qwen3_5ForCausalLM
from hybridkv.sizing.quantization import KV_SCALE_NAMES

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SKIPPED_PREFIXES = ("model.visual.", "mtp.")
SKIPPED_WHAT = {"model.visual.": "vision-tower", "mtp.": "multi-token-prediction"}
LANGUAGE_MODEL_PREFIX = "model.language_model."
# How many offending names an error message lists before summarising the rest.
MAX_NAMES_IN_ERROR = 8
# A 1T-parameter model's index is a few MB; anything far larger is not an index.
MAX_INDEX_BYTES = 64 * 1024 * 1024
# `model.layers.<i>.self_attn.<name>` of a static fp8 KV-cache scale (names in `KV_SCALE_NAMES`).
_KV_SCALE_PATTERN = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(" + "|".join(map(re.escape, KV_SCALE_NAMES))
                               + r")$")
_KV_SCALE_DTYPES = ("F32", "BF16", "F16")


class CheckpointError(UserError):
    """A checkpoint folder that does not hold the weights the configured model needs."""


@dataclass(frozen=True)
class CheckpointEntry:
    """Where one checkpoint tensor goes: a model parameter and the shard parts of it the tensor fills."""

    param: torch.Tensor
    layout: ShardLayout
    first_part: int
    num_parts: int
    # One expert's tensor that may stand in, with its siblings, for the stacked tensor of this name.
    alternative_to: str | None = None

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        return self.layout.checkpoint_shape(self.param.shape, self.first_part, self.num_parts)


def checkpoint_entries(model: Qwen3_5ForCausalLM) -> dict[str, CheckpointEntry]:
    """The `Qwen3_5ForCausalLM` checkpoint names this model needs, each mapped to where it is loaded; stacked experts
    appear twice, under their stacked name and as per-expert entries whose `alternative_to` names the stack."""
    entries = {}
    for name, param in model.named_parameters():
        module_path, _, param_name = name.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        layout = param.shard_layout
        if hasattr(param, "expert_parts"):  # stacked experts, also readable as one tensor per expert
            suffix = param.expert_suffix
            # FP8 experts' scale grids exist only per expert: required, not an alternative to a stacked tensor.
            stacked = name if suffix == "weight" else None
            routed = param.shape[0] if param.shared_slot is None else param.shared_slot
            for index in range(param.shape[0]):
                # The shared expert in the stack's last slot is stored on its own, never in the experts' 3-D tensor.
                expert = f"{parent}.shared_expert" if index == param.shared_slot else f"{module_path}.{index}"
                for projection, first_part, num_parts in param.expert_parts:
                    entries[f"{expert}.{projection}.{suffix}"] = CheckpointEntry(
                        param[index], param.expert_layout, first_part, num_parts,
                        alternative_to=None if index == param.shared_slot else stacked)
            if stacked is None:
                continue
            if routed != param.shape[0]:  # the 3-D tensor fills the routed experts' slots
                entries[name] = CheckpointEntry(param[:routed], layout, 0, len(layout.parts))
                continue
        if hasattr(param, "checkpoint_sources"):
            for checkpoint_module, source_layout, first_part, num_parts in param.checkpoint_sources:
                entries[f"{parent}.{checkpoint_module}.{param_name}"] = CheckpointEntry(param, source_layout,
                                                                                       first_part, num_parts)
        elif module_name in PACKED_CHECKPOINT_NAMES:
            first_part = 0
            for checkpoint_module, num_parts in PACKED_CHECKPOINT_NAMES[module_name]:
                entries[f"{parent}.{checkpoint_module}.{param_name}"] = CheckpointEntry(param, layout, first_part,
                                                                                       num_parts)
                first_part += num_parts
        elif parent.rpartition(".")[2] in PACKED_CHECKPOINT_NAMES:
            # A quantized merged projection holds one child per checkpoint projection, named like it (rows stored
            # grouped by key head, as Qwen3-Next's, read through the grouped layout).
            entries[f"{parent.rpartition('.')[0]}.{module_name}.{param_name}"] = CheckpointEntry(
                param, getattr(param, "grouped_layout", layout), 0, len(layout.parts))
        else:
            entries[name] = CheckpointEntry(param, layout, 0, len(layout.parts))
    return entries


def _open(path: Path):
    """safe_open, with a truncated or corrupt file a CheckpointError naming it rather than a SafetensorError."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc}); rebuild or download the "
                              "checkpoint again") from None


def text_model_name(checkpoint_name: str, tied_embeddings: bool) -> str | None:
    """The `Qwen3_5ForCausalLM` name of a stored tensor, or None for tensors the text model does not use."""
    if checkpoint_name.startswith(SKIPPED_PREFIXES):
        return None
    if tied_embeddings and checkpoint_name == "lm_head.weight":
        return None
    if checkpoint_name.startswith(LANGUAGE_MODEL_PREFIX):
        return "model." + checkpoint_name[len(LANGUAGE_MODEL_PREFIX) :]
    return checkpoint_name


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: those its index names, else every *.safetensors file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist; pass a folder holding *.safetensors")
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        if index_path.stat().st_size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{index_path} is larger than {MAX_INDEX_BYTES} bytes; it is not a safetensors index")
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index_path} is not a safetensors index ({exc}); fix or remove it") from exc
        outside = [name for name in names if not isinstance(name, str) or Path(name).name != name or name == ".."]
        if outside:
            raise CheckpointError(f"{index_path} names files outside the folder: {_listing([str(n) for n in outside])}")
        files = [folder / name for name in names]
        missing = [str(path) for path in files if not path.is_file()]
        if missing:
            raise CheckpointError(f"{index_path} names files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder}")
    return files


def _listing(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:MAX_NAMES_IN_ERROR])
    more = len(names) - MAX_NAMES_IN_ERROR
    return shown + (f" and {more} more" if more > 0 else "")


def _missing(entries: dict[str, CheckpointEntry], located: dict) -> list[str]:
    """Needed names the checkpoint lacks; a stacked expert tensor is present when it, or all of its per-expert
    tensors, are stored (when only some are, the others are what is missing)."""
    per_expert: dict[str, list[str]] = {}
    for name, entry in entries.items():
        if entry.alternative_to:
            per_expert.setdefault(entry.alternative_to, []).append(name)
    missing = []
    for name, entry in entries.items():
        if entry.alternative_to or name in located:
            continue
        experts = per_expert.get(name, [])
        if any(expert in located for expert in experts):
            missing += [expert for expert in experts if expert not in located]
        else:
            missing.append(name)
    return missing


def _kv_scale_value(handle, stored_name: str) -> float:
    """One static KV-cache scale: a single positive finite float, else CheckpointError naming the tensor."""
    view = handle.get_slice(stored_name)
    shape, dtype = list(view.get_shape()), view.get_dtype()
    if math.prod(shape) != 1 or dtype not in _KV_SCALE_DTYPES:
        raise CheckpointError(f"{stored_name} is a KV-cache scale but holds {dtype} of shape {shape}; hybridkv reads "
                              "one per-tensor scale (a float32, bfloat16 or float16 scalar) for K and one for V")
    value = handle.get_tensor(stored_name).float().item()
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"{stored_name} is a KV-cache scale but holds {value}; it must be a positive finite "
                              "number")
    return value


def _locate(files: list[Path], entries: dict[str, CheckpointEntry], tied_embeddings: bool,
            attention_layer_ids: frozenset[int]) -> tuple[dict[str, tuple[Path, str]], dict[tuple[int, str], float]]:
    """Map every needed tensor to (file, stored name), after checking names and shapes of the whole checkpoint; and
    read the static KV-cache scales present, {(layer, "k" or "v"): scale}."""
    located: dict[str, tuple[Path, str]] = {}
    kv_scales: dict[tuple[int, str], float] = {}
    extra, misshaped, duplicated = [], [], []
    skipped = dict.fromkeys(SKIPPED_PREFIXES, 0)
    for path in files:
        with _open(path) as handle:
            for stored_name in handle.keys():
                name = text_model_name(stored_name, tied_embeddings)
                if name is None:
                    for prefix in SKIPPED_PREFIXES:
                        skipped[prefix] += stored_name.startswith(prefix)
                    continue
                entry = entries.get(name)
                scale = _KV_SCALE_PATTERN.match(name) if entry is None else None
                if scale is not None and int(scale.group(1)) in attention_layer_ids:
                    for which in KV_SCALE_NAMES[scale.group(2)]:
                        key = (int(scale.group(1)), which)
                        if key in kv_scales:
                            duplicated.append(stored_name)
                        kv_scales[key] = _kv_scale_value(handle, stored_name)
                    continue
                if entry is None:
                    extra.append(stored_name)
                    continue
                if name in located:
                    duplicated.append(stored_name)
                    continue
                shape = tuple(handle.get_slice(stored_name).get_shape())
                if shape != entry.checkpoint_shape:
                    misshaped.append(f"{stored_name} has shape {list(shape)}, expected {list(entry.checkpoint_shape)}")
                located[name] = (path, stored_name)
    for prefix, count in skipped.items():
        if count:
            log.info("skipping %d %s tensors (%s*) of %s: the engine serves the text model", count,
                     SKIPPED_WHAT[prefix], prefix, files[0].parent)
    missing = _missing(entries, located)
    duplicated += [name for name in located
                   if entries[name].alternative_to in located]  # an expert stored both stacked and on its own
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {_listing(extra)}")
    if duplicated:
        problems.append(f"tensors stored more than once: {_listing(duplicated)}")
    if misshaped:
        problems.append("; ".join(misshaped[:MAX_NAMES_IN_ERROR]))
    if problems:
        raise CheckpointError(
            f"checkpoint in {files[0].parent} does not match the model's config.json: {'; '.join(problems)}"
        )
    return located, kv_scales


@torch.no_grad()
def load_checkpoint(model: Qwen3_5ForCausalLM, folder: str | Path) -> None:
    """Fill this rank's parameters from the checkpoint folder; raises CheckpointError naming any bad tensor."""
    files = checkpoint_files(folder)
    entries = checkpoint_entries(model)
    attention = {index: layer.self_attn for index, layer in enumerate(model.model.layers)
                 if layer.layer_type != "linear_attention"}
    located, kv_scales = _locate(files, entries, model.geometry.tie_word_embeddings, frozenset(attention))
    for (index, which), value in kv_scales.items():
        setattr(attention[index], f"{which}_scale", value)
    by_file: dict[Path, list[str]] = {}
    for name, (path, _) in located.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with _open(path) as handle:
            for name in names:
                entry = entries[name]
                entry.layout.load(entry.param, handle.get_slice(located[name][1]), entry.first_part, entry.num_parts)
