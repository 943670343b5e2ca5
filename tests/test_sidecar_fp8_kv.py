"""`--kv-cache-dtype fp8` end to end on the tiny checkpoint: logits within a stated bound of a float32 KV cache, greedy
agreement, twice the tokens of a bfloat16 cache in the capacity report, the checkpoint's K/V scales under their
published names, and specific errors for a malformed scale or a bad flag."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_fixtures import make_engine, tiny_checkpoint  # noqa: F401 (fixtures)
from test_sidecar_engine import generate_recording_logits

from hybridkv.cli import main
from hybridkv.sidecar.core.config import ConfigError, EngineConfig
from hybridkv.sidecar.core.sampling import SamplingParams
from hybridkv.sidecar.model.loader import CheckpointError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Stated bound on the relative L2 error of each position's logits against the float32 cache, on the same tokens: e4m3
# keeps 3 mantissa bits (K and V within 1/16 each); measured up to 1.0e-2 on these prompts.
FP8_KV_LOGIT_BOUND = 3e-2
PROMPT_LENGTHS = [1, 5, 17, 31, 40, 64, 9, 23]


def _prompts(seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _first_token_logits(engine, prompt: list[int]) -> torch.Tensor:
    _, logits = generate_recording_logits(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=1))
    return logits[0][0]


def _with_tensors(source: str, target: Path, tensors: dict[str, torch.Tensor]) -> str:
    """A copy of the checkpoint folder with `tensors` added to its weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    weights = load_file(target / "model.safetensors")
    save_file({**weights, **tensors}, target / "model.safetensors")
    return str(target)


def _attention_layer(folder: str) -> int:
    return json.loads((Path(folder) / "config.json").read_text())["layer_types"].index("full_attention")


def test_fp8_kv_cache_serves_within_the_stated_logit_bound_of_a_float32_cache(tiny_checkpoint):
    reference, fp8 = make_engine(tiny_checkpoint), make_engine(tiny_checkpoint, kv_cache_dtype="fp8")
    assert all(pool.dtype == torch.float8_e4m3fn for pair in fp8.cache.kv_caches for pool in pair)
    prompts = _prompts()
    want_tokens, want_logits = generate_recording_logits(reference, prompts, GREEDY)
    got_tokens, got_logits = generate_recording_logits(fp8, prompts, GREEDY)
    errors = []
    for want, got, want_row, got_row in zip(want_tokens, got_tokens, want_logits, got_logits):
        # Positions up to the first differing token saw the same tokens on both sides.
        same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want) - 1) + 1
        errors.append(((got_row[:same] - want_row[:same]).norm(dim=-1) / want_row[:same].norm(dim=-1)).max().item())
    agree = sum(want == got for want, got in zip(want_tokens, got_tokens))
    print(f"fp8 KV: relative logit error max {max(errors):.2e}, greedy agreement {agree}/{len(prompts)} prompts")
    assert max(errors) < FP8_KV_LOGIT_BOUND
    assert agree >= len(prompts) * 3 // 4


def test_fp8_kv_cache_holds_twice_the_tokens_of_a_bfloat16_cache(tiny_checkpoint):
    bf16 = make_engine(tiny_checkpoint, dtype="bfloat16").capacity()
    fp8 = make_engine(tiny_checkpoint, dtype="bfloat16", kv_cache_dtype="fp8").capacity()
    assert fp8.budget_bytes == bf16.budget_bytes and fp8.state_pool_bytes == bf16.state_pool_bytes
    # Half the bytes per token: twice the blocks, plus what the null block and the rounding free.
    assert 2 * bf16.token_blocks <= fp8.token_blocks <= 2 * bf16.token_blocks + 3
    assert fp8.token_capacity == fp8.token_blocks * fp8.block_size
    # The planner's prediction beside it (what GetCapacity and the status report) counts fp8 pages too.
    assert 2 * bf16.predicted["token_blocks"] <= fp8.predicted["token_blocks"] <= 2 * bf16.predicted["token_blocks"] + 3
    assert fp8.to_dict()["token_capacity"] == fp8.token_capacity


@pytest.mark.parametrize(
    "names",
    [
        pytest.param({"self_attn.k_scale": 0.5, "self_attn.v_scale": 2.0}, id="compressed-tensors"),
        pytest.param({"self_attn.k_proj.k_scale": 0.5, "self_attn.v_proj.v_scale": 2.0}, id="modelopt"),
        pytest.param({"self_attn.kv_scale": 0.5}, id="one-scale-for-both"),
    ],
)
def test_the_checkpoints_kv_scales_are_read_under_each_published_name(tiny_checkpoint, tmp_path, names):
    layer = _attention_layer(tiny_checkpoint)
    folder = _with_tensors(tiny_checkpoint, tmp_path / "scaled", {
        f"model.layers.{layer}.{name}": torch.tensor(value, dtype=torch.float32) for name, value in names.items()})
    attention = make_engine(folder, kv_cache_dtype="fp8").runner.model.attention_layers[0]
    k_scale = next(value for name, value in names.items() if "k" in name.rpartition(".")[2])
    v_scale = next(value for name, value in names.items() if "v" in name.rpartition(".")[2])
    assert (attention.k_scale, attention.v_scale) == (k_scale, v_scale)


def test_scales_change_an_fp8_cache_and_leave_a_16_bit_cache_alone(tiny_checkpoint, tmp_path):
    layer = _attention_layer(tiny_checkpoint)
    # K and V over 1e-3 saturate at 448 × 1e-3: a cache that applies these scales loses almost everything.
    folder = _with_tensors(tiny_checkpoint, tmp_path / "saturating", {
        f"model.layers.{layer}.self_attn.k_scale": torch.tensor(1e-3),
        f"model.layers.{layer}.self_attn.v_scale": torch.tensor(1e-3)})
    prompt = _prompts()[5]
    plain = _first_token_logits(make_engine(tiny_checkpoint), prompt)
    assert torch.equal(_first_token_logits(make_engine(folder), prompt), plain)
    unscaled = _first_token_logits(make_engine(tiny_checkpoint, kv_cache_dtype="fp8"), prompt)
    scaled = _first_token_logits(make_engine(folder, kv_cache_dtype="fp8"), prompt)
    assert (scaled - plain).norm() > 10 * (unscaled - plain).norm()


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.tensor([0.5, 0.5]), r"holds F32 of shape \[2\]; hybridkv reads one per-tensor scale"),
        (torch.tensor(-1.0), "holds -1.0; it must be a positive finite number"),
        (torch.tensor(float("nan")), "holds nan; it must be a positive finite number"),
        (torch.tensor(3, dtype=torch.int32), r"holds I32 of shape \[\]"),
    ],
)
def test_a_malformed_kv_scale_is_a_specific_error_at_start(tiny_checkpoint, tmp_path, tensor, message):
    name = f"model.layers.{_attention_layer(tiny_checkpoint)}.self_attn.k_scale"
    folder = _with_tensors(tiny_checkpoint, tmp_path / "bad", {name: tensor})
    with pytest.raises(CheckpointError, match=f"{name} is a KV-cache scale but {message}"):
        make_engine(folder, kv_cache_dtype="fp8")


def test_a_kv_scale_on_a_layer_without_attention_is_an_unexpected_tensor(tiny_checkpoint, tmp_path):
    folder = _with_tensors(tiny_checkpoint, tmp_path / "misplaced",
                           {"model.layers.0.self_attn.k_scale": torch.tensor(1.0)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.k_scale"):
        make_engine(folder, kv_cache_dtype="fp8")


def test_a_bad_kv_cache_dtype_is_refused(tiny_checkpoint, capsys):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8, got 'fp8_e5m2'"):
        EngineConfig(model=tiny_checkpoint, kv_cache_dtype="fp8_e5m2").validate()
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", tiny_checkpoint, "--kv-cache-dtype", "int8"])
    assert exit_info.value.code == 2
    assert "argument --kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err
