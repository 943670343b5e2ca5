"""The kernels on a CUDA GPU at real sizes (HV 32 and 48, K = V = 128, up to 32k tokens and 1024 requests, head_dim
256) against the references run in float64 on the same GPU. Run with `scripts/gpu.sh tests/test_kernels_gpu.py`."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from kernel_checks import changed_unnamed_slots, poisoned_allocations, rel_err, same_bits  # noqa: E402

pytestmark = pytest.mark.gpu  # CPU runs deselect these (addopts "-m 'not gpu'")

from hybridkv import kernels  # noqa: E402
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

DEVICE = "cuda"
# bf16 outputs against a float64 reference (bf16 operands land between 1e-3 and 1e-2 relative error).
BF16_BOUND = 1e-2
FP32_STATE_BOUND = 1e-4


def geometry(num_v_heads: int) -> GdnGeometry:
    return GdnGeometry(num_k_heads=16, num_v_heads=num_v_heads, head_k_dim=128, head_v_dim=128)


def heads(geo: GdnGeometry) -> dict:
    return {"num_k_heads": geo.num_k_heads, "head_k_dim": geo.head_k_dim, "head_v_dim": geo.head_v_dim}


def as_float64(inputs: dict) -> dict:
    return {name: t.double() for name, t in inputs.items()}


def random_slots(count: int, slots: int, generator, null_rows: int = 0) -> torch.Tensor:
    chosen = (torch.randperm(slots, generator=generator)[:count] + 1).to(torch.int32)
    chosen[: min(null_rows, count)] = 0
    return chosen[torch.randperm(count, generator=generator)].to(DEVICE)


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 64, 1024])
@pytest.mark.parametrize("num_v_heads", [32, 48])
def test_gdn_decode_at_real_sizes(torch_generator, num_v_heads, batch, ssm_dtype):
    geo = geometry(num_v_heads)
    slots = batch + 3
    _, pool = state_pools(geo, slots, torch_generator, device=DEVICE, ssm_dtype=ssm_dtype)
    slot_ids = random_slots(batch, slots, torch_generator, null_rows=1 if batch > 1 else 0)
    inputs = gdn_step_inputs(geo, batch, torch_generator, device=DEVICE)
    before = pool.clone()
    with poisoned_allocations():
        o = kernels.gdn_decode(**inputs, ssm_state=pool, slot_ids=slot_ids, **heads(geo))
    torch.cuda.synchronize()
    ref_pool = before.double()
    want = reference.gdn_decode(**as_float64(inputs), ssm_state=ref_pool, slot_ids=slot_ids, **heads(geo))
    live = [s for s in slot_ids.tolist() if s]
    assert rel_err(o, want) < BF16_BOUND
    assert torch.count_nonzero(o[slot_ids == 0]) == 0
    state_bound = FP32_STATE_BOUND if ssm_dtype == torch.float32 else BF16_BOUND
    assert rel_err(pool[live], ref_pool[live]) < state_bound
    assert changed_unnamed_slots(before, pool, live) == []


@pytest.mark.parametrize(
    "num_v_heads,lengths",
    [(32, [32768]), (48, [32768]), (32, [4096, 1, 700, 3000, 64, 65, 129, 2000]), (48, [5000, 63, 1, 8000, 777])],
)
def test_gdn_prefill_and_conv_at_real_sizes(torch_generator, num_v_heads, lengths):
    geo = geometry(num_v_heads)
    slots = len(lengths) + 2
    conv_state, pool = state_pools(geo, slots, torch_generator, device=DEVICE)
    slot_ids = random_slots(len(lengths), slots, torch_generator, null_rows=1 if len(lengths) > 1 else 0)
    cu = cu_seqlens_of(lengths, DEVICE)
    weight = conv_weight(geo, torch_generator, device=DEVICE)
    inputs = gdn_step_inputs(geo, sum(lengths), torch_generator, device=DEVICE)
    conv_before, pool_before = conv_state.clone(), pool.clone()
    with poisoned_allocations():
        y = kernels.causal_conv1d_prefill(inputs["qkv"], weight, conv_state, slot_ids, cu)
        o = kernels.gdn_prefill(y, inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"], pool, slot_ids, cu,
                                **heads(geo), cu_seqlens_cpu=cu.tolist())
    torch.cuda.synchronize()
    live = [s for s in slot_ids.tolist() if s]

    ref_conv = conv_before.clone()
    want_y = reference.causal_conv1d_prefill(inputs["qkv"].double(), weight.double(), ref_conv, slot_ids, cu)
    assert rel_err(y, want_y) < BF16_BOUND
    assert same_bits(conv_state, ref_conv)
    assert changed_unnamed_slots(conv_before, conv_state, live) == []

    ref_pool = pool_before.double()
    want_o = reference.gdn_prefill(y.double(), inputs["a"].double(), inputs["b"].double(), inputs["A_log"].double(),
                                   inputs["dt_bias"].double(), ref_pool, slot_ids, cu, **heads(geo))
    errors = {"o": rel_err(o, want_o), "state": rel_err(pool[live], ref_pool[live])}
    print(f"prefill HV={num_v_heads} lengths={lengths}: relative errors {errors}")
    assert errors["o"] < BF16_BOUND and errors["state"] < BF16_BOUND
    assert changed_unnamed_slots(pool_before, pool, live) == []

    # The layer's fused path (conv inside the input pass) on the same raw inputs and starting states.
    fused_conv, fused_pool = conv_before.clone(), pool_before.clone()
    gates = {name: inputs[name] for name in ("a", "b", "A_log", "dt_bias")}
    with poisoned_allocations():
        fused_o = kernels.conv_gdn_prefill(inputs["qkv"], weight, fused_conv, **gates, ssm_state=fused_pool,
                                           slot_ids=slot_ids, cu_seqlens=cu, **heads(geo), cu_seqlens_cpu=cu.tolist())
    torch.cuda.synchronize()
    ref_fused_conv, ref_fused_pool = conv_before.clone(), pool_before.double()
    want_fused = reference.conv_gdn_prefill(inputs["qkv"].double(), weight.double(), ref_fused_conv,
                                            **as_float64(gates), ssm_state=ref_fused_pool, slot_ids=slot_ids,
                                            cu_seqlens=cu, **heads(geo))
    fused_errors = {"o": rel_err(fused_o, want_fused), "state": rel_err(fused_pool[live], ref_fused_pool[live])}
    print(f"fused prefill HV={num_v_heads} lengths={lengths}: relative errors {fused_errors}")
    assert fused_errors["o"] < BF16_BOUND and fused_errors["state"] < BF16_BOUND
    assert same_bits(fused_conv, ref_conv)
    assert changed_unnamed_slots(pool_before, fused_pool, live) == []


def float64_state_pass(k, v, A, beta, g_cumsum, initial, bounds: list[int]):
    """The state pass replayed in float64 from the same inputs (A's lower triangles, the WY form formed explicitly):
    v_new `[T, HV, V]` and each sequence's final state `[N, HV, V, K]`, from `initial` `[N, HV, V, K]`."""
    from hybridkv.kernels import fla_adapter

    group = v.shape[1] // k.shape[1]
    v_new = torch.empty(v.shape, dtype=torch.float64, device=v.device)
    finals = []
    for n in range(len(bounds) - 1):
        state = initial[n].double().transpose(-1, -2)  # [HV, K, V]
        for s in range(bounds[n], bounds[n + 1], fla_adapter.FLA_CHUNK_TOKENS):
            e = min(s + fla_adapter.FLA_CHUNK_TOKENS, bounds[n + 1])
            kc = k[s:e].double().repeat_interleave(group, 1).transpose(0, 1)
            inverse = A[s:e, :, : e - s].double().transpose(0, 1).tril()
            bc, gcum = beta[s:e].double().t()[..., None], g_cumsum[s:e].double().t() / fla_adapter.RCP_LN2
            u = inverse @ (bc * v[s:e].double().transpose(0, 1))
            w = inverse @ (bc * kc * gcum.exp()[..., None])
            chunk_v_new = u - w @ state
            v_new[s:e] = chunk_v_new.transpose(0, 1)
            state = reference.chunk_state_update(state, kc, chunk_v_new, gcum)
        finals.append(state.transpose(-1, -2))
    return v_new, torch.stack(finals)


def fla_state_pass(k, v, g_cumsum, beta, initial, bounds):
    """fla's intra-chunk stage and chunk-state stage on dense initial states -> (w, u, A, h, v_new, final states)."""
    from hybridkv.kernels.fla_adapter import anchor

    w, u, A = anchor("chunk_gated_delta_rule_fwd_intra")(k=k[None], v=v[None], g=g_cumsum[None], beta=beta[None],
                                                         cu_seqlens=bounds[0], chunk_indices=bounds[1])
    h, v_new, final = anchor("chunk_gated_delta_rule_fwd_h")(
        k=k[None], w=w, u=u, g=g_cumsum[None], initial_state=initial, output_final_state=True, state_v_first=True,
        cu_seqlens=bounds[0], chunk_indices=bounds[1], chunk_offsets=bounds[2])
    return w[0], u[0], A[0], h[0], v_new[0], final


def check_state_passes(k, v, g_cumsum, beta, pool, slot_ids, lengths, bounds, configs, label):
    """fla's kkt-and-solve kernel on an unfilled buffer writes every entry the WY-form pass and the folded pass
    read (the lower triangles, bit for bit as in fla's own zero-filled intra stage), and the WY-form pass gives
    fla's w and u from it. Both state passes (the one from w and u fed ours), in each launch configuration,
    give fla's h, v_new and final states within the bf16 bound and, with bf16 operands, come within twice fla's
    distance from a float64 replay of the same inputs; slots not named keep their bytes."""
    from hybridkv.kernels import fla_adapter, gdn_state, gdn_wy

    live = [s for s in slot_ids.tolist() if s]
    dense = torch.where(slot_ids[:, None, None, None] != 0, pool[slot_ids.long()].float(), 0.0)
    w, u, fla_A, fla_h, fla_v_new, fla_final = fla_state_pass(k, v, g_cumsum, beta, dense, bounds)
    with poisoned_allocations():
        A = fla_adapter.kkt_solve(k, g_cumsum, beta, bounds)
    chunk_tokens = fla_adapter.FLA_CHUNK_TOKENS
    lower = torch.ones(chunk_tokens, chunk_tokens, dtype=torch.bool, device=DEVICE).tril()
    chunk_rows = torch.cat([torch.arange(n, device=DEVICE) % chunk_tokens for n in lengths])
    read = lower[chunk_rows][:, None, :].expand_as(A)  # row t of a chunk reads columns 0..t
    assert same_bits(A[read], fla_A[read])
    with poisoned_allocations():
        our_w, our_u = gdn_wy.wy_form(k, v, A, beta, g_cumsum, bounds)
    wy_errors = {"w": rel_err(our_w, w), "u": rel_err(our_u, u)}
    print(f"WY form {label}: against fla's {wy_errors}")
    assert max(wy_errors.values()) < BF16_BOUND
    want_v_new, want_final = float64_state_pass(k, v, A, beta, g_cumsum, dense, bounds[0].tolist())
    fla_errors = {"v_new": rel_err(fla_v_new, want_v_new), "final": rel_err(fla_final[slot_ids != 0],
                                                                             want_final[slot_ids != 0])}
    passes = {"from w, u": lambda state_pool, config: gdn_state.chunk_states(k, our_w, our_u, g_cumsum, state_pool,
                                                                              slot_ids, bounds, config),
              "folded": lambda state_pool, config: gdn_state.folded_chunk_states(k, v, A, beta, g_cumsum, state_pool,
                                                                                 slot_ids, bounds, config)}
    for (name, state_pass), config in itertools.product(passes.items(), configs):
        state_pool = pool.clone()
        with poisoned_allocations():
            h, v_new = state_pass(state_pool, config)
        torch.cuda.synchronize()
        final = state_pool[live]
        against_fla = {"h": rel_err(h, fla_h), "v_new": rel_err(v_new, fla_v_new),
                       "final": rel_err(final, fla_final[slot_ids != 0].to(pool.dtype))}
        errors = {"v_new": rel_err(v_new, want_v_new), "final": rel_err(final, want_final[slot_ids != 0])}
        print(f"state pass {name} {config} {label}: against fla {against_fla}; against the float64 replay "
              f"{errors}, fla's {fla_errors}")
        assert max(against_fla.values()) < BF16_BOUND
        if k.dtype == torch.bfloat16:
            assert all(errors[e] <= 2 * fla_errors[e] + FP32_STATE_BOUND for e in errors)
        else:  # float32 operands multiply as tf32 here, where fla's stage may keep float32
            assert max(errors.values()) < BF16_BOUND
        assert changed_unnamed_slots(pool, state_pool, live) == []


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[32768], [4096, 1, 700, 3000, 64, 65, 129, 2000]])
def test_state_pass_in_the_pool_against_fla_and_the_path_equals_its_parts(torch_generator, lengths, ssm_dtype):
    """The state pass reads and writes the pool in place where fla's reads and writes dense copies, and forms the
    WY values itself from fla's solved A when folded: both passes against fla's intra and state stages on the same
    inputs in every launch configuration the rules pick from (`check_state_passes`), and the layer with fla's
    output stage against fla's whole `chunk_gated_delta_rule`. The input pass's chunk sums must match fla's, the
    layer's path must give the bits of its parts run one by one, and no other slot may change."""
    from hybridkv.kernels import fla_adapter, gdn_chunk, gdn_input, gdn_state, gdn_wy

    chunk_gated_delta_rule = fla_adapter.anchor("chunk_gated_delta_rule")
    chunk_local_cumsum = fla_adapter.anchor("chunk_local_cumsum")

    geo = geometry(32)
    slots = 2 * len(lengths) + 1
    conv_state, pool = state_pools(geo, slots, torch_generator, device=DEVICE, ssm_dtype=ssm_dtype)
    slot_ids = random_slots(len(lengths), slots, torch_generator, null_rows=1 if len(lengths) > 1 else 0)
    cu = cu_seqlens_of(lengths, DEVICE)
    weight = conv_weight(geo, torch_generator, device=DEVICE)
    inputs = gdn_step_inputs(geo, sum(lengths), torch_generator, device=DEVICE)
    gates = [inputs[name] for name in ("a", "b", "A_log", "dt_bias")]
    conv_before = conv_state.clone()
    scale = geo.head_k_dim**-0.5
    bounds = fla_adapter.chunk_bounds(tuple(cu.tolist()), torch.device(DEVICE))
    dense = torch.where(slot_ids[:, None, None, None] != 0, pool[slot_ids.long()].float(), 0.0)

    q, k, v, g, beta = gdn_input.prepare_prefill_inputs(inputs["qkv"], *gates, slot_ids, cu, **heads(geo),
                                                        conv=(weight, conv_state.clone()))
    fla_cumsum = chunk_local_cumsum(g[None], chunk_size=fla_adapter.FLA_CHUNK_TOKENS, scale=fla_adapter.RCP_LN2,
                                    cu_seqlens=bounds[0])[0]
    *_, g_cumsum, _ = gdn_input.prepare_prefill_inputs(inputs["qkv"], *gates, slot_ids, cu, **heads(geo),
                                                       conv=(weight, conv_state.clone()), gate_cumsum=True)
    assert rel_err(g_cumsum, fla_cumsum) < 1e-6

    # Every launch configuration the state pass picks from (by sequences and heads against multiprocessors).
    configs = ({"block_v": 32, "num_stages": 4}, {"block_v": 64, "num_stages": 3}, {"block_v": 64, "num_stages": 2})
    check_state_passes(k, v, g_cumsum, beta, pool, slot_ids, lengths, bounds, configs,
                               f"{len(lengths)} sequences, {ssm_dtype}")
    state_pool = pool.clone()
    multiprocessors = torch.cuda.get_device_properties().multi_processor_count
    A = fla_adapter.kkt_solve(k, g_cumsum, beta, bounds)
    if gdn_state.folds_wy_form(len(lengths), geo.num_v_heads, geo.head_v_dim, multiprocessors):
        h, v_new = gdn_state.folded_chunk_states(k, v, A, beta, g_cumsum, state_pool, slot_ids, bounds)
    else:
        w, u = gdn_wy.wy_form(k, v, A, beta, g_cumsum, bounds)
        h, v_new = gdn_state.chunk_states(k, w, u, g_cumsum, state_pool, slot_ids, bounds)

    fla_o, _ = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                                      initial_state=dense, output_final_state=True, state_v_first=True,
                                      cu_seqlens=bounds[0])
    parts_o = fla_adapter.output_stage(q, k, v_new, h, g_cumsum, scale, bounds)
    gdn_chunk.zero_null_sequences(parts_o, slot_ids, cu)
    prepare_conv = conv_before.clone()
    gdn_input.prepare_prefill_inputs(inputs["qkv"], *gates, slot_ids, cu, **heads(geo), conv=(weight, prepare_conv),
                                     gate_cumsum=True)
    o = kernels.conv_gdn_prefill(inputs["qkv"], weight, conv_state, *gates, pool, slot_ids, cu, **heads(geo),
                                 cu_seqlens_cpu=cu.tolist())
    torch.cuda.synchronize()
    assert same_bits(o, parts_o) and same_bits(conv_state, prepare_conv)
    assert same_bits(pool, state_pool)
    null_rows = torch.repeat_interleave(slot_ids == 0, torch.tensor(lengths, device=DEVICE))
    o_error = rel_err(o[~null_rows], fla_o[0][~null_rows])
    print(f"layer o against fla's chunk_gated_delta_rule: {o_error}")
    assert o_error < BF16_BOUND and torch.count_nonzero(o[null_rows]) == 0


@pytest.mark.parametrize("sequences,dtype", [(1, torch.bfloat16), (64, torch.bfloat16), (1, torch.float32)])
def test_state_pass_with_wide_heads_fits_and_matches_fla(torch_generator, sequences, dtype):
    """Heads of 256 (fla's widest) and float32 activations take a shallower pipeline so the tiles fit in shared
    memory, in both regimes of the launch rule, and still give fla's states."""
    from hybridkv.kernels import fla_adapter, gdn_input

    geo = GdnGeometry(num_k_heads=4, num_v_heads=8, head_k_dim=256, head_v_dim=256)
    lengths = [1000] * sequences
    _, pool = state_pools(geo, sequences, torch_generator, device=DEVICE)
    slot_ids = (torch.arange(sequences) + 1).to(DEVICE, torch.int32)
    cu = cu_seqlens_of(lengths, DEVICE)
    inputs = gdn_step_inputs(geo, sum(lengths), torch_generator, device=DEVICE, dtype=dtype)
    gates = [inputs[name] for name in ("a", "b", "A_log", "dt_bias")]
    _, k, v, g_cumsum, beta = gdn_input.prepare_prefill_inputs(inputs["qkv"], *gates, slot_ids, cu, **heads(geo),
                                                               gate_cumsum=True)
    bounds = fla_adapter.chunk_bounds(tuple(cu.tolist()), torch.device(DEVICE))
    check_state_passes(k, v, g_cumsum, beta, pool, slot_ids, lengths, bounds, [None],
                               f"K=V=256, {sequences} sequences, {dtype}")


def test_chunked_prefill_equals_one_pass_equals_decode_on_gpu(torch_generator):
    geo = geometry(32)
    length, decoded = 20000, 300
    inputs = gdn_step_inputs(geo, length + decoded, torch_generator, device=DEVICE)
    _, pool = state_pools(geo, 3, torch_generator, device=DEVICE)
    pool[1:] = 0
    one = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    two = torch.tensor([2], dtype=torch.int32, device=DEVICE)

    def rows(s, e):
        return {name: (t[s:e] if t.shape[0] == length + decoded else t) for name, t in inputs.items()}

    one_pass = kernels.gdn_prefill(**rows(0, length), ssm_state=pool, slot_ids=one,
                                   cu_seqlens=cu_seqlens_of([length], DEVICE), **heads(geo))
    pieces = [
        kernels.gdn_prefill(**rows(s, e), ssm_state=pool, slot_ids=two, cu_seqlens=cu_seqlens_of([e - s], DEVICE),
                            **heads(geo))
        for s, e in [(0, 8192), (8192, 8193), (8193, 13000), (13000, length)]
    ]
    assert rel_err(torch.cat(pieces), one_pass) < BF16_BOUND
    assert rel_err(pool[2], pool[1]) < BF16_BOUND

    # The decode kernel continues from the prefilled state exactly as a prefill over the same tokens would.
    steps = [kernels.gdn_decode(**rows(t, t + 1), ssm_state=pool, slot_ids=one, **heads(geo))
             for t in range(length, length + decoded)]
    tail = kernels.gdn_prefill(**rows(length, length + decoded), ssm_state=pool, slot_ids=two,
                               cu_seqlens=cu_seqlens_of([decoded], DEVICE), **heads(geo))
    assert rel_err(torch.cat(steps), tail) < BF16_BOUND
    assert rel_err(pool[1], pool[2]) < BF16_BOUND


@pytest.mark.parametrize("batch", [1, 64, 1024])
def test_conv1d_decode_at_real_sizes(torch_generator, batch):
    geo = geometry(48)
    slots = batch + 2
    conv_state, _ = state_pools(geo, slots, torch_generator, device=DEVICE)
    slot_ids = random_slots(batch, slots, torch_generator, null_rows=1 if batch > 1 else 0)
    weight = conv_weight(geo, torch_generator, device=DEVICE)
    x = torch.randn(batch, geo.conv_dim, generator=torch_generator).to(DEVICE, torch.bfloat16)
    before = conv_state.clone()
    with poisoned_allocations():
        y = kernels.causal_conv1d_decode(x, weight, conv_state, slot_ids)
    ref_state = before.clone()
    want = reference.causal_conv1d_decode(x.double(), weight.double(), ref_state, slot_ids)
    assert rel_err(y, want) < BF16_BOUND
    assert same_bits(conv_state, ref_state)


ATTENTION_CASES = [
    # (q heads, kv heads, seq_lens, q_lens): decode batches, then prefills on cached prefixes.
    (16, 4, [32768], [1]),
    (16, 4, "decode64", None),
    (24, 4, "decode1024", None),
    (16, 4, [8192, 3000, 17, 1], [2048, 3000, 1, 1]),
    (24, 4, [4096, 600], [4096, 100]),
]


@pytest.mark.parametrize("num_q_heads,num_kv_heads,seq_lens,q_lens", ATTENTION_CASES)
def test_paged_attention_at_real_sizes(torch_generator, num_q_heads, num_kv_heads, seq_lens, q_lens):
    if seq_lens == "decode64":
        seq_lens = torch.randint(1, 4097, (64,), generator=torch_generator).tolist()
        q_lens = [1] * 64
    elif seq_lens == "decode1024":
        seq_lens = torch.randint(1, 513, (1024,), generator=torch_generator).tolist()
        q_lens = [1] * 1024
    geo = AttentionGeometry(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=256, block_size=16)
    inputs = paged_attention_inputs(geo, seq_lens, q_lens, torch_generator, device=DEVICE)
    with poisoned_allocations():
        o = kernels.paged_attention(**inputs)
    want = reference.paged_attention(**{**inputs, "q": inputs["q"].double(), "k_cache": inputs["k_cache"].double(),
                                        "v_cache": inputs["v_cache"].double()})
    assert rel_err(o, want) < BF16_BOUND


def test_write_kv_cache_at_real_size(torch_generator):
    geo = AttentionGeometry(num_q_heads=16, num_kv_heads=4, head_dim=256, block_size=16)
    pool = paged_attention_inputs(geo, [32768], [1], torch_generator, device=DEVICE)
    tokens = 32768
    slot_mapping = (torch.randperm(tokens, generator=torch_generator) + 16).to(DEVICE)
    slot_mapping[::97] = -1
    k = torch.randn(tokens, 4, 256, generator=torch_generator).to(DEVICE, torch.bfloat16)
    v = torch.randn(tokens, 4, 256, generator=torch_generator).to(DEVICE, torch.bfloat16)
    ref_k, ref_v = pool["k_cache"].clone(), pool["v_cache"].clone()
    reference.write_kv_cache(k, v, ref_k, ref_v, slot_mapping)
    kernels.write_kv_cache(k, v, pool["k_cache"], pool["v_cache"], slot_mapping)
    assert same_bits(pool["k_cache"], ref_k) and same_bits(pool["v_cache"], ref_v)


FP8 = torch.float8_e4m3fn
# e4m3 K and V (3 mantissa bits) against float64 attention over the unquantized bf16 values: the reference alone is
# 3.7e-2 off at these shapes (measured in float64 on CPU); the kernel's bf16 q and summation order add under 1e-2.
FP8_KV_BOUND = 6e-2


@pytest.mark.parametrize("num_q_heads,num_kv_heads,seq_lens,q_lens", [ATTENTION_CASES[0], ATTENTION_CASES[1],
                                                                       ATTENTION_CASES[3]])
def test_paged_attention_over_fp8_pools_at_real_sizes(torch_generator, num_q_heads, num_kv_heads, seq_lens, q_lens):
    if seq_lens == "decode64":
        seq_lens = torch.randint(1, 4097, (64,), generator=torch_generator).tolist()
        q_lens = [1] * 64
    geo = AttentionGeometry(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=256, block_size=16)
    inputs = paged_attention_inputs(geo, seq_lens, q_lens, torch_generator, device=DEVICE)
    k_scale, v_scale = 0.02, 0.015  # K and V of unit scale use about 50 of e4m3's 448
    fp8 = dict(inputs)
    fp8["k_cache"], fp8["v_cache"] = ((pool.float() / scale).clamp(-448, 448).to(FP8)
                                      for pool, scale in ((inputs["k_cache"], k_scale), (inputs["v_cache"], v_scale)))
    with poisoned_allocations():
        o = kernels.paged_attention(**fp8, k_scale=k_scale, v_scale=v_scale)
    # The same fp8 pages dequantized in float64: only summation order and bf16 q separate the two.
    want = reference.paged_attention(**{**fp8, "q": inputs["q"].double()}, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(o, want) < BF16_BOUND
    unquantized = reference.paged_attention(**{**inputs, "q": inputs["q"].double(),
                                               "k_cache": inputs["k_cache"].double(),
                                               "v_cache": inputs["v_cache"].double()})
    assert rel_err(o, unquantized) < FP8_KV_BOUND


def test_write_kv_cache_to_fp8_pools_at_real_size(torch_generator):
    geo = AttentionGeometry(num_q_heads=16, num_kv_heads=4, head_dim=256, block_size=16)
    pool = paged_attention_inputs(geo, [32768], [1], torch_generator, device=DEVICE, kv_dtype=FP8)
    tokens = 32768
    slot_mapping = (torch.randperm(tokens, generator=torch_generator) + 16).to(DEVICE)
    slot_mapping[::97] = -1
    k = (torch.randn(tokens, 4, 256, generator=torch_generator) * 8).to(DEVICE, torch.bfloat16)
    v = (torch.randn(tokens, 4, 256, generator=torch_generator) * 8).to(DEVICE, torch.bfloat16)
    ref_k, ref_v = pool["k_cache"].clone(), pool["v_cache"].clone()
    reference.write_kv_cache(k, v, ref_k, ref_v, slot_mapping, 0.07, 0.05)  # 8-sigma values saturate
    kernels.write_kv_cache(k, v, pool["k_cache"], pool["v_cache"], slot_mapping, 0.07, 0.05)
    assert same_bits(pool["k_cache"], ref_k) and same_bits(pool["v_cache"], ref_v)


@pytest.mark.parametrize("batch", [1, 16])
def test_a_norm_prefetching_the_next_weights_gives_the_same_bits_as_without(torch_generator, batch):
    """The norm with its L2 prefetch programs (the 4B's GDN input projection, then its MLP) against the same launch
    without them: the extra programs only ask for bytes."""
    from hybridkv.kernels import elementwise, triton_utils

    device = torch.device(DEVICE)
    if not triton_utils.l2_prefetch_supported(device):
        # The prefetch programs exist only on Hopper or later with the switch on; elsewhere both launches would be
        # the same plain norm, and the comparison would prove nothing.
        pytest.skip("this GPU (or HYBRIDKV_L2_PREFETCH=off) launches no L2 prefetch programs: nothing to compare")
    hidden = 2560
    in_proj = torch.randn(12352, hidden, generator=torch_generator).to(DEVICE, torch.bfloat16)
    gate_up = torch.randn(18432, hidden, generator=torch_generator).to(DEVICE, torch.bfloat16)
    down = torch.randn(hidden, 9216, generator=torch_generator).to(DEVICE, torch.bfloat16)
    x = torch.randn(batch, hidden, generator=torch_generator).to(DEVICE, torch.bfloat16)
    residual = torch.randn(batch, hidden, generator=torch_generator).to(DEVICE, torch.bfloat16)
    weight = torch.randn(hidden, generator=torch_generator).to(DEVICE, torch.bfloat16)
    plain = elementwise.rms_norm(x, weight, 1e-6, residual)
    for prefetch in ((in_proj,), (gate_up, down)):
        assert triton_utils.l2_prefetch_plan(prefetch, batch, 32, device) is not None
        prefetched = elementwise.rms_norm(x, weight, 1e-6, residual, prefetch=prefetch)
        assert all(same_bits(a, b) for a, b in zip(prefetched, plain))
