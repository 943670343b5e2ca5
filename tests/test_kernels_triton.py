"""Each Triton kernel under the interpreter (tiny shapes) against its plain-torch reference: outputs, the pooled state
written only to the named slots, NaN-poisoned allocations fully overwritten, and prefill == decode step by step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernel_checks import changed_unnamed_slots, poisoned_allocations, rel_err, same_bits  # noqa: E402

from hybridkv import kernels  # noqa: E402
from hybridkv.errors import UserError  # noqa: E402
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

if torch.cuda.is_available():
    # conftest.py turns the Triton interpreter on only without CUDA; on a GPU the same kernels are checked compiled,
    # at real sizes, by tests/test_kernels_gpu.py.
    pytest.skip("the Triton interpreter is off on a CUDA machine; tests/test_kernels_gpu.py covers the kernels there",
                allow_module_level=True)

from hybridkv.kernels import (  # noqa: E402
    attention,
    conv1d,
    fla_adapter,
    gdn_chunk,
    gdn_input,
    gdn_recurrent,
    gdn_state,
    gdn_wy,
    step_inputs,
)

GEOMETRY = GdnGeometry(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)
HEADS = {"num_k_heads": 2, "head_k_dim": 16, "head_v_dim": 8}


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_kernel_matches_reference_and_touches_only_named_slots(torch_generator, ssm_dtype):
    _, pool = state_pools(GEOMETRY, 7, torch_generator, ssm_dtype=ssm_dtype)
    slot_ids = torch.tensor([5, 0, 2, 7, 1], dtype=torch.int32)
    inputs = gdn_step_inputs(GEOMETRY, len(slot_ids), torch_generator)
    ref_pool, kernel_pool = pool.clone(), pool.clone()
    want = reference.gdn_decode(**inputs, ssm_state=ref_pool, slot_ids=slot_ids, **HEADS)
    with poisoned_allocations():
        got = gdn_recurrent.gdn_decode(**inputs, ssm_state=kernel_pool, slot_ids=slot_ids, **HEADS)
    assert rel_err(got, want) < 1e-2  # bf16 outputs
    assert torch.count_nonzero(got[1]) == 0  # the null-slot row
    state_tolerance = 1e-5 if ssm_dtype == torch.float32 else 1e-2
    assert rel_err(kernel_pool[[5, 2, 7, 1]], ref_pool[[5, 2, 7, 1]]) < state_tolerance
    assert changed_unnamed_slots(pool, kernel_pool, [5, 2, 7, 1]) == []


def test_conv1d_kernels_match_reference_with_short_chunks_and_null_rows(torch_generator):
    conv_state, _ = state_pools(GEOMETRY, 6, torch_generator)
    weight = conv_weight(GEOMETRY, torch_generator)
    lengths = [7, 2, 1, 3, 20]  # chunks shorter than the W-1 history keep part of the old history
    slot_ids = torch.tensor([2, 5, 1, 0, 6], dtype=torch.int32)
    x = torch.randn(sum(lengths), GEOMETRY.conv_dim, generator=torch_generator).to(torch.bfloat16)
    ref_state, kernel_state = conv_state.clone(), conv_state.clone()
    want = reference.causal_conv1d_prefill(x, weight, ref_state, slot_ids, cu_seqlens_of(lengths))
    with poisoned_allocations():
        got = conv1d.causal_conv1d_prefill(x, weight, kernel_state, slot_ids, cu_seqlens_of(lengths))
    assert rel_err(got, want) < 1e-2
    assert torch.count_nonzero(got[10:13]) == 0
    assert same_bits(kernel_state, ref_state)  # the state holds raw inputs: exact copies
    assert changed_unnamed_slots(conv_state, kernel_state, [2, 5, 1, 6]) == []

    decode_slots = torch.tensor([3, 0, 6], dtype=torch.int32)
    xd = torch.randn(3, GEOMETRY.conv_dim, generator=torch_generator).to(torch.bfloat16)
    before = kernel_state.clone()
    want = reference.causal_conv1d_decode(xd, weight, ref_state, decode_slots)
    with poisoned_allocations():
        got = conv1d.causal_conv1d_decode(xd, weight, kernel_state, decode_slots)
    assert rel_err(got, want) < 1e-2 and torch.count_nonzero(got[1]) == 0
    assert same_bits(kernel_state, ref_state)
    assert changed_unnamed_slots(before, kernel_state, [3, 6]) == []


def test_decode_kernels_give_the_same_bits_with_their_states_read_first(torch_generator):
    """`prefetch_state` moves the state reads of the conv and GDN decodes ahead of the wait for the kernel before
    (which only a dependent launch on Hopper waits on): the results and the updated slots are the same bits."""
    conv_state, pool = state_pools(GEOMETRY, 6, torch_generator)
    weight = conv_weight(GEOMETRY, torch_generator)
    slot_ids = torch.tensor([3, 0, 6, 1], dtype=torch.int32)
    x = torch.randn(4, GEOMETRY.conv_dim, generator=torch_generator).to(torch.bfloat16)
    inputs = gdn_step_inputs(GEOMETRY, 4, torch_generator)
    results = []
    for prefetch in (False, True):
        conv_pool, ssm_pool = conv_state.clone(), pool.clone()
        y = conv1d.causal_conv1d_decode(x, weight, conv_pool, slot_ids, prefetch_state=prefetch)
        o = gdn_recurrent.gdn_decode(**inputs, ssm_state=ssm_pool, slot_ids=slot_ids, **HEADS,
                                     prefetch_state=prefetch)
        results.append((y, conv_pool, o, ssm_pool))
    for plain, prefetched in zip(*results):
        assert same_bits(prefetched, plain)


@pytest.mark.parametrize("name,mode,used", [("HYBRIDKV_DEPENDENT_LAUNCH", "dependent_launch_mode", "dependent_launch"),
                                             ("HYBRIDKV_L2_PREFETCH", "l2_prefetch_mode", "l2_prefetch_supported"),
                                             ("HYBRIDKV_EARLY_RELEASE", "early_release_mode", "early_release")])
def test_hopper_switches_are_off_on_the_cpu_and_take_only_their_modes(monkeypatch, name, mode, used):
    from hybridkv.kernels import triton_utils

    mode, used = getattr(triton_utils, mode), getattr(triton_utils, used)
    for value in ("on", "off"):
        monkeypatch.setenv(name, value)
        mode.cache_clear()
        assert mode() == value
        assert used(torch.device("cpu")) is False
    monkeypatch.setenv(name, "yes")
    mode.cache_clear()
    with pytest.raises(UserError, match=f"{name}='yes' is not one of on, off"):
        used(torch.device("cpu"))
    monkeypatch.delenv(name)
    mode.cache_clear()
    assert mode() == "on"


def raw_gates(g_cumsum: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """The gates back from their chunk sums in log2 units (64-token chunks from each sequence's start)."""
    g = g_cumsum.clone()
    for n in range(len(bounds) - 1):
        for first in range(bounds[n] + 1, bounds[n + 1]):
            if (first - bounds[n]) % 64:
                g[first] = g_cumsum[first] - g_cumsum[first - 1]
    return g / fla_adapter.RCP_LN2


def check_fla_bounds(bounds) -> list[int]:
    """fla's bounds: int64 sequence bounds, (sequence, chunk) for every 64-token chunk of every sequence in order,
    and each sequence's first chunk. -> the sequence bounds as a list."""
    cu_seqlens, chunk_indices, chunk_offsets = bounds
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    chunks = [(length + 63) // 64 for length in lengths]
    assert chunk_indices.tolist() == [[n, c] for n, count in enumerate(chunks) for c in range(count)]
    assert chunk_offsets.tolist() == [sum(chunks[:n]) for n in range(len(chunks) + 1)]
    assert all(t.dtype == torch.long for t in bounds)
    return cu_seqlens.tolist()


def chunks_of(bounds: list[int]):
    """(global chunk index, first row, end row) of every 64-token chunk, sequences in order."""
    spans = [(s, min(s + 64, end)) for start, end in zip(bounds, bounds[1:]) for s in range(start, end, 64)]
    return [(index, s, e) for index, (s, e) in enumerate(spans)]


def per_head(x, rows, group=1):
    """x[rows] as float64 `[heads, rows, ...]`, grouped heads repeated."""
    return x[rows].double().repeat_interleave(group, 1).transpose(0, 1)


def reference_wy_form(k, v, g_cumsum, beta, bounds):
    """w and u of every chunk (`gdn_wy.wy_form`'s outputs) on the reference math, in float64, out in k's dtype."""
    group = v.shape[1] // k.shape[1]
    w = torch.empty(*v.shape[:2], k.shape[2], dtype=k.dtype)
    u = torch.empty(v.shape, dtype=k.dtype)
    for _, s, e in chunks_of(check_fla_bounds(bounds)):
        rows = slice(s, e)
        gcum = g_cumsum[rows].double().t() / fla_adapter.RCP_LN2
        wc, uc = reference.chunk_wy(per_head(k, rows, group), per_head(v, rows), gcum, beta[rows].double().t())
        w[rows], u[rows] = wc.transpose(0, 1).to(k.dtype), uc.transpose(0, 1).to(k.dtype)
    return w, u


def fla_solve_stand_in(k, g_cumsum, beta, bounds):
    """`fla_adapter.kkt_solve` (fla's kkt-and-solve kernel) on the reference math, in float64, out in k's dtype as
    fla's, with NaN above each chunk's diagonal where fla leaves the buffer unwritten: fla's Triton chunk kernels cannot
    run under the interpreter, our state pass and the glue around it can."""
    group = beta.shape[1] // k.shape[1]
    A = torch.full((*beta.shape, 64), float("nan"), dtype=k.dtype)
    for _, s, e in chunks_of(check_fla_bounds(bounds)):
        rows = slice(s, e)
        gcum = g_cumsum[rows].double().t() / fla_adapter.RCP_LN2
        transform = reference.chunk_transform(per_head(k, rows, group), gcum, beta[rows].double().t())
        identity = torch.eye(e - s, dtype=torch.float64).expand_as(transform)
        inverse = torch.linalg.solve_triangular(transform, identity, upper=False, unitriangular=True)
        lower = torch.ones(e - s, e - s, dtype=torch.bool).tril()[:, None, :]
        A[rows, :, : e - s] = torch.where(lower, inverse.transpose(0, 1), float("nan")).to(k.dtype)
    return A


def fla_output_stand_in(q, k, v_new, h, g_cumsum, scale, bounds):
    """`fla_adapter.output_stage` (fla's output stage) on the reference math, from the state pass's h and v_new."""
    group = v_new.shape[1] // q.shape[1]
    o = torch.empty(v_new.shape, dtype=q.dtype)
    for index, s, e in chunks_of(check_fla_bounds(bounds)):
        rows = slice(s, e)
        gcum = g_cumsum[rows].double().t() / fla_adapter.RCP_LN2
        state = h[index].double().transpose(-1, -2)
        oc = reference.chunk_output(per_head(q, rows, group) * scale, per_head(k, rows, group), per_head(v_new, rows),
                                    state, gcum)
        o[rows] = oc.transpose(0, 1).to(q.dtype)
    return o


@pytest.fixture
def fla_stages(monkeypatch):
    monkeypatch.setattr(fla_adapter, "kkt_solve", fla_solve_stand_in)
    monkeypatch.setattr(fla_adapter, "output_stage", fla_output_stand_in)


def chunk_pass_inputs(lengths, num_v_heads, head_k_dim, head_v_dim, dtype, generator):
    """Inputs of the WY-form and state passes for sequences of `lengths` with 2 key heads: k (normalised) and v in
    `dtype`, beta, the gates' chunk sums in log2 units, the sequence bounds and fla's bounds for them."""
    tokens = sum(lengths)
    k = torch.nn.functional.normalize(torch.randn(tokens, 2, head_k_dim, generator=generator), dim=-1).to(dtype)
    v = torch.randn(tokens, num_v_heads, head_v_dim, generator=generator).to(dtype)
    beta = torch.rand(tokens, num_v_heads, generator=generator)
    gates = -torch.rand(tokens, num_v_heads, generator=generator) / 4
    bounds = cu_seqlens_of(lengths).tolist()
    g_cumsum = torch.cat([chunk.cumsum(0) for s, e in zip(bounds, bounds[1:]) for chunk in gates[s:e].split(64)])
    fla_bounds = fla_adapter.chunk_bounds(tuple(bounds), torch.device("cpu"))
    return k, v, beta, g_cumsum * fla_adapter.RCP_LN2, bounds, fla_bounds


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_v_heads,head_k_dim,head_v_dim,block", [(4, 16, 8, 16), (4, 40, 24, 16), (6, 32, 64, 32)])
def test_wy_form_from_the_solved_lower_triangles(torch_generator, dtype, num_v_heads, head_k_dim, head_v_dim, block):
    """w and u of every chunk against the reference WY form, from an A whose entries above each chunk's diagonal are
    NaN (fla's solve leaves them unwritten): chunks cut short by a sequence's end, an empty sequence, K and V not
    powers of two in several column blocks, grouped heads; every row of w and u written (NaN-poisoned outputs)."""
    lengths = [70, 5, 0, 128, 3]
    tokens = sum(lengths)
    k, v, beta, g_cumsum, _, fla_bounds = chunk_pass_inputs(lengths, num_v_heads, head_k_dim, head_v_dim, dtype,
                                                            torch_generator)
    A = fla_solve_stand_in(k, g_cumsum, beta, fla_bounds)
    assert torch.isnan(A).any()
    with poisoned_allocations():
        w, u = gdn_wy.wy_form(k, v, A, beta, g_cumsum, fla_bounds, config={"block": block})
    want_w, want_u = reference_wy_form(k, v, g_cumsum, beta, fla_bounds)
    assert w.dtype == u.dtype == dtype and w.shape == (tokens, num_v_heads, head_k_dim) and u.shape == v.shape
    assert rel_err(w, want_w) < 1e-2 and rel_err(u, want_u) < 1e-2
    assert not torch.isnan(w).any() and not torch.isnan(u).any()


@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_v_heads,head_k_dim,head_v_dim,block_v", [(4, 16, 8, 16), (4, 32, 40, 16), (6, 24, 32, 32)])
def test_chunk_state_pass_reads_and_writes_the_pool_in_place(torch_generator, ssm_dtype, num_v_heads,
                                                             head_k_dim, head_v_dim, block_v, folded):
    """Both state passes (from w and u, and folded: from v, beta and A) against the reference's WY form and chunk
    state update: h (the state before every chunk), v_new, and each sequence's final state back in its own slot; the
    null slot neither read nor written, other slots untouched, nothing read above A's diagonals (NaN there). Several
    V blocks per head (V=40 in blocks of 16), K and V not powers of two, grouped heads."""
    lengths = [70, 5, 128, 0, 3, 64]
    slot_ids = torch.tensor([3, 0, 1, 6, 5, 2], dtype=torch.int32)
    geometry = GdnGeometry(num_k_heads=2, num_v_heads=num_v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim)
    _, pool = state_pools(geometry, 7, torch_generator, ssm_dtype=ssm_dtype)
    pool[0] = float("nan")  # never read
    group = num_v_heads // 2
    k, v, beta, g_cumsum, bounds, fla_bounds = chunk_pass_inputs(lengths, num_v_heads, head_k_dim, head_v_dim,
                                                                 torch.bfloat16, torch_generator)
    kernel_pool = pool.clone()
    if folded:
        A = fla_solve_stand_in(k, g_cumsum, beta, fla_bounds)
        with poisoned_allocations():
            h, v_new = gdn_state.folded_chunk_states(k, v, A, beta, g_cumsum, kernel_pool, slot_ids, fla_bounds,
                                                     config={"block_v": block_v})
    else:
        w, u = reference_wy_form(k, v, g_cumsum, beta, fla_bounds)
        with poisoned_allocations():
            h, v_new = gdn_state.chunk_states(k, w, u, g_cumsum, kernel_pool, slot_ids, fla_bounds,
                                              config={"block_v": block_v})

    want_pool = pool.double()
    chunk_of_row = {s: index for index, s, _ in chunks_of(bounds)}
    for n, slot in enumerate(slot_ids.tolist()):
        state = torch.zeros(num_v_heads, head_k_dim, head_v_dim, dtype=torch.float64)
        if slot:
            state = want_pool[slot].transpose(-1, -2)
        for s in range(bounds[n], bounds[n + 1], 64):
            rows = slice(s, min(s + 64, bounds[n + 1]))
            # The kernel rounds the state to bf16 as a matrix operand; compare each chunk from the kernel's h.
            assert rel_err(h[chunk_of_row[s]].transpose(-1, -2), state) < 1e-2
            state = h[chunk_of_row[s]].double().transpose(-1, -2)
            gcum = g_cumsum[rows].double().t() / fla_adapter.RCP_LN2
            w, u = reference.chunk_wy(per_head(k, rows, group), per_head(v, rows), gcum, beta[rows].double().t())
            assert rel_err(v_new[rows].transpose(0, 1), u - w @ state) < 1e-2
            state = reference.chunk_state_update(state, per_head(k, rows, group), v_new[rows].double().transpose(0, 1),
                                                 gcum)
        if slot:
            want_pool[slot] = state.transpose(-1, -2)
    named = [s for s, length in zip(slot_ids.tolist(), lengths) if s and length]
    assert rel_err(kernel_pool[named], want_pool[named]) < 1e-2
    assert changed_unnamed_slots(pool, kernel_pool, named) == []
    assert h.shape[0] == len(chunks_of(bounds)) and torch.isnan(kernel_pool[0]).all()


def test_checkpoints_inside_a_chunk_are_planned_on_the_kernels_chunk_starts():
    from hybridkv.sizing.prefix import PREFILL_CHUNK_TOKENS

    assert PREFILL_CHUNK_TOKENS == reference.GDN_CHUNK_TOKENS == fla_adapter.FLA_CHUNK_TOKENS


def prefix_rows(bounds: list[int], keep: list[int]) -> torch.Tensor:
    """Row indices of the first `keep[n]` tokens of each sequence n."""
    return torch.cat([torch.arange(s, s + kept) for s, kept in zip(bounds, keep)])


@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_state_pass_captures_the_state_at_chosen_chunk_starts(torch_generator, ssm_dtype, folded):
    """A capture at chunk c of a sequence stores in its checkpoint slot bit for bit what a pass over the sequence's
    first 64c tokens leaves in the state slot (the same arithmetic, the same rounding to the pool's dtype), a capture
    at chunk 0 the slot's own state; -1 entries capture nothing, and capturing changes neither h, v_new nor the
    final states."""
    lengths, slots = [200, 5, 130], [2, 0, 1]  # chunks 0-3 | 4 | 5-7
    geometry = GdnGeometry(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=24)
    _, pool = state_pools(geometry, 3, torch_generator, ssm_dtype=ssm_dtype)
    k, v, beta, g_cumsum, bounds, _ = chunk_pass_inputs(lengths, 4, 16, 24, torch.bfloat16, torch_generator)

    def state_pass(rows, seq_lengths, seq_slots, state_pool, capture=None):
        fla_bounds = fla_adapter.chunk_bounds(tuple(cu_seqlens_of(seq_lengths).tolist()), torch.device("cpu"))
        slot_ids = torch.tensor(seq_slots, dtype=torch.int32)
        k_, v_, beta_, g_ = k[rows], v[rows], beta[rows], g_cumsum[rows]
        if folded:
            A = fla_solve_stand_in(k_, g_, beta_, fla_bounds)
            return gdn_state.folded_chunk_states(k_, v_, A, beta_, g_, state_pool, slot_ids, fla_bounds,
                                                 capture=capture)
        w, u = reference_wy_form(k_, v_, g_, beta_, fla_bounds)
        return gdn_state.chunk_states(k_, w, u, g_, state_pool, slot_ids, fla_bounds, capture=capture)

    every_row = torch.arange(sum(lengths))
    plain_pool, capturing_pool = pool.clone(), pool.clone()
    plain_h, plain_v_new = state_pass(every_row, lengths, slots, plain_pool)
    checkpoints = torch.full((3, *pool.shape[1:]), float("nan"), dtype=ssm_dtype)
    chunk_slots = torch.tensor([2, -1, 1, -1, -1, -1, 0, -1], dtype=torch.int32)
    h, v_new = state_pass(every_row, lengths, slots, capturing_pool, capture=(chunk_slots, checkpoints))
    assert same_bits(h, plain_h) and same_bits(v_new, plain_v_new) and same_bits(capturing_pool, plain_pool)

    prefix_pool = pool.clone()
    state_pass(prefix_rows(bounds, [128, 5, 64]), [128, 5, 64], slots, prefix_pool)
    assert same_bits(checkpoints[1], prefix_pool[2])  # sequence 0 after 128 tokens (its chunk 2)
    assert same_bits(checkpoints[0], prefix_pool[1])  # sequence 2 after 64 tokens (its chunk 1)
    assert same_bits(checkpoints[2], pool[2])  # sequence 0 before its first chunk

    with pytest.raises(ValueError, match="one per chunk"):
        state_pass(every_row, lengths, slots, pool.clone(), capture=(chunk_slots[:4], checkpoints))
    with pytest.raises(ValueError, match="laid out as the state pool"):
        state_pass(every_row, lengths, slots, pool.clone(), capture=(chunk_slots, checkpoints.double()))


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_reference_prefill_captures_the_state_at_chosen_chunk_starts(torch_generator, ssm_dtype):
    """The reference's `capture`, as the kernels': the state a prefill of the first 64c tokens leaves (to rounding:
    the reference's per-row reductions start at other rows when the batch is cut, which can move float32 ulps)."""
    lengths, slot_ids = [150, 3, 70], torch.tensor([3, 0, 1], dtype=torch.int32)
    _, pool = state_pools(GEOMETRY, 4, torch_generator, ssm_dtype=ssm_dtype)
    inputs = gdn_step_inputs(GEOMETRY, sum(lengths), torch_generator)
    cu = cu_seqlens_of(lengths)
    checkpoints = torch.full((2, *pool.shape[1:]), float("nan"), dtype=ssm_dtype)
    chunk_slots = torch.tensor([-1, -1, 0, -1, -1, 1], dtype=torch.int32)  # 3 + 1 + 2 chunks
    captured_pool, plain_pool = pool.clone(), pool.clone()
    got = reference.gdn_prefill(**inputs, ssm_state=captured_pool, slot_ids=slot_ids, cu_seqlens=cu, **HEADS,
                                capture=(chunk_slots, checkpoints))
    want = reference.gdn_prefill(**inputs, ssm_state=plain_pool, slot_ids=slot_ids, cu_seqlens=cu, **HEADS)
    assert same_bits(got, want) and same_bits(captured_pool, plain_pool)
    rows = prefix_rows(cu.tolist(), [128, 3, 64])
    prefix_pool = pool.clone()
    reference.gdn_prefill(**{name: t[rows] if t.shape[0] == sum(lengths) else t for name, t in inputs.items()},
                          ssm_state=prefix_pool, slot_ids=slot_ids, cu_seqlens=cu_seqlens_of([128, 3, 64]), **HEADS)
    tolerance = 1e-6 if ssm_dtype == torch.float32 else 1e-2
    assert rel_err(checkpoints[0], prefix_pool[3]) < tolerance and rel_err(checkpoints[1], prefix_pool[1]) < tolerance


def test_input_pass_gates_and_their_chunk_sums(torch_generator):
    """The input pass's g and beta against the reference gates; with `gate_cumsum`, g summed within each 64-token
    chunk from every sequence's start (chunks split across sequences and a sequence longer than two chunks)."""
    lengths = [70, 5, 150, 64]
    inputs = gdn_step_inputs(GEOMETRY, sum(lengths), torch_generator)
    cu, slot_ids = cu_seqlens_of(lengths), torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    args = (inputs["qkv"], inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"], slot_ids, cu)
    _, _, _, g, beta = gdn_input.prepare_prefill_inputs(*args, **HEADS)
    want_g, want_beta = reference.gdn_gates(inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"], torch.float32)
    assert rel_err(g, want_g) < 1e-5 and rel_err(beta, want_beta) < 1e-5
    _, _, _, g_cumsum, _ = gdn_input.prepare_prefill_inputs(*args, **HEADS, gate_cumsum=True)
    bounds = cu.tolist()
    want_cumsum = torch.cat([torch.cat([chunk.cumsum(0) for chunk in want_g[s:e].split(64)])
                             for s, e in zip(bounds, bounds[1:])]) * fla_adapter.RCP_LN2
    assert rel_err(g_cumsum, want_cumsum) < 1e-5
    assert rel_err(raw_gates(g_cumsum, bounds), want_g) < 1e-4
    with pytest.raises(ValueError, match="64 rows per program"):
        gdn_input.prepare_prefill_inputs(*args, **HEADS, gate_cumsum=True, config={"block_rows": 32})


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_gdn_prefill_path_matches_reference(torch_generator, fla_stages, ssm_dtype):
    _, pool = state_pools(GEOMETRY, 5, torch_generator, ssm_dtype=ssm_dtype)
    lengths = [9, 3, 70, 1]
    slot_ids = torch.tensor([4, 0, 1, 3], dtype=torch.int32)
    inputs = gdn_step_inputs(GEOMETRY, sum(lengths), torch_generator)
    cu = cu_seqlens_of(lengths)
    ref_pool, kernel_pool = pool.clone(), pool.clone()
    want = reference.gdn_prefill(**inputs, ssm_state=ref_pool, slot_ids=slot_ids, cu_seqlens=cu, **HEADS)
    with poisoned_allocations():
        got = gdn_chunk.gdn_prefill(**inputs, ssm_state=kernel_pool, slot_ids=slot_ids, cu_seqlens=cu, **HEADS,
                                    cu_seqlens_cpu=cu.tolist())
    assert rel_err(got, want) < 1e-2
    assert torch.count_nonzero(got[9:12]) == 0
    # fla takes the normalised q/k as bf16 matrix operands, so the state carries bf16-operand error.
    assert rel_err(kernel_pool[[4, 1, 3]], ref_pool[[4, 1, 3]]) < 1e-2
    assert changed_unnamed_slots(pool, kernel_pool, [4, 1, 3]) == []


@pytest.mark.parametrize("heads,num_v_heads,width", [(1, 4, 4), (4, 4, 3), (2, 4, 5), (4, 6, 4), (8, 4, 4)])
def test_conv_gdn_prefill_matches_conv_then_gdn_reference(torch_generator, monkeypatch, fla_stages, heads, num_v_heads,
                                                          width):
    """The layer's fused input pass (conv, l2norm, split, gates) against the two references in sequence, on x as the
    layer passes it: a column slice of a wider projection. Some programs' rows lie inside one sequence, others start
    one; there are chunks shorter than the W-1 history and a null-slot sequence. Programs of several heads span the
    q/k/v boundaries (K != V), and with 10 heads in groups of 4 the last group is part empty. A narrower conv kernel
    runs in the fused pass with its missing taps zero; a wider one takes the separate conv kernel."""
    geometry = GdnGeometry(num_k_heads=2, num_v_heads=num_v_heads, head_k_dim=16, head_v_dim=8, conv_kernel=width)
    conv_state, pool = state_pools(geometry, 6, torch_generator)
    weight = conv_weight(geometry, torch_generator)
    lengths = [9, 2, 130, 1, 3, 40]
    slot_ids = torch.tensor([4, 6, 1, 3, 0, 5], dtype=torch.int32)
    inputs = gdn_step_inputs(geometry, sum(lengths), torch_generator)
    projection = torch.randn(sum(lengths), geometry.conv_dim + 5, generator=torch_generator).to(torch.bfloat16)
    x = projection[:, 3 : 3 + geometry.conv_dim]
    del inputs["qkv"]
    cu = cu_seqlens_of(lengths)
    named = [4, 6, 1, 3, 5]
    # The oracle runs in float64: the kernel rounds q/k/v to bf16 once, at a different point than a bf16 reference.
    ref_conv, ref_pool = conv_state.clone(), pool.double()
    kernel_conv, kernel_pool = conv_state.clone(), pool.clone()
    want = reference.conv_gdn_prefill(x.double(), weight.double(), ref_conv,
                                      **{name: t.double() for name, t in inputs.items()}, ssm_state=ref_pool,
                                      slot_ids=slot_ids, cu_seqlens=cu, **HEADS)
    monkeypatch.setattr(gdn_input, "prefill_launch_config",
                        lambda head_dim: {"block_rows": 64, "heads": heads, "num_warps": 1, "block_dim": 16})
    with poisoned_allocations():
        got = gdn_chunk.conv_gdn_prefill(x, weight, kernel_conv, **inputs, ssm_state=kernel_pool, slot_ids=slot_ids,
                                         cu_seqlens=cu, **HEADS, cu_seqlens_cpu=cu.tolist())
    assert rel_err(got, want) < 1e-2
    assert torch.count_nonzero(got[142:145]) == 0  # the null-slot sequence
    assert same_bits(kernel_conv, ref_conv)
    assert rel_err(kernel_pool[named], ref_pool[named]) < 1e-2
    assert changed_unnamed_slots(conv_state, kernel_conv, named) == []
    assert changed_unnamed_slots(pool, kernel_pool, named) == []


def test_conv_gdn_prefill_in_chunks_equals_one_pass(torch_generator, fla_stages):
    """A prompt fed to the fused path in pieces (one shorter than the conv history, one a single token) continues
    from the conv and recurrent states the previous piece left in its slot, as one pass over the prompt does."""
    length = 40
    conv_state, pool = state_pools(GEOMETRY, 2, torch_generator)
    conv_state[1:], pool[1:] = 0, 0  # slots as the engine hands them out
    weight = conv_weight(GEOMETRY, torch_generator)
    inputs = gdn_step_inputs(GEOMETRY, length, torch_generator)
    x = inputs.pop("qkv")

    def run(s, e, slot):
        return gdn_chunk.conv_gdn_prefill(x[s:e], weight, conv_state, **{n: (t[s:e] if t.shape[0] == length else t)
                                                                          for n, t in inputs.items()},
                                          ssm_state=pool, slot_ids=torch.tensor([slot], dtype=torch.int32),
                                          cu_seqlens=cu_seqlens_of([e - s]), **HEADS, cu_seqlens_cpu=[0, e - s])

    one_pass = run(0, length, 1)
    pieces = torch.cat([run(s, e, 2) for s, e in [(0, 17), (17, 19), (19, 20), (20, length)]])
    assert rel_err(pieces, one_pass) < 1e-2
    assert same_bits(conv_state[2], conv_state[1])
    assert rel_err(pool[2], pool[1]) < 1e-2


def test_conv_gdn_prefill_told_of_no_null_slot_launches_no_zeroing_and_changes_nothing(torch_generator,
                                                                                        monkeypatch, fla_stages):
    """With `null_slots=False` (no sequence on slot 0, which the engine knows from its host slots) the prefill
    skips the launch that zeroes null-slot rows, and every output and state bit is what the default path gives."""
    lengths = [9, 70, 3]
    slot_ids = torch.tensor([2, 1, 3], dtype=torch.int32)
    conv_state, pool = state_pools(GEOMETRY, 4, torch_generator)
    weight = conv_weight(GEOMETRY, torch_generator)
    inputs = gdn_step_inputs(GEOMETRY, sum(lengths), torch_generator)
    x = inputs.pop("qkv")
    cu = cu_seqlens_of(lengths)

    def run(conv, ssm, **kwargs):
        return gdn_chunk.conv_gdn_prefill(x, weight, conv, **inputs, ssm_state=ssm, slot_ids=slot_ids, cu_seqlens=cu,
                                          **HEADS, cu_seqlens_cpu=cu.tolist(), **kwargs)

    default_conv, default_pool = conv_state.clone(), pool.clone()
    want = run(default_conv, default_pool)
    zeroings = []
    monkeypatch.setattr(gdn_chunk, "zero_null_sequences", lambda *args: zeroings.append(args))
    told_conv, told_pool = conv_state.clone(), pool.clone()
    got = run(told_conv, told_pool, null_slots=False)
    assert zeroings == []
    assert same_bits(got, want) and same_bits(told_conv, default_conv) and same_bits(told_pool, default_pool)
    run(conv_state.clone(), pool.clone())
    assert len(zeroings) == 1  # the default still zeroes


def test_layers_of_a_step_hand_fla_the_same_bounds(torch_generator, monkeypatch):
    """Every GDN layer of a step (same host bounds) reuses the bounds tensors built for the first: no per-layer
    host-to-device copy. Other bounds get their own."""
    seen = []

    def recording_stand_in(*args):
        seen.append(args[3])
        return fla_solve_stand_in(*args)

    monkeypatch.setattr(fla_adapter, "kkt_solve", recording_stand_in)
    monkeypatch.setattr(fla_adapter, "output_stage", fla_output_stand_in)
    _, pool = state_pools(GEOMETRY, 3, torch_generator)
    inputs = gdn_step_inputs(GEOMETRY, 70, torch_generator)
    for bounds in ([0, 30, 70], [0, 30, 70], [0, 69, 70]):
        gdn_chunk.gdn_prefill(**inputs, ssm_state=pool, slot_ids=torch.tensor([1, 2], dtype=torch.int32),
                              cu_seqlens=torch.tensor(bounds, dtype=torch.int32), **HEADS, cu_seqlens_cpu=bounds)
    assert all(a is b for a, b in zip(seen[0], seen[1]))
    assert [t.tolist() for t in seen[2]] == [[0, 69, 70], [[0, 0], [0, 1], [1, 0]], [0, 2, 3]]


def test_layer_folds_the_wy_form_once_its_programs_outnumber_the_multiprocessors(torch_generator, monkeypatch):
    """The rule (H200 figures: 132 SMs, 64-row programs) and the path it picks after fla's solve: the WY form and the
    pass from w and u for few sequences and heads, the folded pass beyond one wave."""
    assert not gdn_state.folds_wy_form(1, 48, 128, 132)
    assert not gdn_state.folds_wy_form(2, 32, 128, 132)
    assert gdn_state.folds_wy_form(3, 32, 128, 132) and gdn_state.folds_wy_form(8, 32, 128, 132)
    assert gdn_state.folds_wy_form(133, 1, 64, 132) and not gdn_state.folds_wy_form(132, 1, 64, 132)
    called = []

    def recording(name, run):
        def record(*args, **kwargs):
            called.append(name)
            return run(*args, **kwargs)
        return record

    monkeypatch.setattr(fla_adapter, "kkt_solve", recording("solve", fla_solve_stand_in))
    for name in ("wy_form", "chunk_states", "folded_chunk_states"):
        monkeypatch.setattr(gdn_chunk, name, recording(name, getattr(gdn_chunk, name)))
    monkeypatch.setattr(fla_adapter, "output_stage", fla_output_stand_in)
    _, pool = state_pools(GEOMETRY, 5, torch_generator)
    inputs = gdn_step_inputs(GEOMETRY, 8, torch_generator)
    # The interpreter counts 4 multiprocessors; GEOMETRY has 4 v-heads of 8 values: one program per sequence-head.
    for bounds in ([0, 8], [0, 3, 8]):
        gdn_chunk.gdn_prefill(**inputs, ssm_state=pool, slot_ids=torch.arange(1, len(bounds), dtype=torch.int32),
                              cu_seqlens=torch.tensor(bounds, dtype=torch.int32), **HEADS, cu_seqlens_cpu=bounds)
    assert called == ["solve", "wy_form", "chunk_states", "solve", "folded_chunk_states"]


def test_conv_gdn_prefill_rejects_mismatched_conv_weight(torch_generator):
    conv_state, pool = state_pools(GEOMETRY, 2, torch_generator)
    inputs = gdn_step_inputs(GEOMETRY, 4, torch_generator)
    x = inputs.pop("qkv")
    with pytest.raises(ValueError, match="disagree"):
        gdn_chunk.conv_gdn_prefill(x, torch.zeros(GEOMETRY.conv_dim - 1, 4), conv_state, **inputs, ssm_state=pool,
                                   slot_ids=torch.tensor([1], dtype=torch.int32), cu_seqlens=cu_seqlens_of([4]),
                                   **HEADS)


@pytest.mark.parametrize("decode_impl", ["reference", "triton"])
def test_chunked_prefill_equals_one_pass_equals_token_by_token_decode(torch_generator, decode_impl):
    length = 75
    inputs = gdn_step_inputs(GEOMETRY, length, torch_generator)
    _, pool = state_pools(GEOMETRY, 3, torch_generator)
    pool[1:] = 0  # slots as the engine hands them out: zeroed
    one_pass = reference.gdn_prefill(**inputs, ssm_state=pool, slot_ids=torch.tensor([1], dtype=torch.int32),
                                     cu_seqlens=cu_seqlens_of([length]), **HEADS)
    pieces = []
    for s, e in [(0, 30), (30, 31), (31, 75)]:
        piece = {name: (t[s:e] if t.shape[0] == length else t) for name, t in inputs.items()}
        pieces.append(reference.gdn_prefill(**piece, ssm_state=pool, slot_ids=torch.tensor([2], dtype=torch.int32),
                                            cu_seqlens=cu_seqlens_of([e - s]), **HEADS))
    assert rel_err(torch.cat(pieces), one_pass) < 1e-2
    assert rel_err(pool[2], pool[1]) < 1e-5

    step = reference.gdn_decode if decode_impl == "reference" else gdn_recurrent.gdn_decode
    decode_pool = torch.zeros_like(pool)
    steps = []
    for t in range(length):
        row = {name: (x[t : t + 1] if x.shape[0] == length else x) for name, x in inputs.items()}
        steps.append(step(**row, ssm_state=decode_pool, slot_ids=torch.tensor([1], dtype=torch.int32), **HEADS))
    assert rel_err(torch.cat(steps), one_pass) < 1e-2
    assert rel_err(decode_pool[1], pool[1]) < 1e-5


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("segments", [1, 4, 16])
def test_paged_attention_kernel_matches_reference(torch_generator, num_q_heads, num_kv_heads, segments):
    """16 segments leave most past the keys (as a decode graph split for max_model_len does at short contexts): the
    merge must read nothing of them, and the poisoned workspace shows it if it does."""
    geometry = AttentionGeometry(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=16, block_size=4)
    # Decode rows, a prefill on a cached prefix, a fresh prefill longer than one tile, and a 1-token chunk.
    for q_lens, seq_lens in [([1, 1, 1], [1, 17, 40]), ([5, 16, 3, 1], [5, 37, 3, 70])]:
        inputs = paged_attention_inputs(geometry, seq_lens, q_lens, torch_generator)
        want = reference.paged_attention(**inputs)
        with poisoned_allocations():
            got = attention.paged_attention(**inputs, config={"segments": segments})
        assert rel_err(got, want) < 1e-2


def test_write_kv_cache_kernel_matches_reference(torch_generator):
    geometry = AttentionGeometry(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    pool = paged_attention_inputs(geometry, [12], [1], torch_generator)
    k = torch.randn(5, 2, 16, generator=torch_generator).to(torch.bfloat16)
    v = torch.randn(5, 2, 16, generator=torch_generator).to(torch.bfloat16)
    slot_mapping = torch.tensor([5, -1, 1, 15, 8], dtype=torch.int64)
    ref_k, ref_v = pool["k_cache"].clone(), pool["v_cache"].clone()
    reference.write_kv_cache(k, v, ref_k, ref_v, slot_mapping)
    attention.write_kv_cache(k, v, pool["k_cache"], pool["v_cache"], slot_mapping)
    assert same_bits(pool["k_cache"], ref_k) and same_bits(pool["v_cache"], ref_v)


def test_dispatcher_picks_reference_on_cpu_and_triton_when_forced(torch_generator, monkeypatch):
    inputs = gdn_step_inputs(GEOMETRY, 2, torch_generator)
    _, pool = state_pools(GEOMETRY, 2, torch_generator)
    slot_ids = torch.tensor([1, 2], dtype=torch.int32)
    outputs = {}
    for mode in ("auto", "reference", "triton"):
        monkeypatch.setenv("HYBRIDKV_KERNELS", mode)
        outputs[mode] = kernels.gdn_decode(**inputs, ssm_state=pool.clone(), slot_ids=slot_ids, **HEADS)
    assert same_bits(outputs["auto"], outputs["reference"])
    assert rel_err(outputs["triton"], outputs["reference"]) < 1e-2
    monkeypatch.setenv("HYBRIDKV_KERNELS", "cuda")
    with pytest.raises(UserError, match="HYBRIDKV_KERNELS"):
        kernels.gdn_decode(**inputs, ssm_state=pool, slot_ids=slot_ids, **HEADS)


@pytest.mark.parametrize("max_seqlen_q", [1, 4096])
@pytest.mark.parametrize("element_bytes", [2, 4])
def test_attention_tiles_fit_the_devices_shared_memory(max_seqlen_q, element_bytes):
    """float32 caches (GPU equality runs) must not ask for more shared memory than a Hopper block may have."""
    hopper_optin_bytes = 232_448
    launch = attention.attention_launch_config(
        num_seqs=8, num_kv_heads=4, group=4, max_seqlen_q=max_seqlen_q, max_seqlen_k=8192, block_size=16,
        num_sms=132, head_dim=256, element_bytes=element_bytes, shared_memory_bytes=hopper_optin_bytes)
    block_m = launch["block_q"] * 4
    staged = (block_m + launch["num_stages"] * 2 * launch["block_n"]) * 256 * element_bytes
    assert staged <= hopper_optin_bytes
    assert launch["block_n"] >= 16 and launch["block_q"] >= 1 and launch["num_stages"] >= 1
    if element_bytes == 2:  # the bf16 launches that were tuned on the H200 are unchanged
        assert (block_m, launch["block_n"], launch["num_stages"]) == ((16, 64, 3) if max_seqlen_q == 1 else (128, 64, 2))


def test_a_mixed_steps_decode_rows_and_prefill_chunks_launch_apart_into_one_output(torch_generator):
    """`BatchContext.attention_parts` of a step with decode rows and prefill chunks: two launches, each sized for its
    own rows, writing their rows of one output, equal to the reference over the whole step."""
    from hybridkv.sidecar.model.context import BatchContext

    geometry = AttentionGeometry(num_q_heads=6, num_kv_heads=2, head_dim=16, block_size=4)
    q_lens, seq_lens = [1, 1, 1, 9, 3], [12, 70, 5, 41, 3]
    inputs = paged_attention_inputs(geometry, seq_lens, q_lens, torch_generator)
    ctx = BatchContext(num_decodes=3, cu_seqlens_q=inputs["cu_seqlens_q"],
                       cu_seqlens_q_cpu=inputs["cu_seqlens_q"].tolist(), seq_lens=inputs["seq_lens"],
                       block_tables=inputs["block_tables"], slot_mapping=torch.zeros(0, dtype=torch.long),
                       state_slot_ids=torch.zeros(5, dtype=torch.int32), max_seqlen_q=9, max_seqlen_k=70,
                       decode_max_seqlen_k=70, prefill_max_seqlen_k=41)
    parts = ctx.attention_parts
    assert [(p.first, p.end, p.max_seqlen_q, p.max_seqlen_k) for p in parts] == [(0, 3, 1, 70), (3, 15, 9, 41)]
    assert parts[1].cu_seqlens_q.tolist() == [0, 9, 12]
    want = reference.paged_attention(**inputs)
    out = torch.full((16, 6, 16), float("nan"), dtype=inputs["q"].dtype)[:15]
    q = inputs["q"]
    for rows in parts:
        attention.paged_attention(q[rows.first : rows.end], inputs["k_cache"], inputs["v_cache"], rows.block_tables,
                                  rows.cu_seqlens_q, rows.seq_lens, inputs["scale"], rows.max_seqlen_q,
                                  rows.max_seqlen_k, config={"segments": 2}, out=out[rows.first : rows.end])
    assert rel_err(out, want) < 1e-2
    whole = BatchContext(num_decodes=0, cu_seqlens_q=inputs["cu_seqlens_q"], cu_seqlens_q_cpu=[0, 9],
                         seq_lens=inputs["seq_lens"][:1], block_tables=inputs["block_tables"][:1],
                         slot_mapping=torch.zeros(0, dtype=torch.long), state_slot_ids=torch.zeros(1, dtype=torch.int32),
                         max_seqlen_q=9, max_seqlen_k=12)
    assert len(whole.attention_parts) == 1 and whole.attention_parts[0].end == 9


def test_paged_attention_writes_strided_output_rows_and_refuses_a_misshapen_output(torch_generator):
    geometry = AttentionGeometry(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    inputs = paged_attention_inputs(geometry, [7, 30], [3, 1], torch_generator)
    wide = torch.full((4, 2, 4, 16), float("nan"), dtype=inputs["q"].dtype)
    out = wide[:, 1]  # rows two heads' worth apart
    assert attention.paged_attention(**inputs, out=out) is out
    assert rel_err(out, reference.paged_attention(**inputs)) < 1e-2
    assert torch.isnan(wide[:, 0]).all()  # nothing written outside the rows given
    with pytest.raises(ValueError, match="out must be"):
        attention.paged_attention(**inputs, out=torch.empty(4, 16, 4, dtype=inputs["q"].dtype))


def test_prefill_chunks_over_long_contexts_split_their_keys_until_their_query_blocks_cover_the_sms():
    def segments(num_seqs, max_seqlen_q, max_seqlen_k):
        return attention.attention_launch_config(num_seqs, 4, 4, max_seqlen_q, max_seqlen_k, 16, 132)["segments"]

    # A prompt's later 256-token chunk: 8 query blocks x 4 KV heads = 32 programs on 132 SMs, one wave in four
    # segments; a 640-token one: 80 programs, 5 waves of eighths of the keys against 1 of all of them.
    assert segments(1, 256, 6400) == 4 and segments(1, 640, 16000) == 8
    # 128 programs: every split adds waves as fast as it shortens them.
    assert segments(1, 1024, 4096) == 1
    # Each segment keeps PREFILL_SEGMENT_TILES tiles of keys: a short context splits less.
    assert segments(1, 256, 1024) == 2 and segments(1, 256, 1023) == 1
    # A fresh long prompt already covers the SMs; many chunks do too.
    assert segments(1, 4096, 4096) == 1 and segments(8, 512, 8192) == 1
    # Few query blocks over a very long context: capped.
    assert segments(1, 5, 131072) == attention.MAX_PREFILL_SEGMENTS
    for num_seqs, q, k in [(1, 64, 100_000), (2, 300, 20_000), (3, 17, 9000)]:
        launch = attention.attention_launch_config(num_seqs, 4, 4, q, k, 16, 132)
        assert k >= launch["segments"] * attention.PREFILL_SEGMENT_TILES * launch["block_n"] or launch["segments"] == 1


FP8 = torch.float8_e4m3fn


def test_write_kv_cache_kernel_quantizes_to_fp8_as_the_reference_does(torch_generator):
    geometry = AttentionGeometry(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    pool = paged_attention_inputs(geometry, [12], [1], torch_generator, kv_dtype=FP8)
    k = (torch.randn(5, 2, 16, generator=torch_generator) * 4).to(torch.bfloat16)
    v = (torch.randn(5, 2, 16, generator=torch_generator) * 4).to(torch.bfloat16)
    k[0, 0, :2], v[4, 1, 5] = 500.0, -900.0  # saturate
    slot_mapping = torch.tensor([5, -1, 1, 15, 8], dtype=torch.int64)
    ref_k, ref_v = pool["k_cache"].clone(), pool["v_cache"].clone()
    reference.write_kv_cache(k, v, ref_k, ref_v, slot_mapping, 0.37, 0.011)
    attention.write_kv_cache(k, v, pool["k_cache"], pool["v_cache"], slot_mapping, 0.37, 0.011)
    assert same_bits(pool["k_cache"], ref_k) and same_bits(pool["v_cache"], ref_v)
    assert pool["v_cache"].view(-1, 2, 16)[8, 1, 5].item() == -448.0


@pytest.mark.parametrize("segments", [1, 4])
def test_paged_attention_kernel_over_fp8_pools_matches_reference(torch_generator, segments):
    geometry = AttentionGeometry(num_q_heads=6, num_kv_heads=2, head_dim=16, block_size=4)
    for q_lens, seq_lens in [([1, 1], [17, 40]), ([5, 3, 1], [37, 3, 70])]:
        inputs = paged_attention_inputs(geometry, seq_lens, q_lens, torch_generator, kv_dtype=FP8)
        want = reference.paged_attention(**inputs, k_scale=0.3, v_scale=2.5)
        with poisoned_allocations():
            got = attention.paged_attention(**inputs, k_scale=0.3, v_scale=2.5, config={"segments": segments})
        assert rel_err(got, want) < 1e-2


def test_host_side_sizes_agree_with_tritons_own_helpers():
    """The launches size their grids and blocks with plain-Python `cdiv` and `next_power_of_2` (Triton's are
    constexpr functions, microseconds a call on the host): the same values, 0 included."""
    import triton

    from hybridkv.kernels.triton_utils import cdiv, next_power_of_2

    for n in [*range(0, 300), 1023, 1024, 1025, 2**20 - 1, 2**20, 2**20 + 1, 5 * 2**31]:
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 2, 3, 16, 64, 128, 257):
            assert cdiv(n, d) == triton.cdiv(n, d)


def _fixed_decode_buffers(rows: int, max_blocks: int, fill: int) -> list[torch.Tensor]:
    """The decode graph's fixed buffers in their dtypes, holding `fill` (what an earlier step left)."""
    longs = [torch.full((rows,), fill, dtype=torch.long) for _ in range(3)]  # ids, positions, slot mapping
    ints = [torch.full((rows,), fill, dtype=torch.int32) for _ in range(2)]  # context lengths, state slots
    return [*longs[:2], longs[2], *ints, torch.full((rows,), fill, dtype=torch.long),
            torch.full((rows, max_blocks), fill, dtype=torch.int32)]


@pytest.mark.parametrize("num_rows,rows", [(3, 3), (3, 8), (0, 4), (5, 16)])
def test_unpacked_decode_inputs_equal_the_reference_with_pending_ids_and_padding(torch_generator, num_rows, rows):
    max_blocks = 300  # wider than one column block of the kernel: the table loop takes two passes
    tables = [torch.randint(1, 500, (int(n),), generator=torch_generator).tolist()
              for n in torch.randint(1, max_blocks + 1, (num_rows,), generator=torch_generator)]
    ids = torch.randint(0, 1000, (num_rows,), generator=torch_generator)
    ids[::2] = -1  # pending: sampled on the device, filled in from last_tokens
    slots = torch.randperm(20, generator=torch_generator)[:num_rows] + 1
    packed = torch.frombuffer(reference.pack_decode_inputs(
        ids.tolist(), torch.arange(num_rows).tolist(), (torch.arange(num_rows) * 16 + 3).tolist(),
        (torch.arange(num_rows) + 5).tolist(), slots.tolist(), tables), dtype=torch.long)
    last_tokens = torch.randint(0, 1000, (21,), generator=torch_generator)
    want = _fixed_decode_buffers(rows, max_blocks, fill=77)
    got = _fixed_decode_buffers(rows, max_blocks, fill=77)
    reference.unpack_decode_inputs(packed, last_tokens, *want)
    step_inputs.unpack_decode_inputs(packed, last_tokens, *got)
    for expected, actual in zip(want, got):
        assert same_bits(actual, expected)
    input_ids, positions, _, seq_lens, state_slots, sample_slots, block_tables = got
    live = torch.arange(rows) < num_rows
    assert input_ids[:num_rows].tolist() == torch.where(ids < 0, last_tokens[slots], ids).tolist()
    assert input_ids[~live].eq(0).all() and seq_lens[~live].eq(1).all() and state_slots[~live].eq(0).all()
    assert sample_slots.tolist() == state_slots.tolist()
    width = max((len(t) for t in tables), default=0)
    for row, table in enumerate(tables):
        assert block_tables[row, :width].tolist() == table + [0] * (width - len(table))
    assert block_tables[num_rows:, :width].eq(0).all() and block_tables[:, width:].eq(77).all()


def test_unpacking_refuses_buffers_that_disagree():
    packed = torch.zeros(8, dtype=torch.long)
    buffers = _fixed_decode_buffers(4, 8, fill=0)
    with pytest.raises(ValueError, match="seq_lens must be \\[4\\]"):
        step_inputs.unpack_decode_inputs(packed, packed, *buffers[:3], buffers[3][:3], *buffers[4:])
    with pytest.raises(ValueError, match="packed decode inputs must be one int64 vector"):
        step_inputs.unpack_decode_inputs(packed.int(), packed, *buffers)
    # A runner that captures a decode graph before it has its last sampled tokens (measuring memory, say).
    with pytest.raises(ValueError, match="last_tokens must be one int64 vector, got NoneType"):
        step_inputs.unpack_decode_inputs(packed, None, *buffers)
