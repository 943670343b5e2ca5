"""The plain-torch kernel references against independent oracles: transformers' own torch GDN and conv functions
(with fla hidden so it uses them) and torch's softmax attention on contiguous K/V."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from hybridkv.kernels import reference  # noqa: E402
from hybridkv.kernels.inputs import (  # noqa: E402
    AttentionGeometry,
    GdnGeometry,
    conv_weight,
    cu_seqlens_of,
    gdn_step_inputs,
    paged_attention_inputs,
    state_pools,
)

GEOMETRY = GdnGeometry(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)


@pytest.fixture(scope="module")
def hf():
    """transformers' Qwen3.5 module with fla hidden, so its torch fallbacks are what it binds."""
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name == "fla" or name.startswith("fla.")}
    saved_hf = sys.modules.pop("transformers.models.qwen3_5.modeling_qwen3_5", None)
    sys.modules["fla"] = None
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5

        yield modeling_qwen3_5
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)
        # Later importers get transformers' module as it binds with fla visible again.
        sys.modules.pop("transformers.models.qwen3_5.modeling_qwen3_5", None)
        if saved_hf is not None:
            sys.modules["transformers.models.qwen3_5.modeling_qwen3_5"] = saved_hf


def model_gates(a, b, A_log, dt_bias):
    """The gating exactly as Qwen3_5GatedDeltaNet.forward writes it."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.float().sigmoid()


def split_heads(qkv, geometry: GdnGeometry):
    hk = geometry.num_k_heads * geometry.head_k_dim
    rows = qkv.shape[0]
    q = qkv[:, :hk].reshape(rows, geometry.num_k_heads, geometry.head_k_dim)
    k = qkv[:, hk : 2 * hk].reshape(rows, geometry.num_k_heads, geometry.head_k_dim)
    v = qkv[:, 2 * hk :].reshape(rows, geometry.num_v_heads, geometry.head_v_dim)
    return q, k, v


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def same_bits(x, y) -> bool:
    return torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_gdn_decode_reference_matches_transformers_recurrence(hf, torch_generator):
    slots = 6
    _, pool = state_pools(GEOMETRY, slots, torch_generator)
    before = pool.clone()
    slot_ids = torch.tensor([4, 0, 2, 5], dtype=torch.int32)
    inputs = gdn_step_inputs(GEOMETRY, len(slot_ids), torch_generator, dtype=torch.float32)
    o = reference.gdn_decode(**inputs, ssm_state=pool, slot_ids=slot_ids, num_k_heads=2, head_k_dim=16, head_v_dim=8)

    g, beta = model_gates(inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"])
    q, k, v = split_heads(inputs["qkv"], GEOMETRY)
    for row, slot in enumerate(slot_ids.tolist()):
        if slot == 0:
            assert torch.count_nonzero(o[row]) == 0
            continue
        want_o, want_state = hf.torch_recurrent_gated_delta_rule(
            q[row][None, None], k[row][None, None], v[row][None, None], g[row][None, None], beta[row][None, None],
            initial_state=before[slot].transpose(-1, -2)[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        assert rel_err(o[row], want_o[0, 0]) < 1e-5
        assert rel_err(pool[slot], want_state[0].transpose(-1, -2)) < 1e-5
    for slot in (0, 1, 3):  # slots nobody named keep every bit, NaN-filled null slot included
        assert same_bits(pool[slot], before[slot])


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_gdn_prefill_reference_matches_transformers_chunked_and_recurrent_forms(hf, torch_generator, ssm_dtype):
    lengths = [70, 1, 5, 9]  # crosses a 64-token chunk boundary; one request on the null slot
    slot_ids = torch.tensor([3, 1, 0, 2], dtype=torch.int32)
    _, pool = state_pools(GEOMETRY, 4, torch_generator, ssm_dtype=ssm_dtype)
    before = pool.clone()
    inputs = gdn_step_inputs(GEOMETRY, sum(lengths), torch_generator, dtype=torch.float32)
    cu = cu_seqlens_of(lengths)
    o = reference.gdn_prefill(**inputs, ssm_state=pool, slot_ids=slot_ids, cu_seqlens=cu, num_k_heads=2,
                              head_k_dim=16, head_v_dim=8)

    g, beta = model_gates(inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"])
    q, k, v = split_heads(inputs["qkv"], GEOMETRY)
    bounds = cu.tolist()
    for n, slot in enumerate(slot_ids.tolist()):
        s, e = bounds[n], bounds[n + 1]
        if slot == 0:
            assert torch.count_nonzero(o[s:e]) == 0
            assert same_bits(pool[0], before[0])
            continue
        h0 = before[slot].float().transpose(-1, -2)[None]
        for oracle in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
            want_o, want_state = oracle(
                q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e], initial_state=h0,
                output_final_state=True, use_qk_l2norm_in_kernel=True,
            )
            assert rel_err(o[s:e], want_o[0]) < 1e-5
            tolerance = 1e-5 if ssm_dtype == torch.float32 else 1e-2
            assert rel_err(pool[slot], want_state[0].transpose(-1, -2)) < tolerance
    assert same_bits(pool[4], before[4])


def test_conv1d_references_match_transformers(hf, torch_generator):
    conv_state, _ = state_pools(GEOMETRY, 5, torch_generator, conv_dtype=torch.float32)
    before = conv_state.clone()
    weight = conv_weight(GEOMETRY, torch_generator, dtype=torch.float32)
    lengths = [6, 2, 1, 3]  # 2 and 1 are shorter than the W-1 history: the new state mixes old and new inputs
    slot_ids = torch.tensor([2, 5, 1, 0], dtype=torch.int32)
    x = torch.randn(sum(lengths), GEOMETRY.conv_dim, generator=torch_generator)
    y = reference.causal_conv1d_prefill(x, weight, conv_state, slot_ids, cu_seqlens_of(lengths))
    start = 0
    for length, slot in zip(lengths, slot_ids.tolist()):
        chunk = y[start : start + length]
        if slot == 0:
            assert torch.count_nonzero(chunk) == 0
        else:
            oracle_state = before[slot][None].clone()
            want = hf.causal_conv1d_update(x[start : start + length].t()[None], oracle_state, weight, None, "silu")
            assert rel_err(chunk, want[0].t()) < 1e-6
            assert torch.allclose(conv_state[slot], oracle_state[0])
        start += length
    assert same_bits(conv_state[0], before[0]) and same_bits(conv_state[3], before[3])
    assert same_bits(conv_state[4], before[4])

    # A fresh request (zero history) is the plain causal conv with zero left padding.
    conv_state[3] = 0
    fresh = reference.causal_conv1d_prefill(x[:6], weight, conv_state, torch.tensor([3], dtype=torch.int32),
                                            cu_seqlens_of([6]))
    assert rel_err(fresh, hf.causal_conv1d_fn(x[:6].t()[None], weight, None, "silu")[0].t()) < 1e-6

    decode_slots = torch.tensor([1, 0, 4], dtype=torch.int32)
    xd = torch.randn(3, GEOMETRY.conv_dim, generator=torch_generator)
    snapshot = conv_state.clone()
    yd = reference.causal_conv1d_decode(xd, weight, conv_state, decode_slots)
    for row, slot in enumerate(decode_slots.tolist()):
        if slot == 0:
            assert torch.count_nonzero(yd[row]) == 0
            continue
        oracle_state = snapshot[slot][None].clone()
        want = hf.causal_conv1d_update(xd[row][None, :, None], oracle_state, weight, None, "silu")
        assert rel_err(yd[row], want[0, :, 0]) < 1e-6
        assert torch.equal(conv_state[slot], oracle_state[0])
    assert same_bits(conv_state[0], snapshot[0])


def test_write_kv_cache_reference_stores_each_token_at_its_slot_only(torch_generator):
    geometry = AttentionGeometry(num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    pool = paged_attention_inputs(geometry, [9], [1], torch_generator, dtype=torch.float32)
    k_cache, v_cache = pool["k_cache"], pool["v_cache"]
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k = torch.randn(4, 2, 8, generator=torch_generator)
    v = torch.randn(4, 2, 8, generator=torch_generator)
    slot_mapping = torch.tensor([9, -1, 2, 13], dtype=torch.int64)  # -1 padding, 2 in the null block: both skipped
    reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(v_cache[3, 1], v[3])
    changed = (~(k_cache.view(torch.int32) == before_k.view(torch.int32))).any(-1).any(-1).nonzero().tolist()
    assert changed == [[2, 1], [3, 1]]
    assert same_bits(v_cache[0], before_v[0])


@pytest.mark.parametrize("q_lens,seq_lens", [([1, 1, 1], [1, 17, 40]), ([5, 16, 3], [5, 37, 3])])
def test_paged_attention_reference_matches_contiguous_softmax_attention(torch_generator, q_lens, seq_lens):
    geometry = AttentionGeometry(num_q_heads=6, num_kv_heads=2, head_dim=16, block_size=4)
    inputs = paged_attention_inputs(geometry, seq_lens, q_lens, torch_generator, dtype=torch.float32)
    o = reference.paged_attention(**inputs)
    bounds = inputs["cu_seqlens_q"].tolist()
    for n, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        # Contiguous K/V read page by page with plain Python indexing.
        pages = [inputs["block_tables"][n, p // 4].item() for p in range(seq_len)]
        keys = torch.stack([inputs["k_cache"][blk, p % 4] for p, blk in enumerate(pages)])
        values = torch.stack([inputs["v_cache"][blk, p % 4] for p, blk in enumerate(pages)])
        q = inputs["q"][bounds[n] : bounds[n + 1]]
        allowed = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
        want = F.scaled_dot_product_attention(
            q.transpose(0, 1).double(), keys.transpose(0, 1).double(), values.transpose(0, 1).double(),
            attn_mask=allowed, scale=inputs["scale"], enable_gqa=True,
        ).transpose(0, 1)
        assert rel_err(o[bounds[n] : bounds[n + 1]], want) < 1e-5


def test_fp8_pools_hold_each_value_over_its_scale_rounded_to_e4m3_and_saturated(torch_generator):
    """The definition: a stored element is the e4m3 value nearest k / k_scale (3 mantissa bits: within 1/16 of it),
    clipped to ±448; reading it back multiplies by the scale."""
    geometry = AttentionGeometry(num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    pool = paged_attention_inputs(geometry, [9], [1], torch_generator, kv_dtype=torch.float8_e4m3fn)
    k = torch.randn(3, 2, 8, generator=torch_generator, dtype=torch.float64).to(torch.bfloat16)
    v = torch.randn(3, 2, 8, generator=torch_generator, dtype=torch.float64).to(torch.bfloat16)
    k[0, 0, 0], v[2, 1, 3] = 1000.0, -1000.0  # beyond 448 × scale: saturates instead of becoming NaN
    k_scale, v_scale = 0.5, 0.25
    reference.write_kv_cache(k, v, pool["k_cache"], pool["v_cache"], torch.tensor([4, 5, 13]), k_scale, v_scale)
    stored_k = pool["k_cache"].view(-1, 2, 8)[[4, 5, 13]].double()
    stored_v = pool["v_cache"].view(-1, 2, 8)[[4, 5, 13]].double()
    assert stored_k[0, 0, 0] == 448.0 and stored_v[2, 1, 3] == -448.0
    for stored, x, scale in ((stored_k, k, k_scale), (stored_v, v, v_scale)):
        exact = (x.double() / scale).clamp(-448, 448)
        assert torch.isfinite(stored).all()
        assert ((stored - exact).abs() <= exact.abs() / 16 + 2.0**-10).all()


def test_paged_attention_reference_over_fp8_pools_is_attention_over_the_dequantized_pools(torch_generator):
    geometry = AttentionGeometry(num_q_heads=6, num_kv_heads=2, head_dim=16, block_size=4)
    inputs = paged_attention_inputs(geometry, [5, 37], [5, 3], torch_generator, dtype=torch.float32,
                                    kv_dtype=torch.float8_e4m3fn)
    k_scale, v_scale = 0.125, 3.0
    got = reference.paged_attention(**inputs, k_scale=k_scale, v_scale=v_scale)
    dequantized = {**inputs, "k_cache": inputs["k_cache"].float() * k_scale,
                   "v_cache": inputs["v_cache"].float() * v_scale}
    assert rel_err(got, reference.paged_attention(**dequantized)) < 1e-6
