"""The fused mixture-of-experts kernel: the plain-torch reference against a per-token loop over experts, the Triton
kernel under the interpreter (tiny shapes) against the reference, and on the GPU (`-m gpu`) one MoE layer at
Qwen3.5-35B-A3B's geometry against the reference in float64."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from kernel_checks import rel_err  # noqa: E402

from hybridkv import kernels  # noqa: E402
from hybridkv.kernels import reference  # noqa: E402


def moe_inputs(num_tokens, num_experts, top_k, hidden_size, intermediate_size, generator, dtype=torch.float32,
               device="cpu"):
    """Random activations, experts and softmax top-k routing; experts N(0, 1/fan_in) so outputs stay O(1)."""
    hidden = torch.randn(num_tokens, hidden_size, generator=generator)
    w13 = torch.randn(num_experts, 2 * intermediate_size, hidden_size, generator=generator) / hidden_size**0.5
    w2 = torch.randn(num_experts, hidden_size, intermediate_size, generator=generator) / intermediate_size**0.5
    probabilities = torch.randn(num_tokens, num_experts, generator=generator).softmax(-1)
    topk_weights, topk_ids = probabilities.topk(top_k, dim=-1)
    return {"hidden": hidden.to(device, dtype), "w13": w13.to(device, dtype), "w2": w2.to(device, dtype),
            "topk_weights": topk_weights.to(device), "topk_ids": topk_ids.to(device, torch.int32)}


def per_token_loop(hidden, w13, w2, topk_weights, topk_ids):
    """The definition, one token and one choice at a time, in float64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        x = hidden[token].double()
        for choice in range(topk_ids.shape[1]):
            expert = int(topk_ids[token, choice])
            gate, up = (w13[expert].double() @ x).chunk(2)
            out[token] += float(topk_weights[token, choice]) * (w2[expert].double() @ (torch.nn.functional.silu(gate) * up))
    return out


def test_reference_equals_a_per_token_loop_over_experts(torch_generator):
    inputs = moe_inputs(9, 6, 3, 32, 24, torch_generator, dtype=torch.float64)
    # Expert 5 receives nothing; token 0 sends all three choices to expert 2; token 1 splits its weight unevenly.
    inputs["topk_ids"][inputs["topk_ids"] == 5] = 4
    inputs["topk_ids"][0] = 2
    inputs["topk_weights"][1] = torch.tensor([0.7, 0.2, 0.1], dtype=inputs["topk_weights"].dtype)
    got = reference.fused_moe(**inputs)
    assert got.dtype == torch.float64
    assert torch.allclose(got, per_token_loop(**inputs), rtol=1e-12, atol=1e-12)


def test_reference_rejects_mismatched_shapes(torch_generator):
    inputs = moe_inputs(4, 4, 2, 16, 8, torch_generator)
    with pytest.raises(ValueError, match=r"must be \[E, 2I, H\] and \[E, H, I\]"):
        reference.fused_moe(**{**inputs, "w2": inputs["w2"][:, :, :4]})
    with pytest.raises(ValueError, match="must both be"):
        reference.fused_moe(**{**inputs, "topk_ids": inputs["topk_ids"][:, :1]})


def test_dispatcher_runs_the_reference_for_cpu_tensors(torch_generator, monkeypatch):
    monkeypatch.delenv("HYBRIDKV_KERNELS", raising=False)
    inputs = moe_inputs(5, 4, 2, 16, 8, torch_generator)
    assert torch.equal(kernels.fused_moe(**inputs), reference.fused_moe(**inputs))


# ---- the Triton kernel under the interpreter -------------------------------------------------------------------

interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is off on a CUDA "
                                      "machine; the GPU test below covers the kernel there")


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,block_m", [(1, 16), (3, 16), (40, 16), (40, 32), (100, 16)])
def test_triton_kernel_matches_the_reference_with_idle_experts_and_repeated_choices(torch_generator, dtype,
                                                                                    num_tokens, block_m):
    pytest.importorskip("triton")
    from hybridkv.kernels import moe

    # Hidden 48 and intermediate 40 are not multiples of the 16-wide tiles: the edge masks are exercised.
    inputs = moe_inputs(num_tokens, 8, 3, 48, 40, torch_generator, dtype=dtype)
    inputs["topk_ids"][inputs["topk_ids"] >= 6] = 1  # experts 6 and 7 get no rows; expert 1 gets many
    inputs["topk_ids"][-1] = 3  # the last token's three choices all land on expert 3
    # One token's gate/up GEMV walks hidden 48 in three K tiles of 16.
    launch = moe.MoeLaunch(block_m=block_m, block_n=16, block_k=16, num_warps=4, num_stages=1,
                           one_token_gate_up_block_k=16)
    # 100 tokens take the parallel alignment, one token none (each row a block of its own), the others the
    # one-launch kernel.
    assert (num_tokens * 3 > moe.ONE_LAUNCH_ALIGN_ROWS) == (num_tokens == 100)
    got = moe.fused_moe(**inputs, launch=launch)
    want = reference.fused_moe(**inputs)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)
    if num_tokens == 1:  # its gate/up through the tensor-core tiles instead of the GEMV
        tiles = moe.fused_moe(**inputs, launch=dataclasses.replace(launch, one_token_gemv=False))
        assert rel_err(tiles, want) < (1e-5 if dtype == torch.float32 else 2e-2)
    # The weight tiles through tensor descriptors: the same tiles, so the same output bit for bit (a gate tile
    # past the expert's 40 rows reads its up rows, into columns the store masks).
    with_tma = dataclasses.replace(launch, tma=True)
    assert moe.tma_tiles_fit(inputs["w13"], inputs["w2"], with_tma)
    assert torch.equal(moe.fused_moe(**inputs, launch=with_tma), got)
    # The down projection in tiles of its own, wider than the gate/up kernel's (hidden 48 in two tiles of 32, the
    # second half past the edge), through pointers and through descriptors.
    wide_down = dataclasses.replace(launch, down_block_n=32, down_num_warps=2, down_num_stages=2)
    assert wide_down.down == (32, 2, 2) and launch.down == (16, 4, 1)
    if num_tokens > 1:  # one token's down projection is a GEMV of its own launch
        for variant in (wide_down, dataclasses.replace(wide_down, tma=True)):
            assert rel_err(moe.fused_moe(**inputs, launch=variant), want) < (1e-5 if dtype == torch.float32 else 2e-2)


@interpreter_only
@pytest.mark.parametrize("num_tokens,block_m,align_m,dtype", [
    (3, 64, 16, torch.bfloat16), (100, 64, 16, torch.float32), (100, 64, 16, torch.bfloat16),
    (100, 32, 16, torch.float32), (70, 64, 32, torch.bfloat16)])
def test_tiles_of_several_aligned_blocks_match_the_reference(torch_generator, num_tokens, block_m, align_m, dtype):
    """Prefill tiles of up to four aligned blocks: an expert's last tile of one block is computed as one block's
    rows, of two (of four) as two, of three as a whole tile with its last rows idle. Expert 1 gets many rows
    (several whole tiles, then a partial one), experts 6 and 7 none, and one token sends every choice to one expert."""
    pytest.importorskip("triton")
    from hybridkv.kernels import moe

    inputs = moe_inputs(num_tokens, 8, 3, 48, 40, torch_generator, dtype=dtype)
    if num_tokens == 100:  # rows per expert 10, 100, 30, 40, 81, 39 (in 16-row blocks 1, 4+3, 2, 3, 4+2, 3), shuffled
        counts = torch.tensor([10, 100, 30, 40, 81, 39, 0, 0])
        flat = torch.repeat_interleave(torch.arange(8), counts)
        inputs["topk_ids"] = flat[torch.randperm(300, generator=torch_generator)].view(100, 3).to(torch.int32)
    else:
        inputs["topk_ids"][inputs["topk_ids"] >= 6] = 1
    inputs["topk_ids"][-1] = 3
    launch = moe.MoeLaunch(block_m=block_m, block_n=16, block_k=16, num_warps=4, num_stages=1, align_m=align_m)
    aligned = moe.align_by_expert(inputs["topk_ids"], 8, align_m, launch.tile_blocks)
    if num_tokens == 100 and launch.tile_blocks == 4:  # every kind of tile is run
        assert set(aligned.tiles[1].tolist()) == {0, 1, 2, 3, 4}
    got = moe.fused_moe(**inputs, launch=launch)
    want = reference.fused_moe(**inputs)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)
    untiled = moe.fused_moe(**inputs, launch=dataclasses.replace(launch, align_m=0))
    assert rel_err(got, untiled) < (1e-6 if dtype == torch.float32 else 1e-2)
    with_tma = dataclasses.replace(launch, tma=True)
    assert torch.equal(moe.fused_moe(**inputs, launch=with_tma), got)


def test_a_launch_takes_tiles_of_one_two_or_four_aligned_blocks():
    from hybridkv.kernels import moe

    assert moe.MoeLaunch(128, 128, 64, 8, 3).tile_blocks == 1
    assert moe.MoeLaunch(128, 128, 64, 8, 3, align_m=64).tile_blocks == 2
    assert moe.MoeLaunch(128, 128, 64, 8, 3, align_m=32).tile_blocks == 4
    assert moe.launch_for(4096 * 8, 256) == moe.PREFILL_LAUNCH and moe.PREFILL_LAUNCH.tile_blocks == 4
    for align_m in (48, 16, 256):
        with pytest.raises(ValueError, match="must be block_m 128 over 1, 2 or 4"):
            moe.MoeLaunch(128, 128, 64, 8, 3, align_m=align_m)


def fp8_experts(inputs, scale_block):
    """The inputs' experts quantized to e4m3 per block, each checkpoint projection (gate, up, down) on its own grid
    as a checkpoint stores them; the scale grids stacked as the kernel takes them."""
    from hybridkv.kernels.quant_reference import quantize_fp8_block

    block = (scale_block, scale_block)
    intermediate = inputs["w13"].shape[1] // 2
    w13, s13, w2, s2 = [], [], [], []
    for e in range(inputs["w13"].shape[0]):
        gate, gate_scale = quantize_fp8_block(inputs["w13"][e, :intermediate].float(), block)
        up, up_scale = quantize_fp8_block(inputs["w13"][e, intermediate:].float(), block)
        down, down_scale = quantize_fp8_block(inputs["w2"][e].float(), block)
        w13.append(torch.cat([gate, up]))
        s13.append(torch.cat([gate_scale, up_scale]))
        w2.append(down)
        s2.append(down_scale)
    return {**inputs, "w13": torch.stack(w13), "w2": torch.stack(w2), "w13_scale": torch.stack(s13),
            "w2_scale": torch.stack(s2), "scale_block": scale_block}


def test_reference_with_e4m3_experts_is_the_reference_on_their_definition(torch_generator):
    """Block-scaled e4m3 experts are `weight * weight_scale_inv` per block (gate and up each on its own grid)."""
    from hybridkv.kernels.quant_reference import dequantize_fp8_block

    inputs = fp8_experts(moe_inputs(5, 4, 2, 48, 40, torch_generator), scale_block=16)
    intermediate = 40
    gate_blocks = 3  # ceil(40 / 16)
    w13 = torch.stack([torch.cat([
        dequantize_fp8_block(inputs["w13"][e, :intermediate], inputs["w13_scale"][e, :gate_blocks], (16, 16)),
        dequantize_fp8_block(inputs["w13"][e, intermediate:], inputs["w13_scale"][e, gate_blocks:], (16, 16)),
    ]) for e in range(4)])
    w2 = torch.stack([dequantize_fp8_block(inputs["w2"][e], inputs["w2_scale"][e], (16, 16)) for e in range(4)])
    dense = {key: inputs[key] for key in ("hidden", "topk_weights", "topk_ids")}
    assert torch.equal(reference.fused_moe(**inputs), reference.fused_moe(**dense, w13=w13, w2=w2))
    with pytest.raises(ValueError, match="come together"):
        reference.fused_moe(**{**inputs, "w2_scale": None})
    with pytest.raises(ValueError, match="gate blocks, then up blocks"):
        reference.fused_moe(**{**inputs, "w13_scale": inputs["w13_scale"][:, :gate_blocks]})


@interpreter_only
@pytest.mark.parametrize("num_tokens,block_m,block_k", [(1, 16, 16), (3, 16, 16), (40, 16, 16), (100, 16, 32)])
def test_triton_kernel_with_e4m3_experts_matches_the_reference(torch_generator, num_tokens, block_m, block_k):
    """Blocks of 32 over hidden 48 and intermediate 40: partial blocks at every edge, and the up projection's grid
    starting two rows into the stacked scales; 100 tokens take the parallel alignment, one token none."""
    pytest.importorskip("triton")
    from hybridkv.kernels import moe

    inputs = fp8_experts(moe_inputs(num_tokens, 8, 3, 48, 40, torch_generator, dtype=torch.bfloat16),
                         scale_block=32)
    inputs["topk_ids"][inputs["topk_ids"] >= 6] = 1  # experts 6 and 7 idle
    launch = moe.MoeLaunch(block_m=block_m, block_n=16, block_k=block_k, num_warps=4, num_stages=1)
    got = moe.fused_moe(**inputs, launch=launch)
    want = reference.fused_moe(**inputs)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got, want) < 2e-2
    with pytest.raises(ValueError, match="must divide the scale block"):
        moe.fused_moe(**inputs, launch=moe.MoeLaunch(block_m=16, block_n=16, block_k=64, num_warps=4,
                                                     num_stages=1))
    # 40 one-byte channels are not whole 16-byte rows: tensor descriptors cannot read w2, so the pointers do.
    with_tma = dataclasses.replace(launch, tma=True)
    assert not moe.tma_tiles_fit(inputs["w13"], inputs["w2"], with_tma)
    assert torch.equal(moe.fused_moe(**inputs, launch=with_tma), got)


@interpreter_only
@pytest.mark.parametrize("num_tokens", [1, 40])
def test_e4m3_weight_tiles_through_tensor_descriptors_equal_the_pointer_loads(torch_generator, num_tokens):
    pytest.importorskip("triton")
    from hybridkv.kernels import moe

    inputs = fp8_experts(moe_inputs(num_tokens, 8, 3, 48, 32, torch_generator, dtype=torch.bfloat16),
                         scale_block=32)
    launch = moe.MoeLaunch(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
    with_tma = dataclasses.replace(launch, tma=True)
    assert moe.tma_tiles_fit(inputs["w13"], inputs["w2"], with_tma)
    assert not moe.tma_tiles_fit(inputs["w13"], inputs["w2"], dataclasses.replace(with_tma, block_k=256))
    assert torch.equal(moe.fused_moe(**inputs, launch=with_tma), moe.fused_moe(**inputs, launch=launch))


@interpreter_only
def test_triton_kernel_sorts_rows_into_whole_blocks_of_one_expert(torch_generator):
    pytest.importorskip("triton")
    from hybridkv.kernels.moe import align_by_expert

    topk_ids = torch.tensor([[2, 0], [2, 2], [0, 3]], dtype=torch.int32)
    sorted_rows, block_experts, num_padded, num_blocks = align_by_expert(topk_ids, num_experts=5, block_m=4)[:4]
    sentinel = topk_ids.numel()
    # Rows t * 2 + j. Expert 0: rows 1, 4; expert 2: rows 0, 2, 3; expert 3: row 5; experts 1 and 4 none.
    assert sorted_rows[: int(num_padded)].tolist() == [1, 4, sentinel, sentinel, 0, 2, 3, sentinel,
                                                        5, sentinel, sentinel, sentinel]
    assert block_experts[: int(num_padded) // 4].tolist() == [0, 2, 3]
    assert num_blocks * 4 >= int(num_padded)


@interpreter_only
@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 256, 8, 16), (3, 5, 2, 4), (32, 256, 8, 16),
                                                                  (7, 512, 10, 16), (40, 8, 3, 32)])
def test_one_launch_alignment_equals_the_torch_alignment(torch_generator, num_tokens, num_experts, top_k, block_m):
    """Decode batches are aligned by one Triton program: exactly the torch version's sorted rows (a stable sort),
    block experts and padded length, with idle experts, non-power-of-two expert counts and a token that picks one
    expert for all its choices."""
    pytest.importorskip("triton")
    from hybridkv.kernels.moe import align_by_expert, align_in_one_launch

    topk_ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=torch_generator, dtype=torch.int32)
    topk_ids[-1] = num_experts - 1
    want = align_by_expert(topk_ids, num_experts, block_m)
    got = align_in_one_launch(topk_ids, num_experts, block_m)
    assert got[3] == want[3]
    for got_tensor, want_tensor in zip(got[:3], want[:3]):
        assert got_tensor.dtype == want_tensor.dtype and torch.equal(got_tensor, want_tensor)


@interpreter_only
@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m,tile_blocks", [
    (2, 5, 2, 4, 1), (33, 256, 8, 16, 1), (300, 256, 8, 128, 1), (260, 9, 10, 16, 1), (1100, 3, 1, 64, 1),
    (2, 5, 2, 4, 4), (300, 256, 8, 32, 4), (260, 9, 10, 16, 2), (1100, 3, 1, 16, 4)])
def test_parallel_alignment_equals_the_torch_alignment(torch_generator, num_tokens, num_experts, top_k, block_m,
                                                       tile_blocks):
    """Prefill batches are aligned in three launches over chunks of rows: exactly the torch version's buffers,
    within one chunk and across several (264 rows are two chunks of 256, 2,600 eleven, the last partial), with
    idle experts, more choices than experts, and a token that picks one expert for all its choices; with tiles of
    several blocks, the same tiles, and every block in use in exactly one tile of one expert."""
    pytest.importorskip("triton")
    from hybridkv.kernels.moe import align_by_expert, align_in_parallel

    topk_ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=torch_generator, dtype=torch.int32)
    topk_ids[-1] = num_experts - 1
    if num_experts > 8:
        topk_ids[topk_ids == 1] = 2  # expert 1 idle
    want = align_by_expert(topk_ids, num_experts, block_m, tile_blocks)
    got = align_in_parallel(topk_ids, num_experts, block_m, tile_blocks)
    assert (got.num_blocks, got.num_tiles) == (want.num_blocks, want.num_tiles)
    for got_tensor, want_tensor in zip(got[:3], want[:3]):
        assert got_tensor.dtype == want_tensor.dtype and torch.equal(got_tensor, want_tensor)
    if tile_blocks == 1:
        assert got.tiles is None and want.tiles is None
        return
    assert torch.equal(got.tiles, want.tiles)
    blocks_in_use = int(want.num_padded) // block_m
    covered = torch.zeros(want.num_blocks, dtype=torch.int64)
    for first, blocks in want.tiles.T.tolist():
        assert 0 <= blocks <= tile_blocks
        covered[first:first + blocks] += 1
        assert len(set(want.block_experts[first:first + blocks].tolist())) <= 1
    assert (covered[:blocks_in_use] == 1).all() and (covered[blocks_in_use:] == 0).all()


def test_fused_moe_aligns_one_token_not_at_all_decode_batches_in_one_launch_and_prefill_in_parallel():
    from hybridkv.kernels.moe import DECODE_LAUNCH, ONE_LAUNCH_ALIGN_ROWS, MoeLaunch, alignment_for

    assert alignment_for(1, 9, DECODE_LAUNCH) == "none"
    assert alignment_for(2, 16, DECODE_LAUNCH) == "one_launch"
    assert alignment_for(32, ONE_LAUNCH_ALIGN_ROWS, DECODE_LAUNCH) == "one_launch"
    assert alignment_for(33, ONE_LAUNCH_ALIGN_ROWS + 8, DECODE_LAUNCH) == "parallel"
    # Tiles of several aligned blocks are named by the parallel alignment only, whatever the batch.
    assert alignment_for(2, 16, MoeLaunch(128, 128, 64, 8, 3, align_m=32)) == "parallel"


# ---- the GPU: one MoE layer at Qwen3.5-35B-A3B geometry -----------------------------------------------------------

QWEN3_5_35B_A3B = {"num_experts": 256, "top_k": 8, "hidden_size": 2048, "intermediate_size": 512}


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 4096])
def test_fused_moe_at_qwen3_5_35b_a3b_geometry_on_the_gpu(torch_generator, num_tokens):
    """bf16 kernel against the float64 reference on the same bf16 weights, decode and prefill launch shapes."""
    geometry = QWEN3_5_35B_A3B
    inputs = moe_inputs(num_tokens, geometry["num_experts"], geometry["top_k"], geometry["hidden_size"],
                        geometry["intermediate_size"], torch_generator, dtype=torch.bfloat16, device="cuda")
    got = kernels.fused_moe(**inputs)
    want = reference.fused_moe(**{**inputs, "hidden": inputs["hidden"].double(), "w13": inputs["w13"].double(),
                                  "w2": inputs["w2"].double()})
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [40, 4096])
def test_weight_tiles_through_tensor_descriptors_equal_the_pointer_loads_on_the_gpu(torch_generator, num_tokens):
    """The prefill tiles at Qwen3.5-35B-A3B geometry read through the tensor memory accelerator: the same output,
    bit for bit, as the pointer loads."""
    from hybridkv.kernels import moe

    geometry = QWEN3_5_35B_A3B
    inputs = moe_inputs(num_tokens, geometry["num_experts"], geometry["top_k"], geometry["hidden_size"],
                        geometry["intermediate_size"], torch_generator, dtype=torch.bfloat16, device="cuda")
    launch = dataclasses.replace(moe.PREFILL_LAUNCH, tma=False)
    with_tma = dataclasses.replace(launch, tma=True)
    assert moe.tma_tiles_fit(inputs["w13"], inputs["w2"], with_tma)
    assert torch.equal(moe.fused_moe(**inputs, launch=with_tma), moe.fused_moe(**inputs, launch=launch))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,block_m,tile_blocks", [(40, 16, 1), (4096, 128, 1), (16384, 128, 1),
                                                            (40, 32, 4), (4096, 32, 4), (16384, 32, 4)])
def test_parallel_alignment_equals_the_torch_alignment_on_the_gpu(torch_generator, num_tokens, block_m,
                                                                  tile_blocks):
    """The prefill alignment as compiled for the GPU: the torch version's buffers (and tiles) exactly, up to 16k
    tokens (512 chunks of rows)."""
    from hybridkv.kernels.moe import align_by_expert, align_in_parallel

    logits = torch.randn(num_tokens, QWEN3_5_35B_A3B["num_experts"], generator=torch_generator)
    topk_ids = logits.topk(QWEN3_5_35B_A3B["top_k"], dim=-1).indices.to("cuda", torch.int32)
    want = align_by_expert(topk_ids, QWEN3_5_35B_A3B["num_experts"], block_m, tile_blocks)
    got = align_in_parallel(topk_ids, QWEN3_5_35B_A3B["num_experts"], block_m, tile_blocks)
    assert (got.num_blocks, got.num_tiles) == (want.num_blocks, want.num_tiles)
    for got_tensor, want_tensor in zip(got[:3], want[:3]):
        assert torch.equal(got_tensor, want_tensor)
    if tile_blocks > 1:
        assert torch.equal(got.tiles, want.tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_fused_moe_with_e4m3_experts_at_qwen3_5_35b_a3b_geometry_on_the_gpu(torch_generator, num_tokens):
    """e4m3 experts with 128-square block scales against the reference on their dequantized float64 weights."""
    from hybridkv.kernels.moe_reference import dequantize_experts

    geometry = QWEN3_5_35B_A3B
    inputs = fp8_experts(moe_inputs(num_tokens, geometry["num_experts"], geometry["top_k"], geometry["hidden_size"],
                                    geometry["intermediate_size"], torch_generator), scale_block=128)
    inputs = {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
    inputs["hidden"] = inputs["hidden"].to(torch.bfloat16)
    got = kernels.fused_moe(**inputs)
    w13, w2 = dequantize_experts(inputs["w13"], inputs["w2"], inputs["w13_scale"], inputs["w2_scale"], 128)
    want = reference.fused_moe(hidden=inputs["hidden"].double(), w13=w13.double(), w2=w2.double(),
                               topk_weights=inputs["topk_weights"], topk_ids=inputs["topk_ids"])
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_routed_moe_with_the_stacked_shared_expert_at_qwen3_5_35b_a3b_geometry_on_the_gpu(torch_generator,
                                                                                           num_tokens):
    """Route and experts with the shared expert as expert 256 (one token routed inside the gate/up kernel) against
    the float64 reference on the same bf16 weights and the same choices."""
    geometry = QWEN3_5_35B_A3B
    stack = geometry["num_experts"] + 1
    inputs = moe_inputs(num_tokens, stack, geometry["top_k"], geometry["hidden_size"], geometry["intermediate_size"],
                        torch_generator, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(num_tokens, stack, generator=torch_generator).to("cuda", torch.bfloat16)
    got = kernels.routed_moe(inputs["hidden"], logits, inputs["w13"], inputs["w2"], geometry["top_k"], True, True)
    weights, ids = reference.moe_route(logits, geometry["top_k"], True, shared_expert=True)
    want = reference.fused_moe(inputs["hidden"].double(), inputs["w13"].double(), inputs["w2"].double(), weights, ids)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 4096])
def test_route_and_the_shared_expert_at_qwen3_5_35b_a3b_geometry_on_the_gpu(torch_generator, num_tokens):
    """The one-launch router against torch's softmax and top-k on the GPU, and the final reduction's shared expert
    against the unfused torch ops, on the same bf16 values (within an ulp of each term: the kernel rounds once)."""
    geometry = QWEN3_5_35B_A3B
    logits = torch.randn(num_tokens, geometry["num_experts"], generator=torch_generator).to("cuda", torch.bfloat16)
    weights, ids = kernels.moe_route(logits, geometry["top_k"], True)
    want_weights, want_ids = reference.moe_route(logits, geometry["top_k"], True)
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    assert torch.allclose(weights.float(), want_weights.float(), rtol=8e-3, atol=0)
    with_gate = torch.cat([logits, torch.randn(num_tokens, 1, generator=torch_generator).to("cuda", logits.dtype)], 1)
    stacked_weights, stacked_ids = kernels.moe_route(with_gate, geometry["top_k"], True, shared_expert=True)
    assert torch.equal(stacked_ids[:, :-1], ids) and (stacked_ids[:, -1] == geometry["num_experts"]).all()
    assert torch.equal(stacked_weights[:, :-1], weights)
    assert torch.allclose(stacked_weights[:, -1:].float(), torch.sigmoid(with_gate[:, -1:]).float(), rtol=8e-3, atol=0)
    inputs = moe_inputs(num_tokens, geometry["num_experts"], geometry["top_k"], geometry["hidden_size"],
                        geometry["intermediate_size"], torch_generator, dtype=torch.bfloat16, device="cuda")
    inputs.update(topk_weights=weights, topk_ids=ids)
    shared = torch.randn(num_tokens, geometry["hidden_size"], generator=torch_generator).to("cuda", torch.bfloat16)
    gate = torch.randn(num_tokens, 1, generator=torch_generator).to("cuda", torch.bfloat16)
    routed = kernels.fused_moe(**inputs)
    got = kernels.fused_moe(**inputs, shared_gate=gate, shared=shared)
    product = torch.sigmoid(gate) * shared
    unfused = routed + product
    ulps = 4 * torch.finfo(torch.bfloat16).eps * (routed.abs() + product.abs())
    assert ((got - unfused).abs() <= ulps).all()


# ---- the router and the gated shared expert ------------------------------------------------------------------------

def test_reference_route_is_the_softmax_top_k_renormalised_in_float32(torch_generator):
    logits = torch.randn(6, 10, generator=torch_generator).to(torch.bfloat16)
    weights, ids = reference.moe_route(logits, 3, renormalise=True)
    probabilities = logits.float().softmax(-1)
    assert ids.dtype == torch.int64 and weights.dtype == torch.bfloat16
    for token in range(6):
        order = sorted(range(10), key=lambda e: -float(probabilities[token, e]))[:3]
        assert ids[token].tolist() == order
        chosen = probabilities[token, order]
        assert torch.equal(weights[token], (chosen / chosen.sum()).to(torch.bfloat16))
    plain, _ = reference.moe_route(logits, 3, renormalise=False)
    assert torch.equal(plain, probabilities.topk(3, dim=-1).values.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"top_k in \[1, experts\]"):
        reference.moe_route(logits, 11, renormalise=True)


def test_reference_adds_the_gated_shared_expert_as_the_model_did(torch_generator):
    inputs = moe_inputs(5, 4, 2, 16, 8, torch_generator, dtype=torch.bfloat16)
    shared = torch.randn(5, 16, generator=torch_generator).to(torch.bfloat16)
    gate = torch.randn(5, 1, generator=torch_generator).to(torch.bfloat16)
    routed = reference.fused_moe(**inputs)
    got = reference.fused_moe(**inputs, shared_gate=gate, shared=shared)
    assert torch.equal(got, routed + torch.sigmoid(gate) * shared)
    with pytest.raises(ValueError, match="come together"):
        reference.fused_moe(**inputs, shared=shared)
    with pytest.raises(ValueError, match=r"must be \(5, 16\) and \[5, 1\]"):
        reference.fused_moe(**inputs, shared_gate=gate[:4], shared=shared)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts,top_k,renormalise", [(12, 3, True), (8, 8, True), (40, 5, False), (7, 1, True)])
def test_triton_route_picks_the_references_experts_and_weights(torch_generator, dtype, num_experts, top_k,
                                                             renormalise):
    pytest.importorskip("triton")
    from hybridkv.kernels import moe

    logits = (3 * torch.randn(9, num_experts, generator=torch_generator)).to(dtype)
    weights, ids = moe.moe_route(logits, top_k, renormalise)
    want_weights, want_ids = reference.moe_route(logits, top_k, renormalise)
    # bfloat16 logits tie now and then, and torch.topk orders equals as it likes: the same logits, in the same
    # order, must have been chosen; where none tie, the same experts.
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    untied = torch.tensor([len(set(row.tolist())) == num_experts for row in logits])
    assert torch.equal(ids[untied], want_ids[untied]) and untied.any()
    assert weights.dtype == dtype and torch.allclose(weights.float(), want_weights.float(), rtol=1e-5 if dtype ==
                                                     torch.float32 else 8e-3, atol=0)
    empty_weights, empty_ids = moe.moe_route(logits[:0], top_k, renormalise)
    assert empty_weights.shape == empty_ids.shape == (0, top_k)


def test_reference_route_with_the_shared_gate_adds_expert_e_weighted_by_its_sigmoid(torch_generator):
    logits = torch.randn(5, 9, generator=torch_generator).to(torch.bfloat16)  # 8 experts, then the shared gate
    weights, ids = reference.moe_route(logits, 3, renormalise=True, shared_expert=True)
    routed_weights, routed_ids = reference.moe_route(logits[:, :8], 3, renormalise=True)
    assert weights.shape == ids.shape == (5, 4)
    assert torch.equal(ids[:, :3], routed_ids) and (ids[:, 3] == 8).all()
    assert torch.equal(weights[:, :3], routed_weights)
    assert torch.equal(weights[:, 3:], torch.sigmoid(logits[:, 8:]))
    with pytest.raises(ValueError, match=r"experts \+ 1 \(the shared expert's gate\)\] with top_k in \[1, experts\]"):
        reference.moe_route(logits, 9, renormalise=True, shared_expert=True)


def test_the_shared_expert_as_one_more_expert_is_the_gated_shared_expert(torch_generator):
    """Routing to the shared expert stacked as expert E, weighted by sigmoid(gate), computes what adding the gated
    shared expert does (float64, so only the association of the sums differs)."""
    num_experts, top_k, hidden_size, intermediate = 6, 2, 16, 8
    inputs = moe_inputs(5, num_experts + 1, top_k, hidden_size, intermediate, torch_generator, dtype=torch.float64)
    logits = torch.randn(5, num_experts + 1, generator=torch_generator, dtype=torch.float64)
    weights, ids = reference.moe_route(logits, top_k, renormalise=True, shared_expert=True)
    stacked = reference.fused_moe(inputs["hidden"], inputs["w13"], inputs["w2"], weights, ids)
    routed_weights, routed_ids = reference.moe_route(logits[:, :-1], top_k, renormalise=True)
    w13, w2 = inputs["w13"], inputs["w2"]
    gate, up = (inputs["hidden"] @ w13[-1].T).chunk(2, dim=-1)
    shared = (torch.nn.functional.silu(gate) * up) @ w2[-1].T
    separate = reference.fused_moe(inputs["hidden"], w13[:-1], w2[:-1], routed_weights, routed_ids,
                                   shared_gate=logits[:, -1:], shared=shared)
    torch.testing.assert_close(stacked, separate, rtol=1e-12, atol=1e-12)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_route_with_the_shared_gate_matches_the_reference(torch_generator, dtype):
    pytest.importorskip("triton")
    from hybridkv.kernels import moe

    logits = (3 * torch.randn(7, 13, generator=torch_generator)).to(dtype)  # 12 experts and the gate
    weights, ids = moe.moe_route(logits, 3, True, shared_expert=True)
    want_weights, want_ids = reference.moe_route(logits, 3, True, shared_expert=True)
    assert ids.shape == (7, 4) and (ids[:, 3] == 12).all()
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    assert torch.allclose(weights.float(), want_weights.float(), rtol=1e-5 if dtype == torch.float32 else 8e-3,
                          atol=0)
    empty_weights, empty_ids = moe.moe_route(logits[:0], 3, True, shared_expert=True)
    assert empty_weights.shape == empty_ids.shape == (0, 4)


@interpreter_only
@pytest.mark.parametrize("num_tokens", [1, 4])
@pytest.mark.parametrize("shared_expert,renormalise,dtype", [(True, True, torch.bfloat16), (False, False,
                                                                                             torch.float32)])
def test_triton_routed_moe_routes_one_token_inside_both_kernels_as_the_reference(
        torch_generator, num_tokens, shared_expert, renormalise, dtype):
    """One token is routed by every program of the gate/up and down kernels; more take the router launch. Both
    equal the reference's route then experts."""
    pytest.importorskip("triton")
    from hybridkv.kernels import moe

    num_experts, top_k = 10, 3
    stack = num_experts + shared_expert
    inputs = moe_inputs(num_tokens, stack, top_k, 48, 40, torch_generator, dtype=dtype)
    logits = (2 * torch.randn(num_tokens, stack, generator=torch_generator)).to(dtype)
    got = moe.routed_moe(inputs["hidden"], logits, inputs["w13"], inputs["w2"], top_k, renormalise, shared_expert)
    want = reference.routed_moe(inputs["hidden"], logits, inputs["w13"], inputs["w2"], top_k, renormalise,
                                shared_expert)
    assert got.dtype == dtype and rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)
    scaled = fp8_experts(inputs, scale_block=128)
    scales = {key: scaled[key] for key in ("w13_scale", "w2_scale", "scale_block")}
    got = moe.routed_moe(inputs["hidden"], logits, scaled["w13"], scaled["w2"], top_k, renormalise, shared_expert,
                         **scales)
    want = reference.routed_moe(inputs["hidden"], logits, scaled["w13"], scaled["w2"], top_k, renormalise,
                                shared_expert, **scales)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)
    with pytest.raises(ValueError, match=r"must be \[1, \d+\] for one token"):
        moe.routed_moe(inputs["hidden"][:1], logits[:1, :-1], inputs["w13"], inputs["w2"], top_k, renormalise,
                       shared_expert)


@interpreter_only
def test_triton_route_breaks_ties_toward_the_lower_expert():
    pytest.importorskip("triton")
    from hybridkv.kernels import moe

    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]])
    weights, ids = moe.moe_route(logits, 4, renormalise=False)
    assert ids.tolist() == [[1, 3, 4, 2]]
    assert weights[0, 0] == weights[0, 1] == weights[0, 2] > weights[0, 3]


@interpreter_only
@pytest.mark.parametrize("num_tokens", [1, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_adds_the_gated_shared_expert_in_its_final_reduction(torch_generator, num_tokens, dtype):
    """The final reduction adds sigmoid(gate) * shared in float32 and rounds once, where the unfused torch ops round
    the gate, the product and the sum: with the shared expert it equals the same kernel's routed output plus the
    reference's addition to within an ulp of each term. One token's down projection makes that reduction itself."""
    pytest.importorskip("triton")
    from hybridkv.kernels import moe

    inputs = moe_inputs(num_tokens, 6, 2, 40, 24, torch_generator, dtype=dtype)
    shared = torch.randn(num_tokens, 40, generator=torch_generator).to(dtype)
    gate = (2 * torch.randn(num_tokens, 1, generator=torch_generator)).to(dtype)
    launch = moe.MoeLaunch(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
    routed = moe.fused_moe(**inputs, launch=launch)
    got = moe.fused_moe(**inputs, launch=launch, shared_gate=gate, shared=shared)
    product = torch.sigmoid(gate) * shared
    unfused = routed + product
    ulps = 4 * torch.finfo(dtype).eps * (routed.abs() + product.abs())
    assert ((got - unfused).abs() <= ulps).all()
    want = reference.fused_moe(**inputs, shared_gate=gate, shared=shared)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)
