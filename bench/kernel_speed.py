"""Kernel benchmarks on a CUDA GPU: time, achieved bandwidth or FLOP rate, the fraction of the ceilings measured in
the same run (device-to-device copy, bf16 matmul), and fla's kernel or torch SDPA on the same inputs.

    python3 bench/kernel_speed.py [--out results.json] [--sweep]
    (scripts/gpu.sh bench/kernel_speed.py runs it on the H200)

Writes every measurement (launch-configuration sweeps included) as JSON and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import sys
import traceback

import torch
import triton
import triton.testing

from hybridkv import kernels
from hybridkv.kernels import attention, conv1d, fla_adapter, gdn_input, gdn_recurrent, gdn_state, gdn_wy, moe
from hybridkv.kernels.inputs import (
    AttentionGeometry,
    GdnGeometry,
    conv_weight,
    cu_seqlens_of,
    gdn_step_inputs,
    paged_attention_inputs,
    state_pools,
)

DEVICE = "cuda"
# Per-layer decode is timed over enough layers' pools that the working set is well past the 60 MB L2.
ROTATION_BYTES = 512 * 2**20


def time_us(fn, graph: bool = False, rep_ms: int = 200) -> float:
    """Median time of fn in µs; small kernels are captured in a CUDA graph so launch gaps don't count (falling back
    to plain launches for code that cannot be captured)."""
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3
        except RuntimeError as err:
            print(f"graph capture failed ({str(err)[:80]}); timing plain launches", flush=True)
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def kernel_split_us(fn, calls: int = 10) -> dict:
    """GPU time per call of each kernel `fn` launches, by kernel name (torch.profiler over `calls` calls after one
    unprofiled), largest first: where a multi-launch case's time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            totals[event.name[:60]] = totals.get(event.name[:60], 0.0) + event.device_time / calls
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def ceilings() -> dict:
    elements = 2**31  # 4 GiB of bf16 per buffer
    src = torch.randn(elements // 2**15, 2**15, device=DEVICE).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_us = time_us(lambda: dst.copy_(src))
    copy_tbps = 2 * src.numel() * 2 / copy_us / 1e6
    del src, dst
    # The copy buffers' 4 GiB segments go back to the driver before the matmul: cuBLAS's workspace, allocated by the
    # first matmul, would otherwise land in one of them and pin it for the life of the process, and an engine started
    # in the same process (bench/throughput.py) would count it as memory taken.
    torch.cuda.empty_cache()
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    mm_us = time_us(lambda: a @ b)
    return {"copy_tbps": copy_tbps, "copy_bytes": 2 * elements * 2, "matmul_bf16_tflops": 2 * 8192**3 / mm_us / 1e6}


class Report:
    def __init__(self, ceiling: dict, path: str):
        self.ceiling = ceiling
        self.path = path
        self.rows: list[dict] = []
        self.sweeps: list[dict] = []

    def save(self):
        """Rewritten after every measurement, so a run cut short still leaves its numbers."""
        result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "ceilings": self.ceiling, "results": self.rows, "sweeps": self.sweeps}
        with open(self.path, "w") as f:
            json.dump(result, f, indent=1)

    def add(self, kernel: str, case: str, us: float, *, bytes_moved: float | None = None, flops: float | None = None,
            baseline: str | None = None, baseline_us: float | None = None, **extra):
        row = {"kernel": kernel, "case": case, "time_us": us, **extra}
        if bytes_moved is not None:
            row["tbps"] = bytes_moved / us / 1e6
            row["fraction_of_copy"] = row["tbps"] / self.ceiling["copy_tbps"]
        if flops is not None:
            row["tflops"] = flops / us / 1e6
            row["fraction_of_matmul"] = row["tflops"] / self.ceiling["matmul_bf16_tflops"]
        if "bound_us" in row:
            row["fraction_of_bound"] = row["bound_us"] / us
        if baseline is not None:
            row.update(baseline=baseline, baseline_us=baseline_us, speed_vs_baseline=baseline_us / us)
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.save()

    def table(self) -> str:
        lines = [
            f"ceilings: copy {self.ceiling['copy_tbps']:.2f} TB/s, bf16 matmul {self.ceiling['matmul_bf16_tflops']:.0f}"
            " TFLOP/s",
            f"{'kernel':<22}{'case':<34}{'µs':>9}{'rate':>12}{'%ceil':>7}  {'baseline':<22}{'µs':>9}{'x':>6}",
        ]
        for r in self.rows:
            if "error" in r:
                lines.append(f"{r['kernel']:<22}{r['case']:<34} failed: {r['error'][:60]}")
                continue
            rate, frac = (f"{r['tbps']:.2f} TB/s", r["fraction_of_copy"]) if "tbps" in r else (
                f"{r['tflops']:.0f} TF/s", r["fraction_of_matmul"])
            base = (f"  {r['baseline']:<22}{r['baseline_us']:>9.1f}{r['speed_vs_baseline']:>6.2f}"
                    if "baseline" in r else "")
            bound = f"  ({100 * r['fraction_of_bound']:.0f}% of its bound)" if "fraction_of_bound" in r else ""
            if "whole_tiles_us" in r:
                bound += f"  (whole tiles {r['whole_tiles_us']:.1f} µs)"
            if "grouped_mm_us" in r:
                bound += f"  (torch grouped GEMMs {r['grouped_mm_us']:.1f} µs)"
            lines.append(f"{r['kernel']:<22}{r['case']:<34}{r['time_us']:>9.1f}{rate:>12}{100 * frac:>6.0f}%{base}"
                         f"{bound}")
        return "\n".join(lines)


def gdn_decode_bench(report: Report, geo: GdnGeometry, batch: int, ssm_dtype, sweep: bool):
    fused_recurrent_gated_delta_rule = fla_adapter.anchor("fused_recurrent_gated_delta_rule")
    gen = torch.Generator().manual_seed(batch)
    state_bytes = geo.num_v_heads * geo.head_v_dim * geo.head_k_dim * torch.finfo(ssm_dtype).bits // 8
    layers = max(1, min(64, math.ceil(ROTATION_BYTES / (batch * state_bytes))))
    pools = [state_pools(geo, batch, gen, device=DEVICE, ssm_dtype=ssm_dtype)[1] for _ in range(layers)]
    for pool in pools:
        pool[0] = 0
    inputs = gdn_step_inputs(geo, batch, gen, device=DEVICE)
    slot_ids = (torch.randperm(batch, generator=gen) + 1).to(DEVICE, torch.int32)
    heads = {"num_k_heads": geo.num_k_heads, "head_k_dim": geo.head_k_dim, "head_v_dim": geo.head_v_dim}
    moved = batch * (2 * state_bytes + inputs["qkv"][0].numel() * 2 + geo.num_v_heads * geo.head_v_dim * 2)
    case = f"HV={geo.num_v_heads} B={batch} {str(ssm_dtype)[6:]}"

    def ours(**launch):
        return lambda: [gdn_recurrent.gdn_decode(**inputs, ssm_state=p, slot_ids=slot_ids, **heads, **launch)
                        for p in pools]

    if sweep:
        for block_v in (8, 16, 32, 64):
            for num_warps in (1, 2, 4, 8):
                us = time_us(ours(block_v=block_v, num_warps=num_warps), graph=True, rep_ms=50) / layers
                report.sweeps.append({"kernel": "gdn_decode", "case": case, "block_v": block_v,
                                      "num_warps": num_warps, "time_us": us, "tbps": moved / us / 1e6})
    us = time_us(ours(), graph=True) / layers

    hk = geo.num_k_heads * geo.head_k_dim
    qkv = inputs["qkv"]
    q = qkv[:, :hk].reshape(batch, 1, geo.num_k_heads, geo.head_k_dim)
    k = qkv[:, hk : 2 * hk].reshape(batch, 1, geo.num_k_heads, geo.head_k_dim)
    v = qkv[:, 2 * hk :].reshape(batch, 1, geo.num_v_heads, geo.head_v_dim)
    # fla keeps a float32 state; it is compared on the float32 pools (read from them, written to a fresh tensor).
    dense = [p[1:] for p in pools] if ssm_dtype == torch.float32 else []

    def fla():
        return [fused_recurrent_gated_delta_rule(
            q, k, v, g=inputs["a"][:, None], beta=inputs["b"][:, None], initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"],
            use_beta_sigmoid_in_kernel=True, state_v_first=True) for h0 in dense]

    fla_us = time_us(fla, graph=True) / len(dense) if dense else None
    report.add("gdn_decode", case, us, bytes_moved=moved, baseline="fla fused_recurrent" if dense else None,
               baseline_us=fla_us, layers_rotated=layers)


def gdn_prefill_bench(report: Report, geo: GdnGeometry, lengths: list[int], sweep: bool = False):
    chunk_gated_delta_rule_fwd_h = fla_adapter.anchor("chunk_gated_delta_rule_fwd_h")
    chunk_gated_delta_rule = fla_adapter.anchor("chunk_gated_delta_rule")
    chunk_gated_delta_rule_fwd_intra = fla_adapter.anchor("chunk_gated_delta_rule_fwd_intra")
    recompute_w_u_fwd = fla_adapter.anchor("recompute_w_u_fwd")
    gen = torch.Generator().manual_seed(len(lengths))
    tokens = sum(lengths)
    conv_state, pool = state_pools(geo, len(lengths), gen, device=DEVICE)
    conv_state[0], pool[0] = 0, 0
    weight = conv_weight(geo, gen, device=DEVICE)
    inputs = gdn_step_inputs(geo, tokens, gen, device=DEVICE)
    slot_ids = (torch.arange(len(lengths)) + 1).to(DEVICE, torch.int32)
    cu = cu_seqlens_of(lengths, DEVICE)
    cu_cpu = cu.tolist()
    heads = {"num_k_heads": geo.num_k_heads, "head_k_dim": geo.head_k_dim, "head_v_dim": geo.head_v_dim}
    x = inputs["qkv"]
    case = f"HV={geo.num_v_heads} {len(lengths)}x{lengths[0]}"

    def path():
        kernels.conv_gdn_prefill(x, weight, conv_state, inputs["a"], inputs["b"], inputs["A_log"],
                                 inputs["dt_bias"], pool, slot_ids, cu, **heads, cu_seqlens_cpu=cu_cpu)

    gates = (inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"])
    conv = (weight, conv_state)
    q, k, v, g, beta = gdn_input.prepare_prefill_inputs(x, *gates, slot_ids, cu, **heads, conv=conv)
    g_cumsum = gdn_input.prepare_prefill_inputs(x, *gates, slot_ids, cu, **heads, conv=conv, gate_cumsum=True)[3]
    raw_q, raw_k = x[:, : q[0].numel()].reshape(q.shape).contiguous(), x[:, q[0].numel() : 2 * q[0].numel()]
    raw_k = raw_k.reshape(k.shape).contiguous()
    dense = pool[1:].float()  # the slots are 1..N in order
    cu_long, cu_cpu_long = cu.long(), torch.tensor(cu_cpu)
    bounds = fla_adapter.chunk_bounds(tuple(cu_cpu), torch.device(DEVICE))

    def fla_alone():
        chunk_gated_delta_rule(raw_q[None], raw_k[None], v[None], g[None], beta[None], initial_state=dense,
                               output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True,
                               cu_seqlens=cu_long, cu_seqlens_cpu=cu_cpu_long)

    def input_pass(config=None):
        return gdn_input.prepare_prefill_inputs(x, *gates, slot_ids, cu, **heads, conv=conv, config=config,
                                                gate_cumsum=True)

    # The input pass reads x and a/b, writes q/k/v and g/beta; the separate conv reads x and writes y.
    input_moved = 2 * tokens * geo.conv_dim * 2 + tokens * geo.num_v_heads * (2 * 2 + 2 * 4)
    if sweep:
        for heads_per_program, warps in ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4)):
            config = {"heads": heads_per_program, "num_warps": warps}
            us = time_us(lambda: input_pass(config), rep_ms=50)
            report.sweeps.append({"kernel": "gdn_prefill_inputs", "case": case, **config, "time_us": us,
                                  "tbps": input_moved / us / 1e6})
    A = fla_adapter.kkt_solve(k, g_cumsum, beta, bounds)
    w, u = gdn_wy.wy_form(k, v, A, beta, g_cumsum, bounds)
    h, v_new = gdn_state.chunk_states(k, w, u, g_cumsum, pool, slot_ids, bounds)
    scale = geo.head_k_dim**-0.5
    # Each pass reads each state once and writes it once, and writes h and v_new; the pass from the WY form reads
    # w, u, k and g, the folded one k, v, A, beta and g.
    written = h.nbytes + v_new.nbytes + 2 * pool[1:].nbytes
    state_moved = w.nbytes + u.nbytes + k.nbytes + g_cumsum.nbytes + written
    wy_moved = A.nbytes + k.nbytes + v.nbytes + beta.nbytes + g_cumsum.nbytes + w.nbytes + u.nbytes
    folded_moved = k.nbytes + v.nbytes + A.nbytes + beta.nbytes + g_cumsum.nbytes + written
    state_passes = {
        "gdn_chunk_states": (lambda config: gdn_state.chunk_states(k, w, u, g_cumsum, pool, slot_ids, bounds,
                                                                   config), state_moved),
        "gdn_folded_chunk_states": (lambda config: gdn_state.folded_chunk_states(k, v, A, beta, g_cumsum, pool,
                                                                                 slot_ids, bounds, config),
                                    folded_moved),
    }
    if sweep:
        for block, warps, stages in itertools.product((16, 32, 64), (2, 4), (2, 3, 4)):
            config = {"block": block, "num_warps": warps, "num_stages": stages}
            us = time_us(lambda: gdn_wy.wy_form(k, v, A, beta, g_cumsum, bounds, config), rep_ms=30)
            report.sweeps.append({"kernel": "gdn_wy_form", "case": case, **config, "time_us": us,
                                  "tbps": wy_moved / us / 1e6})
        configs = {
            "gdn_chunk_states": [{"block_v": bv, "num_stages": st} for bv in (32, 64) for st in (2, 3, 4)],
            "gdn_folded_chunk_states": [{"block_v": bv, "num_stages": st} for bv in (32, 64) for st in (1, 2, 3, 4)],
        }
        for name, (state_pass, moved) in state_passes.items():
            for config in configs[name]:
                try:
                    us = time_us(lambda: state_pass(config), rep_ms=30)  # timed before config changes
                except triton.runtime.errors.OutOfResources as err:
                    report.sweeps.append({"kernel": name, "case": case, **config, "error": str(err)[:120]})
                    continue
                report.sweeps.append({"kernel": name, "case": case, **config, "time_us": us,
                                      "tbps": moved / us / 1e6})

    # Anchors: fla's whole intra stage (zero fill, kkt-and-solve, w and u: what the solve and the WY-form pass
    # replace), its w/u kernel alone on its zero-filled A, and its chunk-state stage on dense copies of the states,
    # alone and with the w/u kernel before it (what the folded pass replaces).
    def fla_intra():
        return chunk_gated_delta_rule_fwd_intra(k=k[None], v=v[None], g=g_cumsum[None], beta=beta[None],
                                                cu_seqlens=bounds[0], chunk_indices=bounds[1])

    fla_A = fla_intra()[2]

    def fla_w_u():
        recompute_w_u_fwd(k=k[None], v=v[None], beta=beta[None], A=fla_A, g=g_cumsum[None], cu_seqlens=bounds[0],
                          chunk_indices=bounds[1])

    def fla_state_pass():
        chunk_gated_delta_rule_fwd_h(k=k[None], w=w[None], u=u[None], g=g_cumsum[None], initial_state=dense,
                                     output_final_state=True, state_v_first=True, cu_seqlens=bounds[0],
                                     chunk_indices=bounds[1], chunk_offsets=bounds[2])

    def fla_w_u_and_state_pass():
        fla_w_u()
        fla_state_pass()

    parts = {
        "input_pass_with_conv": input_pass,
        "fla_intra": fla_intra,
        "fla_solve": lambda: fla_adapter.kkt_solve(k, g_cumsum, beta, bounds),
        "wy_form": lambda: gdn_wy.wy_form(k, v, A, beta, g_cumsum, bounds),
        "fla_w_u": fla_w_u,
        "state_pass_from_w_u": lambda: gdn_state.chunk_states(k, w, u, g_cumsum, pool, slot_ids, bounds),
        "folded_state_pass": lambda: gdn_state.folded_chunk_states(k, v, A, beta, g_cumsum, pool, slot_ids, bounds),
        "fla_output": lambda: fla_adapter.output_stage(q, k, v_new, h, g_cumsum, scale, bounds),
        "fla_state_pass_dense": fla_state_pass,
        "fla_w_u_and_state_pass_dense": fla_w_u_and_state_pass,
        "conv1d_prefill_alone": lambda: conv1d.causal_conv1d_prefill(x, weight, conv_state, slot_ids, cu),
    }
    part_us = {name: time_us(fn) for name, fn in parts.items()}
    fla_us = time_us(fla_alone)
    us = time_us(path)
    # Fewest bytes the path must move: x in, o out, each state in and out.
    moved = tokens * geo.conv_dim * 2 + tokens * geo.num_v_heads * geo.head_v_dim * 2 + 2 * pool[1:].nbytes
    report.add("gdn_prefill_path", case, us, bytes_moved=moved, baseline="fla chunk alone", baseline_us=fla_us,
               parts_us=part_us, tokens_per_s=tokens / us * 1e6)
    report.add("gdn_prefill_inputs", case, part_us["input_pass_with_conv"], bytes_moved=input_moved)
    report.add("gdn_wy_form", case, part_us["wy_form"], bytes_moved=wy_moved, baseline="fla recompute_w_u",
               baseline_us=part_us["fla_w_u"])
    report.add("gdn_chunk_states", case, part_us["state_pass_from_w_u"], bytes_moved=state_moved,
               baseline="fla chunk_fwd_h dense", baseline_us=part_us["fla_state_pass_dense"])
    report.add("gdn_folded_chunk_states", case, part_us["folded_state_pass"], bytes_moved=folded_moved,
               baseline="fla w/u + fwd_h dense", baseline_us=part_us["fla_w_u_and_state_pass_dense"])
    report.add("conv1d_prefill", case, part_us["conv1d_prefill_alone"], bytes_moved=2 * tokens * geo.conv_dim * 2)


def conv_decode_bench(report: Report, geo: GdnGeometry, batch: int):
    gen = torch.Generator().manual_seed(batch)
    layers = max(1, min(64, math.ceil(ROTATION_BYTES / (batch * geo.conv_dim * 3 * 2))))
    pools = [state_pools(geo, batch, gen, device=DEVICE)[0] for _ in range(layers)]
    weight = conv_weight(geo, gen, device=DEVICE)
    x = torch.randn(batch, geo.conv_dim, generator=gen).to(DEVICE, torch.bfloat16)
    slot_ids = (torch.randperm(batch, generator=gen) + 1).to(DEVICE, torch.int32)
    us = time_us(lambda: [kernels.causal_conv1d_decode(x, weight, p, slot_ids) for p in pools], graph=True) / layers
    moved = batch * geo.conv_dim * (3 * 2 * 2 + 2 * 2)
    report.add("conv1d_decode", f"D={geo.conv_dim} B={batch}", us, bytes_moved=moved, layers_rotated=layers)


def decode_attention_inputs(geo: AttentionGeometry, batch: int, context: int):
    """`batch` decode rows of `context` keys each in bf16 pages (the null block zeroed), the case's name, and the
    generator they were drawn from (seeded by the shape), for a case's further draws."""
    gen = torch.Generator().manual_seed(batch * context)
    inputs = paged_attention_inputs(geo, [context] * batch, [1] * batch, gen, device=DEVICE)
    inputs["k_cache"][0], inputs["v_cache"][0] = 0, 0
    return inputs, f"Hq={geo.num_q_heads}/{geo.num_kv_heads} B={batch} ctx={context}", gen


def attention_decode_bench(report: Report, geo: AttentionGeometry, batch: int, context: int, sweep: bool):
    inputs, case, gen = decode_attention_inputs(geo, batch, context)
    moved = 2 * batch * context * geo.num_kv_heads * geo.head_dim * 2
    if sweep:
        configs = [{"block_n": n, "num_warps": w, "num_stages": st} for n in (32, 64) for w in (4, 8)
                   for st in (2, 3, 4)]
        configs += [{"segments": segments, "block_n": n} for segments in (1, 2, 4, 8, 16, 32, 64, 128) for n in (32, 64)]
        for config in configs:
            try:
                us = time_us(lambda: attention.paged_attention(**inputs, config=config), graph=True, rep_ms=50)
            except triton.runtime.errors.OutOfResources as err:
                report.sweeps.append({"kernel": "paged_decode", "case": case, **config, "error": str(err)[:120]})
                continue
            report.sweeps.append({"kernel": "paged_decode", "case": case, **config, "time_us": us,
                                  "tbps": moved / us / 1e6})
    # Both in CUDA graphs, as the engine runs decode: a small batch's kernels take less time than launching them.
    us = time_us(lambda: kernels.paged_attention(**inputs), graph=True)
    q = inputs["q"][:, :, None, :]
    k = torch.randn(batch, geo.num_kv_heads, context, geo.head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn_like(k)
    sdpa_us = time_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                      graph=True)
    report.add("paged_decode", case, us, bytes_moved=moved, baseline="torch SDPA contiguous", baseline_us=sdpa_us)


def attention_captured_bench(report: Report, geo: AttentionGeometry, batch: int, context: int, max_model_len: int):
    """Decode attention as a captured decode graph launches it: the engine captures its decode steps once, at
    start-up, for contexts up to `max_model_len`, so the keys are split for that length whatever the context (the
    extra segments walk no keys and the merge reads every one). Timed against the launch sized for the context."""
    inputs, case, _ = decode_attention_inputs(geo, batch, context)
    moved = 2 * batch * context * geo.num_kv_heads * geo.head_dim * 2
    captured = {**inputs, "max_seqlen_k": max_model_len}
    segments = {name: attention.launch_for(inputs["q"], inputs["k_cache"], batch, 1, launched["max_seqlen_k"])[
        "segments"] for name, launched in (("context", inputs), ("captured", captured))}
    sized_us = time_us(lambda: kernels.paged_attention(**inputs), graph=True)
    us = time_us(lambda: kernels.paged_attention(**captured), graph=True)
    report.add("paged_decode_captured", f"{case} max_model_len={max_model_len}", us, bytes_moved=moved,
               baseline="the launch sized for the context",
               baseline_us=sized_us, segments=segments["captured"], context_segments=segments["context"])


def fp8_decode_bench(report: Report, geo: AttentionGeometry, batch: int, context: int):
    """Paged decode over fp8 (e4m3) pages against the same kernel over bf16 pages: half the bytes read per token."""
    inputs, case, _ = decode_attention_inputs(geo, batch, context)
    k_scale, v_scale = 0.02, 0.015
    fp8 = {**inputs, **{name: (inputs[name].float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                        for name, scale in (("k_cache", k_scale), ("v_cache", v_scale))}}
    bf16_us = time_us(lambda: kernels.paged_attention(**inputs), graph=True)
    us = time_us(lambda: kernels.paged_attention(**fp8, k_scale=k_scale, v_scale=v_scale), graph=True)
    moved = 2 * batch * context * geo.num_kv_heads * geo.head_dim * 1
    report.add("paged_decode_fp8", case, us, bytes_moved=moved, baseline="paged_decode bf16 pages",
               baseline_us=bf16_us)


def attention_prefill_bench(report: Report, geo: AttentionGeometry, seq_len: int, q_len: int, sweep: bool):
    gen = torch.Generator().manual_seed(seq_len + q_len)
    inputs = paged_attention_inputs(geo, [seq_len], [q_len], gen, device=DEVICE)
    inputs["k_cache"][0], inputs["v_cache"][0] = 0, 0
    prefix = seq_len - q_len
    visible_pairs = q_len * prefix + q_len * (q_len + 1) / 2
    flops = 4 * visible_pairs * geo.num_q_heads * geo.head_dim
    case = f"Hq={geo.num_q_heads}/{geo.num_kv_heads} q={q_len} ctx={seq_len}"
    if sweep:
        group_pad = triton.next_power_of_2(geo.num_q_heads // geo.num_kv_heads)
        configs = [{"block_q": m // group_pad, "block_n": n, "num_warps": w, "num_stages": 2}
                   for m in (64, 128) for n in (32, 64) for w in (4, 8)]
        configs.append({"num_stages": 3})
        for config in configs:
            try:
                us = time_us(lambda: attention.paged_attention(**inputs, config=config), rep_ms=50)
            except triton.runtime.errors.OutOfResources as err:
                report.sweeps.append({"kernel": "paged_prefill", "case": case, **config, "error": str(err)[:120]})
                continue
            report.sweeps.append({"kernel": "paged_prefill", "case": case, **config, "time_us": us,
                                  "tflops": flops / us / 1e6})
    us = time_us(lambda: kernels.paged_attention(**inputs))
    baseline = baseline_us = None
    if prefix == 0:
        q = inputs["q"].transpose(0, 1)[None]
        k = torch.randn(1, geo.num_kv_heads, seq_len, geo.head_dim, generator=gen).to(DEVICE, torch.bfloat16)
        v = torch.randn_like(k)
        baseline, baseline_us = "torch SDPA causal", time_us(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    report.add("paged_prefill", case, us, flops=flops, baseline=baseline, baseline_us=baseline_us)


def mixed_attention_parts(inputs: dict, num_decodes: int):
    """The engine's paged-attention launches of a step (`BatchContext.attention_parts`) over these inputs."""
    from hybridkv.sidecar.model.context import BatchContext

    seq_lens = inputs["seq_lens"].tolist()
    device = inputs["q"].device
    # Attention reads none of the step's K/V slots or state slots.
    ctx = BatchContext(num_decodes=num_decodes, cu_seqlens_q=inputs["cu_seqlens_q"],
                       cu_seqlens_q_cpu=inputs["cu_seqlens_q"].tolist(), seq_lens=inputs["seq_lens"],
                       block_tables=inputs["block_tables"],
                       slot_mapping=torch.empty(0, dtype=torch.long, device=device),
                       state_slot_ids=torch.zeros(len(seq_lens), dtype=torch.int32, device=device),
                       max_seqlen_q=inputs["max_seqlen_q"], max_seqlen_k=inputs["max_seqlen_k"],
                       decode_max_seqlen_k=max(seq_lens[:num_decodes]),
                       prefill_max_seqlen_k=max(seq_lens[num_decodes:]))
    return ctx.attention_parts


def attention_mixed_bench(report: Report, geo: AttentionGeometry, decodes: int, decode_context: int, q_len: int,
                          context: int, sweep: bool):
    """A mixed step's attention: `decodes` decode rows beside one prefill chunk of `q_len` tokens ending at
    `context`, launched as the engine does (decode rows and the chunk apart, each sized for its own rows) against
    one launch sized for the longest query; with `sweep`, the chunk's launch at each number of key segments."""
    gen = torch.Generator().manual_seed(decodes * q_len + context)
    inputs = paged_attention_inputs(geo, [decode_context] * decodes + [context], [1] * decodes + [q_len], gen,
                                    device=DEVICE)
    inputs["k_cache"][0], inputs["v_cache"][0] = 0, 0
    parts = mixed_attention_parts(inputs, decodes)
    q, out = inputs["q"], torch.empty_like(inputs["q"])
    pools = {name: inputs[name] for name in ("k_cache", "v_cache", "scale")}

    def launch(rows, config=None):
        attention.paged_attention(q[rows.first : rows.end], block_tables=rows.block_tables,
                                  cu_seqlens_q=rows.cu_seqlens_q, seq_lens=rows.seq_lens,
                                  max_seqlen_q=rows.max_seqlen_q, max_seqlen_k=rows.max_seqlen_k,
                                  out=out[rows.first : rows.end], config=config, **pools)

    case = f"Hq={geo.num_q_heads}/{geo.num_kv_heads} B={decodes} ctx={decode_context} + q={q_len} ctx={context}"
    if sweep:
        for segments in (1, 2, 4, 8, 16):
            us = time_us(lambda: launch(parts[-1], {"segments": segments}), rep_ms=50)
            report.sweeps.append({"kernel": "paged_mixed", "case": case, "part": "prefill", "segments": segments,
                                  "time_us": us})
    one_us = time_us(lambda: kernels.paged_attention(**inputs))
    us = time_us(lambda: [launch(rows) for rows in parts])
    visible_pairs = decodes * decode_context + q_len * (context - q_len) + q_len * (q_len + 1) / 2
    chunk_launch = attention.launch_for(q, inputs["k_cache"], 1, q_len, context)
    report.add("paged_mixed", case, us, flops=4 * visible_pairs * geo.num_q_heads * geo.head_dim,
               baseline="one launch for the step", baseline_us=one_us, prefill_segments=chunk_launch["segments"])


def write_kv_bench(report: Report, geo: AttentionGeometry, tokens: int):
    gen = torch.Generator().manual_seed(tokens)
    pool = paged_attention_inputs(geo, [tokens], [1], gen, device=DEVICE)
    slot_mapping = (torch.randperm(tokens, generator=gen) + geo.block_size).to(DEVICE)
    k = torch.randn(tokens, geo.num_kv_heads, geo.head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn_like(k)
    us = time_us(lambda: kernels.write_kv_cache(k, v, pool["k_cache"], pool["v_cache"], slot_mapping))
    report.add("write_kv_cache", f"T={tokens} Hkv={geo.num_kv_heads}", us, bytes_moved=4 * k.nbytes)

def moe_launches(tokens: int) -> list:
    """The launch configurations the --sweep tries for the fused MoE kernel at one size."""
    if tokens == 1:  # the gate/up GEMV's rows, K tile and warps a program; the down projection's columns and warps
        rule = moe.launch_for(8, 256)
        grid = itertools.product((2, 4), (128, 256, 512), (2, 4), (2, 4, 8), (4, 8))
        return [dataclasses.replace(rule, one_token_gate_up_block_n=n, one_token_gate_up_block_k=k,
                                    one_token_gate_up_warps=w, one_token_down_block_n=down_n,
                                    one_token_down_warps=down_w)
                for n, k, w, down_n, down_w in grid if n * k <= 2048]  # wider tiles were slower on the H200
    if tokens <= 256:
        grid = itertools.product((16,), (16, 32, 64, 128), (64, 128), (4,), (3, 4))
        return [moe.MoeLaunch(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=st)
                for m, n, k, w, st in grid]
    # Prefill: the rule's tiles and their neighbours (weight tiles through the tensor memory accelerator, faster in
    # every tile shape of an earlier sweep), each with experts' runs padded to whole tiles and to a half and a
    # quarter of one (an expert's last rows in a smaller tile).
    tiles = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 8, 3), (128, 256, 64, 8, 3),
             (64, 128, 64, 4, 3), (128, 64, 64, 4, 3))
    launches = [moe.MoeLaunch(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=st, tma=True,
                              align_m=m // parts if parts > 1 else 0)
                for (m, n, k, w, st), parts in itertools.product(tiles, (1, 2, 4))]
    # Wider column tiles read each tile's rows fewer times through the L2, which bounds these GEMMs: the gate/up
    # kernel's 256 gate and 256 up columns on sixteen warps in two stages (three do not fit shared memory), and the
    # down projection's own tiles of 256 columns (one accumulator, so eight warps hold them), on the rule's rows.
    rule = moe.launch_for(tokens * 8, 256)
    wide = dataclasses.replace(rule, block_n=256, num_warps=16, num_stages=2)
    downs = ((0, 0, 0), (256, 8, 3), (256, 8, 4), (256, 16, 3), (128, 8, 4))
    launches += [dataclasses.replace(base, down_block_n=n, down_num_warps=w, down_num_stages=st)
                 for base in (rule, wide) for n, w, st in downs if (base, n) != (rule, 0)]
    return launches


def moe_prefill_bound_us(ceiling: dict, flops: float, moved: float) -> float:
    """The least time a prefill-sized MoE layer can take at the ceilings measured: its products at the bf16 matmul
    rate, or its expert (and activation) bytes at the copy rate, whichever is longer."""
    return max(flops / ceiling["matmul_bf16_tflops"] / 1e6, moved / ceiling["copy_tbps"] / 1e6)


def fused_moe_bench(report: Report, tokens: int, num_experts: int = 256, top_k: int = 8, hidden: int = 2048,
                    intermediate: int = 512, sweep: bool = False, e4m3: bool = False):
    """One MoE layer of Qwen3.5-35B-A3B's geometry (256 experts of width 512, 8 per token, hidden 2048) on `tokens`
    tokens, against a loop of per-expert matmuls over the same grouping (computed outside the timing). Decode sizes
    report the bandwidth on the distinct expert bytes read, prefill sizes the matmul rate. With `e4m3`, the experts
    are block-scaled e4m3 (128-square blocks) and the baseline is the same kernel on the bf16 experts."""
    gen = torch.Generator().manual_seed(tokens)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5).to(DEVICE, torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=gen) / intermediate**0.5).to(DEVICE,
                                                                                                 torch.bfloat16)
    expert_bytes = 3 * hidden * intermediate * 2
    hit = min(num_experts, tokens * top_k)
    # Decode routings rotate through disjoint expert sets, so the timed loop reads more than the 60 MB L2 holds.
    rotations = max(1, min(num_experts // hit, math.ceil(ROTATION_BYTES / (hit * expert_bytes))))
    routings = []
    for rotation in range(rotations):
        logits = torch.randn(tokens, num_experts, generator=gen)
        if hit < num_experts:  # restrict this rotation to its own block of experts
            allowed = torch.zeros(num_experts, dtype=torch.bool)
            allowed[rotation * hit : (rotation + 1) * hit] = True
            logits = logits.masked_fill(~allowed, float("-inf"))
        weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
        routings.append((weights.to(DEVICE), ids.to(DEVICE, torch.int32)))
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    distinct = sum(torch.unique(ids).numel() for _, ids in routings) / rotations
    moved = distinct * expert_bytes + tokens * hidden * 2 * 2
    flops = 2 * tokens * top_k * 3 * hidden * intermediate
    case = f"T={tokens} E={num_experts} k={top_k} H={hidden} I={intermediate}"
    if sweep:
        for launch in moe_launches(tokens):
            config = dataclasses.asdict(launch)
            try:
                swept = time_us(lambda: [moe.fused_moe(x, w13, w2, weights, ids, launch=launch) for weights, ids in routings],
                                graph=True, rep_ms=50) / rotations
            except Exception as err:  # noqa: BLE001 - a configuration that does not compile or fit is skipped
                report.sweeps.append({"kernel": "fused_moe", "case": case, **config, "error": repr(err)[:120]})
                continue
            report.sweeps.append({"kernel": "fused_moe", "case": case, **config, "time_us": swept})
    us = time_us(lambda: [moe.fused_moe(x, w13, w2, weights, ids) for weights, ids in routings],
                 graph=True) / rotations
    if e4m3:
        from hybridkv.kernels.quant_reference import quantize_fp8_block

        stored = {}
        for name, stack, halves in (("w13", w13, 2), ("w2", w2, 1)):
            parts = [[quantize_fp8_block(half.float(), (128, 128)) for half in expert.chunk(halves)]
                     for expert in stack]
            stored[name] = torch.stack([torch.cat([values for values, _ in halves_]) for halves_ in parts])
            stored[f"{name}_scale"] = torch.stack([torch.cat([scale for _, scale in halves_]) for halves_ in parts])
        fp8_us = time_us(lambda: [moe.fused_moe(x, stored["w13"], stored["w2"], weights, ids, stored["w13_scale"],
                                                stored["w2_scale"]) for weights, ids in routings],
                         graph=True) / rotations
        scale_bytes = (stored["w13_scale"][0].nbytes + stored["w2_scale"][0].nbytes)
        fp8_moved = distinct * (expert_bytes // 2 + scale_bytes) + tokens * hidden * 2 * 2
        decode = tokens <= 256
        report.add("fused_moe_fp8", case, fp8_us, bytes_moved=fp8_moved if decode else None,
                   flops=None if decode else flops, baseline="fused_moe, bf16 experts", baseline_us=us,
                   distinct_experts=distinct, layers_rotated=rotations)
        return

    groups = []
    for weights, ids in routings:
        flat = ids.reshape(-1).long()
        per_expert = [(int(e), (flat == e).nonzero()[:, 0]) for e in torch.unique(flat).tolist()]
        groups.append([(e, rows // top_k, weights.reshape(-1)[rows, None].to(torch.bfloat16))
                       for e, rows in per_expert])

    def loop():
        for grouping in groups:
            out = torch.zeros_like(x)
            for expert, token_ids, token_weights in grouping:
                gate, up = (x[token_ids] @ w13[expert].T).chunk(2, dim=-1)
                out.index_add_(0, token_ids, (torch.nn.functional.silu(gate) * up) @ w2[expert].T * token_weights)

    loop_us = time_us(loop, graph=True) / rotations
    decode = tokens <= 256
    # At prefill sizes every expert is read too: the layer takes at least the longer of its products at the matmul
    # rate and its expert bytes at the copy rate (on a GPU whose copy is slow against its matmul, the bytes).
    # At prefill sizes the layer is several launches (the rows' alignment, the two GEMMs, the combine): each one's
    # share, from the profiler.
    bound = {} if decode else {"bound_us": moe_prefill_bound_us(report.ceiling, flops, moved),
                               "kernels_us": kernel_split_us(lambda: moe.fused_moe(x, w13, w2, *routings[0]))}
    if tokens == 1:  # one token's gate/up through the tensor-core tiles instead of the GEMV, in the same run
        tiles = dataclasses.replace(moe.launch_for(top_k, num_experts), one_token_gemv=False)
        bound["tile_gate_up_us"] = time_us(lambda: [moe.fused_moe(x, w13, w2, weights, ids, launch=tiles)
                                                    for weights, ids in routings], graph=True) / rotations
    if not decode and grouped_mm_available(DEVICE):  # the layer through torch's grouped GEMMs, in the same run
        grouped = [grouped_mm_moe(x, w13, w2, weights, ids) for weights, ids in routings]
        bound["grouped_mm_us"] = time_us(lambda: [layer() for layer in grouped], graph=True) / rotations
    rule = moe.launch_for(tokens * top_k, num_experts)
    if rule.tile_blocks > 1:  # the same tiles with each expert's run padded to whole ones, in the same run
        whole = dataclasses.replace(rule, align_m=0)
        bound["whole_tiles_us"] = time_us(lambda: [moe.fused_moe(x, w13, w2, weights, ids, launch=whole)
                                                   for weights, ids in routings], graph=True) / rotations
    report.add("fused_moe", case, us, bytes_moved=moved if decode else None, flops=None if decode else flops,
               baseline="per-expert matmul loop", baseline_us=loop_us, distinct_experts=distinct,
               layers_rotated=rotations, **bound)


def grouped_mm_moe(x, w13, w2, weights, ids):
    """The MoE layer through torch's grouped GEMMs (`torch._grouped_mm`, CUTLASS's on Hopper) on the same routing:
    the rows gathered in expert order, the gate/up GEMM, the SiLU product, the down GEMM, each row scaled by its
    routing weight and summed into its token. The grouping (the expert order and its offsets) is made once, here; the
    function returned runs the rest, so what is timed leaves the grouping out, as the per-expert loop's timing does."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offsets = torch.cumsum(torch.bincount(flat, minlength=w13.shape[0]), 0).to(torch.int32)
    tokens = order // top_k
    row_weights = weights.reshape(-1)[order, None].to(x.dtype)
    # Where each (token, choice) row went in expert order: the rows come back in token order and each token's top_k
    # sum in one reduction (no atomics), as a plain torch MoE combines them.
    back = torch.argsort(order)
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    intermediate = w2.shape[2]

    def layer():
        gate_up = torch._grouped_mm(x.index_select(0, tokens), w13_t, offs=offsets)
        product = torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        down = torch._grouped_mm(product, w2_t, offs=offsets) * row_weights
        return down.index_select(0, back).view(x.shape[0], top_k, -1).sum(1, dtype=torch.float32).to(x.dtype)

    return layer


def grouped_mm_available(device) -> bool:
    """torch's grouped GEMM runs bf16 on Hopper (compute capability 9.x) and on the CPU."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return str(device) == "cpu" or torch.cuda.get_device_capability(device)[0] == 9


# The fused MoE's rows: decode sizes (bandwidth) and prefill sizes (the matmul).
FUSED_MOE_TOKENS = (1, 16, 64, 256, 4096, 8192, 16384)


def quantized_gemm_configs(method: str, tokens: int) -> list[dict]:
    """The launch configurations the --sweep tries for one GEMM size: W4A16 at one token on its CUDA-core kernel
    (block_m 1; block_k is input channels per tile), otherwise tensor-core tiles with split K too (FP8: 0 is the
    kernel's own choice; W4A16: K tiles of one group); FP8 prefill tiles with and without grouped tile order."""
    if tokens == 1 and method == "awq":
        return [{"block_m": 1, "block_n": n, "num_warps": 4, "num_stages": st, "block_k": k, "split_k": split}
                for n in (128, 256, 512) for k in (32, 64, 128) for st in (2, 3) for split in (0, 1)]
    if tokens == 1 and method == "w4a16":
        return [{"block_m": 1, "block_n": n, "num_warps": w, "num_stages": 1, "block_k": k, "split_k": split}
                for n in (16, 32, 64) for k in (128, 256, 512) for w in (2, 4, 8) for split in (0, 1, 2)]
    if tokens > 64:
        tiles = [(64, 256, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4), (64, 128, 4, 4),
                 (128, 256, 8, 3), (128, 64, 4, 4)]
        return [{"block_m": m, "block_n": n, "num_warps": w, "num_stages": st, "group_m": g, "split_k": 1}
                for m, n, w, st in tiles for g in (1, 8)]
    if tokens <= 16:
        grid = itertools.product((16,), (16, 32, 64, 128), (4,), (4, 5))
        splits = (0, 1, 2, 4)
    else:
        grid = itertools.product((16, 32, 64), (32, 64, 128), (4,), (3, 4))
        splits = (0, 1, 2, 4, 8)
    configs = [{"block_m": m, "block_n": n, "num_warps": w, "num_stages": st} for m, n, w, st in grid]
    if method in ("w4a16", "awq"):
        return [{**config, "block_k": 128, "split_k": split} for config in configs for split in (1, 2, 4, 8)]
    configs = [{**config, "split_k": split} for config in configs for split in splits]
    if tokens > 16:
        # Around the rule for narrow outputs loaded through the TMA: 64 x 64 tiles, K in three shares, six stages.
        configs += [{"block_m": 64, "block_n": n, "num_warps": 4, "num_stages": st, "split_k": split}
                    for n in (64, 128) for st in (4, 6, 8) for split in (2, 3, 6)]
    return configs


def quantized_gemm_bench(report: Report, method: str, tokens: int, out_features: int = 17408,
                         in_features: int = 5120, sweep: bool = False):
    """The FP8 or W4A16 GEMM (`method` "w4a16": the compressed-tensors layout; "awq": AWQ's) against torch's bf16
    matmul on the same shape (default: Qwen3.5-27B's MLP gate|up; the down projection is 5120 x 17408). Weights
    rotate through enough copies that the timed loop reads from memory, not the 60 MB L2."""
    from hybridkv.kernels import fp8_gemm, quant_reference, w4a16_gemm

    gen = torch.Generator().manual_seed(tokens)
    dense = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    x = torch.randn(tokens, in_features, generator=gen).to(DEVICE, torch.bfloat16)
    copies = max(1, math.ceil(ROTATION_BYTES / (dense.numel() * 2)))
    weight_bf16 = [dense.to(DEVICE, torch.bfloat16) for _ in range(copies)]
    if method == "fp8":
        weight, scale_inv = (t.to(DEVICE) for t in quant_reference.quantize_fp8_block(dense, (128, 128)))
        stored = [(weight.clone(), scale_inv.clone()) for _ in range(copies)]
        stored_bytes = weight.nbytes + scale_inv.nbytes
        run = lambda config=None: [fp8_gemm.fp8_linear(x, w, s, (128, 128), config) for w, s in stored]  # noqa: E731
    else:
        awq = method == "awq"
        packed = {k: t.to(DEVICE) for k, t in quant_reference.quantize_w4(
            dense, 128, awq, False, torch.float16 if awq else torch.bfloat16).items()}
        stored = [{k: t.clone() for k, t in packed.items()} for _ in range(copies)]
        stored_bytes = sum(t.nbytes for t in packed.values())
        names = ("qweight", "scales", "qzeros") if awq else ("weight_packed", "weight_scale", "weight_zero_point")
        run = lambda config=None: [w4a16_gemm.w4a16_linear(  # noqa: E731
            x, *(p[name] for name in names), 128, awq, config) for p in stored]
    case = f"M={tokens} N={out_features} K={in_features}"
    # Decode sizes, and FP8's prefill tiles (W4A16 prefill dequantizes the weight for the dense GEMM).
    if sweep and (tokens <= 64 or method == "fp8"):
        for config in quantized_gemm_configs(method, tokens):
            try:
                us = time_us(lambda: run(config), graph=True, rep_ms=50) / copies
            except Exception as err:  # noqa: BLE001 - a config that does not compile or fit is skipped
                report.sweeps.append({"kernel": f"{method}_gemm", "case": case, **config, "error": repr(err)[:120]})
                continue
            report.sweeps.append({"kernel": f"{method}_gemm", "case": case, **config, "time_us": us})
    baseline_us = time_us(lambda: [x @ w.t() for w in weight_bf16], graph=True) / copies
    us = time_us(run, graph=True) / copies
    extra = {}
    if method == "fp8" and fp8_gemm.cublas_block_scaled_available(torch.cuda.current_device()):
        # Both FP8 paths on the same shape: the one fp8_linear picks, and the other (Triton tiles or cuBLASLt).
        cublas = fp8_gemm.uses_cublas(tokens, weight, scale_inv, (128, 128))
        other = (lambda: run({})) if cublas else (  # noqa: E731
            lambda: [fp8_gemm.cublas_fp8_linear(x, w, s) for w, s in stored])
        extra = {"backend": "cublaslt" if cublas else "triton",
                 "triton_us" if cublas else "cublaslt_us": time_us(other, graph=True) / copies}
    if method == "fp8" and tokens < fp8_gemm.CUBLAS_MIN_TOKENS:
        # The engine's decode path: the norm or SwiGLU before the projection wrote its input quantized, so the GEMM
        # is the product's only launch (`time_us`); with a quantization launch of its own (a projection whose
        # input no such kernel writes) beside it, and the producer writing 16 bits alone and with the e4m3 copy.
        with_quantize_us = us
        quantized = fp8_gemm.Fp8Activations(x, 128)
        quantized.by_row()
        us = time_us(lambda: [fp8_gemm.fp8_linear(x, w, s, (128, 128), activations=quantized)
                              for w, s in stored], graph=True) / copies
        extra.update(with_quantize_us=with_quantize_us, quantize_us=time_us(
            lambda: fp8_gemm.quantize_activations(x, 128), graph=True), tma=fp8_gemm.uses_tma(weight, (128, 128)),
            **fp8_producer_us(tokens, out_features, in_features))
    if method == "w4a16" and 1 < tokens <= w4a16_gemm.GEMV_MAX_TOKENS:
        # A small batch on the CUDA cores, and the tensor-core tiles of the next class on the same product.
        tiles = w4a16_gemm.w4a16_gemm_config(w4a16_gemm.GEMV_MAX_TOKENS + 1, False, out_features)
        extra = {"backend": "cuda-cores", "tiles_us": time_us(lambda: run(tiles), graph=True) / copies}
    if method != "fp8" and tokens >= w4a16_gemm.DEQUANTIZE_MIN_TOKENS:
        # The tile kernel on the same prefill-sized product, and the dequantization alone.
        extra = {"backend": "dequantize+dense",
                 "tiles_us": time_us(lambda: run({"dequantize": False}), graph=True) / copies,
                 "dequantize_us": time_us(lambda: [w4a16_gemm.dequantize(
                     *(p[name] for name in names), 128, awq, in_features, torch.bfloat16) for p in stored],
                     graph=True) / copies}
    flops = 2 * tokens * out_features * in_features
    report.add(f"{method}_gemm", case, us, flops=flops,
               bytes_moved=stored_bytes + x.nbytes + tokens * out_features * 2, baseline="torch bf16 matmul",
               baseline_us=baseline_us, **extra)


def fp8_producer_us(tokens: int, out_features: int, in_features: int) -> dict:
    """The kernel that writes an FP8 projection's input in the engine, timed writing 16 bits alone and with the
    e4m3 copy the GEMM reads: SwiGLU for a down projection's input (K wider than N), the residual add and RMSNorm
    for the MLP's gate|up (N wider than K)."""
    from hybridkv.kernels import elementwise

    swiglu = in_features > out_features
    gen = torch.Generator().manual_seed(tokens)
    if swiglu:
        merged = torch.randn(tokens, 2 * in_features, generator=gen).to(DEVICE, torch.bfloat16)
        produce = lambda group: elementwise.silu_and_mul(merged, group)  # noqa: E731
    else:
        x, residual = (torch.randn(tokens, in_features, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
        weight = torch.randn(in_features, generator=gen).to(DEVICE, torch.bfloat16) * 0.1
        produce = lambda group: elementwise.rms_norm(x, weight, 1e-6, residual, group)  # noqa: E731
    return {"producer": "silu_and_mul" if swiglu else "rms_norm",
            "producer_us": time_us(lambda: produce(None), graph=True),
            "producer_quantizing_us": time_us(lambda: produce(128), graph=True)}


def fused_moe_fp8_bench(report: Report, tokens: int):
    fused_moe_bench(report, tokens, e4m3=True)


def fp8_gemm_bench(report: Report, tokens: int, *shape: int, sweep: bool = False):
    quantized_gemm_bench(report, "fp8", tokens, *shape, sweep=sweep)


def gemv_launches() -> list:
    """The launch configurations the --sweep tries for the one-token GEMV."""
    from hybridkv.kernels import gemv

    configs = [gemv.GemvLaunch(block_n=n, block_k=k, num_warps=4, programs_per_sm=4)
               for n, k in itertools.product((2, 4, 8, 16), (256, 512, 1024, 2048))]
    configs += [gemv.GemvLaunch(block_n=8, block_k=256, num_warps=w, programs_per_sm=4) for w in (2, 8)]
    configs += [gemv.GemvLaunch(block_n=8, block_k=256, num_warps=4, programs_per_sm=p) for p in (2, 8)]
    return configs


def sweep_gemv_launches(report: Report, kernel: str, case: str, launched, weights: list) -> None:
    """Time `launched(weight, launch)` over the rotated `weights` under each of `gemv_launches()` into
    `report.sweeps`; a configuration that does not compile or fit is recorded with its error and skipped."""
    for launch in gemv_launches():
        config = {"block_n": launch.block_n, "block_k": launch.block_k, "num_warps": launch.num_warps,
                  "programs_per_sm": launch.programs_per_sm}
        try:
            swept = time_us(lambda: [launched(w, launch) for w in weights], graph=True, rep_ms=50) / len(weights)
        except Exception as err:  # noqa: BLE001 - a configuration that does not compile or fit is skipped
            report.sweeps.append({"kernel": kernel, "case": case, **config, "error": repr(err)[:120]})
            continue
        report.sweeps.append({"kernel": kernel, "case": case, **config, "time_us": swept})


# One-token projections of Qwen3.5-0.8B, 4B and 35B-A3B (N x K, from the models' weights) and 0.8B's tied LM head.
GEMV_SHAPES = ((8224, 1024), (1024, 2048), (7168, 1024), (1024, 3584), (5120, 1024), (12352, 2560), (2560, 4096),
               (18432, 2560), (2560, 9216), (10240, 2560), (12352, 2048), (2048, 4096), (257, 2048),
               (9216, 2048), (248320, 1024))
# The ones swept with --sweep: 0.8B's (the small models' fixed cost per step), the MoE router, and 4B's and
# 35B-A3B's GDN in-projections and 4B's output and down projections.
GEMV_SWEPT = frozenset(((8224, 1024), (1024, 2048), (7168, 1024), (1024, 3584), (5120, 1024), (257, 2048),
                        (12352, 2560), (12352, 2048), (2560, 4096), (2560, 9216)))


def gemv_bench(report: Report, out_features: int, in_features: int, sweep: bool = False):
    """`kernels.linear` at one token (the GEMV from `GEMV_MIN_OUT_FEATURES` to `GEMV_MAX_OUT_FEATURES` outputs) against
    torch's bf16 matmul (cuBLAS) on the same weights, which rotate through enough copies to be read from memory."""
    from hybridkv import kernels
    from hybridkv.kernels import gemv

    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    dense = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(torch.bfloat16)
    x = torch.randn(1, in_features, generator=gen).to(DEVICE, torch.bfloat16)
    copies = max(1, math.ceil(ROTATION_BYTES / (dense.numel() * 2)))
    weights = [dense.to(DEVICE) for _ in range(copies)]
    case = f"M=1 N={out_features} K={in_features}"
    if sweep and (out_features, in_features) in GEMV_SWEPT:
        sweep_gemv_launches(report, "gemv", case, lambda w, launch: gemv.gemv(x, w, launch), weights)
    baseline_us = time_us(lambda: [x @ w.t() for w in weights], graph=True) / copies
    us = time_us(lambda: [kernels.linear(x, w) for w in weights], graph=True) / copies
    report.add("gemv", case, us, bytes_moved=dense.numel() * 2 + (in_features + out_features) * 2,
               baseline="torch bf16 matmul (cuBLAS)", baseline_us=baseline_us,
               gemv=kernels.GEMV_MIN_OUT_FEATURES <= out_features <= kernels.GEMV_MAX_OUT_FEATURES)


# One token's projections that read their input's activation inside the GEMV (`kernels.gemv.Prologue`), at the 0.8B's
# and 4B's sizes: (prologue, heads, head dim, output features); the MLP's SwiGLU is one "head" of the whole width.
GEMV_PROLOGUE_CASES = (("swiglu", 1, 3584, 1024), ("swiglu", 1, 9216, 2560), ("gated_norm", 16, 128, 1024),
                       ("gated_norm", 32, 128, 2560), ("sigmoid_gate", 8, 256, 1024), ("sigmoid_gate", 16, 256, 2560))


def gemv_prologue_bench(report: Report, prologue: str, heads: int, head_dim: int, out_features: int,
                        sweep: bool = False):
    """One token's activation read inside the projection's GEMV (`kernels.swiglu_linear`, `gated_norm_linear`,
    `sigmoid_gated_linear`) against the two launches it replaces (the activation's kernel, then `kernels.linear`),
    on weights rotated through enough copies to be read from memory; `sweep` also times the fused GEMV under each
    of `gemv_launches()`."""
    from hybridkv import kernels
    from hybridkv.kernels import gemv

    width = heads * head_dim
    gen = torch.Generator().manual_seed(out_features * 11 + width)
    dense = (torch.randn(out_features, width, generator=gen) / width**0.5).to(torch.bfloat16)
    copies = max(1, math.ceil(ROTATION_BYTES / (dense.numel() * 2)))
    weights = [dense.to(DEVICE) for _ in range(copies)]

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, torch.bfloat16)

    if prologue == "swiglu":
        gate_up = draw(1, 2 * width)
        fused = lambda w: kernels.swiglu_linear(gate_up, w)  # noqa: E731
        launched = lambda w, launch: gemv.swiglu_gemv(gate_up, w, launch)  # noqa: E731
        separate = lambda w: kernels.linear(kernels.silu_and_mul(gate_up), w)  # noqa: E731
        input_bytes = gate_up.numel() * 2
    else:
        core = draw(1, heads, head_dim)
        gate = draw(1, heads, 2 * head_dim)[..., head_dim:]  # strided, as the merged projections hand it over
        input_bytes = 2 * core.numel() * 2
        if prologue == "gated_norm":
            norm_weight = draw(head_dim)
            fused = lambda w: kernels.gated_norm_linear(core, gate, norm_weight, 1e-6, w)  # noqa: E731
            launched = lambda w, launch: gemv.gated_norm_gemv(core, gate, norm_weight, 1e-6, w, launch)  # noqa: E731
            separate = lambda w: kernels.linear(  # noqa: E731
                kernels.gated_rms_norm(core, gate, norm_weight, 1e-6).reshape(1, -1), w)
        else:
            fused = lambda w: kernels.sigmoid_gated_linear(core, gate, w)  # noqa: E731
            launched = lambda w, launch: gemv.sigmoid_gated_gemv(core, gate, w, launch)  # noqa: E731
            separate = lambda w: kernels.linear((core * torch.sigmoid(gate)).reshape(1, -1), w)  # noqa: E731
    case = f"{prologue} M=1 N={out_features} K={width}"
    if sweep:
        sweep_gemv_launches(report, "gemv_prologue", case, launched, weights)
    baseline_us = time_us(lambda: [separate(w) for w in weights], graph=True) / copies
    us = time_us(lambda: [fused(w) for w in weights], graph=True) / copies
    report.add("gemv_prologue", case, us,
               bytes_moved=dense.numel() * 2 + input_bytes + out_features * 2,
               baseline="the activation's launch, then the GEMV", baseline_us=baseline_us)


# A layer norm and the projection after it (an MLP: its gate/up, then its down projection reading SwiGLU), at the
# 0.8B's and 4B's sizes: (name, hidden size, the projection's weights N x K).
NORM_PREFETCH_CASES = (("0.8B GDN in", 1024, ((8224, 1024),)), ("0.8B MLP", 1024, ((7168, 1024), (1024, 3584))),
                       ("4B GDN in", 2560, ((12352, 2560),)), ("4B attention qkv", 2560, ((10240, 2560),)),
                       ("4B MLP", 2560, ((18432, 2560), (2560, 9216))))


def prefetch_limits_swept(multiprocessors: int) -> list:
    """The prefetch limits the --sweep tries: the first 2 to 16 MiB of every tensor over one or two programs per
    multiprocessor, with no size floor."""
    from hybridkv.kernels.triton_utils import PrefetchLimits

    return [PrefetchLimits(min_bytes=0, max_bytes=mib << 20, programs=per_sm * multiprocessors)
            for mib, per_sm in itertools.product((2, 4, 8, 16), (1, 2))]


def norm_prefetch_bench(report: Report, name: str, hidden: int, shapes: tuple, batch: int = 1,
                        sweep: bool = False):
    """A chain of [layer norm -> projection] links, each link with weights of its own (rotated past the L2), the
    norm asking the L2 for the head of its projection's weights (`triton_utils.l2_prefetch_plan`, the engine's
    limits) against the same chain without that; `sweep` also times the chain under `prefetch_limits_swept()`."""
    from hybridkv import kernels
    from hybridkv.kernels import elementwise, triton_utils

    gen = torch.Generator().manual_seed(hidden * 13 + len(shapes))
    link = [(torch.randn(*shape, generator=gen) / shape[1] ** 0.5).to(torch.bfloat16) for shape in shapes]
    link_bytes = sum(w.numel() * 2 for w in link)
    links = [[w.to(DEVICE) for w in link] for _ in range(max(1, math.ceil(ROTATION_BYTES / link_bytes)))]
    x = torch.randn(batch, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    residual = torch.randn(batch, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    norm_weight = (torch.randn(hidden, generator=gen) * 0.1).to(DEVICE, torch.bfloat16)
    no_prefetch = triton_utils.PrefetchLimits(max_rows=-1)

    def chain(limits):
        for weights in links:
            normed, _ = elementwise.rms_norm(x, norm_weight, 1e-6, residual, prefetch=weights, prefetch_limits=limits)
            out = kernels.linear(normed, weights[0])
            if len(weights) > 1:
                kernels.swiglu_linear(out, weights[1])

    case = f"{name} M={batch}"
    if sweep:
        for limits in prefetch_limits_swept(triton_utils.device_limits(x.device)[0]):
            swept = time_us(lambda: chain(limits), graph=True, rep_ms=50) / len(links)
            report.sweeps.append({"kernel": "norm_prefetch", "case": case, "max_bytes": limits.max_bytes,
                                  "programs": limits.programs, "time_us": swept})
    baseline_us = time_us(lambda: chain(no_prefetch), graph=True) / len(links)
    us = time_us(lambda: chain(triton_utils.DEFAULT_PREFETCH_LIMITS), graph=True) / len(links)
    prefetched = triton_utils.l2_prefetch_plan(links[0], batch, 32, x.device) is not None
    report.add("norm_prefetch", case, us, bytes_moved=link_bytes + 4 * batch * hidden * 2,
               baseline="the norm without prefetches", baseline_us=baseline_us, prefetched=prefetched)


def w4a16_gemm_bench(report: Report, tokens: int, *shape: int, sweep: bool = False):
    quantized_gemm_bench(report, "w4a16", tokens, *shape, sweep=sweep)


def awq_gemm_bench(report: Report, tokens: int, *shape: int, sweep: bool = False):
    quantized_gemm_bench(report, "awq", tokens, *shape, sweep=sweep)


# --only names -> the benchmark functions they select.
BENCHES = {
    "gdn_decode": gdn_decode_bench,
    "gdn_prefill": gdn_prefill_bench,
    "conv_decode": conv_decode_bench,
    "paged_decode": attention_decode_bench,
    "paged_decode_captured": attention_captured_bench,
    "paged_decode_fp8": fp8_decode_bench,
    "paged_prefill": attention_prefill_bench,
    "paged_mixed": attention_mixed_bench,
    "write_kv_cache": write_kv_bench,
    "fp8_gemm": fp8_gemm_bench,
    "w4a16_gemm": w4a16_gemm_bench,
    "awq_gemm": awq_gemm_bench,
    "fused_moe": fused_moe_bench,
    "fused_moe_fp8": fused_moe_fp8_bench,
    "gemv": gemv_bench,
    "gemv_prologue": gemv_prologue_bench,
    "norm_prefetch": norm_prefetch_bench,
}


def run_case(report: Report, bench, *args, only: frozenset = frozenset(BENCHES), **kwargs) -> None:
    """One benchmark case, if its kernel is among `only`; a failure is recorded and printed, and the other cases
    still run."""
    if bench not in {BENCHES[name] for name in only}:
        return
    try:
        bench(report, *args, **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure of one case is reported, not fatal
        traceback.print_exc()
        report.rows.append({"kernel": bench.__name__, "case": repr(args)[:80], "error": repr(err)[:300]})
        report.save()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=f"bench/results/kernels-{datetime.date.today().isoformat()}.json")
    parser.add_argument("--sweep", action="store_true", help="also time the launch-configuration sweeps")
    parser.add_argument("--sweep-tokens", default="1,16,64",
                        help="token counts at which the quantized GEMMs and the fused MoE are swept (comma-separated; "
                             "default %(default)s)")
    parser.add_argument("--fused-moe-tokens", default=",".join(map(str, FUSED_MOE_TOKENS)),
                        help="token counts of the fused MoE rows (comma-separated; default %(default)s)")
    parser.add_argument("--only", default=",".join(BENCHES),
                        help=f"comma-separated kernels to time (a full run takes more than one 10-minute device "
                             f"call): {', '.join(BENCHES)}")
    args = parser.parse_args(argv)
    only = frozenset(name.strip() for name in args.only.split(",") if name.strip())
    if not only or only - set(BENCHES):
        parser.error(f"--only takes kernels from {', '.join(BENCHES)}; got {args.only!r}")
    try:
        sweep_tokens = {int(t) for t in args.sweep_tokens.split(",") if t.strip()}
    except ValueError:
        parser.error(f"--sweep-tokens takes comma-separated token counts; got {args.sweep_tokens!r}")
    try:
        moe_tokens = [int(t) for t in args.fused_moe_tokens.split(",") if t.strip()]
    except ValueError:
        moe_tokens = []
    if not moe_tokens or min(moe_tokens) < 1:
        parser.error(f"--fused-moe-tokens takes comma-separated positive token counts; got {args.fused_moe_tokens!r}")
    if not torch.cuda.is_available():
        print("bench/kernel_speed.py needs a CUDA GPU", file=sys.stderr)
        return 2
    sweep = args.sweep
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    report = Report(ceilings(), args.out)
    print(json.dumps({"ceilings": report.ceiling}), flush=True)
    g32 = GdnGeometry(num_k_heads=16, num_v_heads=32)
    g48 = GdnGeometry(num_k_heads=16, num_v_heads=48)
    a16 = AttentionGeometry(num_q_heads=16, num_kv_heads=4)
    # The cases the targets name come first, so a run cut short still has them.
    for gemm in (fp8_gemm_bench, w4a16_gemm_bench):
        for tokens in (1, 2, 4, 16, 64, 128, 4096, 8192):
            run_case(report, gemm, tokens, sweep=sweep and tokens in sweep_tokens, only=only)
        for tokens in (1, 2, 4, 16, 64, 4096):  # the down projection: few output tiles, a long K
            run_case(report, gemm, tokens, 5120, 17408, sweep=sweep and tokens in sweep_tokens, only=only)
    for gemm in (fp8_gemm_bench, w4a16_gemm_bench):
        # Qwen3.5-9B's MLP at decode sizes: gate|up fused, and a down projection of 56% of 27B's bytes (fixed costs
        # weigh more).
        for shape in ((24576, 4096), (4096, 12288)):
            for tokens in (1, 2, 4, 16, 64):
                run_case(report, gemm, tokens, *shape, sweep=False, only=only)
    for shape in ((), (5120, 17408)):  # AWQ checkpoints at one token (the layout most 4-bit deployments use)
        run_case(report, awq_gemm_bench, 1, *shape, sweep=sweep and 1 in sweep_tokens, only=only)
    for batch in (1, 64, 1024):
        run_case(report, gdn_decode_bench, g32, batch, torch.float32, sweep=sweep, only=only)
    # Short contexts at small batches too: the sizing rule keeps a segment at least four tiles of keys, and there the
    # launch captured for a long max_model_len, split finer, ran twice as fast (docs/performance.md, 2026-12-07); and
    # batch 16 at long contexts, where a cap of two programs a multiprocessor would split less than the rule does.
    for batch, context in ((64, 4096), (1, 32768), (1, 576), (16, 576), (1, 2048), (16, 32768), (16, 8192)):
        run_case(report, attention_decode_bench, a16, batch, context, sweep=sweep, only=only)
    run_case(report, gdn_prefill_bench, g32, [32768], sweep=sweep, only=only)
    run_case(report, gdn_prefill_bench, g32, [4096] * 8, sweep=sweep, only=only)
    run_case(report, attention_prefill_bench, a16, 8192, 8192, sweep=sweep, only=only)
    run_case(report, gdn_decode_bench, g32, 256, torch.float32, sweep=False, only=only)
    run_case(report, gdn_decode_bench, g48, 64, torch.float32, sweep=False, only=only)
    run_case(report, gdn_decode_bench, g32, 64, torch.bfloat16, sweep=False, only=only)
    for batch, context in ((256, 1024), (1024, 512)):
        run_case(report, attention_decode_bench, a16, batch, context, sweep=False, only=only)
    # A short context in graphs captured for the throughput bench's, the serving bench's and a long max_model_len:
    # the 4B's attention and the 0.8B's (8 query heads on 2 KV heads).
    for geo in (a16, AttentionGeometry(num_q_heads=8, num_kv_heads=2)):
        for batch in (1, 16):
            for max_model_len in (4096, 8192, 262144):
                run_case(report, attention_captured_bench, geo, batch, 576, max_model_len, only=only)
    for geo, lengths in ((g48, [32768]), (g32, [2048] * 4)):
        run_case(report, gdn_prefill_bench, geo, lengths, sweep=sweep, only=only)
    for batch in (64, 1024):
        run_case(report, conv_decode_bench, g32, batch, only=only)
    run_case(report, attention_prefill_bench, a16, 8192, 2048, sweep=False, only=only)
    # Mixed steps: decode rows beside a prompt's later chunk (long contexts) or its first.
    for decodes, q_len, context in ((64, 256, 6400), (256, 640, 16000), (256, 640, 1024), (16, 256, 2048),
                                    (64, 2048, 2048)):
        run_case(report, attention_mixed_bench, a16, decodes, 1024, q_len, context, sweep=sweep, only=only)
    run_case(report, write_kv_bench, a16, 8192, only=only)
    for batch, context in ((1, 32768), (16, 32768), (64, 4096), (256, 1024)):
        run_case(report, fp8_decode_bench, a16, batch, context, only=only)
    # Targets: >= 70% of copy bandwidth on the expert bytes read at decode, >= 50% of the bf16 matmul at prefill.
    for tokens in moe_tokens:
        run_case(report, fused_moe_bench, tokens, sweep=sweep and tokens in sweep_tokens, only=only)
    for tokens in (1, 16, 64, 256, 4096):
        run_case(report, fused_moe_fp8_bench, tokens, only=only)
    for shape in GEMV_SHAPES:
        run_case(report, gemv_bench, *shape, sweep=sweep, only=only)
    for case in GEMV_PROLOGUE_CASES:
        run_case(report, gemv_prologue_bench, *case, sweep=sweep, only=only)
    for case in NORM_PREFETCH_CASES:
        for batch in (1, 16):
            run_case(report, norm_prefetch_bench, *case, batch, sweep=sweep and batch == 1, only=only)

    report.save()
    for name in ("gdn_decode", "gdn_prefill_inputs", "gdn_chunk_states", "gdn_folded_chunk_states", "paged_decode",
                 "paged_prefill", "paged_mixed", "fp8_gemm", "w4a16_gemm", "awq_gemm", "fused_moe", "gemv",
                 "gemv_prologue", "norm_prefetch"):
        best = {}
        for s in report.sweeps:
            if s["kernel"] == name and "time_us" in s and (s["case"] not in best or s["time_us"] <
                                                           best[s["case"]]["time_us"]):
                best[s["case"]] = s
        for case, s in best.items():
            print(f"best {name} {case}: {json.dumps(s)}")
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
