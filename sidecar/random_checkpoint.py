"""Random-weight checkpoints with a locally built tokenizer, for tests, the demo and benchmarks.

`make_model` writes what a Hugging Face `Qwen3_5ForCausalLM` (or `Qwen3_5MoeForCausalLM`, `Qwen3NextForCausalLM`)
folder holds: config.json, safetensors weights (one file, or shards plus `model.safetensors.index.json` past
`max_shard_bytes`), tokenizer.json with its tokenizer_config.json, chat_template.jinja and generation_config.json.
The same seed and settings give byte-identical files. Any catalog geometry can be written, or scaled down
(`tiny=True`, or key overrides) to a few megabytes.

Initialisation is chosen so greedy decoding is decisive and depends on the context, rather than a coin toss between
near-tied logits or an echo of the last token:
- the head is scaled so logits have a standard deviation of about `LOGIT_STD` (8): the typical gap between the two
  largest logits is then ~2, about 1e5 times float32 rounding, so greedy tokens are stable across implementations;
- linear weights are N(0, 1/fan_in), and the projections that write into the residual stream (o_proj, out_proj,
  down_proj) are `RESIDUAL_BRANCH_GAIN` times louder, so the layers, not the (possibly tied) embedding, decide;
- GDN decay follows Mamba's time-step range (dt in [1e-3, 1e-1], A in [1, 16]), so the recurrent state remembers
  tens to hundreds of tokens and earlier context changes later tokens;
- norm weights get small random offsets (std 0.1) so every norm's weight is exercised.
A deep random stack is far more sensitive to rounding than a trained one: in bf16, transformers' own logits of a
32-layer random model pick a different argmax from its fp32 logits at about half the positions. Compare
implementations in float32; use bf16 checkpoints for throughput and memory.

The tokenizer is byte-level BPE: 256 byte tokens, the special tokens, merges learned deterministically from a small
corpus kept in this module, then reserved tokens up to the config's vocab_size, so every id the model can emit decodes.
Any text round-trips, and so does any reply: the reserved tokens (nearly all of a full-size vocabulary, so nearly all
of a random model's output) are added tokens that encoding finds whole, so a reply decoded to text and tokenized
again, as a chat client's history is, comes back as the ids the model emitted, about as a trained model's replies do.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridkv.errors import UserError
from hybridkv.sizing import ModelGeometry, geometry_from_config

ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM"}
MODEL_TYPE = "qwen3_5_text"
# Experts are written as the published checkpoints store them: Qwen3.5-MoE as stacked 3-D tensors, Qwen3-Next as
# one tensor per expert and projection.
PER_EXPERT_MODEL_TYPES = ("qwen3_next",)
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
NUM_BYTE_TOKENS = 256
# A chat template in the Qwen3 chat format (turns between <|im_start|> and <|im_end|>, tools as JSON schemas, calls in
# <tool_call> tags, results in <tool_response> tags, reasoning in <think>, opened by the generation prompt unless
# enable_thinking is false), so chat requests, tool calls and reasoning can be served from a random checkpoint.
CHAT_TEMPLATE = """\
{%- set system = messages[0].content if messages and messages[0].role in ('system', 'developer') else none -%}
{%- if tools or system is not none -%}
<|im_start|>system
{% if system is not none %}{{ system }}
{% endif %}
{%- if tools %}Tools you may call, one JSON schema per line:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, answer <tool_call>{"name": NAME, "arguments": {...}}</tool_call> (one block per call).
{% endif %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if loop.first and system is not none %}
{%- elif message.role == 'assistant' %}
<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}
{%- endif %}
"""
# Merges are learned in Python; past this many the corpus has nothing more worth merging.
MAX_LEARNED_MERGES = 2000
LOGIT_STD = 8.0
NORM_OFFSET_STD = 0.1
DT_MIN, DT_MAX = 1e-3, 1e-1
# Residual branches write louder than the embedding, so a tied head does not just echo the current token.
RESIDUAL_BRANCH_GAIN = 4.0
RESIDUAL_BRANCH_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# A few megabytes, hidden 64, 4 layers (3 GDN + 1 attention), vocab 512; head counts split by tensor parallel 1, 2, 4.
TINY_OVERRIDES: dict = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
}
# MoE configs also shrink their experts: 8 experts of width 32 (split by tensor parallel 1, 2, 4), 2 per token.
TINY_MOE_OVERRIDES: dict = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}

TOKENIZER_CORPUS = """\
A hybrid language model mixes two kinds of layers. Most layers are linear attention: each keeps a small state that
is updated token by token and never grows, however long the text becomes. Every fourth layer is full attention: it
remembers the keys and values of all earlier tokens, so its memory grows with the length of every request.
A serving engine therefore keeps two pools. The token pool is split into blocks of sixteen tokens and handed out as
requests grow; the state pool holds one slot per running request, and a slot is cleared when a request starts and
returned when it finishes. Capacity is counted in tokens for the first pool and in requests for the second.
The planner reads the model's configuration, the size of the graphics card and the target load, then computes how
many bytes each pool needs before anything is deployed. After the engine starts, it measures what it really
allocated and reports both numbers side by side, so an operator can see whether the prediction was right.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 8192. Punctuation: , . ; : ! ? ( ) [ ] { }
" ' - + = * / < > | _ # @ & % $. Code: def step(batch): return [model(x) for x in batch] if batch else None
The quick brown fox jumps over the lazy dog while the engine schedules decodes first and prefills in chunks.
Requests arrive, wait for a free slot and enough blocks, run, and leave; when memory runs out, the newest request
is preempted and recomputed later. Nothing is guessed: every figure is derived from bytes.
"""

# Keys an override may set though the source config need not hold them: the rule that derives layer_types.
OVERRIDE_ONLY_KEYS = ("full_attention_interval",)


class ModelSpecError(UserError):
    """A geometry, config or override that does not describe a model make_model can write."""


def config_from_geometry(geometry: ModelGeometry) -> dict:
    """The Hugging Face text config (config.json) of a geometry, MoE keys included for MoE geometries."""
    moe = {
        "num_experts": geometry.num_experts,
        "num_experts_per_tok": geometry.num_experts_per_tok,
        "moe_intermediate_size": geometry.moe_intermediate_size,
        "shared_expert_intermediate_size": geometry.shared_expert_intermediate_size,
        "norm_topk_prob": geometry.norm_topk_prob,
        "decoder_sparse_step": geometry.decoder_sparse_step,
        "mlp_only_layers": list(geometry.mlp_only_layers),
    } if geometry.is_moe else {}
    return {
        **moe,
        "model_type": geometry.model_type,
        "hidden_size": geometry.hidden_size,
        "num_hidden_layers": geometry.num_hidden_layers,
        "layer_types": list(geometry.layer_types),
        "intermediate_size": geometry.intermediate_size,
        "num_attention_heads": geometry.num_attention_heads,
        "num_key_value_heads": geometry.num_key_value_heads,
        "head_dim": geometry.head_dim,
        "linear_num_key_heads": geometry.linear_num_key_heads,
        "linear_num_value_heads": geometry.linear_num_value_heads,
        "linear_key_head_dim": geometry.linear_key_head_dim,
        "linear_value_head_dim": geometry.linear_value_head_dim,
        "linear_conv_kernel_dim": geometry.linear_conv_kernel_dim,
        "vocab_size": geometry.vocab_size,
        "tie_word_embeddings": geometry.tie_word_embeddings,
        "rms_norm_eps": geometry.rms_norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": geometry.rope_theta,
            "partial_rotary_factor": geometry.partial_rotary_factor,
        },
        "max_position_embeddings": geometry.max_position_embeddings,
        "attn_output_gate": geometry.attn_output_gate,
        "dtype": geometry.dtype,
        "mamba_ssm_dtype": geometry.mamba_ssm_dtype,
        "hidden_act": "silu",
    }


def _default_layer_types(num_layers: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def build_config(source: ModelGeometry | Mapping, *, tiny: bool = False, overrides: Mapping | None = None,
                 dtype: str | None = None) -> dict:
    """The config.json to write: the source's text config, scaled down if `tiny`, then `overrides` applied.

    When the layer count changes and `layer_types` is not overridden, layer types are re-derived with a full-attention
    layer every `full_attention_interval` layers (4 unless the config says otherwise).
    """
    if isinstance(source, ModelGeometry):
        config = config_from_geometry(source)
    elif "text_config" in source:
        # A vision-language config: the text model's keys, with the head tying that lives at the top level.
        tying = {key: source[key] for key in ("tie_word_embeddings",) if key in source}
        config = copy.deepcopy({**tying, **source["text_config"]})
    else:
        config = copy.deepcopy(dict(source))
    tiny_keys = {**TINY_OVERRIDES, **TINY_MOE_OVERRIDES}
    unknown = sorted(set(overrides or {}) - set(config) - set(tiny_keys) - set(OVERRIDE_ONLY_KEYS))
    if unknown:
        valid = sorted(set(config) | set(tiny_keys) | set(OVERRIDE_ONLY_KEYS))
        raise ModelSpecError(f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                             f"the keys this config can set are: {', '.join(valid)}")
    tiny_changes = {**TINY_OVERRIDES, **(TINY_MOE_OVERRIDES if config.get("num_experts") else {})} if tiny else {}
    changes = {**tiny_changes, **(overrides or {})}
    config.update(copy.deepcopy(changes))
    layers = config.get("num_hidden_layers")
    if "layer_types" not in changes and isinstance(layers, int) and len(config.get("layer_types") or ()) != layers:
        interval = config.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise ModelSpecError(f"full_attention_interval must be a positive integer, got {interval!r}")
        config["layer_types"] = _default_layer_types(layers, interval)
    if dtype is not None:
        if dtype not in DTYPES:
            raise ModelSpecError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        config["dtype"] = dtype
    config.pop("torch_dtype", None)
    config.setdefault("dtype", "bfloat16")
    if not isinstance(config["dtype"], str) or config["dtype"] not in DTYPES:
        raise ModelSpecError(f"config dtype {config['dtype']!r} is not one of {', '.join(DTYPES)}")
    config["model_type"] = config.get("model_type") or MODEL_TYPE
    if not isinstance(config["model_type"], str):
        raise ModelSpecError(f"config key 'model_type' must be a string, got {str(config['model_type'])[:80]}")
    if config["model_type"] in ARCHITECTURES:  # other types are refused by make_model with the engine's message
        config["architectures"] = [ARCHITECTURES[config["model_type"]]]
    config.setdefault("hidden_act", "silu")
    return config


# ---------------------------------------------------------------------------------------------------------- tokenizer


def _byte_alphabet() -> list[str]:
    """The printable stand-in character of each byte value used by byte-level BPE (GPT-2's mapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def learn_merges(words: Counter, num_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE merges over pre-tokenized words; ties go to the lexicographically smallest pair, so it is stable."""
    pieces = {word: list(word) for word in words}
    merges = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for word, count in words.items():
            symbols = pieces[word]
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        if pairs[best] < 2:
            break
        merges.append(best)
        merged = best[0] + best[1]
        for word, symbols in pieces.items():
            i, out = 0, []
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            pieces[word] = out
    return merges


def build_tokenizer(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` ids; the eos token is id 256."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    minimum = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ModelSpecError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer; use at least {minimum}")
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(piece for piece, _ in pre_tokenizer.pre_tokenize_str(TOKENIZER_CORPUS))
    merges = learn_merges(words, min(vocab_size - minimum, MAX_LEARNED_MERGES))
    vocab = {char: byte for byte, char in enumerate(_byte_alphabet())}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    for left, right in merges:
        vocab[left + right] = len(vocab)
    # Reserved ids decode to their own name, which encodes back to the id (an added token, not special: decoding
    # keeps it), so any sampled id has a text that reads back as itself.
    reserved = []
    while len(vocab) < vocab_size:
        reserved.append(f"<|reserved_{len(reserved)}|>")
        vocab[reserved[-1]] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in reserved])
    return tokenizer


# ------------------------------------------------------------------------------------------------------------ weights


def _init_std(name: str, shape: tuple[int, ...], hidden_size: int, tied: bool) -> tuple[float, float]:
    """(mean, std) of the normal a tensor is drawn from; see the module docstring for the reasoning."""
    head_std = LOGIT_STD / math.sqrt(hidden_size)
    if name.endswith("embed_tokens.weight"):
        return 0.0, head_std if tied else 1.0
    if name == "lm_head.weight":
        return 0.0, head_std
    if name.endswith("linear_attn.norm.weight"):
        return 1.0, NORM_OFFSET_STD  # plain-weight gated norm
    if name.endswith("norm.weight"):
        return 0.0, NORM_OFFSET_STD  # zero-centred (1 + w) norms
    if name.endswith("conv1d.weight"):
        return 0.0, 1.0 / math.sqrt(shape[-1])
    if name.endswith(RESIDUAL_BRANCH_OUTPUTS):
        return 0.0, RESIDUAL_BRANCH_GAIN / math.sqrt(shape[-1])
    return 0.0, 1.0 / math.sqrt(shape[-1])


def _random_tensor(name: str, shape: tuple[int, ...], config: dict, generator: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        # Per-head decay rates A in [1, 16], as trained models spread them.
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log()
    if name.endswith("dt_bias"):
        # Time steps dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1] (Mamba's range): memories of ~1 to ~1000 tokens.
        dt = torch.empty(shape).uniform_(math.log(DT_MIN), math.log(DT_MAX), generator=generator).exp()
        return torch.log(torch.expm1(dt))
    mean, std = _init_std(name, shape, config["hidden_size"], bool(config.get("tie_word_embeddings")))
    return torch.randn(shape, generator=generator) * std + mean


def checkpoint_shapes(config: dict, per_expert: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the checkpoint for this config, in sorted order; `per_expert` stores one
    tensor per expert even for a model type whose 16-bit checkpoints stack them (quantized experts are stored so)."""
    from hybridkv.sidecar.model.loader import checkpoint_entries
    from hybridkv.sidecar.model.qwen3_5 import Qwen3_5ForCausalLM

    geometry = geometry_from_config(config)
    # The meta device gives every shape without allocating the weights.
    model = Qwen3_5ForCausalLM(geometry, torch.float32, "meta")
    entries = checkpoint_entries(model)
    names = written_names(entries, geometry.model_type, per_expert)
    return {name: entries[name].checkpoint_shape for name in sorted(names)}


def written_names(entries: Mapping, model_type: str, per_expert: bool = False) -> list[str]:
    """The checkpoint names of `checkpoint_entries` a checkpoint of this model type stores: stacked experts have
    entries under both names, and this keeps the ones its published checkpoints use (one per expert where
    `per_expert`)."""
    per_expert = per_expert or model_type in PER_EXPERT_MODEL_TYPES
    stacked = {entry.alternative_to for entry in entries.values() if entry.alternative_to}
    return [name for name, entry in entries.items()
            if (per_expert if entry.alternative_to else not (per_expert and name in stacked))]


INDEX_FILE = "model.safetensors.index.json"


def _plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, max_shard_bytes: int) -> dict[str, list[str]]:
    """File name -> tensor names, filling each file up to `max_shard_bytes` in name order."""
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * itemsize
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    return {f"model-{index:05d}-of-{len(shards):05d}.safetensors": names for index, names in enumerate(shards, 1)}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# make-model --quantize: the stored format, and the projections each keeps in 16 bits (as published checkpoints keep
# the small GDN gate projections, the MoE router and the shared-expert gate); tiny models use 32-channel groups so
# their 64-wide hidden size holds whole groups.
QUANTIZE_FORMATS = {
    "fp8": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
            ["lm_head", "linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.in_proj_ba", "mlp.gate",
             "mlp.shared_expert_gate"]),
    "awq": ({"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemm"},
            ["lm_head", "in_proj_a", "in_proj_b", "mlp.gate", "mlp.shared_expert_gate"]),
    "w4a16": (None, ["lm_head", "re:.*linear_attn[.]in_proj_[ab]$", "re:.*mlp[.](shared_expert_)?gate$"]),
}
TINY_GROUP_SIZE = 32
FULL_GROUP_SIZE = 128


def quantization_config(quantize: str, tiny: bool, dtype: str) -> dict:
    """The `quantization_config` make-model writes for `--quantize` (fp8, awq or w4a16)."""
    from hybridkv.sizing.quantization import W4A16, WeightQuantization, parse_quantization_config

    if quantize not in QUANTIZE_FORMATS:
        raise ModelSpecError(f"quantize {quantize!r} is not one of {', '.join(QUANTIZE_FORMATS)}")
    entry, skipped = QUANTIZE_FORMATS[quantize]
    group_size = TINY_GROUP_SIZE if tiny else FULL_GROUP_SIZE
    if quantize == W4A16:
        return WeightQuantization(W4A16, group_size=group_size, symmetric=False, scale_dtype=dtype,
                                  not_converted=tuple(skipped)).config_entry(dtype)
    config = {**entry, "modules_to_not_convert": skipped}
    if quantize == "awq":
        config["group_size"] = group_size
    parse_quantization_config(config, dtype)  # the writer and the reader agree on every key
    return config


def stored_tensors(name: str, dense: torch.Tensor, quantization, linear_names: frozenset[str],
                    dtype: torch.dtype) -> dict:
    """The checkpoint tensors of one dense tensor: itself, or its quantized form when it is a converted weight."""
    from hybridkv.kernels.quant_reference import quantize_fp8_block, quantize_w4
    from hybridkv.sizing.quantization import AWQ, FP8

    module = name.removesuffix(".weight")
    if quantization is None or module not in linear_names or not quantization.converts(module):
        return {name: dense.to(dtype)}
    if quantization.method == FP8:
        values, scale_inv = quantize_fp8_block(dense, quantization.block_size)
        return {name: values, f"{module}.weight_scale_inv": scale_inv}
    scale_dtype = DTYPES[quantization.scale_dtype]
    stored = quantize_w4(dense, quantization.group_size, quantization.method == AWQ, quantization.symmetric,
                         scale_dtype)
    return {f"{module}.{suffix}": tensor for suffix, tensor in stored.items()}


def _write_weights(out_dir: Path, shards: dict[str, list[str]], shapes: dict[str, tuple[int, ...]], config: dict,
                   seed: int) -> None:
    dtype = DTYPES[config["dtype"]]
    from hybridkv.sizing.quantization import linear_layers

    geometry = geometry_from_config(config)
    linear_names = frozenset(name for name, _, _ in linear_layers(geometry))
    from hybridkv.sidecar.random_weights import random_weight

    total_bytes, weight_map = 0, {}
    for file_name, names in shards.items():
        tensors = {}
        for name in names:
            dense = random_weight(name, shapes[name], config, seed, torch.device("cpu"))
            tensors.update(stored_tensors(name, dense, geometry.quantization, linear_names, dtype))
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file_name))
        save_file(tensors, out_dir / file_name, metadata={"format": "pt"})
        # safetensors creates files 0600; a checkpoint is read by the (non-root) server, so follow the umask instead.
        os.chmod(out_dir / file_name, 0o666 & ~_umask())
        del tensors
    if len(shards) > 1:
        index_json = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index_json, indent=2, sort_keys=True) + "\n")


def make_model(out_dir: str | Path, geometry_or_config: ModelGeometry | Mapping, seed: int, *, tiny: bool = False,
               overrides: Mapping | None = None, dtype: str | None = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, quantize: str | None = None,
               weights: bool = True) -> Path:
    """Write a random-weight checkpoint and its tokenizer into `out_dir`; returns the folder.

    `geometry_or_config` is a catalog `ModelGeometry` or a Hugging Face config dict (a vision-language config's
    `text_config` is used). `tiny` applies `TINY_OVERRIDES`; `overrides` then sets any config key; `dtype` is the
    stored weight dtype (default: the config's); `quantize` (fp8, awq, w4a16) stores the projections in that
    published format, quantized from the same random draws. Raises ModelSpecError / GeometryError for configs that cannot be
    written and UnsupportedModelError for architectures the engine does not run. Files already in `out_dir` with
    the same names are replaced; other weight files there (a checkpoint sharded differently) are refused.
    `weights=False` writes everything but the weights (for `--load-format random`, which builds the same values in
    device memory with `random_weights`).
    """
    from hybridkv.sidecar.model.qwen3_5 import check_supported

    if max_shard_bytes < 1:
        raise ModelSpecError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    config = build_config(geometry_or_config, tiny=tiny, overrides=overrides, dtype=dtype)
    geometry = geometry_from_config(config)
    check_supported(geometry)
    tokenizer = build_tokenizer(geometry.vocab_size)
    config["eos_token_id"] = tokenizer.token_to_id(EOS_TOKEN)
    # Shapes and random draws of the 16-bit model; quantized projections are written from those draws.
    config.pop("quantization_config", None)
    per_expert = False
    if quantize is not None:
        quantized = {**config, "quantization_config": quantization_config(quantize, tiny, config["dtype"])}
        quantized_geometry = geometry_from_config(quantized)
        check_supported(quantized_geometry)
        per_expert = quantized_geometry.fp8_experts
    shapes = checkpoint_shapes(config, per_expert)
    if quantize is not None:
        config = quantized
    shards = _plan_shards(shapes, torch.empty((), dtype=DTYPES[config["dtype"]]).element_size(), max_shard_bytes)
    out_dir = Path(out_dir)
    written = set(shards) | ({INDEX_FILE} if len(shards) > 1 else set())
    # Weight files of another checkpoint would be read with these and break loading: refuse rather than delete them.
    stale = sorted(path.name for path in out_dir.glob("*.safetensors*") if path.name not in written)
    if stale:
        raise ModelSpecError(f"{out_dir} already holds weight files this checkpoint would not replace "
                             f"({', '.join(stale[:4])}); remove them or choose another folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if weights:
        _write_weights(out_dir, shards, shapes, config, seed)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "model_max_length": config.get("max_position_embeddings"),
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    generation_config = {"eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2, sort_keys=True) + "\n")
    return out_dir
