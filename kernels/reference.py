"""Plain-torch references for every kernel, with the dispatcher's exact signatures.

They run the engine on CPU and are what the Triton kernels are tested against. Pools are indexed by slot/block; slot 0
and block 0 are null: never read, never written, and rows whose slot is 0 produce zeros.

Layouts: conv state `[slots, conv_dim, W-1]` (the last W-1 raw pre-conv inputs, oldest first), recurrent state
`[slots, HV, V, K]` (V-first), token pools `k_cache`/`v_cache` `[num_blocks, block_size, Hkv, D]` holding
k / k_scale and v / v_scale (static per-layer scales, 1.0 unless the pool is fp8). Arithmetic is
float32 (float64 when the activations are float64, which tests use for a high-precision oracle), except in the
model's elementwise steps (norms, rotary, SwiGLU), which round where transformers' Qwen3.5 rounds: the residual sum
in the activation dtype, the zero-centred norm `norm(x) * (1 + w)` in fp32, the gated norm's `w * norm(x)` in the
activation dtype before the SiLU gate, rotary products and SiLU in the activation dtype.
"""

from __future__ import annotations

from array import array

import torch
import torch.nn.functional as F

from hybridkv.sizing.quantization import E4M3_MAX

# Chunk length of the chunked (prefill) form of the gated delta rule.
GDN_CHUNK_TOKENS = 64
# softplus switches to the identity above this input, as the model's kernels do.
SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, dtype: torch.dtype):
    """g = -exp(A_log) * softplus(a + dt_bias) (log-space decay, <= 0) and beta = sigmoid(b), both in `dtype`."""
    g = -A_log.to(dtype).exp() * F.softplus(a.to(dtype) + dt_bias.to(dtype), threshold=SOFTPLUS_THRESHOLD)
    return g, b.to(dtype).sigmoid()


def split_qkv(qkv: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int, dtype: torch.dtype):
    """Split `[rows, 2*H*K + HV*V]` into l2-normalised, K^-0.5-scaled q and l2-normalised k (each repeated to one head
    per v-head, `[rows, HV, K]`) and v `[rows, HV, V]`, all in `dtype`."""
    rows = qkv.shape[0]
    key_dim = num_k_heads * head_k_dim
    num_v_heads = (qkv.shape[1] - 2 * key_dim) // head_v_dim
    x = qkv.to(dtype)
    q = x[:, :key_dim].reshape(rows, num_k_heads, head_k_dim)
    k = x[:, key_dim : 2 * key_dim].reshape(rows, num_k_heads, head_k_dim)
    v = x[:, 2 * key_dim :].reshape(rows, num_v_heads, head_v_dim)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS) * head_k_dim**-0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    group = num_v_heads // num_k_heads
    return q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1), v


def check_gdn_shapes(qkv: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int, ssm_state: torch.Tensor):
    key_dim = num_k_heads * head_k_dim
    value_dim = qkv.shape[1] - 2 * key_dim
    num_v_heads = ssm_state.shape[1]
    if value_dim != num_v_heads * head_v_dim or num_v_heads % num_k_heads != 0:
        raise ValueError(
            f"qkv has {qkv.shape[1]} channels but 2*{num_k_heads}*{head_k_dim} + {num_v_heads}*{head_v_dim} were "
            f"expected (HV={num_v_heads} must be a multiple of H={num_k_heads})"
        )
    if tuple(ssm_state.shape[2:]) != (head_v_dim, head_k_dim):
        raise ValueError(f"ssm_state must be [slots, HV, V={head_v_dim}, K={head_k_dim}], got {tuple(ssm_state.shape)}")


def gdn_decode(qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, num_k_heads, head_k_dim, head_v_dim,
               prefetch_state: bool = False):
    """One gated delta-rule step per row, updating `ssm_state[slot_ids[i]]` in place; returns o `[B, HV, V]`.
    (`prefetch_state` is the Triton kernel's launch hint; the reference runs in order.)"""
    check_gdn_shapes(qkv, num_k_heads, head_k_dim, head_v_dim, ssm_state)
    dtype = compute_dtype(qkv.dtype)
    q, k, v = split_qkv(qkv, num_k_heads, head_k_dim, head_v_dim, dtype)
    g, beta = gdn_gates(a, b, A_log, dt_bias, dtype)
    slots = slot_ids.long()
    live = slots != 0
    # Null rows start from zero whatever slot 0 holds.
    state = torch.where(live[:, None, None, None], ssm_state[slots].to(dtype), 0.0)  # [B, HV, V, K]
    state = state * g.exp()[..., None, None]
    delta = (v - (state * k[:, :, None, :]).sum(-1)) * beta[..., None]  # [B, HV, V]
    state = state + delta[..., None] * k[:, :, None, :]
    o = torch.where(live[:, None, None], (state * q[:, :, None, :]).sum(-1), 0.0)
    ssm_state[slots[live]] = state[live].to(ssm_state.dtype)
    return o.to(qkv.dtype)


def chunk_decay(gcum: torch.Tensor) -> torch.Tensor:
    """`[HV, c, c]`: exp(gcum_i - gcum_j) for j <= i, zero above the diagonal; gcum `[HV, c]` the gates summed
    within the chunk."""
    c = gcum.shape[-1]
    lower = torch.ones(c, c, dtype=torch.bool, device=gcum.device).tril()
    return (gcum[:, :, None] - gcum[:, None, :]).masked_fill(~lower, float("-inf")).exp()


def chunk_transform(k, gcum, beta):
    """One chunk's T = I + strictly-lower(beta_i k_i.k_j decay_ij) `[HV, c, c]`: k `[HV, c, K]`, gcum and beta
    `[HV, c]`."""
    kkt = ((beta[..., None] * k) @ k.transpose(-1, -2)) * chunk_decay(gcum)
    return torch.eye(k.shape[1], dtype=k.dtype, device=k.device) + kkt.tril(-1)


def chunk_wy(k, v, gcum, beta):
    """One chunk's WY form: k `[HV, c, K]`, v `[HV, c, V]`, gcum and beta `[HV, c]` -> (w `[HV, c, K]`,
    u `[HV, c, V]`), u = T^-1 beta v, w = T^-1 beta k e^gcum with T = `chunk_transform(k, gcum, beta)`."""
    transform = chunk_transform(k, gcum, beta)
    u = torch.linalg.solve_triangular(transform, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(transform, beta[..., None] * k * gcum.exp()[..., None], upper=False,
                                      unitriangular=True)
    return w, u


def chunk_output(q, k, v_new, s, gcum):
    """One chunk's output `[HV, c, V]` from the state before it, s `[HV, K, V]`, and its new values v_new = u - w s."""
    return (q * gcum.exp()[..., None]) @ s + ((q @ k.transpose(-1, -2)) * chunk_decay(gcum)) @ v_new


def chunk_state_update(s, k, v_new, gcum):
    """The state after a chunk: s e^g_last + (k e^(g_last - gcum))^T v_new, s `[HV, K, V]`."""
    g_last = gcum[:, -1:]
    return s * g_last.exp()[..., None] + (k * (g_last - gcum).exp()[..., None]).transpose(-1, -2) @ v_new


def gdn_chunked_sequence(q, k, v, g, beta, state, on_chunk_start=None):
    """The gated delta rule over one sequence in chunks of GDN_CHUNK_TOKENS (the UT/WY form).

    q, k `[L, HV, K]` (normalised, q scaled), v `[L, HV, V]`, g, beta `[L, HV]`, state `[HV, V, K]`; all one dtype.
    `on_chunk_start(c, state)` sees the state `[HV, V, K]` before each chunk c.
    Returns (o `[L, HV, V]`, final state `[HV, V, K]`).
    """
    s = state.transpose(-1, -2)  # [HV, K, V]: the math below reads as in the papers
    outputs = []
    for start in range(0, q.shape[0], GDN_CHUNK_TOKENS):
        if on_chunk_start is not None:
            on_chunk_start(start // GDN_CHUNK_TOKENS, s.transpose(-1, -2))
        end = min(start + GDN_CHUNK_TOKENS, q.shape[0])
        qc, kc, vc = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [HV, c, *]
        gcum, bc = g[start:end].t().cumsum(-1), beta[start:end].t()  # [HV, c]
        w, u = chunk_wy(kc, vc, gcum, bc)
        v_new = u - w @ s
        outputs.append(chunk_output(qc, kc, v_new, s, gcum).transpose(0, 1))
        s = chunk_state_update(s, kc, v_new, gcum)
    return torch.cat(outputs, 0), s.transpose(-1, -2)


def gdn_prefill(
    qkv, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim, head_v_dim,
    cu_seqlens_cpu: list[int] | None = None, capture=None,
):
    """Varlen gated delta rule: sequence n starts from `ssm_state[slot_ids[n]]` and its final state is written back.

    A new request's slot must hold zeros (the engine zeroes slots when it allocates them). With `capture` =
    (chunk_slots, pool), chunk_slots int32 `[chunks]` numbering every sequence's GDN_CHUNK_TOKENS-token chunks in
    order: the state before each chunk whose entry is not -1 is also stored in that slot of `pool` (laid out as
    `ssm_state`). Returns o `[T, HV, V]`.
    """
    check_gdn_shapes(qkv, num_k_heads, head_k_dim, head_v_dim, ssm_state)
    dtype = compute_dtype(qkv.dtype)
    bounds = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.tolist()
    q, k, v = split_qkv(qkv, num_k_heads, head_k_dim, head_v_dim, dtype)
    g, beta = gdn_gates(a, b, A_log, dt_bias, dtype)
    o = torch.zeros(qkv.shape[0], ssm_state.shape[1], head_v_dim, dtype=qkv.dtype, device=qkv.device)
    chunk_slots = capture[0].tolist() if capture is not None else None
    first_chunk = 0
    for n, slot in enumerate(slot_ids.tolist()):
        start, end = bounds[n], bounds[n + 1]
        chunks = -(-(end - start) // GDN_CHUNK_TOKENS)
        first_chunk, this_first = first_chunk + chunks, first_chunk
        if slot == 0 or end == start:
            continue
        on_chunk_start = None
        if chunk_slots is not None:
            def on_chunk_start(chunk, state, first=this_first):
                if chunk_slots[first + chunk] >= 0:
                    capture[1][chunk_slots[first + chunk]] = state.to(capture[1].dtype)
        seq_o, final = gdn_chunked_sequence(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], ssm_state[slot].to(dtype),
            on_chunk_start,
        )
        o[start:end] = seq_o.to(qkv.dtype)
        ssm_state[slot] = final.to(ssm_state.dtype)
    return o


def _conv_silu(window: torch.Tensor, weight: torch.Tensor, out_rows: int) -> torch.Tensor:
    """Depthwise causal conv over `window` `[D, W-1+rows]` (history first), SiLU; returns `[rows, D]`."""
    y = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0]  # [D, out_rows]
    return F.silu(y[:, -out_rows:]).t() if out_rows else y.new_zeros(0, weight.shape[0])


def causal_conv1d_prefill(x, weight, conv_state, slot_ids, cu_seqlens):
    """Depthwise causal conv1d + SiLU per sequence, history from `conv_state[slot]`; the slot then holds the last
    W-1 raw inputs (history included when the chunk is shorter than W-1). Returns y `[T, D]` in x's dtype."""
    dtype = compute_dtype(x.dtype)
    y = torch.zeros_like(x)
    bounds = cu_seqlens.tolist()
    history_len = weight.shape[1] - 1
    for n, slot in enumerate(slot_ids.tolist()):
        start, end = bounds[n], bounds[n + 1]
        if slot == 0 or end == start:
            continue
        window = torch.cat([conv_state[slot].to(dtype), x[start:end].t().to(dtype)], dim=1)
        y[start:end] = _conv_silu(window, weight.to(dtype), end - start).to(x.dtype)
        conv_state[slot] = window[:, window.shape[1] - history_len :].to(conv_state.dtype)
    return y


def conv_gdn_prefill(
    x, conv_weight, conv_state, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim,
    head_v_dim, cu_seqlens_cpu: list[int] | None = None, capture=None,
):
    """A GDN layer's prefill from the raw projections: `causal_conv1d_prefill` (y rounded to x's dtype, as the layer
    stores it), then `gdn_prefill`. Both states come from and go back to each sequence's slot."""
    mixed = causal_conv1d_prefill(x, conv_weight, conv_state, slot_ids, cu_seqlens)
    return gdn_prefill(mixed, a, b, A_log, dt_bias, ssm_state, slot_ids, cu_seqlens, num_k_heads, head_k_dim,
                       head_v_dim, cu_seqlens_cpu=cu_seqlens_cpu, capture=capture)


def causal_conv1d_decode(x, weight, conv_state, slot_ids, prefetch_state: bool = False):
    """One conv step per row: window = `conv_state[slot]` + the new input, which is shifted into the slot.
    (`prefetch_state` is the Triton kernel's launch hint; the reference runs in order.)"""
    dtype = compute_dtype(x.dtype)
    slots = slot_ids.long()
    live = slots != 0
    history = torch.where(live[:, None, None], conv_state[slots].to(dtype), 0.0)
    window = torch.cat([history, x.to(dtype)[:, :, None]], dim=2)  # [B, D, W]
    y = torch.where(live[:, None], F.silu((window * weight.to(dtype)).sum(-1)), 0.0)
    conv_state[slots[live]] = window[live, :, 1:].to(conv_state.dtype)
    return y.to(x.dtype)


def _to_pool(x: torch.Tensor, scale: float, pool_dtype: torch.dtype) -> torch.Tensor:
    """x / scale in the pool's dtype; an fp8 pool rounds to nearest and saturates at ±E4M3_MAX."""
    scaled = x.to(compute_dtype(x.dtype)) * (1.0 / scale)  # the reciprocal, as the kernel multiplies by it
    if pool_dtype == torch.float8_e4m3fn:
        scaled = scaled.float().clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(pool_dtype)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0):
    """Store token t's k / k_scale and v / v_scale at flat slot `slot_mapping[t]` = block * block_size + offset;
    negative entries and the null block 0 are skipped. An fp8 pool (float8_e4m3fn) saturates at ±448."""
    block_size = k_cache.shape[1]
    live = slot_mapping >= block_size
    flat_slots = slot_mapping[live]
    k_cache.view(-1, *k_cache.shape[2:])[flat_slots] = _to_pool(k[live], k_scale, k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[flat_slots] = _to_pool(v[live], v_scale, v_cache.dtype)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q, max_seqlen_k,
                    k_scale: float = 1.0, v_scale: float = 1.0, out=None):
    """Causal softmax attention over paged K/V holding k / k_scale and v / v_scale; query i of sequence n sits at
    position seq_lens[n] - q_len + i. Written into `out` when given."""
    dtype = compute_dtype(q.dtype)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    o = torch.zeros_like(q) if out is None else out.zero_()
    bounds = cu_seqlens_q.tolist()
    for n, seq_len in enumerate(seq_lens.tolist()):
        start, end = bounds[n], bounds[n + 1]
        if end == start:
            continue
        positions = torch.arange(seq_len, device=q.device)
        blocks = block_tables[n].long()[positions // block_size]
        keys = k_cache[blocks, positions % block_size].to(dtype) * k_scale  # [L, Hkv, D]
        values = v_cache[blocks, positions % block_size].to(dtype) * v_scale
        group = num_q_heads // num_kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        query = q[start:end].to(dtype)
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        query_pos = seq_len - (end - start) + torch.arange(end - start, device=q.device)
        scores = scores.masked_fill(positions[None, None, :] > query_pos[None, :, None], float("-inf"))
        o[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return o


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x, weight, eps, residual=None):
    """Zero-centred RMSNorm over the last dim; with `residual`, normalises `x + residual` and returns it too."""
    if residual is not None:
        x = residual = residual + x
    normed = (_normalize(x, eps) * (1.0 + weight.float())).to(x.dtype)
    return normed if residual is None else (normed, residual)


def gated_rms_norm(x, gate, weight, eps):
    """`(w * rmsnorm(x)) * silu(gate)` over the last dim (norm before gate, plain weight)."""
    normed = weight * _normalize(x, eps).to(x.dtype)
    return (normed * F.silu(gate.float())).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(positions, q, k, inv_freq, rotary_dim):
    """NeoX rotary of the first `rotary_dim` dims of q `[T, Hq, D]` and k `[T, Hkv, D]` at `positions` `[T]`."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)

    def rotate(x):
        rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((rotated * cos + _rotate_half(rotated) * sin, passed), dim=-1)

    return rotate(q), rotate(k)


def qk_norm_rotary(q, k, q_weight, k_weight, eps, positions, inv_freq, rotary_dim):
    """Attention's per-head q and k norms (`rms_norm`), then `rotary` of both."""
    return rotary(positions, rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), inv_freq, rotary_dim)


def silu_and_mul(x):
    """SwiGLU over a merged `[gate | up]` projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- a decode step's inputs, packed on the host and unpacked on the device (`step_inputs`) ---
def pack_decode_inputs(input_ids, positions, slot_mapping, seq_lens, state_slots, block_tables) -> array:
    """One int64 buffer: `[n, width, input_ids[n], positions[n], slot_mapping[n], seq_lens[n], state_slots[n],
    block_tables n x width]`, n rows of one token each, every table padded with the null block 0 to the widest
    (`width`). Ids may be negative (pending: the device fills them in)."""
    num_rows = len(input_ids)
    width = max((len(table) for table in block_tables), default=0)
    packed = array("q", (num_rows, width))
    for part in (input_ids, positions, slot_mapping, seq_lens, state_slots):
        if len(part) != num_rows:
            raise ValueError(f"every field of a decode step has one entry a row ({num_rows}), got {len(part)}")
        packed.extend(part)
    extend_padded_tables(packed, block_tables, width)
    return packed


def extend_padded_tables(packed: array, block_tables, width: int) -> None:
    """Append each block table to `packed` (int64), padded with the null block 0 to `width` entries (C-level
    extends: a step of many long-context requests has tens of thousands of entries)."""
    padding = array("q", bytes(8 * width))
    for table in block_tables:
        packed.extend(table)
        packed.extend(padding[: width - len(table)])


def check_decode_inputs(packed, last_tokens, input_ids, positions, slot_mapping, seq_lens, state_slots,
                        sample_slots, block_tables) -> int:
    """The rows of the fixed buffers; ValueError if they disagree, or `packed` or `last_tokens` is not one int64
    vector."""
    rows = input_ids.shape[0]
    for name, vector in (("packed decode inputs", packed), ("last_tokens", last_tokens)):
        if not isinstance(vector, torch.Tensor) or vector.dtype != torch.int64 or vector.dim() != 1:
            got = f"{vector.dtype} {tuple(vector.shape)}" if isinstance(vector, torch.Tensor) else type(vector).__name__
            raise ValueError(f"{name} must be one int64 vector, got {got}")
    for name, tensor in (("positions", positions), ("slot_mapping", slot_mapping), ("seq_lens", seq_lens),
                         ("state_slots", state_slots), ("sample_slots", sample_slots)):
        if tuple(tensor.shape) != (rows,):
            raise ValueError(f"{name} must be [{rows}] like input_ids, got {tuple(tensor.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != rows or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [{rows}, max_blocks] with contiguous rows, got "
                         f"{tuple(block_tables.shape)} {block_tables.stride()}")
    return rows


def unpack_decode_inputs(packed, last_tokens, input_ids, positions, slot_mapping, seq_lens, state_slots,
                         sample_slots, block_tables):
    """Every row of the fixed buffers from `packed`: ids < 0 from `last_tokens[state slot]`; rows past the packed
    count are padding (token 0, position 0, slot mapping 0, context 1, state slot 0, a table of null blocks over the
    packed width); table columns past the width are left as they were."""
    rows = check_decode_inputs(packed, last_tokens, input_ids, positions, slot_mapping, seq_lens, state_slots,
                               sample_slots, block_tables)
    num_rows, width = int(packed[0]), int(packed[1])
    fields = packed[2 : 2 + 5 * num_rows].view(5, num_rows)
    ids, pos, flat, lens, slots = fields
    ids = torch.where(ids < 0, last_tokens[slots].to(ids.dtype), ids)
    padding = rows - num_rows
    for out, live, pad in ((input_ids, ids, 0), (positions, pos, 0), (slot_mapping, flat, 0), (seq_lens, lens, 1),
                           (state_slots, slots, 0), (sample_slots, slots, 0)):
        out.copy_(torch.cat((live, live.new_full((padding,), pad))))
    tables = packed[2 + 5 * num_rows : 2 + 5 * num_rows + num_rows * width].view(num_rows, width)
    block_tables[:, :width] = torch.cat((tables, tables.new_zeros(padding, width)))


# The MoE reference lives in its own file; the dispatcher finds every reference here.
from .moe_reference import fused_moe, moe_route, routed_moe  # noqa: E402,F401
